"""Token forcing between two running servers that speak SGLang's /generate API (SGLang itself with and without a
speculative algorithm, or `specpilot serve`): the candidate must produce the reference's tokens, greedy or drawn
with a seed.

Each prompt is decoded in segments. Both servers continue the same input (the prompt, then the reference's tokens
so far) to the end; where the candidate's first token differs from the reference's, that position is a
divergence, judged by the reference's top-1 minus top-2 logprob there (a tie within the band may flip under float
reordering; beyond it, the candidate is wrong), and the next segment starts one past it with the reference's token
forced. Every output position is checked, not only those before the first difference, and both servers always see
the same input, so a difference is the candidate's decoding, not a prefill-versus-decode one. One request at a
time: nothing depends on what a server batches together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from specpilot.forcing.forcing import Divergence

# input ids, tokens to generate -> (output ids, each position's top-1 minus top-2 logprob, or [] unasked)
Generate = Callable[[list[int], int], tuple[list[int], list[float]]]


@dataclass
class ServedVerdict:
    num_prompts: int
    max_new_tokens: int
    tie_band: float
    positions_checked: int = 0
    requests: int = 0  # segments decoded by each server
    identical_unforced: int = 0  # prompts whose first segment (no forcing) was the reference's output whole
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def tie_mismatches(self) -> int:
        return sum(d.margin <= self.tie_band for d in self.divergences)

    @property
    def non_tie_mismatches(self) -> int:
        return len(self.divergences) - self.tie_mismatches

    @property
    def passed(self) -> bool:
        """Every position checked and no divergence beyond the band (band 0: none at all but exact ties)."""
        return self.positions_checked == self.num_prompts * self.max_new_tokens and self.non_tie_mismatches == 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tie_mismatches": self.tie_mismatches, "non_tie_mismatches": self.non_tie_mismatches,
                               "passed": self.passed}


def sglang_generate(client: httpx.Client, with_margins: bool, sampling: dict[str, Any] | None = None) -> Generate:
    """A Generate over `client` (its base_url a server's): /generate on input ids, EOS ignored, greedy unless
    `sampling` (SGLang's sampling_params, e.g. temperature and sampling_seed: a seeded draw is keyed by the seed and
    the position, so both servers draw alike from the same input); the margins from the top-2 logprobs of each
    output position where asked."""
    def generate(input_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
        params = {"temperature": 0} | (sampling or {}) | {"max_new_tokens": new_tokens, "ignore_eos": True}
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params}
        if with_margins:
            body |= {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1}
        response = client.post("/generate", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{client.base_url}/generate answered {response.status_code}: {response.text[:300]}")
        answer = response.json()
        margins = [top[0][0] - top[1][0] for top in answer["meta_info"]["output_top_logprobs"]] if with_margins else []
        return answer["output_ids"], margins
    return generate


def remembered(generate: Generate) -> Generate:
    """`generate`, answering an input it has seen from memory: a reference forced against several candidates
    decodes each segment once (greedy and seeded answers are functions of the input)."""
    answers: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def recall(input_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(input_ids), new_tokens)
        if key not in answers:
            answers[key] = generate(input_ids, new_tokens)
        return answers[key]
    return recall


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The first position where `got` differs from `expected` (a shorter `got` differs where it ends), or None."""
    for i, token in enumerate(expected):
        if i >= len(got) or got[i] != token:
            return i
    return None


def force_served(reference: Generate, candidate: Generate, prompts: Sequence[list[int]], max_new_tokens: int,
                 tie_band: float = 0.0) -> ServedVerdict:
    """The candidate forced along the reference's tokens on every prompt (see the module's docstring)."""
    verdict = ServedVerdict(len(prompts), max_new_tokens, tie_band)
    for index, prompt in enumerate(prompts):
        forced: list[int] = []
        while len(forced) < max_new_tokens:
            left = max_new_tokens - len(forced)
            want, margins = reference(prompt + forced, left)
            if len(want) != left:
                raise RuntimeError(f"prompt {index}: the reference gave {len(want)} tokens of the {left} asked")
            got, _ = candidate(prompt + forced, left)
            verdict.requests += 1
            at = first_difference(want, got)
            if not forced and at is None:
                verdict.identical_unforced += 1
            if at is None:
                verdict.positions_checked += left
                break
            verdict.positions_checked += at + 1
            verdict.divergences.append(Divergence(index, len(forced) + at, want[at],
                                                  got[at] if at < len(got) else -1, margins[at]))
            forced += want[: at + 1]
    return verdict
