"""When waiting requests join the batch (`--admission coalesce`): a prefill pass stalls every running request for
its length, and under load requests end one by one, so admitting each as its slot frees costs a pass per request.
Coalescing weighs the two costs as a ski rental: a free slot left idle for t seconds loses what one request decodes
in t, a pass of P seconds what all R running requests decode in P; waiting requests are admitted once the idle
slot-seconds they have cost reach R x P (at most twice the cheapest choice in hindsight, whatever the arrivals).
P is the engine's recent prefill passes' time. Batch invariance keeps every request's tokens the same whenever it
is admitted; only when changes."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from itertools import islice

from specpilot.state.request import Request

SMOOTHING = 0.3  # weight of the latest prefill pass in the moving average of their time


class Admission:
    def __init__(self, max_prefill_batch: int, slots: int) -> None:
        """`max_prefill_batch`: waiting requests worth one pass whatever it costs (the largest prefill graph's);
        `slots`: the requests that may run at once (no more slots than that are ever free)."""
        self.max_prefill_batch = max_prefill_batch
        # when slots freed by ending requests did, oldest first, until refilled
        self.freed: deque[float] = deque(maxlen=slots)
        self.prefill_s: float | None = None  # recent prefill passes' seconds (None: none measured yet)

    def slot_freed(self, now: float | None = None) -> None:
        self.freed.append(time.perf_counter() if now is None else now)

    def filled(self, n: int) -> None:
        """n requests took free slots: the longest idle ones."""
        for _ in range(min(n, len(self.freed))):
            self.freed.popleft()

    def prefilled(self, seconds: float) -> None:
        self.prefill_s = seconds if self.prefill_s is None else SMOOTHING * seconds + (1 - SMOOTHING) * self.prefill_s

    def worth_a_pass(self, waiting: Iterable[Request], free: int, running: int, now: float | None = None) -> bool:
        """Whether to prefill the waiting requests (in admission order) that fit in `free` slots now, beside `running`
        requests."""
        waiting = list(islice(waiting, free))
        n = len(waiting)
        if not running or n >= self.max_prefill_batch or self.prefill_s is None:
            return n > 0
        now = time.perf_counter() if now is None else now
        freed = list(self.freed)[:n]
        # the j-th waiting request would fill the j-th longest idle slot: idle since the later of the two (a slot
        # free before any request ended, e.g. at start, counts from the request's arrival)
        idle = sum(now - max(req.created, freed[j] if j < len(freed) else 0.0)
                   for j, req in enumerate(waiting))
        return idle >= running * self.prefill_s
