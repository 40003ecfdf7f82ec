"""`overlap`: AR decode steps that keep the device one pass ahead of the host.

A plain AR step fills the decode graph's inputs from the host, replays it, waits for the chosen tokens and
commits them, so the device idles while the host commits and fills. Under `overlap`, once a batch's tokens are
chosen on the device (an argmax), the next pass launches at once: its inputs are this pass's advanced on the
device (each request's token in, position, cache row and key count one further), and the host then reads the
tokens (a copy queued before that launch) and commits them while the next pass runs. The next step takes that
pass's logits instead of running one.

A launched pass is used only where it still holds: the decode inputs were not filled from the host since, and
each request it decodes has committed exactly the tokens it had when the pass launched (a speculative step,
or anything else that committed, makes it stale: its rows are recomputed, writing the same K/V). Requests that
finished meanwhile are left out (their rows wasted); requests that joined wait for the next step. A pass runs
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


class AheadDecode:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.launched: _Launched | None = None

    def can_launch(self, n: int) -> bool:
        """Whether a decode graph holds n requests (the pass just run for them was that graph's)."""
        return self.runner.graph_for(1, n) is not None

    def take(self, reqs: list[Request]) -> tuple[torch.Tensor, list[int], bool] | None:
        """The launched pass's logits for those of `reqs` it still decodes, their indices in `reqs`, and whether
        `reqs` is exactly its batch in its order (the decode inputs then hold its pass, to launch the next from).
        None: no pass is launched, or it decodes none of them. The pass is used up either way."""
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
        if rows == list(range(len(launched.reqs))):
            return launched.logits, kept, len(kept) == len(reqs)
        return launched.logits.index_select(0, to_device(rows, launched.logits.device)), kept, False

    def launch(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        """Replay the decode graph of `reqs` one token further: `tokens` ([n], on the device) are the tokens
        chosen from the pass that just ran for exactly these requests, in order, through that same graph (whose
        inputs hold its pass). `committed` must follow, with the lengths once the tokens are committed."""
        static, n = self.runner.static[1], len(reqs)
        static.input_ids[:n].copy_(tokens)
        for field in (static.positions, static.write_index, static.kv_lens):
            field[:n] += 1
        graph = self.runner.graph_for(1, n)
        graph.graph.replay()
        self.launched = _Launched(list(reqs), [], static.fills, graph.logits[:n])

    def committed(self) -> None:
        """The launched pass's requests have committed the tokens it decodes from."""
        if self.launched is not None:
            self.launched.lengths = [len(r.output_ids) for r in self.launched.reqs]
