"""SGLang's verify pass back into committed tokens, by our verifier's rule (engine/verify.py).

The target's TARGET_VERIFY pass gives logits at every block row ([bs * D, V], a request's D rows in node
order). Each row's decision is the target's token there: its argmax for a greedy request, else the keyed
sample of its distribution at the output position the row decides (engine/sampling.py), so the tokens do
not depend on the drafts, the batch or the tensor-parallel rank. The verifier's walk (`Verifier.greedy`)
then commits the drafted path that matches the decisions and the decision after it. `to_sglang` hands the
result back in the layout of SGLang's eagle_utils.eagle_sample, which SGLang's KV bookkeeping and
GenerationBatchResult read.

Under SGLang's deterministic inference its own sampler draws a request's token keyed by the request's seed and
the position of the token it reads, the same function of the logits in a decode step as in a verify row; there
the worker hands every verify row to SGLang's sampler (`rows_sampling_info`), so sampled output is SGLang AR's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from specpilot.config import SamplingParams
from specpilot.engine.sampling import keyed_sample_rows
from specpilot.kernels.softmax_topk import row_argmax
from specpilot.state.draft import Accepted


def sampling_params(sglang_params: Any) -> SamplingParams:
    """SGLang's per-request SamplingParams (normalized by its __post_init__: greedy is top_k 1, no top-k is
    top_k 1 << 30) as ours, which draw from the same distribution."""
    return SamplingParams(temperature=sglang_params.temperature, top_p=sglang_params.top_p,
                          top_k=sglang_params.top_k, min_p=sglang_params.min_p, seed=sglang_params.sampling_seed)


def keyed_seed(rid: str, seed: int | None) -> int:
    """The request's seed, else one derived from its id: every rank of a tensor-parallel server derives the
    same one (Python's hash() differs between processes)."""
    if seed is not None:
        return seed
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")


def row_decisions(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                  output_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[bs, D] the token the target decides at each block row. `logits` [bs * D, V]; per request its
    params, keyed-sampling seed and output length before this step (len(req.output_ids)); `depths` [bs, D]
    each row's node depth (VerifyTensors.positions - seq_lens): a row decides output position
    output_len + depth."""
    bs, d = depths.shape
    decisions = row_argmax(logits).view(bs, d)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        positions = output_lens.to(logits.device)[index, None] + depths[index]
        rows = logits.view(bs, d, -1)[index].flatten(0, 1)
        decisions[index] = keyed_sample_rows(rows, [params[i] for i in sampled for _ in range(d)],
                                             [seeds[i] for i in sampled for _ in range(d)],
                                             positions.flatten()).view(-1, d)
    return decisions


# SamplingBatchInfo's per-request tensors (the sampler reads these; the refused features' lists stay None)
ROW_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed")


def rows_sampling_info(info: Any, rows: int) -> Any:
    """SGLang's SamplingBatchInfo of a decode batch for its verify pass of `rows` rows a request: each request's
    tensors repeated for its rows, the batch-wide flags kept (SGLang's sampler picks its path by them, as it does
    for that batch's decode)."""
    return dataclasses.replace(info, **{name: getattr(info, name).repeat_interleave(rows, dim=0)
                                        for name in ROW_FIELDS if getattr(info, name) is not None})


def to_sglang(accepted: Accepted) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predict [bs * D] int32: each accepted row's decision, 0 elsewhere; accept_index [bs, D] int32: the
    accepted rows as flat indices, -1 past them; accept_lens [bs] int32: accepted drafts + the bonus).
    The committed tokens are predict[accept_index[b, :accept_lens[b]]]."""
    bs, d = accepted.nodes.shape
    live = torch.arange(d, device=accepted.nodes.device) < accepted.counts[:, None]
    rows = accepted.nodes + d * torch.arange(bs, device=accepted.nodes.device)[:, None]
    # rows past a request's count go to one scratch element, so the scatter needs no host-side mask
    predict = torch.zeros(bs * d + 1, dtype=torch.int32, device=rows.device)
    predict.scatter_(0, torch.where(live, rows, bs * d).flatten(), accepted.tokens.flatten().int())
    return predict[:-1], torch.where(live, rows, -1).int(), accepted.counts.int()
