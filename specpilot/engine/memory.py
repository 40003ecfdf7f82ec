"""How much KV the engine reserves: a pool of positions (pages, state/pages.py) that request slots of up to
`context_length` positions draw from, sized by what the user asked for (--max-running-requests x
--context-length as whole slots, --max-total-tokens, --mem-fraction-static) within what the machine has free
once the weights are loaded. Requests are admitted by free pages, so a pool smaller than its slots' sum
still runs every slot with short requests.
"""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Defaults when the user leaves a setting open, per device type.
DEFAULT_MAX_RUNNING_REQUESTS = {"cpu": 64, "cuda": 32}
DEFAULT_CONTEXT_LENGTH = {"cpu": 2048, "cuda": 4096}
# On CPU, where the pool lives in the host's memory, its positions without --max-total-tokens or
# --mem-fraction-static (at least one request of the whole context): eight whole requests, or 64 short ones.
DEFAULT_CPU_POOL_TOKENS = 8 * 2048
# Share of the memory free after loading the weights that the KV cache may take without
# --mem-fraction-static: the rest is left for activations, CUDA graphs, the drafter and (on CPU) the host's
# other programs.
KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.6}


@dataclass(frozen=True)
class KVPlan:
    num_slots: int
    context_length: int  # positions a request may reach (a verify pass's spill past it is added on top)
    bytes_per_token: int  # target K/V of every layer
    budget_bytes: int  # what the machine could give the cache
    limited_by: str  # which setting fixed the pool's size
    pool_tokens: int = 0  # positions in the pool (0: whole slots, num_slots x context_length)

    @property
    def total_tokens(self) -> int:
        return self.pool_tokens or self.num_slots * self.context_length

    @property
    def whole_slots(self) -> bool:
        return self.total_tokens >= self.num_slots * self.context_length

    @property
    def reserved_bytes(self) -> int:
        return self.total_tokens * self.bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_tokens": self.total_tokens, "reserved_bytes": self.reserved_bytes}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory (the host's for CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    return _host_meminfo("MemAvailable:", "SC_AVPHYS_PAGES"), _host_meminfo("MemTotal:", "SC_PHYS_PAGES")


def _host_meminfo(key: str, sysconf_name: str) -> int:
    """A /proc/meminfo figure (MemAvailable: free plus reclaimable cache) where Linux reports it, else
    sysconf's pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf(sysconf_name) * os.sysconf("SC_PAGE_SIZE")


def kv_budget(device: torch.device, mem_fraction_static: float | None, free_bytes: int | None = None,
              total_bytes: int | None = None) -> int:
    """Bytes the KV pool may take. With --mem-fraction-static F (SGLang's meaning): F of the device's whole
    memory for the weights and the pool together, so the pool gets F x total less what is already in use;
    without it, KV_MEMORY_FRACTION of what is free."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    if free_bytes is None or (mem_fraction_static is not None and total_bytes is None):
        free, total = memory_bytes(device)
        free_bytes = free if free_bytes is None else free_bytes
        total_bytes = total if total_bytes is None else total_bytes
    if mem_fraction_static is None:
        return int(free_bytes * KV_MEMORY_FRACTION[kind])
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"--mem-fraction-static must lie in (0, 1), got {mem_fraction_static}")
    used = total_bytes - free_bytes
    return max(0, min(free_bytes, int(mem_fraction_static * total_bytes) - used))


def return_freed_memory() -> None:
    """Hand the host memory freed tensors left in the C heap back to the system. glibc keeps freed
    blocks below its (growing) mmap threshold, so dropping a loader's weights would not lower the
    process's footprint otherwise. A no-op where the C library is not glibc."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def plan_kv(device: torch.device, bytes_per_token: int, model_max_positions: int,
            max_running_requests: int | None, context_length: int | None,
            max_total_tokens: int | None, free_bytes: int | None = None, mem_fraction_static: float | None = None,
            total_bytes: int | None = None) -> KVPlan:
    """Slots, the context a request may reach, and the pool's positions: the least of the slots' sum, the
    memory budget and --max-total-tokens. Raises ValueError naming the flag when not even one request of the
    whole context fits."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    context = min(context_length or DEFAULT_CONTEXT_LENGTH[kind], model_max_positions)
    slots = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS[kind]
    budget = kv_budget(device, mem_fraction_static, free_bytes, total_bytes)
    memory = "--mem-fraction-static" if mem_fraction_static is not None else "memory"
    caps = {"--max-running-requests": slots * context, memory: budget // bytes_per_token}
    if max_total_tokens is not None:
        caps["--max-total-tokens"] = max_total_tokens
    elif kind == "cpu" and mem_fraction_static is None:
        caps["the CPU default pool (--max-total-tokens)"] = max(DEFAULT_CPU_POOL_TOKENS, context)
    limited_by = min(caps, key=lambda name: caps[name])
    pool = caps[limited_by]
    if pool < context:
        if limited_by == "--max-total-tokens":
            raise ValueError(f"--max-total-tokens {max_total_tokens} holds less than one request of "
                             f"--context-length {context}")
        raise ValueError(f"one request of --context-length {context} needs "
                         f"{bytes_per_token * context / 2**20:.0f} MiB of KV cache, but only "
                         f"{budget / 2**20:.0f} MiB are available for it on {kind}: lower --context-length"
                         + (" or raise --mem-fraction-static" if mem_fraction_static is not None else ""))
    return KVPlan(slots, context, bytes_per_token, budget, limited_by,
                  0 if limited_by == "--max-running-requests" else pool)
