"""Where a benchmark's numbers came from: code, machine, software and command, stored beside them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

PACKAGES = ("specpilot", "torch", "triton", "transformers")
_ROOT = Path(__file__).resolve().parents[2]  # the checkout's root when specpilot runs from one


def git_state(root: Path = _ROOT) -> dict[str, Any] | None:
    """{commit, dirty} of the checkout specpilot's own files belong to; None when they are not one's
    top level (an installed copy inside some other repository must not report that repository)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None
        # untracked files (bench output folders, scratch) do not count, as with `git describe --dirty`
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_name() -> str:
    """The CPU's model and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:  # Linux names the model here; platform.processor() often does not
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({cores} cores)"


def device_name(device: torch.device | None = None) -> str:
    """The accelerator's name, else the CPU's; `None`: this machine's GPU if it has one."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def collect(device: torch.device | None, dtype: str | None) -> dict[str, Any]:
    return {"git": git_state(), "device": device_name(device), "cpu": cpu_name(), "dtype": dtype,
            "versions": {"python": platform.python_version()} | {p: _version(p) for p in PACKAGES},
            "argv": sys.argv, "utc": datetime.now(UTC).isoformat(timespec="seconds")}


def label(prov: dict[str, Any]) -> str:
    """One line for a chart's footer: commit, device, dtype, date."""
    git = prov["git"]
    commit = "no checkout" if git is None else git["commit"] + ("-dirty" if git["dirty"] else "")
    return f"{commit} | {prov['device']} | {prov['dtype']} | {prov['utc']}"
