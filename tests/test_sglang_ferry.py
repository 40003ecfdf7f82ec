"""benchmarks/sglang_wheels.py: the wheels SGLang needs on the device travel in parts one device call can carry,
and come back whole, checked, on the other side."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_wheels  # noqa: E402

PART = 1000


def _wheel(path: Path, size: int, requires: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        meta = "Metadata-Version: 2.1\nName: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr("x-1.dist-info/METADATA", meta)
        z.writestr("x/blob.bin", bytes(range(256)) * (size // 256))
    return path


def test_parts_stay_under_the_limit_and_join_back_into_the_same_wheels(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    wheels = {name: _wheel(src / f"{name}-1-py3-none-any.whl", size, [])
              for name, size in (("big", 3500), ("mid", 700), ("small", 100), ("tiny", 10))}
    manifest = sglang_wheels.pack(wheels, tmp_path / "ferry", part_bytes=PART)
    parts = sorted((tmp_path / "ferry").iterdir())
    assert len(parts) == manifest["parts"] and all(sum(f.stat().st_size for f in p.iterdir()) <= PART for p in parts)
    big = next(w for w in manifest["wheels"] if w["file"].startswith("big"))
    assert len(big["pieces"]) > 1  # a wheel larger than a part is split across parts
    staged = tmp_path / "staged"  # what the stage calls leave on the device
    staged.mkdir()
    for part in parts:
        for piece in part.iterdir():
            (staged / piece.name).write_bytes(piece.read_bytes())
    joined = sglang_wheels.join(json.loads(json.dumps(manifest)), staged, tmp_path / "whl")
    assert sorted(p.read_bytes() for p in joined) == sorted(p.read_bytes() for p in wheels.values())


def test_join_refuses_a_missing_or_altered_piece(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "a-1-py3-none-any.whl", 2500, [])
    manifest = sglang_wheels.pack({"a": wheel}, tmp_path / "ferry", part_bytes=PART)
    staged = tmp_path / "staged"
    staged.mkdir()
    pieces = sorted(p for part in (tmp_path / "ferry").iterdir() for p in part.iterdir())
    for piece in pieces[1:]:
        (staged / piece.name).write_bytes(piece.read_bytes())
    with pytest.raises(SystemExit, match="not staged yet"):
        sglang_wheels.join(manifest, staged, tmp_path / "whl")
    (staged / pieces[0].name).write_bytes(b"\0" + pieces[0].read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256 differs"):
        sglang_wheels.join(manifest, staged, tmp_path / "whl")


def test_requirements_follow_the_devices_markers_and_the_extras_asked_for(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w-1-py3-none-any.whl", 10, [
        "always", 'linux-only; sys_platform == "linux"', 'mac-only; sys_platform == "darwin"',
        'py311; python_version < "3.12"', 'cuda; extra == "cu13"', 'docs; extra == "docs"'])
    names = {r.name for r in sglang_wheels.requirements(wheel, {"cu13"})}
    assert names == {"always", "linux-only", "cuda"}


def test_check_names_the_module_a_launch_path_import_misses(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "launch_path_probe.py").write_text("import json\nimport no_such_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = sglang_wheels.missing_imports(("json", "launch_path_probe"))
    assert missing == {"launch_path_probe": "no_such_package_anywhere"}
