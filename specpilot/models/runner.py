"""Runs the target over a ForwardBatch: eagerly, or by replaying CUDA graphs captured per
(tokens-per-request, batch-size bucket) for decode and verify passes, and for `ragged` verifies (requests of
different widths) per (batch-size bucket, total-rows bucket). A verify graph's inputs are laid out by the
speculative step's plan stage (engine/step.py); the runner only replays it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.slot_attention import kv_splits
from specpilot.models.transformer import Transformer
from specpilot.progress import bar
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.graphs import (CapturedPass, EagerReplay, GraphBackend, capture_buckets, pick_bucket,
                                    ragged_token_buckets)
from specpilot.state.static_batch import RaggedStaticBatch, StaticBatch

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class RunOutput:
    logits: torch.Tensor  # [rows, V] float32: every token's, or each request's last (see `last_only`)
    taps: torch.Tensor | None  # [T, n_taps * H] for every token
    # verify passes: the batch that ran (a graph's static batch: its bucket's rows, padding included)
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None  # [T, H] every token's final hidden state, where asked (`keep_hidden`)


class Graph:
    """One captured pass: its static batch (a view of the runner's StaticBatch for its q), static outputs."""

    def __init__(self, graph: CapturedPass | EagerReplay, batch: ForwardBatch) -> None:
        self.graph, self.batch = graph, batch
        self.logits, self.taps = graph.outputs


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, device: torch.device,
                 tap_layers: tuple[int, ...] = ()) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.tap_layers = tuple(tap_layers)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.static: dict[int, StaticBatch] = {}  # q -> the inputs of its graphs
        self.ragged: dict[tuple[int, int], Graph] = {}  # (batch bucket, rows bucket) -> a ragged verify graph
        self.ragged_inputs: RaggedStaticBatch | None = None

    # ---- eager ------------------------------------------------------------------------------
    def run(self, batch: ForwardBatch) -> RunOutput:
        hidden, taps = self.model(batch, self.cache, self.tap_layers)
        return RunOutput(self.model.logits(hidden), taps, batch)

    @torch.inference_mode()
    def forward(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]],
                last_only: bool = False, keep_hidden: bool = False) -> RunOutput:
        """`keep_hidden` (with last_only): also every token's hidden state, for logits of rows past the last
        (a prompt's own logprobs) computed apart, so the last rows' logits are the ones a pass without it gets."""
        q = len(token_lists[0])
        g = None if keep_hidden else self.graph_for(q, len(slots))
        if g is not None and all(len(t) == q for t in token_lists):
            self.static[q].fill(slots, start_lens, token_lists, g.batch.batch_size)
            out = self.replay(g, q * len(slots))
            return RunOutput(out.logits[q - 1 :: q] if last_only else out.logits, out.taps)
        batch = ForwardBatch.build(slots, start_lens, token_lists, self.cache.max_len, self.device)
        if last_only:
            last_rows = batch.q_starts.long() + batch.q_lens.long() - 1
            hidden, taps = self.model(batch, self.cache, self.tap_layers)
            return RunOutput(self.model.logits(hidden[last_rows]), taps, hidden=hidden if keep_hidden else None)
        out = self.run(batch)
        return RunOutput(out.logits, out.taps)

    # ---- CUDA graphs ------------------------------------------------------------------------
    def graph_for(self, q: int, n: int) -> Graph | None:
        """The graph of the smallest bucket that holds n requests of q tokens, if one was captured."""
        return self.graphs.get((q, pick_bucket((b for qq, b in self.graphs if qq == q), n)))

    def ragged_for(self, n: int, rows: int) -> Graph | None:
        """The ragged verify graph of the smallest buckets that hold n requests and `rows` rows, if one was captured."""
        b = pick_bucket({b for b, _ in self.ragged}, n)
        return self.ragged.get((b, pick_bucket((t for bb, t in self.ragged if bb == b), rows)))

    def ragged_rows(self, n: int) -> list[int]:
        """The row buckets of the ragged graphs that hold n requests ([]: none do)."""
        b = pick_bucket({b for b, _ in self.ragged}, n)
        return sorted(t for bb, t in self.ragged if bb == b)

    def replay(self, g: Graph, rows: int) -> RunOutput:
        """Replay a graph whose inputs are laid out; the outputs of its first `rows` rows (its requests')."""
        g.graph.replay()
        return RunOutput(g.logits[:rows], None if g.taps is None else g.taps[:rows], g.batch)

    @torch.inference_mode()
    def capture(self, q_lens: tuple[int, ...] = (1,), batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES,
                tree_qs: tuple[int, ...] = (), num_kv_splits: int = 0, ragged_q: int = 0) -> None:
        """Capture one graph per (q, batch size). Graphs for `tree_qs` tokens per request take tree masks
        (tree verification). `num_kv_splits`: attention's key splits (0: the kernel's choice per bucket).
        `ragged_q`: also ragged verify graphs of requests of 1..ragged_q rows, per batch size and rows bucket."""
        if not GraphBackend.available(self.device):
            raise RuntimeError("CUDA graphs need a CUDA device")
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = GraphBackend.pool(self.device)
        for q in q_lens:
            self.static[q] = StaticBatch(max_b, q, self.device, self.cache.scratch_slot, self.cache.max_len,
                                         tree=q in tree_qs)
        buckets = capture_buckets(batch_sizes, max_b)
        ragged = sorted(((b, t) for b in buckets for t in ragged_token_buckets(b, ragged_q)),
                        key=lambda bt: bt[1], reverse=True)  # most rows first: the others reuse its memory
        if ragged:
            self.ragged_inputs = RaggedStaticBatch(max_b, ragged[0][1], ragged_q, self.device,
                                                   self.cache.scratch_slot, self.cache.max_len)
        passes = [(q, b, None) for q in q_lens for b in buckets] + [(ragged_q, b, t) for b, t in ragged]
        for q, b, t in bar(passes, "capturing the target's CUDA graphs"):
            splits = num_kv_splits or kv_splits(self.device, b, self.cache.k[0].shape[2])
            batch = self.static[q].batch(b, splits) if t is None else self.ragged_inputs.batch(b, t, splits)
            graph = Graph(GraphBackend.capture(lambda batch=batch: self._outputs(batch), pool), batch)
            if t is None:
                self.graphs[(q, b)] = graph
            else:
                self.ragged[(b, t)] = graph
        GraphBackend.synchronize(self.device)

    def _outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.run(batch)
        return out.logits, out.taps
