"""Triton is optional: without it (CPU-only installs) every op runs its plain-torch reference."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def pick_backend(backend: str, x: torch.Tensor) -> str:
    """"auto" means Triton for CUDA tensors when it imports, torch otherwise."""
    if backend == "auto":
        return "triton" if x.is_cuda and HAS_TRITON else "torch"
    if backend in BACKENDS:
        return backend
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")


def require_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton, which is not importable")
