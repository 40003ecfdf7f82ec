"""The gated delta rule's references (kernels/gated_delta.py): token by token equals Hugging Face's own
Qwen3-Next recurrence; the chunked form equals it; over a draft tree every node's output is the recurrence
along its path and the committed state is the recurrence's after the accepted path; a decode step of many
requests is each one's recurrence, and its Triton kernel (interpreter, in a subprocess) matches it. The spans
kernel (many requests' prefills, or their trees' and chains' verifies, in one launch) matches the chunked and
tree forms and, along paths, the recurrence: under the interpreter at small shapes, on CUDA at Qwen3-Next's."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.gated_delta import (
    ancestor_bits,
    gated_delta_chunked,
    gated_delta_commit,
    gated_delta_decode,
    gated_delta_recurrent,
    gated_delta_tree,
    gated_delta_verify,
)


def inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g, dtype=dtype), dim=-1) / dk**0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(t, hv, dv, generator=g, dtype=dtype)
    decay = -torch.nn.functional.softplus(torch.randn(t, hv, generator=g, dtype=dtype)) * 0.5
    beta = torch.sigmoid(torch.randn(t, hv, generator=g, dtype=dtype))
    state = torch.randn(hv, dk, dv, generator=g, dtype=dtype) * 0.3
    return q, k, v, decay, beta, state


def test_recurrence_equals_hugging_face_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = inputs(20)
    out, final = gated_delta_recurrent(q, k, v, g, beta, state)
    # HF scales q by Dk^-1/2 itself and takes [B, T, H, D] (fp32)
    hf_out, hf_final = torch_recurrent_gated_delta_rule(
        (q * 16**0.5)[None].float(), k[None].float(), v[None].float(), g[None].float(), beta[None].float(),
        initial_state=state[None].float(), output_final_state=True)
    torch.testing.assert_close(out.float(), hf_out[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.float(), hf_final[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,chunk", [(1, 64), (37, 64), (130, 64), (50, 16)])
def test_chunked_equals_the_recurrence(t, chunk):
    q, k, v, g, beta, state = inputs(t, seed=t)
    out, final = gated_delta_recurrent(q, k, v, g, beta, state)
    c_out, c_final = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(c_out, out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(c_final, final, rtol=1e-9, atol=1e-10)


def _path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("parents", [
    [-1, 0, 1, 2, 3],  # a chain
    [-1, 0, 0, 1, 1, 2, 3, 3, 6, 0],  # a tree of 10 nodes
    [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, 64)],
])
def test_every_tree_node_is_the_recurrence_along_its_path_and_a_path_commits_its_state(parents):
    n = len(parents)
    q, k, v, g, beta, state = inputs(n, seed=n)
    out, u, G = gated_delta_tree(q, k, v, g, beta, state, parents)
    for node in range(n):
        path = _path(parents, node)
        along, final = gated_delta_recurrent(q[path], k[path], v[path], g[path], beta[path], state)
        torch.testing.assert_close(out[node], along[-1], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(gated_delta_commit(state, k, u, G, path), final, rtol=1e-9, atol=1e-10)
    assert torch.equal(gated_delta_commit(state, k, u, G, []), state)


def test_a_chain_tree_is_the_chunked_form():
    q, k, v, g, beta, state = inputs(16, seed=3)
    out, u, G = gated_delta_tree(q, k, v, g, beta, state, list(range(-1, 15)))
    torch.testing.assert_close(out, gated_delta_chunked(q, k, v, g, beta, state)[0], rtol=1e-12, atol=1e-12)


def test_bad_shapes_and_orders_are_named():
    q, k, v, g, beta, state = inputs(4)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_recurrent(q, k, v, g, beta, state[:, :, :3])
    with pytest.raises(ValueError, match="not an earlier node"):
        gated_delta_tree(q, k, v, g, beta, state, [-1, 2, 0, 1])


DECODE_CASES = [(3, 2, 4, 16, 8), (2, 1, 1, 32, 32), (5, 4, 8, 16, 16)]  # B, Hk, Hv, Dk, Dv


def decode_inputs(bsz: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    steps = [inputs(1, hk, hv, dk, dv, seed=seed * 10 + b, dtype=torch.float32) for b in range(bsz)]
    q, k, v, g, beta, state = (torch.cat([s[i] for s in steps]) if i < 5 else torch.stack([s[i] for s in steps])
                               for i in range(6))
    return q, k, v, g, beta, state


def test_a_decode_step_of_many_requests_is_each_one_s_recurrence():
    q, k, v, g, beta, state = decode_inputs(3, 2, 4, 16, 8)
    before = state.clone()
    out = gated_delta_decode(q, k, v, g, beta, state, backend="torch")
    for b in range(3):
        o, after = gated_delta_recurrent(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1],
                                         before[b])
        torch.testing.assert_close(out[b], o[0])
        torch.testing.assert_close(state[b], after)


def test_a_verify_of_many_requests_is_each_one_s_tree_from_its_bits():
    trees = [[-1, 0, 0, 1, 1, 2], [-1], [-1, 0, 1, 2], [-1, 0, 0, 2, 0]]
    q, k, v, g, beta, _ = inputs(16, seed=2)
    table = torch.randn(5, 4, 16, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    slots, starts, lens = torch.tensor([4, 0, 2, 1]), torch.tensor([0, 6, 7, 11]), torch.tensor([6, 1, 4, 5])
    bits = torch.cat([ancestor_bits(p) for p in trees])
    for tree, shapes in ((bits, trees), (None, [list(range(-1, n - 1)) for n in lens.tolist()])):
        out, u, G = gated_delta_verify(q, k, v, g, beta, table, slots, starts, lens, tree)
        for slot, lo, n, parents in zip(slots.tolist(), starts.tolist(), lens.tolist(), shapes):
            rows = slice(lo, lo + n)
            expected = gated_delta_tree(q[rows], k[rows], v[rows], g[rows], beta[rows], table[slot], parents)
            for got, want in zip((out[rows], u[:, rows], G[:, rows]), expected):
                assert torch.equal(got, want)


def test_ancestor_bits_are_the_engine_s_tree_mask():
    assert ancestor_bits([-1, 0, 0, 1, 3]).tolist() == [0b1, 0b11, 0b101, 0b1011, 0b11011]
    assert ancestor_bits(list(range(-1, 63)))[-1] == -1  # all 64 bits


def _random_tree(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


PREFILL_LENS = [1, 5, 70, 16, 33]  # spans within a chunk and across chunk boundaries, for chunks of 16, 32, 64
VERIFY_SIZES = [1, 7, 16, 33, 64]
# (name, kind, Hk, Hv, Dk, Dv, the spans kernel's chunk, block_k and block_v) under the interpreter
SPAN_CASES = [("prefill", "prefill", 2, 4, 32, 32, 32, 16, 16),
              ("prefill-chunks-of-16", "prefill", 2, 4, 16, 32, 16, 16, 64),
              ("prefill-chunks-of-64", "prefill", 1, 2, 32, 16, 64, 32, 16),
              ("tree", "tree", 2, 4, 32, 32, 32, 16, 16), ("chain", "chain", 1, 2, 16, 16, 32, 16, 64)]


def span_errors(kind: str, hk: int, hv: int, dk: int, dv: int, chunk: int, block_k: int, block_v: int,
                device: str = "cpu", lens: list[int] | None = None) -> dict[str, float]:
    """The spans kernel on float32 against the references in float64, each span from its own row of a state
    table whose rows are strided like the recurrent cache's: the largest error of each output relative to its
    largest magnitude (at least 1), and whether rows no span owns kept their bits."""
    from specpilot.kernels.gated_delta import gated_delta_spans_triton

    lens = lens or (PREFILL_LENS if kind == "prefill" else VERIFY_SIZES)
    t, b = sum(lens), len(lens)
    q, k, v, g, beta, _ = inputs(t, hk, hv, dk, dv, seed=t, dtype=torch.float32)
    table = torch.randn(b + 2, 3, hv, dk, dv, generator=torch.Generator().manual_seed(b)) * 0.3
    q, k, v, g, beta, table = (x.to(device) for x in (q, k, v, g, beta, table))
    state, before = table[:, 1], table[:, 1].clone()
    slots = torch.randperm(b + 2, generator=torch.Generator().manual_seed(7))[:b]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    trees = [_random_tree(n, seed=n) if kind == "tree" else list(range(-1, n - 1)) for n in lens]
    bits = torch.cat([ancestor_bits(p) for p in trees]).to(device) if kind == "tree" else None
    out, u, G = gated_delta_spans_triton(q, k, v, g, beta, state, slots.to(device), starts.to(device),
                                         torch.tensor(lens, device=device), kind != "prefill", bits, chunk=chunk,
                                         block_k=block_k, block_v=block_v)
    q, k, v, g, beta, before = (x.double() for x in (q, k, v, g, beta, before))
    worst: dict[str, float] = {}

    def err(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        scale = max(1.0, float(want.abs().max()))
        worst[name] = max(worst.get(name, 0.0), float((got.double() - want).abs().max()) / scale)

    for slot, lo, n, parents in zip(slots.tolist(), starts.tolist(), lens, trees):
        rows = slice(lo, lo + n)
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot])
        if kind == "prefill":
            ref_out, ref_state = gated_delta_chunked(*args)
            err("out", out[rows], ref_out)
            err("state", state[slot], ref_state)
            continue
        ref_out, ref_u, ref_G = gated_delta_tree(*args, parents)
        for name, got, want in (("out", out[rows], ref_out), ("u", u[:, rows], ref_u), ("G", G[:, rows], ref_G)):
            err(name, got, want)
        path = _path(parents, n - 1)
        along, after = gated_delta_recurrent(*(x[path] for x in args[:5]), before[slot])
        err("path", out[rows][path], along)  # every node on the path is the recurrence's
        err("commit", gated_delta_commit(before[slot], k[rows], u[:, rows].double(), G[:, rows].double(), path), after)
    owned = torch.zeros(len(state), dtype=torch.bool)
    owned[slots] = kind == "prefill"
    worst["untouched"] = float(not torch.equal(state[~owned.to(device)].double(), before[~owned.to(device)]))
    return worst


def _triton_results() -> dict[str, list[float] | dict[str, float]]:
    from specpilot.kernels.gated_delta import gated_delta_decode_triton

    errors: dict[str, list[float] | dict[str, float]] = {}
    for case in DECODE_CASES:
        q, k, v, g, beta, state = decode_inputs(*case, seed=1)
        ref_state = state.clone()
        ref = gated_delta_decode(q, k, v, g, beta, ref_state, backend="torch")
        got = gated_delta_decode_triton(q, k, v, g, beta, state)
        errors[str(case)] = [float((got - ref).abs().max()), float((state - ref_state).abs().max())]
    for name, *case in SPAN_CASES:
        errors[name] = span_errors(*case)
    return errors


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_triton_decode_step_matches_the_reference(triton_results, case):
    out_err, state_err = triton_results[str(case)]
    assert out_err < 1e-5 and state_err < 1e-5


@pytest.mark.parametrize("case", [c[0] for c in SPAN_CASES])
def test_triton_spans_match_the_chunked_and_tree_forms(triton_results, case):
    errors = triton_results[case]
    assert errors.pop("untouched") == 0
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,lens", [("prefill", [1, 17, 64, 200, 1000, 3]), ("tree", [16, 64, 1, 33, 16, 16]),
                                       ("chain", [16, 64, 1, 8])])
def test_cuda_spans_match_the_chunked_and_tree_forms_at_qwen3_next_shapes(kind, lens):
    errors = span_errors(kind, 16, 32, 128, 128, 32, 32, 64, "cuda", lens)
    assert errors.pop("untouched") == 0
    assert max(errors.values()) < 1e-4, errors


if __name__ == "__main__":
    import json

    print(json.dumps(_triton_results()))
