"""Our Gated DeltaNet layer (models/gated_deltanet.py) against Hugging Face's Qwen3-Next one with the same
weights: a prompt in one pass and then decode steps carrying the conv and recurrent state equal HF's whole
pass; a prompt split into chunks equals it in one — within fp32 rounding. A pass of many requests at once
(prefill from their own states in a per-slot table, then trees' and chains' verifies) equals each request
alone, and with the delta rule's Triton kernel (interpreter, in a subprocess; CUDA at Qwen3-Next's shapes) it
equals the plain-torch pass."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
from triton_interpret import interpreter_fixture

from specpilot.kernels.gated_delta import PaddedPaths, ancestor_bits
from specpilot.models.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetConfig,
    RecurrentState,
    Spans,
    TreePass,
    commit_states,
)

CPU = torch.device("cpu")


def pair(seed: int = 0) -> tuple[Qwen3NextGatedDeltaNet, GatedDeltaNet]:
    torch.manual_seed(seed)
    hf_cfg = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                             layer_types=["linear_attention"], rms_norm_eps=1e-6)
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = GatedDeltaNet(GatedDeltaNetConfig(64, 2, 4, 16, 8, 4, 1e-6))
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf, ours


def test_a_prompt_then_decode_steps_equal_hugging_face():
    hf, ours = pair()
    x = torch.randn(30, 64) * 0.5
    with torch.no_grad():
        expected = hf(x[None])[0]
        state = RecurrentState.zeros(ours.cfg, CPU, torch.float32)
        prefill, state = ours(x[:20], state)
        steps = [prefill]
        for t in range(20, 30):
            out, state = ours(x[t : t + 1], state)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps), expected, rtol=1e-4, atol=1e-5)


def test_a_prompt_in_chunks_carries_its_state():
    _, ours = pair(1)
    x = torch.randn(70, 64) * 0.5
    with torch.no_grad():
        whole, final = ours(x, RecurrentState.zeros(ours.cfg, CPU, torch.float32))
        first, state = ours(x[:33], RecurrentState.zeros(ours.cfg, CPU, torch.float32))
        second, state = ours(x[33:], state)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.ssm, final.ssm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.conv, final.conv)


def _path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_a_tree_verify_gives_every_node_its_path_s_output_and_commits_the_accepted_path():
    _, ours = pair(2)
    g = torch.Generator().manual_seed(4)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 0, 9, 10, 5, 12, 13, 8]  # 16 nodes, paths deeper than the conv
    with torch.no_grad():
        prompt, tree_x = torch.randn(12, 64, generator=g) * 0.5, torch.randn(16, 64, generator=g) * 0.5
        _, state = ours(prompt, RecurrentState.zeros(ours.cfg, CPU, torch.float32))
        out, tree = ours.verify_tree(tree_x, state, parents)
        for node in range(16):
            path = _path(parents, node)
            along, after = ours(tree_x[path], state)
            torch.testing.assert_close(out[node], along[-1], rtol=1e-4, atol=1e-5)
            committed = ours.commit(state, tree, path)
            torch.testing.assert_close(committed.ssm, after.ssm, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(committed.conv, after.conv)


def test_a_pass_s_requests_commit_together_as_each_would_alone():
    """commit_states over a batch of paths of different lengths (an empty one, one past the conv window, the
    padding between) gives each request the state its path alone commits: conv windows bit for bit."""
    _, ours = pair(3)
    g = torch.Generator().manual_seed(6)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 0, 9, 10, 5, 12, 13, 8]
    with torch.no_grad():
        states = [ours(torch.randn(5 + i, 64, generator=g) * 0.5, RecurrentState.zeros(ours.cfg, CPU, torch.float32))[1]
                  for i in range(4)]
        trees = [ours.verify_tree(torch.randn(16, 64, generator=g) * 0.5, state, parents)[1] for state in states]
        paths = [_path(parents, 8), [], _path(parents, 4), [0]]
        # the pass's TreePass: the requests' nodes one block after another
        joined = TreePass(*(torch.cat([getattr(t, f) for t in trees], dim=1 if f in ("u", "G") else 0)
                            for f in ("mixed", "k", "u", "G")))
        conv, ssm = commit_states(torch.stack([s.conv for s in states]), torch.stack([s.ssm for s in states]), joined,
                                  PaddedPaths.of([[16 * i + node for node in path] for i, path in enumerate(paths)],
                                                 CPU))
    for i, (state, tree, path) in enumerate(zip(states, trees, paths)):
        alone = ours.commit(state, tree, path)
        assert torch.equal(conv[i], alone.conv)
        torch.testing.assert_close(ssm[i], alone.ssm, rtol=1e-6, atol=1e-7)
    assert torch.equal(ssm[1], states[1].ssm) and torch.equal(conv[1], states[1].conv)


def test_the_snapshot_baseline_verifies_and_commits_the_same():
    _, ours = pair(5)
    g = torch.Generator().manual_seed(7)
    parents = [-1, 0, 0, 1, 2, 2, 4, 6]
    with torch.no_grad():
        _, state = ours(torch.randn(9, 64, generator=g) * 0.5, RecurrentState.zeros(ours.cfg, CPU, torch.float32))
        x = torch.randn(8, 64, generator=g) * 0.5
        tree_out, tree = ours.verify_tree(x, state, parents)
        snap_out, snapshots = ours.verify_snapshots(x, state, parents)
    torch.testing.assert_close(snap_out, tree_out, rtol=1e-4, atol=1e-5)
    committed = ours.commit(state, tree, _path(parents, 7))
    torch.testing.assert_close(snapshots[7].ssm, committed.ssm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(snapshots[7].conv, committed.conv)


PASS_SLOTS = [3, 0, 5, 2]  # rows of a six-slot table
PASS_LENS = [5, 1, 20, 3]
PASS_TREES = [[-1, 0, 0, 1, 1, 2, 3, 3, 6, 0, 9, 10], [-1], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 1]]


def random_layer(cfg: GatedDeltaNetConfig, device: str = "cpu", scale: float = 0.3) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return layer


def _rows(lens: list[int]) -> list[slice]:
    ends = torch.tensor(lens).cumsum(0).tolist()
    return [slice(end - n, end) for end, n in zip(ends, lens)]


def run_passes(layer: GatedDeltaNet) -> dict[str, torch.Tensor]:
    """A prefill pass (PASS_LENS tokens of the requests in PASS_SLOTS, from random states in a table strided like
    the recurrent cache's), then two verifies from the states it left: each request's tree of PASS_TREES, and
    chains as long. Inputs, outputs and states."""
    cfg, device = layer.cfg, layer.out_proj.weight.device
    gen = torch.Generator().manual_seed(1)
    width = cfg.conv_kernel
    conv = (torch.randn(6, 2, width - 1, cfg.conv_dim, generator=gen) * 0.5).to(device)[:, 1]
    ssm = (torch.randn(6, 2, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, generator=gen) * 0.3)
    ssm = ssm.to(device)[:, 1]
    slots = torch.tensor(PASS_SLOTS, device=device)
    sizes = [len(t) for t in PASS_TREES]
    x, y = ((torch.randn(sum(lens), cfg.hidden_size, generator=gen) * 0.5).to(device) for lens in (PASS_LENS, sizes))

    def spans(lens: list[int], verify: bool = False, trees: list[list[int]] | None = None) -> Spans:
        starts = torch.tensor([r.start for r in _rows(lens)], device=device)
        parents = torch.tensor(sum(trees, []), device=device) if trees else None
        bits = torch.cat([ancestor_bits(t) for t in trees]).to(device) if trees else None
        return Spans.build(slots, starts, torch.tensor(lens, device=device), width, verify, parents, bits)

    out = {"x": x, "y": y, "conv before": conv.clone(), "ssm before": ssm.clone()}
    with torch.no_grad():
        out["prefill"], _ = layer.forward_spans(x, conv, ssm, spans(PASS_LENS))
        out["conv"], out["ssm"] = conv, ssm
        out["tree"], tree = layer.forward_spans(y, conv, ssm, spans(sizes, True, PASS_TREES))
        out["chain"], chain = layer.forward_spans(y, conv, ssm, spans(sizes, True))
    return out | {"tree u": tree.u, "tree G": tree.G, "chain u": chain.u, "chain G": chain.G}


def test_a_pass_of_many_requests_is_each_one_alone():
    layer = random_layer(GatedDeltaNetConfig(64, 2, 4, 16, 8))
    got = run_passes(layer)
    for slot, rows, vrows, tree in zip(PASS_SLOTS, _rows(PASS_LENS), _rows([len(t) for t in PASS_TREES]), PASS_TREES):
        with torch.no_grad():
            out, after = layer(got["x"][rows], RecurrentState(got["conv before"][slot], got["ssm before"][slot]))
            tree_out, _ = layer.verify_tree(got["y"][vrows], after, tree)
            chain_out, _ = layer.verify_tree(got["y"][vrows], after, list(range(-1, len(tree) - 1)))
        torch.testing.assert_close(got["prefill"][rows], out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["conv"][slot], after.conv)
        torch.testing.assert_close(got["ssm"][slot], after.ssm, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["tree"][vrows], tree_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["chain"][vrows], chain_out, rtol=1e-4, atol=1e-5)
    others = [s for s in range(6) if s not in PASS_SLOTS]
    assert torch.equal(got["conv"][others], got["conv before"][others])
    assert torch.equal(got["ssm"][others], got["ssm before"][others])


def triton_against_torch(cfg: GatedDeltaNetConfig, device: str, scale: float) -> dict[str, float]:
    """run_passes with the delta rule's Triton kernel against plain torch: per output, the largest error relative
    to its largest magnitude (at least 1)."""
    layer = random_layer(cfg, device, scale)
    layer.backend = "triton"
    got = run_passes(layer)
    layer.backend = "torch"
    want = run_passes(layer)
    return {name: float((got[name] - want[name]).abs().max()) / max(1.0, float(want[name].abs().max()))
            for name in want}


triton_results = interpreter_fixture(__file__)


def test_triton_pass_equals_the_plain_torch_one(triton_results):
    assert max(triton_results.values()) < 1e-5, triton_results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pass_equals_the_plain_torch_one_at_qwen3_next_shapes():
    errors = triton_against_torch(GatedDeltaNetConfig(2048, 16, 32, 128, 128), "cuda", 0.02)
    assert max(errors.values()) < 1e-4, errors


if __name__ == "__main__":
    import json

    print(json.dumps(triton_against_torch(GatedDeltaNetConfig(64, 2, 4, 16, 16), "cpu", 0.3)))
