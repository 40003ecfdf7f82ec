"""The GPU image has torch, triton, transformers, safetensors and numpy, and none of the server's, the terminal
app's or structured output's packages: the engine and the GPU benchmarks that build synthetic models must import
there (a structured-output request is then a clear error), so they run on the device without the wheel ferry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("xgrammar", "gguf", "fastapi", "uvicorn", "pydantic", "starlette", "textual", "sqlite_utils", "flashinfer",
          "sglang", "opentelemetry")
BLOCKER = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Absent())
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "benchmarks")!r}]
"""


@pytest.mark.parametrize("module", ["specpilot.engine.engine", "specpilot.bench.harness", "common", "gpu_b12_gemm",
                                    "gpu_engine", "gpu_spec", "gpu_step_profile", "ar_overlap",
                                    "train_step_profile"])
def test_imports_without_the_server_s_packages(module):
    run = subprocess.run([sys.executable, "-c", BLOCKER + f"import {module}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_constraint_without_xgrammar_is_a_clear_error():
    code = BLOCKER + """
from specpilot.engine.grammar import GrammarCompiler
try:
    GrammarCompiler(object(), 100)
except ValueError as err:
    assert "xgrammar" in str(err), err
else:
    raise AssertionError("no error")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
