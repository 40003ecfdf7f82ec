"""The engine: requests in, tokens out. Admits waiting requests into free KV slots (batched ragged
prefill), then advances every running request by one decode step per `step()` call."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from itertools import accumulate
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from specpilot.config import SamplingParams
from specpilot.drafters.base import DrafterContext
from specpilot.engine.config import EngineConfig, resolve_device, resolve_dtype
from specpilot.engine.admission import Admission
from specpilot.engine.ahead import AheadDecode
from specpilot.engine.memory import KVPlan, kv_bytes_per_token, plan_kv, return_freed_memory
from specpilot.engine.budget import SpeculationBudget
from specpilot.engine.cost_table import CostTable, cache_path, key_for, load_cost_table
from specpilot.engine.gemm_tiles import load_tile_table
from specpilot.engine.registry import Deployment, check_tunables, resolve_mechanisms
from specpilot.engine.sampling import choose_tokens, suppress
from specpilot.engine.spec_stats import SpecStats
from specpilot.engine.step import SpeculativeStep
from specpilot.engine.grammar import GrammarCompiler, RequestGrammar, constrain
from specpilot.engine.logprobs import prompt_logprobs, token_logprobs, wants_prompt_logprobs
from specpilot.engine.stops import StopChecker
from specpilot.engine.two_level import VerifyLengths, verify_widths
from specpilot.engine.verify import Verifier
from specpilot.kernels.slot_attention import MAX_TREE_Q_LEN
from specpilot.kernels.softmax_topk import row_argmax
from specpilot.kernels.triton_support import HAS_TRITON
from specpilot.models.build import build_model
from specpilot.models.checkpoint import Checkpoint, load_checkpoint
from specpilot.models.linear import iter_linears, set_tile_table, to_b12, warm_linears, weight_bytes
from specpilot.models.runner import PREFILL_GRAPH_BATCH_SIZES, ModelRunner, RunOutput
from specpilot.models.transformer import Transformer
from specpilot.progress import phase
from specpilot.state.cache import KVCache
from specpilot.state.pages import PageTable
from specpilot.state.graphs import GraphBackend
from specpilot.state.request import Request
from specpilot.state.transfer import HostCopy

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter

log = logging.getLogger(__name__)


class TokenObserver(Protocol):
    def observe(self, req: Request, tokens: list[int], rows: torch.Tensor) -> list[int]: ...


def _wants_b12(config: EngineConfig, checkpoint: Checkpoint) -> bool:
    """--mechanisms names b12, or leaves it open and the checkpoint was B12 (its registry entry checks bf16)."""
    return config.asks_for("b12") or (config.leaves_open("b12") and checkpoint.weight_format == "b12")


def _build_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer:
    with phase(f"building the model on {device.type} in {str(dtype).removeprefix('torch.')}"):
        return build_model(checkpoint, device, dtype)


def _split_rows(rows: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor | None]:
    if rows is None:
        return [None] * len(lengths)
    return list(rows.split(lengths))


class Engine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, model: Transformer | None = None,
                 drafter_factory: Callable[[EngineConfig, DrafterContext], Drafter] | None = None,
                 cache: KVCache | None = None) -> None:
        """`model`: an already built target (synthetic weights in benchmarks); `drafter_factory`: builds
        the drafter from the config and what it drafts for (default: from the --speculative-* settings); the target's KV cache is sized after it. `cache`: another
        engine's KV cache to run in (see `twin`)."""
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        mcfg = checkpoint.config
        self.model = model if model is not None else _build_model(checkpoint, self.device, self.dtype)
        if _wants_b12(config, checkpoint):  # before the KV pool is sized: it gets the bytes B12 frees
            with phase("holding the target's matrices as B12"):
                to_b12(self.model)
            return_freed_memory()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        # a hybrid target (models/hybrid.py) runs in plain torch: no invariant kernels, no graphs
        self.hybrid = mcfg.hybrid is not None
        per_token = kv_bytes_per_token(self.model.kv_layers, mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        if cache is None:
            self.kv_plan = plan = plan_kv(self.device, per_token, mcfg.max_position_embeddings,
                                          config.max_running_requests, config.context_length, config.max_total_tokens,
                                          mem_fraction_static=config.mem_fraction_static)
            # a slot's room for a verify pass's spill past the context: the largest block asked for, or a tree's
            spill = max(MAX_TREE_Q_LEN, config.speculative_num_draft_tokens or 0)
            pages = PageTable(plan.num_slots, plan.context_length + spill,
                              None if plan.whole_slots else plan.total_tokens, self.device, config.page_size)
        else:  # a twin: the other engine's slots and pool, and its context length (its config is resolved)
            pages = cache.pages
            self.kv_plan = KVPlan(pages.num_slots, config.context_length, per_token, budget_bytes=0,
                                  limited_by="a shared cache", pool_tokens=cache.pool_tokens)
        self.pages = pages
        # the settings in effect (/get_server_info reports them)
        self.config = config = replace(config, max_running_requests=self.kv_plan.num_slots,
                                       context_length=self.kv_plan.context_length,
                                       max_total_tokens=self.kv_plan.total_tokens, page_size=pages.page_size)
        self.context_length = self.kv_plan.context_length
        # Exact: the invariant kernels run, so logits are bitwise independent of pass and batch (forcing
        # then requires identity, tie band 0).
        self.exact = config.batch_invariant and self.device.type == "cuda" and HAS_TRITON and not self.hybrid
        self.model.set_batch_invariant(self.exact)
        # this device's tuned GEMM tiles, where `specpilot bench --tune-gemm-tiles` made them: the same bits, sooner
        self.gemm_tiles, self.gemm_tiles_path = load_tile_table(self.device) if self.exact and config.tuned_tiles \
            else (None, None)
        set_tile_table(self.model, self.gemm_tiles)
        check_tunables(Deployment(self.device.type, config))
        self._drafter: Drafter | None = None
        if drafter_factory is None and config.speculative_algorithm:
            from specpilot.drafters import build_drafter as drafter_factory
        if drafter_factory is not None:
            with phase(f"loading the drafter ({config.speculative_algorithm or 'custom'})"):
                self._drafter = drafter_factory(config, DrafterContext(
                    self.model, checkpoint, self.device, self.dtype, pages, self.context_length))
            # defaults resolved by the drafter
            self.config = replace(config, speculative_num_draft_tokens=self.drafter.block_size,
                                  speculative_draft_model_path=self.drafter.source)
        # A verify pass near the end of the context writes up to block_size - 1 positions past it.
        self.spill = self.drafter.block_size if self.drafter else 0
        slot_len = self.context_length + self.spill
        if slot_len > pages.max_len:
            raise ValueError(f"the drafter's block of {self.spill} tokens does not fit the KV slots' "
                             f"{pages.max_len - self.context_length} positions past the context: pass "
                             f"--speculative-num-draft-tokens")
        self.model.setup_rope(slot_len)
        if cache is None:
            cache = self.model.kv_cache(self.dtype, pages)
            log.info("KV pool: %d pages of %d positions = %d tokens, %.0f MiB, for %d request slots of up to %d "
                     "(limited by %s)", pages.num_pages, pages.page_size, cache.pool_tokens,
                     cache.kv.numel() * cache.kv.itemsize / 2**20, pages.num_slots, self.context_length,
                     self.kv_plan.limited_by)
        self.cache = cache
        self.runner = ModelRunner(self.model, self.cache, self.device,
                                  tap_layers=self.drafter.tap_layers if self.drafter else ())
        self.stops = StopChecker(self.tokenizer, mcfg.eos_token_ids, self.context_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admission = Admission(PREFILL_GRAPH_BATCH_SIZES[-1], config.max_running_requests) \
            if config.admission == "coalesce" else None
        self.verifier = Verifier()
        # Token forcing (specpilot.forcing) installs itself here: it sees every decided token first.
        self.forcing: TokenObserver | None = None
        self.reset_spec_stats()
        self.last_step: str | None = None  # "prefill" or "decode": what the newest step() ran
        graphs = config.cuda_graphs and GraphBackend.available(self.device) and not self.hybrid
        self._set_up_speculation(graphs)
        if graphs:
            with phase("capturing CUDA graphs"):
                self._capture_graphs()
        elif self.device.type == "cuda":  # without graphs Triton compiles each kernel variant at its first launch
            with phase("compiling the eager passes' kernels"):
                block = self._drafter.block_size if self._drafter is not None else 1
                warm_linears([self.model], max(config.max_prefill_tokens, config.max_running_requests * block))
                if self._drafter is not None:
                    self._drafter.warm(config.max_running_requests)

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        """A drafter set after construction (tests' oracles) speculates without graphs of its own."""
        self._drafter = drafter
        self._set_up_speculation(graphs=False)

    def _set_up_speculation(self, graphs: bool) -> None:
        """The mechanisms in effect for this drafter (engine/registry.py) and the step that runs them."""
        capabilities = self._drafter.capabilities if self._drafter else None
        self.mechanisms = resolve_mechanisms(self.config.mechanisms,
                                             Deployment(self.device.type, self.config, capabilities, graphs))
        if self.weights_info()["format"] == "b12":  # weights shared with a twin that asked for them
            self.mechanisms |= {"b12"}
        self.speculation = SpeculativeStep(self) if self._drafter else None
        self.ahead = AheadDecode(self.runner) if "overlap" in self.mechanisms else None
        self.budget = SpeculationBudget() if "budget" in self.mechanisms else None
        self.verify_lengths = VerifyLengths(self._cost_table()) if "two-level" in self.mechanisms else None
        if self.verify_lengths is not None and self._drafter.capabilities.trees:
            self._drafter.tree_confidences = True  # before its graphs are captured

    def _cost_table(self) -> CostTable:
        key = key_for(self.device, self.checkpoint.source, self.dtype, self.exact)
        table = load_cost_table(key)
        if table is None:
            raise ValueError(f"--mechanisms: two-level needs this device and model's cost table ({cache_path(key)}): "
                             "run `specpilot bench --profile-cost-table` with the same --model-path, --device and "
                             "--dtype first")
        return table

    def _capture_graphs(self) -> None:
        q_lens = (1,) if self.drafter is None else (1, *verify_widths(self.drafter.block_size, self.mechanisms))
        trees = self.drafter is not None and self.config.speculative_eagle_topk > 1
        self.runner.capture(q_lens=q_lens, batch_sizes=self.config.cuda_graph_batch_sizes,
                            tree_qs=tuple(q for q in q_lens if q > 1) if trees else (),
                            num_kv_splits=self.config.attention_kv_splits,
                            ragged_q=self.drafter.block_size if "ragged" in self.mechanisms else 0,
                            prefill_tokens=self.config.prefill_graph_tokens)
        if self.speculation is not None:
            self.speculation.capture()

    def weights_info(self) -> dict[str, int | str]:
        """The target's weight format ("b12" once any matrix is held so) and bytes, beside what they take dense, and
        the tuned GEMM tiles' file its products launch on ("untuned": none)."""
        held = weight_bytes(self.model)
        planes = [linear for _, linear in iter_linears(self.model) if linear.b12 is not None]
        dense = held + sum((lin.in_features * lin.out_features * 2 if lin.weight is None else 0) - lin.b12.stored_bytes
                           for lin in planes)
        return {"format": "b12" if planes else str(self.dtype).removeprefix("torch."), "bytes": held,
                "dense_bytes": dense, "saved_bytes": dense - held,
                "gemm_tiles": str(self.gemm_tiles_path) if self.gemm_tiles_path else "untuned"}

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
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None,
                    prefill_from: Request | None = None) -> Request:
        """`prefill_from`: an earlier request of the same prompt (another sample of it), whose prefill this one
        copies when both are admitted together."""
        prompt = list(prompt_ids)
        if prefill_from is not None and prefill_from.prompt_ids != prompt:
            raise ValueError("a request may share the prefill only of the same prompt")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context length is {self.context_length}")
        vocab = self.checkpoint.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        req = Request(prompt, params) if rid is None else Request(prompt, params, rid=rid)
        req.prefill_from = prefill_from
        if params.constraint is not None:
            req.grammar = self._grammar(params)
        if not params.greedy:
            req.sampling_seed = params.seed if params.seed is not None else random.getrandbits(63)
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
                self.retire([req])
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
        if self.model.batch_invariant != self.exact or self.model.tile_table is not self.gemm_tiles:
            self.model.set_batch_invariant(self.exact)  # a twin with other kernels or tiles ran last
            set_tile_table(self.model, self.gemm_tiles)
        admitted = self._admit()
        if admitted:
            self.last_step = "prefill"
            start = time.perf_counter()
            finished = self._prefill(admitted)
            if self.admission is not None:
                self.admission.prefilled(time.perf_counter() - start)
            return finished
        if self.running:
            self.last_step = "decode"
            return self._decode(self.running)
        return []

    def positions_needed(self, req: Request) -> int:
        """Cache positions a request can reach: its prompt, its new tokens and a verify pass's spill."""
        return min(len(req.prompt_ids) + req.params.max_new_tokens + self.spill, self.cache.max_len)

    def _admit(self) -> list[Request]:
        """Waiting requests in order while a slot and the pages for every position they can reach are free."""
        admitted: list[Request] = []
        free = min(self.cache.num_free, self.config.max_running_requests - len(self.running))
        if self.running and free < min(self.config.min_prefill_batch, len(self.waiting)):
            return admitted
        if self.admission is not None and not self.admission.worth_a_pass(self.waiting, free, len(self.running)):
            return admitted
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            # a sample admitted with the request whose prefill it copies shares that prompt's pages
            src = req.prefill_from
            share = (src.slot, len(src.prompt_ids)) if src is not None and src.prefill_from is None \
                and any(src is r for r in admitted) else None
            need = self.positions_needed(req)
            if (admitted and len(req.prompt_ids) > budget) or not self.cache.can_hold(need, share):
                break
            self.waiting.popleft()
            req.slot = self.cache.allocate(need, share)
            budget -= len(req.prompt_ids)
            admitted.append(req)
        if self.admission is not None:
            self.admission.filled(len(admitted))
        return admitted

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        """One pass over the prompts of the admitted requests but those whose sample of the same prompt is
        among them: those copy its K/V, taps and last logits (each still samples with its own seed)."""
        admitted = {id(r) for r in reqs}
        shares = [r.prefill_from is not None and id(r.prefill_from) in admitted and r.prefill_from.prefill_from is None
                  for r in reqs]
        computed = [r for r, shared in zip(reqs, shares) if not shared]
        index = {id(r): i for i, r in enumerate(computed)}
        scored = [wants_prompt_logprobs(r) for r in computed]
        out = self.runner.forward([r.slot for r in computed], [0] * len(computed), [r.prompt_ids for r in computed],
                                  last_only=True, keep_hidden=any(scored))
        if out.hidden is not None:
            starts = [0, *accumulate(len(r.prompt_ids) for r in computed)]
            for r, lo, hi, want in zip(computed, starts, starts[1:], scored):
                if want:
                    prompt_logprobs(r, out.hidden[lo:hi], self.model.logits)
        for r, shared in zip(reqs, shares):
            if shared:
                self.cache.copy_prefix(r.prefill_from.slot, r.slot, len(r.prompt_ids))
                if wants_prompt_logprobs(r):
                    r.input_logprobs = list(r.prefill_from.input_logprobs)
        self.running.extend(reqs)
        rows = [index[id(r.prefill_from if shared else r)] for r, shared in zip(reqs, shares)]
        if self.drafter is not None:
            taps = _split_rows(out.taps, [len(r.prompt_ids) for r in computed])
            self.drafter.start(reqs, [taps[i] for i in rows])
        return self._sample_and_commit(reqs, out.logits[rows])

    def _decode(self, reqs: list[Request]) -> list[Request]:
        if self.drafter is None:
            return self._decode_ar(list(reqs))
        if self.budget is None:
            return self.speculation(reqs)
        batch = list(reqs)  # `reqs` is the running list, which the step's retirements shrink
        before, start = sum(len(r.output_ids) for r in batch), time.perf_counter()
        speculate = self.budget.speculate(len(batch))
        finished = self.speculation(reqs) if speculate else self._decode_beside_drafter(batch)
        self.budget.record(len(batch), speculate, sum(len(r.output_ids) for r in batch) - before,
                           time.perf_counter() - start)
        return finished

    def _decode_ar(self, reqs: list[Request], drafter_commit: bool = False) -> list[Request]:
        """An AR step; under `overlap` (engine/ahead.py) from the pass the previous step launched where it still
        holds, and launching the next one before the host commits, where this batch allows it. `drafter_commit`:
        the drafter is told of each request's committed token with its row's taps, as after a verify pass."""
        taken = self.ahead.take(reqs) if self.ahead is not None else None
        if taken is None:
            out = self._decode_pass(reqs)
            logits, taps, deciding = out.logits, out.taps, reqs
        else:  # requests that joined since it launched decide nothing this step
            logits, taps, deciding = taken.logits, taken.taps, [reqs[i] for i in taken.kept]
        if drafter_commit and taps is not None:  # copied: the graph's outputs are overwritten by its next pass
            taps = taps[: len(deciding)].clone()
        if self.ahead is None or not self._overlappable(reqs):
            finished = self._sample_and_commit(deciding, logits)
        else:
            tokens = row_argmax(logits)
            chosen = HostCopy.of(tokens)  # queued before the next pass: waits for this one's tokens alone
            self.ahead.launch(reqs, tokens, taken)
            finished = self._commit_chosen(deciding, chosen.tolist(), None)
            self.ahead.committed()
        if drafter_commit:
            done = {id(r) for r in finished}
            going = [i for i, r in enumerate(deciding) if id(r) not in done]
            self.drafter.commit([deciding[i] for i in going], [1] * len(going),
                                [None if taps is None else taps[i : i + 1] for i in going])
        return finished

    def _overlappable(self, reqs: list[Request]) -> bool:
        """Whether the host needs nothing of this step's logits but their argmax: greedy requests without a grammar,
        banned ids or logprobs, no token forcing, and a decode graph for the batch."""
        return (self.forcing is None and self.ahead.can_launch(len(reqs)) and not self.stops.bans(reqs)
                and all(r.params.greedy and r.grammar is None and not r.params.return_logprob for r in reqs))

    def _decode_pass(self, reqs: list[Request]) -> RunOutput:
        return self.runner.forward([r.slot for r in reqs], [r.cached_len for r in reqs],
                                   [[r.output_ids[-1]] for r in reqs])

    def _decode_beside_drafter(self, reqs: list[Request]) -> list[Request]:
        """An AR step while speculation is paused (`budget`): what the device prepared for a next verify no
        longer holds, and the drafter is told of each request's one committed token (with its row's taps) as
        after a verify pass. `reqs`: a list of the caller's, not the running list, which retiring the finished
        shrinks."""
        self.speculation.invalidate()
        return self._decode_ar(reqs, drafter_commit=True)

    def mask_as_decoded(self, params: SamplingParams, output: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The rows [len(output), V] that decided `output` (a teacher-forced pass's), masked in place as a
        request of `params` masks them while decoding: stop ids banned before min_new_tokens, then its grammar
        along `output`."""
        suppress(logits, self.stops.banned(Request([], params), len(output)))  # positions from the first
        if params.constraint is not None:
            constrain(logits, self._grammar(params).masks_along(output))
        return logits

    def _grammar(self, params: SamplingParams) -> RequestGrammar:
        """A fresh grammar state for `params`' constraint (the compiler is made on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.checkpoint.config.vocab_size)
        return self._grammars.matcher(params)

    def _sample_and_commit(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        if self.stops.bans(reqs):
            logits = suppress(logits, [self.stops.banned(r, 1)[0] for r in reqs])
        for i, r in enumerate(reqs):
            if r.grammar is not None:
                constrain(logits[i : i + 1], r.grammar.bitmask([]))
        return self._commit_chosen(reqs, choose_tokens(logits, reqs), logits)

    def _commit_chosen(self, reqs: list[Request], tokens: list[int], logits: torch.Tensor | None) -> list[Request]:
        """Commit one chosen token a request (`logits`: the rows they were chosen from, where forcing or
        logprobs read them); retire those that finished."""
        finished, forcing = [], self.forcing is not None
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            n, done = self.commit_tokens(r, [t], logits[i : i + 1] if forcing or r.params.return_logprob else None)
            r.token_origins += ["target"] * n
            if done:
                finished.append(r)
        self.retire(finished)
        return finished

    def commit_tokens(self, req: Request, tokens: list[int], rows: torch.Tensor | None) -> tuple[int, bool]:
        """Append decided tokens until the request finishes; returns (appended, finished). `rows` are the
        target logits the tokens were decided from (row j for tokens[j]); None where nothing reads them
        (no token forcing, no logprobs)."""
        if self.forcing is not None:
            tokens = self.forcing.observe(req, tokens, rows)
        n, done = self.stops.extend(req, tokens)
        if req.params.return_logprob:
            req.logprobs += token_logprobs(rows[:n], tokens[:n], req.params)
        return n, done

    def retire(self, reqs: list[Request]) -> None:
        for req in reqs:
            if self.drafter is not None and req.slot is not None:
                self.drafter.release(req)
            if req.slot is not None:
                self.cache.free(req.slot)
                req.slot = None
                if self.admission is not None:
                    self.admission.slot_freed()
            if req in self.running:
                self.running.remove(req)

    @contextmanager
    def autoregressive(self) -> Iterator[None]:
        """Decode without the drafter (AR on the same engine, weights and graphs) inside the block."""
        drafter, self._drafter = self._drafter, None
        try:
            yield
        finally:
            self._drafter = drafter

    # ---- convenience ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_step: Callable[[], None] | None = None) -> list[Request]:
        """Run prompts to completion (continuous batching when they exceed the slots); `on_step` after each step."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
            if on_step is not None:
                on_step()
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
        del req.token_origins[num_output_tokens:]
        del req.logprobs[num_output_tokens:]
        if req.grammar is not None:
            req.grammar.reset(req.output_ids)
        if self.speculation is not None:  # what the device prepared for the next step assumed the old length
            self.speculation.invalidate()
