"""Capturing a pass as a CUDA graph, shared by the target's runner and the drafters.

`capture(fn, pool)` runs `fn` (whose tensors live in static buffers) twice on a side stream — autotuning
and lazy allocations must happen outside the graph — then once under capture, and returns a
`CapturedPass`: `outputs` are static tensors that every `replay()` overwrites.

`EagerReplay` stands in for a CUDA graph where there is none (CPU tests of the graph paths): replay
reruns `fn` and copies its results into the first run's outputs, so the static-buffer plumbing around a
graph (input fills, bucket padding, in-place edits before replay) is exercised exactly as on a GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass
from typing import Any

import torch

Outputs = Any  # a tensor, or (nested) tuples and dataclasses of tensors and None


class CapturedPass:
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Outputs) -> None:
        self.graph, self.outputs = graph, outputs

    def replay(self) -> None:
        self.graph.replay()


class EagerReplay:
    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn
        self.outputs = fn()
        # a captured graph's outputs hold nothing until its first replay: poison these the same way, so
        # code that reads them before a replay fails on CPU as it would on a GPU
        _poison(self.outputs)

    def replay(self) -> None:
        _copy_into(self.outputs, self.fn())


def _copy_into(dst: Outputs, src: Outputs) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif is_dataclass(dst):
        for f in fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))


def _poison(out: Outputs) -> None:
    if isinstance(out, torch.Tensor):
        out.fill_(float("nan") if out.is_floating_point() else -(2**31) + 7)
    elif isinstance(out, tuple):
        for o in out:
            _poison(o)
    elif is_dataclass(out):
        for f in fields(out):
            _poison(getattr(out, f.name))


def cuda_capture(fn: Callable[[], Outputs], pool: Any) -> CapturedPass:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph collects garbage before the capture; a collection inside it could run a finalizer of an
    # earlier engine's objects whose CUDA calls invalidate the capture (an H100 test run once failed so)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    return CapturedPass(graph, outputs)


def eager_capture(fn: Callable[[], Outputs], pool: Any) -> EagerReplay:
    return EagerReplay(fn)


class GraphBackend:
    """How passes are captured. Tests switch `GraphBackend.capture` to `eager_capture` to run the graph
    paths on CPU; everything else uses CUDA graphs."""

    capture: Callable[[Callable[[], Outputs], Any], CapturedPass | EagerReplay] = staticmethod(cuda_capture)

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" or GraphBackend.capture is eager_capture

    @staticmethod
    def pool(device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    @staticmethod
    def synchronize(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()


def capture_buckets(batch_sizes: tuple[int, ...], max_b: int) -> list[int]:
    """The batch sizes to capture graphs for, at most `max_b`; largest first, so smaller graphs reuse the
    largest one's memory pool."""
    return sorted({min(b, max_b) for b in batch_sizes}, reverse=True)


def ragged_token_buckets(batch_size: int, q: int) -> list[int]:
    """The row counts a ragged verify of `batch_size` requests of 1..q rows captures graphs for: 2^k and 3 * 2^k
    (a pass pads at most half its rows) between batch_size and batch_size * q, and batch_size * q itself.
    None for a batch of one (its one request's width is uniform), nor for q < 2 (no drafts: no ragged verify)."""
    if batch_size < 2 or q < 2:
        return []
    series = (m << k for k in range((batch_size * q).bit_length()) for m in (2, 3))
    return sorted({t for t in series if batch_size < t < batch_size * q} | {batch_size * q})


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """The prompt-token counts graphed prefills capture: powers of two from 64 below `max_tokens`, and
    `max_tokens` itself (a pass pads at most half its rows past 64); none for 0."""
    if max_tokens <= 0:
        return []
    return sorted({64 << k for k in range(max_tokens.bit_length()) if 64 << k < max_tokens} | {max_tokens})


def pick_bucket(captured: Iterable[int], n: int) -> int:
    """The smallest captured batch size that holds n requests; 0 when none does (run eagerly)."""
    return min((b for b in captured if b >= n), default=0)
