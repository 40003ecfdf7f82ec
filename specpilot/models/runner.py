"""Runs the target over a ForwardBatch: eagerly, or by replaying CUDA graphs captured per
(tokens-per-request, batch-size bucket) for decode and verify passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.slot_attention import kv_splits
from specpilot.models.transformer import Transformer
from specpilot.progress import bar
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.graphs import CapturedPass, EagerReplay, GraphBackend
from specpilot.state.tree import TreeLayout, chain_layout

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class RunOutput:
    logits: torch.Tensor  # [rows, V] float32: every token's, or each request's last (see `last_only`)
    taps: torch.Tensor | None  # [T, n_taps * H] for every token
    # verify passes: the batch that ran (a graph's static batch: its bucket's rows, padding included)
    batch: ForwardBatch | None = None


class _Graph:
    """One captured pass: static inputs are views of the runner's buffers, outputs are static too."""

    def __init__(self, graph: CapturedPass | EagerReplay, batch: ForwardBatch) -> None:
        self.graph, self.batch = graph, batch
        self.logits, self.taps = graph.outputs


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, device: torch.device,
                 tap_layers: tuple[int, ...] = ()) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.tap_layers = tuple(tap_layers)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.static_inputs: dict[int, _StaticInputs] = {}

    # ---- eager ------------------------------------------------------------------------------
    def _run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, taps = self.model(batch, self.cache, self.tap_layers)
        return self.model.logits(hidden), taps

    @torch.inference_mode()
    def forward(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]],
                last_only: bool = False) -> RunOutput:
        q = len(token_lists[0])
        key = (q, self._bucket(len(slots), q))
        if key[1] and all(len(t) == q for t in token_lists) and key in self.graphs:
            return self._replay(self.graphs[key], slots, start_lens, token_lists, last_only)
        batch = ForwardBatch.build(slots, start_lens, token_lists, self.cache.max_len, self.device)
        if last_only:
            last_rows = batch.q_starts.long() + batch.q_lens.long() - 1
            hidden, taps = self.model(batch, self.cache, self.tap_layers)
            return RunOutput(self.model.logits(hidden[last_rows]), taps)
        logits, taps = self._run(batch)
        return RunOutput(logits, taps)

    @torch.inference_mode()
    def verify(self, slots: list[int], start_lens: list[int], first_tokens: list[int], drafts: torch.Tensor,
               tree: TreeLayout | None = None, laid_out: bool = False, placed: bool = False) -> RunOutput:
        """Every request verifies [its newest token, drafts[i]] (drafts: [B, K], on any device), as a
        chain or, with `tree`, as that draft tree (ancestor mask, depth positions). On the graph path the
        drafts go device-to-device into the graph's inputs, never through the host. `laid_out`: the
        device already laid these requests' verify inputs out in the graph's batch (after the last
        verify, see Engine._lay_out_next_verify); honoured unless another pass filled them since. `placed`:
        the drafts and tree are already in those inputs (Draft.placed); honoured with `laid_out`."""
        q = drafts.shape[1] + 1
        key = (q, self._bucket(len(slots), q))
        if key not in self.graphs:
            lists = [[t] + d for t, d in zip(first_tokens, drafts.tolist())]
            batch = ForwardBatch.build(slots, start_lens, lists, self.cache.max_len, self.device)
            if tree is not None:
                batch.tree_mask, batch.tree_parents = torch.empty_like(batch.positions), torch.zeros_like(batch.positions)
                batch.place_tree(TreeLayout(*(t.to(self.device) for t in vars(tree).values())))
            return RunOutput(*self._run(batch), batch)
        g, n = self.graphs[key], len(slots)
        if tree is not None and g.batch.tree_mask is None:
            raise RuntimeError(f"the verify graphs for {q} tokens were captured without tree masks")
        inputs = self.static_inputs[q]
        if not (laid_out and inputs.laid_out == g.batch.batch_size):
            inputs.fill(slots, start_lens, [[t] * q for t in first_tokens], g.batch.batch_size)
            placed = False
        inputs.laid_out = 0
        if not placed:
            g.batch.input_ids[: n * q].view(n, q)[:, 1:].copy_(drafts, non_blocking=True)
            if tree is not None:
                g.batch.place_tree(tree)
        g.graph.replay()
        return RunOutput(g.logits[: n * q], None if g.taps is None else g.taps[: n * q], g.batch)

    # ---- CUDA graphs ------------------------------------------------------------------------
    def _bucket(self, batch_size: int, q: int) -> int:
        sizes = sorted(b for (qq, b) in self.graphs if qq == q)
        return next((b for b in sizes if b >= batch_size), 0)

    @torch.inference_mode()
    def capture(self, q_lens: tuple[int, ...] = (1,), batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES,
                tree_q: int | None = None) -> None:
        """Capture one graph per (q, batch size); largest first so smaller ones reuse its memory pool.
        Graphs for `tree_q` tokens per request take tree masks (tree verification)."""
        if not GraphBackend.available(self.device):
            raise RuntimeError("CUDA graphs need a CUDA device")
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = GraphBackend.pool(self.device)
        for q in q_lens:
            self.static_inputs[q] = _StaticInputs(max_b, q, self.cache, self.device, tree=q == tree_q)
        buckets = sorted({min(b, max_b) for b in batch_sizes}, reverse=True)
        for q, b in bar([(q, b) for q in q_lens for b in buckets], "capturing the target's CUDA graphs"):
            batch = self.static_inputs[q].batch(b, kv_splits(self.device, b, self.cache.k[0].shape[2]))
            self.graphs[(q, b)] = _Graph(GraphBackend.capture(lambda batch=batch: self._run(batch), pool), batch)
        GraphBackend.synchronize(self.device)

    def _replay(self, g: _Graph, slots: list[int], start_lens: list[int], token_lists: list[list[int]],
                last_only: bool) -> RunOutput:
        n, q = len(slots), g.batch.max_q_len
        self.static_inputs[q].fill(slots, start_lens, token_lists, g.batch.batch_size)
        g.graph.replay()
        logits = g.logits[: n * q]
        if last_only:
            logits = logits[q - 1 :: q]
        taps = None if g.taps is None else g.taps[: n * q]
        return RunOutput(logits, taps)


class _StaticInputs:
    """Device input buffers of the graphs for one q (every bucket's batch is a prefix view), filled by
    one host-to-device copy per step from pinned memory. Rows past the real requests point at the
    scratch slot, so a smaller batch in a larger bucket never writes into live requests' K/V."""

    def __init__(self, max_b: int, q: int, cache: KVCache, device: torch.device, tree: bool = False) -> None:
        self.q, self.max_len, self.scratch = q, cache.max_len, cache.scratch_slot
        n = max_b * q
        self.host = torch.zeros(3 * n + 3 * max_b, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros_like(self.host, device=device)
        self.n, self.max_b = n, max_b
        self.q_starts = torch.arange(0, n, q, dtype=torch.int32, device=device)
        # tree graphs: every fill restores chain masks and parents; a verify step then lays its tree over them
        self.chain = self.tree_mask = self.tree_parents = None
        if tree:
            chain = chain_layout(torch.zeros(max_b, q - 1, dtype=torch.long, device=device))
            parents = torch.nn.functional.pad(chain.parents, (1, 0))
            self.chain = torch.stack([chain.ancestors.reshape(-1), parents.reshape(-1)])
            self.tree_mask, self.tree_parents = self.chain.clone().unbind(0)
        self._layout: dict[int, torch.Tensor] = {}
        self.fill([], [], [], max_b)
        self.laid_out = 0  # > 0: the device laid out the next verify of a bucket of this many (the engine)

    def batch(self, b: int, num_kv_splits: int) -> ForwardBatch:
        n, m, q, d = self.n, self.max_b, self.q, self.dev
        return ForwardBatch(
            input_ids=d[0 : b * q], positions=d[n : n + b * q], write_index=d[2 * n : 2 * n + b * q],
            slot_ids=d[3 * n : 3 * n + b], q_lens=d[3 * n + m : 3 * n + m + b],
            kv_lens=d[3 * n + 2 * m : 3 * n + 2 * m + b], q_starts=self.q_starts[:b], max_q_len=q,
            num_kv_splits=num_kv_splits, tree_mask=None if self.tree_mask is None else self.tree_mask[: b * q],
            tree_parents=None if self.tree_parents is None else self.tree_parents[: b * q],
        )

    def fill(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]], b: int) -> None:
        q, L = self.q, self.max_len
        pad = b - len(slots)
        starts = [*start_lens, *[0] * pad]
        slots_all = [*slots, *[self.scratch] * pad]
        ids = [t for toks in token_lists for t in toks] + [0] * (pad * q)
        pos = [s + i for s in starts for i in range(q)]
        writes = [slot * L + p for slot, s in zip(slots_all, starts) for p in range(s, s + q)]
        # one host tensor and one indexed write into the pinned buffer (small tensors cost more to make
        # than to fill: this was the largest host cost of a speculative step)
        self.laid_out = 0
        values = torch.tensor(ids + pos + writes + slots_all + [q] * b + [s + q for s in starts])
        self.host.index_copy_(0, self._rows(b), values)
        self.dev.copy_(self.host, non_blocking=self.dev.is_cuda)
        if self.tree_mask is not None:
            self.tree_mask.copy_(self.chain[0])
            self.tree_parents.copy_(self.chain[1])

    def _rows(self, b: int) -> torch.Tensor:
        """Where a bucket of b requests' values go in the buffer: ids, positions, writes (b*q each), then
        slots, q_lens, kv_lens (b each)."""
        rows = self._layout.get(b)
        if rows is None:
            n, m, q = self.n, self.max_b, self.q
            spans = ((0, b * q), (n, b * q), (2 * n, b * q), (3 * n, b), (3 * n + m, b), (3 * n + 2 * m, b))
            rows = self._layout[b] = torch.cat([torch.arange(start, start + size) for start, size in spans])
        return rows
