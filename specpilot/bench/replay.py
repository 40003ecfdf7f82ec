"""Replayed acceptance: a real drafter's passes (so a step costs what it costs) whose proposals are replaced by
the target's own continuation for a sampled number of tokens, then a wrong one, so each verify pass accepts
exactly the sampled count. The counts follow a recorded run's acceptance (`specpilot bench` JSON's
accept_histogram) or a shape scaled to a chosen τ. Every figure measured so is labelled "replayed acceptance":
the tokens are AR's, the acceptance is not the drafter's own."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specpilot.drafters.base import Drafter, VerifySource
from specpilot.state.draft import Draft
from specpilot.state.request import Request

LABEL = "replayed acceptance"


@dataclass(frozen=True)
class AcceptTrace:
    """probs[a]: the share of verify passes that accept a drafts (a = 0 .. len(probs) - 1)."""

    probs: tuple[float, ...]
    source: str

    @classmethod
    def from_histogram(cls, counts: list[int], source: str) -> AcceptTrace:
        """A bench JSON's accept_histogram: counts[n] passes committed n tokens (n - 1 drafts and the bonus)."""
        total = sum(counts[1:])
        if total <= 0:
            raise ValueError(f"{source}: the acceptance histogram counts no verify pass")
        return cls(tuple(c / total for c in counts[1:]), source)

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
        return AcceptTrace(tuple(scaled[a] - scaled[a + 1] for a in range(len(self.probs))),
                           f"{self.source} scaled to tau {tau:g}")

    def conditional(self) -> list[float]:
        """Per draft slot j = 1 .. max_accepted, the chance it is accepted once drafts 1 .. j-1 were: a confidence
        calibrated to the trace that knows nothing of the pass at hand (what level 1 of two-level reads)."""
        survival = [sum(self.probs[a:]) for a in range(len(self.probs))]  # P(accepted >= a)
        return [s / prev if prev > 0 else 0.0 for prev, s in zip(survival, survival[1:])]

    def sample(self, rng: random.Random) -> int:
        return rng.choices(range(len(self.probs)), weights=self.probs)[0]


class ReplayDrafter(Drafter):
    """`inner` drafts (its passes and their cost are real); each request's row is then the reference
    continuation (`reference[rid]`: the target's own output, from an AR run) for a count drawn from `trace`,
    then a token that differs from the reference, then whatever `inner` drafted; its confidences are the trace's
    (`AcceptTrace.conditional`, the same for every pass). Chains only; no early launch (each proposal is replaced
    on the host, and placed in the verify pass eagerly, not by a graph)."""

    name = "replay"

    def __init__(self, inner: Drafter, reference: dict[str, list[int]], trace: AcceptTrace, vocab_size: int,
                 seed: int = 0) -> None:
        super().__init__(inner.block_size)
        if inner.capabilities.trees:
            raise ValueError("replayed acceptance takes a chain drafter (tree-topk 1)")
        if trace.max_accepted > self.num_proposals:
            raise ValueError(f"the trace accepts up to {trace.max_accepted} drafts; blocks here hold {self.num_proposals}")
        self.inner, self.reference, self.trace, self.vocab = inner, reference, trace, vocab_size
        odds = trace.conditional()
        self.confidences = odds + [0.0] * (self.num_proposals - len(odds))
        self.rng = random.Random(seed)
        self.tap_layers, self.source = inner.tap_layers, inner.source
        self.capabilities = replace(inner.capabilities, early_launch=False, device_lookup=False, confidences=True)

    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        self.inner.start(reqs, prompt_taps)

    def propose(self, reqs: list[Request]) -> Draft:
        draft = self.inner.propose(reqs)
        rows = draft.tokens[: len(reqs)].tolist()
        for row, req in zip(rows, reqs):
            ref = self.reference[req.rid][len(req.output_ids) :]
            accept = min(self.trace.sample(self.rng), len(ref))
            row[:accept] = ref[:accept]
            if accept < min(len(row), len(ref)) and row[accept] == ref[accept]:  # the next draft must miss
                row[accept] = (ref[accept] + 1) % self.vocab
        tokens = torch.tensor(rows, dtype=draft.tokens.dtype, device=draft.tokens.device)
        confidences = torch.tensor([self.confidences[: tokens.shape[1]]] * len(reqs), device=tokens.device)
        return Draft(tokens, confidences)

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        self.inner.commit(reqs, committed, verify_taps)

    def release(self, req: Request) -> None:
        self.inner.release(req)

    def warm(self, max_batch: int) -> None:
        self.inner.warm(max_batch)

    def capture(self, batch_sizes: tuple[int, ...], sources: dict[int, VerifySource]) -> None:
        self.inner.capture(batch_sizes, sources)

    def static_draft(self, bucket: int) -> Draft | None:
        return None  # proposals are new tensors, not the inner drafter's graph outputs
