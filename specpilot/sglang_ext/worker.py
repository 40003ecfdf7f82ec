"""The worker SGLang's scheduler drives for SPECPILOT (speculative/base_spec_worker.py BaseSpecWorker; SGLang
builds it with server_args, gpu_id, nccl_port, target_worker and its parallel-state keywords).

Our DFlash drafter runs in SGLang's process, on its device, beside the target (session.DraftSession): it embeds
and projects through the target's own embed_tokens and LM head (vocabulary shards joined across tensor-parallel
ranks) and reads the target's hidden states at its layers through SGLang's DFlash capture
(`set_dflash_layers_to_capture`, CaptureHiddenMode.FULL). Every rank drafts the same tokens from the same inputs.

A prefill (extend) is SGLang's own target pass; its taps become the drafter's context. A decode step:

1. the session proposes each request's chain or tree;
2. `layout.verify_tensors` lays the block out as SGLang's tree-verify input (the full custom mask);
3. the target runs one TARGET_VERIFY pass over it (SGLang's attention backend takes the mask);
4. `accept.row_decisions` decides every row (greedy argmax, else keyed sampling), the verifier's walk finds the
   accepted path, `accept.to_sglang` gives it SGLang's layout;
5. SGLang's KV bookkeeping keeps the accepted rows' K/V, the session commits the path (the drafter's next
   context), and a GenerationBatchResult hands the tokens to the scheduler - as in SGLang's NGRAMWorker.

Sampled rows: our keyed sampling (accept.row_decisions), or under SGLang's deterministic inference its own
sampler on every row (`_sglang_decisions`), so that sampled output is SGLang AR's too.

Not carried over: logprobs, hidden states, grammars, penalties, logit bias and custom logit processors (such a
request is aborted at admission with HTTP 400: admission.py). The drafter's passes run as CUDA graphs of their own
per batch size of the target's verify graphs (`init_cuda_graphs`). The target's weights are SGLang's to update; the
drafter keeps its own (a changed target lowers acceptance, never the tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from specpilot.engine.verify import Verifier
from specpilot.sglang_ext import accept, args
from specpilot.sglang_ext.layout import VerifyTensors, verify_tensors
from specpilot.sglang_ext.session import DraftSession, TargetHead


class SpecPilotWorker(BaseSpecWorker):
    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any, **parallel: Any) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # our drafter is not an SGLang TpModelWorker
        self.settings = s = args.resolve(server_args)
        self.model_runner = target_worker.model_runner
        model = self.model_runner.model
        if not hasattr(model, "set_dflash_layers_to_capture"):
            raise ValueError(f"--model-path {server_args.model_path}: SGLang's {type(model).__name__} cannot hand its "
                             "hidden states to a DFlash drafter (it has no set_dflash_layers_to_capture)")
        model.set_dflash_layers_to_capture(s.drafter.target_layer_ids)
        self.head = TargetHead.of_causal_lm(model, _vocab_gather(server_args.tp_size))
        self.device = self.head.lm_head_weight.device
        self.context_len = self.model_runner.model_config.context_len
        self.session: DraftSession | None = None  # made once the target's KV pool is (alloc_memory_pool)

    def alloc_memory_pool(self, memory_pool_config: Any = None, req_to_token_pool: Any = None,
                          token_to_kv_pool_allocator: Any = None) -> None:
        """After the target's pools: the drafter's context cache holds as many positions as the target's pool
        (plus two blocks a request), from the memory SGLang left beside it (--mem-fraction-static)."""
        super().alloc_memory_pool(memory_pool_config, req_to_token_pool, token_to_kv_pool_allocator)
        runner, s = self.model_runner, self.settings
        requests = runner.max_running_requests
        self.session = DraftSession.load(s.draft_path, self.head, requests, self.context_len, self.device,
                                         self.head.lm_head_weight.dtype, s.block_size, s.topk, s.ngram_assist,
                                         pool_tokens=runner.max_total_num_tokens + requests * 2 * s.block_size)

    def init_cuda_graphs(self) -> None:
        """After the target's graphs (SGLang's order): the drafter's, for the batch sizes of the target's verify
        graphs; where the target has none, or across tensor-parallel ranks (a graph would hold the vocabulary
        gather's collective), eager passes with their kernels compiled now for every batch size. Either way no
        request's step pays for a Triton compile (a kernel variant compiles at its first launch)."""
        runner = self.model_runner
        target_graphs = getattr(runner, "decode_cuda_graph_runner", None)
        if target_graphs is not None and self.server_args.tp_size == 1:
            # no engine verify graphs here for an early launch to read: the graphs lay out nothing ahead
            self.session.drafter.capture(tuple(target_graphs.capture_bs), {})
        else:
            self.session.drafter.warm(runner.max_running_requests)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.session.release(rid)

    # SGLang updates the target before asking the draft worker; BaseSpecWorker's versions walk SGLang draft runners
    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        return True, "updated the target's weights; the SPECPILOT drafter keeps its own"

    update_weights_from_ipc = update_weights_from_disk

    def update_weights_from_tensor(self, recv_req: Any) -> tuple[bool, str]:
        # SGLang hands tensor updates to the draft worker instead of the target when there is one
        return self._target_worker.update_weights_from_tensor(recv_req)

    def forward_batch_generation(self, batch: Any, on_publish: Any = None, **_: Any) -> GenerationBatchResult:
        if batch.forward_mode.is_extend():
            return self._prefill(batch, on_publish)
        if not batch.forward_mode.is_decode():  # an idle batch
            return self._target_worker.forward_batch_generation(batch)
        return self._verify(batch, on_publish)

    def _prefill(self, batch: Any, on_publish: Any) -> GenerationBatchResult:
        result = self._target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out = result.logits_output
        reqs = batch.reqs
        self.session.prefill([r.rid for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
                             batch.prefix_lens, batch.extend_lens, out.hidden_states, self._reach(reqs))
        out.hidden_states = None  # nothing for the scheduler to copy to the host
        new_seq_lens = batch.seq_lens.clone()
        if on_publish is not None:
            on_publish(new_seq_lens)
        d = self.settings.block_size
        accept_tokens = torch.zeros(len(reqs), d, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = result.next_token_ids
        accept_lens = torch.ones(len(reqs), dtype=torch.int32, device=self.device)
        return self._result(result, result.next_token_ids, accept_tokens.flatten(), accept_lens, new_seq_lens)

    def _verify(self, batch: Any, on_publish: Any) -> GenerationBatchResult:
        info = batch.sampling_info
        # admission refuses these (plugin.refuse_unsupported); a prefill may still carry an aborted one's
        if batch.return_logprob or batch.has_grammar or info.logit_bias is not None or info.has_custom_logit_processor:
            raise RuntimeError("a request SPECPILOT does not serve reached its verify (admission.refusal)")
        reqs = batch.reqs
        rids = [r.rid for r in reqs]
        draft = self.session.propose(rids, [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
                                     self._reach(reqs))
        newest = torch.tensor([r.output_ids[-1] for r in reqs], device=self.device)
        # FULL_MASK, as SGLang's NGRAM verify lays it out; its seq_lens_sum is not kept current in decode batches
        tensors = verify_tensors(newest, draft.tokens, draft.tree, batch.seq_lens, int(batch.seq_lens_cpu.sum()))
        bs, d = tensors.retrieve_index.shape
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tensors.draft_token
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens, end_offset=batch.seq_lens + d, batch_size=bs, draft_token_num=d,
            device=self.device)
        batch.spec_info = to_verify_input(tensors)
        result = self._target_worker.forward_batch_generation(batch, is_verify=True,
                                                              capture_hidden_mode=CaptureHiddenMode.FULL)
        out = result.logits_output
        if self.settings.deterministic:
            decisions = self._sglang_decisions(batch.sampling_info, out.next_token_logits, tensors.positions, d)
        else:
            depths = tensors.positions.view(bs, d) - batch.seq_lens[:, None]
            params = [accept.sampling_params(r.sampling_params) for r in reqs]
            seeds = [accept.keyed_seed(r.rid, p.seed) for r, p in zip(reqs, params)]
            output_lens = torch.tensor([len(r.output_ids) for r in reqs])
            decisions = accept.row_decisions(out.next_token_logits, params, seeds, output_lens, depths)
        accepted = Verifier().greedy(decisions, draft.tokens, batch.seq_lens, draft.tree)
        predict, accept_index, accept_lens = accept.to_sglang(accepted)
        self.session.commit(rids, accepted, out.hidden_states)
        out.hidden_states = None
        move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = predict[accept_index].flatten()  # rows past a request's count: ignored by accept_lens
        return self._result(result, accept_tokens, accept_tokens, accept_lens, new_seq_lens)

    def _sglang_decisions(self, sampling_info: Any, logits: torch.Tensor, positions: torch.Tensor,
                          d: int) -> torch.Tensor:
        """[bs, D] SGLang's own sampler's token at every verify row, keyed (deterministic inference) by the
        request's seed and the row's input position, as in SGLang's decode of that token."""
        rows = LogitsProcessorOutput(next_token_logits=logits.clone())  # the sampler scales and softmaxes in place
        tokens = self.model_runner.sampler(rows, accept.rows_sampling_info(sampling_info, d), False, [], [], positions)
        return tokens.view(-1, d)

    def _reach(self, reqs: list[Any]) -> list[int]:
        """The positions each request may reach: its prompt, its new tokens and a verify block."""
        d = self.settings.block_size
        return [min(len(r.origin_input_ids) + (r.sampling_params.max_new_tokens or self.context_len), self.context_len)
                + d for r in reqs]

    def _result(self, result: Any, next_token_ids: torch.Tensor, accept_tokens: torch.Tensor,
                accept_lens: torch.Tensor, new_seq_lens: torch.Tensor) -> GenerationBatchResult:
        d = self.settings.block_size
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=d, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=d)


def _vocab_gather(tp_size: int) -> Any:
    """What joins the LM head's vocabulary shards of a logits row across tensor-parallel ranks (None: one rank)."""
    if tp_size == 1:
        return None
    from sglang.srt.distributed import tensor_model_parallel_all_gather

    return lambda logits: tensor_model_parallel_all_gather(logits, dim=-1)


def to_verify_input(tensors: VerifyTensors) -> NgramVerifyInput:
    """SGLang's tree-verify input (the one its attention backends take a custom mask from) for a block, with
    the tree's depths and ancestors for the Triton backend's decode rows (decode_rows.py)."""
    spec_info = NgramVerifyInput(draft_token=tensors.draft_token, custom_mask=tensors.custom_mask,
                                 positions=tensors.positions, retrieve_index=tensors.retrieve_index,
                                 retrieve_next_token=tensors.retrieve_next_token,
                                 retrieve_next_sibling=tensors.retrieve_next_sibling,
                                 draft_token_num=tensors.draft_token_num)
    spec_info.row_depths, spec_info.row_ancestors = tensors.depths, tensors.ancestors
    return spec_info
