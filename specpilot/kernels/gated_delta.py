"""The gated delta rule (Gated DeltaNet, the recurrent layers of Qwen3-Next and Qwen3.5): plain-torch
references of its three forms — token by token, chunked, and over a draft tree — and Triton kernels that run
many requests at once.

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

Many requests' spans at once, each from its own state in a [S, Hv, Dk, Dv] table (row slots[b] for request b):
`gated_delta_prefill` (chunked, each end state written back in place) and `gated_delta_verify` (every span a tree
given by its nodes' ancestor bits, the engine's tree_mask, or a chain: outputs, u and G, no state written). On
CUDA one Triton kernel runs both: one program per (request, value head, block of Dv columns) walks its span's
chunks. A span's chunks wait on each other through S, and a verify is one chunk, so programs per chunk would buy
nothing there; S's columns evolve independently, so splitting Dv gives more programs, each rebuilding the chunk's
A. A chunk's products with k, q and S run over blocks of Dk, S read from (and a prefill's written back to) its
table row rather than held in registers beside them; A comes from k k^T and its mask (j < i, or j a proper
ancestor of i); (I + A) u = rhs is solved by forward substitution; products run on tensor cores at about fp32's
accuracy (three tf32 products each), accumulated in fp32. Elsewhere each span runs its reference form.

A decode step of many requests at once (`gated_delta_decode`: one token each, states updated in place) has a
Triton kernel beside its reference: one program per (request, value head) holds its state tile in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["PaddedPaths", "ancestor_bits", "gated_delta_chunked", "gated_delta_commit", "gated_delta_commit_paths",
           "gated_delta_decode", "gated_delta_decode_reference", "gated_delta_decode_triton", "gated_delta_prefill",
           "gated_delta_prefill_reference", "gated_delta_recurrent", "gated_delta_spans_triton", "gated_delta_tree",
           "gated_delta_verify", "gated_delta_verify_reference"]


def _dtype(v: torch.Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per value head, as [Hv, T, ...] in the compute dtype: q and k repeated over their value heads."""
    hk, hv = k.shape[1], v.shape[1]
    if hv % hk or q.shape != k.shape or g.shape != beta.shape or g.shape != v.shape[:2]:
        raise ValueError(f"need q, k [T, Hk, Dk], v [T, Hv, Dv] with Hv a multiple of Hk, g, beta [T, Hv]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}")
    if state.shape != (hv, k.shape[2], v.shape[2]):
        raise ValueError(f"state must be [Hv, Dk, Dv] = {(hv, k.shape[2], v.shape[2])}, got {tuple(state.shape)}")
    dtype = _dtype(v)
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


def ancestor_bits(parents: list[int]) -> torch.Tensor:
    """[T] int64, the engine's tree_mask of one tree of at most 64 nodes: bit j of node i is set iff j is i or one
    of its ancestors."""
    if len(parents) > 64:
        raise ValueError(f"ancestor bits hold trees of at most 64 nodes, got {len(parents)}")
    return (_ancestors(parents).long() << torch.arange(len(parents))).sum(1)


def _parents_of(bits: list[int]) -> list[int]:
    """Each node's parent (-1 for a root): its highest ancestor bit below its own."""
    return [(b & ((1 << i) - 1)).bit_length() - 1 for i, b in enumerate(bits)]


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


@dataclass(frozen=True)
class PaddedPaths:
    """Accepted paths of one verify pass (rows of the pass, root first), padded to the longest as a commit reads
    them; made once per pass, whatever reads it."""

    rows: torch.Tensor  # [B, P] long: each path's rows, then its last row again (0 for an empty path)
    taken: torch.Tensor  # [B, P] bool: the path's own entries
    lengths: torch.Tensor  # [B] long

    @classmethod
    def of(cls, paths: list[list[int]], device: torch.device) -> PaddedPaths:
        longest = max(map(len, paths), default=0)
        rows = torch.tensor([p + [p[-1] if p else 0] * (longest - len(p)) for p in paths], dtype=torch.long,
                            device=device).view(len(paths), longest)
        lengths = torch.tensor([len(p) for p in paths], dtype=torch.long, device=device)
        return cls(rows, torch.arange(longest, device=device) < lengths[:, None], lengths)


def gated_delta_commit(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor,
                       path: list[int]) -> torch.Tensor:
    """The state after the accepted `path` of tree nodes (root first; `k` [T, Hk, Dk] the tree's keys, u and G
    from gated_delta_tree): e^{G_m} S0 + sum over the path of e^{G_m - G_j} k_j u_j^T, m its last node."""
    if not path:
        return state
    return gated_delta_commit_paths(state[None], k, u, G, PaddedPaths.of([path], u.device))[0]


def gated_delta_commit_paths(states: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor,
                             paths: PaddedPaths) -> torch.Tensor:
    """`gated_delta_commit` of B requests of one verify pass at once: states [B, Hv, Dk, Dv], `paths` rows of
    the pass's k [T, Hk, Dk], u [Hv, T, Dv] and G [Hv, T]; an empty path keeps its state. Padded entries weigh
    zero, so a pass's commit costs the same few launches whatever its batch."""
    if paths.rows.shape[1] == 0:
        return states
    rows, taken = paths.rows, paths.taken
    rep = u.shape[0] // k.shape[1]
    keys = k[rows].repeat_interleave(rep, dim=2).permute(0, 2, 1, 3).to(u.dtype)  # [B, Hv, P, Dk]
    values = u[:, rows].permute(1, 0, 2, 3)  # [B, Hv, P, Dv]
    g_last = G[:, rows[:, -1]].t()  # [B, Hv]
    weights = torch.where(taken[:, None, :], (g_last[:, :, None] - G[:, rows].permute(1, 0, 2)).exp(), 0.0)
    after = g_last.exp()[:, :, None, None] * states.to(u.dtype) + torch.einsum("bhpk,bhpv->bhkv",
                                                                                keys * weights[..., None], values)
    return torch.where(taken[:, 0, None, None, None], after, states.to(u.dtype))


def _spans(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> list[tuple[int, int, int]]:
    return list(zip(*(t.tolist() for t in (slots, starts, lens))))


def gated_delta_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                                  lens: torch.Tensor) -> torch.Tensor:
    """B requests' spans, request b's rows starts[b] : starts[b] + lens[b] of q, k [T, Hk, Dk], v [T, Hv, Dv],
    g, beta [T, Hv], each from its state state[slots[b]] (`state` [S, Hv, Dk, Dv]), which it moves on to the
    span's end in place: the outputs [T, Hv, Dv]. A span of one token takes the recurrence, a longer one the
    chunked form."""
    out = torch.empty(v.shape, dtype=_dtype(v), device=v.device)
    for slot, lo, n in _spans(slots, starts, lens):
        rule = gated_delta_recurrent if n == 1 else gated_delta_chunked
        out[lo : lo + n], state[slot] = rule(*(t[lo : lo + n] for t in (q, k, v, g, beta)), state[slot])
    return out


def gated_delta_verify_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                                 lens: torch.Tensor,
                                 tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B requests' drafts, laid out as gated_delta_prefill_reference's spans, each a tree (`tree` [T] int64: each
    node's ancestor bits within its span, as `ancestor_bits`) or a chain (None), from its committed state:
    (outputs [T, Hv, Dv], u [Hv, T, Dv], G [Hv, T]) as gated_delta_tree gives them per span. No state written."""
    t, hv, dv = v.shape
    dtype = _dtype(v)
    out = torch.empty(v.shape, dtype=dtype, device=v.device)
    u = torch.empty(hv, t, dv, dtype=dtype, device=v.device)
    G = torch.empty(hv, t, dtype=dtype, device=v.device)
    bits = tree.tolist() if tree is not None else None
    for slot, lo, n in _spans(slots, starts, lens):
        parents = list(range(-1, n - 1)) if bits is None else _parents_of(bits[lo : lo + n])
        out[lo : lo + n], u[:, lo : lo + n], G[:, lo : lo + n] = gated_delta_tree(
            *(x[lo : lo + n] for x in (q, k, v, g, beta)), state[slot], parents)
    return out, u, G


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


if triton is not None:

    @triton.jit
    def _dot(a, b, acc):
        # three tf32 MMAs: near fp32's accuracy on tensor cores, accumulated in fp32 (fp32 FMA products hold
        # whole operand rows per thread and spill at these tiles)
        return tl.dot(a, b, acc, input_precision="tf32x3")

    @triton.jit
    def _rows(ptr, rows, live, STRIDE: tl.constexpr, cols):
        """[len(rows), len(cols)] float32 at `ptr` + rows * STRIDE + cols (zeros where not `live`)."""
        return tl.load(ptr + rows[:, None] * STRIDE + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _gated_delta_spans_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_stride, slots_ptr, starts_ptr,
                                  lens_ptr, tree_ptr, o_ptr, u_ptr, G_ptr, T, HV: tl.constexpr, REP: tl.constexpr,
                                  DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                                  BV: tl.constexpr, VERIFY: tl.constexpr, TREE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        HK: tl.constexpr = HV // REP
        # this program's span and head as 64-bit bases, so the tiles' offsets stay 32-bit (fewer registers)
        start = tl.load(starts_ptr + b).to(tl.int64)
        n = tl.load(lens_ptr + b)
        q_ptr += (start * HK + h // REP) * DK
        k_ptr += (start * HK + h // REP) * DK
        v_ptr += (start * HV + h) * DV
        o_ptr += (start * HV + h) * DV
        g_ptr += start * HV + h
        beta_ptr += start * HV + h
        tree_ptr += start
        u_ptr += (h * T + start) * DV
        G_ptr += h * T + start
        state_ptr += tl.load(slots_ptr + b).to(tl.int64) * state_stride + h * DK * DV
        rows = tl.arange(0, BT)
        bk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        for lo in range(0, n, BT):
            r = lo + rows
            live = r < n
            # k k^T, q k^T, k S and q S over blocks of Dk: S streams through its table row (a prefill's moved on
            # there chunk by chunk) rather than staying in registers beside k and q
            kk = tl.zeros([BT, BT], dtype=tl.float32)
            qk = tl.zeros([BT, BT], dtype=tl.float32)
            ks = tl.zeros([BT, BV], dtype=tl.float32)
            qs = tl.zeros([BT, BV], dtype=tl.float32)
            for c in tl.static_range(0, DK, BK):
                k = _rows(k_ptr + c, r, live, HK * DK, bk)
                q = _rows(q_ptr + c, r, live, HK * DK, bk)
                s = tl.load(state_ptr + (c + bk[:, None]) * DV + dv[None, :])
                kk = _dot(k, tl.trans(k), kk)
                qk = _dot(q, tl.trans(k), qk)
                ks = _dot(k, s, ks)
                qs = _dot(q, s, qs)
            g = tl.load(g_ptr + r * HV, mask=live, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + r * HV, mask=live, other=0.0).to(tl.float32)
            if TREE:
                bits = tl.load(tree_ptr + r, mask=live, other=0)
                sees = ((bits[:, None] >> rows[None, :].to(tl.int64)) & 1) != 0
            else:
                sees = rows[None, :] <= rows[:, None]
            G = tl.sum(tl.where(sees, g[None, :], 0.0), axis=1)  # a path's cumulative log-decay
            decay = tl.exp(tl.where(sees, G[:, None] - G[None, :], float("-inf")))  # e^{G_i - G_j}, 0 off the path
            e_g = tl.exp(G)
            a = tl.where(rows[None, :] < rows[:, None], beta[:, None] * decay * kk, 0.0)
            u = beta[:, None] * (_rows(v_ptr, r, live, HV * DV, dv) - e_g[:, None] * ks)
            # (I + A) u = rhs, A strictly lower: once row j is final, take its part out of every later row
            for j in range(0, tl.minimum(n - lo, BT) - 1):
                u_j = tl.sum(tl.where(rows[:, None] == j, u, 0.0), axis=0)
                a_j = tl.sum(tl.where(rows[None, :] == j, a, 0.0), axis=1)
                u -= a_j[:, None] * u_j[None, :]
            o = _dot(decay * qk, u, e_g[:, None] * qs)
            tl.store(o_ptr + r[:, None] * (HV * DV) + dv[None, :], o, mask=live[:, None])
            if VERIFY:
                tl.store(u_ptr + r[:, None] * DV + dv[None, :], u, mask=live[:, None])
                if vb == 0:
                    tl.store(G_ptr + r, G, mask=live)
            else:
                g_end = tl.sum(tl.where(rows == tl.minimum(n - lo, BT) - 1, G, 0.0), axis=0)
                w = tl.where(live, tl.exp(g_end - G), 0.0)  # e^{G_C - G_j}
                for c in tl.static_range(0, DK, BK):
                    k = _rows(k_ptr + c, r, live, HK * DK, bk)
                    s_ptrs = state_ptr + (c + bk[:, None]) * DV + dv[None, :]
                    tl.store(s_ptrs, _dot(tl.trans(k * w[:, None]), u, tl.exp(g_end) * tl.load(s_ptrs)))
                tl.debug_barrier()  # the next chunk's threads read what these stored


def gated_delta_spans_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                             verify: bool = False, tree: torch.Tensor | None = None, max_len: int | None = None,
                             chunk: int = 32, block_k: int = 32,
                             block_v: int = 64) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gated_delta_prefill's spans (`verify` False: the states moved on in place; returns (outputs, None, None)) or
    gated_delta_verify's (returns (outputs, u, G)) in one launch. `max_len`: the longest span if the caller knows
    it (else read from `lens`). A prefill takes chunks of `chunk` tokens (fewer for short spans: that length
    rounded up to a power of two, at least 16), a verify each span as one chunk of up to 64. `block_k`,
    `block_v`: the Dk rows of S a product takes at once, and the Dv columns one program carries."""
    require_triton("gated_delta_spans_triton")
    t, hv, dv = v.shape
    hk, dk = k.shape[1:]
    if state.dtype != torch.float32 or state.shape[1:] != (hv, dk, dv) or state.stride()[1:] != (dk * dv, dv, 1):
        raise ValueError(f"state must be float32 [S, Hv, Dk, Dv] = [S, {hv}, {dk}, {dv}], each row contiguous, got "
                         f"{state.dtype} {tuple(state.shape)} strides {state.stride()}")
    for name, size in (("Dk", dk), ("Dv", dv), ("chunk", chunk), ("block_k", block_k), ("block_v", block_v)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"gated_delta_spans_triton needs a power of two of at least 16 for {name}, got {size}")
    if tree is not None and not verify:
        raise ValueError("a tree is a verify's")
    if max_len is None:
        max_len = int(lens.max()) if lens.numel() else 0
    if verify and max_len > 64:
        raise ValueError(f"a verify's span must fit one chunk of at most 64 tokens, got {max_len}")
    bt = max(16, triton.next_power_of_2(max_len))
    if not verify:
        bt = min(chunk, bt)
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    u = torch.empty((hv, t, dv), dtype=torch.float32, device=v.device) if verify else None
    G = torch.empty((hv, t), dtype=torch.float32, device=v.device) if verify else None
    if lens.numel() and t:
        bv = min(block_v, dv)
        _gated_delta_spans_kernel[(lens.numel(), hv, dv // bv)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, state.stride(0),
            slots.contiguous(), starts.contiguous(), lens.contiguous(), tree.contiguous() if tree is not None else lens,
            out, u if verify else out, G if verify else out, t, HV=hv, REP=hv // hk, DK=dk, DV=dv, BT=bt,
            BK=min(block_k, dk), BV=bv, VERIFY=verify, TREE=tree is not None, num_warps=4 if bt == 16 else 8)
    return out, u, G


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                        max_len: int | None = None, backend: str = "auto") -> torch.Tensor:
    """As gated_delta_prefill_reference (states moved on in place): Triton for CUDA tensors, the reference
    otherwise."""
    if pick_backend(backend, v) == "triton":
        return gated_delta_spans_triton(q, k, v, g, beta, state, slots, starts, lens, max_len=max_len)[0]
    return gated_delta_prefill_reference(q, k, v, g, beta, state, slots, starts, lens)


def gated_delta_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                       tree: torch.Tensor | None = None, max_len: int | None = None,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As gated_delta_verify_reference: Triton for CUDA tensors, the reference otherwise."""
    if pick_backend(backend, v) == "triton":
        return gated_delta_spans_triton(q, k, v, g, beta, state, slots, starts, lens, True, tree, max_len)
    return gated_delta_verify_reference(q, k, v, g, beta, state, slots, starts, lens, tree)
