"""Runs the target over a ForwardBatch: eagerly, or by replaying CUDA graphs captured per
(tokens-per-request, batch-size bucket) for decode and verify passes, for `ragged` verifies (requests of
different widths) per (batch-size bucket, total-rows bucket), and for prefills of a few prompts per (prompts
bucket, prompt-tokens bucket). A verify graph's inputs are laid out by the speculative step's plan stage
(engine/step.py); the runner only replays it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.slot_attention import kv_splits
from specpilot.models.transformer import Transformer
from specpilot.progress import bar
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.graphs import (CapturedPass, EagerReplay, GraphBackend, capture_buckets, pick_bucket,
                                    prefill_token_buckets, ragged_token_buckets)
from specpilot.state.static_batch import RaggedStaticBatch, StaticBatch

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# prompts a graphed prefill takes: requests that end one by one admit the next ones a few at a time, and a
# first wave of many prompts is one long pass whose launches cost little beside its tokens
PREFILL_GRAPH_BATCH_SIZES = (1, 2, 4, 8)


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
        self.prefills: dict[tuple[int, int], Graph] = {}  # (prompts bucket, tokens bucket) -> a prefill graph
        self.prefill_inputs: RaggedStaticBatch | None = None

    # ---- eager ------------------------------------------------------------------------------
    def run(self, batch: ForwardBatch) -> RunOutput:
        hidden, taps = self.model(batch, self.cache, self.tap_layers)
        return RunOutput(self.model.logits(hidden), taps, batch)

    @torch.inference_mode()
    def forward(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]],
                last_only: bool = False, keep_hidden: bool = False) -> RunOutput:
        """`keep_hidden` (with last_only): also every token's hidden state, for logits of rows past the last
        (a prompt's own logprobs) computed apart, so the last rows' logits are the ones a pass without it gets."""
        if last_only and not keep_hidden and self.prefills:
            out = self._graphed_prefill(slots, start_lens, token_lists)
            if out is not None:
                return out
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

    def _graphed_prefill(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]]) -> RunOutput | None:
        """A last-only pass by the prefill graph of the smallest buckets that hold it (None: none does). Its
        outputs are copied out: the runner's other graphs share the memory pool and may reuse theirs."""
        total = sum(map(len, token_lists))
        b = pick_bucket({b for b, _ in self.prefills}, len(slots))
        t = pick_bucket((t for bb, t in self.prefills if bb == b), total)
        g = self.prefills.get((b, t))
        if g is None:
            return None
        self.prefill_inputs.fill(slots, start_lens, token_lists, b, t)
        g.graph.replay()
        return RunOutput(g.logits[: len(slots)].clone(), None if g.taps is None else g.taps[:total].clone())

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
                tree_qs: tuple[int, ...] = (), num_kv_splits: int = 0, ragged_q: int = 0,
                prefill_tokens: int = 0) -> None:
        """Capture one graph per (q, batch size). Graphs for `tree_qs` tokens per request take tree masks
        (tree verification). `num_kv_splits`: attention's key splits (0: the kernel's choice per bucket).
        `ragged_q`: also ragged verify graphs of requests of 1..ragged_q rows, per batch size and rows bucket.
        `prefill_tokens`: also prefill graphs (each request's last logits, every row's taps) of up to that many
        prompt tokens, per PREFILL_GRAPH_BATCH_SIZES bucket and prompt-tokens bucket."""
        if not GraphBackend.available(self.device):
            raise RuntimeError("CUDA graphs need a CUDA device")
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = GraphBackend.pool(self.device)
        for q in q_lens:
            self.static[q] = StaticBatch(max_b, q, self.device, self.cache.scratch_slot, self.cache.max_len,
                                         tree=q in tree_qs)
        buckets = capture_buckets(batch_sizes, max_b)
        spare = self.model.rope.cos.shape[0]  # the positions rows of no request may take
        ragged = sorted(((b, t) for b in buckets for t in ragged_token_buckets(b, ragged_q)),
                        key=lambda bt: bt[1], reverse=True)  # most rows first: the others reuse its memory
        if ragged:
            self.ragged_inputs = RaggedStaticBatch(max_b, ragged[0][1], ragged_q, self.device,
                                                   self.cache.scratch_slot, self.cache.max_len, spare)
        # b requests reach at most b * max_len tokens; the bucket's largest first: the others reuse its memory
        prefills = sorted(((b, t) for b in capture_buckets(PREFILL_GRAPH_BATCH_SIZES, max_b)
                           for t in prefill_token_buckets(min(prefill_tokens, b * self.cache.max_len)) if t >= b),
                          key=lambda bt: bt[::-1], reverse=True)
        if prefills:
            self.prefill_inputs = RaggedStaticBatch(max(b for b, _ in prefills), prefills[0][1], prefills[0][1],
                                                    self.device, self.cache.scratch_slot, self.cache.max_len, spare,
                                                    verify=False)
        # (where the graph goes, its key, its requests, its static batch given the key splits, what it outputs)
        passes = [(self.graphs, (q, b), b, lambda s, q=q, b=b: self.static[q].batch(b, s), self._outputs)
                  for q in q_lens for b in buckets]
        passes += [(self.ragged, (b, t), b, lambda s, b=b, t=t: self.ragged_inputs.batch(b, t, s), self._outputs)
                   for b, t in ragged]
        passes += [(self.prefills, (b, t), b, lambda s, b=b, t=t: self.prefill_inputs.batch(b, t, s), self._last_outputs)
                   for b, t in prefills]
        for graphs, key, b, inputs, outputs in bar(passes, "capturing the target's CUDA graphs"):
            batch = inputs(num_kv_splits or kv_splits(self.device, b, self.cache.k[0].shape[2]))
            graphs[key] = Graph(GraphBackend.capture(lambda batch=batch, outputs=outputs: outputs(batch), pool), batch)
        GraphBackend.synchronize(self.device)

    def _outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.run(batch)
        return out.logits, out.taps

    def _last_outputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each request's last row's logits (a bucket request that owns no rows reads the row before its start,
        which is some other row) and every row's taps."""
        hidden, taps = self.model(batch, self.cache, self.tap_layers)
        last = (batch.q_starts.long() + batch.q_lens.long() - 1).clamp(min=0)
        return self.model.logits(hidden[last]), taps
