"""The search agent: proposes parameter sets (profiles) over the registry's tunables and mechanisms,
steered by the ranked gaps (the largest first) and seeded by priors from memory, with random moves
beside them. It runs in a process of its own and sees only what it is given: the space, the gaps, the
current best profile and the priors - never the evaluator's prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Values tried per tunable, where it applies (engine/registry.py's domains, narrowed to what is worth a run).
VALUES: dict[str, list[Any]] = {
    "block-size": [2, 3, 4, 6, 8, 12, 16],
    "tree-topk": [1, 2, 4],
    "ngram-assist": [0, 1, 2, 3],
    "lookup-prob": [0.5, 0.7, 0.9],
}
# Which tunables move a gap, and which way first (-1: smaller values, +1: larger).
GAP_MOVES: dict[str, list[tuple[str, int]]] = {
    "verify": [("block-size", -1), ("tree-topk", -1)],
    "draft": [("block-size", -1)],
    "acceptance (tau)": [("block-size", +1), ("tree-topk", +1), ("ngram-assist", +1)],
    "host and overhead": [("block-size", +1)],
}
# Which mechanisms off by default answer a gap: verifying fewer drafts (two-level; ragged, which keeps its chains
# ragged under graphs), or none where AR is faster (budget).
GAP_MECHANISMS: dict[str, list[str]] = {"verify": ["two-level", "ragged", "budget"]}


@dataclass
class Brief:
    """What an agent is told."""

    space: dict[str, list[Any]]  # tunable -> the values that apply to this deployment
    best: dict[str, Any]  # the current best profile (starts as stock's)
    gaps: list[dict[str, Any]]  # ranked, largest lost speedup first
    priors: list[dict[str, Any]]  # profiles validated on matching deployments
    tried: list[dict[str, Any]]  # profiles already evaluated (not proposed again)
    count: int
    seed: int
    index: int = 0  # this agent's place among `agents`: the guided moves are dealt out between them
    agents: int = 1
    # each tunable's value where `best` leaves it open: what the deployment runs with (CPU DFlash: block 4)
    current: dict[str, Any] = field(default_factory=dict)
    in_effect: list[str] = field(default_factory=list)  # the mechanisms the best profile runs
    optional: list[str] = field(default_factory=list)  # mechanisms off by default that could run beside them


def _key(profile: dict[str, Any]) -> str:
    return json.dumps(profile, sort_keys=True)


def _step(space: dict[str, list[Any]], tunables: dict[str, Any], name: str, direction: int,
          current: dict[str, Any]) -> dict[str, Any] | None:
    """One value along `name` from where the profile stands (its own value, else the deployment's)."""
    values = space.get(name)
    if not values:
        return None
    at = tunables.get(name, current.get(name, values[0]))
    # the nearest tried value that way (`at` may lie between them)
    side = [v for v in values if (v < at if direction < 0 else v > at)]
    if not side:
        return None
    return tunables | {name: side[-1] if direction < 0 else side[0]}


def propose(brief: Brief) -> list[dict[str, Any]]:
    """Up to `count` new profiles: priors first, then gap-guided steps from the best (every `agents`-th
    of them, from this agent's `index` on, so parallel agents explore different moves), then random moves."""
    rng = random.Random(brief.seed)
    seen = {_key(p) for p in brief.tried} | {_key(brief.best)}
    out: list[dict[str, Any]] = []

    def offer(profile: dict[str, Any]) -> None:
        if len(out) < brief.count and _key(profile) not in seen:
            seen.add(_key(profile))
            out.append(profile)

    tunables = dict(brief.best.get("tunables") or {})
    mechanisms = brief.best.get("mechanisms")
    guided = list(brief.priors)
    if mechanisms == "stock":  # the step's mechanisms are the first move off stock
        guided.append({"mechanisms": None, "tunables": tunables})
    for gap in brief.gaps:
        for name, direction in GAP_MOVES.get(gap["name"], []):
            moved = _step(brief.space, tunables, name, direction, brief.current)
            if moved is not None:
                guided.append({"mechanisms": mechanisms, "tunables": moved})
        if mechanisms != "stock":  # beside the mechanisms the best runs (its list, or the defaults in effect)
            running = set(brief.in_effect if mechanisms is None else mechanisms)
            for name in GAP_MECHANISMS.get(gap["name"], []):
                if name in brief.optional and name not in running:
                    guided.append({"mechanisms": sorted(running | {name}), "tunables": tunables})
    unique = list({_key(p): p for p in guided}.values())
    for profile in unique[brief.index :: brief.agents]:
        offer(profile)
    names = sorted(brief.space)
    for _ in range(50 * brief.count):
        if len(out) >= brief.count or not names:
            break
        name = rng.choice(names)
        offer({"mechanisms": mechanisms, "tunables": tunables | {name: rng.choice(brief.space[name])}})
    return out


def run_agent(brief_path: str) -> None:
    """A search agent's process: read its brief from its sandbox, write its proposals beside it."""
    path = Path(brief_path)
    brief = Brief(**json.loads(path.read_text()))
    (path.parent / "proposals.json").write_text(json.dumps(propose(brief)))
