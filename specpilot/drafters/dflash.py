"""DFlash block drafter: drafts a block per request in one pass of the DFlash model (dflash_model.py).

The model and its checkpoint format: dflash_model.py.

Per request the drafter keeps context K/V, one entry per committed token, computed from the target's
tap features (concat -> fc -> RMSNorm, then each layer's k/v projections). A draft is one non-causal
pass over the block [newest committed token, mask x (B-1)] whose queries see the whole context and the
whole block; output slot k predicts the token at slot k. Block K/V are written past the context and
are overwritten by the next round, so dropping them costs nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specpilot.drafters.base import Capabilities, Drafter, DraftTarget, VerifySource
from specpilot.drafters.device_lookup import DeviceLookup
from specpilot.drafters.dflash_model import DFlashConfig, DFlashModel, load_dflash_model, read_dflash_config
from specpilot.drafters.draft_tree import TreeBuilder, node_confidences
from specpilot.kernels.slot_attention import kv_splits
from specpilot.kernels.softmax_topk import softmax_topk
from specpilot.kernels.step_layout import lay_out_draft
from specpilot.models.linear import Linear, use_cpu_layout, warm_linears
from specpilot.models.rope import RotaryTable
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.pages import PageTable
from specpilot.state.draft import Accepted, Draft
from specpilot.state.graphs import CapturedPass, EagerReplay, GraphBackend, capture_buckets, pick_bucket
from specpilot.state.request import Request
from specpilot.state.static_batch import StaticBatch
from specpilot.state.transfer import to_device
from specpilot.state.tree import TreeLayout


class DFlashDrafter(Drafter):
    """Context K/V of the committed tokens are appended in the same pass that drafts the next block,
    so one step is one (graph-capturable) pass: [pending context rows ; block rows]. Pending rows
    are the verify rows of the previous step; rows that were not committed write to the scratch slot."""

    name = "dflash"

    def __init__(self, model: DFlashModel, cfg: DFlashConfig, target: DraftTarget, pages: PageTable,
                 context_length: int, device: torch.device, dtype: torch.dtype, block_size: int | None = None,
                 topk: int = 1, lookup_prob: float = 0.9, num_kv_splits: int = 0) -> None:
        """`lookup_prob`: the probability a tree gives prompt lookup's tokens when it merges them into the
        slots' top-k; `num_kv_splits`: attention's key splits in the drafter's graphs (0: the kernel's)."""
        super().__init__(block_size or cfg.block_size)
        self.capabilities = Capabilities(early_launch=True, trees=topk > 1, confidences=True, device_lookup=topk > 1,
                                         graphs=True)
        self.num_kv_splits = num_kv_splits
        tcfg = target.config
        if cfg.layers.hidden_size != tcfg.hidden_size:
            raise ValueError(f"DFlash drafter hidden size {cfg.layers.hidden_size} != target's {tcfg.hidden_size}")
        if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
            raise ValueError(f"DFlash mask_token_id {cfg.mask_token_id} outside the target vocabulary")
        if any(not 0 <= i < tcfg.num_layers for i in cfg.target_layer_ids):
            raise ValueError(f"DFlash target_layer_ids {cfg.target_layer_ids} outside the target's layers")
        self.cfg, self.target, self.model, self.device = cfg, target, model, device
        self.tap_layers = tuple(cfg.target_layer_ids)
        # every layer's k/v rows of qkv_proj stacked: the context rows' K/V of all layers in one projection
        kv_rows = [layer.self_attn.qkv_proj.weight[layer.self_attn.q_size :] for layer in model.layers]
        with torch.device("meta"):
            self.context_kv = Linear(cfg.layers.hidden_size, sum(w.shape[0] for w in kv_rows))
        self.context_kv.weight = nn.Parameter(torch.cat(kv_rows), requires_grad=False)
        if device.type == "cpu":
            use_cpu_layout(self.model)
            use_cpu_layout(self.context_kv)
        # the target's slots and pages (room for the block past the longest context)
        self.cache = KVCache(cfg.layers.num_layers, cfg.layers.num_kv_heads, cfg.layers.head_dim, dtype, pages)
        self.rope = RotaryTable(cfg.layers.head_dim, cfg.layers.rope_theta, cfg.layers.rope_scaling,
                                context_length + self.block_size, device)
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}  # rid -> (verify-row taps, rows committed)
        self.graphs: dict[int, DraftGraph] = {}
        # launch_next's draft: (its requests' ids, the graph that ran it or None, its outputs, its tree's parts if built)
        self._launched: tuple[list[str], DraftGraph | None, tuple[torch.Tensor, ...], TreeParts | None] | None = None
        # topk > 1: the block's slots' top-k become a tree of block_size - 1 nodes (same verify width)
        k = self.num_proposals
        self.tree = TreeBuilder(topk, k, k, device) if topk > 1 else None
        self.lookup_prob = lookup_prob
        # a tree's drafts carry each node's confidence (its token's probability at its slot) where asked for
        # (`two-level`; before capture): a few more kernels in the tree pass
        self.tree_confidences = False
        # `attach_lookup` (before capture): prompt lookup on the device, so an early launch builds the tree too
        self.device_lookup: DeviceLookup | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, target: DraftTarget, pages: PageTable, context_length: int,
                        device: torch.device, dtype: torch.dtype, **settings: float | int | None) -> DFlashDrafter:
        """`settings`: the constructor's block_size, topk, lookup_prob and num_kv_splits."""
        path = Path(path)
        cfg = read_dflash_config(path)
        return cls(load_dflash_model(path, cfg, device, dtype), cfg, target, pages, context_length, device,
                   dtype, **settings)

    def attach_lookup(self, min_n: int, max_n: int) -> DeviceLookup:
        self.device_lookup = DeviceLookup(self.cache.num_slots, self.cache.max_len, self.num_proposals, min_n, max_n,
                                          self.device)
        return self.device_lookup

    # ---- protocol ---------------------------------------------------------------------------
    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        """Prompt context is ragged and long: written eagerly, once."""
        self.extend_context(reqs, prompt_taps, [0] * len(reqs))

    @torch.inference_mode()
    def extend_context(self, reqs: list[Request], taps: list[torch.Tensor], starts: list[int]) -> None:
        """The context rows of tokens a target ran outside a verify pass: request i's taps[i] are those of its
        positions starts[i] onwards (a whole prompt from 0, or a chunk of one another engine prefilled)."""
        spans = [range(s, s + t.shape[0]) for t, s in zip(taps, starts)]
        positions = [p for span in spans for p in span]
        rows = [r.slot * self.cache.max_len + p for r, span in zip(reqs, spans) for p in span]
        self._write_context(torch.cat(taps), to_device(positions, self.device), to_device(rows, self.device))

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        """The committed rows' context is written by the next draft pass; rows a pass never took (a second
        commit with no draft between: AR steps while speculation is paused) are written now, eagerly."""
        held = [(r, *self.pending[r.rid], n) for r, n in zip(reqs, committed)
                if r.rid in self.pending and self.pending[r.rid][0] is not None and self.pending[r.rid][1]]
        if held:  # their tokens end where this commit's begin (req.cached_len - n)
            spans = [(r, range(r.cached_len - n - c, r.cached_len - n)) for r, _, c, n in held]
            positions = [p for _, span in spans for p in span]
            rows = [r.slot * self.cache.max_len + p for r, span in spans for p in span]
            self._write_context(torch.cat([taps[:c] for _, taps, c, _ in held]), to_device(positions, self.device),
                                to_device(rows, self.device))
        for req, n, taps in zip(reqs, committed, verify_taps):
            self.pending[req.rid] = (taps, n)

    def release(self, req: Request) -> None:
        self.pending.pop(req.rid, None)

    @torch.inference_mode()
    def launch_next(self, reqs: list[Request], verify: ForwardBatch, accepted: Accepted,
                    verify_taps: torch.Tensor | None) -> None:
        """Instead of `commit` after a greedy verify: start the next block's draft on the device before
        the host has seen this step's tokens. `verify` is the verify pass's batch (its first
        len(reqs) requests are `reqs`), `accepted` its device-side acceptance, `verify_taps` its taps
        with accepted rows first. The next `propose` for these requests (or the ones still running)
        finishes this draft instead of drafting anew. After a verify graph (of any width), two graph replays; a
        tree drafter with a device lookup builds the tree too (a third). Other verifies of a captured bucket lay
        the inputs out eagerly, then replay the graphs."""
        b = verify.batch_size
        graph = self.graphs.get(b)
        early_tree = self.tree is not None and self.device_lookup is not None
        tree = None
        prep = None if graph is None else graph.prep_for(verify, accepted, verify_taps)
        if graph is not None:
            if prep is not None:
                prep.replay()
            else:  # outputs of no verify graph (a ragged verify's gathered ones): laid out eagerly, a few kernels
                graph.lay_out(self, b, (verify, accepted, verify_taps))
            graph.graph.replay()
            outputs = graph.outputs
            if early_tree:
                graph.tree_graph.replay()
                tree = graph.tree_graph.outputs
        else:
            graph, inputs = None, DraftInputs(self, b)
            hint = self._prep(inputs, b, verify, accepted, verify_taps)
            outputs = self._body_pass(inputs, b)
            if early_tree:
                tree = self._tree_pass(*outputs, hint)
        self._launched = ([r.rid for r in reqs], graph, outputs, tree)

    def cancel_launch(self) -> None:
        """The host committed other tokens than the launched draft assumed (token forcing substitutes
        stock's): the next `propose` drafts anew. The context rows it wrote stay valid or are rewritten."""
        self._launched = None

    @torch.inference_mode()
    def propose(self, reqs: list[Request]) -> Draft:
        """A tree drafter with a device lookup merges the lookup's proposal ([n, K + 1]: a use flag, then K
        tokens per request) into each slot's top-k (draft_tree.merge_lookup)."""
        launched = self._take_launched(reqs)
        graph, outputs, tree = launched or (*self._launch_pending(reqs), None)
        n = len(reqs)
        if self.tree is None:
            return Draft(outputs[0][:n], outputs[1][:n])
        hint = None
        if self.device_lookup is not None:
            if launched is not None:  # the launch appended these requests' newest tokens on the device
                self.device_lookup.mark_synced(reqs)
            else:
                self.device_lookup.sync(reqs)
                hint = self.device_lookup.lookup(reqs)
        if tree is None:
            tree = self._tree_pass(*(t[:n] for t in outputs), hint) if graph is None else graph.replay_tree(hint, n)
        return _tree_draft(tree, n, None if graph is None else graph.bucket)

    # ---- the pass -----------------------------------------------------------------------------
    def _take_launched(self, reqs: list[Request]) -> tuple[DraftGraph | None, tuple[torch.Tensor, ...], TreeParts | None] | None:
        """The launched draft's outputs (and tree, if built) with rows for `reqs`, if it covered every one
        of them (requests that finished since are dropped: their rows are gathered out, in place)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        rids, graph, outputs, tree = launched
        if rids == [r.rid for r in reqs]:  # the same requests (most steps): its rows as they are
            return graph, outputs, tree
        where = {rid: i for i, rid in enumerate(rids)}
        rows = [where.get(r.rid) for r in reqs]
        if None in rows:
            return None  # a new request joined: draft everyone anew (the launched pass wrote their context)
        if rows != list(range(len(rows))):
            index = to_device(rows, self.device)  # asynchronous: the launched draft may still run
            for t in (*outputs, *(tree or ())):
                t[: len(rows)] = t.index_select(0, index)
        return graph, outputs, tree

    def _launch_pending(self, reqs: list[Request]) -> tuple[DraftGraph | None, tuple[torch.Tensor, ...]]:
        """Draft from the committed rows `commit` left (per request: its verify rows' taps and how many of
        them were committed; nothing for requests whose context is already written)."""
        n, B = len(reqs), self.block_size
        width = len(self.tap_layers) * self.cfg.layers.hidden_size
        counts, feats, blank = [], [], None
        for req in reqs:
            taps, c = self.pending.pop(req.rid, (None, 0))
            counts.append(c)
            if taps is None:  # nothing committed: one block of zeros serves every such request
                if blank is None:
                    blank = self.target.embed_tokens.weight.new_zeros(B, width)
                taps = blank
            elif taps.shape[0] < B:  # a verify pass shorter than the block (e.g. requests near their end)
                taps = torch.cat([taps, taps.new_zeros(B - taps.shape[0], width)])
            feats.append(taps[:B])
        bucket = pick_bucket(self.graphs, n)
        graph = self.graphs.get(bucket)
        inputs = graph.inputs if graph is not None else DraftInputs(self, n)
        pad = (bucket or n) - n  # padding requests: the scratch slot, nothing committed
        meta = to_device([[r.cached_len - c for r, c in zip(reqs, counts)] + [0] * pad,
                          [r.slot for r in reqs] + [self.cache.scratch_slot] * pad, counts + [0] * pad,
                          [r.output_ids[-1] for r in reqs] + [0] * pad], self.device)
        self._lay_out(inputs, n + pad, *meta)
        inputs.feats[: n * B].copy_(torch.cat(feats))
        if graph is None:
            return None, self._body_pass(inputs, n)
        graph.graph.replay()
        return graph, graph.outputs

    def _lay_out(self, inputs: DraftInputs, b: int, starts: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                 first: torch.Tensor) -> None:
        """Device-side (graph-capturable) inputs of a pass for b requests: request i wrote counts[i]
        context rows at starts[i] + j (its first counts[i] feature rows; the rest go to the scratch
        slot), and drafts the block [first[i], masks] at starts[i] + counts[i]."""
        n = b * self.block_size
        lay_out_draft(inputs.ctx_positions[:n], inputs.ctx_rows[:n], inputs.positions[:n], inputs.write_index[:n],
                      inputs.kv_lens[:b], inputs.slot_ids[:b], inputs.input_ids[:n], starts, slots, counts, first,
                      self.cache.max_len, self.cache.scratch_slot)

    def _prep(self, inputs: DraftInputs, b: int, verify: ForwardBatch, accepted: Accepted,
              verify_taps: torch.Tensor | None) -> torch.Tensor | None:
        """On the device, from a verify batch of b requests and its acceptance: the next pass's inputs,
        and with a device lookup, the accepted tokens appended to its history and the lookup's hint."""
        self._lay_out(inputs, b, accepted.starts, verify.slot_ids, accepted.counts, accepted.bonus())
        if verify_taps is not None:  # q rows per request (fewer than the block where `two-level` trimmed it)
            q = verify_taps.shape[0] // b
            inputs.feats[: b * self.block_size].view(b, self.block_size, -1)[:, :q].copy_(verify_taps.view(b, q, -1))
        if self.device_lookup is None or self.tree is None:
            return None
        return self.device_lookup.append_and_lookup(verify.slot_ids, accepted)

    def _write_context(self, feats: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        ctx = self.model.hidden_norm(self.model.fc(feats))
        kv = self.context_kv(ctx)
        rows = self.cache.pages.physical(rows)
        for layer, part in zip(self.model.layers, kv.split(2 * self.cfg.layers.kv_size, dim=-1)):
            layer.self_attn.write_context(part, positions, rows, self.cache, self.rope)

    def _body_pass(self, inputs: DraftInputs, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append context K/V, then draft the block: per draft slot [b, B-1] the argmax token and its
        probability, or with a tree builder the top-k probabilities and tokens, [b, B-1, k]."""
        B = self.block_size
        self._write_context(inputs.feats[: b * B], inputs.ctx_positions[: b * B], inputs.ctx_rows[: b * B])
        block = self.cache.paged(inputs.batch(b))
        x, residual = self.target.embed(block.input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, block, self.cache, self.rope)
        h = self.model.norm.fused(x, residual)[0].view(b, B, -1)[:, 1:].reshape(b * (B - 1), -1)
        top, ids = softmax_topk(self.target.logits(h), self.tree.topk if self.tree is not None else 1)
        if self.tree is not None:
            return top.view(b, B - 1, -1), ids.view(b, B - 1, -1)
        return ids.view(b, B - 1), top.view(b, B - 1)

    def _tree_pass(self, top: torch.Tensor, ids: torch.Tensor, hint: torch.Tensor | None) -> TreeParts:
        """The tree's tensors (TreeLayout's fields in order), then its nodes' confidences where asked for."""
        tree = self.tree.build_merged(top, ids, hint, self.lookup_prob)
        if not self.tree_confidences:
            return tuple(vars(tree).values())
        return (*vars(tree).values(), node_confidences(top, ids, hint, self.lookup_prob, tree))

    @torch.inference_mode()
    def warm(self, max_batch: int) -> None:
        """An eager pass chooses attention's key splits by its request count, and each choice is a kernel of its
        own (Triton compiles one per split count, ~1 s each): one pass per choice, on the scratch slot; and the
        drafter's GEMMs at every row count its passes take."""
        max_b = min(max_batch, self.cache.num_slots)
        warm_linears([self.model], max_b * self.block_size)
        inputs, compiled = DraftInputs(self, max_b), set()
        for b in range(1, max_b + 1):
            splits = inputs.batch(b).num_kv_splits
            if splits not in compiled:
                compiled.add(splits)
                self._body_pass(inputs, b)

    # ---- CUDA graphs --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, batch_sizes: tuple[int, ...], sources: dict[tuple[int, int], VerifySource]) -> None:
        """Graphs per bucket; `sources` ((verify width, bucket) -> the static batch, acceptance and ordered taps
        of the engine's verify and acceptance graphs) adds the graphs that lay out an early launch, one per
        width a bucket verifies."""
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = GraphBackend.pool(self.device)
        inputs = DraftInputs(self, max_b)
        for b in capture_buckets(batch_sizes, max_b):
            self.graphs[b] = DraftGraph.capture(self, inputs, b, pool,
                                                [source for (_, bb), source in sorted(sources.items()) if bb == b])
        GraphBackend.synchronize(self.device)

    def static_draft(self, bucket: int) -> Draft | None:
        """The tree graph's outputs of a bucket, as a Draft of all its rows (what `propose` returns rows of)."""
        graph = self.graphs.get(bucket)
        if graph is None or graph.tree_graph is None:
            return None
        return _tree_draft(graph.tree_graph.outputs, None, bucket)


# a tree pass's outputs: TreeLayout's tensors in field order, then (where asked for) the nodes' confidences
TreeParts = tuple[torch.Tensor, ...]


def _tree_draft(parts: TreeParts, n: int | None, bucket: int | None) -> Draft:
    """The first n requests' rows of a tree pass's outputs (all of them: None) as a Draft."""
    rows = [t[:n] for t in parts]
    tree = TreeLayout(*rows[:4])
    return Draft(tree.tokens, rows[4] if len(rows) > 4 else None, tree=tree, bucket=bucket)


class DraftInputs:
    """Static inputs of the drafter's passes for up to max_b requests (a bucket of b uses the first b):
    the block's batch (a StaticBatch of the mask token), the context rows' positions, cache rows and
    features. Laid out on the device by `_lay_out`; until then every row points at the scratch slot."""

    def __init__(self, drafter: DFlashDrafter, max_b: int) -> None:
        B, dev, cache = drafter.block_size, drafter.device, drafter.cache
        self.block = StaticBatch(max_b, B, dev, cache.scratch_slot, cache.max_len, causal=False)
        self.block.input_ids.fill_(drafter.cfg.mask_token_id)
        self.input_ids, self.positions, self.write_index = self.block.input_ids, self.block.positions, self.block.write_index
        self.slot_ids, self.kv_lens = self.block.slot_ids, self.block.kv_lens
        self.ctx_positions, self.ctx_rows = torch.zeros(2, max_b * B, dtype=torch.int64, device=dev)
        self.kv_heads, self.num_kv_splits = drafter.cfg.layers.num_kv_heads, drafter.num_kv_splits
        width = len(drafter.tap_layers) * drafter.cfg.layers.hidden_size
        self.feats = torch.zeros(max_b * B, width, dtype=cache.k[0].dtype, device=dev)
        zeros = torch.zeros(max_b, dtype=torch.int64, device=dev)
        drafter._lay_out(self, max_b, zeros, zeros + cache.scratch_slot, zeros, zeros)

    def batch(self, b: int) -> ForwardBatch:
        return self.block.batch(b, self.num_kv_splits or kv_splits(self.input_ids.device, b, self.kv_heads))


class DraftGraph:
    """The drafter's graphs for a bucket of b requests: the body (context rows + the block's layers);
    for tree drafts the tree build, a separate graph so that a body can take a hint prompt lookup found
    on the host; and per source (the engine's verify and acceptance graphs of the bucket, one per verify
    width), a `prep` graph, which lays out the next body's inputs from them on the device (with a device
    lookup, its hint too)."""

    def __init__(self, body: CapturedPass | EagerReplay, inputs: DraftInputs, bucket: int) -> None:
        self.graph, self.inputs, self.bucket = body, inputs, bucket
        self.outputs: tuple[torch.Tensor, ...] = body.outputs
        self.tree_graph: CapturedPass | EagerReplay | None = None
        self.hint: torch.Tensor | None = None
        self.preps: list[tuple[VerifySource, CapturedPass | EagerReplay]] = []

    @classmethod
    def capture(cls, drafter: DFlashDrafter, inputs: DraftInputs, b: int, pool: tuple,
                sources: list[VerifySource]) -> DraftGraph:
        g = cls(GraphBackend.capture(lambda: drafter._body_pass(inputs, b), pool), inputs, b)
        if drafter.tree is not None:
            # prompt lookup's hint rows (use flag + tokens), all unused unless a step fills them
            g.hint = torch.zeros(b, drafter.block_size, dtype=torch.int64, device=drafter.device)
            g.tree_graph = GraphBackend.capture(lambda: drafter._tree_pass(*g.outputs, g.hint), pool)
        for source in sources:
            g.preps.append((source, GraphBackend.capture(lambda source=source: g.lay_out(drafter, b, source), pool)))
        return g

    def prep_for(self, verify: ForwardBatch, accepted: Accepted,
                 verify_taps: torch.Tensor | None) -> CapturedPass | EagerReplay | None:
        """The prep graph that reads exactly these verify outputs (those of a verify graph of this bucket), if any."""
        given = (verify, accepted, verify_taps)
        return next((prep for source, prep in self.preps if all(m is g for m, g in zip(source, given))), None)

    def lay_out(self, drafter: DFlashDrafter, b: int, source: VerifySource) -> None:
        """The next body's inputs (and hint) from a verify's batch, acceptance and taps: what a prep graph replays."""
        hint = drafter._prep(self.inputs, b, *source)
        if hint is not None:
            self.hint.copy_(hint)

    def replay_tree(self, hint: torch.Tensor | None, n: int) -> TreeParts:
        """`hint`: the device lookup's rows for n requests (without one the hint rows stay unused)."""
        if hint is not None:  # rows past n are padding: their drafts are dropped, whatever they hold
            self.hint[:n].copy_(hint)
        self.tree_graph.replay()
        return self.tree_graph.outputs
