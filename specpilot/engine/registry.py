"""One registry of what changes speed but never output.

A *tunable* is a setting with a domain (block size, tree top-k, prompt lookup, graph buckets, ...); a
*mechanism* is a behaviour of the speculative step's stages that is on or off (engine/step.py). Each
entry names its domain, the deployments it applies to, its default and the stages it changes, so the
CLI, a profile file, the optimizer and `/get_server_info` all read the same list. `stock` is the empty
set of mechanisms: the plain propose → verify → accept-on-the-host → commit loop.

Adding a mechanism: one `Mechanism` entry here, plus the hook in each stage it names (a test of
`name in engine.mechanisms` there).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from specpilot.drafters.base import Capabilities
from specpilot.engine.config import EngineConfig, changes_defaults, resolve_dtype

STAGES = ("propose", "plan", "verify", "accept", "commit", "prepare")
STOCK = "stock"  # --mechanisms stock: none of them
# Profiles validated for a deployment and shipped with the package (`--profile NAME`): embedded-<device>
# is what the embedded model's DFlash drafter runs with unless --profile names another.
SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "profiles"


@dataclass(frozen=True)
class Deployment:
    """What preconditions look at: the device type and the resolved config; the drafter's declared
    capabilities once it exists (None for AR)."""

    device: str
    config: EngineConfig
    capabilities: Capabilities | None = None
    graphs: bool = False  # the target's passes run as (captured) graphs


def _always(_: Deployment) -> str | None:
    return None


@dataclass(frozen=True)
class Tunable:
    name: str  # the profile's key
    field: str  # the EngineConfig field it sets
    domain: str  # for people: what values it takes
    valid: Callable[[Any], bool]
    stages: tuple[str, ...]
    # where generate / serve / bench / force leave it open: a value per (device type, algorithm); None:
    # the EngineConfig default
    default: Callable[[str, str | None], Any] | None = None
    # why a value other than its default cannot apply to this deployment (None: it can)
    applies: Callable[[Deployment], str | None] = _always
    cli: str | None = None  # the CLI flag, where it is not the field's name (SGLang's spelling)

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.field.replace("_", "-")


@dataclass(frozen=True)
class Mechanism:
    name: str
    summary: str
    stages: tuple[str, ...]
    requires: Callable[[Deployment], str | None]  # why it cannot run here (None: it can)
    by_default: bool = True  # on wherever it can run, unless a set is asked for


def _int_at_least(n: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= n


def _model_drafter(d: Deployment) -> str | None:
    alg = d.config.speculative_algorithm
    return None if alg in ("dflash", "pard") else f"needs a model drafter (dflash or pard), not {alg or 'none'}"


def _dflash(d: Deployment) -> str | None:
    return None if d.config.speculative_algorithm == "dflash" else "needs --speculative-algorithm dflash"


def _trees(d: Deployment) -> str | None:
    return _dflash(d) or (None if d.config.speculative_eagle_topk > 1 else "needs draft trees (tree-topk > 1)")


def _tree_topk_default(device: str, algorithm: str | None) -> int:
    # DFlash drafts top-4 trees on CUDA and chains on CPU, where a tree's wide verify pass costs more
    # than it gains (docs/RESULTS.md)
    return 4 if algorithm == "dflash" and device == "cuda" else 1


def _ngram_assist_default(device: str, algorithm: str | None) -> int:
    return 2 if algorithm == "dflash" else 0


TUNABLES: tuple[Tunable, ...] = (
    Tunable("block-size", "speculative_num_draft_tokens", "an integer >= 2, or null (the drafter's own)",
            lambda v: v is None or _int_at_least(2)(v), ("propose", "plan", "verify")),
    Tunable("tree-topk", "speculative_eagle_topk", "an integer >= 1 (1: a chain)", _int_at_least(1),
            ("propose", "plan", "verify", "accept"), _tree_topk_default, _dflash),
    Tunable("ngram-assist", "speculative_ngram_assist", "0 (off) or the n-gram length 1..4 that must repeat",
            lambda v: isinstance(v, int) and 0 <= v <= 4, ("propose",), _ngram_assist_default, _model_drafter),
    Tunable("lookup-prob", "speculative_lookup_prob", "a probability in (0, 1]",
            lambda v: isinstance(v, (int, float)) and 0 < v <= 1, ("propose",), applies=_trees),
    Tunable("cuda-graphs", "cuda_graphs", "true or false", lambda v: isinstance(v, bool), ("propose", "verify"),
            cli="--disable-cuda-graph"),
    Tunable("graph-batch-sizes", "cuda_graph_batch_sizes", "a list of batch sizes >= 1",
            lambda v: isinstance(v, (list, tuple)) and bool(v) and all(_int_at_least(1)(b) for b in v),
            ("propose", "verify", "accept"), cli="--cuda-graph-bs"),
    Tunable("kv-splits", "attention_kv_splits", "0 (the kernel's choice) or a number of key splits >= 1",
            _int_at_least(0), ("propose", "verify")),
    Tunable("max-prefill-tokens", "max_prefill_tokens", "an integer >= 1", _int_at_least(1), ()),
    Tunable("prefill-graph-tokens", "prefill_graph_tokens", "0 (prefills run eagerly) or the most prompt tokens a "
            "prefill pass replays a CUDA graph for (with CUDA graphs)", _int_at_least(0), ()),
    Tunable("admission", "admission", "eager (waiting requests join as slots free) or coalesce (once idle slots "
            "outweigh a prefill pass)", lambda v: v in ("eager", "coalesce"), ()),
    Tunable("prefill-waves", "min_prefill_batch", "an integer >= 1: free slots that admit a wave",
            _int_at_least(1), ()),
    Tunable("max-running-requests", "max_running_requests", "an integer >= 1, or null (the memory's)",
            lambda v: v is None or _int_at_least(1)(v), ()),
)


def _device_acceptance(d: Deployment) -> str | None:
    return None if d.capabilities is not None else "needs a drafter"


def _early_launch(d: Deployment) -> str | None:
    if d.capabilities is None or not d.capabilities.early_launch:
        return "needs a drafter that launches early (dflash)"
    return None


def _graphs(d: Deployment) -> str | None:
    return None if d.graphs else "needs CUDA graphs"


def _layout_ahead(d: Deployment) -> str | None:
    return _device_acceptance(d) or _graphs(d)


def _bf16_weights(d: Deployment) -> str | None:
    dtype = resolve_dtype(d.config.dtype, torch.device(d.device))
    return None if dtype == torch.bfloat16 else f"needs bf16 weights (--dtype bfloat16), not {dtype}"


def _confidences(d: Deployment) -> str | None:
    if d.capabilities is None or not d.capabilities.confidences:
        return "needs a drafter whose drafts carry confidences (dflash, pard)"
    return None


def _device_lookup(d: Deployment) -> str | None:
    if d.capabilities is None or not d.capabilities.device_lookup:
        return "needs a drafter that looks up on the device (dflash trees)"
    return _trees(d) or (None if d.config.speculative_ngram_assist else "needs ngram-assist > 0")


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("device-acceptance", "greedy steps accept on the device (a graph of their own); the host reads "
              "counts and tokens in one copy", ("accept",), _device_acceptance),
    Mechanism("early-launch", "after a device acceptance the drafter launches the next draft before the host "
              "syncs, so the host's commit work runs beside it", ("accept", "commit", "propose"), _early_launch),
    Mechanism("layout-ahead", "the acceptance graph lays out the next verify pass's graph inputs, so a step "
              "whose batch did not change skips the host's fill", ("accept", "plan"), _layout_ahead),
    Mechanism("device-lookup", "prompt lookup for draft trees runs on the device, inside the early launch",
              ("propose",), _device_lookup),
    # off unless asked for: its AR probes cost a little where speculation always wins (the optimizer picks it)
    Mechanism("budget", "each decode step speculates or runs AR, whichever its batch size's measured tokens per "
              "second favour (hysteresis, periodic probes), so a busy server is never slower than AR",
              ("propose", "verify"), _device_acceptance, by_default=False),
    # off unless asked for: it reads this device and model's cost table (`specpilot bench --profile-cost-table`)
    Mechanism("two-level", "each request verifies the prefix of its draft chain (or the subtree of its draft tree) "
              "that maximises the step's expected tokens per second (the drafter's calibrated confidences, the cost "
              "table T(B, rows)); trees and a graph's batch verify one width, the best captured", ("plan", "verify"),
              _confidences, by_default=False),
    # off unless asked for, as `two-level` is (only its chains verify different widths); its graphs take memory
    Mechanism("ragged", "a verify whose requests take different widths (two-level's chains) runs packed, without "
              "padding between requests, as the CUDA graph of its (batch, total rows) bucket rather than eagerly",
              ("plan", "verify"), _graphs, by_default=False),
    # on by default since the H100 measured it (docs/RESULTS.md, sessions 26-27): the AR step 2% shorter at 8B shapes
    # and 6-7% on the embedded model, the same tokens, and a server's publishing runs beside the next pass
    Mechanism("overlap", "an AR decode step launches the next pass before the host reads its tokens (inputs advanced "
              "on the device from this pass's argmax), so the host's commit runs beside it; greedy batches without "
              "grammars, banned ids, logprobs or forcing", ("commit",), _graphs),
    # off unless asked for (or the checkpoint is B12): converting the weights takes time at load
    Mechanism("b12", "the target's matrices held as B12 (12 bits a weight) and multiplied by a kernel that decodes "
              "them in registers: bf16's bits, three quarters of its bytes", ("propose", "verify"), _bf16_weights,
              by_default=False),
)
# what a mechanism needs of the others (checked when a set is asked for)
NEEDS = {"early-launch": ("device-acceptance",), "layout-ahead": ("device-acceptance",), "ragged": ("two-level",)}

_TUNABLE_BY_NAME = {t.name: t for t in TUNABLES}
_MECHANISM_BY_NAME = {m.name: m for m in MECHANISMS}
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


def parse_mechanisms(text: str, source: str = "--mechanisms") -> frozenset[str]:
    """Comma-separated names (exactly those), `stock` for none, or `+name` / `-name` entries that add to or take from
    the defaults. Raises ValueError naming `source` (the flag, or a profile's key)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == [STOCK]:
        return frozenset()
    if any(n[:1] in "+-" for n in names) and not changes_defaults(frozenset(names)):
        raise ValueError(f"{source}: either names (exactly those) or +name / -name changes to the defaults, not both")
    unknown = [n for n in names if n.lstrip("+-") not in _MECHANISM_BY_NAME]
    if unknown or not names:
        raise ValueError(f"{source}: unknown {', '.join(unknown) or 'empty list'}; choose from "
                         f"{STOCK}, {', '.join(_MECHANISM_BY_NAME)}")
    return frozenset(names)


def _changed_defaults(requested: frozenset[str], deployment: Deployment) -> frozenset[str]:
    """The defaults with `+name`s added (each must hold here) and `-name`s left out, with whatever needs them."""
    on: set[str] = set()
    for m in MECHANISMS:  # in order: a mechanism's needs come before it
        added = f"+{m.name}" in requested
        why = m.requires(deployment)
        if added and why is not None:
            raise ValueError(f"--mechanisms: +{m.name} {why}")
        missing = [n for n in NEEDS.get(m.name, ()) if n not in on]
        if added and missing:
            raise ValueError(f"--mechanisms: +{m.name} needs {', '.join(missing)}, which is left out")
        if (added or (m.by_default and why is None and f"-{m.name}" not in requested)) and not missing:
            on.add(m.name)
    return frozenset(on)


def resolve_mechanisms(requested: Iterable[str] | None, deployment: Deployment) -> frozenset[str]:
    """None: every mechanism on by default whose precondition holds here; `+name` / `-name` entries change that set.
    A set of names: exactly those, each of which must hold (ValueError naming the mechanism and why not)."""
    chosen = None if requested is None else frozenset(requested)
    if chosen is None or changes_defaults(chosen):
        return _changed_defaults(chosen or frozenset(), deployment)
    for name in sorted(chosen):
        if name not in _MECHANISM_BY_NAME:
            raise ValueError(f"--mechanisms: unknown mechanism {name!r}")
        why = _MECHANISM_BY_NAME[name].requires(deployment)
        if why is not None:
            raise ValueError(f"--mechanisms: {name} {why}")
        missing = [n for n in NEEDS.get(name, ()) if n not in chosen]
        if missing:
            raise ValueError(f"--mechanisms: {name} needs {', '.join(missing)} too")
    return chosen


def check_tunables(deployment: Deployment) -> None:
    """Every tunable's value lies in its domain and, where it differs from the default, applies here."""
    config = deployment.config
    for t in TUNABLES:
        value = getattr(config, t.field)
        if not t.valid(value):
            raise ValueError(f"{t.flag} ({t.name}) must be {t.domain}, got {value!r}")
        if value != _DEFAULTS[t.field]:
            why = t.applies(deployment)
            if why is not None:
                raise ValueError(f"{t.flag} ({t.name}) {why}")


def open_defaults(device: str, algorithm: str | None) -> dict[str, Any]:
    """The values generate / serve / bench / force take for the tunables the user leaves open (the
    settings measured fastest on each device), by EngineConfig field."""
    return {t.field: t.default(device, algorithm) for t in TUNABLES if t.default is not None}


def ar_changes(config: EngineConfig) -> dict[str, Any]:
    """The changes that make `config` plain AR decoding (token forcing's reference run): no drafter, no
    mechanisms, and every tunable that applies only with a drafter back at its default, so that
    check_tunables accepts the result."""
    changes: dict[str, Any] = {"speculative_algorithm": None, "mechanisms": frozenset()}
    ar = Deployment(config.device, replace(config, **changes))
    return changes | {t.field: _DEFAULTS[t.field] for t in TUNABLES if t.applies(ar) is not None}


def catalog(device: str, algorithm: str | None) -> dict[str, list[dict[str, Any]]]:
    """Every tunable (its flag, domain, stages and the default generate / serve / bench / force take on
    `device` for `algorithm`) and every mechanism, for `specpilot registry`."""
    defaults = _DEFAULTS | open_defaults(device, algorithm)
    return {"tunables": [{"name": t.name, "flag": t.flag, "domain": t.domain,
                          "default": _jsonable(defaults[t.field]), "stages": list(t.stages)} for t in TUNABLES],
            "mechanisms": [{"name": m.name, "stages": list(m.stages), "needs": list(NEEDS.get(m.name, ())),
                            "on_by_default": m.by_default, "summary": m.summary} for m in MECHANISMS]}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Profile:
    """A deployment's speed settings, from a JSON file: {"mechanisms": [names] or "stock", "tunables":
    {name: value}}; either key may be left out, and "validated" may say how it was (for people)."""

    mechanisms: frozenset[str] | None
    tunables: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """From a file, or a shipped profile by its name."""
        shipped = SHIPPED_PROFILES / f"{path}.json"
        if not Path(path).is_file() and shipped.is_file():
            path = shipped
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            names = ", ".join(shipped_profiles())
            raise ValueError(f"--profile {path}: no such file, nor a shipped profile ({names})") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--profile {path}: {err}") from None
        return cls.parse(raw, f"--profile {path}")

    @classmethod
    def parse(cls, raw: Any, source: str = "profile") -> Profile:
        """From the JSON value; errors name `source` (the flag and file, or the optimizer's candidate)."""
        if not isinstance(raw, dict) or set(raw) - {"mechanisms", "tunables", "validated"} or \
                not isinstance(raw.get("tunables") or {}, dict):
            raise ValueError(f"{source}: expected an object with keys mechanisms and tunables "
                             "(an object of name: value)")
        mech = raw.get("mechanisms")
        if isinstance(mech, list):
            mech = parse_mechanisms(",".join(map(str, mech)) or STOCK, f"{source}: mechanisms")
        elif mech == STOCK:
            mech = frozenset()
        elif mech is not None:
            raise ValueError(f"{source}: mechanisms must be a list of names or \"stock\"")
        tunables = raw.get("tunables") or {}
        unknown = [k for k in tunables if k not in _TUNABLE_BY_NAME]
        if unknown:
            raise ValueError(f"{source}: unknown tunables {', '.join(unknown)}; choose from "
                             f"{', '.join(_TUNABLE_BY_NAME)}")
        for name, value in tunables.items():
            t = _TUNABLE_BY_NAME[name]
            if not t.valid(value):
                raise ValueError(f"{source}: {name} must be {t.domain}, got {value!r}")
        return cls(mech, dict(tunables))

    def apply(self, config: EngineConfig) -> EngineConfig:
        values = {_TUNABLE_BY_NAME[k].field: tuple(v) if isinstance(v, list) else v for k, v in self.tunables.items()}
        if self.mechanisms is not None:
            values["mechanisms"] = self.mechanisms
        return replace(config, **values)


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in SHIPPED_PROFILES.glob("*.json"))


def embedded_profile(device: str) -> str | None:
    """The shipped profile of the embedded model with its DFlash drafter on this device type, if one is."""
    name = f"embedded-{device}"
    return name if name in shipped_profiles() else None


def in_effect(config: EngineConfig, mechanisms: Iterable[str]) -> dict[str, Any]:
    """What /get_server_info and bench JSON report: the mechanisms on and every tunable's value."""
    return {"mechanisms": sorted(mechanisms),
            "tunables": {t.name: _jsonable(getattr(config, t.field)) for t in TUNABLES}}
