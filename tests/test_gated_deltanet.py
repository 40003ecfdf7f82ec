"""Our Gated DeltaNet layer (models/gated_deltanet.py) against Hugging Face's Qwen3-Next one with the same
weights: a prompt in one pass and then decode steps carrying the conv and recurrent state equal HF's whole
pass; a prompt split into chunks equals it in one — within fp32 rounding."""

from __future__ import annotations

import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from specpilot.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, RecurrentState

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
