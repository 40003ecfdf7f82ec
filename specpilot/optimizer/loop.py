"""`specpilot optimize`: rounds of cost model → gaps → agents (K search agents and, given an endpoint, an LLM
coding agent, each a process in its own sandbox directory) → the sealed evaluator (one process of the installed
package per candidate) → an integration step that combines the round's accepted candidates → memory, with a Markdown and
PNG report per round; it ends in a profile that `--profile` applies (and the accepted patch, if one won). A
deployment starts from profiles validated on others of the same device type; `--resume` goes on after the
last candidate judged (SIGTERM stops a run after the candidate being judged, its round marked paused, for
`--resume` to go on); `--baseline` judges as many random profiles (best-of-N) beside the loop's result."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from specpilot.costmodel import rank_gaps
from specpilot.costmodel.measure import floors_of, measure
from specpilot.engine.config import EngineConfig, resolve_device, resolve_dtype
from specpilot.engine.engine import Engine
from specpilot.engine.cost_table import key_for, load_cost_table
from specpilot.engine.registry import MECHANISMS, NEEDS, TUNABLES, Deployment, Profile, check_tunables, open_defaults
from specpilot.memory import Memory
from specpilot.optimizer import llm_agent, remote, report, search
from specpilot.optimizer.verdicts import REPEATS, Request

EVALUATOR_TIMEOUT_S = 3600


@dataclass
class Settings:
    config: EngineConfig  # the deployment (model, drafter, device, dtype) with its tunables left at stock
    rounds: int = 2
    agents: int = 2
    per_agent: int = 1  # proposals per agent per round (the round's evaluation budget: agents x per_agent)
    dataset: str = "humaneval"
    num_prompts: int = 3
    max_new_tokens: int = 32
    repeats: int = REPEATS
    db: str = "specpilot-memory.db"
    out: str = "specpilot-optimize"
    resume: bool = False
    load: str = "B=1"
    priors: list[dict[str, Any]] = field(default_factory=list)  # profiles to try first (the device's defaults)
    llm: dict[str, Any] | None = None  # an LLM coding agent's endpoint (llm_agent.Endpoint fields), one per round
    llm_attempts: int = 3
    llm_source_chars: int = llm_agent.MAX_SOURCE_CHARS
    baseline: bool = False  # also evaluate as many random profiles as the loop evaluated (best-of-N)


STOCK: dict[str, Any] = {"mechanisms": "stock", "tunables": {}}  # the registry's stock profile (never mutated)


@dataclass
class Candidate:
    agent: str  # "search-<i>", "llm:<model>", "integration", "baseline"
    profile: dict[str, Any]
    patch: str | None = None
    parent: int | None = None  # the candidate it builds on (lineage)
    exchanges: list[dict[str, Any]] = field(default_factory=list)  # an LLM agent's prompts and responses


def plain_stock(config: EngineConfig, given: set[str]) -> tuple[EngineConfig, dict[str, Any] | None]:
    """Stock is the registry's: no mechanisms and every tunable the user left open (fields not in `given`)
    at its plain default. The device's measured defaults this undoes come back as a prior profile for
    the search to confirm (None where they undo nothing)."""
    device_defaults = open_defaults(resolve_device(config.device).type, config.speculative_algorithm)
    plain = {f: getattr(EngineConfig, f) for f, v in device_defaults.items()
             if f not in given and getattr(config, f) == v}
    names = {t.field: t.name for t in TUNABLES}
    moved = {names[f]: device_defaults[f] for f in plain if device_defaults[f] != plain[f]}
    return replace(config, **plain), ({"mechanisms": None, "tunables": moved} if moved else None)


def _space(config: EngineConfig) -> dict[str, list[Any]]:
    """The tunables that apply to this deployment, with the values worth trying."""
    device = resolve_device(config.device).type
    space = {}
    for name, values in search.VALUES.items():
        ok = [v for v in values if _valid(config, device, {"tunables": {name: v}})]
        if len(ok) > 1:
            space[name] = ok
    return space


def _valid(config: EngineConfig, device: str, profile: dict[str, Any]) -> bool:
    try:
        check_tunables(Deployment(device, Profile.parse(profile).apply(config)))
        return True
    except ValueError:
        return False


def evaluate(settings: Settings, candidate: Candidate, workdir: Path, against: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """One candidate through the sealed evaluator, a process of the installed package that imports nothing
    from its work directory; the memory's files are guarded (a candidate that writes them is rejected). It is
    timed against stock, or head to head against the profile `against`."""
    opponent = {} if against is None else {"stock": against}
    request = Request(config=settings.config.to_fields(), candidate=candidate.profile, dataset=settings.dataset,
                      num_prompts=settings.num_prompts, max_new_tokens=settings.max_new_tokens,
                      repeats=settings.repeats, patch=candidate.patch,
                      guarded=[str(Path(settings.db).resolve()), str(Path(settings.db).resolve()) + "-wal"],
                      **opponent)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "request.json"
    path.write_text(json.dumps(asdict(request)))
    proc = subprocess.run([sys.executable, *remote.PYTHON_FLAGS, "-m", "specpilot.optimizer.evaluator", str(path)],
                          cwd=workdir, capture_output=True, text=True, timeout=EVALUATOR_TIMEOUT_S)
    if proc.returncode != 0:
        return {"accepted": False, "reason": f"the evaluator failed: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _agents(briefs: list[search.Brief], llm: llm_agent.LlmBrief | None, root: Path) -> list[Candidate]:
    """Each brief to an agent in its own process and sandbox directory (search agents, and the LLM agent
    where an endpoint is given); their candidates."""
    jobs = []
    for i, brief in enumerate(briefs):
        jobs.append((search.run_agent, root / f"agent-{i}", asdict(brief)))
    if llm is not None:
        jobs.append((llm_agent.run_agent, root / "agent-llm", asdict(llm)))
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for target, sandbox, brief in jobs:
        sandbox.mkdir(parents=True, exist_ok=True)
        (sandbox / "brief.json").write_text(json.dumps(brief))
        procs.append(ctx.Process(target=target, args=(str(sandbox / "brief.json"),)))
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = []
    for i in range(len(briefs)):
        written = root / f"agent-{i}" / "proposals.json"
        out += [Candidate(f"search-{i}", p) for p in (json.loads(written.read_text()) if written.is_file() else [])]
    written = root / "agent-llm" / "proposal.json"
    if llm is not None and written.is_file():
        proposal = json.loads(written.read_text())
        out.append(Candidate(f"llm:{llm.endpoint['model']}", proposal["profile"], proposal["patch"],
                             exchanges=proposal["exchanges"]))
    return out


@dataclass
class Measured:
    """What the cost model found on the current best profile: its gaps, ranked; the values its engine runs the
    search's tunables at; the mechanisms it runs, and those off by default that could run beside them."""

    gaps: list[dict[str, Any]] = field(default_factory=list)
    current: dict[str, Any] = field(default_factory=dict)
    in_effect: list[str] = field(default_factory=list)
    optional: list[str] = field(default_factory=list)


def _measure_gaps(settings: Settings, profile: dict[str, Any]) -> Measured:
    from specpilot.bench.datasets import apply_chat_template, load_prompts

    engine = Engine.from_config(Profile.parse(profile, "the best profile").apply(settings.config))
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(settings.dataset, 1)]
    measured, context = measure(engine, prompts, settings.max_new_tokens)
    return Measured([g.as_dict() for g in rank_gaps(measured, floors_of(engine, context))], _running_values(engine),
                    sorted(engine.mechanisms), _optional_mechanisms(engine))


def _optional_mechanisms(engine: Engine) -> list[str]:
    """Mechanisms off by default that this engine's deployment can run beside its own (`two-level` only where the
    cost table it reads was profiled)."""
    deployment = Deployment(engine.device.type, engine.config, engine.drafter.capabilities if engine.drafter else None,
                            graphs=bool(engine.runner.graphs))
    names = [m.name for m in MECHANISMS if not m.by_default and m.name not in engine.mechanisms
             and m.requires(deployment) is None and all(n in engine.mechanisms for n in NEEDS.get(m.name, ()))]
    table = key_for(engine.device, engine.checkpoint.source, engine.dtype, engine.exact)
    return [n for n in names if n != "two-level" or load_cost_table(table) is not None]


def _running_values(engine: Engine) -> dict[str, Any]:
    """Each search tunable's value in this engine; the block where the profile leaves it to the drafter
    (on CPU, DFlash drafts chains of DFLASH_CPU_BLOCK), so a gap's "smaller block" starts from there."""
    fields = {t.name: t.field for t in TUNABLES}
    values = {name: getattr(engine.config, fields[name]) for name in search.VALUES}
    if values.get("block-size") is None and engine.drafter is not None:
        values["block-size"] = engine.drafter.block_size
    return {k: v for k, v in values.items() if v is not None}


def integrate(accepted: list[dict[str, Any]], best: dict[str, Any]) -> Candidate | None:
    """The accepted candidates of a round combined: every accepted profile's changes to the round's best
    (the faster one's value where two change the same tunable), with the best accepted patch, if any; None
    where there is nothing to combine (fewer than two accepted)."""
    if len(accepted) < 2:
        return None
    ranked = sorted(accepted, key=lambda r: r["speedup"]["median"])
    base = dict(best.get("tunables") or {})
    tunables = dict(base)
    mechanisms = best.get("mechanisms")
    for r in ranked:  # slowest first, so the fastest's values win
        changes = {k: v for k, v in (r["profile"].get("tunables") or {}).items() if base.get(k) != v}
        tunables |= changes
        if r["profile"].get("mechanisms") != best.get("mechanisms"):
            mechanisms = r["profile"].get("mechanisms")
    patches = [r for r in ranked if r.get("patch")]
    return Candidate("integration", {"mechanisms": mechanisms, "tunables": tunables},
                     patches[-1]["patch"] if patches else None, parent=ranked[-1]["candidate"])


def random_profiles(space: dict[str, list[Any]], n: int, seed: int, tried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best-of-N baseline's N configurations: every tunable of the space drawn at random, the step's
    mechanisms on (the loop's first move off stock)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(50 * n):
        if len(out) >= n or not space:
            break
        profile = {"mechanisms": None, "tunables": {name: rng.choice(values) for name, values in sorted(space.items())}}
        if profile not in out and profile not in tried:
            out.append(profile)
    return out


class _Loop:
    """One `optimize` call: the memory, the deployment, and the candidates judged so far."""

    def __init__(self, settings: Settings, console: Console) -> None:
        self.settings, self.console = settings, console
        self.memory = Memory(settings.db)
        interrupted = self.memory.mark_interrupted()
        if interrupted:
            console.print(f"rounds {interrupted} were left running by a process that died: marked incomplete")
        cfg = settings.config
        torch_device = resolve_device(cfg.device)
        self.device = torch_device.type
        drafter = f"{cfg.speculative_algorithm}:{cfg.speculative_draft_model_path or 'default'}"
        dtype = str(resolve_dtype(cfg.dtype, torch_device)).removeprefix("torch.")
        self.dep = self.memory.deployment(cfg.model_path or "embedded", drafter, self.device, dtype, settings.load)
        self.tried: list[dict[str, Any]] = [dict(STOCK)]
        self.patches: set[str] = set()
        # the loop's evaluations of this deployment in earlier calls: with --resume they are part of the budget
        # the baseline is given
        self.earlier = _loop_evaluations(self.memory, self.dep) if settings.resume else 0
        if settings.resume:  # go on after the last finished candidate: nothing judged is judged again
            self.tried += _judged_profiles(self.memory, self.dep)
            self.patches |= _judged_patches(self.memory, self.dep)
        self.evaluations = 0
        self.stopping = False  # SIGTERM asked for a clean stop: no candidate is started after it

    def judge(self, round_id: int, candidate: Candidate, work: Path) -> dict[str, Any] | None:
        """Record, evaluate and validate one candidate (None where it was judged before)."""
        if candidate.patch is None and candidate.profile in self.tried[1:]:
            return None
        if candidate.patch is not None and candidate.patch in self.patches and candidate.agent != "integration":
            return None
        if candidate.patch is None:
            self.tried.append(candidate.profile)
        else:
            self.patches.add(candidate.patch)
        memory = self.memory
        cid = memory.add_candidate(round_id, candidate.agent, params=candidate.profile, patch=candidate.patch,
                                   parent_id=candidate.parent)
        for exchange in candidate.exchanges:
            memory.event("llm exchange", {"candidate": cid, **exchange}, round_id)
        what = f"a patch of {len(candidate.patch.splitlines())} lines" if candidate.patch is not None else ""
        self.console.print(f"round {round_id}: candidate {cid} from {candidate.agent}: {what} "
                           f"{json.dumps(candidate.profile)}")
        verdict = evaluate(self.settings, candidate, work / f"candidate-{cid}")
        self.evaluations += 1
        memory.validate(cid, verdict["accepted"], verdict.get("reason"), verdict.get("forcing"),
                        verdict.get("speedup"), verdict.get("noise_band"))
        self.console.print(f"  -> accepted, {verdict['speedup']['median']:.3f}x stock" if verdict["accepted"]
                           else f"  -> rejected: {verdict.get('reason')}")
        return {"candidate": cid, "agent": candidate.agent, "profile": candidate.profile, "patch": candidate.patch,
                **verdict}

    def head_to_head(self, round_id: int, result: dict[str, Any], against: dict[str, Any], work: Path,
                     kind: str) -> dict[str, Any]:
        """A judged profile against another instead of stock: where two profiles' ratios to stock, each
        measured apart, are within the noise of each other, only their own interleaved pairs rank them. The
        verdict is an event of `kind` ("challenge": the round's best against the best so far, part of the
        loop's evaluations; "head-to-head": the loop's result against the baseline's, outside both)."""
        verdict = evaluate(self.settings, Candidate(result["agent"], result["profile"]),
                           work / f"{kind}-{result['candidate']}", against)
        self.evaluations += kind == "challenge"
        summary = {"candidate": result["candidate"], "profile": result["profile"], "against": against,
                   "accepted": verdict["accepted"], "reason": verdict.get("reason"), "speedup": verdict.get("speedup")}
        self.memory.event(kind, summary, round_id)
        s = verdict.get("speedup") or {}
        shown = f"{s['median']:.3f}x, >= {s['lower']:.3f}x at p = {s['p']:.3f}" if s else verdict.get("reason")
        self.console.print(f"round {round_id}: {kind}: candidate {result['candidate']} against "
                           f"{json.dumps(against)}: {'faster' if verdict['accepted'] else 'not shown faster'} ({shown})")
        return summary

    def adopts(self, round_id: int, top: dict[str, Any], best: dict[str, Any], best_patch: str | None,
               best_speedup: float, work: Path) -> dict[str, Any] | None:
        """Whether the round's top candidate becomes the best: the first one beats stock, which its acceptance
        showed; a later profile must beat the best so far head to head (a patch, which the evaluator times only
        against the installed package, by its ratio to stock). Returns the challenge, if any, else None; `top`
        gets "adopted"."""
        challenge = None
        if top["profile"] == best and top.get("patch") == best_patch:
            top["adopted"] = False
        elif best == STOCK and best_patch is None:
            top["adopted"] = True
        elif top.get("patch") is None and best_patch is None:
            challenge = self.head_to_head(round_id, top, best, work, "challenge")
            top["adopted"] = challenge["accepted"]
        else:
            top["adopted"] = top["speedup"]["median"] > best_speedup
        return challenge


def optimize(settings: Settings, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    loop = _Loop(settings, console)
    memory, dep = loop.memory, loop.dep
    # where a watcher (the terminal app) finds this run: its process group takes SIGSTOP/SIGCONT, it SIGTERM
    memory.event("optimizer started", {"pid": os.getpid(), "pgid": os.getpgrp(), "deployment": dep,
                                       "rounds": settings.rounds, "agents": settings.agents, "resume": settings.resume})
    _stop_on_sigterm(loop)
    best: dict[str, Any] = STOCK
    best_patch: str | None = None
    best_speedup = 1.0
    if settings.resume:
        best, best_patch, best_speedup = _best_so_far(memory, dep) or (best, best_patch, best_speedup)
    priors = _priors(memory, dep, loop.device)
    if priors:
        console.print(f"from memory: {len(priors)} profile(s) validated on other {loop.device} deployments are tried "
                      "first")
        memory.event("priors taken", {"profiles": priors})
    priors += [p for p in settings.priors if p not in priors]
    space = _space(settings.config)
    root = Path(settings.out)
    root.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    measured = _measure_gaps(settings, best) if settings.rounds else Measured()
    for _ in range(settings.rounds):
        if loop.stopping:
            break
        round_id = memory.start_round(dep)
        work = root / f"round-{round_id}"
        work.mkdir(parents=True, exist_ok=True)
        gaps = measured.gaps
        memory.add_gaps(round_id, _gap_rows(gaps))
        briefs = [search.Brief(space, best, gaps, priors, loop.tried, settings.per_agent, seed=1000 * round_id + i,
                               index=i, agents=settings.agents, current=measured.current,
                               in_effect=measured.in_effect, optional=measured.optional)
                  for i in range(settings.agents)]
        llm = None if settings.llm is None else llm_agent.LlmBrief(settings.llm, gaps, best, settings.llm_attempts,
                                                                     source_chars=settings.llm_source_chars)
        priors = []
        results = []
        for candidate in _agents(briefs, llm, work):
            if loop.stopping:
                break
            if r := loop.judge(round_id, candidate, work):
                results.append(r)
        if loop.stopping:
            memory.pause_round(round_id)
            console.print(f"round {round_id} paused (SIGTERM): --resume goes on after its last verdict")
            break
        accepted = [r for r in results if r["accepted"]]
        combined = integrate(accepted, best)
        if combined is not None and (r := loop.judge(round_id, combined, work)):
            results.append(r)
            accepted += [r] if r["accepted"] else []
        challenge = None
        if accepted:
            top = max(accepted, key=lambda r: r["speedup"]["median"])
            challenge = loop.adopts(round_id, top, best, best_patch, best_speedup, work)
            if top["adopted"]:
                best, best_patch, best_speedup = top["profile"], top.get("patch"), top["speedup"]["median"]
        memory.event("best so far", {"profile": best, "patch": best_patch, "speedup_over_stock": best_speedup},
                     round_id)
        memory.finish_round(round_id)
        rounds.append({"round": round_id, "gaps": gaps, "results": results, "challenge": challenge, "best": best,
                       "best_speedup_over_stock": best_speedup})
        measured = _measure_gaps(settings, best)
        gaps = measured.gaps
        # the next round stores them as its own; the last round's would be lost without this
        memory.event("gaps after", {"gaps": [{"rank": i, **g} for i, g in enumerate(_gap_rows(gaps), start=1)]},
                     round_id)
        report.write(rounds[-1], gaps, work, f"specpilot optimize, deployment {dep}, round {round_id}")
    result = {"deployment": dep, "rounds": rounds, "paused": loop.stopping, "profile": best,
              "speedup_over_stock": best_speedup,
              "evaluations": loop.evaluations, "resumed_from_memory": bool(settings.resume)}
    if settings.baseline and not loop.stopping:
        result["baseline"] = _baseline(loop, space, root, best if best_patch is None else None)
    profile_path = root / "profile.json"
    profile_path.write_text(json.dumps(best, indent=2))
    result["profile_path"] = str(profile_path)
    if best_patch:
        (root / "accepted.patch").write_text(best_patch)
        result["patch_path"] = str(root / "accepted.patch")
    return result


def _gap_rows(gaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost model's ranked gaps as the memory's gaps rows (τ's measured and best sit in the ms columns)."""
    return [{"name": g["name"], "measured_ms": g["measured"], "floor_ms": g["best"], "lost_speedup": g["lost_speedup"]}
            for g in gaps]


def _stop_on_sigterm(loop: _Loop) -> None:
    """SIGTERM sets `stopping` (the candidate being judged finishes, its verdict is kept) where this is the main
    thread; a second SIGTERM is the default one (the process ends at once)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        loop.stopping = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, stop)


def _baseline(loop: _Loop, space: dict[str, list[Any]], root: Path, found: dict[str, Any] | None) -> dict[str, Any]:
    """Best-of-N: as many random profiles as the loop judged (in this call, and with --resume in the earlier ones),
    through the same evaluator, in a round of their own; then the loop's profile (`found`, unless stock or a
    patch) against the baseline's best, head to head."""
    n = loop.evaluations + loop.earlier
    round_id = loop.memory.start_round(loop.dep)
    work = root / f"baseline-{round_id}"
    results = []
    for profile in random_profiles(space, n, seed=round_id, tried=loop.tried):
        if loop.stopping:  # SIGTERM: the baseline stops after its candidate being judged, like a round
            loop.memory.pause_round(round_id)
            return {"round": round_id, "evaluations": len(results), "paused": True}
        if r := loop.judge(round_id, Candidate("baseline", profile), work):
            results.append(r)
    accepted = [r for r in results if r["accepted"]]
    top = max(accepted, key=lambda r: r["speedup"]["median"], default=None)
    summary = {"round": round_id, "evaluations": len(results), "best": top["profile"] if top else None,
               "best_speedup_over_stock": top["speedup"]["median"] if top else 1.0}
    if top is not None and found not in (None, STOCK, top["profile"]):
        mine = {"candidate": _candidate_of(loop.memory, loop.dep, found), "agent": "loop", "profile": found}
        summary["head_to_head"] = loop.head_to_head(round_id, mine, top["profile"], work, "head-to-head")
    loop.memory.finish_round(round_id)
    return summary


def _best_so_far(memory: Memory, dep: int) -> tuple[dict[str, Any], str | None, float] | None:
    """The best as the last finished round left it (a memory from before rounds recorded it: the accepted
    profile with the best ratio to stock)."""
    rows = list(memory.db.query(
        "SELECT e.detail FROM events e JOIN rounds r ON r.id = e.round_id WHERE r.deployment_id = ? "
        "AND e.kind = 'best so far' ORDER BY e.id DESC LIMIT 1", [dep]))
    if rows:
        detail = json.loads(rows[0]["detail"])
        return detail["profile"], detail["patch"], detail["speedup_over_stock"]
    rows = list(memory.db.query(
        "SELECT c.params, v.speedup_median FROM candidates c JOIN validations v ON v.candidate_id = c.id "
        "JOIN rounds r ON r.id = c.round_id WHERE r.deployment_id = ? AND v.accepted = 1 AND c.patch IS NULL "
        "AND c.agent != 'baseline' ORDER BY v.speedup_median DESC LIMIT 1", [dep]))
    return (json.loads(rows[0]["params"]), None, rows[0]["speedup_median"]) if rows else None


def _candidate_of(memory: Memory, dep: int, profile: dict[str, Any]) -> int | None:
    """The loop's candidate that was this profile (its first judging)."""
    rows = memory.db.query(
        "SELECT c.id, c.params FROM candidates c JOIN rounds r ON r.id = c.round_id WHERE r.deployment_id = ? "
        "AND c.patch IS NULL AND c.agent != 'baseline' ORDER BY c.id", [dep])
    return next((r["id"] for r in rows if json.loads(r["params"]) == profile), None)


def _loop_evaluations(memory: Memory, dep: int) -> int:
    """The evaluator calls the loop spent on this deployment: its judged candidates and its challenges."""
    judged = memory.db.execute(
        "SELECT COUNT(*) FROM candidates c JOIN validations v ON v.candidate_id = c.id JOIN rounds r "
        "ON r.id = c.round_id WHERE r.deployment_id = ? AND c.agent != 'baseline'", [dep]).fetchone()[0]
    challenges = memory.db.execute(
        "SELECT COUNT(*) FROM events e JOIN rounds r ON r.id = e.round_id WHERE r.deployment_id = ? "
        "AND e.kind = 'challenge'", [dep]).fetchone()[0]
    return judged + challenges


def _judged_profiles(memory: Memory, dep: int) -> list[dict[str, Any]]:
    rows = memory.db.query(
        "SELECT c.params FROM candidates c JOIN validations v ON v.candidate_id = c.id JOIN rounds r "
        "ON r.id = c.round_id WHERE r.deployment_id = ? AND c.patch IS NULL", [dep])
    return [json.loads(r["params"]) for r in rows]


def _judged_patches(memory: Memory, dep: int) -> set[str]:
    rows = memory.db.query(
        "SELECT c.patch FROM candidates c JOIN validations v ON v.candidate_id = c.id JOIN rounds r "
        "ON r.id = c.round_id WHERE r.deployment_id = ? AND c.patch IS NOT NULL", [dep])
    return {r["patch"] for r in rows}


def _priors(memory: Memory, dep: int, device: str) -> list[dict[str, Any]]:
    """The best accepted profile of each other deployment on this device type."""
    rows = memory.db.query(
        "SELECT r.deployment_id, c.params, MAX(v.speedup_median) FROM candidates c "
        "JOIN validations v ON v.candidate_id = c.id JOIN rounds r ON r.id = c.round_id "
        "JOIN deployments d ON d.id = r.deployment_id WHERE v.accepted = 1 AND d.id != ? AND d.device = ? "
        "AND c.patch IS NULL AND c.agent != 'baseline' GROUP BY r.deployment_id", [dep, device])
    return [json.loads(r["params"]) for r in rows]
