"""One speculative step, as stages: propose → plan → verify → accept → commit → prepare.

- **propose**: the drafter's draft for every running request (a chain or a tree per request; a draft
  launched early by the previous step is finished here).
- **plan**: lays the verify pass out: a graph's static inputs (filled from the host, or kept where the
  previous step's acceptance graph laid them out on the device), the drafts and trees written into them.
  This stage alone writes the runner's graph inputs.
- **verify**: one target pass over every request's block.
- **accept**: the tokens each request commits and the verify rows that decided them: on the device for
  greedy batches (`device-acceptance`), else the verifier's walk on the host (any sampling). Where
  `early-launch` is on, the drafter starts the next draft before the host reads the result.
- **commit**: appends the tokens (token forcing sees them first), records statistics.
- **prepare**: hands the committed rows to the drafter (unless it launched early) and records which
  requests' next verify inputs the device already laid out (`layout-ahead`).

The mechanisms in effect (engine/registry.py) are properties of these stages; with none (`stock`) the
step is propose → plan → verify → host walk → commit. Verify widths are per request (a drafter may
propose fewer tokens for some requests); device acceptance and the graphs per width take uniform widths,
so a ragged step runs eagerly, or under `ragged` through a graph per (batch, total rows) bucket, and accepts
greedy chains on the device (eagerly, gathered to the widest width), anything else on the host.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, cached_property
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from specpilot.engine.grammar import constrain
from specpilot.engine.sampling import keyed_sample_rows, suppress
from specpilot.engine.spec_stats import StepClock
from specpilot.engine.verify import draft_children
from specpilot.kernels.softmax_topk import row_argmax
from specpilot.kernels.step_layout import lay_out_next_verify
from specpilot.models.runner import Graph, RunOutput
from specpilot.state.batch import ForwardBatch
from specpilot.state.draft import Accepted, Decision, Draft
from specpilot.state.graphs import CapturedPass, EagerReplay, GraphBackend
from specpilot.state.request import Request
from specpilot.state.transfer import HostCopy, to_device
from specpilot.state.tree import TreeLayout

if TYPE_CHECKING:
    from specpilot.engine.engine import Engine


@dataclass
class VerifyPlan:
    reqs: list[Request]
    draft: Draft
    widths: list[int] | None  # verify rows per request: its newest token and its drafts (None: until `settle`)
    batch: ForwardBatch  # what the verify pass runs (a graph's static batch, padding rows included)
    graph: Graph | None = None  # None: an eager pass
    # constrained requests: the drafts' tokens and tree parents on the host, read before the verify is
    # launched so their grammar masks are made while it runs
    host_drafts: tuple[list[list[int]], list[list[int]] | None] | None = None

    def settle(self, widths: list[int]) -> None:
        """The widths level 1 chose on the device, once the host has them (after the verify)."""
        self.widths = widths

    @cached_property
    def offsets(self) -> list[int]:
        """Request i's verify rows are offsets[i] : offsets[i + 1]."""
        return [0, *accumulate(self.widths)]

    @cached_property
    def uniform(self) -> bool:
        """Every request verifies as many rows (what graphs and device acceptance take)."""
        return len(set(self.widths)) == 1

    @cached_property
    def constrained(self) -> list[int]:
        """The requests with a grammar, by index (most steps have none: their grammar work is skipped whole)."""
        return [i for i, r in enumerate(self.reqs) if r.grammar is not None]


@dataclass
class Acceptance:
    decisions: list[Decision]
    taps: torch.Tensor | None  # the verify taps, each request's accepted rows first (trees reordered)
    launched: bool = False  # the drafter launched the next draft from the device's acceptance
    graphed: bool = False  # the acceptance graph ran (it laid out the next verify of the same requests)
    corrected: bool = False  # a grammar checked after acceptance cut some request's tokens short


@dataclass
class Commits:
    committed: list[int]  # tokens appended per request
    finished: list[Request]
    redraft: bool  # token forcing committed other tokens than accepted: a launched draft no longer fits


@dataclass
class _LaidOut:
    """The next verify of these requests is laid out in their bucket's static inputs (until a host fill)."""

    rids: list[str]
    q: int  # rows per request
    bucket: int
    fills: int


@dataclass
class _AcceptanceGraph:
    graph: CapturedPass | EagerReplay  # outputs: (Accepted, taps in accepted order, packed values)
    batch: ForwardBatch  # the static batch of the verify graph it follows
    host: torch.Tensor  # pinned: where the graph copies the packed values the host reads


class SpeculativeStep:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner, self.cache, self.device = engine.runner, engine.cache, engine.device
        self.mechanisms = engine.mechanisms
        self.acceptance: dict[tuple[int, int], _AcceptanceGraph] = {}  # a verify graph's (q, bucket) -> its acceptance graph
        self.placement: dict[int, CapturedPass | EagerReplay] = {}  # bucket -> lays the drafter's static tree in
        self._laid_out: _LaidOut | None = None

    def __call__(self, reqs: list[Request]) -> list[Request]:
        clock, start = StepClock(self.device), time.perf_counter()
        draft = self.propose(reqs)
        clock.mark()
        plan = self.plan(reqs, draft)
        out = self.verify(plan)
        acceptance = self.accept(plan, out, clock)
        clock.synced()
        if self.engine.verify_lengths is not None:
            self.engine.verify_lengths.learn([d.rows for d in acceptance.decisions])
        commits = self.commit(plan, out, acceptance)
        self.prepare(plan, acceptance, commits)
        self.engine.retire(commits.finished)
        clock.done()
        self.engine.spec_stats.add_clock(clock)
        if self.engine.verify_lengths is not None:
            self.engine.verify_lengths.observe(1e3 * (time.perf_counter() - start), len(plan.widths), plan.offsets[-1])
        return commits.finished

    # ---- stages -------------------------------------------------------------------------------
    def propose(self, reqs: list[Request]) -> Draft:
        return self.engine.drafter.propose(reqs)

    def plan(self, reqs: list[Request], draft: Draft) -> VerifyPlan:
        if self.engine.verify_lengths is not None:
            draft = self._level_one(reqs, draft)
        plan = self._plan(reqs, draft)
        if plan.widths is not None and any(not self._checked_after(reqs[i]) for i in plan.constrained):
            plan.host_drafts = (draft.tokens.tolist(),
                                draft.tree.parents.tolist() if draft.tree is not None else None)
        return plan

    def _level_one(self, reqs: list[Request], draft: Draft) -> Draft:
        """`two-level`: the drafts worth verifying. Under graphs of one width per pass, that width for all, chosen
        without waiting for the draft (`VerifyLengths.choose_ahead`; a tree keeps the subtree the device picks);
        else, from the draft's confidences on the host, a chain's per request (ragged: eager passes, or `ragged`
        graphs) and a tree's as a subtree of one width for all."""
        n, k = len(reqs), draft.tokens.shape[1]
        chooser = self.engine.verify_lengths
        widths = [q for q in self.runner.static if q > 1 and self.runner.graph_for(q, n) is not None]
        rows = self.runner.ragged_rows(n) if "ragged" in self.mechanisms and draft.tree is None else []
        if rows and self._host_free(reqs):
            draft.device_lengths = chooser.choose_rows_ahead(draft.confidences, rows)
            return draft
        if widths and not rows:
            width, keep = chooser.choose_ahead(draft.confidences, draft.tree, widths)
            if draft.tree is None:
                draft.lengths = None if width > k else [width - 1] * n
                return draft
            return draft if keep is None else self._narrowed(draft, keep)
        if draft.tree is None:
            draft.lengths = chooser.choose(draft.confidences.float().cpu().numpy(), row_buckets=rows or None)
            return draft
        host = torch.stack([draft.confidences.float(), draft.tree.parents.float()]).cpu().numpy()  # one sync
        keep = chooser.choose_tree(host[0], host[1].astype(np.int64), range(2, k + 2))
        return draft if keep is None else self._narrowed(draft, torch.from_numpy(keep).to(self.device, non_blocking=True))

    def _host_free(self, reqs: list[Request]) -> bool:
        """Whether a step needs its verify widths on the host only after the verify: greedy, no grammar, no stop id
        banned (device acceptance; masks and bans are laid out per verify row before it)."""
        return all(r.params.greedy and r.grammar is None for r in reqs) and not self.engine.stops.bans(reqs) \
            and "device-acceptance" in self.mechanisms

    @staticmethod
    def _narrowed(draft: Draft, keep: torch.Tensor) -> Draft:
        tree = draft.tree.narrow(keep)
        return Draft(tree.tokens, tree=tree, assisted=draft.assisted)

    def _plan(self, reqs: list[Request], draft: Draft) -> VerifyPlan:
        if draft.device_lengths is not None:  # laid out on the device; the widths follow the verify
            lengths, rows = draft.device_lengths
            graph = self.runner.ragged_for(len(reqs), rows)
            self._laid_out = None
            slots, starts, firsts = (to_device(v, self.device) for v in _heads(reqs))
            self.runner.ragged_inputs.lay_out(slots, starts, firsts, draft.tokens, lengths, graph.batch.batch_size,
                                              graph.batch.num_tokens)
            return VerifyPlan(reqs, draft, None, graph.batch, graph)
        widths = draft.widths()
        q, n = max(widths), len(reqs)
        laid, self._laid_out = self._laid_out, None
        ragged = len(set(widths)) > 1
        if not ragged:
            graph = self.runner.graph_for(q, n)
        elif "ragged" in self.mechanisms and draft.tree is None:  # packed chains, through their rows' bucket
            graph = self.runner.ragged_for(n, sum(widths))
        else:
            graph = None
        if graph is None or ragged:
            slots, starts, firsts = _heads(reqs)
            lists = [[t, *d[: w - 1]] for t, d, w in zip(firsts, draft.tokens.tolist(), widths)]
            if graph is not None:
                self.runner.ragged_inputs.fill(slots, starts, lists, graph.batch.batch_size, graph.batch.num_tokens)
                return VerifyPlan(reqs, draft, widths, graph.batch, graph)
            batch = ForwardBatch.build(slots, starts, lists, self.cache.max_len, self.device)
            batch.verify = True
            if draft.tree is not None:
                batch.tree_mask, batch.tree_parents = torch.empty_like(batch.positions), torch.zeros_like(batch.positions)
                batch.place_tree(TreeLayout(*(t.to(self.device) for t in vars(draft.tree).values())))
            return VerifyPlan(reqs, draft, widths, batch)
        if draft.tree is not None and graph.batch.tree_mask is None:
            raise RuntimeError(f"the verify graphs for {q} tokens were captured without tree masks")
        b, inputs = graph.batch.batch_size, self.runner.static[q]
        if laid is None or (laid.rids, laid.q, laid.bucket, laid.fills) != ([r.rid for r in reqs], q, b, inputs.fills):
            slots, starts, firsts = _heads(reqs)
            inputs.fill(slots, starts, [[t] * q for t in firsts], b)
        if draft.bucket == b and b in self.placement:  # the drafter's graph outputs: one replay lays them in
            self.placement[b].replay()
        else:
            graph.batch.input_ids[: n * q].view(n, q)[:, 1:].copy_(draft.tokens[:, : q - 1], non_blocking=True)
            if draft.tree is not None:
                graph.batch.place_tree(draft.tree)
        return VerifyPlan(reqs, draft, widths, graph.batch, graph)

    def verify(self, plan: VerifyPlan) -> RunOutput:
        if plan.graph is None:
            return self.runner.run(plan.batch)
        return self.runner.replay(plan.graph, plan.batch.num_tokens if plan.widths is None else plan.offsets[-1])

    def accept(self, plan: VerifyPlan, out: RunOutput, clock: StepClock) -> Acceptance:
        """Device acceptance where it applies (nothing banned; uniform widths, sampled rows decided by their
        keyed samples; or greedy chains of different widths, `two-level`'s), else the walk. A grammar's masks
        go into the verify logits first, in place (a graph's own output buffer, which its acceptance graph
        reads): a masked argmax or keyed sample never takes a draft the grammar forbids, so constrained steps
        stay on the device path. Greedy requests that need no masked rows are checked against their grammar
        after acceptance instead (`_check_grammars`)."""
        reqs, tree = plan.reqs, plan.draft.tree
        if plan.widths is None:  # level 1 chose the widths on the device: they come back with the acceptance
            return self._accept_ragged(plan, out, clock)
        banned = self._banned_rows(plan)
        if plan.host_drafts is not None:
            self._constrain(plan, out.logits)
        on_device = "device-acceptance" in self.mechanisms and banned is None
        if on_device and not plan.uniform and all(r.params.greedy for r in reqs):  # ragged chains
            return self._accept_ragged(plan, out, clock)
        if on_device and plan.uniform:
            accepted, taps, host, graphed = self._accept_on_device(plan, out)
            clock.mark()
            launched = "early-launch" in self.mechanisms
            drafted = self._drafts_to_check(plan, launched)
            if launched:
                self.engine.drafter.launch_next(reqs, out.batch, accepted, taps)
                clock.mark()
            # the one sync: rows of the bucket's requests, of which the first len(reqs) are ours
            decisions = Accepted.unpack(host.tolist(), out.batch.batch_size, plan.widths[0], len(reqs))
            resumed: list[tuple[int, int, list[int]]] = []
            corrected = self._check_grammars(plan, out.logits, decisions, drafted,
                                             resumed if tree is not None else None)
            if resumed:  # the launched draft took the device's old taps for these nodes' context
                taps = self._move_resumed(plan, out, resumed, taps)
                if launched:
                    self.engine.drafter.cancel_launch()
                    launched = False
            return Acceptance(decisions, taps, launched, graphed, corrected)
        logits = out.logits if banned is None else suppress(out.logits, banned)
        decisions = self._walk(plan, logits)  # syncs
        corrected = self._check_grammars(plan, logits, decisions, plan.draft)
        clock.mark()
        taps = out.taps
        if tree is not None:  # per request: its count, then its rows padded to q
            q = plan.widths[0]
            walked = to_device([[len(d.tokens), *d.rows, *[0] * (q - len(d.rows))] for d in decisions], self.device)
            base = out.batch.write_index.view(-1, q)[: len(reqs), 0]
            taps = self._arrange_accepted(base, walked[:, 0], walked[:, 1:], taps)
        return Acceptance(decisions, taps, corrected=corrected)

    def commit(self, plan: VerifyPlan, out: RunOutput, acceptance: Acceptance) -> Commits:
        engine, forcing, assisted = self.engine, self.engine.forcing, plan.draft.assisted
        self.cache.commit_paths([r.slot for r in plan.reqs], [d.rows for d in acceptance.decisions])
        committed, finished, redraft = [], [], acceptance.corrected
        for i, (req, decision) in enumerate(zip(plan.reqs, acceptance.decisions)):
            rows = None
            if forcing is not None or req.params.return_logprob:  # the rows that decided each token
                rows = out.logits[plan.offsets[i] : plan.offsets[i + 1]][decision.rows]
                if self._checked_after(req):  # unmasked until now: masked as AR's rows are
                    constrain(rows, req.grammar.masks_along(decision.tokens))
            n, done = engine.commit_tokens(req, decision.tokens, rows)
            # token forcing may commit stock's tokens instead: a draft launched for ours no longer fits
            redraft |= forcing is not None and not done and req.output_ids[-n:] != decision.tokens
            req.accept_lengths.append(n)
            req.token_origins += origins(n, len(decision.tokens), assisted is not None and assisted[i])
            committed.append(n)
            if done:
                finished.append(req)
        engine.spec_stats.record(committed)
        return Commits(committed, finished, redraft)

    def prepare(self, plan: VerifyPlan, acceptance: Acceptance, commits: Commits) -> None:
        drafter = self.engine.drafter
        if not acceptance.launched:
            taps = acceptance.taps
            offsets = plan.offsets
            drafter.commit(plan.reqs, commits.committed,
                           [None if taps is None else taps[a:b] for a, b in zip(offsets, offsets[1:])])
        elif commits.redraft:
            drafter.cancel_launch()
        if acceptance.graphed and "layout-ahead" in self.mechanisms and not (commits.finished or commits.redraft):
            q = plan.widths[0]
            self._laid_out = _LaidOut([r.rid for r in plan.reqs], q, plan.batch.batch_size, self.runner.static[q].fills)

    def invalidate(self) -> None:
        """What the device prepared for the next step no longer holds (a rollback changed a length)."""
        self._laid_out = None
        if "early-launch" in self.mechanisms:
            self.engine.drafter.cancel_launch()

    # ---- acceptance -----------------------------------------------------------------------------
    def _accept_on_device(self, plan: VerifyPlan, out: RunOutput) -> tuple[Accepted, torch.Tensor | None, HostCopy, bool]:
        """Greedy batches replay the acceptance graph of the verify graph that ran; the rest run
        `_acceptance` eagerly over the whole batch (a graph's bucket included). Returns the acceptance,
        the verify taps with accepted rows first, the packed values on their way to the host, and
        whether the graph ran."""
        graph = self.acceptance.get((out.batch.max_q_len, out.batch.batch_size))
        sampled = [r for r in plan.reqs if not r.params.greedy]
        if graph is not None and graph.batch is out.batch and not sampled:
            graph.graph.replay()
            accepted, taps, _ = graph.graph.outputs
            return accepted, taps, HostCopy(graph.host), True
        logits, taps = (out.logits, out.taps) if plan.graph is None else (plan.graph.logits, plan.graph.taps)
        accepted, taps, values = self._acceptance(out.batch, logits, taps, reqs=plan.reqs if sampled else ())
        return accepted, taps, HostCopy.of(values), False

    def _accept_ragged(self, plan: VerifyPlan, out: RunOutput, clock: StepClock) -> Acceptance:
        """Greedy chains of different widths (`two-level`), on the device: each request's rows gathered to the
        batch's widest width (its last row repeated), drafts past its width never matching, so acceptance stops
        there. Reads the widths from the batch (on the device, wherever they were chosen): where level 1 chose
        them there, they come back in the acceptance's one copy (`VerifyPlan.settle`). Under `early-launch` the
        drafter starts the next draft from the gathered taps before the host reads the copy."""
        reqs, batch = plan.reqs, out.batch
        n, q = len(reqs), batch.max_q_len
        q_starts, q_lens = batch.q_starts[:n].long(), batch.q_lens[:n].long()
        j = torch.arange(q, device=self.device)
        rows = q_starts[:, None] + torch.minimum(j, q_lens[:, None] - 1)  # [n, q]
        drafts = torch.where(j[1:] < q_lens[:, None], batch.input_ids[rows][:, 1:], -1)
        accepted = self.engine.verifier.greedy(row_argmax(out.logits)[rows], drafts, batch.positions[rows[:, 0]])
        settled = plan.widths is not None
        host = HostCopy.of(accepted.pack() if settled else torch.cat([accepted.pack(), q_lens]))
        clock.mark()
        launched = "early-launch" in self.mechanisms and out.taps is not None
        drafted = self._drafts_to_check(plan, launched)
        if launched:  # as a verify graph of the bucket's requests and width q would have left them
            pad = batch.batch_size - n
            fills = {"counts": 1}  # a padding request commits one token (0) at its scratch slot's start
            padded = Accepted(**{name: torch.cat([t, t.new_full((pad, *t.shape[1:]), fills.get(name, 0))])
                                 for name, t in vars(accepted).items()})
            taps = out.taps[rows.flatten()]
            self.engine.drafter.launch_next(reqs, batch, padded, torch.cat([taps, taps.new_zeros(pad * q, taps.shape[1])]))
            clock.mark()
        values = host.tolist()
        if not settled:
            plan.settle(values[-n:])
            values = values[:-n]
        decisions = Accepted.unpack(values, n, q, n)
        return Acceptance(decisions, out.taps, launched,
                          corrected=self._check_grammars(plan, out.logits, decisions, drafted))

    def _acceptance(self, batch: ForwardBatch, logits: torch.Tensor, verify_taps: torch.Tensor | None,
                    host: torch.Tensor | None = None,
                    reqs: Sequence[Request] = ()) -> tuple[Accepted, torch.Tensor | None, torch.Tensor]:
        """Fixed-shape device work over a verify batch (graph-capturable): greedy acceptance, a tree's
        K/V compaction, the taps in accepted order, and the packed values the host reads. The graph form
        (`host`: the pinned buffer it copies them into) also lays out the next verify in the graph's
        static batch under `layout-ahead`; an eager batch is not reused, so it is left as it is. `reqs`:
        the batch's requests where some sample (their rows' decisions are keyed samples, not argmaxes)."""
        b, q = batch.batch_size, batch.max_q_len
        ids, positions = batch.input_ids.view(b, q), batch.positions.view(b, q)
        tree = None
        if batch.tree_mask is not None:
            tree = TreeLayout(ids[:, 1:], batch.tree_parents.view(b, q)[:, 1:], positions[:, 1:] - positions[:, :1],
                              batch.tree_mask.view(b, q))
        starts = positions[:, 0].clone()  # the layout below moves them on
        decided = row_argmax(logits).view(b, q)
        sampled = [i for i, req in enumerate(reqs) if not req.params.greedy]
        if sampled:  # the row at depth d decides output position len(output) + d
            index = torch.tensor(sampled, device=logits.device)
            depths = positions[index] - positions[index, :1]
            outputs = torch.tensor([len(reqs[i].output_ids) for i in sampled], device=logits.device)
            decided[index] = keyed_sample_rows(
                logits.view(b, q, -1)[index].flatten(0, 1), [reqs[i].params for i in sampled],
                [reqs[i].sampling_seed for i in sampled], (outputs[:, None] + depths).flatten(), repeats=q,
            ).view(len(sampled), q)
        accepted = self.engine.verifier.greedy(decided, ids[:, 1:], starts, tree)
        taps = verify_taps
        if tree is not None:
            taps = self._arrange_accepted(batch.write_index.view(b, q)[:, 0], accepted.counts, accepted.nodes, taps)
        values = accepted.pack()
        if host is not None:
            host.copy_(values, non_blocking=True)
            if "layout-ahead" in self.mechanisms:
                # in place: the batch becomes the next verify of the same requests (its block starts where
                # this step's commits end, the bonus token first; drafts and a tree are placed by `plan`)
                lay_out_next_verify(batch.positions, batch.write_index, batch.kv_lens, batch.input_ids,
                                    batch.slot_ids, accepted.starts, accepted.counts, accepted.bonus(),
                                    self.cache.scratch_slot)
        return accepted, taps, values

    def _walk(self, plan: VerifyPlan, logits: torch.Tensor) -> list[Decision]:
        """The verifier's walk on the host (any sampling): per request the tokens to commit and the
        verify rows that decided them (0, then the accepted draft nodes)."""
        draft, offsets = plan.draft, plan.offsets
        k = draft.tokens.shape[1]
        parts = [row_argmax(logits), draft.tokens.to(logits.device).flatten()]
        if draft.tree is not None:
            parts.append(draft.tree.parents.to(logits.device).flatten())
        host = torch.cat(parts).tolist()
        rows, n_drafted = offsets[-1], len(plan.reqs) * k
        flat, parents = host[rows : rows + n_drafted], host[rows + n_drafted :]
        decisions = []
        for i, (req, w) in enumerate(zip(plan.reqs, plan.widths)):
            drafted = slice(i * k, i * k + w - 1)
            lo, hi = offsets[i], offsets[i + 1]
            tokens, path = self.engine.verifier.accept(req, logits[lo:hi], flat[drafted], host[lo:hi],
                                                       parents[drafted] if draft.tree is not None else None)
            decisions.append(Decision(tokens, [0, *path]))
        return decisions

    def _checked_after(self, req: Request) -> bool:
        """Whether a constrained request's grammar is checked after acceptance rather than masking its verify
        rows: greedy, with no stop ids banned. A row's plain argmax is its masked argmax wherever the grammar
        allows it (masking only removes ids, and the first of equal maxima stays first among the allowed ones),
        so one accept per decided token replaces a mask per draft node; the rows that decided are masked
        afterwards where something reads them (`commit`)."""
        return req.grammar is not None and req.params.greedy and not self.engine.stops.bans((req,))

    def _drafts_to_check(self, plan: VerifyPlan, launching: bool) -> Draft:
        """The drafts a grammar check after acceptance may walk: copied (on the device) where a draft launched
        early will overwrite them — a drafter graph's outputs, which the plan's draft views — and a request needs
        the check."""
        draft = plan.draft
        checked = any(self._checked_after(plan.reqs[i]) for i in plan.constrained)
        if not launching or draft.bucket is None or not checked:
            return draft
        tree = draft.tree if draft.tree is None else replace(draft.tree, parents=draft.tree.parents.clone())
        return replace(draft, tokens=draft.tokens.clone(), tree=tree)

    def _check_grammars(self, plan: VerifyPlan, logits: torch.Tensor, decisions: list[Decision], drafted: Draft,
                        resumed: list[tuple[int, int, list[int]]] | None = None) -> bool:
        """Each request checked after acceptance: its decided tokens against its grammar, and from the first
        it refuses, the decision redone (RequestGrammar.recheck; in place) down the drafts (`drafted`, the plan's
        as they were verified: `_drafts_to_check`). Where the device already moved a tree's accepted K/V
        (`resumed` given) the redone decision goes on only through nodes whose K/V that move left in place (rows
        past the accepted count); each request that did is appended to `resumed` as (index, depth of the last
        node kept, the nodes past it) for `_move_resumed`. Returns whether any changed (what the device prepared
        for the next step assumed the old decisions)."""
        corrected = False
        for i in plan.constrained:
            req, decision, lo = plan.reqs[i], decisions[i], plan.offsets[i]
            if not self._checked_after(req):
                continue

            def decide(row: int, mask: torch.Tensor | None, lo: int = lo) -> int:
                x = logits[lo + row][None]
                return int(row_argmax(x if mask is None else constrain(x.clone(), mask))[0])

            moved = len(decision.rows) - 1 if resumed is not None else 0  # rows 1..moved were written over

            def children(i: int = i, moved: int = moved) -> dict[tuple[int, int], int]:
                return {key: row for key, row in self._children(drafted, plan.widths[i], i).items() if row > moved}

            redone = req.grammar.recheck(decision.tokens, decision.rows, children, decide)
            if redone is None:
                continue
            tokens, rows = redone
            if resumed is not None:  # the rows both decisions share, then those the redone one went on through
                kept = next((d for d, (a, b) in enumerate(zip(rows, decision.rows)) if a != b),
                            min(len(rows), moved + 1))
                if len(rows) > kept:
                    resumed.append((i, kept - 1, rows[kept:]))
            decision.tokens, decision.rows = tokens, rows
            corrected = True
        return corrected

    def _move_resumed(self, plan: VerifyPlan, out: RunOutput, resumed: list[tuple[int, int, list[int]]],
                      taps: torch.Tensor | None) -> torch.Tensor | None:
        """Trees whose redone decision went on past the nodes the device moved: those nodes' K/V move too (node
        c at depth d to base + d, as commit_accepted does, from base + depth of the last node kept), and the
        taps in accepted order take theirs."""
        q, max_len = plan.widths[0], self.cache.max_len
        width = 1 + max(len(nodes) for _, _, nodes in resumed)
        # slot rows of each last kept node (not the batch's write_index: `layout-ahead` has moved it on)
        base = to_device([plan.reqs[i].slot * max_len + plan.reqs[i].cached_len + kept for i, kept, _ in resumed],
                         self.device)
        counts = to_device([1 + len(nodes) for _, _, nodes in resumed], self.device)
        nodes = to_device([[0, *(c - kept for c in path), *[0] * (width - 1 - len(path))] for _, kept, path in resumed],
                          self.device)
        self.cache.commit_accepted(base, counts, nodes)
        if taps is None:
            return None
        dst = [i * q + kept + y for i, kept, path in resumed for y in range(1, len(path) + 1)]
        src = [i * q + c for i, _, path in resumed for c in path]
        taps = taps.clone()
        taps[to_device(dst, self.device)] = out.taps[to_device(src, self.device)]
        return taps

    @staticmethod
    def _children(draft: Draft, w: int, i: int) -> dict[tuple[int, int], int]:
        """Request i's drafted (row, token) -> child row, over its verify width `w`."""
        tokens = draft.tokens[i, : w - 1].tolist()
        return draft_children(tokens, None if draft.tree is None else draft.tree.parents[i, : w - 1].tolist())

    def _constrain(self, plan: VerifyPlan, logits: torch.Tensor) -> None:
        """Each constrained request's verify rows masked by its grammar at the state its draft path leads
        to (row 0: its committed tokens; a draft node's row: those and the path of drafts down to it): the
        masks are made on the host while the verify runs, then applied in one launch. Requests checked after
        acceptance are left unmasked."""
        tokens, parents = plan.host_drafts
        masks = None
        for i in plan.constrained:
            req, w, lo = plan.reqs[i], plan.widths[i], plan.offsets[i]
            if not self._checked_after(req):
                mask = req.grammar.bitmask(tokens[i][: w - 1], parents[i][: w - 1] if parents else None)
                if masks is None:  # every row of the pass (graph padding included), unmasked until set
                    masks = mask.new_full((logits.shape[0], mask.shape[1]), -1)
                masks[lo : lo + w] = mask
        constrain(logits, masks)

    def _banned_rows(self, plan: VerifyPlan) -> list[list[int]] | None:
        """Ids banned per verify row: row j decides the token at depth (its node's depth) + 1; None: none is."""
        stops = self.engine.stops
        if not stops.bans(plan.reqs):
            return None
        per_req = [stops.banned(r, w) for r, w in zip(plan.reqs, plan.widths)]
        tree = plan.draft.tree
        if tree is None:
            return [row for rows in per_req for row in rows]
        depths = tree.depths.tolist()  # rare (min_new_tokens not reached yet): worth a sync
        return [rows[d] for rows, ds in zip(per_req, depths) for d in (0, *ds)]

    def _arrange_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor,
                          taps: torch.Tensor | None) -> torch.Tensor | None:
        """Trees only (a chain is in order already). Device-side, per request (cache row `base` of its
        newest token): the accepted nodes' K/V move from their node rows to the positions they now hold
        (depth d at base + d), for all layers at once; returns the verify taps with each request's
        accepted rows first, in order (what the drafter takes as committed rows)."""
        n, q = nodes.shape
        self.cache.commit_accepted(base, counts, nodes)
        order = torch.arange(0, n * q, q, device=nodes.device)[:, None] + nodes
        return None if taps is None else taps.index_select(0, order.flatten())

    # ---- CUDA graphs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """After the runner's verify graphs: one acceptance graph per verify graph (reading its static
        batch, logits and taps); the drafter's graphs over them; then, for tree drafts, one placement
        graph per bucket that lays the drafter's static tree into that bucket's verify inputs."""
        drafter, pool = self.engine.drafter, GraphBackend.pool(self.device)
        q = drafter.block_size
        if "device-acceptance" in self.mechanisms:
            for (gq, b), g in self.runner.graphs.items():
                if gq == 1:  # AR's decode graphs
                    continue
                host = torch.zeros(Accepted.packed_size(b, gq), dtype=torch.int64, pin_memory=self.device.type == "cuda")
                graph = GraphBackend.capture(lambda g=g, host=host: self._acceptance(g.batch, g.logits, g.taps, host), pool)
                self.acceptance[(gq, b)] = _AcceptanceGraph(graph, g.batch, host)
                # a graph's outputs hold nothing until it runs, and the drafter's graphs are captured
                # over these: run both once (the static inputs aim at the scratch slot)
                g.graph.replay()
                graph.replay()
            GraphBackend.synchronize(self.device)
        if not drafter.capabilities.graphs:
            return
        # the drafter's graphs follow every verify graph's acceptance, whatever its width (`two-level`'s narrower ones)
        drafter.capture(self.engine.config.cuda_graph_batch_sizes,
                        {key: (g.batch, *g.graph.outputs[:2]) for key, g in self.acceptance.items()})
        for (gq, b), g in self.runner.graphs.items():
            static = drafter.static_draft(b) if gq == q and g.batch.tree_mask is not None else None
            if static is not None and static.tree is not None:
                self.placement[b] = GraphBackend.capture(lambda g=g, s=static: _place(g.batch, s), pool)
        GraphBackend.synchronize(self.device)


def _heads(reqs: list[Request]) -> tuple[list[int], list[int], list[int]]:
    """Per request its slot, cached length and newest token (the first of its verify block)."""
    return [r.slot for r in reqs], [r.cached_len for r in reqs], [r.output_ids[-1] for r in reqs]


@cache  # a few block-bounded keys, met by every request every step
def origins(committed: int, decided: int, assisted: bool) -> tuple[str, ...]:
    """How a verify pass's `committed` tokens came, of the `decided` its acceptance chose (accepted drafts,
    then the bonus; a stop may end the pass before its bonus)."""
    drafts = min(committed, decided - 1)
    return ("ngram" if assisted else "draft",) * drafts + ("bonus",) * (committed - drafts)


def _place(batch: ForwardBatch, draft: Draft) -> None:
    """A bucket's drafts and tree into its verify batch's inputs (every row: padding rows are harmless)."""
    batch.input_ids.view(batch.batch_size, -1)[:, 1:].copy_(draft.tokens)
    batch.place_tree(draft.tree)
