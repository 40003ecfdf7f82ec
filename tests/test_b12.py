"""B12 (specpilot/formats/b12.py): bit-exact round trips over any bf16 bit pattern and shape, the format's
size on realistic weights, and clear errors for what it cannot hold."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.formats.b12 import B12Error, B12Tensor, decode, encode


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@st.composite
def bit_patterns(draw, max_weights: int = 256) -> torch.Tensor:
    """Any 16-bit patterns as a bf16 matrix (inf, NaN, ±0 and subnormals included) small enough that one
    escape segment holds them all."""
    n = draw(st.integers(1, 16))
    k = draw(st.integers(1, max(1, max_weights // n)))
    values = draw(st.lists(st.integers(-(2**15), 2**15 - 1), min_size=n * k, max_size=n * k))
    return torch.tensor(values, dtype=torch.int16).view(n, k).view(torch.bfloat16)


@settings(max_examples=200, deadline=None)
@given(bit_patterns())
def test_any_bit_pattern_round_trips_exactly(t):
    assert torch.equal(_bits(decode(encode(t))), _bits(t))


@st.composite
def weights(draw) -> torch.Tensor:
    """Weight-like matrices of many shapes (K across block edges): Gaussian or heavy-tailed rows of varied
    scale, with special values sprinkled in."""
    n, k = draw(st.integers(1, 70)), draw(st.integers(1, 700))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    heavy = draw(st.booleans())
    x = torch.distributions.StudentT(3.0).sample((n, k)) if heavy else torch.randn(n, k, generator=g)
    x = x * torch.exp(torch.randn(n, 1, generator=g)) * 0.02
    t = x.to(torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 6e4],
                            dtype=torch.bfloat16)
    picks = torch.randint(0, n * k, (draw(st.integers(0, 8)),), generator=g)
    t.view(-1)[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    return t


@settings(max_examples=60, deadline=None)
@given(weights())
def test_weights_round_trip_in_about_twelve_bits(t):
    b = encode(t)
    assert torch.equal(_bits(decode(b)), _bits(t))
    if t.numel() >= 16384:  # bytes a row and a row's block, words a segment, over 16k weights: under half a bit
        assert b.stats()["bits_per_weight"] < 12.5


def test_planes_survive_a_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    t = (torch.randn(40, 300) * 0.02).to(torch.bfloat16)
    t[3, 7] = float("nan")
    save_file(encode(t).tensors("w"), tmp_path / "w.safetensors")
    loaded = B12Tensor.from_tensors(load_file(tmp_path / "w.safetensors"), "w")
    assert torch.equal(_bits(decode(loaded)), _bits(t))
    with pytest.raises(B12Error, match="w2: B12 plane 'w2.b12_shape' is missing"):
        B12Tensor.from_tensors({}, "w2")


def test_a_checkpoint_of_another_b12_layout_is_refused():
    """The note's version names the planes' layout: an older one is refused, never misread."""
    from specpilot.formats.b12 import FORMAT_VERSION
    from specpilot.formats.checkpoint import FORMAT_KEY, format_note

    assert format_note({FORMAT_KEY: {"format": "b12", "version": FORMAT_VERSION}})["version"] == FORMAT_VERSION
    with pytest.raises(ValueError, match=f"reads b12 version {FORMAT_VERSION}; convert the bf16 checkpoint again"):
        format_note({FORMAT_KEY: {"format": "b12", "version": FORMAT_VERSION - 1, "tensors": []}})


def test_what_b12_cannot_hold_is_named():
    with pytest.raises(B12Error, match="q_proj: torch.float32 values bf16 cannot hold exactly"):
        encode(torch.tensor([[0.1, 0.2]]), "q_proj")
    assert torch.equal(_bits(decode(encode(torch.tensor([[0.5, -2.0, float("nan")]]), "exact"))),
                       _bits(torch.tensor([[0.5, -2.0, float("nan")]]).to(torch.bfloat16)))
    with pytest.raises(B12Error, match="norm: B12 stores matrices"):
        encode(torch.ones(4, dtype=torch.bfloat16), "norm")
    wild = torch.randint(-(2**15), 2**15, (16, 256), dtype=torch.int16).view(torch.bfloat16)
    with pytest.raises(B12Error, match="wild: .* fall outside their rows' exponent windows"):
        encode(wild, "wild")


def _bf16_model_dir(tmp_path):
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "tiny")
    weights = load_file(path / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, path / "model.safetensors")
    return path


def test_convert_writes_a_checkpoint_that_loads_and_generates_the_same(tmp_path, capsys):
    from specpilot.cli import main
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig
    from specpilot.formats.checkpoint import FORMAT_KEY
    from specpilot.models.checkpoint import load_checkpoint

    src = _bf16_model_dir(tmp_path)
    out = tmp_path / "b12"
    assert main(["convert", "--format", "b12", "--model-path", str(src), "--out", str(out)]) == 0
    assert "matrices as B12" in capsys.readouterr().out
    note = json.loads((out / "config.json").read_text())[FORMAT_KEY]
    assert note["format"] == "b12" and note["tensors"] and 12.0 < note["bits_per_weight"] < 14.0
    assert (out / "tokenizer.json").is_file()
    plain, b12 = load_checkpoint(src, torch.bfloat16), load_checkpoint(out, torch.bfloat16)
    assert plain.state_dict.keys() == b12.state_dict.keys()
    for name, t in plain.state_dict.items():
        assert torch.equal(t.view(torch.int16), b12.state_dict[name].view(torch.int16)), name
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = [Engine.from_config(EngineConfig(model_path=str(p), device="cpu", max_running_requests=1,
                                               context_length=64)).generate([prompt], params)[0].output_ids
               for p in (src, out)]
    assert outputs[0] == outputs[1]


def test_convert_names_what_it_cannot_hold(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from specpilot.cli import main

    src = _bf16_model_dir(tmp_path / "one-fp32")
    weights = load_file(src / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name].float() + 1e-3  # values bf16 cannot hold
    save_file(weights, src / "model.safetensors")
    with pytest.raises(SystemExit):
        main(["convert", "--format", "b12", "--model-path", str(src), "--out", str(tmp_path / "out")])
    assert f"{name}: torch.float32 values bf16 cannot hold exactly" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written
    b12 = tmp_path / "b12"
    main(["convert", "--format", "b12", "--model-path", str(_bf16_model_dir(tmp_path)), "--out", str(b12)])
    with pytest.raises(SystemExit):
        main(["convert", "--format", "b12", "--model-path", str(b12), "--out", str(tmp_path / "again")])
    assert "is a B12 checkpoint already" in capsys.readouterr().err


def test_b12_linear_gives_the_bf16_products_and_moves_with_the_module():
    from specpilot.models.linear import Linear, to_b12, weight_bytes

    g = torch.Generator().manual_seed(3)
    lin = Linear(300, 40, bias=True)
    lin.weight.data = (torch.randn(40, 300, generator=g) * 0.05).to(torch.bfloat16)
    lin.bias.data = torch.randn(40, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 5, 300, generator=g).to(torch.bfloat16)
    expected = lin(x)
    report = to_b12(lin)
    assert report["converted"] == 1 and lin.weight is None and lin.b12 is not None
    assert report["bytes_before"] == 40 * 300 * 2 + 40 * 2
    assert report["bytes_after"] == weight_bytes(lin) < 0.8 * report["bytes_before"]
    assert torch.equal(lin(x).view(torch.int16), expected.view(torch.int16))
    assert "b12" in repr(lin)
    lin.to(torch.device("meta"))
    assert lin.b12.sm.device.type == "meta"


def test_b12_keeps_a_tied_weight_and_leaves_other_dtypes():
    from specpilot.models.linear import Linear, to_b12
    from torch import nn

    tied = nn.Module()
    tied.embed = nn.Embedding(64, 32, dtype=torch.bfloat16)
    tied.head = Linear(32, 64)
    tied.head.weight = tied.embed.weight
    fp32 = Linear(32, 8)
    fp32.weight.data = torch.randn(8, 32)
    assert to_b12(tied)["converted"] == 1 and tied.head.weight is tied.embed.weight and tied.head.b12 is not None
    assert to_b12(fp32) == {"converted": 0, "kept_bf16": 1, "bytes_before": 8 * 32 * 4, "bytes_after": 8 * 32 * 4}


def test_a_b12_checkpoint_runs_as_b12_in_bf16(tmp_path):
    from specpilot.cli import main
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig

    src, out = _bf16_model_dir(tmp_path), tmp_path / "b12"
    assert main(["convert", "--format", "b12", "--model-path", str(src), "--out", str(out)]) == 0
    config = EngineConfig(device="cpu", dtype="bfloat16", max_running_requests=2, context_length=64)
    plain = Engine.from_config(replace(config, model_path=str(src)))
    asked = Engine.from_config(replace(config, model_path=str(src), mechanisms=frozenset({"b12"})))
    loaded = Engine.from_config(replace(config, model_path=str(out)))
    assert "b12" not in plain.mechanisms and plain.weights_info()["format"] == "bfloat16"
    for engine in (asked, loaded):
        info = engine.weights_info()
        assert "b12" in engine.mechanisms and info["format"] == "b12"
        assert info["dense_bytes"] == plain.weights_info()["bytes"] and info["saved_bytes"] > 0
    prompts, params = [[5, 6, 7, 8, 9], [11, 3]], SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = [r.output_ids for r in plain.generate(prompts, params)]
    for engine in (asked, loaded):
        assert [r.output_ids for r in engine.generate(prompts, params)] == expected
    # float32 weights cannot be B12: the request names why
    with pytest.raises(ValueError, match="--mechanisms: b12 needs bf16 weights"):
        Engine.from_config(replace(config, model_path=str(src), dtype="float32", mechanisms=frozenset({"b12"})))


def test_force_checks_b12_against_the_bf16_weights(tmp_path, capsys):
    """`specpilot force --mechanisms b12`: the reference run keeps bf16 weights of its own (a shared model
    would be B12 on both sides and prove nothing)."""
    from spec_fixtures import write_random_dflash

    from specpilot.cli import main

    src = _bf16_model_dir(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    dflash = write_random_dflash(tmp_path, hidden=cfg["hidden_size"], num_target_layers=cfg["num_hidden_layers"],
                                 mask_token_id=cfg["vocab_size"] - 1)
    assert main(["force", "--model-path", str(src), "--device", "cpu", "--dtype", "bfloat16",
                 "--speculative-algorithm", "dflash", "--speculative-draft-model-path", str(dflash),
                 "--mechanisms", "b12,device-acceptance", "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
