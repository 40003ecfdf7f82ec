"""SGLang's entry point: `register` (group sglang.srt.plugins in pyproject.toml) adds the speculative
algorithm SPECPILOT to SGLang's registry (speculative/spec_info.py SpeculativeAlgorithm.register), and hooks
the verify input SGLang's CUDA-graph runner captures the target's verify graphs with (`capture_verify_input`),
answers SGLang's scheduler's question for the drafter's K/V pool (`no_draft_kv_pool`), aborts at admission the
requests our worker cannot serve (`refuse_unsupported`), and, under deterministic inference, has the target's Triton
attention verify with decode rows (`attention_backend_init`, decode_rows.py), so that verify logits are AR's.

SGLang's load_plugins() calls it once in every process and logs and swallows what it raises, so a broken
plugin shows as `Unknown speculative algorithm name: SPECPILOT`, with the cause earlier in the log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.speculative.spec_info import CustomSpecAlgo, SpeculativeAlgorithm

from specpilot.sglang_ext import admission, args, decode_rows

logger = logging.getLogger(__name__)

NAME = "SPECPILOT"
GRAPH_VERIFY_INPUT = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
DRAFT_KV_POOL = "sglang.srt.mem_cache.kv_cache_builder.get_draft_kv_pool"
ADMISSION = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"


class SpecPilotAlgorithm(CustomSpecAlgo):
    """What SGLang's scheduler and KV accounting ask of an algorithm, answered for ours — including three methods
    of SGLang's algorithm enum that its CustomSpecAlgo lacks (0.5.17) and its scheduler calls at start."""

    def has_draft_kv(self) -> bool:
        # our drafter's K/V live in its own cache: SGLang's pool holds only the verify block, as for NGRAM
        return False

    def carries_draft_hidden_states(self) -> bool:
        # nothing of the drafter's travels from a prefill server to a decode server
        return False

    def need_topk(self) -> bool:
        # no EAGLE top-k tensors relayed between steps
        return False

    def create_future_map(self, device: Any, req_to_token_pool: Any, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False) -> Any:
        from sglang.srt.managers.overlap_utils import FutureMap

        # the host's sequence lengths always: the worker sizes its full tree mask from them, as NGRAM's verify does
        return FutureMap(device, self, req_to_token_pool, True, needs_confidence_relay)

    def handle_server_args(self, server_args: Any) -> None:
        args.apply(server_args)


def register() -> None:
    SpeculativeAlgorithm.register(NAME, supports_overlap=False, validate_server_args=args.validate,
                                  spec_class=SpecPilotAlgorithm)(_worker_class)
    HookRegistry.register(GRAPH_VERIFY_INPUT, capture_verify_input, HookType.AROUND)
    HookRegistry.register(DRAFT_KV_POOL, no_draft_kv_pool, HookType.AROUND)
    HookRegistry.register(ADMISSION, refuse_unsupported, HookType.AROUND)
    HookRegistry.register(f"{decode_rows.BACKEND}.__init__", attention_backend_init, HookType.AROUND)
    for target, hook in decode_rows.HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND)


def attention_backend_init(init: Any, backend: Any, model_runner: Any, *rest: Any, **kwargs: Any) -> None:
    """Marks the target's Triton backend of a SPECPILOT server under deterministic inference for decode-row
    verification (decode_rows.py) — or says why its verify logits may differ from AR's by a rounding step."""
    init(backend, model_runner, *rest, **kwargs)
    ours = (isinstance(getattr(model_runner, "spec_algorithm", None), SpecPilotAlgorithm)
            and not model_runner.is_draft_worker)
    why_not = decode_rows.supported(backend) if ours else "not SPECPILOT's target"
    setattr(backend, decode_rows.ROWS, why_not is None)
    if ours and why_not is not None and backend.enable_deterministic:
        logger.warning("SPECPILOT verifies with SGLang's extend kernel (%s): its tokens can differ from SGLang AR's "
                       "at near-ties", why_not)


def refuse_unsupported(add_request_to_queue: Any, scheduler: Any, req: Any, is_retracted: bool = False) -> Any:
    """A new request a SPECPILOT server cannot serve (admission.refusal) finishes at once with HTTP 400 and the
    reason, as SGLang aborts requests at admission (a one-token prefill, then the error), instead of reaching the
    worker, whose exception would stop the server."""
    if isinstance(scheduler.spec_algorithm, SpecPilotAlgorithm) and not is_retracted and req.to_finish is None:
        reason = admission.refusal(req)
        if reason is not None:
            req.set_finish_with_abort(reason)
    return add_request_to_queue(scheduler, req, is_retracted=is_retracted)


def no_draft_kv_pool(get_draft_kv_pool: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler asks every speculative worker but NGRAM's for its drafter's K/V pool (for disaggregation
    and the hierarchical cache) by reaching into an SGLang draft worker's runner; ours has no SGLang draft worker
    and keeps its drafter's K/V in its own cache, so, as for NGRAM, there is none to hand over."""
    if isinstance(kwargs.get("spec_algorithm"), SpecPilotAlgorithm):
        return None
    return get_draft_kv_pool(**kwargs)


def capture_verify_input(get_spec_info: Any, runner: Any, num_tokens: int) -> Any:
    """The verify input SGLang's CUDA-graph runner captures the target's TARGET_VERIFY graphs with. SGLang makes
    one for its own algorithms only; with none, ours would be captured without a tree mask (the Triton backend
    bakes `custom_mask=None` into the graph, which then verifies every tree as a chain; FlashInfer's capture
    fails) and without the hidden states our drafter reads. For ours: the tree-verify input our worker hands the
    target (NGRAM's), on the runner's mask buffer, capturing every position's hidden states."""
    spec_info = get_spec_info(runner, num_tokens)
    model_runner = runner.model_runner
    if (spec_info is not None or model_runner.is_draft_worker
            or not isinstance(model_runner.spec_algorithm, SpecPilotAlgorithm)):
        return spec_info
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    spec_info = NgramVerifyInput(draft_token=None, custom_mask=runner.buffers.custom_mask, positions=None,
                                 retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
                                 draft_token_num=runner.captured_req_width)
    spec_info.capture_hidden_mode = CaptureHiddenMode.FULL
    # a chain for the decode rows' capture (decode_rows.py); replays read the live block's tree
    d = runner.captured_req_width
    device = runner.buffers.custom_mask.device
    spec_info.row_depths = torch.arange(d, device=device).expand(num_tokens // d, d)
    spec_info.row_ancestors = torch.ones(d, d, dtype=torch.bool, device=device).tril().expand(num_tokens // d, d, d)
    return spec_info


def _worker_class(server_args: Any) -> type:
    # imported when SGLang builds its workers: the worker module pulls in SGLang's scheduler and model code
    from specpilot.sglang_ext.worker import SpecPilotWorker

    return SpecPilotWorker
