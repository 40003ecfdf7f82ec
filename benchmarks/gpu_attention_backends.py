"""H200: our paged attention kernels against FlashInfer's, in one run (issue 19: FlashInfer as the CUDA backend
where it measures faster). Llama-3.1-8B's heads (32 q / 8 kv / head 128) and the embedded model's (9 / 3 / 64) over
our page pool (page size 64), bf16, contexts 1024 and 4096, B = 1, 8, 32, 64:

* decode (one query per request): ours - the batch-invariant Triton kernel (`inv`) and the fast one with
  batch-sized key splits (`fast`) - against FlashInfer's paged decode: its default plan (`fi`, CUDA cores), on
  tensor cores (`fi_tc`), and on tensor cores with a fixed split size (`fi_fixed`, --fixed-split-pages: by
  default our invariant kernel's 256 keys) or with the key split disabled (`fi_nosplit`);
* verify (16 query rows per request): a random draft tree (each node's parent before it) under its tree mask,
  FlashInfer's paged prefill with a custom mask; a chain, causal in both; FlashInfer under the same split plans
  (its prefill always runs on tensor cores, so `fi_tc` has no verify of its own: `fi`'s stands for it).

Checks, in the same run, over 32 requests of ragged context: relative error against the plain-torch reference;
batch invariance, bitwise (a request's rows computed alone equal its rows among 32); and decode == verify: the rows
of each request's accepted path (the deepest tree path, after the engine's commit moves its K/V into place; the
whole chain) equal the decode of the same query over the same keys, which speculation needs for a token's logits
to be the same whether it was decoded or verified.

Timing: CUDA-graph replays of calls cycling through the layers of a pool of enough layers (copies) to exceed
twice the L2 (at least 8 calls), backends interleaved over repeats; µs per call (median, min, max); FlashInfer's
plans (host work once per pass) are made outside the graphs, and their re-plan time recorded. FlashInfer's kernels
JIT-compile with the machine's nvcc in a background thread while ours are checked. Without FlashInfer (not
importable) ours are still checked and timed.

    python benchmarks/gpu_attention_backends.py [--out DIR] [--repeats 3] [--contexts 1024 4096]
        [--batches 1 8 32 64] [--shapes llama8b embedded] [--fixed-split-pages 4] [--invariant-forms] [--fast-splits]

`--invariant-forms`: our invariant kernel also pinned to each of its launch forms (tile height, key splits over
programs or folded in one, a program per tree token), timed beside its own choice and checked bitwise against it:
which form a shape should take (the kernel's heuristics in kernels/slot_attention.py). `--fast-splits`: the fast
kernel also pinned to 1, 2, 4 and 8 key splits (the engine's choice is `kv_splits`; the drafters' block attention
takes it too), which gives different bits by design.

On the H200, FlashInfer comes as wheels: `bash benchmarks/gpu_ferry.sh flashinfer` here, then a run call carrying
.ferry/flashinfer: bash benchmarks/gpu_ferry.sh run 'python3 benchmarks/gpu_attention_backends.py'.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402
from gpu_engine import time_interleaved  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.kernels.slot_attention import (  # noqa: E402
    SPLIT_KEYS,
    kv_splits,
    slot_attention_invariant,
    slot_attention_reference,
    slot_attention_triton,
    tree_tail_rows,
)
from specpilot.state.batch import ForwardBatch  # noqa: E402
from specpilot.state.cache import KVCache  # noqa: E402
from specpilot.state.graphs import cuda_capture  # noqa: E402
from specpilot.state.pages import PAGE_SIZE, PageTable  # noqa: E402
from specpilot.state.tree import TreeLayout  # noqa: E402

SHAPES = {"llama8b": (32, 8, 128), "embedded": (9, 3, 64)}  # q heads, kv heads, head dim (embedded: SmolLM2-135M)
DTYPE = torch.bfloat16
VERIFY_Q = 16
KINDS = ("decode", "tree", "chain")
CHECK_B, CHECK_CTX = 32, 1024  # check passes: 32 requests of CHECK_CTX / 2 .. CHECK_CTX committed tokens
SINGLES = (0, 13, 31)  # check requests also run alone
MAX_COPIES = 128
MIN_CALLS = 8  # per graph: its launch is a small share of what it times
# FlashInfer's split-kv partials of a pass (fp32, per q head x 64-row q tile x split): a 16-row verify of 64 requests
# at 4k keys in 256-key splits takes 1.1 GB; one buffer serves every plan (passes run one at a time, on one stream)
FI_WORKSPACE_BYTES = 4 << 30

Attend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (k pool, v pool) of one layer -> output rows
# --invariant-forms: the invariant kernel's launch forms pinned (each gives the kernel's bits: timed beside `inv`, the
# kernel's own choice, and checked bitwise against it)
INVARIANT_FORMS: dict[str, dict[str, Any]] = {
    "inv_m16": {"block_m": 16}, "inv_m32": {"block_m": 32}, "inv_split": {"split_grid": True},
    "inv_fold": {"split_grid": False}, "inv_m32_split": {"block_m": 32, "split_grid": True},
    "inv_token": {"per_token": True}, "inv_prefetch": {"prefetch": True},
    "inv_prefetch_m32": {"prefetch": True, "block_m": 32}}
FAST_SPLITS = {f"fast_s{n}": n for n in (1, 2, 4, 8)}  # --fast-splits: the fast kernel's key splits pinned


# --------------------------------------------------------------------------------------------------------------------
# Passes: inputs of one attention call over the pool, as the engine builds them
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Pass:
    kind: str  # decode, tree or chain
    q: torch.Tensor
    batch: ForwardBatch
    cache: KVCache

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5


def random_trees(n: int, q: int, gen: torch.Generator) -> TreeLayout:
    """n draft trees of q nodes (node 0: the newest committed token), each node's parent uniform among the nodes
    before it. On the CPU."""
    parents = (torch.rand(n, q - 1, generator=gen) * torch.arange(1, q)).long()
    depths = torch.zeros(n, q, dtype=torch.long)
    ancestors = torch.ones(n, q, dtype=torch.long)
    for j in range(1, q):
        parent = parents[:, j - 1 : j]
        depths[:, j] = depths.gather(1, parent)[:, 0] + 1
        ancestors[:, j] = ancestors.gather(1, parent)[:, 0] | (1 << j)
    return TreeLayout(torch.zeros_like(parents), parents, depths[:, 1:], ancestors)


def tree_rows(tree: TreeLayout, rows: slice, device: torch.device) -> TreeLayout:
    return TreeLayout(*(t[rows].to(device) for t in (tree.tokens, tree.parents, tree.depths, tree.ancestors)))


def deepest_path(parents: list[int]) -> list[int]:
    """Node 0 to the deepest node (the last of equals) of a tree whose node j > 0 has parent parents[j - 1]."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    node = max(range(len(depth)), key=lambda j: (depth[j], j))
    path = [node]
    while node:
        node = parents[node - 1]
        path.append(node)
    return path[::-1]


def make_pass(kind: str, cache: KVCache, slots: list[int], starts: list[int], q: torch.Tensor,
              tree: TreeLayout | None = None) -> Pass:
    """Requests in `slots`, whose first `starts` positions are committed, append q's rows (as many each); a tree
    (on q's device) places them as its nodes."""
    q_len = q.shape[0] // len(slots)
    batch = ForwardBatch.build(slots, starts, [[0] * q_len] * len(slots), cache.max_len, q.device)
    if tree is not None:
        batch.tree_mask = torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
        batch.tree_parents = torch.zeros_like(batch.tree_mask)
        batch.place_tree(tree)
        batch.tail_rows = tree_tail_rows(batch.positions, batch.tree_mask)  # once per pass, as the model does
    return Pass(kind, q, batch, cache)


def make_passes(cache: KVCache, slots: list[int], ctx: list[int], heads: int, trees: TreeLayout) -> dict[str, Pass]:
    """Request b's decode of its token at position ctx[b] - 1, and its verify of 16 tokens after ctx[b]: a tree
    (`trees` row b) and a chain."""
    device, head_dim, n = cache.kv.device, cache.k[0].shape[3], len(slots)

    def queries(rows: int) -> torch.Tensor:
        return torch.randn(rows, heads, head_dim, device=device, dtype=cache.kv.dtype)

    return {"decode": make_pass("decode", cache, slots, [c - 1 for c in ctx], queries(n)),
            "tree": make_pass("tree", cache, slots, ctx, queries(n * VERIFY_Q), tree_rows(trees, slice(None), device)),
            "chain": make_pass("chain", cache, slots, ctx, queries(n * VERIFY_Q))}


def paged_cache(layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                device: torch.device) -> tuple[KVCache, list[int]]:
    """A pool of random K/V (never zeros: they can time faster) with `slots` requests of max_len positions."""
    cache = KVCache(layers, kv_heads, head_dim, DTYPE, PageTable(slots, max_len, None, device, PAGE_SIZE))
    held = [cache.allocate() for _ in range(slots)]
    cache.kv.normal_()
    return cache, held


def reference(p: Pass) -> torch.Tensor:
    b = p.batch
    return slot_attention_reference(p.q, p.cache.k[0], p.cache.v[0], b.slot_ids, b.q_starts, b.q_lens, b.kv_lens,
                                    p.scale, tree_mask=b.tree_mask, page_table=p.cache.page_table)


# --------------------------------------------------------------------------------------------------------------------
# FlashInfer's view of the same pool
# --------------------------------------------------------------------------------------------------------------------


def flashinfer_pages(table: torch.Tensor, slots: list[int], kv_lens: list[int],
                     page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV description of requests (slots[b], its first kv_lens[b] positions) over our page
    table, int32 on the table's device (a custom mask's packing wants its offsets there): page indptr, the pages
    in order, rows used of each last page (1..page_size)."""
    counts = torch.tensor([-(-n // page_size) for n in kv_lens])
    indptr = torch.tensor([0, *itertools.accumulate(counts.tolist())], dtype=torch.int32)
    rows = torch.tensor(slots).repeat_interleave(counts)
    cols = torch.arange(int(indptr[-1])) - indptr[:-1].long().repeat_interleave(counts)
    last = torch.tensor(kv_lens, dtype=torch.int32) - (counts.to(torch.int32) - 1) * page_size
    device = table.device
    return indptr.to(device), table[rows.to(device), cols.to(device)].contiguous(), last.to(device)


def flashinfer_custom_mask(tree_mask: torch.Tensor, q_len: int, kv_lens: list[int]) -> torch.Tensor:
    """FlashInfer's custom mask (bool, flat; per request its [q_len, kv_len] rows, True = attend) of our tree
    masks (int64 [B * q_len]: per row the visible block rows' bits): every context key, then the row's bits."""
    bits = (tree_mask.view(-1, q_len, 1) >> torch.arange(q_len, device=tree_mask.device)) & 1 != 0
    return torch.cat([torch.cat([bits.new_ones(q_len, n - q_len), block], 1).flatten()
                      for n, block in zip(kv_lens, bits)])


def import_flashinfer() -> tuple[ModuleType | None, str | None]:
    try:
        import flashinfer
    except Exception as exc:  # absent, or built for another torch/CUDA: ours are still worth timing
        return None, error_text(exc)
    return flashinfer, None


def build_flashinfer(head_dims: list[int]) -> float:
    """JIT-compile and load every FlashInfer module the plans below use, through the cached getters their plan()
    calls with these same arguments (so it finds them loaded): decode on CUDA cores and the FA2 prefill module
    (tensor-core decode and verify, every mask mode) per head dim, and the packing of custom masks. One thread per
    module: each builds in its own ninja (on MAX_JOBS cores). Seconds taken."""
    from flashinfer.decode import get_batch_decode_module
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.quantization.packbits import get_quantization_module

    start = time.perf_counter()
    jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [(get_quantization_module, ())]
    for d in head_dims:  # dtypes q, kv, o, index; head dims qk, vo; no RoPE, window, soft cap (, fp16 qk sums)
        jobs.append((get_batch_decode_module, (DTYPE, DTYPE, DTYPE, torch.int32, d, d, 0, False, False)))
        jobs.append((get_batch_prefill_module, ("fa2", DTYPE, DTYPE, DTYPE, torch.int32, d, d, 0, False, False, False)))
    with ThreadPoolExecutor(len(jobs)) as pool:
        for built in [pool.submit(fn, *args) for fn, args in jobs]:
            built.result()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------------------------------
# Backends: prepare(pass) gives the call of one layer (plans and launch choices made once per pass, outside it)
# --------------------------------------------------------------------------------------------------------------------


class Ours:
    def __init__(self, invariant: bool, form: str | None = None) -> None:
        """`form`: one of INVARIANT_FORMS (invariant) or FAST_SPLITS (fast), the launch pinned instead of the
        kernel's or the engine's choice."""
        self.name = ("inv" if invariant else "fast") if form is None else form
        self.invariant, self.form = invariant, INVARIANT_FORMS.get(form, {})
        self.splits = FAST_SPLITS.get(form)
        self.partner = self.name  # whose verify rows its decode is checked against

    def prepare(self, p: Pass) -> Attend | None:
        b, table = p.batch, p.cache.page_table
        if (self.form.get("per_token") or self.form.get("prefetch")) and b.tree_mask is None:
            return None  # a tree pass's forms
        if self.invariant:
            return lambda k, v: slot_attention_invariant(p.q, k, v, b.slot_ids, b.q_starts, b.q_lens, b.kv_lens,
                                                         b.positions, p.scale, b.max_q_len, b.tree_mask, b.tail_rows,
                                                         table, **self.form)
        splits = self.splits or kv_splits(p.q.device, b.batch_size, p.cache.k[0].shape[2])  # the engine's choice
        return lambda k, v: slot_attention_triton(p.q, k, v, b.slot_ids, b.q_starts, b.q_lens, b.kv_lens, p.scale,
                                                  max_q_len=b.max_q_len, num_kv_splits=splits,
                                                  tree_mask=b.tree_mask, page_table=table)


def flashinfer_variants(fixed_pages: int) -> dict[str, tuple[bool, dict[str, Any], bool]]:
    """name: (decode on tensor cores, the plans' split arguments, has a verify plan). FlashInfer takes a fixed
    split size (in pages) only on tensor cores, and disable_split_kv only there (its CUDA-core plan drops it)."""
    return {"fi": (False, {}, True), "fi_tc": (True, {}, False),
            "fi_fixed": (True, {"fixed_split_size": fixed_pages}, True),
            "fi_nosplit": (True, {"disable_split_kv": True}, True)}


class FlashInfer:
    def __init__(self, fi: ModuleType, name: str, tensor_cores: bool, split: dict[str, Any], verify: bool,
                 workspace: torch.Tensor) -> None:
        self.fi, self.name, self.tensor_cores, self.split, self.verify = fi, name, tensor_cores, split, verify
        self.workspace = workspace
        self.partner = name if verify else "fi"
        self.plan_us: float | None = None  # host time of a re-plan of the last pass prepared

    def prepare(self, p: Pass) -> Attend | None:
        if p.kind != "decode" and not self.verify:
            return None
        b, cache = p.batch, p.cache
        heads, head_dim = p.q.shape[1], p.q.shape[2]
        kv_heads, page = cache.k[0].shape[2], cache.pages.page_size
        kv_lens = b.kv_lens.tolist()
        indptr, indices, last = flashinfer_pages(cache.page_table, b.slot_ids.tolist(), kv_lens, page)
        common = {"q_data_type": p.q.dtype, "kv_data_type": p.q.dtype, "sm_scale": p.scale, **self.split}
        if p.kind == "decode":
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                 use_tensor_cores=self.tensor_cores)
            plan = functools.partial(wrapper.plan, indptr, indices, last, heads, kv_heads, head_dim, page, **common)
        else:
            q_len = b.max_q_len
            mask = ({"causal": True} if p.kind == "chain"
                    else {"custom_mask": flashinfer_custom_mask(b.tree_mask, q_len, kv_lens)})
            # FA2: FlashInfer's only paged prefill with custom masks; the chain too (FA3 would be another JIT build)
            wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            qo_indptr = torch.arange(b.batch_size + 1, dtype=torch.int32, device=indptr.device) * q_len
            plan = functools.partial(wrapper.plan, qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, page,
                                     **mask, **common)
        plan()
        start = time.perf_counter()
        plan()  # as serving re-plans every step (once for all layers): its host time, warm
        self.plan_us = (time.perf_counter() - start) * 1e6
        out = torch.empty_like(p.q)  # else run() allocates it, and the prefill zero-fills it, on every call
        return lambda k, v: wrapper.run(p.q, (k, v), out=out)


Backend = Ours | FlashInfer


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def rows_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Query rows (tokens) of a and b that differ in any bit."""
    return int((a.view(torch.int16) != b.view(torch.int16)).flatten(1).any(1).sum())


# --------------------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------------------


class CheckData:
    """One shape's check passes over a one-layer pool: CHECK_B requests of ragged context, and the reference
    outputs on the pool as made (a tree's commit moves rows; check() starts from a copy)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, device: torch.device, gen: torch.Generator) -> None:
        self.ctx = torch.randint(CHECK_CTX // 2, CHECK_CTX + 1, (CHECK_B,), generator=gen).tolist()
        self.cache, self.slots = paged_cache(1, CHECK_B, CHECK_CTX + VERIFY_Q, kv_heads, head_dim, device)
        self.pristine = self.cache.kv.clone()
        self.trees = random_trees(CHECK_B, VERIFY_Q, gen)
        self.passes = make_passes(self.cache, self.slots, self.ctx, heads, self.trees)
        self.refs = {kind: reference(p) for kind, p in self.passes.items()}

    def single(self, kind: str, r: int) -> tuple[Pass, slice]:
        """Request r's part of a check pass as a pass of its own, and its rows in the whole."""
        p = self.passes[kind]
        q_len = p.batch.max_q_len
        rows = slice(r * q_len, (r + 1) * q_len)
        start = self.ctx[r] - 1 if kind == "decode" else self.ctx[r]
        tree = tree_rows(self.trees, slice(r, r + 1), p.q.device) if kind == "tree" else None
        return make_pass(kind, self.cache, [self.slots[r]], [start], p.q[rows], tree), rows

    def path_decode(self, kind: str) -> tuple[Pass, torch.Tensor]:
        """The decodes of each request's accepted path (the deepest tree path, or the whole chain): node j of it at
        position ctx + j over the keys up to it, and the verify rows they must equal. For a tree this first moves
        the path's K/V to ctx + depth, as the engine's commit does."""
        device, q_len = self.cache.kv.device, VERIFY_Q
        if kind == "tree":
            paths = [deepest_path(parents) for parents in self.trees.parents.tolist()]
            nodes = torch.tensor([path + [0] * (q_len - len(path)) for path in paths], device=device)
            base = torch.tensor([s * self.cache.max_len + c for s, c in zip(self.slots, self.ctx)], device=device)
            self.cache.commit_accepted(base, torch.tensor([len(path) for path in paths], device=device), nodes)
        else:
            paths = [list(range(q_len))] * CHECK_B
        entries = [(b, j, node) for b, path in enumerate(paths) for j, node in enumerate(path)]
        rows = torch.tensor([b * q_len + node for b, _, node in entries], device=device)
        decode = make_pass("decode", self.cache, [self.slots[b] for b, _, _ in entries],
                           [self.ctx[b] + j for b, j, _ in entries], self.passes[kind].q[rows])
        return decode, rows


def check(data: CheckData, backends: list[Backend]) -> dict[str, dict[str, Any]]:
    """Per backend: relative error against the reference, batch invariance and decode == verify, bitwise."""
    data.cache.kv.copy_(data.pristine)
    k, v = data.cache.k[0], data.cache.v[0]
    report: dict[str, dict[str, Any]] = {be.name: {"rel_err": {}, "batch_invariant": {}, "decode_vs_verify": {},
                                                   "errors": {}} for be in backends}
    outs: dict[tuple[str, str], torch.Tensor] = {}

    def failed(be: Backend, what: str, exc: Exception) -> None:
        report[be.name]["errors"][what] = error_text(exc)
        print(f"  {be.name} {what}: {error_text(exc)}", flush=True)

    for kind, p in data.passes.items():
        for be in backends:
            try:
                attend = be.prepare(p)
                if attend is None:
                    continue
                out = outs[be.name, kind] = attend(k, v)
                report[be.name]["rel_err"][kind] = rel_err(out, data.refs[kind])
                report[be.name]["batch_invariant"][kind] = all(
                    rows_differ(be.prepare(single)(k, v), out[rows]) == 0
                    for single, rows in (data.single(kind, r) for r in SINGLES))
            except Exception as exc:  # one failing FlashInfer plan must not lose the rest
                failed(be, kind, exc)
    for kind in ("chain", "tree"):  # the chain's first: the tree's commit moves rows the chain's verify read
        path, rows = data.path_decode(kind)
        for be in backends:
            verify = outs.get((be.partner, kind))
            if verify is None:
                continue
            try:
                differ = rows_differ(be.prepare(path)(k, v), verify[rows])
                report[be.name]["decode_vs_verify"][kind] = {"verify": be.partner, "rows": len(rows), "differ": differ}
            except Exception as exc:
                failed(be, f"decode_vs_verify {kind}", exc)
    return report


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------


def over_layers(attend: Attend, cache: KVCache, calls: int) -> Callable[[], None]:
    """`calls` calls cycling through the pool's layers, as a model's layers run them: with the pool over twice the
    L2, no call finds its keys cached."""
    def run() -> None:
        for i in range(calls):
            attend(cache.k[i % len(cache.k)], cache.v[i % len(cache.v)])
    return run


def time_case(shape: str, ctx: int, batch: int, backends: list[Backend], repeats: int, l2_bytes: int,
              device: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    heads, kv_heads, head_dim = SHAPES[shape]
    max_len = ctx + VERIFY_Q
    token_bytes = 2 * kv_heads * head_dim * DTYPE.itemsize  # K and V
    copies = min(MAX_COPIES, max(1, -(-2 * l2_bytes // (batch * max_len * token_bytes))))
    calls = max(copies, MIN_CALLS)
    cache, slots = paged_cache(copies, batch, max_len, kv_heads, head_dim, device)
    passes = make_passes(cache, slots, [ctx] * batch, heads, random_trees(batch, VERIFY_Q, gen))
    rows = []
    for kind, p in passes.items():
        kv_len = ctx if kind == "decode" else max_len
        row: dict[str, Any] = {"shape": shape, "ctx": ctx, "batch": batch, "op": kind, "copies": copies, "calls": calls,
                               "kv_bytes": batch * kv_len * token_bytes, "rel_err": {}, "us": {}, "plan_us": {},
                               "errors": {}}
        ref = reference(p)
        graphs = {}
        inv_out = None
        runs = {}  # a graph reads its plan's buffers (FlashInfer's wrapper holds them): keep each alive beside it
        for be in backends:
            try:
                attend = be.prepare(p)
                if attend is None:
                    continue
                out = attend(cache.k[0], cache.v[0])
                row["rel_err"][be.name] = rel_err(out, ref)
                if be.name == "inv":
                    inv_out = out
                elif be.name in INVARIANT_FORMS:  # a pinned form: the kernel's bits whatever the launch
                    row.setdefault("same_bits_as_inv", {})[be.name] = bool(torch.equal(out, inv_out))
                if isinstance(be, FlashInfer):
                    row["plan_us"][be.name] = be.plan_us
                runs[be.name] = over_layers(attend, cache, calls)
                graphs[be.name] = cuda_capture(runs[be.name], None)
            except Exception as exc:
                row["errors"][be.name] = error_text(exc)
                print(f"  {shape} ctx {ctx} B {batch} {kind} {be.name}: {error_text(exc)}", flush=True)
        timed = time_interleaved({name: g.replay for name, g in graphs.items()}, repeats, iters=30, warmup=3)
        for name, t in timed.items():
            us = {stat: t[stat] * 1e3 / calls for stat in ("median", "min", "max")}
            row["us"][name] = us | {"TBps": row["kv_bytes"] / us["median"] / 1e6}
        rows.append(row)
        print(f"{shape} ctx {ctx} B {batch} {kind}: "
              + ", ".join(f"{n} {t['median']:.1f}" for n, t in row["us"].items()) + " us", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def print_tables(result: dict[str, Any], names: list[str]) -> None:
    fi = result["flashinfer"]
    print(f"\nFlashInfer {fi['version']}: JIT build {fi['jit_build_s']:.0f} s" if fi["error"] is None
          else f"\nFlashInfer not measured ({fi['error']}): ours only")
    print(f"checks: {CHECK_B} requests of {CHECK_CTX // 2}..{CHECK_CTX} committed tokens; batch-invariant: requests "
          f"{', '.join(map(str, SINGLES))} alone == among {CHECK_B}, bitwise; decode==verify: yes, or differing / "
          f"all rows of the accepted paths (against another backend's verify: in brackets)")
    print(f"{'shape':<9} {'backend':<11} {'batch-inv dec tree chain':<25} {'decode==verify tree chain':<27} "
          f"rel err dec tree chain")
    for shape, report in result["checks"].items():
        for name in names:
            r = report.get(name)
            if r is None:
                continue
            inv = " ".join({True: "yes", False: "NO"}.get(r["batch_invariant"].get(kind), "-") for kind in KINDS)
            dv = [r["decode_vs_verify"].get(kind) for kind in ("tree", "chain")]
            same = " ".join("-" if d is None else "yes" if d["differ"] == 0 else f"{d['differ']}/{d['rows']}"
                            for d in dv)
            partner = next((d["verify"] for d in dv if d), name)
            same += f" [{partner}]" if partner != name else ""
            errs = " ".join(f"{r['rel_err'][kind]:.1e}" if kind in r["rel_err"] else "-" for kind in KINDS)
            print(f"{shape:<9} {name:<11} {inv:<25} {same:<27} {errs}" + (" ERRORS" if r["errors"] else ""))
    print(f"\nus per call, median of {result['repeats']} interleaved repeats (fi_fixed: {result['fixed_split_pages']} "
          f"pages per split); '-': no such plan; ERR: failed (see above); fi plan: host us of FlashInfer's default "
          f"re-plan, once per pass")
    print(f"{'shape':<9} {'ctx':>5} {'B':>3} {'op':<6}" + "".join(f"{n:>11}" for n in names)
          + f"{'fi plan':>9}  max rel err")
    for row in result["timings"]:
        cells = "".join(f"{row['us'][n]['median']:>11.1f}" if n in row["us"] else
                        f"{'ERR' if n in row['errors'] else '-':>11}" for n in names)
        plan = row["plan_us"].get("fi")
        err = max(row["rel_err"].values(), default=float("nan"))
        print(f"{row['shape']:<9} {row['ctx']:>5} {row['batch']:>3} {row['op']:<6}{cells}"
              f"{'-' if plan is None else f'{plan:.0f}':>9}  {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings of each backend")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--invariant-forms", action="store_true",
                    help=f"also time the invariant kernel pinned to each launch form ({', '.join(INVARIANT_FORMS)})")
    ap.add_argument("--fast-splits", action="store_true",
                    help=f"also time the fast kernel pinned to each key split count ({', '.join(FAST_SPLITS)})")
    ap.add_argument("--fixed-split-pages", type=int, default=SPLIT_KEYS // PAGE_SIZE,
                    help="FlashInfer's fixed split size, in pages (default: our invariant kernel's split)")
    args = ap.parse_args()
    device = torch.device("cuda")
    out = out_dir(args.out)
    started = time.perf_counter()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    fi, fi_error = import_flashinfer()
    build: Future[float] | None = None
    if fi is not None:  # nvcc runs while ours are checked (and their Triton kernels compile)
        # the two prefill modules' ninjas on half the cores each (not set: each would run cores + 2 nvcc at once)
        os.environ.setdefault("MAX_JOBS", str(max(1, len(os.sched_getaffinity(0)) // 2)))
        build = ThreadPoolExecutor(1).submit(build_flashinfer, sorted({SHAPES[s][2] for s in args.shapes}))
    ours: list[Backend] = [Ours(True), Ours(False)]
    checks = {shape: CheckData(*SHAPES[shape], device, gen) for shape in args.shapes}
    report = {shape: check(data, ours) for shape, data in checks.items()}
    fi_info: dict[str, Any] = {"version": getattr(fi, "__version__", None), "error": fi_error, "jit_build_s": None}
    backends = list(ours) + ([Ours(True, form) for form in INVARIANT_FORMS] if args.invariant_forms else []) + (
        [Ours(False, form) for form in FAST_SPLITS] if args.fast_splits else [])
    if build is not None:
        try:
            fi_info["jit_build_s"] = build.result()
        except Exception as exc:
            fi_info["error"] = error_text(exc)
            print(f"FlashInfer's JIT build failed: {fi_info['error']}", flush=True)
        else:
            workspace = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            theirs = [FlashInfer(fi, name, *variant, workspace)
                      for name, variant in flashinfer_variants(args.fixed_split_pages).items()]
            for shape, data in checks.items():
                report[shape] |= check(data, theirs)
            backends += theirs
    del checks
    checked = time.perf_counter()

    result: dict[str, Any] = {
        "provenance": collect(device, "bfloat16"), "flashinfer": fi_info, "shapes": {s: SHAPES[s] for s in args.shapes},
        "page_size": PAGE_SIZE, "verify_q": VERIFY_Q, "fixed_split_pages": args.fixed_split_pages,
        "repeats": args.repeats, "l2_bytes": torch.cuda.get_device_properties(device).L2_cache_size,
        "checks": report, "timings": [],
    }
    path = out / "gpu_attention_backends.json"
    write_json(path, result)  # each stage lands, should a later one take the process down
    for shape, ctx, batch in itertools.product(args.shapes, args.contexts, args.batches):
        result["timings"] += time_case(shape, ctx, batch, backends, args.repeats, result["l2_bytes"], device, gen)
        write_json(path, result)
    result["wall_s"] = {"checks": checked - started, "timing": time.perf_counter() - checked}
    write_json(path, result)
    names = [be.name for be in ours] + list(flashinfer_variants(args.fixed_split_pages))
    print_tables(result, names)
    print(f"\nwall: checks (with FlashInfer's build) {result['wall_s']['checks']:.0f} s, timing "
          f"{result['wall_s']['timing']:.0f} s; {path}")


if __name__ == "__main__":
    main()
