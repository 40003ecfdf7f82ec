"""Step floors from shapes and ceilings: a pass can go no faster than reading its weights and K/V once at
the device's read rate, nor than its matmul FLOPs at the device's GEMM rate (the roofline, per pass)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from specpilot.costmodel.calibrate import Ceilings


@dataclass(frozen=True)
class Shapes:
    target_weight_bytes: int  # every projection the target reads per pass (the LM head included)
    target_params: int  # their parameters: 2 FLOPs per parameter per token
    kv_bytes_per_token: int  # K and V of one position over all layers
    drafter_weight_bytes: int  # per draft pass (0: n-gram lookup)
    drafter_params: int
    block: int  # tokens per verify pass (the newest token + drafts); 1 for AR
    target_layers: int
    drafter_layers: int  # 0: no model (n-gram lookup)


def linear_weights(module: nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the distinct 2-D weights of every nn.Linear-like module (those with a
    `weight` and `in_features`), so a tied LM head counts once."""
    seen: dict[int, tuple[int, int]] = {}
    for child in module.modules():
        w = getattr(child, "weight", None)
        if hasattr(child, "in_features") and w is not None and w.dim() == 2:
            seen[id(w)] = (w.numel() * w.element_size(), w.numel())
    return sum(b for b, _ in seen.values()), sum(p for _, p in seen.values())


def shapes_of(engine) -> Shapes:
    """The shapes of an engine's target and drafter (a drafter's own model, where it has one)."""
    t_bytes, t_params = linear_weights(engine.model)
    cfg = engine.model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
    d_bytes = d_params = d_layers = 0
    drafter = engine.drafter
    model = getattr(drafter, "model", None) if drafter is not None else None
    while model is not None and not isinstance(model, nn.Module):  # a wrapper (n-gram assist) holds the drafter
        model = getattr(model, "model", None)
    if isinstance(model, nn.Module):
        d_bytes, d_params = linear_weights(model)
        d_layers = sum(1 for m in model.modules() if isinstance(m, nn.ModuleList) for _ in m) or 1
    return Shapes(t_bytes, t_params, kv, d_bytes, d_params, drafter.block_size if drafter else 1, cfg.num_layers,
                  d_layers)


@dataclass(frozen=True)
class Floors:
    batch: int
    context: int
    ar_step_ms: float
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    tau_max: float  # every draft accepted: the block's tokens per step

    @property
    def spec_step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.overhead_ms

    @property
    def speedup_ceiling(self) -> float:
        """τ_max · T_AR / T_step at the floors."""
        return self.ceiling_over(self.ar_step_ms)

    def ceiling_over(self, ar_step_ms: float) -> float:
        """The most a speculative step can gain over an AR step measured at `ar_step_ms`: every draft
        accepted, at the speculative step's floor (the plausibility gate's bound)."""
        return self.tau_max * ar_step_ms / self.spec_step_ms

    def as_dict(self) -> dict:
        return asdict(self) | {"spec_step_ms": self.spec_step_ms, "speedup_ceiling": self.speedup_ceiling}


# Eager kernels of one decoder layer (norm, qkv, rope + K/V write, attention, o, norm, gate_up, SiLU, down)
KERNELS_PER_LAYER = 9


def _pass_ms(weight_bytes: int, params: int, tokens: int, kv_bytes: int, ceilings: Ceilings, layers: int,
             graphs: bool) -> float:
    """The roofline of one pass plus its launches: one graph replay, or one launch per eager kernel."""
    read = (weight_bytes + kv_bytes) / ceilings.read_bytes_per_s
    compute = 2 * params * tokens / ceilings.matmul_flops
    launches = ceilings.graph_replay_s if graphs and ceilings.graph_replay_s else \
        (KERNELS_PER_LAYER * layers + 2) * ceilings.launch_s
    return 1e3 * (max(read, compute) + launches)


def floors(shapes: Shapes, ceilings: Ceilings, batch: int = 1, context: int = 512, graphs: bool = False) -> Floors:
    """Floors of one AR step and one speculative step (draft, verify, acceptance overhead) for `batch`
    requests `context` tokens deep. Each pass pays its launches: one graph replay with `graphs`, else one
    launch per eager kernel (fusing them is a gap, not a floor, on the graph path); acceptance costs
    three more launches."""
    kv = batch * context * shapes.kv_bytes_per_token
    target = (shapes.target_weight_bytes, shapes.target_params)
    ar = _pass_ms(*target, batch, kv, ceilings, shapes.target_layers, graphs)
    verify = _pass_ms(*target, batch * shapes.block, kv, ceilings, shapes.target_layers, graphs)
    draft = 0.0 if not shapes.drafter_weight_bytes else _pass_ms(
        shapes.drafter_weight_bytes, shapes.drafter_params, batch * shapes.block, 0, ceilings, shapes.drafter_layers,
        graphs)
    per_launch = ceilings.graph_replay_s if graphs and ceilings.graph_replay_s else ceilings.launch_s
    overhead = 1e3 * 3 * per_launch
    return Floors(batch, context, ar, draft, verify, overhead, float(shapes.block))
