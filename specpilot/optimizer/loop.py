"""`specpilot optimize`: rounds of cost model → gaps → search agents (K processes, each in its own sandbox
directory) → the sealed evaluator (one isolated process per candidate) → memory, ending in a profile that
`--profile` applies. A deployment starts from profiles validated on others of the same device type."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from specpilot.costmodel import calibrate, floors, rank_gaps, shapes_of
from specpilot.costmodel.measure import measure
from specpilot.engine.config import EngineConfig, resolve_device, resolve_dtype
from specpilot.engine.engine import Engine
from specpilot.engine.registry import TUNABLES, Deployment, Profile, check_tunables, open_defaults
from specpilot.memory import Memory
from specpilot.optimizer import search
from specpilot.optimizer.evaluator import Request, config_fields

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
    repeats: int = 3
    db: str = "specpilot-memory.db"
    out: str = "specpilot-optimize"
    resume: bool = False
    load: str = "B=1"
    priors: list[dict[str, Any]] = field(default_factory=list)  # profiles to try first (the device's defaults)


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


def evaluate(settings: Settings, profile: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One candidate through the sealed evaluator, an isolated process of the installed package."""
    request = Request(config=config_fields(settings.config), candidate=profile, dataset=settings.dataset,
                      num_prompts=settings.num_prompts, max_new_tokens=settings.max_new_tokens,
                      repeats=settings.repeats)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "request.json"
    path.write_text(json.dumps(asdict(request)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-m", "specpilot.optimizer.evaluator", str(path)], cwd=workdir,
                          capture_output=True, text=True, timeout=EVALUATOR_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        return {"accepted": False, "reason": f"the evaluator failed: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _agents(briefs: list[search.Brief], root: Path) -> list[list[dict[str, Any]]]:
    """Each brief to a search agent in its own process and sandbox directory; their proposals."""
    paths = []
    for i, brief in enumerate(briefs):
        sandbox = root / f"agent-{i}"
        sandbox.mkdir(parents=True, exist_ok=True)
        (sandbox / "brief.json").write_text(json.dumps(asdict(brief)))
        paths.append(str(sandbox / "brief.json"))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=search.run_agent, args=(p,)) for p in paths]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    written = [Path(p).parent / "proposals.json" for p in paths]
    return [json.loads(w.read_text()) if w.is_file() else [] for w in written]


def _measure_gaps(settings: Settings, profile: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """The cost model on the current best profile: its gaps, ranked."""
    from specpilot.bench.datasets import apply_chat_template, load_prompts

    engine = Engine.from_config(Profile.parse(profile, "the best profile").apply(settings.config))
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(settings.dataset, 1)]
    measured, context = measure(engine, prompts, settings.max_new_tokens)
    floor = floors(shapes_of(engine), calibrate(engine.device, engine.dtype), 1, context,
                   engine.config.cuda_graphs and engine.device.type == "cuda")
    return [g.as_dict() for g in rank_gaps(measured, floor)]


def optimize(settings: Settings, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    memory = Memory(settings.db)
    interrupted = memory.mark_interrupted()
    if interrupted:
        console.print(f"rounds {interrupted} were left running by a process that died: marked incomplete")
    cfg = settings.config
    torch_device = resolve_device(cfg.device)
    device = torch_device.type
    drafter = f"{cfg.speculative_algorithm}:{cfg.speculative_draft_model_path or 'default'}"
    dtype = str(resolve_dtype(cfg.dtype, torch_device)).removeprefix("torch.")
    dep = memory.deployment(cfg.model_path or "embedded", drafter, device, dtype, settings.load)
    best: dict[str, Any] = {"mechanisms": "stock", "tunables": {}}
    best_speedup = 1.0
    tried = [dict(best)]
    if settings.resume:
        best, best_speedup = _best_so_far(memory, dep) or (best, best_speedup)
    priors = _priors(memory, dep, device)
    if priors:
        console.print(f"from memory: {len(priors)} profile(s) validated on other {device} deployments are tried first")
        memory.event("priors taken", {"profiles": priors})
    priors += [p for p in settings.priors if p not in priors]
    space = _space(cfg)
    root = Path(settings.out)
    root.mkdir(parents=True, exist_ok=True)
    rounds = []
    for _ in range(settings.rounds):
        round_id = memory.start_round(dep)
        work = root / f"round-{round_id}"
        work.mkdir(parents=True, exist_ok=True)
        gaps = _measure_gaps(settings, best, work)
        memory.add_gaps(round_id, [{"name": g["name"], "measured_ms": g["measured"], "floor_ms": g["best"],
                                    "lost_speedup": g["lost_speedup"]} for g in gaps])
        briefs = [search.Brief(space, best, gaps, priors, tried, settings.per_agent, seed=1000 * round_id + i,
                               index=i, agents=settings.agents) for i in range(settings.agents)]
        proposals = _agents(briefs, work)
        priors = []
        results = []
        for agent, profiles in enumerate(proposals):
            for profile in profiles:
                if any(profile == t for t in tried):
                    continue
                tried.append(profile)
                cid = memory.add_candidate(round_id, f"search-{agent}", params=profile)
                console.print(f"round {round_id}: candidate {cid} from agent {agent}: {json.dumps(profile)}")
                verdict = evaluate(settings, profile, work / f"candidate-{cid}")
                memory.validate(cid, verdict["accepted"], verdict.get("reason"), verdict.get("forcing"),
                                verdict.get("speedup"), verdict.get("noise_band"))
                results.append({"candidate": cid, "profile": profile, **verdict})
                console.print(f"  -> accepted, {verdict['speedup']['median']:.3f}x stock" if verdict["accepted"]
                              else f"  -> rejected: {verdict.get('reason')}")
        accepted = [r for r in results if r["accepted"]]
        if accepted:
            top = max(accepted, key=lambda r: r["speedup"]["median"])
            # a candidate is measured against stock, so the best is the best ratio to stock seen so far
            if top["speedup"]["median"] > best_speedup:
                best, best_speedup = top["profile"], top["speedup"]["median"]
        memory.finish_round(round_id)
        rounds.append({"round": round_id, "gaps": gaps, "results": results, "best": best,
                       "best_speedup_over_stock": best_speedup})
        (work / "report.json").write_text(json.dumps(rounds[-1], indent=2))
    profile_path = root / "profile.json"
    profile_path.write_text(json.dumps(best, indent=2))
    return {"deployment": dep, "rounds": rounds, "profile": best, "profile_path": str(profile_path),
            "speedup_over_stock": best_speedup, "resumed_from_memory": bool(settings.resume)}


def _best_so_far(memory: Memory, dep: int) -> tuple[dict[str, Any], float] | None:
    rows = list(memory.db.query(
        "SELECT c.params, v.speedup_median FROM candidates c JOIN validations v ON v.candidate_id = c.id "
        "JOIN rounds r ON r.id = c.round_id WHERE r.deployment_id = ? AND v.accepted = 1 "
        "ORDER BY v.speedup_median DESC LIMIT 1", [dep]))
    return (json.loads(rows[0]["params"]), rows[0]["speedup_median"]) if rows else None


def _priors(memory: Memory, dep: int, device: str) -> list[dict[str, Any]]:
    """The best accepted profile of each other deployment on this device type."""
    rows = memory.db.query(
        "SELECT r.deployment_id, c.params, MAX(v.speedup_median) FROM candidates c "
        "JOIN validations v ON v.candidate_id = c.id JOIN rounds r ON r.id = c.round_id "
        "JOIN deployments d ON d.id = r.deployment_id WHERE v.accepted = 1 AND d.id != ? AND d.device = ? "
        "GROUP BY r.deployment_id", [dep, device])
    return [json.loads(r["params"]) for r in rows]

