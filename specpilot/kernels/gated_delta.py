"""The gated delta rule (Gated DeltaNet, the recurrent layers of Qwen3-Next and Qwen3.5): plain-torch
references of its three forms — token by token, chunked, and over a draft tree.

One request's sequence, per value head h (keys and queries shared by consecutive value heads, GQA-style), with
a state S in R^{Dk x Dv} and per-token decay alpha_t = exp(g_t), write strength beta_t:

    S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (alpha_t S_{t-1})^T k_t),   o_t = S_t^T q_t

(q and k as the layer hands them: L2-normalised, q scaled by Dk^-1/2). Unrolled over a span that starts from S0,
with G_i the decay's cumulative log over the span,

    S_i = e^{G_i} S0 + sum_{j <= i} e^{G_i - G_j} k_j u_j^T
    u + A u = beta * (v - e^{G} S0^T k),   A_ij = beta_i e^{G_i - G_j} (k_i . k_j) for j < i

so a span's u is one triangular solve, its outputs o_i = e^{G_i} S0^T q_i + sum_{j <= i} e^{G_i - G_j}
(q_i . k_j) u_j, and its end state the sum above (the chunked form). A draft tree is the same with "j < i"
read as "j a proper ancestor of i" and G_i = g_i + G_parent(i): every node's output in one pass, with no state
written per node; after acceptance one state is committed along the accepted path (`gated_delta_commit`). A
chain is the tree whose node i hangs under i - 1.

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv]. Computed in float32 (or the
inputs' float64).

A decode step of many requests at once (`gated_delta_decode`: one token each, states updated in place) has a
Triton kernel beside its reference: one program per (request, value head) holds its state tile in registers.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["gated_delta_chunked", "gated_delta_commit", "gated_delta_decode", "gated_delta_decode_reference",
           "gated_delta_decode_triton", "gated_delta_recurrent", "gated_delta_tree"]


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per value head, as [Hv, T, ...] in the compute dtype: q and k repeated over their value heads."""
    hk, hv = k.shape[1], v.shape[1]
    if hv % hk or q.shape != k.shape or g.shape != beta.shape or g.shape != v.shape[:2]:
        raise ValueError(f"need q, k [T, Hk, Dk], v [T, Hv, Dv] with Hv a multiple of Hk, g, beta [T, Hv]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}")
    if state.shape != (hv, k.shape[2], v.shape[2]):
        raise ValueError(f"state must be [Hv, Dk, Dv] = {(hv, k.shape[2], v.shape[2])}, got {tuple(state.shape)}")
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    rep = hv // hk
    q, k = (t.repeat_interleave(rep, dim=1).transpose(0, 1).to(dtype) for t in (q, k))
    return q, k, v.transpose(0, 1).to(dtype), g.t().to(dtype), beta.t().to(dtype), state.to(dtype)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: (outputs [T, Hv, Dv], the state after the last token [Hv, Dk, Dv])."""
    q, k, v, g, beta, s = _heads(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t, None, None].exp()
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", s, k[:, t]))
        s = s + k[:, t, :, None] * u[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
    return out.transpose(0, 1), s


def _span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor,
          sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One span's outputs and u, per head [H, T, ...]: `sees` [T, T] bool, node i's ancestors-or-self."""
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~sees, float("-inf")).exp()  # e^{G_i - G_j}, j in anc(i)
    proper = sees & ~torch.eye(sees.shape[0], dtype=torch.bool, device=sees.device)
    a = beta[:, :, None] * decay * (k @ k.transpose(1, 2)) * proper
    rhs = beta[:, :, None] * (v - G.exp()[:, :, None] * (k @ s0))
    eye = torch.eye(sees.shape[0], dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False)
    out = G.exp()[:, :, None] * (q @ s0) + (decay * (q @ k.transpose(1, 2))) @ u
    return out, u


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of `chunk` tokens, each one triangular solve from the state at its start: as recurrent."""
    q, k, v, g, beta, s = _heads(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    for lo in range(0, v.shape[1], chunk):
        hi = min(lo + chunk, v.shape[1])
        G = g[:, lo:hi].cumsum(1)
        sees = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=v.device).tril()
        out[:, lo:hi], u = _span(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], G, beta[:, lo:hi], s, sees)
        end = (G[:, -1:] - G).exp()  # e^{G_C - G_j}
        s = G[:, -1, None, None].exp() * s + torch.einsum("htk,htv->hkv", k[:, lo:hi] * end[:, :, None], u)
    return out.transpose(0, 1), s


def _ancestors(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: node i sees node j iff j is i or one of its ancestors (parents[i] < i; -1: the root's)."""
    n = len(parents)
    sees = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node (a tree lists parents first)")
        if p >= 0:
            sees[i] |= sees[p]
    return sees


def gated_delta_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every node of a tree from the committed `state` in one pass (node i continues its parent's path;
    parents[i] = -1 for a node on the committed state): (outputs [T, Hv, Dv], u [Hv, T, Dv], G [Hv, T]) — u and
    G what `gated_delta_commit` needs once a path is accepted. No state is written per node."""
    q, k, v, g, beta, s = _heads(q, k, v, g, beta, state)
    G = g.clone()
    for i, p in enumerate(parents):
        if p >= 0:
            G[:, i] += G[:, p]
    sees = _ancestors(parents).to(v.device)
    out, u = _span(q, k, v, G, beta, s, sees)
    return out.transpose(0, 1), u, G


def gated_delta_commit(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor,
                       path: list[int]) -> torch.Tensor:
    """The state after the accepted `path` of tree nodes (root first; `k` [T, Hk, Dk] the tree's keys, u and G
    from gated_delta_tree): e^{G_m} S0 + sum over the path of e^{G_m - G_j} k_j u_j^T, m its last node."""
    if not path:
        return state
    rep = u.shape[0] // k.shape[1]
    keys = k.repeat_interleave(rep, dim=1).transpose(0, 1).to(u.dtype)[:, path]  # [Hv, P, Dk]
    m = path[-1]
    weights = (G[:, m, None] - G[:, path]).exp()  # [Hv, P]
    return G[:, m, None, None].exp() * state.to(u.dtype) + torch.einsum("hpk,hpv->hkv", keys * weights[:, :, None],
                                                                         u[:, path])


def gated_delta_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of each of B requests: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; `state` [B, Hv, Dk, Dv]
    float32, updated in place. Returns the outputs [B, Hv, Dv] (float32)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b in range(v.shape[0]):
        o, state[b] = gated_delta_recurrent(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1],
                                            beta[b : b + 1], state[b])
        out[b] = o[0]
    return out


if triton is not None:

    @triton.jit
    def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, HV: tl.constexpr,
                                   REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // REP  # the key head this value head reads
        dk = tl.arange(0, DK)
        dv = tl.arange(0, DV)
        q = tl.load(q_ptr + (b * (HV // REP) + hk) * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + (b * (HV // REP) + hk) * DK + dk).to(tl.float32)
        v = tl.load(v_ptr + (b * HV + h) * DV + dv).to(tl.float32)
        alpha = tl.exp(tl.load(g_ptr + b * HV + h).to(tl.float32))
        beta = tl.load(beta_ptr + b * HV + h).to(tl.float32)
        s_ptrs = state_ptr + ((b * HV + h) * DK + dk[:, None]).to(tl.int64) * DV + dv[None, :]
        s = tl.load(s_ptrs) * alpha
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        tl.store(s_ptrs, s)
        tl.store(out_ptr + (b * HV + h) * DV + dv, tl.sum(s * q[:, None], axis=0))


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    require_triton("gated_delta_decode_triton")
    bsz, hv, dv = v.shape
    hk, dk = k.shape[1:]
    if state.shape != (bsz, hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous float32 [B, Hv, Dk, Dv] = {(bsz, hv, dk, dv)}, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gated_delta_decode_triton needs power-of-two head dims, got Dk {dk}, Dv {dv}")
    out = torch.empty((bsz, hv, dv), dtype=torch.float32, device=v.device)
    if bsz:
        _gated_delta_decode_kernel[(bsz, hv)](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                              beta.contiguous(), state, out, HV=hv, REP=hv // hk, DK=dk, DV=dv,
                                              num_warps=4)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Triton for CUDA tensors, the reference otherwise."""
    if pick_backend(backend, v) == "triton":
        return gated_delta_decode_triton(q, k, v, g, beta, state)
    return gated_delta_decode_reference(q, k, v, g, beta, state)
