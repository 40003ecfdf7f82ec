"""Replayed acceptance: a real drafter's passes (so a step costs what it costs) whose proposals are replaced by
the target's own continuation for a sampled number of tokens, then a wrong one, so each verify pass accepts
exactly the sampled count. The counts follow a recorded run's acceptance (`specpilot bench` JSON's
accept_histogram) or a shape scaled to a chosen τ. Every figure measured so is labelled "replayed acceptance":
the tokens are AR's, the acceptance is not the drafter's own.

A confidence trace (`RecordingDrafter`, benchmarks/record_confidences.py) also keeps, per recorded verify pass, the
drafter's confidence in each of its drafts beside how many were accepted. Replayed from it, a pass that accepts a
drafts carries the confidences of a real pass that accepted a: what two-level's level 1 reads is then as
informative as a real drafter's, not one vector for every pass."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch

from specpilot.drafters.base import Drafter, VerifySource
from specpilot.state.batch import ForwardBatch
from specpilot.state.draft import Accepted, Draft
from specpilot.state.request import Request
from specpilot.state.transfer import to_device

LABEL = "replayed acceptance"


@dataclass(frozen=True)
class AcceptTrace:
    """probs[a]: the share of verify passes that accept a drafts (a = 0 .. len(probs) - 1)."""

    probs: tuple[float, ...]
    source: str
    # a confidence trace's passes: (drafts accepted, the drafter's confidence per draft slot)
    passes: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @classmethod
    def from_histogram(cls, counts: list[int], source: str) -> AcceptTrace:
        """A bench JSON's accept_histogram: counts[n] passes committed n tokens (n - 1 drafts and the bonus)."""
        total = sum(counts[1:])
        if total <= 0:
            raise ValueError(f"{source}: the acceptance histogram counts no verify pass")
        return cls(tuple(c / total for c in counts[1:]), source)

    @classmethod
    def from_passes(cls, passes: list[tuple[int, list[float]]], source: str) -> AcceptTrace:
        """Recorded passes (drafts accepted, confidences per draft slot); the counts' shares are the trace's."""
        if not passes:
            raise ValueError(f"{source}: the confidence trace holds no pass")
        slots = len(passes[0][1])
        if any(len(c) != slots or not 0 <= a <= slots for a, c in passes):
            raise ValueError(f"{source}: every pass needs {slots} confidences and 0..{slots} drafts accepted")
        counts = [0] * (slots + 1)
        for a, _ in passes:
            counts[a] += 1
        return cls(tuple(c / len(passes) for c in counts), source, tuple((a, tuple(c)) for a, c in passes))

    @classmethod
    def load(cls, path: str | Path, dataset: str | None = None) -> AcceptTrace:
        """A confidence trace (JSON with "passes"), or a `specpilot bench` JSON's histogram (`from_bench_json`)."""
        raw = json.loads(Path(path).read_text())
        if "passes" in raw:
            return cls.from_passes(raw["passes"], f"{path} ({raw.get('dataset', 'confidence trace')})")
        return cls.from_bench_json(path, dataset)

    @classmethod
    def from_bench_json(cls, path: str | Path, dataset: str | None = None) -> AcceptTrace:
        """The accept_histogram of one dataset's result (default: the first) of a `specpilot bench` JSON."""
        results = json.loads(Path(path).read_text())["results"]
        chosen = [r for r in results if dataset is None or r["dataset"] == dataset]
        if not chosen:
            raise ValueError(f"{path}: no result for dataset {dataset!r}")
        return cls.from_histogram(chosen[0]["accept_histogram"], f"{path}:{chosen[0]['dataset']}")

    @property
    def max_accepted(self) -> int:
        return len(self.probs) - 1

    @property
    def tau(self) -> float:
        """Tokens committed per verify pass on average: accepted drafts plus the bonus."""
        return sum((a + 1) * p for a, p in enumerate(self.probs))

    def scaled_to(self, tau: float) -> AcceptTrace:
        """The same shape with survival S(a) = P(accepted >= a) raised to the power that gives `tau`."""
        if not 1.0 <= tau <= self.max_accepted + 1:
            raise ValueError(f"a trace of up to {self.max_accepted} accepted drafts reaches tau 1..{self.max_accepted + 1}, "
                             f"not {tau}")
        survival = [sum(self.probs[a:]) for a in range(1, len(self.probs))]

        def tau_at(gamma: float) -> float:
            return 1.0 + sum(s**gamma for s in survival)

        lo, hi = 1e-6, 1e6  # tau_at falls as gamma grows
        for _ in range(200):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if tau_at(mid) > tau else (lo, mid)
        scaled = [1.0] + [s**lo for s in survival] + [0.0]
        # the survival's support is unchanged, so every count drawn still has recorded passes to take confidences from
        return AcceptTrace(tuple(scaled[a] - scaled[a + 1] for a in range(len(self.probs))),
                           f"{self.source} scaled to tau {tau:g}", self.passes)

    def conditional(self) -> list[float]:
        """Per draft slot j = 1 .. max_accepted, the chance it is accepted once drafts 1 .. j-1 were: a confidence
        calibrated to the trace that knows nothing of the pass at hand (what level 1 of two-level reads)."""
        survival = [sum(self.probs[a:]) for a in range(len(self.probs))]  # P(accepted >= a)
        return [s / prev if prev > 0 else 0.0 for prev, s in zip(survival, survival[1:])]

    def sample(self, rng: random.Random) -> int:
        return rng.choices(range(len(self.probs)), weights=self.probs)[0]

    def sample_pass(self, rng: random.Random) -> tuple[int, tuple[float, ...] | None]:
        """A count of accepted drafts, and where the trace recorded passes, the confidences of one that accepted
        as many (None without)."""
        accepted = self.sample(rng)
        return accepted, rng.choice(self._by_count[accepted]) if self.passes else None

    @cached_property
    def _by_count(self) -> dict[int, list[tuple[float, ...]]]:
        by: dict[int, list[tuple[float, ...]]] = {}
        for a, confidences in self.passes:
            by.setdefault(a, []).append(confidences)
        return by


class WrappedDrafter(Drafter):
    """A drafter around `inner`, which drafts, keeps its state and compiles or captures what it runs; a chain
    drafter's (trees are refused). Early launches go to `inner` where the wrapper keeps that capability."""

    def __init__(self, inner: Drafter, early_launch: bool) -> None:
        super().__init__(inner.block_size)
        if inner.capabilities.trees:
            raise ValueError(f"{self.name} takes a chain drafter (tree-topk 1)")
        self.inner = inner
        self.tap_layers, self.source = inner.tap_layers, inner.source
        self.capabilities = replace(inner.capabilities, early_launch=early_launch and inner.capabilities.early_launch,
                                    device_lookup=False)

    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        self.inner.start(reqs, prompt_taps)

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        self.inner.commit(reqs, committed, verify_taps)

    def release(self, req: Request) -> None:
        self.inner.release(req)

    def launch_next(self, reqs: list[Request], verify: ForwardBatch, accepted: Accepted,
                    verify_taps: torch.Tensor | None) -> None:
        self.inner.launch_next(reqs, verify, accepted, verify_taps)

    def cancel_launch(self) -> None:
        self.inner.cancel_launch()

    def warm(self, max_batch: int) -> None:
        self.inner.warm(max_batch)

    def capture(self, batch_sizes: tuple[int, ...], sources: dict[tuple[int, int], VerifySource]) -> None:
        self.inner.capture(batch_sizes, sources)

    def static_draft(self, bucket: int) -> Draft | None:
        return None  # proposals are the wrapper's, not the inner drafter's graph outputs


class ReplayDrafter(WrappedDrafter):
    """`inner` drafts (its passes and their cost are real, early launches included); each request's row is then the
    reference continuation (`reference[rid]`: the target's own output, from an AR run) for a count drawn from
    `trace`, then a token that differs from the reference, then whatever `inner` drafted; its confidences are those
    of a recorded pass that accepted as many (a confidence trace's), or else the trace's `conditional` odds, the
    same for every pass. Chains only. The rows are replaced on the device from what the host knows without
    reading the draft (the reference's next tokens, the drawn counts), so the host never waits for the draft —
    as with a real drafter — and the verify pass takes them eagerly, not from a graph's outputs."""

    name = "replay"

    def __init__(self, inner: Drafter, reference: dict[str, list[int]], trace: AcceptTrace, vocab_size: int,
                 seed: int = 0) -> None:
        super().__init__(inner, early_launch=True)
        if trace.max_accepted > self.num_proposals:
            raise ValueError(f"the trace accepts up to {trace.max_accepted} drafts; blocks here hold {self.num_proposals}")
        self.reference, self.trace, self.vocab = reference, trace, vocab_size
        self.confidences = self._padded(trace.conditional())
        self.rng = random.Random(seed)
        self.capabilities = replace(self.capabilities, confidences=True)

    def propose(self, reqs: list[Request]) -> Draft:
        draft = self.inner.propose(reqs)
        drafted = draft.tokens[: len(reqs)]
        k = drafted.shape[1]
        windows, accepts, confidences = [], [], []
        for req in reqs:
            ref = self.reference[req.rid][len(req.output_ids) : len(req.output_ids) + k]
            accept, recorded = self.trace.sample_pass(self.rng)
            accepts.append(min(accept, len(ref)))
            windows.append([*ref, *[-1] * (k - len(ref))])  # past the reference's end: no token matches -1
            confidences.append((self.confidences if recorded is None else self._padded(recorded))[:k])
        device = drafted.device
        ref, accept = to_device(windows, device), to_device(accepts, device)[:, None]
        slot = torch.arange(k, device=device)
        missed = (slot == accept) & (drafted == ref)  # the draft after the accepted ones must miss
        tokens = torch.where(slot < accept, ref, torch.where(missed, (ref + 1) % self.vocab, drafted))
        return Draft(tokens.to(drafted.dtype), to_device(confidences, device, torch.float32))

    def _padded(self, confidences: Sequence[float]) -> list[float]:
        return [*confidences] + [0.0] * (self.num_proposals - len(confidences))


class RecordingDrafter(WrappedDrafter):
    """`inner` drafting as it does; per request and verify pass, its confidence in each of its drafts and how many
    the target accepted (`passes`: a confidence trace, what `AcceptTrace.from_passes` replays). A pass counts once
    its request drafts again, so a request's last pass, which its end may have cut short, never does. Record with
    every draft verified (stock mechanisms: no budget or two-level trimming the chain)."""

    name = "recording"

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner, early_launch=False)  # it reads each draft's confidences on the host
        if not inner.capabilities.confidences:
            raise ValueError(f"{inner.name} gives no confidences to record")
        self.passes: list[tuple[int, tuple[float, ...]]] = []
        self._proposed: dict[str, tuple[float, ...]] = {}  # per request: the confidences of its newest draft
        self._committed: dict[str, tuple[int, tuple[float, ...]]] = {}  # its newest verified pass, not yet counted

    def propose(self, reqs: list[Request]) -> Draft:
        draft = self.inner.propose(reqs)
        for req, confidences in zip(reqs, draft.confidences[: len(reqs)].tolist()):
            if req.rid in self._committed:
                self.passes.append(self._committed.pop(req.rid))
            self._proposed[req.rid] = tuple(confidences)
        return draft

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        for req, tokens in zip(reqs, committed):
            if req.rid in self._proposed:
                self._committed[req.rid] = (tokens - 1, self._proposed.pop(req.rid))  # drafts: all but the bonus
        super().commit(reqs, committed, verify_taps)

    def release(self, req: Request) -> None:
        self._proposed.pop(req.rid, None)
        self._committed.pop(req.rid, None)
        super().release(req)
