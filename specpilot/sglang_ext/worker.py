"""The worker SGLang's scheduler drives for SPECPILOT (speculative/base_spec_worker.py BaseSpecWorker; SGLang
builds it with server_args, gpu_id, nccl_port, target_worker and its parallel-state keywords).

A decode step, as the worker is to run it: our drafter proposes a chain or tree per request (args.Settings);
`layout.verify_tensors` lays the block out as SGLang's verify input (`to_verify_input`); the target worker
runs one TARGET_VERIFY pass; `accept.row_decisions`, the verifier's walk and `accept.to_sglang` turn its
logits into the committed tokens in SGLang's layout; SGLang's KV bookkeeping (move_accept_tokens_to_target_
kvcache) and a GenerationBatchResult close the step, as in SGLang's NGRAMWorker.

In place and tested on CPU: the settings and the conversions both ways. Not yet: the device half (below),
so constructing the worker raises and a server stops at launch with the reason rather than at its first
request.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from specpilot.sglang_ext import args
from specpilot.sglang_ext.layout import VerifyTensors

DEVICE_HALF_MISSING = (
    "SPECPILOT's SGLang worker cannot run yet: its device half is not implemented - running SpecPilot's DFlash "
    "drafter ({path}) inside SGLang's process on its device (fed the target's layers {layers} through SGLang's "
    "hidden-state capture, embedding and projecting with the target's embed_tokens and vocabulary-parallel "
    "lm_head, keeping its context K/V per req_pool_index), and the decode step around SGLang's target verify "
    "pass. In place: registration, the server-argument checks (block size {block}, tree top-k {topk}), and "
    "the conversions to SGLang's verify inputs and back (specpilot.sglang_ext.layout, .accept)."
)


class SpecPilotWorker(BaseSpecWorker):
    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any, **parallel: Any) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # our drafter is not an SGLang TpModelWorker
        self.settings = args.resolve(server_args)
        s = self.settings
        raise NotImplementedError(DEVICE_HALF_MISSING.format(path=s.draft_path, layers=s.drafter.target_layer_ids,
                                                             block=s.block_size, topk=s.topk))


def to_verify_input(tensors: VerifyTensors) -> NgramVerifyInput:
    """SGLang's tree-verify input (the one its attention backends take a custom mask from) for a block."""
    return NgramVerifyInput(draft_token=tensors.draft_token, custom_mask=tensors.custom_mask,
                            positions=tensors.positions, retrieve_index=tensors.retrieve_index,
                            retrieve_next_token=tensors.retrieve_next_token,
                            retrieve_next_sibling=tensors.retrieve_next_sibling,
                            draft_token_num=tensors.draft_token_num)
