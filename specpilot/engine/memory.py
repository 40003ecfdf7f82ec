"""How much KV the engine reserves: request slots of `context_length` positions each, from what the
user asked for (--max-running-requests, --context-length, --max-total-tokens) within what the machine
has free once the weights are loaded.

Slots are fixed (kv_cache.py says why), so the reservation is slots x context length whether or not
requests use it; the defaults keep that small on CPU, where the cache lives in the host's memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Defaults when the user leaves a setting open, per device type.
DEFAULT_MAX_RUNNING_REQUESTS = {"cpu": 8, "cuda": 32}
DEFAULT_CONTEXT_LENGTH = {"cpu": 2048, "cuda": 4096}
# Share of the memory free after loading the weights that the KV cache may take: the rest is left
# for activations, CUDA graphs, the drafter and (on CPU) the host's other programs.
KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.6}


@dataclass(frozen=True)
class KVPlan:
    num_slots: int
    context_length: int  # positions per slot (a verify pass's spill past it is added on top)
    bytes_per_token: int  # target K/V of every layer
    budget_bytes: int  # what the machine could give the cache (free memory x KV_MEMORY_FRACTION)
    limited_by: str  # which setting fixed the slot count

    @property
    def total_tokens(self) -> int:
        return self.num_slots * self.context_length

    @property
    def reserved_bytes(self) -> int:
        return self.total_tokens * self.bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_tokens": self.total_tokens, "reserved_bytes": self.reserved_bytes}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _host_available_bytes()


def _host_available_bytes() -> int:
    """MemAvailable (free plus reclaimable cache) where Linux reports it, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
            max_total_tokens: int | None, free_bytes: int | None = None) -> KVPlan:
    """Slots and their length. Raises ValueError naming the flag when not even one request fits."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    context = min(context_length or DEFAULT_CONTEXT_LENGTH[kind], model_max_positions)
    wanted = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS[kind]
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    budget = int(free * KV_MEMORY_FRACTION[kind])
    caps = {"--max-running-requests": wanted, "memory": budget // (bytes_per_token * context)}
    if max_total_tokens is not None:
        caps["--max-total-tokens"] = max_total_tokens // context
    limited_by = min(caps, key=lambda name: caps[name])
    slots = caps[limited_by]
    if slots < 1:
        if limited_by == "--max-total-tokens":
            raise ValueError(f"--max-total-tokens {max_total_tokens} holds less than one request of "
                             f"--context-length {context}")
        raise ValueError(f"one request of --context-length {context} needs "
                         f"{bytes_per_token * context / 2**20:.0f} MiB of KV cache, but only "
                         f"{budget / 2**20:.0f} MiB are available for it on {kind}: lower --context-length")
    return KVPlan(slots, context, bytes_per_token, budget, limited_by)
