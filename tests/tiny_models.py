"""Tiny random Hugging Face models (and GGUF exports of them) shared by the tests."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# Chosen so that with head_dim 16 and theta 10000 three RoPE frequencies fall in the smoothed band.
TINY_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 16.0,
    "original_max_position_embeddings": 8192,
}

_CONFIG_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def tiny_hf_config(arch: str, tied: bool = False) -> transformers.PretrainedConfig:
    config_cls, _ = _CONFIG_CLASSES[arch]
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2 if arch == "llama" else 3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    if arch == "llama":
        kwargs["rope_scaling"] = dict(TINY_LLAMA3_ROPE, rope_theta=10000.0)
    else:
        kwargs["rope_theta"] = 1_000_000.0
    return config_cls(**kwargs)


def tiny_hf_model(arch: str, tied: bool = False, seed: int = 0, vocab_size: int | None = None) -> transformers.PreTrainedModel:
    """Random float32 model in eval mode; norms and biases are randomised too so that mix-ups show."""
    _, model_cls = _CONFIG_CLASSES[arch]
    torch.manual_seed(seed)
    config = tiny_hf_config(arch, tied)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    # The row permutation llama.cpp's converter applies to llama q/k weights and biases.
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def _gguf_tensor_name(hf_name: str) -> str | None:
    renames = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in renames:
        return renames[hf_name]
    layer_renames = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_renames[module]}.{kind}"


def save_tiny_gguf(model: transformers.PreTrainedModel, path: pathlib.Path) -> pathlib.Path:
    """Write `model` as an F32 GGUF laid out the way llama.cpp's converter would (no tokenizer)."""
    cfg = model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if hasattr(cfg, "head_dim"):  # Qwen2 configs have none; the loader must derive it
        writer.add_key_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = _llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = _llama_cpp_permute(values, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_tensor_name(name), np.ascontiguousarray(values))
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp stores Llama-3.1 scaling as per-frequency divisors of the default inv_freq.
        default_inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        )
        scaled_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        writer.add_tensor("rope_freqs.weight", (default_inv_freq / scaled_inv_freq.double()).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def make_tiny_model_dir(path: pathlib.Path, spelled: bool = False) -> pathlib.Path:
    """Random tiny Llama plus a word-level tokenizer ("w0".."w319", eos w2) with a Jinja chat template.

    Every English word is "w0" to that tokenizer, so all prompts of a dataset look alike and get one answer.
    `spelled`: ids 6..99 are instead the printable characters (but space), which text is spelled out in, so each prompt
    gets its own answer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_hf_model("llama").save_pretrained(path)
    vocab = {f"w{i}": i for i in range(320)}
    if spelled:
        for code in range(33, 127):
            del vocab[f"w{code - 27}"]
            vocab[chr(code)] = code - 27
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if spelled:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split(Regex("w[0-9]+|."), "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path
