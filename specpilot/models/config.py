"""Architecture description shared by every loader and the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_next", "qwen3_5_text")
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_text")  # Gated DeltaNet layers beside attention (models/hybrid.py)


@dataclass
class ModelConfig:
    """Shapes and numerics of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 family)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict (Llama-3 "llama3" type supported), or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hybrid: Any = None  # a hybrid architecture's models.hybrid.HybridConfig (the fields above: its attention layers')

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
