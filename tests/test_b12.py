"""B12 (specpilot/formats/b12.py): bit-exact round trips over any bf16 bit pattern and shape, the format's
size on realistic weights, and clear errors for what it cannot hold."""

from __future__ import annotations

import json

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
    if t.numel() >= 4096:  # a row byte and a segment word a few thousand weights: well under half a bit
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
