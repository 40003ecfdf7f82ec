"""Runs the target over a ForwardBatch: eagerly, or by replaying CUDA graphs captured per
(tokens-per-request, batch-size bucket) for decode and verify passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.engine.forward_batch import ForwardBatch
from specpilot.engine.kv_cache import KVCache
from specpilot.models.transformer import Transformer

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


@dataclass
class RunOutput:
    logits: torch.Tensor  # [rows, V] float32: every token's, or each request's last (see `last_only`)
    taps: torch.Tensor | None  # [T, n_taps * H] for every token


class _Graph:
    """One captured pass: static inputs are views of the runner's buffers, outputs are static too."""

    def __init__(self, graph: torch.cuda.CUDAGraph, batch: ForwardBatch, logits: torch.Tensor,
                 taps: torch.Tensor | None) -> None:
        self.graph, self.batch, self.logits, self.taps = graph, batch, logits, taps


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, device: torch.device,
                 tap_layers: tuple[int, ...] = ()) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.tap_layers = tuple(tap_layers)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.padding: dict[int, ForwardBatch] = {}  # per q: pristine scratch-slot rows

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

    # ---- CUDA graphs ------------------------------------------------------------------------
    def _bucket(self, batch_size: int, q: int) -> int:
        sizes = sorted(b for (qq, b) in self.graphs if qq == q)
        return next((b for b in sizes if b >= batch_size), 0)

    @torch.inference_mode()
    def capture(self, q_lens: tuple[int, ...] = (1,), batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES,
                num_kv_splits: int = 1) -> None:
        """Capture one graph per (q, batch size); largest first so smaller ones reuse its memory pool."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = torch.cuda.graph_pool_handle()
        for q in q_lens:
            buffers = self._padding_batch(max_b, q, num_kv_splits)
            self.padding[q] = self._padding_batch(max_b, q, num_kv_splits)
            for b in sorted({min(b, max_b) for b in batch_sizes}, reverse=True):
                self.graphs[(q, b)] = self._capture_one(self._slice(buffers, b, q), pool)
        torch.cuda.synchronize()

    def _padding_batch(self, b: int, q: int, num_kv_splits: int) -> ForwardBatch:
        """A batch that writes only to the scratch slot: safe to run during warm-up and capture, and
        the filler for the rows of a bucket that a smaller batch leaves empty."""
        scratch, max_len = self.cache.scratch_slot, self.cache.max_len
        batch = ForwardBatch.build([scratch] * b, [0] * b, [[0] * q for _ in range(b)], max_len, self.device)
        batch.num_kv_splits = num_kv_splits
        return batch

    @staticmethod
    def _slice(full: ForwardBatch, b: int, q: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=full.input_ids[: b * q], positions=full.positions[: b * q],
            write_index=full.write_index[: b * q], slot_ids=full.slot_ids[:b], q_starts=full.q_starts[:b],
            q_lens=full.q_lens[:b], kv_lens=full.kv_lens[:b], max_q_len=q, causal=full.causal,
            num_kv_splits=full.num_kv_splits,
        )

    def _capture_one(self, batch: ForwardBatch, pool: tuple) -> _Graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: autotuning and lazy allocations happen outside the graph
                self._run(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits, taps = self._run(batch)
        return _Graph(graph, batch, logits, taps)

    def _replay(self, g: _Graph, slots: list[int], start_lens: list[int], token_lists: list[list[int]],
                last_only: bool) -> RunOutput:
        n, q = len(slots), g.batch.max_q_len
        real = ForwardBatch.build(slots, start_lens, token_lists, self.cache.max_len, self.device)
        sb, pad = g.batch, self.padding[q]
        b = sb.batch_size
        # Rows past n must point at the scratch slot again, or they would overwrite live requests' K/V.
        for name in ("input_ids", "positions", "write_index"):
            getattr(sb, name)[: n * q].copy_(getattr(real, name))
            getattr(sb, name)[n * q :].copy_(getattr(pad, name)[n * q : b * q])
        for name in ("slot_ids", "q_lens", "kv_lens"):
            getattr(sb, name)[:n].copy_(getattr(real, name))
            getattr(sb, name)[n:].copy_(getattr(pad, name)[n:b])
        g.graph.replay()
        logits = g.logits[: n * q]
        if last_only:
            logits = logits[q - 1 :: q]
        taps = None if g.taps is None else g.taps[: n * q]
        return RunOutput(logits, taps)
