"""Triton kernels under the CPU interpreter in tests.

Each kernel test module runs its Triton cases in a subprocess of itself, so TRITON_INTERPRET=1 is set
before triton is first imported whatever other tests imported, and reports one JSON object on its last
line. A module with many cases may run as several such processes at once, each taking its share of them:
the interpreter keeps a process to one core, and the test process only waits. The interpreter's bf16
handling differs from the GPU's in two places; the patches below make it compute what the GPU computes.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


T = TypeVar("T")


def interpreter_fixture(module_file: str, parts: int = 1) -> Any:
    """A module-scoped fixture holding what `module_file` reports when run under the interpreter (its
    tests skip without triton): `triton_results = interpreter_fixture(__file__)`. With `parts` > 1 it runs
    as that many processes at once, `python module_file PART PARTS`, whose reports (dicts, each of its
    `share` of the cases) the fixture holds as one."""

    @pytest.fixture(scope="module")
    def results() -> Any:
        pytest.importorskip("triton")
        if parts == 1:
            return run_module(module_file)
        with ThreadPoolExecutor(parts) as pool:
            reports = pool.map(lambda part: run_module(module_file, str(part), str(parts)), range(parts))
            return functools.reduce(_union, reports)

    return results


def share(items: Sequence[T]) -> Sequence[T]:
    """In a module run in parts by its fixture: the items this part takes (all of them run alone)."""
    part, parts = map(int, sys.argv[1:3]) if len(sys.argv) > 2 else (0, 1)
    return items[part::parts]


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two parts' reports as one; a key both report holds the union of their dicts."""
    return a | b | {key: a[key] | b[key] for key in a.keys() & b.keys()}


def run_module(path: str, *args: str, timeout: int = 600) -> Any:
    """Run `python path ARGS` in the interpreter; returns the JSON its last output line holds."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, path, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def patch_dot() -> None:
    """Make the interpreter's tl.dot compute what the GPU's MMA computes.
    - bf16: the interpreter keeps bf16 as raw uint16 bits, which np.matmul would multiply as integers. The
      operands are widened to the float32 values they encode (exact), as the MMA consumes them.
    - Row by row: an MMA row's result never depends on the rows beside it. np.matmul's does: OpenBLAS
      takes another kernel, and another summation order, for one row than for many on some CPUs. So each
      row is its own product."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def as_float32(h: TensorHandle) -> TensorHandle:
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        a, b = as_float32(a), as_float32(b)
        if a.data.ndim != 2 or a.data.shape[0] == 1:
            return original(self, a, b, d, *args)
        rows = [original(self, TensorHandle(a.data[i : i + 1], a.dtype.scalar), b,
                         TensorHandle(d.data[i : i + 1], d.dtype.scalar), *args).data
                for i in range(a.data.shape[0])]
        return TensorHandle(np.concatenate(rows), d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


def patch_bf16_cast() -> None:
    """The interpreter casts float32 to bfloat16 by truncation; the GPU (and torch) round to nearest even."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = patched
