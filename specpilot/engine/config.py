"""The engine's settings (SGLang's server-argument names where SGLang has one) and their device and dtype."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from specpilot.state.pages import PAGE_SIZE


def changes_defaults(mechanisms: frozenset[str]) -> bool:
    """A --mechanisms value of `+name` / `-name` entries: changes to the default set, not a set of its own."""
    return bool(mechanisms) and all(n[:1] in "+-" for n in mechanisms)


@dataclass
class EngineConfig:
    model_path: str | None = None  # None: the embedded default
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    # None: the device's default within the free memory (engine/memory.py); the engine's own config
    # holds the values in effect
    max_running_requests: int | None = None
    context_length: int | None = None  # KV positions a request may reach
    max_total_tokens: int | None = None  # KV pool's positions, all requests together (SGLang's flag)
    mem_fraction_static: float | None = None  # share of the device's memory for weights + KV pool (SGLang's)
    page_size: int = PAGE_SIZE  # KV pool's positions per page, a power of two (SGLang's flag)
    cuda_graphs: bool = True
    max_prefill_tokens: int = 16384  # tokens of prompts admitted in one prefill pass
    # Offline throughput: while requests run, admit waiting ones only once this many slots are free (or
    # every waiting one fits), so prefills come in waves instead of one eager pass per finished request.
    min_prefill_batch: int = 1
    # CUDA graphs: prefill passes of up to this many prompt tokens (and PREFILL_GRAPH_BATCH_SIZES prompts) replay a
    # graph per (prompts, tokens) bucket; an eager pass is launch-bound, and under load a request that ends
    # admits the next one in a pass of its own. 0: prefills run eagerly.
    prefill_graph_tokens: int = 2048
    # eager: waiting requests join as soon as a slot is free; coalesce: while requests run, once the free slots'
    # idle time outweighs a prefill pass's stall of the batch (engine/admission.py)
    admission: str = "eager"
    speculative_algorithm: str | None = None  # None | dflash | pard | ngram
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None  # tokens per verify pass (block size); default from the drafter
    speculative_ngram_assist: int = 0  # dflash/pard: prompt lookup's block where an n-gram this long repeats (0: off)
    speculative_eagle_topk: int = 1  # dflash: > 1 drafts a tree from each slot's top-k (SGLang's flag name)
    speculative_lookup_prob: float = 0.9  # dflash trees: the probability prompt lookup's tokens enter the tree at
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # graph buckets
    attention_kv_splits: int = 0  # key splits of decode/verify attention; 0: the kernel's choice per batch
    # CUDA: the target runs the batch-invariant kernels, so a request's logits are bitwise the same whatever
    # the pass and its batch companions (speculation identical to AR); False: the fastest kernel per pass
    batch_invariant: bool = True
    # CUDA, batch-invariant: launch the GEMMs on this device's tuned tiles where `bench --tune-gemm-tiles` cached them
    tuned_tiles: bool = True
    # the speed mechanisms in effect (engine/registry.py): None = every one whose precondition holds,
    # an empty set = stock
    mechanisms: frozenset[str] | None = None

    def asks_for(self, mechanism: str) -> bool:
        """--mechanisms names it: in a set of exactly those, or as `+name` on top of the defaults."""
        return self.mechanisms is not None and (mechanism in self.mechanisms or f"+{mechanism}" in self.mechanisms)

    def leaves_open(self, mechanism: str) -> bool:
        """A mechanism on by default may run: the mechanisms are left open, changed without `-name`, or name it."""
        if self.mechanisms is None:
            return True
        if changes_defaults(self.mechanisms):
            return f"-{mechanism}" not in self.mechanisms
        return mechanism in self.mechanisms

    def to_fields(self) -> dict[str, Any]:
        """As JSON values (the optimizer's evaluator requests, `serve --engine-config`)."""
        raw = asdict(self)
        raw["mechanisms"] = None if self.mechanisms is None else sorted(self.mechanisms)
        raw["cuda_graph_batch_sizes"] = list(self.cuda_graph_batch_sizes)
        return raw

    @classmethod
    def from_fields(cls, raw: dict[str, Any]) -> EngineConfig:
        mechanisms = raw.get("mechanisms")
        return cls(**raw | {"mechanisms": None if mechanisms is None else frozenset(mechanisms),
                            "cuda_graph_batch_sizes": tuple(raw.get("cuda_graph_batch_sizes",
                                                                    cls.cuda_graph_batch_sizes))})


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
