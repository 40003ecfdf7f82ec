"""The engine: requests in, tokens out. Admits waiting requests into free KV slots (batched ragged
prefill), then advances every running request by one decode step per `step()` call."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from specpilot.config import SamplingParams
from specpilot.engine.memory import KVPlan, kv_bytes_per_token, plan_kv, return_freed_memory
from specpilot.engine.sampling import choose_tokens, make_generator, suppress
from specpilot.engine.spec_stats import SpecStats, StepClock
from specpilot.engine.stops import StopChecker
from specpilot.engine.verify import Verifier
from specpilot.kernels.softmax_topk import row_argmax
from specpilot.kernels.step_layout import lay_out_next_verify
from specpilot.models.build import build_model
from specpilot.models.checkpoint import Checkpoint, load_checkpoint
from specpilot.models.runner import (
    DEFAULT_GRAPH_BATCH_SIZES,
    ModelRunner,
    RunOutput,
)
from specpilot.models.transformer import Transformer
from specpilot.progress import phase
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.draft import Accepted, Draft
from specpilot.state.graphs import CapturedPass, EagerReplay, GraphBackend
from specpilot.state.request import Request
from specpilot.state.transfer import HostCopy, to_device
from specpilot.state.tree import TreeLayout

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model_path: str | None = None  # None: the embedded default
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    # None: the device's default within the free memory (engine/memory.py); the engine's own config
    # holds the values in effect
    max_running_requests: int | None = None
    context_length: int | None = None  # KV positions per request slot
    max_total_tokens: int | None = None  # cap on all slots' positions together (SGLang's flag)
    cuda_graphs: bool = True
    max_prefill_tokens: int = 16384  # tokens of prompts admitted in one prefill pass
    # Offline throughput: while requests run, admit waiting ones only once this many slots are free (or
    # every waiting one fits), so prefills come in waves instead of one eager pass per finished request.
    min_prefill_batch: int = 1
    speculative_algorithm: str | None = None  # None | dflash | pard | ngram
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None  # tokens per verify pass (block size); default from the drafter
    speculative_ngram_assist: int = 0  # dflash/pard: prompt lookup's block where an n-gram this long repeats (0: off)
    speculative_eagle_topk: int = 1  # dflash: > 1 drafts a tree from each slot's top-k (SGLang's flag name)
    speculative_lookup_prob: float = 0.9  # dflash trees: the probability prompt lookup's tokens enter the tree at
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # graph buckets
    attention_kv_splits: int = 0  # key splits of decode/verify attention; 0: the kernel's choice per batch
    # the speed mechanisms in effect (engine/registry.py): None = every one whose precondition holds,
    # an empty set = stock
    mechanisms: frozenset[str] | None = None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class _AcceptanceGraph:
    graph: CapturedPass | EagerReplay  # outputs: (Accepted, taps in accepted order, values)
    batch: ForwardBatch  # the static batch of the verify graph it follows
    host: torch.Tensor  # pinned: where the graph copies the values the host reads


class TokenObserver(Protocol):
    def observe(self, req: Request, tokens: list[int], rows: torch.Tensor) -> list[int]: ...


def _build_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer:
    with phase(f"building the model on {device.type} in {str(dtype).removeprefix('torch.')}"):
        return build_model(checkpoint, device, dtype)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _split_rows(rows: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor | None]:
    if rows is None:
        return [None] * len(lengths)
    offsets = _offsets(lengths)
    return [rows[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]


class Engine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, model: Transformer | None = None,
                 drafter_factory: Callable[[EngineConfig, Engine], Drafter] | None = None,
                 cache: KVCache | None = None) -> None:
        """`model`: an already built target (synthetic weights in benchmarks); `drafter_factory`: builds
        the drafter from the config and the engine's model, device, dtype and context length (default:
        from the --speculative-* settings); the target's KV cache is sized after it. `cache`: another
        engine's KV cache to run in (see `twin`)."""
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        mcfg = checkpoint.config
        self.model = model if model is not None else _build_model(checkpoint, self.device, self.dtype)
        per_token = kv_bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        if cache is None:
            self.kv_plan = plan_kv(self.device, per_token, mcfg.max_position_embeddings, config.max_running_requests,
                                   config.context_length, config.max_total_tokens)
        else:  # a twin: the other engine's slots, and its context length (its config is resolved)
            self.kv_plan = KVPlan(cache.num_slots, config.context_length, per_token, budget_bytes=0,
                                  limited_by="a shared cache")
        if config.max_running_requests and self.kv_plan.num_slots < config.max_running_requests:
            log.warning("KV cache: %d request slots of %d positions (limited by %s), not the %d asked for",
                        self.kv_plan.num_slots, self.kv_plan.context_length, self.kv_plan.limited_by,
                        config.max_running_requests)
        # the settings in effect (/get_server_info reports them)
        self.config = config = replace(config, max_running_requests=self.kv_plan.num_slots,
                                       context_length=self.kv_plan.context_length,
                                       max_total_tokens=self.kv_plan.total_tokens)
        self.context_length = self.kv_plan.context_length
        self.drafter: Drafter | None = None
        if drafter_factory is None and config.speculative_algorithm:
            from specpilot.drafters import build_drafter as drafter_factory
        if drafter_factory is not None:
            with phase(f"loading the drafter ({config.speculative_algorithm or 'custom'})"):
                self.drafter = drafter_factory(config, self)
            # defaults resolved by the drafter
            self.config = replace(config, speculative_num_draft_tokens=self.drafter.block_size,
                                  speculative_draft_model_path=self.drafter.source)
        # A verify pass near the end of the context writes up to block_size - 1 positions past it.
        slot_len = self.context_length + (self.drafter.block_size if self.drafter else 0)
        self.model.setup_rope(slot_len)
        if cache is None:
            plan = self.kv_plan
            cache = KVCache(mcfg.num_layers, plan.num_slots, slot_len, mcfg.num_kv_heads, mcfg.head_dim, self.dtype,
                            self.device)
            log.info("KV cache: %d slots x %d positions = %d tokens, %.0f MiB (limited by %s)", plan.num_slots,
                     plan.context_length, plan.total_tokens, plan.reserved_bytes / 2**20, plan.limited_by)
        elif cache.max_len < slot_len:
            raise ValueError(f"the shared KV cache holds {cache.max_len} positions per slot; this engine needs {slot_len}")
        self.cache = cache
        self.runner = ModelRunner(self.model, self.cache, self.device,
                                  tap_layers=self.drafter.tap_layers if self.drafter else ())
        self.stops = StopChecker(self.tokenizer, mcfg.eos_token_ids, self.context_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.verifier = Verifier()
        # Token forcing (specpilot.forcing) installs itself here: it sees every decided token first.
        self.forcing: TokenObserver | None = None
        self.reset_spec_stats()
        self.acceptance_graphs: dict[int, _AcceptanceGraph] = {}  # verify bucket -> its acceptance graph
        self._verify_laid_out: list[str] | None = None  # the requests whose next verify the device laid out
        if config.cuda_graphs and GraphBackend.available(self.device):
            with phase("capturing CUDA graphs"):
                self._capture_graphs()

    def _capture_graphs(self) -> None:
        q_lens = (1,) if self.drafter is None else (1, self.drafter.block_size)
        tree_q = self.drafter.block_size if self.drafter and self.config.speculative_eagle_topk > 1 else None
        self.runner.capture(q_lens=q_lens, tree_q=tree_q)
        if self.drafter is not None:
            self._capture_acceptance()
        if hasattr(self.drafter, "capture"):
            self.drafter.capture(DEFAULT_GRAPH_BATCH_SIZES, {b: (g.batch, *g.graph.outputs[:2])
                                                             for b, g in self.acceptance_graphs.items()})

    @torch.inference_mode()
    def _capture_acceptance(self) -> None:
        """One acceptance graph per verify graph, reading that graph's static batch, logits and taps."""
        pool = GraphBackend.pool(self.device)
        q = self.drafter.block_size
        for (gq, b), g in self.runner.graphs.items():
            if gq == q:
                host = torch.zeros(b * (2 * q + 1), dtype=torch.int64, pin_memory=self.device.type == "cuda")
                graph = GraphBackend.capture(
                    lambda g=g, host=host: self._acceptance(g.batch, g.logits, g.taps, host), pool)
                self.acceptance_graphs[b] = _AcceptanceGraph(graph, g.batch, host)
                # a graph's outputs hold nothing until it runs, and the drafter's graphs are captured
                # over these: run both once (the static inputs aim at the scratch slot)
                g.graph.replay()
                graph.replay()
        GraphBackend.synchronize(self.device)

    def twin(self, **changes: object) -> Engine:
        """An engine of this one's config with `changes` (e.g. no drafter) over the same weights and KV
        cache, for runs that take turns with this engine's (token forcing's stock and candidate), never
        run at once."""
        if self.has_work:
            raise RuntimeError("an engine with requests in flight cannot share its KV cache")
        return Engine(self.checkpoint, replace(self.config, **changes), model=self.model, cache=self.cache)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        with phase(f"loading {config.model_path or 'the embedded model'}"):
            checkpoint = load_checkpoint(config.model_path, dtype=dtype)
        model = _build_model(checkpoint, device, dtype)
        # the model holds its own (fused) weights: drop the loader's before the KV cache is reserved, or
        # the footprint holds both
        checkpoint.state_dict.clear()
        return_freed_memory()
        return cls(checkpoint, config, model=model)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> Request:
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context length is {self.context_length}")
        vocab = self.checkpoint.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        req = Request(prompt, params) if rid is None else Request(prompt, params, rid=rid)
        if not params.greedy:
            req.generator = make_generator(params.seed, self.device)
        if params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        else:
            self.waiting.append(req)
        return req

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = {"type": "abort"}
                return True
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = {"type": "abort"}
                self._retire([req])
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- steps ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One forward pass: a prefill of newly admitted requests if any can be admitted, else one
        decode step for every running request. Returns the requests that finished."""
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if self.running:
            return self._decode(self.running)
        return []

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        free = min(self.cache.num_free, self.config.max_running_requests - len(self.running))
        if self.running and free < min(self.config.min_prefill_batch, len(self.waiting)):
            return admitted
        budget = self.config.max_prefill_tokens
        while self.waiting and self.cache.num_free and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            if admitted and len(req.prompt_ids) > budget:
                break
            self.waiting.popleft()
            req.slot = self.cache.allocate()
            budget -= len(req.prompt_ids)
            admitted.append(req)
        return admitted

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        out = self.runner.forward([r.slot for r in reqs], [0] * len(reqs), [r.prompt_ids for r in reqs],
                                  last_only=True)
        self.running.extend(reqs)
        if self.drafter is not None:
            self.drafter.start(reqs, _split_rows(out.taps, [len(r.prompt_ids) for r in reqs]))
        return self._sample_and_commit(reqs, out.logits)

    def _decode(self, reqs: list[Request]) -> list[Request]:
        if self.drafter is not None:
            return self._speculative_step(reqs)
        out = self.runner.forward([r.slot for r in reqs], [r.cached_len for r in reqs],
                                  [[r.output_ids[-1]] for r in reqs])
        return self._sample_and_commit(reqs, out.logits)

    def _sample_and_commit(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        logits = suppress(logits, [self.stops.banned(r, 1)[0] for r in reqs])
        tokens = choose_tokens(logits, [r.params for r in reqs], [r.generator for r in reqs])
        finished = [r for i, (r, t) in enumerate(zip(reqs, tokens)) if self._commit(r, [t], logits[i : i + 1])[1]]
        self._retire(finished)
        return finished

    def _commit(self, req: Request, tokens: list[int], rows: torch.Tensor) -> tuple[int, bool]:
        """Append decided tokens until the request finishes; returns (appended, finished). `rows` are the
        target logits the tokens were decided from (row j for tokens[j])."""
        if self.forcing is not None:
            tokens = self.forcing.observe(req, tokens, rows)
        for n, token in enumerate(tokens, start=1):
            if self.stops.append(req, token):
                return n, True
        return len(tokens), False

    def _speculative_step(self, reqs: list[Request]) -> list[Request]:
        """Draft a block (a chain, or a tree of as many nodes) per request, verify all of them in one
        target pass, commit the accepted path plus the bonus token. Drafts stay on the device until the
        one sync after verification, so the host prepares the verify pass while the draft runs. The
        target cache needs no rollback: each request's cached length is derived from its committed
        tokens; a tree's accepted nodes are moved to the positions they now hold.

        When every request is greedy, acceptance runs on the device (a CUDA graph of its own), and a
        drafter that can (`launches_early`) starts the next draft before the sync: the host's work on
        this step's tokens then runs beside that draft instead of before it."""
        clock = StepClock(self.device)
        draft = self.drafter.propose(reqs)
        clock.mark()
        tree = draft.tree
        n, q = len(reqs), draft.tokens.shape[1] + 1
        rids = [r.rid for r in reqs]
        out = self.runner.verify([r.slot for r in reqs], [r.cached_len for r in reqs], [r.output_ids[-1] for r in reqs],
                                 draft.tokens, tree, laid_out=self._verify_laid_out == rids, placed=draft.placed)
        self._verify_laid_out = None
        banned = self._banned_rows(reqs, q, tree)
        early = graphed = False
        if all(r.params.greedy for r in reqs) and not any(banned):
            accepted, taps, host, graphed = self._accept_on_device(out)
            clock.mark()
            if self.drafter.launches_early:
                self.drafter.launch_next(reqs, out.batch, accepted, taps)
                clock.mark()
                early = True
            values, b = host.tolist(), out.batch.batch_size  # the one sync; rows of the bucket's b requests
            counts, tokens, nodes = values[:n], values[b : b + b * q], values[b + b * q :]
            decisions = [(tokens[i * q : i * q + c], nodes[i * q : i * q + c]) for i, c in enumerate(counts)]
        else:
            logits = suppress(out.logits, banned)
            decisions = self._walk(reqs, logits, draft)  # syncs
            clock.mark()
            taps = out.taps
            if tree is not None:  # per request: its count, then its rows padded to q
                walked = to_device([[len(t), *rows, *[0] * (q - len(rows))] for t, rows in decisions], self.device)
                base = out.batch.write_index.view(-1, q)[:n, 0]
                taps = self._arrange_accepted(base, walked[:, 0], walked[:, 1:], taps)
        clock.synced()
        finished, committed, redraft = [], [], False
        for i, (req, (tokens, rows)) in enumerate(zip(reqs, decisions)):
            decided = out.logits[i * q : (i + 1) * q]
            if self.forcing is not None:
                decided = decided[rows]
            n_committed, done = self._commit(req, tokens, decided)
            # token forcing may commit stock's tokens instead: a draft launched for ours no longer fits
            redraft |= not done and req.output_ids[-n_committed:] != tokens
            req.accept_lengths.append(n_committed)
            self.spec_stats.record(n_committed)
            committed.append(n_committed)
            if done:
                finished.append(req)
        if not early:
            self.drafter.commit(reqs, committed, _split_rows(taps, [q] * n))
        elif redraft:
            self.drafter.cancel_launch()
        if graphed and not (finished or redraft):  # the acceptance graph laid out these requests' next verify
            self._verify_laid_out = rids
            self.runner.static_inputs[q].laid_out = out.batch.batch_size
        self._retire(finished)
        clock.done()
        self.spec_stats.add_clock(clock)
        return finished

    def _accept_on_device(self, out: RunOutput) -> tuple[Accepted, torch.Tensor | None, HostCopy, bool]:
        """Greedy acceptance of a verify pass on the device: replays the acceptance graph of the verify
        graph that ran, or runs `_acceptance` eagerly. Returns the acceptance, the verify taps with
        accepted rows first, the values the host reads (see `_acceptance`) on their way to it, and
        whether the graph ran."""
        graph = self.acceptance_graphs.get(out.batch.batch_size)
        if graph is not None and graph.batch is out.batch:
            graph.graph.replay()
            accepted, taps, _ = graph.graph.outputs
            return accepted, taps, HostCopy(graph.host), True
        accepted, taps, values = self._acceptance(out.batch, out.logits, out.taps)
        return accepted, taps, HostCopy.of(values), False

    def _acceptance(self, batch: ForwardBatch, logits: torch.Tensor, verify_taps: torch.Tensor | None,
                    host: torch.Tensor | None = None) -> tuple[Accepted, torch.Tensor | None, torch.Tensor]:
        """Fixed-shape device work over a verify batch (graph-capturable): greedy acceptance, a tree's
        K/V compaction, the taps in accepted order, and the values the host reads: counts [b], then
        tokens and nodes [b, q] each, flat. The graph form (`host`: the pinned buffer it copies the
        values into) also lays out the next verify in the graph's static batch; an eager batch is not
        reused, so it is left as it is."""
        b, q = batch.batch_size, batch.max_q_len
        ids, positions = batch.input_ids.view(b, q), batch.positions.view(b, q)
        tree = None
        if batch.tree_mask is not None:
            tree = TreeLayout(ids[:, 1:], batch.tree_parents.view(b, q)[:, 1:], positions[:, 1:] - positions[:, :1],
                              batch.tree_mask.view(b, q))
        starts = positions[:, 0].clone()  # the layout below moves them on
        accepted = self.verifier.greedy(row_argmax(logits).view(b, q), ids[:, 1:], starts, tree)
        taps = verify_taps
        if tree is not None:
            taps = self._arrange_accepted(batch.write_index.view(b, q)[:, 0], accepted.counts, accepted.nodes, taps)
        values = torch.cat([accepted.counts, accepted.tokens.flatten(), accepted.nodes.flatten()])
        if host is not None:
            host.copy_(values, non_blocking=True)
            self._lay_out_next_verify(batch, accepted)
        return accepted, taps, values

    def _lay_out_next_verify(self, batch: ForwardBatch, accepted: Accepted) -> None:
        """In place: the batch becomes the next verify pass of the same requests (its block starts where
        this step's commits end, the bonus token first; the drafts and a tree are placed later), so a
        step whose batch did not change skips the host's fill of a verify graph's inputs. Padding rows
        (the scratch slot) stay where they are."""
        lay_out_next_verify(batch.positions, batch.write_index, batch.kv_lens, batch.input_ids, batch.slot_ids,
                            accepted.starts, accepted.counts, accepted.bonus(), self.cache.scratch_slot)

    def _walk(self, reqs: list[Request], logits: torch.Tensor, draft: Draft) -> list[tuple[list[int], list[int]]]:
        """The verifier's walk on the host (any sampling): per request the tokens to commit and the
        verify rows that decided them (0, then the accepted draft nodes)."""
        n, q = len(reqs), draft.tokens.shape[1] + 1
        parts = [row_argmax(logits), draft.tokens.to(logits.device).flatten()]
        if draft.tree is not None:
            parts.append(draft.tree.parents.to(logits.device).flatten())
        host = torch.cat(parts).tolist()
        flat, parents = host[n * q : n * q + n * (q - 1)], host[n * q + n * (q - 1) :]
        decisions = []
        for i, req in enumerate(reqs):
            drafted = slice(i * (q - 1), (i + 1) * (q - 1))
            tokens, path = self.verifier.accept(req, logits[i * q : (i + 1) * q], flat[drafted],
                                                host[i * q : (i + 1) * q], parents[drafted] if draft.tree else None)
            decisions.append((tokens, [0, *path]))
        return decisions

    def _banned_rows(self, reqs: list[Request], q: int, tree: TreeLayout | None) -> list[list[int]]:
        """Ids banned per verify row: row j decides the token at depth (its node's depth) + 1."""
        per_req = [self.stops.banned(r, q) for r in reqs]
        if tree is None or not any(row for rows in per_req for row in rows):
            return [row for rows in per_req for row in rows]
        depths = tree.depths.tolist()  # rare (min_new_tokens not reached yet): worth a sync
        return [rows[d] for rows, ds in zip(per_req, depths) for d in (0, *ds)]

    def _arrange_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor,
                          taps: torch.Tensor | None) -> torch.Tensor | None:
        """Trees only (a chain is in order already). Device-side, per request (cache row `base` of its
        newest token): the accepted nodes' K/V move from their node rows to the positions they now hold
        (depth d at base + d), for all layers at once (KVCache.compact_accepted); returns the verify taps
        with each request's accepted rows first, in order (what the drafter takes as committed rows)."""
        n, q = nodes.shape
        self.cache.compact_accepted(base, counts, nodes)
        order = torch.arange(0, n * q, q, device=nodes.device)[:, None] + nodes
        return None if taps is None else taps.index_select(0, order.flatten())

    def _retire(self, reqs: list[Request]) -> None:
        for req in reqs:
            if self.drafter is not None and req.slot is not None:
                self.drafter.release(req)
            if req.slot is not None:
                self.cache.free(req.slot)
                req.slot = None
            if req in self.running:
                self.running.remove(req)

    @contextmanager
    def autoregressive(self) -> Iterator[None]:
        """Decode without the drafter (AR on the same engine, weights and graphs) inside the block."""
        drafter, self.drafter = self.drafter, None
        try:
            yield
        finally:
            self.drafter = drafter

    # ---- convenience ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
        """Run prompts to completion (continuous batching when they exceed the slots)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return reqs

    def warm_up(self) -> None:
        """One short generation, so the first real request does not pay for kernel compilation and lazy
        allocations (on CUDA the first prefill took over a second); it leaves the statistics empty."""
        block = self.drafter.block_size if self.drafter else 1
        self.generate([list(range(16))], SamplingParams(max_new_tokens=2 * block + 2, ignore_eos=True))
        self.reset_spec_stats()

    def reset_spec_stats(self) -> None:
        self.spec_stats = SpecStats(block_size=self.drafter.block_size if self.drafter else 0)

    def output_text(self, req: Request) -> str:
        return self.stops.output_text(req)

    def rollback(self, req: Request, num_output_tokens: int) -> None:
        """Truncate a running request to its first `num_output_tokens` outputs. Cached K/V past the new
        length are simply ignored and overwritten later: with fixed slots a rollback moves no data."""
        if not 1 <= num_output_tokens <= len(req.output_ids):
            raise ValueError(f"can roll back to 1..{len(req.output_ids)} output tokens, not {num_output_tokens}")
        del req.output_ids[num_output_tokens:]
        # what the device prepared for the next step assumed the old length
        self._verify_laid_out = None
        if self.drafter is not None and self.drafter.launches_early:
            self.drafter.cancel_launch()
