"""The plugin's drafting (specpilot/sglang_ext/session.py) beside a target another engine runs: here
transformers' own SmolLM2 (fp32, the embedded model) stands where SGLang's model runner does in the worker,
handing over what SGLang hands over - a prefill's taps (in chunks), the verify pass's logits and taps of the
laid-out block (specpilot.sglang_ext.layout: its positions and custom mask) - and the worker's acceptance
(accept.row_decisions, the verifier's walk). The shipped DFlash drafter must then draft as well as it does in
our own engine (its context written at the right positions), and the output must be the target's greedy one.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from specpilot.bench.datasets import apply_chat_template, load_prompts
from specpilot.config import SamplingParams
from specpilot.drafters import EMBEDDED_DRAFTER
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.verify import Verifier
from specpilot.sglang_ext.accept import row_decisions
from specpilot.sglang_ext.layout import verify_tensors
from specpilot.sglang_ext.session import DraftSession, TargetHead
from specpilot.state.graphs import GraphBackend, eager_capture

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def sglang_ids(ids: list[int]) -> array:
    """Token ids as SGLang's Req holds them (origin_input_ids, output_ids)."""
    return array("q", ids)


@pytest.fixture(scope="module")
def target(embedded_checkpoint) -> Engine:
    """Our engine of the embedded model, no drafter: the prompts' tokenizer, and the weights engine_tau's
    engines share (one build for the module)."""
    return Engine(embedded_checkpoint, EngineConfig(device="cpu", max_running_requests=2, context_length=512))


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [apply_chat_template(target.tokenizer, p) for p in load_prompts("humaneval", 2)]


@pytest.fixture(scope="module")
def targets_greedy(hf_smollm, prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: what every session's output must be (made once)."""
    with torch.no_grad():
        return [hf_smollm.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _pass(model, tokens: list[int], positions: list[int], mask: torch.Tensor,
          taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, taps) of every row: the target's pass as SGLang's runner gives it (hidden states of the
    outputs of layers `taps`, concatenated)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), attention_mask=mask[None, None], position_ids=torch.tensor([positions]),
                    output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in taps], -1)


def _drive(model, session: DraftSession, prompts: list[list[int]], chunk: int,
           max_steps: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Prefill (in chunks of `chunk` tokens), then verify the session's drafts until NEW_TOKENS each (or for
    `max_steps` verify steps). Returns the outputs and the tokens each verify committed."""
    taps = session.tap_layers
    rids = [f"r{i}" for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        logits, prompt_taps = _pass(model, prompt, list(range(n)), torch.ones(n, n, dtype=torch.bool).tril(), taps)
        outputs[i].append(int(logits[-1].argmax()))
        for start in range(0, n, chunk):  # SGLang's chunked prefill: a chunk's taps from its first position
            end = min(start + chunk, n)
            session.prefill([rids[i]], [sglang_ids(prompt)], [sglang_ids(outputs[i][:1] if end == n else [])],
                            [start], [end - start], prompt_taps[start:end], [n + NEW_TOKENS + 16])
    committed: list[int] = []
    steps = 0
    while min(len(o) for o in outputs) < NEW_TOKENS and steps != max_steps:
        steps += 1
        draft = session.propose(rids, [sglang_ids(p) for p in prompts], [sglang_ids(o) for o in outputs],
                                [len(p) + NEW_TOKENS + 16 for p in prompts])
        seq_lens = torch.tensor([len(p) + len(o) - 1 for p, o in zip(prompts, outputs)])
        newest = torch.tensor([o[-1] for o in outputs])
        layout = verify_tensors(newest, draft.tokens, draft.tree, seq_lens)
        bs, d = layout.retrieve_index.shape
        block = layout.custom_mask.view(bs, d, d)
        rows, row_taps = [], []
        for b, (prompt, output) in enumerate(zip(prompts, outputs)):
            ctx = int(seq_lens[b])
            mask = torch.ones(ctx + d, ctx + d, dtype=torch.bool).tril()
            mask[ctx:, ctx:] = block[b]
            tokens = prompt + output[:-1] + layout.draft_token.view(bs, d)[b].tolist()
            positions = list(range(ctx)) + layout.positions.view(bs, d)[b].tolist()
            logits, t = _pass(model, tokens, positions, mask, taps)
            rows.append(logits[ctx:])
            row_taps.append(t[ctx:])
        depths = layout.positions.view(bs, d) - seq_lens[:, None]
        decisions = row_decisions(torch.cat(rows), [GREEDY] * bs, [0] * bs,
                                  torch.tensor([len(o) for o in outputs]), depths)
        accepted = Verifier().greedy(decisions, draft.tokens, seq_lens, draft.tree)
        for output, new in zip(outputs, session.commit(rids, accepted, torch.cat(row_taps))):
            output.extend(new)
            committed.append(len(new))
    return [o[:NEW_TOKENS] for o in outputs], committed


@pytest.fixture(scope="module")
def engine_tau(target, prompts):
    """Mean tokens per verify of our own engine with the same drafter on the same prompts, by tree top-k."""
    taus: dict[tuple[int, int], float] = {}

    def tau(topk: int, assist: int = 0) -> float:
        if (topk, assist) not in taus:
            engine = Engine(target.checkpoint, EngineConfig(device="cpu", max_running_requests=2, context_length=512,
                                                            speculative_algorithm="dflash",
                                                            speculative_num_draft_tokens=16,
                                                            speculative_eagle_topk=topk,
                                                            speculative_ngram_assist=assist), model=target.model)
            lengths = [n for r in engine.generate(prompts, GREEDY) for n in r.accept_lengths]
            taus[topk, assist] = sum(lengths) / len(lengths)
        return taus[topk, assist]

    return tau


def _session(model, topk: int, assist: int = 0) -> DraftSession:
    return DraftSession.load(EMBEDDED_DRAFTER, TargetHead.of_causal_lm(model), max_requests=2, context_length=512,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=16, topk=topk,
                             ngram_assist=assist)


@pytest.mark.parametrize("topk,assist", [(1, 0), (4, 0), (4, 2)], ids=["chain", "tree", "tree+assist"])
def test_session_drafts_as_in_our_engine_and_output_is_the_targets(hf_smollm, prompts, targets_greedy, engine_tau,
                                                                    topk: int, assist: int) -> None:
    """Tree + assist is the plugin's default (prompt lookup on the device, synced from SGLang's token lists)."""
    session = _session(hf_smollm, topk, assist)
    outputs, committed = _drive(hf_smollm, session, prompts, chunk=37)
    assert outputs == targets_greedy
    tau = sum(committed) / len(committed)
    # a context written at the wrong positions (or from the wrong rows) drafts near-random tokens: tau ~1
    assert tau >= 0.85 * engine_tau(topk, assist), tau
    assert tau > 1.5


@pytest.mark.parametrize("topk,assist", [(1, 0), (4, 2)], ids=["chain", "tree+assist"])
def test_the_drafters_graphs_draft_as_its_eager_passes(hf_smollm, prompts, monkeypatch, topk: int,
                                                        assist: int) -> None:
    """The drafter's graphs as the worker captures them (on CPU, each replay reruns the captured pass into its
    static outputs: the graph path's plumbing - buckets, padding rows on the scratch slot, outputs overwritten
    by the next replay): drafts, and so every verify's acceptance, are the eager session's, step by step."""
    eager = _session(hf_smollm, topk, assist)
    eager.drafter.warm(4)
    monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
    graphed = _session(hf_smollm, topk, assist)
    graphed.drafter.capture((1, 4), {})  # two requests: a bucket of 4, two padding rows
    assert set(graphed.dflash.graphs) == {1, 4}
    assert _drive(hf_smollm, graphed, prompts, chunk=37) == _drive(hf_smollm, eager, prompts, chunk=37)


def test_slots_and_pages_go_back_and_the_least_recent_requests_yield_theirs(hf_smollm) -> None:
    session = DraftSession.load(EMBEDDED_DRAFTER, TargetHead.of_causal_lm(hf_smollm), max_requests=1,
                                context_length=1024, device=torch.device("cpu"), dtype=torch.float32,
                                block_size=4, topk=1, ngram_assist=0, pool_tokens=1024)
    slots, page = session.pages.num_slots, session.pages.page_size
    width = len(session.tap_layers) * hf_smollm.config.hidden_size

    def prefill(rid: str, reach: int) -> None:
        session.prefill([rid], [[1, 2, 3]], [[4]], [0], [3], torch.zeros(3, width), [reach])

    for i in range(slots + 2):  # short requests: slots run out first
        prefill(f"r{i}", page)
    assert list(session.requests) == [f"r{i}" for i in range(2, slots + 2)]
    session.release("r2")
    assert session.pages.num_free == 1 and "r2" not in session.requests
    prefill("long", session.pages.max_len)  # the whole pool: every other request gives its pages up
    assert list(session.requests) == ["long"] and session.pages.free_pages == 0
    with pytest.raises(RuntimeError, match="KV cache full"):  # a request of this very step keeps its pages
        session.propose(["long", "new"], [[1, 2, 3]] * 2, [[4]] * 2, [session.pages.max_len, page])


def test_a_chunked_prefill_written_from_position_0_fails_the_acceptance_check(hf_smollm, prompts, engine_tau,
                                                                           monkeypatch) -> None:
    """The check above has teeth: a session that writes every prefill chunk's context from position 0 (the
    chunks overwrite each other) drafts from a scrambled context, and its acceptance falls far below (over its
    first 8 verify steps: at tau ~1 the whole 24 tokens take three times the good session's steps)."""
    session = _session(hf_smollm, 1)
    write = session.dflash.extend_context
    monkeypatch.setattr(session.dflash, "extend_context",
                        lambda reqs, taps, starts: write(reqs, taps, [0] * len(starts)))
    _, committed = _drive(hf_smollm, session, prompts, chunk=37, max_steps=8)
    tau = sum(committed) / len(committed)
    assert tau < 0.85 * engine_tau(1), tau
