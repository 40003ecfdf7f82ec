"""Training data for the DFlash trainer: prompts, target-regenerated responses (cached on disk), batches
with random anchors, and the target's tap features.

Responses must come from the target itself (greedy): the drafter learns to predict what this target
emits, not what some other model wrote. Features are recomputed per batch with one teacher-forced target
pass by default instead of being stored: at paper scale (800K x 3072 tokens x 5 taps x 4096 x bf16) they
would fill about 100 TB, while the pass costs a fraction of the step. Small runs on slow devices (CPU) can
cache them in memory instead (FeatureSource).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine
from specpilot.state.batch import ForwardBatch

DATA_FILE = "data.pt"
VALIDATION_FILE = "validation.pt"
GENERATION_PART = 4096  # prompts whose responses are saved together: a cut generation loses at most one part


@dataclass
class Sample:
    tokens: torch.Tensor  # [len] int32: the prompt, then the target's response
    prompt_len: int


@dataclass
class DataStats:
    num_sequences: int
    skipped_prompts: int  # prompts too long for --max-seq-len
    prompt_tokens: int
    response_tokens: int
    generation_s: float
    generation_tokens_per_s: float
    reused_cache: bool = False
    reused_responses: int = 0  # sequences taken from an earlier run's file (--reuse-responses), not generated


def load_training_prompts(tokenizer, datasets: list[str], num_prompts: int,
                          num_validation: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of the datasets' train splits (disjoint from the bench splits), interleaved so
    any prefix is an even mixture, under the target's chat template: `num_prompts` for training and the
    `num_validation` that follow them in each set for validation, passing over any from a conversation a
    training prompt comes from (ShareGPT's turns share one), so validation sees nothing trained on. The
    training prompts do not depend on how many validation prompts are asked for, except where no set has a
    prompt left after the training ones: then each keeps its last ones for validation."""
    from specpilot.bench.datasets import apply_chat_template, load_prompts

    if tokenizer is None:
        raise ValueError("the target has no tokenizer: pass token-id prompts instead of --datasets")
    per_set = -(-num_prompts // len(datasets))
    val_per_set = -(-num_validation // len(datasets))
    # seed 0: the data do not depend on the training seed, so seed sweeps see the same sequences
    sets = [load_prompts(d, split="train", seed=0) for d in datasets]

    def split(takes: list[int]) -> tuple[list, list]:
        mixed = [s[i] for i in range(per_set) for s, take in zip(sets, takes) if i < min(take, len(s))][:num_prompts]
        trained = {p.conversation for p in mixed}
        unseen = [[p for p in s[take:] if p.conversation not in trained][:val_per_set] for s, take in zip(sets, takes)]
        return mixed, [s[i] for i in range(val_per_set) for s in unseen if i < len(s)]

    mixed, held = split([per_set] * len(sets))
    if num_validation and not held:  # every set ran out: validating on nothing would go unnoticed
        mixed, held = split([max(0, len(s) - val_per_set) for s in sets])
    return ([apply_chat_template(tokenizer, p) for p in mixed],
            [apply_chat_template(tokenizer, p) for p in held[:num_validation]])


@dataclass(frozen=True)
class Responses:
    """What the target writes per prompt: its greedy response, and `per_prompt - 1` more sampled at
    `temperature` (each request seeded from its prompt's index and its own, so the data repeat)."""

    per_prompt: int = 1
    temperature: float = 0.8

    def params(self, max_new_tokens: int, prompt: int) -> list[SamplingParams]:
        sampled = [SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature,
                                  seed=prompt * self.per_prompt + k) for k in range(1, self.per_prompt)]
        return [SamplingParams(max_new_tokens=max_new_tokens), *sampled]

    def meta(self) -> dict:
        """The cache's record of them (nothing for greedy only, as caches made before sampling have none)."""
        return {} if self.per_prompt == 1 else {"responses_per_prompt": self.per_prompt,
                                                "response_temperature": self.temperature}


def generate_responses(engine: Engine, prompts: list[list[int]], max_new_tokens: int, progress: Progress,
                       responses: Responses = Responses(), first_index: int = 0,
                       label: str = "generating responses",
                       known: dict[bytes, Sample] | None = None) -> tuple[list[Sample], DataStats]:
    """The target's responses (`Responses`) with continuous batching (engine.max_running_requests at a time).
    Prompts leave room for at least two response tokens (one anchor and its target) or are skipped; the sampled
    responses' seeds count the prompts that fit from `first_index` (the ones before them in a parted run).
    Greedy responses found in `known` (an earlier run's, `earlier_responses`) are taken, not generated again."""
    known = known or {}
    fits = [p for p in prompts if len(p) + 2 <= engine.context_length]
    new = [(i, p) for i, p in enumerate(fits, first_index) if prompt_key(p) not in known]
    task = progress.add_task(label, total=len(new) * responses.per_prompt, stats="")
    reqs = {i: [engine.add_request(p, params) for params in responses.params(max_new_tokens, i)] for i, p in new}
    start, produced = time.perf_counter(), 0
    while engine.has_work:
        finished = engine.step()
        produced += sum(len(r.output_ids) for r in finished)
        progress.update(task, advance=len(finished), stats=f"{produced / (time.perf_counter() - start):,.0f} tok/s")
    wall = time.perf_counter() - start
    # an anchor needs a token after it: responses of one token (an immediate EOS) teach nothing
    samples, reused = [], 0
    for i, p in enumerate(fits, first_index):
        if i not in reqs:
            samples.append(known[prompt_key(p)])
            reused += 1
        else:
            samples += [Sample(torch.tensor(r.all_ids, dtype=torch.int32), len(r.prompt_ids))
                        for r in reqs[i] if len(r.output_ids) >= 2]
    stats = DataStats(len(samples), len(prompts) - len(fits), sum(s.prompt_len for s in samples), produced, wall,
                      produced / wall if wall > 0 else 0.0, reused_responses=reused)
    return samples, stats


def earlier_responses(path: Path, meta: dict) -> dict[bytes, Sample]:
    """The greedy responses of an earlier run's data file (data.pt), by prompt, for prompts this run shares with
    it: made by the same target with the same settings (`meta` but the prompt list), and the batch-invariant
    engine's greedy responses do not depend on their batch, so they are the ones a new generation would write."""
    data = torch.load(path, weights_only=True)
    theirs = {k: v for k, v in data["meta"].items() if k != "prompts"}
    ours = {k: v for k, v in meta.items() if k != "prompts"}
    if theirs != ours:
        raise ValueError(f"--reuse-responses {path}: made with other settings ({theirs}, now {ours})")
    return {prompt_key(s.tokens[: s.prompt_len].tolist()): s for s in _stored_samples(data)}


def prompt_key(prompt: list[int]) -> bytes:
    """A prompt's ids packed (a compact dict key: an earlier run holds tens of thousands of prompts)."""
    return array("i", prompt).tobytes()


def _narrow(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids in 16 bits (unsigned) where every id fits, else as they are."""
    return tokens.to(torch.uint16) if tokens.numel() and int(tokens.max()) < 1 << 16 else tokens


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.blake2b(json.dumps(prompts).encode(), digest_size=16).hexdigest()


def _read_cache(path: Path, meta: dict) -> tuple[list[Sample], DataStats] | None:
    if not path.is_file():
        return None
    data = torch.load(path, weights_only=True)
    if data["meta"] != meta:
        raise ValueError(f"{path} was generated with different settings ({data['meta']}, now {meta}); "
                         f"use a fresh --out directory")
    return _stored_samples(data), DataStats(**{**data["stats"], "reused_cache": True})


def _stored_samples(data: dict) -> list[Sample]:
    seqs = data["tokens"].to(torch.int32).split(data["lengths"].tolist())
    return [Sample(t, p) for t, p in zip(seqs, data["prompt_lens"].tolist())]


def _write_cache(path: Path, meta: dict, samples: list[Sample], stats: DataStats) -> None:
    tokens = torch.cat([s.tokens for s in samples]) if samples else torch.zeros(0, dtype=torch.int32)
    data = {"meta": meta, "stats": asdict(stats), "tokens": _narrow(tokens),
            "lengths": torch.tensor([len(s.tokens) for s in samples]),
            "prompt_lens": torch.tensor([s.prompt_len for s in samples])}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


def _combined(parts: list[DataStats]) -> DataStats:
    response, wall = sum(p.response_tokens for p in parts), sum(p.generation_s for p in parts)
    return DataStats(sum(p.num_sequences for p in parts), sum(p.skipped_prompts for p in parts),
                     sum(p.prompt_tokens for p in parts), response, wall, response / wall if wall > 0 else 0.0,
                     all(p.reused_cache for p in parts), sum(p.reused_responses for p in parts))


def load_or_generate(out: Path, meta: dict, engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                     progress: Progress, name: str = DATA_FILE,
                     responses: Responses = Responses(),
                     known: dict[bytes, Sample] | None = None) -> tuple[list[Sample], DataStats]:
    """Generated sequences are cached in out/`name` (flat tokens + lengths) with the settings that made them
    (`meta`); a rerun with the same settings reuses them instead of regenerating, different settings are
    refused. Tokens are stored in 16 bits where the vocabulary fits (the file is half as large: small enough
    to bring back from a device and carry to the next one), and read back as int32. The responses are made
    GENERATION_PART prompts at a time, each part saved as it completes (out/NAME.parts/), so a generation cut
    by a deadline resumes at its first missing part; the parts go once the whole file is written. `known`: an
    earlier run's greedy responses (`earlier_responses`), taken for the prompts they answer."""
    path = out / name
    meta = meta | responses.meta()
    cached = _read_cache(path, meta)
    if cached is not None:
        return cached
    parts_dir = path.with_suffix(".parts")
    samples, stats, fitted = [], [], 0
    starts = range(0, len(prompts), GENERATION_PART)
    for k, start in enumerate(starts):
        chunk = prompts[start : start + GENERATION_PART]
        part_meta = meta | {"part": k, "part_prompts": prompts_digest(chunk)}
        part = _read_cache(parts_dir / f"{k}.pt", part_meta)
        if part is None:
            part = generate_responses(engine, chunk, max_new_tokens, progress, responses, fitted,
                                      f"generating responses, part {k + 1}/{len(starts)}", known)
            _write_cache(parts_dir / f"{k}.pt", part_meta, *part)
        samples += part[0]
        stats.append(part[1])
        fitted += len(chunk) - part[1].skipped_prompts
    total = _combined(stats)
    _write_cache(path, meta, samples, total)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return samples, total


# ---------------------------------------------------------------- batches


@dataclass
class Batch:
    indices: list[int]  # into the sample list
    tokens: torch.Tensor  # [N, L] right-padded with 0
    lengths: torch.Tensor  # [N]
    anchors: torch.Tensor  # [N, A] block starts (padding anchors are 1 and invalid)
    anchor_valid: torch.Tensor  # [N, A]


def sample_anchors(sample: Sample, num_anchors: int, generator: torch.Generator) -> list[int]:
    """Distinct random response positions a with a + 1 inside the sequence (slot 1 has a target), as at
    inference where the first block starts at the first response token with the prompt as context."""
    first, last = sample.prompt_len, len(sample.tokens) - 2
    count = last - first + 1
    picks = torch.randperm(count, generator=generator)[:num_anchors]
    return sorted(first + int(i) for i in picks)


def make_batch(samples: list[Sample], indices: list[int], num_anchors: int, generator: torch.Generator,
               device: torch.device) -> Batch:
    seqs = [samples[i].tokens for i in indices]
    anchors = [sample_anchors(samples[i], num_anchors, generator) for i in indices]
    n, length, width = len(seqs), max(map(len, seqs)), max(map(len, anchors))
    tokens = torch.zeros(n, length, dtype=torch.long)
    anchor_t = torch.ones(n, width, dtype=torch.long)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for j, (seq, anc) in enumerate(zip(seqs, anchors)):
        tokens[j, : len(seq)] = seq
        anchor_t[j, : len(anc)] = torch.tensor(anc)
        valid[j, : len(anc)] = True
    lengths = torch.tensor([len(s) for s in seqs])
    return Batch(indices, tokens.to(device), lengths.to(device), anchor_t.to(device), valid.to(device))


def tap_features(engine: Engine, seqs: list[list[int]], tap_layers: tuple[int, ...],
                 with_final: bool = False) -> list[torch.Tensor]:
    """Tap features of every position from one teacher-forced target pass, [len, taps * H] per
    sequence: the same outputs the engine hands the drafter at inference (prefill and verify rows).
    `with_final`: the target's final (normed) hidden state follows, [len, taps * H + H]."""
    slots = [engine.cache.allocate(len(s)) for s in seqs]
    try:
        with torch.inference_mode():
            batch = ForwardBatch.build(slots, [0] * len(seqs), seqs, engine.cache.max_len, engine.device)
            final, taps = engine.model(batch, engine.cache, tap_layers)
    finally:
        for slot in slots:
            engine.cache.free(slot)
    if with_final:
        taps = torch.cat([taps, final], dim=-1)
    return list(taps.split([len(s) for s in seqs]))


def pad_features(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[N, L_max, F], zero padded. Made outside inference mode: an ordinary tensor autograd may save."""
    out = torch.zeros(len(rows), max(r.shape[0] for r in rows), rows[0].shape[1], dtype=rows[0].dtype, device=device)
    for j, r in enumerate(rows):
        out[j, : r.shape[0]] = r
    return out


class FeatureSource:
    """Tap features for training batches. Default: recomputed per batch (one target forward; cheap on a
    GPU and nothing to store). With `cache`: computed once up front in fixed chunks of `chunk` sequences
    (so a resumed run sees bit-identical values) and kept in host memory, for small runs on slow devices."""

    def __init__(self, engine: Engine, samples: list[Sample], tap_layers: tuple[int, ...], cache: bool, chunk: int,
                 progress: Progress, with_final: bool = False) -> None:
        self.engine, self.samples, self.tap_layers, self.with_final = engine, samples, tap_layers, with_final
        self.cached: list[torch.Tensor] | None = None
        if cache:
            task = progress.add_task("computing features", total=len(samples), stats="")
            self.cached = []
            for i in range(0, len(samples), chunk):
                seqs = [s.tokens.tolist() for s in samples[i : i + chunk]]
                self.cached += [r.cpu() for r in tap_features(engine, seqs, tap_layers, with_final)]
                progress.advance(task, len(seqs))

    def __call__(self, indices: list[int]) -> torch.Tensor:
        if self.cached is not None:
            rows = [self.cached[i] for i in indices]
        else:
            rows = tap_features(self.engine, [self.samples[i].tokens.tolist() for i in indices], self.tap_layers,
                                self.with_final)
        return pad_features(rows, self.engine.device)
