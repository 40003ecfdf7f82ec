"""Token forcing (DESIGN §5).

1. Stock: the target alone decodes autoregressively (greedy, or seeded sampling at T>0); one extra
   teacher-forced pass over prompt + stock output gives, at every position, the top-1/top-2 logit margin
   (greedy) or the full target distribution (T>0).
2. Candidate: the configuration under test runs its own loop (drafting, verification, batching), but
   every token it decides to commit is compared with stock's token at that position, and stock's token
   is what gets committed. Once a decided token differs, the rest of that step is dropped (its target
   K/V came from the wrong token), so the candidate always continues from stock's exact context.
3. Greedy verdict: positions checked, mismatches where stock's margin is not a near-tie (must be 0),
   the first divergence. A near-tie is a margin below the dtype's floor or below twice that position's
   own reordering noise: the largest difference between stock's decode logits and its teacher-forced
   logits there (its top tokens), since a third evaluation (the candidate's) may move each of the two top
   logits by that much. Near-tie flips are bounded too: where there are any, a null drafter's engine
   (drafters/null.py: stock through the candidate's verify width) is forced over the same prompts, and
   the candidate may not flip more than that baseline predicts plus three Poisson standard deviations
   (`tie_allowance`). At T>0 sampling is keyed (engine/sampling.py: the token at an
   output position is a function of the seed, the position and the distribution), so the candidate
   must commit stock's very tokens: a mismatch is excused only where stock's top-2 keyed scores (log p
   plus the position's Gumbel noise, in logit units) are that close, and the total-variation distance
   between the candidate's target distribution and stock's is bounded too.
4. Exact mode: where both engines run the batch-invariant kernels (CUDA; Engine.exact) logits are a function
   of the context alone, so the tie band is 0 and every committed position's whole logits row must be
   bitwise stock's (compared through a 64-bit digest of the row's bits), and stock's own decode logits must
   equal its teacher-forced ones (stock_noise 0): the verdict says `exact: true`.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from rich.progress import Progress

from specpilot.config import SamplingParams
from specpilot.drafters.null import NullDrafter
from specpilot.engine.engine import Engine
from specpilot.engine.sampling import target_probs
from specpilot.kernels.keyed_argmax import keyed_scores
from specpilot.state.request import Request

NEAR_TIE = 1e-3  # fp32 logit margin under which float reordering may flip the argmax (fp32 CPU)
NEAR_TIE_BF16 = 0.1  # bf16 logits are much coarser
NOISE_TOP_K = 8  # decode-logit entries per position compared with the teacher-forced pass
TV_TOLERANCE = 5e-3


@dataclass
class Divergence:
    prompt: int
    position: int
    expected: int
    got: int
    margin: float


@dataclass
class ForcingVerdict:
    algorithm: str
    greedy: bool
    num_prompts: int
    positions_checked: int = 0
    non_tie_mismatches: int = 0
    tie_mismatches: int = 0
    first_divergence: Divergence | None = None
    max_tv_distance: float = 0.0
    tie_epsilon: float = NEAR_TIE
    floor: float = NEAR_TIE  # a near-tie's band at a position: max(floor, 2 x that position's stock noise)
    stock_noise: float = 0.0  # max |decode - teacher-forced| logit of stock's top tokens
    # the candidate's logits at stock's top tokens against stock's teacher-forced ones: the largest
    # difference, and the positions where it exceeds the tie band (a perturbation no flip revealed)
    max_logit_deviation: float = 0.0
    logit_deviations: int = 0
    # exact mode: positions whose whole logits row differs from stock's in any bit
    exact: bool = False
    row_mismatches: int = 0
    # statistical mode, where near-tie flips occurred: the null drafter's flips over its positions
    null_tie_mismatches: int | None = None
    null_positions: int | None = None
    tau: float = 0.0

    @property
    def tie_allowance(self) -> float | None:
        """Near-tie flips allowed: the null baseline's rate over our positions + 3 Poisson sigmas."""
        if not self.null_positions:
            return None
        expected = self.null_tie_mismatches * self.positions_checked / self.null_positions
        return expected + 3 * math.sqrt(max(expected, 1.0))

    @property
    def passed(self) -> bool:
        if self.positions_checked == 0:
            return False
        if self.exact and (self.row_mismatches or self.stock_noise or self.tie_mismatches):
            return False
        if self.tie_allowance is not None and self.tie_mismatches > self.tie_allowance:
            return False
        return (self.non_tie_mismatches == 0 and self.logit_deviations == 0
                and (self.greedy or self.max_tv_distance <= TV_TOLERANCE))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        out["tie_allowance"] = self.tie_allowance
        return out


@dataclass
class StockRun:
    tokens: list[list[int]]
    # top-1 minus top-2 at each output position: logits (greedy) or keyed scores in logit units (T>0)
    margins: list[list[float]]
    probs: list[torch.Tensor | None] = field(default_factory=list)  # T>0: [n, V] target distributions
    top: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # teacher-forced top ids, logits
    noise: float = 0.0  # max |decode - teacher-forced| over each position's top decode logits
    # per prompt and output position: that position's own |decode - teacher-forced| (0 where not recorded)
    noise_at: list[list[float]] = field(default_factory=list)
    digests: list[torch.Tensor] = field(default_factory=list)  # per prompt: row_digests of the teacher-forced logits


_DIGEST_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def row_digests(rows: torch.Tensor) -> torch.Tensor:
    """int64 [n]: a digest of each float32 row's bits (a sum of the bits times fixed odd 64-bit weights,
    wrapping): equal rows give equal digests, and one flipped bit changes it."""
    key = (rows.shape[1], str(rows.device))
    if key not in _DIGEST_WEIGHTS:
        g = torch.Generator().manual_seed(0x5EC)
        _DIGEST_WEIGHTS[key] = (torch.randint(-(2**62), 2**62, (rows.shape[1],), generator=g) | 1).to(rows.device)
    bits = rows.float().contiguous().view(torch.int32).to(torch.int64)
    return (bits * _DIGEST_WEIGHTS[key]).sum(1)


class DecodeLogitRecorder:
    """Installed as the stock engine's `forcing` hook: keeps each decided position's top decode logits."""

    def __init__(self) -> None:
        self.top: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, req: Request, tokens: list[int], rows: torch.Tensor) -> list[int]:
        self.top.setdefault(req.rid, []).extend(zip(*torch.topk(rows[: len(tokens)].float(), NOISE_TOP_K, dim=-1)))
        return tokens


class ForcingObserver:
    """Installed as `engine.forcing`: compares and substitutes every decided token."""

    def __init__(self, stock: StockRun, prompt_index: dict[str, int], verdict: ForcingVerdict) -> None:
        self.stock, self.prompt_index, self.verdict = stock, prompt_index, verdict

    def observe(self, req: Request, tokens: list[int], rows: torch.Tensor) -> list[int]:
        i = self.prompt_index[req.rid]
        ref, margins = self.stock.tokens[i], self.stock.margins[i]
        n = len(req.output_ids)
        forced: list[int] = []
        checked = rows[: max(min(len(tokens), len(ref) - n), 0)]
        deviations = self._deviations(i, n, checked)
        same_rows = self._same_rows(i, n, checked) if self.verdict.exact else None
        for j, token in enumerate(tokens):
            pos = n + j
            if pos >= len(ref):
                break
            self.verdict.positions_checked += 1
            forced.append(ref[pos])
            if deviations[j] is not None:
                self.verdict.max_logit_deviation = max(self.verdict.max_logit_deviation, deviations[j])
                self.verdict.logit_deviations += deviations[j] > self.verdict.tie_epsilon
            if same_rows is not None and not same_rows[j]:
                self.verdict.row_mismatches += 1
            if not req.params.greedy:
                mine = target_probs(rows[j : j + 1], req.params).cpu()
                tv = float(0.5 * (mine[0] - self.stock.probs[i][pos]).abs().sum())
                self.verdict.max_tv_distance = max(self.verdict.max_tv_distance, tv)
            if token != ref[pos]:
                self._mismatch(i, pos, ref[pos], token, margins[pos])
                break  # the rest of this step was computed from a token stock did not produce
        return forced

    def _deviations(self, prompt: int, start: int, rows: torch.Tensor) -> list[float | None]:
        """Per row (output positions start, start + 1, ...): the largest |candidate - stock| logit at
        stock's top tokens, in one copy to the host; None where none is finite (stop ids are masked
        before min_new_tokens)."""
        ids, values = self.stock.top[prompt]
        n = rows.shape[0]
        mine = rows.float().gather(1, ids[start : start + n].to(rows.device)).cpu()
        theirs = values[start : start + n]
        finite = torch.isfinite(mine) & torch.isfinite(theirs)
        gaps = torch.where(finite, (mine - theirs).abs(), -1.0).max(1).values.tolist()
        return [g if g >= 0 else None for g in gaps]

    def _same_rows(self, prompt: int, start: int, rows: torch.Tensor) -> list[bool]:
        """Per row: whether its digest is stock's (whose rows carry the same masks: `Engine.mask_as_decoded`)."""
        n = rows.shape[0]
        return (row_digests(rows).cpu() == self.stock.digests[prompt][start : start + n]).tolist()

    def _mismatch(self, prompt: int, pos: int, expected: int, got: int, margin: float) -> None:
        noise = self.stock.noise_at[prompt] if self.stock.noise_at and not self.verdict.exact else ()
        band = max(self.verdict.floor, 2 * noise[pos]) if pos < len(noise) else self.verdict.tie_epsilon
        if margin < band:
            self.verdict.tie_mismatches += 1
            return
        self.verdict.non_tie_mismatches += 1
        if self.verdict.first_divergence is None:
            self.verdict.first_divergence = Divergence(prompt, pos, expected, got, margin)


@torch.inference_mode()
def teacher_forced_logits(engine: Engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Target logits at every output position from one pass over prompt + output: [len(output), V]."""
    ids = prompt + output[:-1] if output else prompt
    slot = engine.cache.allocate(len(ids))
    try:
        out = engine.runner.forward([slot], [0], [ids])
        return out.logits[len(prompt) - 1 :]
    finally:
        engine.cache.free(slot)


def _run_to_completion(engine: Engine, reqs: list[Request], progress: Progress | None, label: str) -> None:
    task = progress.add_task(label, total=len(reqs)) if progress else None
    while engine.has_work:
        finished = engine.step()
        if task is not None:
            progress.advance(task, len(finished))


def run_stock(engine: Engine, prompts: list[list[int]], params: SamplingParams,
              progress: Progress | None = None) -> StockRun:
    recorder = DecodeLogitRecorder()
    engine.forcing = recorder
    try:
        reqs = [engine.add_request(p, params) for p in prompts]
        _run_to_completion(engine, reqs, progress, "stock AR")
    finally:
        engine.forcing = None
    tokens = [r.output_ids for r in reqs]
    margins, probs, top_logits, digests, noise_at = [], [], [], [], []
    passes = progress.add_task("stock teacher-forced", total=len(reqs)) if progress else None
    for req, prompt, out in zip(reqs, prompts, tokens):
        if passes is not None:
            progress.advance(passes)
        logits = engine.mask_as_decoded(params, out, teacher_forced_logits(engine, prompt, out))
        top_values, top_ids = torch.topk(logits.float(), NOISE_TOP_K, dim=-1)
        top_logits.append((top_ids.cpu(), top_values.cpu()))
        digests.append(row_digests(logits).cpu())
        at = [0.0] * len(out)
        if top := recorder.top.get(req.rid):
            values, ids = (torch.stack(t) for t in zip(*top))
            gaps = (values - logits[: len(top)].float().gather(1, ids)).abs()
            at[: len(top)] = gaps.nan_to_num(0.0).max(1).values.tolist()  # -inf both ways: a masked id, no gap
        noise_at.append(at)
        if params.greedy:
            top2 = torch.topk(logits, 2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
            probs.append(None)
        else:
            target = target_probs(logits, params)
            margins.append(keyed_margins(target, params, req.sampling_seed))
            probs.append(target.cpu())
    noise = max((max(at) for at in noise_at if at), default=0.0)
    return StockRun(tokens, margins, probs, top_logits, noise, noise_at, digests)


def keyed_margins(probs: torch.Tensor, params: SamplingParams, seed: int) -> list[float]:
    """Per output position (row of the target distributions `probs`), top-1 minus top-2 of the keyed
    scores, times the temperature: in logit units, so the greedy tie band applies."""
    scores = keyed_scores(probs, seed, torch.arange(probs.shape[0], device=probs.device))
    top2 = torch.topk(scores, 2, dim=-1).values
    return ((top2[:, 0] - top2[:, 1]).nan_to_num(posinf=1e30) * params.temperature).tolist()


def run_forcing(stock_engine: Engine, candidate: Engine, prompts: list[list[int]], params: SamplingParams,
                algorithm: str, tie_epsilon: float | None = None, stock: StockRun | None = None,
                progress: Progress | None = None) -> ForcingVerdict:
    """Run stock on `stock_engine` (no drafter) and the candidate forced to stock's tokens. A `stock` run
    of the same prompts and params may be passed in to check several candidates against one stock run.
    The two engines may share a KV cache (Engine.twin): they run one after the other."""
    if stock_engine.drafter is not None:
        raise ValueError("the stock engine must decode autoregressively (no drafter)")
    if not params.greedy and params.seed is None:  # keyed sampling: both runs draw with the same seed
        params = replace(params, seed=random.getrandbits(63))
    if stock is None:
        stock = run_stock(stock_engine, prompts, params, progress)
    exact = stock_engine.exact and candidate.exact
    floor = tie_epsilon
    if tie_epsilon is None:
        floor = 0.0 if exact else NEAR_TIE if stock_engine.dtype == torch.float32 else NEAR_TIE_BF16
        tie_epsilon = 0.0 if exact else max(floor, 2 * stock.noise)
    verdict = ForcingVerdict(algorithm, params.greedy, len(prompts), tie_epsilon=tie_epsilon, floor=floor,
                             stock_noise=stock.noise, exact=exact)
    _force(candidate, stock, prompts, params, verdict, progress, f"candidate ({algorithm}), forced")
    verdict.tau = candidate.spec_stats.tau
    if verdict.tie_mismatches and not exact and candidate.drafter is not None:
        null = replace(verdict, tie_mismatches=0, positions_checked=0, non_tie_mismatches=0, first_divergence=None)
        _force(null_engine(candidate), stock, prompts, params, null, progress, "null drafter, forced")
        verdict.null_tie_mismatches, verdict.null_positions = null.tie_mismatches, null.positions_checked
    return verdict


def _force(engine: Engine, stock: StockRun, prompts: list[list[int]], params: SamplingParams,
           verdict: ForcingVerdict, progress: Progress | None, label: str) -> None:
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.forcing = ForcingObserver(stock, {r.rid: i for i, r in enumerate(reqs)}, verdict)
    try:
        _run_to_completion(engine, reqs, progress, label)
    finally:
        engine.forcing = None


def null_engine(candidate: Engine) -> Engine:
    """Stock through the candidate's verify width: its weights, KV cache and config, a null drafter."""
    block = candidate.drafter.block_size
    return Engine(candidate.checkpoint, replace(candidate.config, speculative_algorithm=None,
                                                speculative_draft_model_path=None, speculative_ngram_assist=0,
                                                speculative_eagle_topk=1),
                  model=candidate.model, cache=candidate.cache, drafter_factory=lambda config, ctx: NullDrafter(block))

