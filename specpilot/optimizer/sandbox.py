"""A candidate's source tree: a copy of the installed package with the candidate's patch applied, in a directory
of its own. Patches may change the engine, never the judge: the evaluator, the forcing, the memory and the
optimizer that runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import specpilot

# what a patch may not touch (paths inside the repository)
JUDGE = ("specpilot/optimizer/", "specpilot/forcing/", "specpilot/memory/", "specpilot/bench/", "schema/")


class PatchError(ValueError):
    """The patch does not apply, or reaches outside what a candidate may change."""


def installed_package() -> Path:
    return Path(specpilot.__file__).resolve().parent


def patched_paths(patch: str) -> list[str]:
    """The repository paths a unified diff changes (its ---/+++ lines, a/ and b/ prefixes dropped)."""
    paths = []
    for line in patch.splitlines():
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip()
            if path != "/dev/null":
                paths.append(path[2:] if path[:2] in ("a/", "b/") else path)
    return sorted(set(paths))


def check_patch(patch: str) -> list[str]:
    """The paths the patch changes; PatchError if it changes none, or any outside `specpilot/` or in the judge."""
    paths = patched_paths(patch)
    if not paths:
        raise PatchError("the patch changes no file (a unified diff with ---/+++ lines is expected)")
    for path in paths:
        parts = Path(path).parts
        if Path(path).is_absolute() or ".." in parts or not path.startswith("specpilot/"):
            raise PatchError(f"the patch reaches outside the package: {path}")
        if path.startswith(JUDGE):
            raise PatchError(f"the patch touches the judge: {path}")
    return paths


def make_sandbox(dest: Path, patch: str | None = None, package: Path | None = None) -> Path:
    """`dest` holds a copy of the package (`dest/specpilot`), with the patch applied; returns `dest`, the root a
    process puts on PYTHONPATH to run the candidate's code."""
    package = package or installed_package()
    if (dest / "specpilot").exists():
        shutil.rmtree(dest / "specpilot")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(package, dest / "specpilot", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if patch is not None:
        check_patch(patch)
        (dest / "candidate.patch").write_text(patch)
        for args in (["--check"], []):
            # no repository above dest: git apply then patches paths relative to dest
            proc = subprocess.run(["git", "apply", *args, "--whitespace=nowarn", "candidate.patch"], cwd=dest,
                                  capture_output=True, text=True,
                                  env={**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent)})
            if proc.returncode != 0:
                raise PatchError(f"the patch does not apply: {proc.stderr.strip()[-500:]}")
    return dest
