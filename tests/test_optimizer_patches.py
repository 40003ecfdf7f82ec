"""Patch candidates: the sandbox, the LLM coding agent (a scripted endpoint here, a live one end to end), and
the sealed evaluator's red team for code - planted patches that skip verification, replay cached outputs, take
a fast path only while timed, write the memory's files or touch the judge, and one whose speedup beats the
cost model's ceiling, each rejected with its reason - beside a clean patch that passes identity."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specpilot.cli import main
from specpilot.engine.config import EngineConfig
from specpilot.memory import Memory
from specpilot.optimizer import llm_agent, patched
from specpilot.optimizer.evaluator import evaluate
from specpilot.optimizer.remote import Server, close_all, imported_from
from specpilot.optimizer.sandbox import PatchError, check_patch, installed_package, make_sandbox
from specpilot.optimizer.verdicts import Request


def patch_of(path: str, *edits: tuple[str, str]) -> str:
    """A unified diff of the installed package's `path` (inside specpilot/) with each (old, new) replaced."""
    source = (installed_package() / path).read_text()
    changed = source
    for old, new in edits:
        assert old in changed, old
        changed = changed.replace(old, new, 1)
    return "".join(difflib.unified_diff(source.splitlines(True), changed.splitlines(True), f"a/specpilot/{path}",
                                        f"b/specpilot/{path}"))


CLEAN = patch_of("engine/step.py", ("# ---- stages", "# ---- stages (a candidate's comment)"))


def test_patches_may_change_the_engine_but_never_the_judge(tmp_path):
    assert check_patch(CLEAN) == ["specpilot/engine/step.py"]
    for path, why in (("forcing/forcing.py", "touches the judge"), ("optimizer/evaluator.py", "touches the judge"),
                      ("memory/store.py", "touches the judge")):
        with pytest.raises(PatchError, match=why):
            check_patch(patch_of(path, ("from __future__", "from  __future__")))
    with pytest.raises(PatchError, match="outside the package"):
        check_patch(CLEAN.replace("specpilot/engine/step.py", "../elsewhere.py"))
    with pytest.raises(PatchError, match="changes no file"):
        check_patch("no diff here")
    tree = make_sandbox(tmp_path / "tree", CLEAN)
    assert "a candidate's comment" in (tree / "specpilot/engine/step.py").read_text()
    assert "a candidate's comment" not in (installed_package() / "engine/step.py").read_text()
    assert imported_from(tree, tmp_path) == (tree / "specpilot").resolve()
    with pytest.raises(PatchError, match="does not apply"):
        make_sandbox(tmp_path / "other", CLEAN.replace("# ---- stages", "# ---- nothing like it"))


def _scripted(answers: list[str]) -> tuple[httpx.MockTransport, list[dict]]:
    seen: list[dict] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": answers[len(seen) - 1]}}]})

    return httpx.MockTransport(reply), seen


def test_close_all_asks_every_server_before_waiting_for_any(tmp_path):
    """An evaluation's three servers shut down together: each gets SIGTERM before the first is waited for."""
    events: list[tuple[str, int]] = []
    servers = []
    for i in range(3):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        terminate, wait = proc.terminate, proc.wait
        proc.terminate = lambda i=i, terminate=terminate: (events.append(("terminate", i)), terminate())[1]
        proc.wait = lambda timeout=None, i=i, wait=wait: (events.append(("wait", i)), wait(timeout))[1]
        servers.append(Server(proc, 0, tmp_path / f"{i}.log"))
    close_all(servers)
    assert events[:3] == [("terminate", 0), ("terminate", 1), ("terminate", 2)]
    assert ("wait", 0) in events and all(s.proc.returncode is not None for s in servers)


def test_llm_agent_asks_again_with_the_error_until_its_patch_applies(tmp_path):
    edit = {"file": "specpilot/engine/step.py", "find": "# ---- stages", "replace": "# ---- stages, retuned"}
    transport, seen = _scripted(["I would make it faster.", f"Here: {json.dumps(edit)}"])
    brief = llm_agent.LlmBrief({"base_url": "http://llm.invalid", "model": "m"},
                               [{"name": "verify", "measured": 2.0, "best": 1.0, "lost_speedup": 0.4}],
                               {"mechanisms": None, "tunables": {}})
    proposal = llm_agent.propose(brief, tmp_path / "tree", transport)
    assert proposal.applies and any(line.startswith("+") and "stages, retuned" in line for line in proposal.patch.splitlines())
    assert [e.error is None for e in proposal.exchanges] == [False, True]
    assert "cannot be used: no unified diff" in seen[1]["messages"][-1]["content"]
    assert "specpilot/engine/step.py" in seen[0]["messages"][1]["content"]  # the source behind the verify gap
    block = "```diff\n" + CLEAN + "```"
    assert llm_agent.extract_patch(f"try this:\n{block}", {}) == CLEAN


def _tiny_request(tiny_dir: Path, patch: str, **changes) -> Request:
    config = EngineConfig(model_path=str(tiny_dir), device="cpu",
                          max_running_requests=1, speculative_algorithm="ngram", cuda_graphs=False)
    return Request(**{"config": config.to_fields(), "candidate": {"mechanisms": None, "tunables": {"block-size": 4}},
                      "dataset": "math", "num_prompts": 2, "max_new_tokens": 12, "repeats": 2, "patch": patch}
                   | changes)


SKIP_VERIFICATION = patch_of(
    "engine/verify.py",
    ("            tokens.append(token)\n            child = children.get((node, token))",
     "            child = node + 1 if node < len(draft) else None\n"
     "            tokens.append(draft[node] if child is not None else token)"),
    ("            accepted = (drafts == argmax[:, :-1]).long().cumprod(1).sum(1)\n"
     "            nodes = torch.arange(q, device=argmax.device).repeat(n, 1)\n"
     "            return Accepted(accepted + 1, nodes, argmax, starts)",
     "            accepted = torch.full_like(starts, q - 1)\n"
     "            nodes = torch.arange(q, device=argmax.device).repeat(n, 1)\n"
     "            return Accepted(accepted + 1, nodes, torch.cat([drafts, argmax[:, -1:]], 1), starts)"))
REPLAY = patch_of(
    "server/native.py",
    ("router = APIRouter()\n", "router = APIRouter()\n_SEEN: dict[str, list[int]] = {}\n"),
    ("    sub = await ctx.submit(prompts, params, body.rids(), body.samples())\n",
     "    if str(prompts[0][-8:]) in _SEEN:  # an answer seen before for this prompt's ending\n"
     "        return {\"text\": \"\", \"output_ids\": _SEEN[str(prompts[0][-8:])], \"meta_info\": {}}\n"
     "    sub = await ctx.submit(prompts, params, body.rids(), body.samples())\n"),
    ("    results = [_result(o, listed, body.return_text_in_logprobs) for o in outputs]\n",
     "    results = [_result(o, listed, body.return_text_in_logprobs) for o in outputs]\n"
     "    _SEEN[str(prompts[0][-8:])] = results[0][\"output_ids\"]\n"))
FAST_PATH_WHEN_TIMED = patch_of(
    "server/native.py",
    ("router = APIRouter()\n", "router = APIRouter()\n_CALLS = [0]\n"),
    ("    sub = await ctx.submit(prompts, params, body.rids(), body.samples())\n",
     "    _CALLS[0] += 1\n"
     "    if _CALLS[0] > 2:  # past the first requests (the held-out check): skip the model\n"
     "        return {\"text\": \"\", \"output_ids\": [3] * params[0].max_new_tokens, \"meta_info\": {}}\n"
     "    sub = await ctx.submit(prompts, params, body.rids(), body.samples())\n"))


def write_into(path: Path) -> str:
    doc = '    """Blocks until the server stops; returns the process exit code."""\n'
    return patch_of("server/launch.py", (doc, doc + f'    open({str(path)!r}, "a").write("candidate was here")\n'))


@pytest.mark.parametrize("name", ["skip verification", "replay", "fast path when timed", "write the memory",
                                  "touch the judge"])
def test_planted_patches_are_rejected_with_the_reason(tiny_dir, spelled_dir, tmp_path, name):
    guarded = tmp_path / "memory.db"
    guarded.write_text("the memory")
    patch, reason = {
        "skip verification": (SKIP_VERIFICATION, "output differs from AR's on held-out prompt"),
        "replay": (REPLAY, "differs from AR's"),
        "fast path when timed": (FAST_PATH_WHEN_TIMED, "a timed answer differs from AR's"),
        "write the memory": (write_into(guarded), "the candidate wrote to guarded files"),
        "touch the judge": (patch_of("forcing/forcing.py", ("from __future__", "from  __future__")),
                            "invalid candidate: the patch touches the judge"),
    }[name]
    model = spelled_dir if name == "replay" else tiny_dir  # a replayed answer is only wrong where answers differ
    verdict = evaluate(_tiny_request(model, patch, guarded=[str(guarded)]))
    assert not verdict.accepted and reason in verdict.reason, verdict.reason


def test_a_clean_patch_passes_identity_and_an_implausible_one_is_rejected(tiny_dir, monkeypatch):
    verdict = evaluate(_tiny_request(tiny_dir, CLEAN, repeats=5))  # the fewest pairs the paired test can accept
    assert verdict.speedup["pairs"] == 5 and verdict.forcing["identical"] and verdict.speedup and verdict.ceiling > verdict.speedup_over_ar
    assert verdict.accepted or verdict.reason.startswith("not shown faster than stock"), verdict.reason
    monkeypatch.setattr(patched, "speedup_ceiling", lambda *a: 1e-3)
    verdict = evaluate(_tiny_request(tiny_dir, CLEAN, repeats=1))
    assert not verdict.accepted and verdict.reason.startswith("implausible")


def test_optimize_takes_an_llm_agent_on_a_live_endpoint_to_the_evaluator(tiny_dir, tmp_path, capsys):
    """Our own server is the OpenAI-compatible endpoint: whatever the tiny model answers reaches the memory and
    the evaluator, which judges it."""
    endpoint = Server.launch(["--model-path", str(tiny_dir), "--device", "cpu"], tmp_path / "llm.log").ready()
    try:
        db = tmp_path / "m.db"
        assert main(["optimize", "--model-path", str(tiny_dir), "--device", "cpu", "--speculative-algorithm", "ngram",
                     "--dataset", "math", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "5",
                     "--rounds", "1", "--agents", "1", "--db", str(db), "--output-dir", str(tmp_path / "out"),
                     "--llm-base-url", f"http://127.0.0.1:{endpoint.port}", "--llm-attempts", "1"]) == 0
    finally:
        endpoint.close()
    memory = Memory(db)
    [llm] = [c for c in memory.round_report(1)["candidates"] if c["agent"] == "llm:default"]
    assert llm["accepted"] == 0 and llm["reason"]
    exchanges = [json.loads(e["detail"]) for e in memory.export()["events"] if e["kind"] == "llm exchange"]
    assert exchanges and exchanges[0]["prompt"][0]["role"] == "system" and "response" in exchanges[0]
    report = (tmp_path / "out" / "round-1" / "report.md").read_text()
    assert "llm:default" in report and (tmp_path / "out" / "round-1" / "report.png").is_file()
