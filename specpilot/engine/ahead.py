"""`overlap`: AR decode steps (of an engine without a drafter, `Engine.autoregressive()`, or the `budget`'s AR
steps) that keep the device one pass ahead of the host.

A plain AR step fills the decode graph's inputs from the host, replays it, waits for the chosen tokens and
commits them, so the device idles while the host commits and fills. Under `overlap`, once a batch's tokens are
chosen on the device (an argmax), the next pass launches at once: its inputs are this pass's advanced on the
device (each request's token in, position, cache row and key count one further), and the host then reads the
tokens (a copy queued before that launch) and commits them while the next pass runs. The next step takes that
pass's logits instead of running one.

A launched pass is used only where it still holds: the decode inputs were not filled from the host since, and
each request it decodes has committed exactly the tokens it had when the pass launched (a speculative step,
or anything else that committed, makes it stale: its rows are recomputed, writing the same K/V). Requests that
finished meanwhile are left out (their rows wasted; the others' rows move to the front on the device before
the next launch). Requests that joined (after a prefill step) decide nothing in the step that takes the pass
launched without them: that step's next pass is filled from the host with them in it (the others' chosen
tokens written in on the device), so they decide one step later than plain steps would have them. A pass runs
the same graph on the same inputs as a host-filled one, so the tokens are the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.models.runner import ModelRunner
from specpilot.state.request import Request
from specpilot.state.transfer import to_device


@dataclass
class _Launched:
    reqs: list[Request]  # the requests the pass decodes, in row order
    lengths: list[int]  # their output lengths once the tokens it decodes from were committed
    fills: int  # the decode inputs' host fills when it launched: one more since means they were replaced
    logits: torch.Tensor  # the graph's output rows for them (valid until the graph's next replay)
    taps: torch.Tensor | None  # and their tap rows, where the target keeps taps for a drafter


@dataclass
class Taken:
    """What a step takes from the launched pass: the logits (and tap) rows of the requests it still decodes
    (`kept`, their indices in the step's batch) and where those rows lie among the pass's (`rows`, on the device;
    None: its first len(kept) rows, in order), of `launched` rows in all."""

    logits: torch.Tensor
    taps: torch.Tensor | None
    kept: list[int]
    rows: torch.Tensor | None
    launched: int


class AheadDecode:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.launched: _Launched | None = None

    def can_launch(self, n: int) -> bool:
        """Whether a decode graph holds n requests (the pass just run for them was that graph's)."""
        return self.runner.graph_for(1, n) is not None

    def take(self, reqs: list[Request]) -> Taken | None:
        """The launched pass's rows for those of `reqs` it still decodes, in their order. None: no pass is
        launched, it no longer holds, or it decodes none of them. The pass is used up either way."""
        launched, self.launched = self.launched, None
        if launched is None or launched.fills != self.runner.static[1].fills:
            return None
        where = {id(r): (row, n) for row, (r, n) in enumerate(zip(launched.reqs, launched.lengths))}
        rows, kept = [], []
        for i, r in enumerate(reqs):
            row, n = where.get(id(r), (None, -1))
            if n == len(r.output_ids):
                rows.append(row)
                kept.append(i)
        if not rows:
            return None
        taps = launched.taps
        if rows == list(range(len(rows))):
            return Taken(launched.logits[: len(rows)], None if taps is None else taps[: len(rows)], kept, None,
                         len(launched.reqs))
        index = to_device(rows, launched.logits.device)
        return Taken(launched.logits.index_select(0, index), None if taps is None else taps.index_select(0, index),
                     kept, index, len(launched.reqs))

    def launch(self, reqs: list[Request], tokens: torch.Tensor, taken: Taken | None) -> None:
        """Replay the decode graph of `reqs` one token further. `tokens` ([k], on the device) are those chosen
        from the pass that just ran: for all of `reqs`, through a decode graph whose inputs hold it (`taken`
        None); or for those the launched pass still decodes (`taken`). Where those are all of `reqs`, the
        pass's inputs advance on the device, its rows moved to the front in their order first and the rest
        aimed at the scratch slot; where requests joined, the host fills the inputs (the joined requests' newest
        tokens, the others' places one further) and the chosen tokens go in on the device. `committed` must
        follow, once the tokens are committed."""
        static, n = self.runner.static[1], len(reqs)
        graph = self.runner.graph_for(1, n)
        if taken is not None and len(taken.kept) < n:
            old = set(taken.kept)
            static.fill([r.slot for r in reqs], [r.cached_len + (i in old) for i, r in enumerate(reqs)],
                        [[0] if i in old else [r.output_ids[-1]] for i, r in enumerate(reqs)], graph.batch.batch_size)
            static.input_ids[to_device(taken.kept, tokens.device)] = tokens
        else:
            if taken is not None:
                static.keep(taken.rows, n, taken.launched)
            static.advance(n, tokens)
        graph.graph.replay()
        self.launched = _Launched(list(reqs), [], static.fills, graph.logits[:n],
                                  None if graph.taps is None else graph.taps[:n])

    def committed(self) -> None:
        """The launched pass's requests have committed the tokens it decodes from."""
        if self.launched is not None:
            self.launched.lengths = [len(r.output_ids) for r in self.launched.reqs]
