"""The Gated DeltaNet layer of hybrid targets (Qwen3-Next, Qwen3.5), with the published checkpoints' parameter
names: over one request's tokens and its recurrent state, or over every request of a pass at once.

Per token, projections give each key head's query and key (Dk each), each value head's value and output gate
z (Dv each), its write strength b and decay input a: Qwen3-Next fuses them in two projections grouped by key
head (in_proj_qkvz, in_proj_ba), Qwen3.5 keeps four (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Queries, keys
and values pass a depthwise causal convolution (width 4, over the last 3 inputs kept as the conv state) and
SiLU; queries and keys are L2-normalised, queries scaled by Dk^-1/2; beta = sigmoid(b), g = -exp(A_log) *
softplus(a + dt_bias). The gated delta rule (kernels/gated_delta.py) turns them into one output per value head,
RMS-normalised per head and gated by SiLU(z), then projected back. One request's pass (`forward`) of several
tokens takes the chunked form, a single token the recurrent one: both carry (conv state, recurrent state) from
one call to the next.

A model's pass (`forward_spans`) takes all its requests' tokens at once, their states rows of per-slot tables:
the projections over every token, each token's convolution as a gather of its window's inputs (laid out once
per pass in `Spans`), then one call of the rule over every request's span (kernels/gated_delta.py: the Triton
kernel on CUDA, each span's reference form elsewhere).

A draft tree is one pass too (`verify_tree` for one request, `forward_spans` for a pass's): each node's
convolution reads its own ancestors' inputs (then the committed conv state), the delta rule's tree form gives
every node's output from the committed state, and nothing is written per node; `commit` then makes the one
state of the accepted path. `verify_snapshots` is the way SGLang and vLLM verify, kept for comparison: node by
node from its parent's state, each node's state kept until the commit picks the accepted leaf's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.kernels.gated_delta import (
    PaddedPaths,
    ancestor_bits,
    gated_delta_chunked,
    gated_delta_commit_paths,
    gated_delta_prefill,
    gated_delta_recurrent,
    gated_delta_verify,
)


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    fused_projections: bool = True  # Qwen3-Next's two grouped projections; False: Qwen3.5's four

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class RecurrentState:
    """One request's state in one GDN layer: the convolution's last inputs and the delta rule's matrices."""

    conv: torch.Tensor  # [conv_kernel - 1, conv_dim]
    ssm: torch.Tensor  # [value heads, Dk, Dv], float32

    @classmethod
    def zeros(cls, cfg: GatedDeltaNetConfig, device: torch.device, dtype: torch.dtype) -> RecurrentState:
        return cls(torch.zeros(cfg.conv_kernel - 1, cfg.conv_dim, device=device, dtype=dtype),
                   torch.zeros(cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, device=device))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass
class TreePass:
    """What a tree's verify leaves for the commit: each node's conv input, keys, and the delta rule's u, G."""

    mixed: torch.Tensor  # [T, conv_dim]
    k: torch.Tensor  # [T, Hk, Dk]
    u: torch.Tensor  # [Hv, T, Dv]
    G: torch.Tensor  # [Hv, T]


@dataclass(frozen=True)
class Spans:
    """A pass's requests as its DeltaNet layers read them, laid out once for all of them: request b's tokens are
    rows starts[b] : starts[b] + lens[b] (the spans tile the rows in order), its states row slots[b] of each
    layer's tables. A verify's spans are trees (`tree`: each node's ancestor bits within its span, the engine's
    tree_mask) or chains (None)."""

    slots: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int
    lens: torch.Tensor  # [B] int
    host: list[tuple[int, int, int]]  # (slot, start, length) per request
    # [T, K]: each token's convolution inputs, oldest first, as rows of [the pass's inputs; each request's K - 1
    # conv state rows]: its conv state's newest where its path (parents in a tree) is shorter than K, then the path's
    windows: torch.Tensor
    verify: bool = False
    tree: torch.Tensor | None = None  # [T] int64

    @property
    def max_len(self) -> int:
        return max((n for _, _, n in self.host), default=0)

    @classmethod
    def build(cls, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int, verify: bool = False,
              parents: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> Spans:
        """`width`: the convolution's; `parents` [T]: each tree node's parent within its span (negative, or any
        value for a span's first node: the committed state), None for chains; `tree` their ancestor bits."""
        host = list(zip(*(x.tolist() for x in (slots, starts, lens))))
        device, b, t = starts.device, len(host), sum(n for _, _, n in host)
        rows = torch.arange(t, device=device)
        req = torch.repeat_interleave(torch.arange(b, device=device), lens.to(device), output_size=t)
        first = starts.to(device).long()[req]
        if parents is None:
            prev, root = rows - 1, rows == first
        else:
            prev, root = first + parents.long(), (rows == first) | (parents < 0)
        # a root's predecessor is its request's newest conv state row, and each conv row's the one before it
        prev = torch.where(root, t + req * (width - 1) + width - 2, prev)
        graph = torch.cat([prev, torch.arange(t - 1, t - 1 + b * (width - 1), device=device)])
        cols = [rows]
        for _ in range(width - 1):
            cols.append(graph[cols[-1]])
        return cls(slots.long(), starts, lens, host, torch.stack(cols[::-1], 1), verify, tree)


class GatedRMSNorm(nn.Module):
    """RMS norm over each value head's output (weights as published, not 1 + w), then the SiLU(z) gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * o.to(dtype)) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        per_key = cfg.num_value_heads // cfg.num_key_heads
        if cfg.fused_projections:
            self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * cfg.key_dim + 2 * cfg.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * cfg.num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads))
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)
        self.backend = "auto"  # the delta rule's over a pass's spans (kernels/triton_support.pick_backend)
        self._split = [cfg.key_head_dim, cfg.key_head_dim, per_key * cfg.value_head_dim, per_key * cfg.value_head_dim]

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per token: the conv's input [T, conv_dim] (queries, keys, values), z [T, Hv, Dv], b and a [T, Hv]."""
        cfg, t = self.cfg, x.shape[0]
        if not cfg.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, cfg.num_value_heads, -1), self.in_proj_b(x),
                    self.in_proj_a(x))
        q, k, v, z = self.in_proj_qkvz(x).view(t, cfg.num_key_heads, -1).split(self._split, dim=-1)
        b, a = self.in_proj_ba(x).view(t, cfg.num_key_heads, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, cfg.num_value_heads, -1), b.reshape(t, -1), a.reshape(t, -1)

    def _convolve(self, mixed: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal convolution + SiLU over [conv state; inputs]: (outputs [T, conv_dim], the new state)."""
        window = torch.cat([state.conv.to(mixed.dtype), mixed])  # [K - 1 + T, C]
        weight = self.conv1d.weight[:, 0]  # [C, K]
        taps = window.unfold(0, self.cfg.conv_kernel, 1)  # [T, C, K]: inputs t .. t + K - 1 of the window
        out = F.silu((taps * weight).sum(-1))
        return out, window[-(self.cfg.conv_kernel - 1):]

    def _rule_inputs(self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, g, beta of the delta rule from the convolved inputs and b, a."""
        cfg, t = self.cfg, conv_out.shape[0]
        q, k, v = conv_out.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = _l2norm(q.reshape(t, cfg.num_key_heads, -1).float()) * cfg.key_head_dim**-0.5
        k = _l2norm(k.reshape(t, cfg.num_key_heads, -1).float())
        v = v.reshape(t, cfg.num_value_heads, -1).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, torch.sigmoid(b).float()

    def forward(self, x: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
        """x [T, hidden] of one request, after `state`: (outputs [T, hidden], the state after the last token)."""
        mixed, z, b, a = self._projections(x)
        conv_out, conv_state = self._convolve(mixed, state)
        q, k, v, g, beta = self._rule_inputs(conv_out, b, a)
        rule = gated_delta_recurrent if x.shape[0] == 1 else gated_delta_chunked
        o, ssm = rule(q, k, v, g, beta, state.ssm)
        return self.out_proj(self.norm(o, z, x.dtype).reshape(x.shape[0], -1)), RecurrentState(conv_state, ssm)

    def forward_spans(self, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                      spans: Spans) -> tuple[torch.Tensor, TreePass | None]:
        """Every request of a pass at once: x [T, hidden] (rows as `spans` lays them out), conv [S, K - 1,
        conv_dim] and ssm [S, Hv, Dk, Dv] this layer's states by slot. A prefill or decode moves each request's
        states on to its last token in place; a verify writes none and returns its TreePass (a request's part:
        its span's rows). Returns (outputs [T, hidden], that TreePass or None)."""
        mixed, z, b, a = self._projections(x)
        source = torch.cat([mixed, conv[spans.slots].flatten(0, 1).to(mixed.dtype)])
        weight = self.conv1d.weight[:, 0].float()
        # tap by tap, float32: no [T, K, conv_dim] copy of the windows
        taps = sum(source[spans.windows[:, i]].float() * weight[:, i] for i in range(self.cfg.conv_kernel))
        q, k, v, g, beta = self._rule_inputs(F.silu(taps.to(mixed.dtype)), b, a)
        rule = (q, k, v, g, beta, ssm, spans.slots, spans.starts, spans.lens)
        tree = None
        if spans.verify:
            o, u, G = gated_delta_verify(*rule, spans.tree, spans.max_len, self.backend)
            tree = TreePass(mixed, k, u, G)
        else:
            o = gated_delta_prefill(*rule, spans.max_len, self.backend)
            last = spans.starts.long() + spans.lens.long() - 1
            conv.index_copy_(0, spans.slots, source[spans.windows[last, 1:]].to(conv.dtype))
        return self.out_proj(self.norm(o, z, x.dtype).reshape(x.shape[0], -1)), tree

    def verify_tree(self, x: torch.Tensor, state: RecurrentState, parents: list[int]) -> tuple[torch.Tensor, TreePass]:
        """Every node of one request's draft tree after the committed `state` (x [T, hidden] in topological order,
        node i continuing parents[i], -1: the committed state): (outputs [T, hidden], what `commit` takes)."""
        one = torch.tensor([0, 0, len(parents)], device=x.device)
        spans = Spans.build(one[:1], one[1:2], one[2:], self.cfg.conv_kernel, True,
                            torch.tensor(parents, device=x.device), ancestor_bits(parents).to(x.device))
        return self.forward_spans(x, state.conv[None], state.ssm[None], spans)

    def verify_snapshots(self, x: torch.Tensor, state: RecurrentState,
                         parents: list[int]) -> tuple[torch.Tensor, list[RecurrentState]]:
        """The per-node-snapshot baseline of `verify_tree`: (outputs [T, hidden], every node's state after it)."""
        outs, snapshots = [], []
        for node, parent in enumerate(parents):
            out, after = self(x[node : node + 1], snapshots[parent] if parent >= 0 else state)
            outs.append(out)
            snapshots.append(after)
        return torch.cat(outs), snapshots

    def commit(self, state: RecurrentState, tree: TreePass, path: list[int]) -> RecurrentState:
        """The state after the accepted `path` of a verified tree's nodes (root first)."""
        return commit_state(state, tree, path)


def commit_state(state: RecurrentState, tree: TreePass, path: list[int]) -> RecurrentState:
    """The state after the accepted `path` (root first) of a verify's nodes, from its TreePass."""
    conv, ssm = commit_states(state.conv[None], state.ssm[None], tree, PaddedPaths.of([path], tree.mixed.device))
    return RecurrentState(conv[0], ssm[0])


def commit_states(conv: torch.Tensor, ssm: torch.Tensor, tree: TreePass,
                  paths: PaddedPaths) -> tuple[torch.Tensor, torch.Tensor]:
    """The states of B requests (conv [B, K - 1, conv_dim], ssm [B, Hv, Dk, Dv]) after their accepted paths of
    one verify pass (rows of its TreePass): each conv window moves on by its path's inputs, each delta rule's
    state is rebuilt along its path. A few launches for the whole batch."""
    width = conv.shape[1]
    # each window: rows len(path) .. len(path) + K - 2 of [its conv state; its path's inputs]
    joined = torch.cat([conv.to(tree.mixed.dtype), tree.mixed[paths.rows]], dim=1)
    newest = paths.lengths[:, None] + torch.arange(width, device=joined.device)
    windows = joined.gather(1, newest[:, :, None].expand(-1, -1, joined.shape[2]))
    after = gated_delta_commit_paths(ssm, tree.k, tree.u, tree.G, paths)
    return windows.to(conv.dtype), after.to(ssm.dtype)
