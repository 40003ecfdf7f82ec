"""The sealed evaluator's judgement of a patch candidate: code, not settings, so it never runs in the evaluator's
process. The candidate's copy of the package (optimizer/sandbox.py) serves in a process of its own, stock and
AR from the installed package in theirs, and the evaluator only sends requests and reads answers:

1. Identity: on held-out prompts no agent sees, each made fresh by a random tag in its text, the candidate's
   output ids must be AR's (computed here, by the installed engine). On the batch-invariant CUDA path this is
   exact forcing; on CPU it is the conservative form (a flip at a near-tie rejects).
2. Timing, measured here from each request's send to its answer: interleaved repeats of stock and the
   candidate, every repeat on freshly tagged benchmark prompts (so no answer can be replayed), and every
   timed answer must be AR's too (so no fast path can skip work while being timed); one AR run for the gate.
3. The guard: the installed package and the memory's files hash the same after the candidate ran.
Then the profile candidates' rule (verdicts.decide).
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from specpilot.bench.datasets import Prompt, apply_chat_template, load_prompts
from specpilot.config import SamplingParams
from specpilot.costmodel.measure import speedup_ceiling
from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.registry import Profile, ar_changes
from specpilot.optimizer.remote import Server, close_all, imported_from
from specpilot.optimizer.sandbox import installed_package, make_sandbox
from specpilot.optimizer.verdicts import Guard, Request, Verdict, decide


class Rejected(Exception):
    """A verdict reached before the end (the reason is the message)."""


def tagged(prompts: list[Prompt], tokenizer: Any) -> list[Prompt]:
    """The prompts with a fresh random tag at the start of the first user turn (words of the tokenizer's
    own vocabulary, so the tag changes the token ids whatever the tokenizer): new texts every call."""
    vocab = len(tokenizer)
    out = []
    for p in prompts:
        tag = tokenizer.decode([secrets.randbelow(vocab) for _ in range(4)], skip_special_tokens=True).strip()
        messages = [dict(m) for m in p.messages]
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = f"(ref {tag}) {first['content']}"
        out.append(replace(p, messages=messages))
    return out


class _Judge:
    def __init__(self, request: Request, ar: Engine, candidate: Server) -> None:
        self.request, self.ar, self.candidate = request, ar, candidate
        self.params = SamplingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True)
        self.sampling: dict[str, Any] = {"max_new_tokens": request.max_new_tokens, "ignore_eos": True}

    def ids(self, prompts: list[Prompt]) -> list[list[int]]:
        return [apply_chat_template(self.ar.tokenizer, p) for p in prompts]

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        return [r.output_ids for p in prompts for r in self.ar.generate([p], self.params)]

    def timed(self, server: Server, prompts: list[list[int]], expected: list[list[int]] | None = None) -> float:
        """Seconds per output token over the prompts, one request at a time; with `expected`, each answer
        must be it."""
        seconds = tokens = 0.0
        for i, prompt in enumerate(prompts):
            got, took = server.generate(prompt, self.sampling)
            if expected is not None and got != expected[i]:
                raise Rejected(f"a timed answer differs from AR's (prompt {i}, first difference at token "
                               f"{next((j for j, (a, b) in enumerate(zip(got, expected[i])) if a != b), len(got))})")
            seconds, tokens = seconds + took, tokens + len(got)
        return seconds / max(tokens, 1)

    def identity(self, held_out: list[Prompt]) -> dict[str, Any]:
        prompts = self.ids(tagged(held_out, self.ar.tokenizer))
        expected = self.reference(prompts)
        for i, (prompt, ref) in enumerate(zip(prompts, expected)):
            got, _ = self.candidate.generate(prompt, self.sampling)
            if got != ref:
                raise Rejected(f"output differs from AR's on held-out prompt {i} "
                               f"({sum(a != b for a, b in zip(got, ref)) + abs(len(got) - len(ref))} tokens)")
        return {"held_out_prompts": len(prompts), "identical": True, "exact": self.ar.exact,
                "positions_checked": sum(map(len, expected))}


def _reject(reason: str, start: float, forcing: dict[str, Any] | None = None) -> Verdict:
    return Verdict(False, reason, forcing, seconds=time.perf_counter() - start)


def evaluate_patch(request: Request) -> Verdict:
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="specpilot-candidate-"))
    base = EngineConfig.from_fields(request.config)
    try:
        candidate_cfg = Profile.parse(request.candidate, "the candidate").apply(base)
        stock_cfg = Profile.parse(request.stock, "the stock profile").apply(base)
        tree = make_sandbox(work / "tree", request.patch)
    except ValueError as err:
        return _reject(f"invalid candidate: {err}", start)
    if imported_from(tree, work) != (tree / "specpilot").resolve():
        return _reject("the candidate's process does not import its own tree", start)
    guard = Guard([installed_package(), *map(Path, request.guarded)])
    ar = Engine.from_config(replace(stock_cfg, **ar_changes(stock_cfg)))
    texts = load_prompts(request.dataset, 2 * request.num_prompts)
    bench, held_out = texts[: request.num_prompts], texts[request.num_prompts :]
    servers = {"candidate": Server.with_config(candidate_cfg.to_fields(), work, "candidate", tree),
               "stock": Server.with_config(stock_cfg.to_fields(), work, "stock"),
               "ar": Server.with_config(ar.config.to_fields(), work, "ar")}
    forcing = None
    try:
        for server in servers.values():
            server.ready()
        judge = _Judge(request, ar, servers["candidate"])
        forcing = judge.identity(held_out)
        runs: dict[str, list[float]] = {"stock": [], "candidate": []}
        for _ in range(request.repeats):  # interleaved pairs on fresh prompts
            prompts = judge.ids(tagged(bench, ar.tokenizer))
            runs["stock"].append(judge.timed(servers["stock"], prompts))
            runs["candidate"].append(judge.timed(servers["candidate"], prompts, judge.reference(prompts)))
        ar_prompts = judge.ids(tagged(bench, ar.tokenizer))
        ar_ms = 1e3 * judge.timed(servers["ar"], ar_prompts)
    except (Rejected, RuntimeError, TimeoutError) as err:
        return _reject(_tampered(guard) or str(err), start, forcing)
    finally:
        close_all(servers.values())
    if tampered := _tampered(guard):
        return _reject(tampered, start, forcing)
    context = int(statistics.mean(map(len, ar_prompts)) + request.max_new_tokens / 2)
    candidate_ms = 1e3 * statistics.median(runs["candidate"])
    return decide(runs["stock"], runs["candidate"], ar_ms / candidate_ms, speedup_ceiling(ar, ar_ms, context),
                  forcing, time.perf_counter() - start)


def _tampered(guard: Guard) -> str | None:
    changed = guard.changed()
    return f"the candidate wrote to guarded files: {', '.join(changed[:5])}" if changed else None
