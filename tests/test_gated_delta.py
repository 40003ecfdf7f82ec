"""The gated delta rule's references (kernels/gated_delta.py): token by token equals Hugging Face's own
Qwen3-Next recurrence; the chunked form equals it; over a draft tree every node's output is the recurrence
along its path and the committed state is the recurrence's after the accepted path; a decode step of many
requests is each one's recurrence, and its Triton kernel (interpreter, in a subprocess) matches it."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.gated_delta import (
    gated_delta_chunked,
    gated_delta_commit,
    gated_delta_decode,
    gated_delta_recurrent,
    gated_delta_tree,
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


def _triton_results() -> dict[str, list[float]]:
    from specpilot.kernels.gated_delta import gated_delta_decode_triton

    errors = {}
    for case in DECODE_CASES:
        q, k, v, g, beta, state = decode_inputs(*case, seed=1)
        ref_state = state.clone()
        ref = gated_delta_decode(q, k, v, g, beta, ref_state, backend="torch")
        got = gated_delta_decode_triton(q, k, v, g, beta, state)
        errors[str(case)] = [float((got - ref).abs().max()), float((state - ref_state).abs().max())]
    return errors


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_triton_decode_step_matches_the_reference(triton_results, case):
    out_err, state_err = triton_results[str(case)]
    assert out_err < 1e-5 and state_err < 1e-5


if __name__ == "__main__":
    import json

    print(json.dumps(_triton_results()))
