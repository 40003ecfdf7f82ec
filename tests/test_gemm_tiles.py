"""Tuned GEMM tiles (kernels/gemm_tiles.py, engine/gemm_tiles.py): the table's buckets, file and lookups; the
tuner's choice (never a tile whose bits differ, never one within the noise of the untuned tiles); an engine
without CUDA keeps the untuned tiles; warming an eager engine covers the tuned tiles' variants; on CUDA a
tuned table's products are bitwise the untuned ones'."""

from __future__ import annotations

import json

import pytest
import torch
from triton_launches import LaunchRecorder

from specpilot.cli import build_parser, engine_config_from_args, main
from specpilot.engine.gemm_tiles import load_tile_table, save_tile_table, tile_table_path
from specpilot.kernels import skinny_gemm as sg
from specpilot.kernels.gemm_tiles import (
    BUCKETS,
    CANDIDATES,
    MIN_GAIN,
    VERIFY_BUCKETS,
    VERIFY_CANDIDATES,
    TileTable,
    bucket,
    candidates_for,
    pick_fastest,
)
from specpilot.kernels.skinny_gemm import SkinnyConfig, invariant_config
from specpilot.models.linear import Linear, set_tile_table

SMALL = (SkinnyConfig(block_n=16, block_k=128, split_k=1, num_warps=2, num_stages=8), None)
NARROW = (SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=8), None)
WIDE = (SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4), 64)  # a verify pass's


def table() -> TileTable:
    t = TileTable("NVIDIA H100 80GB HBM3")
    t.entries[("b12", 4096, 4096, 1)] = SMALL
    t.entries[("b12", 4096, 4096, 16)] = NARROW
    t.entries[("bf16", 96, 1024, 64)] = SMALL
    t.entries[("bf16", 96, 1024, 256)] = WIDE
    t.timings[("b12", 4096, 4096, 1)] = {"us": 19.2, "untuned_us": 26.0}
    return t


def test_rows_take_the_smallest_bucket_that_holds_them():
    assert [bucket(m) for m in (1, 2, 4, 5, 16, 17, 64, 65, 300, 512, 513)] == \
        [1, 4, 4, 16, 16, 64, 64, 128, 384, 512, None]
    assert sg.MAX_M in BUCKETS and BUCKETS[-1] == VERIFY_BUCKETS[-1]
    assert candidates_for(64) == CANDIDATES and candidates_for(65) == VERIFY_CANDIDATES
    assert all(block_m is None for _, block_m in CANDIDATES) and all(block_m for _, block_m in VERIFY_CANDIDATES)
    # every verify bucket's untuned tiles are among its candidates: the tuner weighs its neighbours against them
    assert all(sg.invariant_config(m, n, 4096) in VERIFY_CANDIDATES for m in VERIFY_BUCKETS for n in (4096, 6144, 28672))


def test_a_table_picks_per_kernel_shape_and_bucket_and_leaves_the_rest_untuned():
    t = table()
    assert t.pick("b12", 4096, 4096, 1) == SMALL
    assert t.pick("b12", 4096, 4096, 3) is None  # bucket 4: not tuned
    assert t.pick("b12", 4096, 4096, 9) == NARROW
    assert t.pick("bf16", 4096, 4096, 1) is None  # another kernel
    assert t.pick("b12", 4096, 4096, 65) is None  # bucket 128: not tuned
    choose = t.chooser("bf16", 96, 1024)
    assert choose(40) == SMALL and choose(200) == WIDE
    assert choose(8) == invariant_config(8, 96, 1024) and choose(300) == invariant_config(300, 96, 1024)
    assert choose(600) == invariant_config(600, 96, 1024)  # past the verify sizes


def test_the_table_round_trips_through_its_file(tmp_path):
    t = table()
    back = TileTable.load(t.save(tmp_path / "t.json"))
    assert back.device == t.device and back.entries == t.entries and back.pick("bf16", 96, 1024, 256) == WIDE
    assert back.timings[("b12", 4096, 4096, 1)] == {"us": 19.2, "untuned_us": 26.0}
    raw = json.loads(t.to_json())
    raw["entries"][0]["m"] = 3
    with pytest.raises(ValueError, match="m one of"):
        TileTable.from_json(json.dumps(raw))


def test_saving_merges_into_the_devices_table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    path = save_tile_table(table())
    assert path == tile_table_path("NVIDIA H100 80GB HBM3") and path.name == "NVIDIA_H100_80GB_HBM3.json"
    new = TileTable("NVIDIA H100 80GB HBM3", {("bf16", 96, 1024, 64): NARROW})
    merged = TileTable.load(save_tile_table(new, TileTable.load(path)))
    assert merged.entries[("bf16", 96, 1024, 64)] == NARROW and merged.entries[("b12", 4096, 4096, 1)] == SMALL


def test_the_tuner_keeps_only_faster_tiles_with_the_same_bits():
    untuned, fast_wrong, fast_right, close = CANDIDATES[4], CANDIDATES[0], CANDIDATES[1], VERIFY_CANDIDATES[2]
    times = {untuned: 10.0, fast_wrong: 5.0, fast_right: 8.0, close: 10.0 * (1 - MIN_GAIN / 2)}
    best, t = pick_fastest(untuned, times, times.__getitem__, lambda c: c != fast_wrong)
    assert best == fast_right and t == {"us": 8.0, "untuned_us": 10.0}
    best, t = pick_fastest(untuned, [close], times.__getitem__, lambda c: True)
    assert best is None and t == {"us": 10.0, "untuned_us": 10.0}  # within the noise: untuned stays

    def failing(config):
        if config == fast_right:
            raise RuntimeError("out of shared memory")
        return times[config]
    assert pick_fastest(untuned, [fast_right, close], failing, lambda c: True)[0] is None


def test_linears_take_the_table_for_their_own_shape():
    linear = Linear(4096, 4096)
    assert linear.tuned("b12", 1) == (None, None)
    set_tile_table(torch.nn.Sequential(linear), table())
    assert linear.tuned("b12", 1) == SMALL and linear.tuned("bf16", 1) == (None, None)


def test_warm_rows_cover_the_tuned_tiles_variants(monkeypatch):
    """An eager engine warms variant_rows(choose=...) of the table; every later product of 1..max rows, launched
    as Linear launches it (the tuned tiles where the table has them), meets only warmed variants."""
    seen: dict[tuple, str] = {}
    phase = ["warm"]
    monkeypatch.setattr(sg, "_skinny_gemm_kernel", LaunchRecorder(seen, phase, "gemm"))
    t, (n, k) = table(), (96, 1024)
    w = torch.zeros(n, k, dtype=torch.bfloat16)

    def product(m: int) -> None:
        config, block_m = t.pick("bf16", n, k, m) or (None, None)
        sg.invariant_gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, config=config, block_m=block_m)
    for m in sg.variant_rows(n, k, 300, True, choose=t.chooser("bf16", n, k)):
        product(m)
    phase[0] = "run"
    for m in range(1, 301):
        product(m)
    assert [key for key, p in seen.items() if p == "run"] == []
    assert any(("BLOCK_N", "16") in key[1][1] for key in seen)  # the tuned 16-row tile was among them
    assert any(("BLOCK_N", "64") in key[1][1] and ("BLOCK_M", "64") in key[1][1] for key in seen)  # and the verify one


def test_an_engine_off_cuda_keeps_the_untuned_tiles(tiny_dir, tmp_path, monkeypatch):
    from specpilot.engine.engine import Engine

    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    assert load_tile_table(torch.device("cpu")) == (None, None)
    args = build_parser().parse_args(["generate", "--model-path", str(tiny_dir), "--prompt", "x", "--device", "cpu"])
    engine = Engine.from_config(engine_config_from_args(args))
    assert engine.config.tuned_tiles and engine.weights_info()["gemm_tiles"] == "untuned"
    off = build_parser().parse_args(["generate", "--model-path", str(tiny_dir), "--prompt", "x",
                                     "--disable-tuned-tiles"])
    assert engine_config_from_args(off).tuned_tiles is False


def test_tuning_without_cuda_is_a_clear_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tune-gemm-tiles", "--model-path", str(tiny_dir), "--device", "cpu"])
    assert exc.value.code == 2 and "--tune-gemm-tiles" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuned_tables_products_are_bitwise_the_untuned_ones_on_cuda(tmp_path, monkeypatch):
    """The tuner on the device (two shapes, both kernels); every entry it keeps gives the untuned tiles' bits
    through Linear at each bucket's row counts, B12 planes and bf16 weights alike."""
    from specpilot.engine.gemm_tiles import tune

    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    shapes = [(1024, 4096), (4096, 1024)]
    tuned = tune(shapes, buckets=(1, 16, 256), candidates=lambda m: candidates_for(m)[:4])
    assert tuned.device == torch.cuda.get_device_name()
    tuned.entries[("bf16", 1024, 4096, 1)] = SMALL  # one entry whatever the timings said, so one always runs
    tuned.entries[("b12", 1024, 4096, 16)] = SMALL
    tuned.entries[("bf16", 4096, 1024, 256)] = WIDE
    g = torch.Generator(device="cuda").manual_seed(3)
    for n, k in shapes:
        for b12 in (False, True):
            linear = Linear(k, n).to("cuda", torch.bfloat16)
            linear.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * 0.02)
            linear.batch_invariant = True
            if b12:
                assert linear.to_b12()
            for m in (1, 3, 16, 200):
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                linear.tiles = None
                untuned = linear(x)
                linear.tiles = tuned
                assert torch.equal(linear(x).view(torch.int16), untuned.view(torch.int16)), (n, k, b12, m)
