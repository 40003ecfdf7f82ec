"""DFlash drafter training: the training forward equals inference, a tiny run learns, its checkpoint
loads and stays lossless, --resume reproduces an uninterrupted run, and the CLI drives it."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from dataclasses import replace
from statistics import mean
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from spec_fixtures import write_random_dflash
from tiny_models import tiny_hf_model

from specpilot.bench.datasets import load_prompts
from specpilot.cli import main
from specpilot.config import SamplingParams
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.drafters.dflash_model import load_dflash_model, read_dflash_config
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing
from specpilot.models.build import build_model
from specpilot.models.checkpoint import load_checkpoint
from specpilot.models.rope import RotaryTable
from specpilot.models.transformer import DecoderLayer
from specpilot.state.pages import PageTable
from specpilot.state.request import Request
from specpilot.training.data import load_training_prompts
from specpilot.training.train import (
    BEST_FILE,
    LOGIT_BYTES,
    LOGIT_CHUNK_ELEMENTS,
    STATE_FILE,
    VALIDATION_TOPK,
    DraftTrainer,
    LossMix,
    TrainConfig,
    ValidationStats,
    build_target_layer_ids,
    chained_tau,
    default_mask_token_id,
    draft_hidden,
    export_dflash,
    init_draft_model,
    load_initial_weights,
    lm_head_loss,
    logit_chunk_elements,
    published_state_dict,
    slot_sources,
    train_drafter,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_hf_model("qwen3").save_pretrained(path)
    return path


def toy_corpus(n: int, seed: int = 0) -> list[list[int]]:
    """Short prompts ending in a repeated motif: the tiny target's greedy replies fall into loops."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, 300) for _ in range(rng.randint(2, 5))]
        prompts.append([rng.randrange(3, 300) for _ in range(rng.randint(1, 8))] + motif * 3)
    return prompts


def tiny_config(out, target_dir, **overrides) -> TrainConfig:
    settings = {"out": out, "target": str(target_dir), "num_layers": 1, "block_size": 4, "max_new_tokens": 32,
                "max_seq_len": 128, "epochs": 6, "batch_size": 4, "anchors_per_seq": 16, "lr": 3e-3, "device": "cpu"}
    return TrainConfig(**(settings | overrides))


# ---------------------------------------------------------------- training forward == inference


def test_train_forward_matches_inference(target_dir, tmp_path):
    """Logits of every block from one batched training forward (two sequences of different lengths,
    several anchors each) equal DFlashDrafter's inference logits for the same context and block."""
    target = build_model(load_checkpoint(target_dir), CPU, torch.float32)
    target.setup_rope(256)
    B = 5
    path = write_random_dflash(tmp_path / "d", hidden=64, num_target_layers=3, mask_token_id=319, taps=[0, 2],
                               block_size=B)
    cfg = read_dflash_config(path)
    model = load_dflash_model(path, cfg, CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = [23, 17]
    tokens = torch.randint(0, 319, (2, 23), generator=g)
    feats = torch.randn(2, 23, 2 * 64, generator=g)
    feats[1, lengths[1] :] = 0  # padding, as batches carry it
    anchors = torch.tensor([[3, 10, 21], [1, 9, 15]])  # incl. blocks running past the sequence end
    rope = RotaryTable(cfg.layers.head_dim, cfg.layers.rope_theta, None, 128, CPU)
    hidden = draft_hidden(model, target, rope, feats, tokens, anchors, cfg.mask_token_id, B)
    train_logits = target.logits(hidden[:, :, 1:])

    pages = PageTable(1, 64 + cfg.block_size, None, CPU)
    drafter = DFlashDrafter(model, cfg, target, pages, context_length=64, device=CPU, dtype=torch.float32)
    slot = pages.allocate()
    seen = []
    logits = target.logits
    target.logits = lambda h: seen.append(logits(h)) or seen[-1]
    for n in range(2):
        for j, a in enumerate(anchors[n].tolist()):
            req = Request(tokens[n, :a].tolist(), SamplingParams(), output_ids=[int(tokens[n, a])], slot=slot)
            drafter.start([req], [feats[n, :a]])
            drafter.propose([req])
            torch.testing.assert_close(train_logits[n, j], seen[-1], rtol=1e-5, atol=1e-5)

    # and the comparison has teeth: the last context position moves the logits, the anchor's own
    # features (not yet computed at inference) and other blocks' tokens do not
    def logits_with(feats_=feats, tokens_=tokens):
        return target.logits(draft_hidden(model, target, rope, feats_, tokens_, anchors, cfg.mask_token_id, B)[:, :, 1:])

    a = int(anchors[0, 1])
    for pos, moves in ((a - 1, True), (a, False)):
        bumped = feats.clone()
        bumped[0, pos] += 1.0
        diff = (logits_with(feats_=bumped)[0, 1] - train_logits[0, 1]).abs().max()
        assert (diff > 1e-3) if moves else (diff == 0), (pos, float(diff))
    other = tokens.clone()
    other[0, anchors[0, 0]] = (other[0, anchors[0, 0]] + 1) % 319
    assert torch.equal(logits_with(tokens_=other)[0, 1:], train_logits[0, 1:])


def test_draft_model_is_made_of_target_layers_and_exports_what_it_loads(tmp_path):
    """The DFlash model's layers are the target's DecoderLayer (nothing a second layer class could
    drift from), and the export mapping undoes the load mapping: the published tensors come back."""
    path = write_random_dflash(tmp_path / "d", hidden=64, num_target_layers=3, mask_token_id=0)
    cfg = read_dflash_config(path)
    model = load_dflash_model(path, cfg, CPU, torch.float32)
    assert len(model.layers) == cfg.layers.num_layers and all(isinstance(x, DecoderLayer) for x in model.layers)
    raw = load_file(str(path / "model.safetensors"))
    exported = published_state_dict(model, cfg)
    assert exported.keys() == raw.keys() and all(torch.equal(exported[k], raw[k]) for k in raw)


# ---------------------------------------------------------------- defaults


@pytest.mark.parametrize("mix", [LossMix(), LossMix(distill=0.6), LossMix(0.3, rank_weight=0.5, rank_topk=3)],
                         ids=["hard", "distill", "distill+rank"])
def test_chunked_head_loss_equals_whole(mix):
    """Recomputing the logits chunk by chunk in backward changes neither the loss nor its gradients."""
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (13,), generator=g)
    soft_h = torch.randn(13, 8, generator=g) if mix.distill else None
    results = []
    for chunk in (50 * 13 * 3, 50 * 4, 1):
        h = torch.randn(13, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        ce, rank = lm_head_loss(h, head, targets, chunk, soft_h, mix)
        ce.sum().backward()
        results.append((ce.detach(), rank, h.grad))
    for ce, rank, grad in results[1:]:
        torch.testing.assert_close(ce, results[0][0])
        assert torch.equal(rank, results[0][1])
        torch.testing.assert_close(grad, results[0][2])


def test_the_loss_chunks_on_cuda_follow_the_device_not_its_free_memory(monkeypatch):
    """A run and its repeat must cut a batch's rows alike: the chunk size reads the device's total memory, so what
    else the process holds (generated responses, allocator caches) cannot change it."""
    total = 80 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    sizes = set()
    for free in (70 << 30, 52 << 30, 9 << 30):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, total))
        sizes.add(logit_chunk_elements(torch.device("cuda", 0)))
    assert sizes == {total // 4 // LOGIT_BYTES}
    assert logit_chunk_elements(CPU) == LOGIT_CHUNK_ELEMENTS


def test_the_head_loss_ranks_the_target_token_among_the_drafter_s():
    """rank 0: the drafter's top token; r: r tokens score above it."""
    head = torch.eye(5)
    h = torch.tensor([[0.1, 0.9, 0.3, 0.0, 0.5], [0.1, 0.9, 0.3, 0.0, 0.5]])
    _, rank = lm_head_loss(h, head, torch.tensor([1, 2]))
    assert rank.tolist() == [0, 2]


def test_validation_chains_the_top_token_and_a_top_k_tree():
    """One response of 4 anchors, 3 slots each: the chain accepts each anchor's leading top-1 slots, the
    tree its leading top-4 slots; each steps over what it accepted plus the bonus token."""
    ranks = torch.tensor([[[0, 2, 0], [5, 0, 0], [0, 0, 1], [3, 3, 3]]])  # [responses, anchors, slots]
    ok = torch.ones_like(ranks, dtype=torch.bool)
    stats = ValidationStats()
    stats.add(ranks, ok, torch.ones(1, 4, dtype=torch.bool))
    summary = stats.summary()
    # chain: anchor 0 accepts 1 -> next at anchor 2, accepts 2 -> past the end: 2 steps, 5 tokens
    # tree: anchor 0 accepts all 3 -> past the end: 1 step, 4 tokens
    assert (summary["tau"], summary[f"tau_top{VALIDATION_TOPK}"]) == (2.5, 4.0)
    assert summary["accuracy"] == [0.5, 0.5, 0.5]
    assert summary[f"accuracy_top{VALIDATION_TOPK}"] == [0.75, 1.0, 1.0]


def test_distilled_loss_mixes_in_the_target_distribution():
    """distill w: (1 - w) x CE against the tokens + w x CE against softmax(head @ the target's hidden)."""
    g = torch.Generator().manual_seed(2)
    head = torch.randn(30, 6, generator=g)
    h, soft_h = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    targets = torch.randint(0, 30, (5,), generator=g)
    hard, _ = lm_head_loss(h, head, targets)
    mixed, _ = lm_head_loss(h, head, targets, soft_h=soft_h, mix=LossMix(distill=0.25))
    logq = torch.log_softmax(h @ head.T, -1)
    soft = -(torch.softmax(soft_h @ head.T, -1) * logq).sum(-1)
    torch.testing.assert_close(mixed, 0.75 * hard + 0.25 * soft)
    torch.testing.assert_close(lm_head_loss(h, head, targets, soft_h=soft_h, mix=LossMix(distill=1.0))[0], soft)
    torch.testing.assert_close(lm_head_loss(h, head, targets, soft_h=soft_h, mix=LossMix(distill=0.0))[0], hard)


def test_the_rank_term_falls_once_the_token_is_inside_the_tree_s_top_k():
    """rank weight w, top-k: CE + w x softplus(k-th best other logit - the token's). Row 0's token is 2nd of 5
    (inside a top-2, outside a top-1), row 1's 4th; the term's gradient raises the token's logit."""
    head = torch.eye(5)
    h = torch.tensor([[0.1, 0.9, 0.3, 0.0, 0.5], [0.1, 0.9, 0.3, 0.0, 0.5]], requires_grad=True)
    targets = torch.tensor([4, 0])
    hard, _ = lm_head_loss(h, head, targets)
    for k, kth in ((1, torch.tensor([0.9, 0.9])), (2, torch.tensor([0.3, 0.5]))):
        ranked, _ = lm_head_loss(h, head, targets, mix=LossMix(rank_weight=0.5, rank_topk=k))
        expected = hard + 0.5 * torch.nn.functional.softplus(kth - torch.tensor([0.5, 0.1]))
        torch.testing.assert_close(ranked, expected)
    term = lm_head_loss(h, head, targets, mix=LossMix(rank_weight=1.0, rank_topk=2))[0] - hard
    (grad,) = torch.autograd.grad(term.sum(), h)
    assert grad[0, 4] < 0 and grad[1, 0] < 0  # descending the term raises each token's own logit


def test_slot_sources_pick_the_position_before_each_slot():
    final = torch.arange(2 * 7, dtype=torch.float32).view(2, 7, 1)
    anchors = torch.tensor([[0, 3], [5, 1]])
    got = slot_sources(final, anchors, block_size=3)[..., 0]
    assert got.tolist() == [[[0, 1], [3, 4]], [[12, 13], [8, 9]]]  # anchor + k - 1 for k = 1, 2 (clamped at 6)


def test_target_layer_ids_spread_from_1_to_l_minus_3():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(3, 5) == [1]
    assert build_target_layer_ids(36, 1) == [17]


def test_default_mask_token_id():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def tokenizer(vocab: int, **kw) -> PreTrainedTokenizerFast:
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)},
                                                                                 unk_token="w0")), **kw)
        # added special tokens as SmolLM2 has them (ids 20..23); the chat template uses the last two
        tok.add_tokens(["<repo>", "<file>", "<|im_start|>", "<|im_end|>"], special_tokens=True)
        tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
        return tok

    smol_like = tokenizer(20, eos_token="w2")
    assert default_mask_token_id(smol_like, 24) == 21  # the highest added token nothing uses: <file>
    assert default_mask_token_id(smol_like, 32) == 24  # padded embedding rows (Qwen3): the first past the tokenizer
    assert default_mask_token_id(tokenizer(20, mask_token="w7"), 24) == 7
    assert default_mask_token_id(None, 320) == 319


# ---------------------------------------------------------------- a tiny run


@pytest.fixture(scope="module")
def tiny_run(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    prompts = toy_corpus(24)
    report = train_drafter(tiny_config(out, target_dir), prompts, toy_corpus(6, seed=1))
    return out, prompts, report


def test_tiny_run_learns(tiny_run):
    _, _, report = tiny_run
    assert report["finished"] and report["steps"] == report["total_steps"] == 6 * 6
    losses = report["step_losses"]
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.3, losses
    first, last = report["epochs"][0], report["epochs"][-1]
    assert last["accuracy"][0] > first["accuracy"][0] + 0.2 and last["tau_all_anchors"] > 1.5
    validation = report["validation"]
    assert len(validation) == 6 and validation[-1]["tau"] > validation[0]["tau"] + 0.1, validation
    data = report["data"]
    assert data["num_sequences"] == 24 and data["generation_tokens_per_s"] > 0 and not data["reused_cache"]


def test_a_run_continues_an_earlier_drafter(tiny_run, target_dir, tmp_path):
    """--init-from: the run starts from the exported drafter's weights (its losses sit at the trained drafter's
    level, far below a fresh start's) with a fresh schedule; its validation before the first step (the mark to
    beat) is the earlier run's last, and --validate-every 4 validates at steps 4 and 6 (the end), which the
    curves place at 2/3 and 1 epoch."""
    done, prompts, first_report = tiny_run
    report = train_drafter(tiny_config(tmp_path / "again", target_dir, init_from=str(done), epochs=1,
                                       validate_every=4), prompts, toy_corpus(6, seed=1))
    fresh, trained, again = first_report["step_losses"][:6], first_report["step_losses"][-6:], report["step_losses"]
    assert mean(again) < mean(fresh) - 0.3 and abs(mean(again) - mean(trained)) < 0.3, (fresh, trained, again)
    assert report["args"]["init_from"] == str(done)
    assert [v["step"] for v in report["validation"]] == [4, 6] and report["start_validation"]["step"] == 0
    # the export is bf16, the earlier run validated its fp32 weights
    assert report["start_validation"]["tau"] == pytest.approx(first_report["validation"][-1]["tau"], abs=0.1)
    assert first_report["start_validation"] is None
    curves = training_curves_module().curves(report)
    assert curves["epoch"] == [0.667, 1.0] and curves["start"]["tau"] == report["start_validation"]["tau"]
    cfg = read_dflash_config(done)
    model = init_draft_model(cfg, seed=1, device=CPU)
    load_initial_weights(model, cfg, str(done))
    exported = load_dflash_model(done, cfg, CPU, torch.float32).state_dict()
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items())


def test_a_grown_drafter_drafts_what_its_source_did(target_dir, tmp_path):
    """--init-from a smaller drafter: two more layers, a wider MLP and a tap added between the source's two;
    the grown drafter's logits equal the source's for every block until training moves it, whatever the new tap
    carries; the new parts are live (moving an added layer's output projection moves the logits)."""
    target = build_model(load_checkpoint(target_dir), CPU, torch.float32)
    target.setup_rope(256)
    B = 5
    path = write_random_dflash(tmp_path / "d", hidden=64, num_target_layers=3, mask_token_id=319, taps=[0, 2],
                               block_size=B, num_layers=1, intermediate=96)
    have = read_dflash_config(path)
    want = replace(have, layers=replace(have.layers, num_layers=3, intermediate_size=160), target_layer_ids=[0, 1, 2])
    source = load_dflash_model(path, have, CPU, torch.float32)
    grown = init_draft_model(want, seed=3, device=CPU)
    load_initial_weights(grown, want, str(path))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 319, (2, 23), generator=g)
    feats = torch.randn(2, 23, 2 * 64, generator=g)
    middle_tap = torch.randn(2, 23, 64, generator=g)
    grown_feats = torch.cat([feats[..., :64], middle_tap, feats[..., 64:]], dim=-1)
    anchors = torch.tensor([[3, 10, 21], [1, 9, 15]])
    rope = RotaryTable(have.layers.head_dim, have.layers.rope_theta, None, 128, CPU)

    def logits(model, f):
        return target.logits(draft_hidden(model, target, rope, f, tokens, anchors, have.mask_token_id, B)[:, :, 1:])

    expected = logits(source, feats)
    torch.testing.assert_close(logits(grown, grown_feats), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        grown.layers[2].self_attn.o_proj.weight.normal_(0, 0.05, generator=g)
    assert (logits(grown, grown_feats) - expected).abs().max() > 1e-3


def test_a_run_grows_an_earlier_drafter(tiny_run, target_dir, tmp_path):
    """A run of two layers and a wider MLP from the one-layer tiny run: its validation before the first step is the
    earlier drafter's; it trains and exports its own shape."""
    done, prompts, first_report = tiny_run
    report = train_drafter(tiny_config(tmp_path / "grown", target_dir, init_from=str(done), epochs=1, num_layers=2,
                                       intermediate_size=192), prompts, toy_corpus(6, seed=1))
    assert report["start_validation"]["tau"] == pytest.approx(first_report["validation"][-1]["tau"], abs=0.1)
    exported = read_dflash_config(tmp_path / "grown")
    assert (exported.layers.num_layers, exported.layers.intermediate_size) == (2, 192)


def test_init_from_a_drafter_of_other_shapes_names_the_flag(tiny_run, target_dir, tmp_path):
    done, prompts, _ = tiny_run
    with pytest.raises(ValueError, match=r"--init-from .*block_size \(4 against 8\)"):
        train_drafter(tiny_config(tmp_path / "other", target_dir, init_from=str(done), block_size=8), prompts,
                      toy_corpus(6, seed=1))
    assert read_dflash_config(done).target_layer_ids == [1]
    for shape, why in (({"intermediate_size": 64}, r"intermediate_size \(128 against 64: a drafter only grows\)"),
                       ({"target_layer_ids": [0, 2]}, re.escape("[1] not tapped by this run"))):
        with pytest.raises(ValueError, match=r"--init-from .*" + why):
            train_drafter(tiny_config(tmp_path / "smaller", target_dir, init_from=str(done), **shape), prompts)
    with pytest.raises(ValueError, match=r"--init-from .*nowhere.*no config.json"):
        train_drafter(tiny_config(tmp_path / "none", target_dir, init_from=str(tmp_path / "nowhere")), prompts)


def test_distilled_run_learns(target_dir, tmp_path):
    """--distill: the same tiny run with soft labels at weight 0.5 (features carry the target's final
    hidden state) learns as well; validation tau rises."""
    report = train_drafter(tiny_config(tmp_path / "run", target_dir, distill=0.5), toy_corpus(24), toy_corpus(6, seed=1))
    losses, validation = report["step_losses"], report["validation"]
    assert report["finished"] and sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.3, losses
    assert validation[-1]["tau"] > validation[0]["tau"] + 0.1, validation


def test_ranked_run_learns(target_dir, tmp_path):
    """--rank-loss: the tiny run with the ranking term at weight 0.5 learns; validation's tree tau rises."""
    report = train_drafter(tiny_config(tmp_path / "run", target_dir, rank_loss=0.5, rank_topk=2), toy_corpus(24),
                           toy_corpus(6, seed=1))
    losses, validation = report["step_losses"], report["validation"]
    assert report["finished"] and sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.3, losses
    key = f"tau_top{VALIDATION_TOPK}"
    assert validation[-1][key] > validation[0][key] + 0.1, validation


def test_patience_stops_early_and_exports_the_best_validation_s_drafter(tiny_run, target_dir, tmp_path, monkeypatch):
    """Scripted validations (tree tau 1.0, 2.0, 1.5, 2.0): with --patience 2 the run stops after the fourth
    epoch (two in a row fail to beat the second's; a tie does not), exports the drafter as it was at the second
    validation, and a --resume of the stopped run trains no further."""
    source, prompts, _ = tiny_run
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(source / "data.pt", out / "data.pt")  # the tiny run's cached responses
    taus, seen = iter([1.0, 2.0, 1.5, 2.0, 3.0, 3.0]), []

    def scripted(self):
        seen.append({k: v.clone() for k, v in published_state_dict(self.model, self.dcfg).items()})
        tau = next(taus)
        return {"tau": tau, "steps": 1, "accuracy": [], f"tau_top{VALIDATION_TOPK}": tau}

    monkeypatch.setattr(DraftTrainer, "validate", scripted)
    report = train_drafter(tiny_config(out, target_dir, patience=2, validation_prompts=1), prompts, prompts[:1])
    assert report["finished"] and report["stopped_early"] and len(seen) == 4
    assert report["steps"] == 4 * 6 < report["total_steps"] and (report["best_epoch"], report["exported_epoch"]) == (2, 2)
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in seen[1].items())
    assert not all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in seen[3].items())
    assert (out / BEST_FILE).is_file()
    again = train_drafter(tiny_config(out, target_dir, patience=2, validation_prompts=1, resume=True), prompts,
                          prompts[:1])
    assert again["steps"] == 4 * 6 and len(seen) == 4


def test_checkpoint_is_in_the_published_format(tiny_run, target_dir, tmp_path):
    out, _, report = tiny_run
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 319, "target_layer_ids": [1], "block_size": 4}
    tensors = load_file(str(out / "model.safetensors"))
    reference = load_file(str(write_random_dflash(tmp_path / "ref", hidden=64, num_target_layers=3, mask_token_id=0,
                                                  num_layers=1, heads=4, kv_heads=2, head_dim=32, taps=[1])
                              / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in reference.items()}
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    # the fp32 master weights, rounded to bf16, are what inference loads
    dcfg = read_dflash_config(out)
    loaded = load_dflash_model(out, dcfg, CPU, torch.float32).state_dict()
    master = torch.load(out / STATE_FILE, weights_only=True)["model"]
    for name, value in master.items():
        assert torch.equal(loaded[name], value.to(torch.bfloat16).float()), name
    assert json.loads((out / "training.json").read_text())["steps"] == report["steps"]


def spec_engine(target_dir, drafter_dir=None) -> Engine:
    algorithm = None if drafter_dir is None else "dflash"
    return Engine(load_checkpoint(target_dir), EngineConfig(
        device="cpu", max_running_requests=24, context_length=128, speculative_algorithm=algorithm,
        speculative_draft_model_path=None if drafter_dir is None else str(drafter_dir)))


def test_trained_drafter_is_lossless_and_beats_random(tiny_run, target_dir, tmp_path):
    out, prompts, _ = tiny_run
    params = SamplingParams(max_new_tokens=32)
    verdict = run_forcing(spec_engine(target_dir), spec_engine(target_dir, out), prompts[:6], params, "dflash")
    assert verdict.passed, verdict.as_dict()

    random_dir = tmp_path / "random"
    random_dir.mkdir()
    dcfg = read_dflash_config(out)
    export_dflash(init_draft_model(dcfg, seed=1, device=CPU), dcfg, 3, random_dir)
    taus = {}
    for name, path in (("trained", out), ("random", random_dir)):
        engine = spec_engine(target_dir, path)
        engine.generate(prompts, params)
        taus[name] = engine.spec_stats.tau
    assert taus["trained"] > taus["random"] + 0.4, taus


@pytest.mark.parametrize("cache_features", [False, True])
def test_resume_reproduces_an_uninterrupted_run(tiny_run, target_dir, tmp_path, cache_features):
    source, prompts, _ = tiny_run
    whole, split = tmp_path / "whole", tmp_path / "split"
    for out in (whole, split):  # same prompts as the tiny run: its cached responses are reused
        out.mkdir()
        shutil.copy(source / "data.pt", out / "data.pt")
    settings = {"epochs": 2, "save_every": 2, "cache_features": cache_features}
    train_drafter(tiny_config(whole, target_dir, **settings), prompts)

    first = train_drafter(tiny_config(split, target_dir, stop_after=5, **settings), prompts)
    assert not first["finished"] and first["steps"] == 5 and first["data"]["reused_cache"]
    assert not (split / "model.safetensors").exists()
    with pytest.raises(ValueError, match="--resume"):
        train_drafter(tiny_config(split, target_dir, **settings), prompts)
    with pytest.raises(ValueError, match="lr"):
        train_drafter(tiny_config(split, target_dir, resume=True, **(settings | {"lr": 1e-3})), prompts)
    second = train_drafter(tiny_config(split, target_dir, resume=True, **settings), prompts)
    assert second["finished"] and second["steps"] == 12 and len(second["step_losses"]) == 12

    assert (whole / "model.safetensors").read_bytes() == (split / "model.safetensors").read_bytes()
    a, b = (torch.load(d / STATE_FILE, weights_only=True) for d in (whole, split))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["step_losses"] == b["step_losses"]


def test_sigterm_ends_a_slice_after_its_step_and_the_resumed_run_equals_an_uninterrupted_one(
        tiny_run, target_dir, tmp_path, monkeypatch):
    """`timeout` ends a slice with SIGTERM: the trainer finishes the step under way, saves its state and writes
    training.json (unfinished), restores the signal's handler, and --resume completes the same run."""
    source, prompts, _ = tiny_run
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out in (whole, cut):
        out.mkdir()
        shutil.copy(source / "data.pt", out / "data.pt")
    settings = {"epochs": 1, "save_every": 100}
    train_drafter(tiny_config(whole, target_dir, **settings), prompts)

    step = DraftTrainer.train_step

    def step_then_term(self):
        step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        m.setattr(DraftTrainer, "train_step", step_then_term)
        first = train_drafter(tiny_config(cut, target_dir, **settings), prompts)
    assert not first["finished"] and first["steps"] == 2 and signal.getsignal(signal.SIGTERM) is handler
    assert json.loads((cut / "training.json").read_text())["steps"] == 2
    second = train_drafter(tiny_config(cut, target_dir, resume=True, **settings), prompts)
    assert second["finished"] and second["step_losses"] == json.loads((whole / "training.json").read_text())[
        "step_losses"]
    assert (whole / "model.safetensors").read_bytes() == (cut / "model.safetensors").read_bytes()


class _BytesTokenizer:
    """Encodes text as its UTF-8 bytes, so distinct prompts stay distinct (no chat template)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_validation_prompts_follow_the_training_prompts():
    tokenizer = _BytesTokenizer()
    alone, none = load_training_prompts(tokenizer, ["math", "code"], 10)
    train, held_out = load_training_prompts(tokenizer, ["math", "code"], 10, 4)
    assert train == alone and none == [] and len(held_out) == 4
    assert not {tuple(p) for p in held_out} & {tuple(p) for p in train}


def test_validation_prompts_survive_asking_for_more_prompts_than_the_sets_hold():
    """More --num-prompts than every set holds: each keeps its last ones for validation instead of training on
    everything and validating on nothing. Where one set still has prompts left, the split is as before."""
    tokenizer = _BytesTokenizer()
    everything, none = load_training_prompts(tokenizer, ["math", "code"], 10**6)
    train, held_out = load_training_prompts(tokenizer, ["math", "code"], 10**6, 4)
    assert none == [] and len(held_out) == 4 and len(train) == len(everything) - 4
    assert not {tuple(p) for p in held_out} & {tuple(p) for p in train}
    code_runs_out = 2 * (len(load_prompts("code", split="train", seed=0)) + 100)  # math holds more than code
    alone, _ = load_training_prompts(tokenizer, ["math", "code"], code_runs_out)
    train, held_out = load_training_prompts(tokenizer, ["math", "code"], code_runs_out, 4)
    assert train == alone and len(held_out) == 2  # math's next ones; code has none left


def test_validation_passes_over_the_conversations_training_takes_from(tmp_path, monkeypatch):
    """ShareGPT's opening turns and later turns share conversations: a validation prompt never comes from one a
    training prompt came from, whichever of the two sets either is in."""
    import re

    from specpilot.bench import datasets

    conversations = []
    for c in range(40):
        opening = next(t for t in (f"c{c}: open {i}" for i in range(1000)) if not datasets.is_held_out(t))
        turns = [("human", opening), ("gpt", "ok"), ("human", f"c{c}: second"), ("gpt", "ok"), ("human", f"c{c}: third")]
        conversations.append({"id": f"id{c}", "conversations": [{"from": w, "value": t} for w, t in turns]})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(conversations))
    monkeypatch.setenv(datasets.SHAREGPT_PATH_ENV, str(path))
    train, held_out = load_training_prompts(_BytesTokenizer(), ["sharegpt", "sharegpt-turns"], 20, 10)
    assert len(train) == 20 and len(held_out) == 10

    def tags(prompts):
        return {tag for p in prompts for tag in re.findall(r"c\d+:", bytes(p).decode())}

    assert tags(train) and tags(held_out) and not tags(train) & tags(held_out)


def test_chained_tau_steps_like_decoding():
    # anchor 0 accepts 2 (commits 3), anchor 3 accepts 0, anchor 4 accepts 3 (past the end: stops)
    assert chained_tau([2, 9, 9, 0, 3, 9]) == (3, 3 + 1 + 4)
    assert chained_tau([]) == (0, 0)


def test_validation_tau_matches_the_engine(tiny_run, target_dir):
    """The per-epoch validation tau is the tau the engine measures on the same held-out prompts."""
    out, _, report = tiny_run
    engine = spec_engine(target_dir, out)
    engine.generate(toy_corpus(6, seed=1), SamplingParams(max_new_tokens=32))
    assert report["validation"][-1]["tau"] == pytest.approx(engine.spec_stats.tau, abs=0.05)


# ---------------------------------------------------------------- the command line


def test_cli_trains_on_dataset_prompts(tiny_dir, tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(["train-drafter", "--target", str(tiny_dir), "--out", str(out), "--datasets", "math",
                 "--num-prompts", "4", "--validation-prompts", "2", "--max-new-tokens", "6", "--num-layers", "2",
                 "--intermediate-size", "48", "--block-size", "3", "--target-layer-ids", "0", "1", "--epochs", "1",
                 "--batch-size", "2", "--device", "cpu"]) == 0
    assert "validation tau" in capsys.readouterr().out
    report = json.loads((out / "training.json").read_text())
    assert report["data"]["num_sequences"] == 4 and report["steps"] == 2 and len(report["validation"]) == 1
    assert report["args"]["datasets"] == ["math"] and report["draft"]["target_layer_ids"] == [0, 1]
    dcfg = read_dflash_config(out)
    assert dcfg.block_size == 3 and dcfg.layers.num_layers == 2 and dcfg.layers.intermediate_size == 48
    assert load_file(str(out / "model.safetensors"))["layers.1.mlp.gate_proj.weight"].shape[0] == 48


@pytest.mark.parametrize("argv,message", [
    (["--block-size", "1"], "--block-size"),
    (["--dtype", "float16"], "--dtype"),
    (["--resume"], "--resume"),
    (["--mask-token-id", "100000"], "--mask-token-id"),
    (["--distill", "1.5"], "--distill"),
    (["--rank-loss", "-1"], "--rank-loss"),
    (["--responses-per-prompt", "2", "--response-temperature", "0"], "--response-temperature"),
    (["--patience", "2", "--validation-prompts", "0"], "--patience"),
    (["--validate-every", "5", "--validation-prompts", "0"], "--validate-every"),
])
def test_cli_errors_name_the_flag(tiny_dir, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["train-drafter", "--target", str(tiny_dir), "--out", str(tmp_path / "d"), "--device", "cpu",
              "--datasets", "math", "--num-prompts", "2", "--max-new-tokens", "4", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def training_curves_module():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import training_curves

    return training_curves


def test_training_curves_chart_runs_side_by_side(tiny_run, tmp_path, capsys):
    """benchmarks/training_curves.py: each run's validation taus per epoch and its smoothed loss, in a PNG and
    a JSON; a directory without a training.json is refused by name."""
    training_curves = training_curves_module()
    out, _, report = tiny_run
    training_curves.main([f"hard={out}", f"again={out}", "--out", str(tmp_path)])
    assert (tmp_path / "training_curves.png").stat().st_size > 0
    runs = json.loads((tmp_path / "training_curves.json").read_text())
    assert list(runs) == ["hard", "again"]
    assert runs["hard"]["tau"] == [v["tau"] for v in report["validation"]] and len(runs["hard"]["tree_tau"]) == 6
    assert runs["hard"]["best_epoch"] == report["best_epoch"] and runs["hard"]["loss"]
    assert runs["hard"]["epoch"] == [1, 2, 3, 4, 5, 6] and runs["hard"]["start"] is None
    with pytest.raises(SystemExit):
        training_curves.main([f"missing={tmp_path / 'nowhere'}", "--out", str(tmp_path)])
    assert "training.json does not exist" in capsys.readouterr().err


def test_more_responses_per_prompt_sample_past_the_greedy_one(target_dir, tmp_path):
    """--responses-per-prompt 3: each prompt's greedy response and two sampled ones (seeded, so a second
    generation repeats them); the cache records the setting, so a greedy-only run refuses it."""
    prompts = toy_corpus(4, seed=3)
    settings = dict(epochs=1, responses_per_prompt=3, response_temperature=1.5, validation_prompts=0)
    first = train_drafter(tiny_config(tmp_path / "a", target_dir, **settings), prompts)
    again = train_drafter(tiny_config(tmp_path / "b", target_dir, **settings), prompts)
    assert first["data"]["num_sequences"] == again["data"]["num_sequences"] == 12
    a, b = (torch.load(tmp_path / d / "data.pt", weights_only=True) for d in ("a", "b"))
    assert torch.equal(a["tokens"], b["tokens"]) and a["meta"]["responses_per_prompt"] == 3
    seqs = a["tokens"].split(a["lengths"].tolist())
    greedy = train_drafter(tiny_config(tmp_path / "g", target_dir, epochs=1, validation_prompts=0), prompts)
    g = torch.load(tmp_path / "g" / "data.pt", weights_only=True)
    assert greedy["data"]["num_sequences"] == 4 and "responses_per_prompt" not in g["meta"]
    assert [s.tolist() for s in g["tokens"].split(g["lengths"].tolist())] == [seqs[i].tolist() for i in (0, 3, 6, 9)]
    assert any(not torch.equal(seqs[3 * i], seqs[3 * i + k]) for i in range(4) for k in (1, 2))
    (tmp_path / "c").mkdir()
    shutil.copy(tmp_path / "a" / "data.pt", tmp_path / "c" / "data.pt")
    with pytest.raises(ValueError, match="different settings"):
        train_drafter(tiny_config(tmp_path / "c", target_dir, epochs=1, validation_prompts=0), prompts)


def test_cached_responses_are_stored_in_16_bits_and_older_int32_caches_still_load(target_dir, tmp_path):
    """data.pt keeps token ids in 16 bits where the vocabulary fits (half the bytes: a cache small enough to carry
    between device sessions); reading gives int32 either way, and a cache written in int32 is reused as it is."""
    prompts = toy_corpus(3, seed=5)
    config = tiny_config(tmp_path / "a", target_dir, epochs=1, validation_prompts=0)
    first = train_drafter(config, prompts)
    stored = torch.load(tmp_path / "a" / "data.pt", weights_only=True)
    assert stored["tokens"].dtype == torch.uint16
    legacy = stored | {"tokens": stored["tokens"].to(torch.int32)}
    (tmp_path / "b").mkdir()
    torch.save(legacy, tmp_path / "b" / "data.pt")
    again = train_drafter(tiny_config(tmp_path / "b", target_dir, epochs=1, validation_prompts=0), prompts)
    assert again["data"]["reused_cache"] and again["data"]["num_sequences"] == first["data"]["num_sequences"]
    assert again["step_losses"] == first["step_losses"]  # the same sequences, read back as int32


def test_a_cut_generation_resumes_at_its_first_missing_part(target_dir, tmp_path, monkeypatch):
    """Responses are saved GENERATION_PART prompts at a time: a generation that dies in its second part keeps the
    first, a rerun generates only the rest, and the data equal an uncut run's (sampled responses too: their seeds
    count the prompts across parts); the parts go once data.pt is written."""
    from rich.progress import Progress

    from specpilot.training import data as training_data
    from specpilot.training.train import target_engine

    monkeypatch.setattr(training_data, "GENERATION_PART", 2)
    engine = target_engine(tiny_config(tmp_path, target_dir, max_new_tokens=8))
    prompts, responses = toy_corpus(5, seed=7), training_data.Responses(per_prompt=2)
    meta = {"prompts": training_data.prompts_digest(prompts)}

    def load(out):
        return training_data.load_or_generate(out, meta, engine, prompts, 8, Progress(disable=True),
                                              responses=responses)

    whole, whole_stats = load(tmp_path / "whole")
    calls, real, dies_at = [], training_data.generate_responses, [2]

    def dies_in_part_two(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == dies_at[0]:
            raise RuntimeError("deadline")  # a deadline's signal ends the process here
        return real(*args, **kwargs)

    monkeypatch.setattr(training_data, "generate_responses", dies_in_part_two)
    with pytest.raises(RuntimeError, match="deadline"):
        load(tmp_path / "cut")
    assert sorted(p.name for p in (tmp_path / "cut" / "data.parts").iterdir()) == ["0.pt"]
    calls.clear()
    dies_at[0] = 0
    again, stats = load(tmp_path / "cut")
    assert calls == [prompts[2:4], prompts[4:]]  # part 1 read back, not regenerated
    assert [(a.tokens.tolist(), a.prompt_len) for a in again] == [(w.tokens.tolist(), w.prompt_len) for w in whole]
    assert stats.num_sequences == whole_stats.num_sequences and not stats.reused_cache
    assert not (tmp_path / "cut" / "data.parts").exists() and (tmp_path / "cut" / "data.pt").is_file()
    assert load(tmp_path / "cut")[1].reused_cache


def test_the_fused_hard_loss_is_the_plain_cross_entropy_and_its_gradient():
    """The recipe's hard labels run through the fused path (logits in the head's dtype, the gradient kept from
    the forward): the same loss, ranks and gradient as torch's cross-entropy through autograd, chunked or not,
    as the fp32 path, and no gradient kept under no_grad (validation)."""
    g = torch.Generator().manual_seed(3)
    head = torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (11,), generator=g)
    h0 = torch.randn(11, 8, generator=g)
    h = h0.clone().requires_grad_(True)
    logits = h @ head.T
    want = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    weights = torch.rand(11, generator=g)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), h)
    want_rank = (logits > logits.gather(1, targets[:, None])).sum(1)
    for chunk, fused in ((40 * 11, True), (40 * 3, True), (40 * 3, False)):  # False: the fp32 path
        h = h0.clone().requires_grad_(True)
        ce, rank = lm_head_loss(h, head, targets, chunk, fused=fused)
        (grad,) = torch.autograd.grad((ce * weights).sum(), h)
        torch.testing.assert_close(ce, want.detach())
        assert torch.equal(rank, want_rank)
        torch.testing.assert_close(grad, want_grad)
    with torch.no_grad():
        ce, _ = lm_head_loss(h0, head, targets)
    assert not ce.requires_grad


def test_an_earlier_runs_greedy_responses_are_reused_for_the_prompts_it_holds(target_dir, tmp_path, monkeypatch):
    """--reuse-responses: a run over a changed prompt list takes the earlier run's responses of the prompts both
    hold and generates only the new ones; its data equal a fresh generation's, in the new list's order, and a
    file made with other settings (here --max-new-tokens) is refused, as is one that does not exist."""
    from specpilot.training import data as training_data

    first, more = toy_corpus(4, seed=11), toy_corpus(3, seed=12)
    train_drafter(tiny_config(tmp_path / "a", target_dir, epochs=1, validation_prompts=0), first)
    prompts = [first[2], more[0], first[0], more[1], first[3], more[2]]
    fresh = train_drafter(tiny_config(tmp_path / "fresh", target_dir, epochs=1, validation_prompts=0), prompts)
    generated, real = [], training_data.generate_responses

    def counting(engine, chunk, *args):
        generated.append(sum(training_data.prompt_key(p) not in args[-1] for p in chunk))  # args[-1]: known
        return real(engine, chunk, *args)

    monkeypatch.setattr(training_data, "generate_responses", counting)
    reused = train_drafter(tiny_config(tmp_path / "b", target_dir, epochs=1, validation_prompts=0,
                                       reuse_responses=tmp_path / "a" / "data.pt"), prompts)
    assert generated == [3] and reused["data"]["reused_responses"] == 3 and fresh["data"]["reused_responses"] == 0
    a, b = (torch.load(tmp_path / d / "data.pt", weights_only=True) for d in ("fresh", "b"))
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["prompt_lens"], b["prompt_lens"])
    assert reused["step_losses"] == fresh["step_losses"] and reused["args"]["reuse_responses"].endswith("data.pt")
    with pytest.raises(ValueError, match="other settings"):
        train_drafter(tiny_config(tmp_path / "c", target_dir, epochs=1, validation_prompts=0, max_new_tokens=5,
                                  reuse_responses=tmp_path / "a" / "data.pt"), prompts)
    with pytest.raises(ValueError, match="--reuse-responses"):
        tiny_config(tmp_path / "d", target_dir, reuse_responses=tmp_path / "nowhere.pt")
