"""The `budget` mechanism: speculation only where it pays, so a busy server is never slower than AR.

A decode step of B requests either speculates (draft + verify, τ tokens per request) or runs one AR pass
(one token per request). Which is faster depends on B, the requests' acceptance and the device, and shifts
as requests come and go; so the engine measures both as it serves: per batch-size bucket (powers of two),
the tokens committed per second of wall time of each mode's recent steps. A bucket not seen yet starts in the
mode of the nearest one measured. A step speculates unless
AR's rate beats speculation's, with hysteresis (the other mode must win by `margin` to switch) and a
probe of the mode not in use every `probe_every` steps of a bucket, so both rates stay current.

Lossless by construction: on the batch-invariant path an AR pass and a verify pass give a token the same
logits, so which mode decided it changes nothing (token forcing checks it); the drafter is kept in step
through AR stretches (Drafter.commit with one committed token per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.5  # weight of a step in its mode's moving averages
MARGIN = 0.05  # the mode not in use must be this much faster to take over
PROBE_EVERY = 64  # steps of a bucket between probes of the mode not in use
WARM_STEPS = 4  # steps of a bucket in its first mode before the other's first (a batch's first drafts run cold)


def bucket(batch_size: int) -> int:
    """The power of two at or below `batch_size`: steps of similar batches share their rates."""
    return 1 << (max(batch_size, 1).bit_length() - 1)


@dataclass
class _Rate:
    """Tokens and seconds of a mode's steps, each an exponential moving average: the mode in use is smoothed
    over many steps, and a single probe of the other moves its estimate most of the way."""

    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0

    @property
    def measured(self) -> bool:
        return self.count > 0

    def add(self, tokens: int, seconds: float) -> None:
        self.count += 1
        if self.count == 1:
            self.tokens, self.seconds = float(tokens), seconds
            return
        self.tokens += SMOOTHING * (tokens - self.tokens)
        self.seconds += SMOOTHING * (seconds - self.seconds)

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    speculate: bool = True  # the mode in use
    steps: int = 0
    spec: _Rate = field(default_factory=_Rate)
    ar: _Rate = field(default_factory=_Rate)


class SpeculationBudget:
    def __init__(self, margin: float = MARGIN, probe_every: int = PROBE_EVERY) -> None:
        self.margin, self.probe_every = margin, probe_every
        self.buckets: dict[int, _Bucket] = {}
        self.ar_steps = self.spec_steps = 0

    def speculate(self, batch_size: int) -> bool:
        """Whether the next decode step of `batch_size` requests speculates."""
        key = bucket(batch_size)
        b = self.buckets.get(key)
        if b is None:  # a batch size not seen yet starts in the mode its nearest measured bucket chose
            b = self.buckets[key] = _Bucket(speculate=self._nearest_mode(key))
        b.steps += 1
        in_use, other = (b.spec, b.ar) if b.speculate else (b.ar, b.spec)
        if in_use.count >= WARM_STEPS and not other.measured:  # the other mode's first step, once this has a rate
            return not b.speculate
        if b.steps % self.probe_every == 0 and b.ar.measured:
            return not b.speculate
        if b.spec.measured and b.ar.measured:
            spec, ar = b.spec.per_second, b.ar.per_second
            if b.speculate and ar > spec * (1 + self.margin):
                b.speculate = False
            elif not b.speculate and spec > ar * (1 + self.margin):
                b.speculate = True
        return b.speculate

    def _nearest_mode(self, key: int) -> bool:
        measured = [k for k, b in self.buckets.items() if b.spec.measured and b.ar.measured]
        if not measured:
            return True
        return self.buckets[min(measured, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))].speculate

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step's outcome: tokens committed over all its requests, and its wall time."""
        b = self.buckets.setdefault(bucket(batch_size), _Bucket())
        (b.spec if speculated else b.ar).add(tokens, seconds)
        if speculated:
            self.spec_steps += 1
        else:
            self.ar_steps += 1

    def as_dict(self) -> dict:
        """What /get_server_info and bench report: steps by mode, and each bucket's mode and rates."""
        return {"spec_steps": self.spec_steps, "ar_steps": self.ar_steps,
                "buckets": {str(k): {"speculate": b.speculate, "spec_tok_s": round(b.spec.per_second, 1),
                                     "ar_tok_s": round(b.ar.per_second, 1)} for k, b in sorted(self.buckets.items())}}
