"""benchmarks/server_identity.py end to end on CPU: two real servers (AR, then n-gram speculation) over
the tiny model, concurrent streams, greedy and seeded sampling; every output's ids must be AR's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "server_identity.py"


def _script():
    spec = importlib.util.spec_from_file_location("server_identity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.95"]], ids=["greedy", "t0.8"])
def test_speculation_through_the_server_gives_ars_ids(tiny_dir, tmp_path, sampling):
    rc = _script().main(["--dataset", "math", "--num-prompts", "3", "--max-new-tokens", "12", "--concurrency", "3",
                         "--speculative-algorithm", "ngram", "--out", str(tmp_path), *sampling,
                         "--", "--model-path", str(tiny_dir), "--device", "cpu"])
    report = json.loads((tmp_path / "server_identity.json").read_text())
    assert rc == 0 and report["results"] == {"math": {"requests": 3, "identical": 3}}
    assert report["provenance"]["git"] is None or report["provenance"]["git"]["commit"]
    assert (tmp_path / "server_spec.log").stat().st_size > 0
