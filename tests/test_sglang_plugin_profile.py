"""benchmarks/sglang_plugin_profile.py reads a real torch-profiler trace (made here on CPU, as SGLang's profiler
writes it on the device) into per-step figures."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_plugin_profile as sp  # noqa: E402

from specpilot.bench import provenance  # noqa: E402


class _Worker:
    def forward_batch_generation(self, x: torch.Tensor) -> torch.Tensor:
        provenance.label({"git": None, "device": "cpu", "dtype": None, "utc": "now"})  # a function of ours
        return (x @ x).sum()


def _trace(tmp_path: Path, steps: int) -> Path:
    worker, x = _Worker(), torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            worker.forward_batch_generation(x)
    plain = tmp_path / "trace.json"
    prof.export_chrome_trace(str(plain))
    return plain


def test_union_of_intervals_counts_overlap_once() -> None:
    assert sp.busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert sp.busy_us([]) == 0


def test_a_real_trace_gives_steps_our_functions_and_the_gpu_share(tmp_path: Path) -> None:
    plain = _trace(tmp_path, steps=4)
    trace = json.loads(plain.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    t0 = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - t0
    # two overlapping kernels covering the first quarter of the window, as a CUDA trace would list them
    trace["traceEvents"] += [{"ph": "X", "cat": "kernel", "name": "k", "ts": t0, "dur": window / 8},
                             {"ph": "X", "cat": "kernel", "name": "k", "ts": t0 + window / 16, "dur": window * 3 / 16},
                             {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0, "dur": 1},
                             {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 1}]
    packed = tmp_path / "trace.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump(trace, f)
    s = sp.summarize_trace(packed, top=1)  # the test runner's own frames outrank the step: it is listed anyway
    assert s["steps"] == 4
    assert s["gpu_busy_share"] == pytest.approx(0.25, abs=2 / window)  # epoch-µs floats: ~0.25 µs steps
    assert s["kernels"] == 2
    assert s["kernel_launches_per_step"] == s["graph_launches_per_step"] == 0.25
    ours = [name for name in s["python_ms_per_step"] if "specpilot/bench/provenance.py" in name]
    assert len(ours) == 1 and s["python_calls_per_step"][ours[0]] == 1
    step = next(name for name in s["python_ms_per_step"] if name.endswith("forward_batch_generation"))
    assert s["python_ms_per_step"][step] >= s["python_ms_per_step"][ours[0]]  # inclusive time holds its callee
    assert sp.summarize_trace(plain)["steps"] == 4  # an unzipped trace reads alike


def test_a_trace_without_complete_events_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(ValueError, match="no complete events"):
        sp.summarize_trace(empty)
