"""The device's ceilings, measured: copy and read bandwidth, matmul rate (a large GEMM and a decode-shaped
one), the cost of one kernel launch and of one CUDA graph replay. Each is a median of a few timed runs, measured
once per process and device."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specpilot.kernels.stream_read import stream_read_triton
from specpilot.kernels.triton_support import HAS_TRITON


@dataclass(frozen=True)
class Ceilings:
    device: str
    dtype: str
    copy_bytes_per_s: float  # bytes read + written per second by a device-to-device copy
    read_bytes_per_s: float  # bytes read per second: kernels/stream_read.py's probe on CUDA, a sum elsewhere
    matmul_flops: float  # a square GEMM's rate in `dtype`
    decode_matmul_bytes_per_s: float  # weight bytes per second of a one-row GEMM (decode's shape)
    launch_s: float  # one small kernel, eagerly
    graph_replay_s: float | None  # one CUDA graph replay of one small kernel (None off CUDA)

    def as_dict(self) -> dict:
        return asdict(self)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, inner: int = 1) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


# One square product may take this long before the GEMM's size is halved: CPUs without a fast kernel for a
# dtype (bf16 on many) take seconds for the 1024 x 1024 one, and the rate there hardly depends on the size.
GEMM_PROBE_S = 0.25
GEMM_MIN_N = 128


def _square_gemm(n: int, dtype: torch.dtype, device: torch.device) -> tuple[int, float]:
    """(n, seconds per n x n product), n halved from the given one while a single product is slow."""
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() - start <= GEMM_PROBE_S or n <= GEMM_MIN_N:
            return n, median_seconds(lambda: a @ b, device, inner=3)
        n //= 2


@functools.cache
def calibrate(device: torch.device, dtype: torch.dtype, size_mib: int | None = None) -> Ceilings:
    """Measures in a few seconds; `size_mib` is each buffer (default 1024 on CUDA, 128 on CPU, past the
    caches either way)."""
    size = (size_mib or (1024 if device.type == "cuda" else 128)) * 2**20
    src = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = median_seconds(lambda: dst.copy_(src), device)
    probe = stream_read_triton if device.type == "cuda" and HAS_TRITON else torch.sum
    read = median_seconds(lambda: probe(src), device)
    n, gemm = _square_gemm(4096 if device.type == "cuda" else 1024, dtype, device)
    k = 4096 if device.type == "cuda" else 2048
    w = torch.randn(4 * k, k, device=device).to(dtype)
    x = torch.randn(1, k, device=device).to(dtype)
    decode = median_seconds(lambda: torch.nn.functional.linear(x, w), device, inner=5)
    tiny = torch.zeros(8, device=device)
    launch = median_seconds(lambda: tiny.add_(1.0), device, inner=200)
    return Ceilings(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        copy_bytes_per_s=2 * size / copy,
        read_bytes_per_s=size / read,
        matmul_flops=2 * n**3 / gemm,
        decode_matmul_bytes_per_s=w.numel() * w.element_size() / decode,
        launch_s=launch,
        graph_replay_s=_graph_replay_seconds(device, tiny),
    )


def _graph_replay_seconds(device: torch.device, tiny: torch.Tensor) -> float | None:
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        tiny.add_(1.0)  # warm on the side stream, as capture wants
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tiny.add_(1.0)
    return median_seconds(graph.replay, device, inner=200)
