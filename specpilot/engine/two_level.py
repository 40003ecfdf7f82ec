"""Two-level verification (`two-level`): level 1 chooses how many of each request's drafts the target
verifies; level 2 is the one exact target pass over what level 1 kept.

A chain's draft j is accepted only if drafts 1..j all are, so with the drafter's confidences c (its
probability of each drafted token) draft j survives with probability s_j = c_1 ··· c_j, and a request that
verifies L drafts commits 1 + s_1 + ... + s_L tokens in expectation. The step costs the cost table's
T(B, rows per request) for the verify pass plus the rest of the step (drafting, acceptance, the host's
work), which the step measures as it runs; a draft tree's verify is priced by the table's tree grid where it
has one (its nodes cost more than a chain's rows in the batch-invariant attention). Level 1 keeps the drafts that maximise expected tokens per
millisecond: survivals do not increase along a chain, so the best k drafts kept overall are the k largest
survivals (each request a prefix of its chain), and one pass over k = 0 .. B*K finds the best k (under
`ragged` graphs, each k costing its rows' bucket). Where the verify pass runs as a CUDA graph of one width
every request verifies as many rows, so level 1 picks the best of the captured widths instead. A draft tree narrows the same way, to one width for all: a node survives with the
product of its own and its ancestors' confidences, a child never more than its parent, so each request keeps
its (width - 1) likeliest nodes, a subtree.

A drafter's confidence is not the chance its token is accepted (the embedded DFlash drafter is far too sure of
itself), so level 1 calibrates it as it runs: per confidence bin, how often a verified draft whose parent was
accepted was accepted itself, with the drafter's own confidence as a prior worth a few drafts, both forgotten
slowly (recent steps count most).

Under graphs of one width per pass (`choose_ahead`), level 1 never makes the host wait for the draft: reading the
draft's confidences before the verify launch would leave the device idle while the host decides, fills and
launches. The host picks the step's width from the previous step's drafts (already on the host by then), and the
device picks which nodes of each tree fill it (`select`) from this step's; this step's drafts reach the host
beside the verify, for the calibration and the next step's width.

Where no narrower verify could pay (the table prices every width about alike for this batch, as for a small batch
whose pass is bound by latency), level 1 sits the step out: the whole block, and none of its host work.

Lossless by construction: level 1 only drops proposals; the target decides every committed token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specpilot.engine.cost_table import CostTable
from specpilot.state.transfer import HostCopy
from specpilot.state.tree import TreeLayout

SMOOTHING = 0.2  # weight of a step in the moving average of the step's time beside its verify pass
OUTLIER = 4.0  # a step counts at most this many times the average (a step that compiled a kernel is no sample)
# level 1 sits a step out unless a narrower verify could raise tokens per millisecond by this much: its own host
# work (the drafts' copy, the calibration, a tree's selection) costs about that of a small batch's step
MIN_GAIN = 0.03
BINS = 10  # confidence bins of the calibration
PRIOR = 4.0  # drafts' worth of the drafter's own confidence in each bin
DECAY = 0.995  # per step, of the calibration's counts


def verify_widths(block_size: int, mechanisms: frozenset[str]) -> tuple[int, ...]:
    """The verify widths given CUDA graphs: the whole block, and with `two-level` the powers of two below it too."""
    if "two-level" not in mechanisms:
        return (block_size,)
    return (*(1 << i for i in range(1, (block_size - 1).bit_length())), block_size)


class VerifyLengths:
    def __init__(self, table: CostTable) -> None:
        self.table = table
        self.other_ms: float | None = None  # unknown until a step is measured: the first steps verify everything
        self.kept = self.offered = 0  # drafts verified, drafts proposed (what /get_server_info reports)
        self.tried, self.accepted = np.zeros(BINS), np.zeros(BINS)  # per confidence bin: drafts reached, accepted
        # the latest choice: its drafts' confidence bins and parents ([B, K], 0 = the root), which were verified, and
        # for narrowed trees the draft each verify row holds ([B, width - 1]; None: row j holds draft j)
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None = None
        # `choose_ahead` / `choose_rows_ahead`: this step's drafts on their way to the host (the copy; requests, drafts,
        # width (0: ragged, the chains' lengths follow the confidences in the copy), whether a tree), and the previous
        # step's survivals, each request's likeliest first, that forecast the next width or rows
        self._pending: tuple[HostCopy, int, int, int, bool] | None = None
        self._ahead: np.ndarray | None = None
        self._tree = False  # the latest choice verifies draft trees: priced (and observed) on the tree grid

    def choose(self, confidences: np.ndarray, widths: Sequence[int] | None = None,
               row_buckets: Sequence[int] | None = None) -> list[int]:
        """Per request the number of its drafts to verify, from `confidences` [B, K]; `widths`: the verify
        widths (rows per request, the newest token included) that graphs offer for this batch, one for all
        requests; None: any number per request (a ragged pass), whose rows `row_buckets` round up to the
        captured ragged graph's they run in (None: an eager pass, no rounding)."""
        n, k = confidences.shape
        self._tree = False
        bins, calibrated = self._calibrated(confidences)
        survival = np.cumprod(calibrated, axis=1)
        if self.other_ms is None:
            lengths = [k] * n
        elif widths is None:
            lengths = self._ragged(survival, row_buckets)
        else:
            lengths = self._uniform(survival, widths)
        self._remember(bins, np.broadcast_to(np.arange(k), (n, k)), np.arange(k)[None] < np.array(lengths)[:, None])
        return lengths

    def choose_tree(self, confidences: np.ndarray, parents: np.ndarray, widths: Sequence[int]) -> np.ndarray | None:
        """Draft trees ([B, K] node confidences and parents, 0 = the root, node j's parent before it): one verify
        width of `widths` for all, and per request the nodes to keep ([B, width - 1] 0-based, ascending); None
        where every node is kept."""
        n, k = confidences.shape
        self._tree = True
        bins, calibrated = self._calibrated(confidences)
        survival = _tree_survival(calibrated, parents)
        # per request its nodes likeliest first; among equals the earlier (a parent before its child)
        order = np.argsort(-survival, axis=1, kind="stable")
        kept = k if self.other_ms is None else self._uniform(np.take_along_axis(survival, order, 1), widths)[0]
        if kept == k:
            self._remember(bins, parents, np.ones((n, k), dtype=bool))
            return None
        keep = np.sort(order[:, :kept], axis=1)
        verified = np.zeros((n, k), dtype=bool)
        np.put_along_axis(verified, keep, True, 1)
        self._remember(bins, parents, verified, keep)
        return keep

    def choose_ahead(self, confidences: torch.Tensor, tree: TreeLayout | None,
                     widths: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """Graphs of one width per pass: this step's width, one of `widths`, from the previous step's drafts (the
        whole block until a step was measured), and for a tree narrower than its nodes the nodes each request keeps
        (`select`, on the device; None: all). A chain verifies its first width - 1 drafts. This step's drafts ([B, K]
        confidences, a tree's parents and kept nodes) go to the host beside the verify."""
        n, k = confidences.shape
        width = k + 1
        self._tree = tree is not None
        if not self._can_pay(n, widths, k):
            self._sit_out(n, k)
            return width, None
        if self.other_ms is not None and self._ahead is not None and self._ahead.shape[1] == k:
            width = self._best_width(self._ahead, n, widths)
        keep = self.select(confidences, tree, width) if tree is not None and width <= k else None
        parts = [confidences.float().flatten()]
        if tree is not None:
            parts.append(tree.parents.float().flatten())
        if keep is not None:
            parts.append(keep.float().flatten())
        self._pending = (HostCopy.of(torch.cat(parts)), n, k, width, tree is not None)
        return width, keep

    def choose_rows_ahead(self, confidences: torch.Tensor, row_buckets: Sequence[int]) -> tuple[torch.Tensor, int]:
        """`ragged` graphs: on the device the chains' lengths ([B], the drafts likeliest to survive; `select_chains`)
        that fill this step's rows, one of `row_buckets` chosen from the previous step's drafts (every draft until a
        step was measured); returns (lengths, rows), as `Draft.device_lengths` holds them. This step's drafts and
        lengths go to the host beside the verify."""
        n, k = confidences.shape
        self._tree = False
        buckets = sorted(row_buckets)
        rows = n * (k + 1)
        takes_part = self._can_pay(n, [1], k)  # not where even a row per request would not pay
        if takes_part and self.other_ms is not None and self._ahead is not None and self._ahead.shape[1] == k:
            like_last = np.resize(self._ahead, (n, k))  # the last step's requests, as many as this step's
            rows = n + sum(self._ragged(like_last, buckets))
        rows = next((t for t in buckets if t >= rows), buckets[-1])
        if not takes_part:
            self._sit_out(n, k)
            return torch.full((n,), k, dtype=torch.long, device=confidences.device), rows
        lengths = self.select_chains(confidences, min(rows - n, n * k))
        copy = HostCopy.of(torch.cat([confidences.float().flatten(), lengths.float()]))
        self._pending = (copy, n, k, 0, False)
        return lengths, rows

    def _can_pay(self, n: int, widths: Sequence[int], k: int) -> bool:
        """Whether verifying fewer rows (per request, `widths` below the whole block's k + 1) could raise tokens
        per millisecond for n requests by MIN_GAIN: at best it keeps every token the whole block would, for a
        cheaper step. Where the pass costs about the same at every width (a small batch's, bound by latency) it
        cannot, and level 1's host work would only slow the step. Unknown before a step was measured: it can."""
        if self.other_ms is None:
            return True
        narrower = [w for w in widths if 1 <= w <= k]
        if not narrower:
            return False
        full, *narrow = self.table.along_tokens(n, np.array([k + 1, *narrower], dtype=np.float64), self._tree)
        return self.other_ms + full > (1 + MIN_GAIN) * (self.other_ms + min(narrow))

    def _sit_out(self, n: int, k: int) -> None:
        """A step that verifies every draft without level 1: nothing goes to the host, nothing is learnt."""
        self._pending = self._last = None
        self.kept += n * k
        self.offered += n * k

    def select_chains(self, confidences: torch.Tensor, drafts: int) -> torch.Tensor:
        """On the device: how many of its drafts each chain verifies ([B]) so that the `drafts` likeliest to
        survive are verified, by this step's calibrated confidences. Survivals never rise along a chain, and
        among equals the stable order takes the shallower draft first: each request verifies a prefix."""
        n, k = confidences.shape
        survival = self._log_rates(confidences).cumsum(1).flatten()
        chosen = torch.sort(-survival, stable=True).indices[:drafts]
        return torch.zeros(n, dtype=torch.long, device=confidences.device).index_add_(
            0, chosen // k, torch.ones_like(chosen))

    def _log_rates(self, confidences: torch.Tensor) -> torch.Tensor:
        """On the device: each draft's log calibrated chance of acceptance once its parent is accepted."""
        c = confidences.float().clamp(0.0, 1.0)
        bins = (c * BINS).long().clamp_max(BINS - 1)
        counts = torch.from_numpy(np.stack([self.accepted, self.tried]).astype(np.float32))
        if c.is_cuda:
            counts = counts.pin_memory()
        accepted, tried = counts.to(c.device, non_blocking=True)
        return torch.log(((accepted[bins] + PRIOR * c) / (tried[bins] + PRIOR)).clamp_min(1e-30))

    def select(self, confidences: torch.Tensor, tree: TreeLayout, width: int) -> torch.Tensor:
        """On the device: per request the width - 1 nodes of its tree likeliest to survive ([B, width - 1], 0-based,
        ascending), by this step's calibrated confidences: a subtree (TreeLayout.narrow)."""
        c = confidences
        log_rate = self._log_rates(c)
        nodes = torch.arange(1, c.shape[1] + 1, device=c.device)
        bits = ((tree.ancestors[:, 1:, None] >> nodes) & 1).bool()  # [B, K, K]: node j's ancestors (itself too)
        log_survival = torch.where(bits, log_rate[:, None, :], 0.0).sum(-1)
        # a child never above its parent whatever the rounding (each node takes the least of its ancestors'), and
        # among equals the stable sort ranks the parent first: the kept nodes form a subtree
        log_survival = torch.where(bits, log_survival[:, None, :], float("inf")).amin(-1)
        order = torch.sort(-log_survival, dim=1, stable=True).indices[:, : width - 1]
        return order.sort(dim=1).values

    def _resolve_pending(self) -> None:
        """The last `choose_ahead` step's drafts, now on the host: remembered for `learn`, and their survivals
        (each request's likeliest first) kept to forecast the next width."""
        copy, n, k, width, is_tree = self._pending
        self._pending = None
        values = np.asarray(copy.tolist(), dtype=np.float64)
        confidences = values[: n * k].reshape(n, k)
        bins, calibrated = self._calibrated(confidences)
        if is_tree:
            parents = values[n * k : 2 * n * k].reshape(n, k).astype(np.int64)
            survival = -np.sort(-_tree_survival(calibrated, parents), axis=1)
            columns = None
            verified = np.ones((n, k), dtype=bool)
            if width <= k:  # the nodes `select` kept
                columns = values[2 * n * k :].reshape(n, width - 1).astype(np.int64)
                verified = np.zeros((n, k), dtype=bool)
                np.put_along_axis(verified, columns, True, 1)
        else:  # a chain's drafts verified: width - 1 each, or (`choose_rows_ahead`: width 0) its own count
            parents, survival, columns = np.broadcast_to(np.arange(k), (n, k)), np.cumprod(calibrated, axis=1), None
            counts = values[n * k :, None] if width == 0 else width - 1
            verified = np.broadcast_to(np.arange(k) < counts, (n, k))
        self._remember(bins, parents, verified, columns)
        self._ahead = survival

    def _calibrated(self, confidences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each draft's confidence bin, and its calibrated chance of acceptance once its parent is accepted."""
        confidences = np.clip(confidences, 0.0, 1.0)
        bins = np.minimum((confidences * BINS).astype(np.int64), BINS - 1)
        return bins, (self.accepted[bins] + PRIOR * confidences) / (self.tried[bins] + PRIOR)

    def _remember(self, bins: np.ndarray, parents: np.ndarray, verified: np.ndarray,
                  columns: np.ndarray | None = None) -> None:
        self._last = (bins, parents, verified, columns)
        self.kept += int(verified.sum())
        self.offered += bins.size

    def _ragged(self, survival: np.ndarray, row_buckets: Sequence[int] | None) -> list[int]:
        n, k = survival.shape
        # largest first; among equal survivals the earlier (a chain's shallower draft first: prefixes stay prefixes)
        order = np.argsort(-survival, axis=None, kind="stable")
        tokens = n + np.concatenate([[0.0], np.cumsum(survival.ravel()[order])])
        rows = n + np.arange(n * k + 1)
        if row_buckets is not None:  # a graph's pass costs its bucket's rows
            buckets = np.array(sorted(row_buckets))
            rows = buckets[np.minimum(np.searchsorted(buckets, rows), len(buckets) - 1)]
        ms = self.other_ms + self.table.along_tokens(n, rows / n, self._tree)
        best = int(np.argmax(tokens / ms))
        return np.bincount(order[:best] // k, minlength=n).tolist()

    def _uniform(self, survival: np.ndarray, widths: Sequence[int]) -> list[int]:
        return [self._best_width(survival, survival.shape[0], widths) - 1] * survival.shape[0]

    def _best_width(self, survival: np.ndarray, n: int, widths: Sequence[int]) -> int:
        """The width of `widths` for n requests whose drafts survive as `survival`'s rows do (each row likeliest
        first; another batch's where n differs: its mean per request)."""
        k = survival.shape[1]
        options = sorted(w for w in set(widths) if 1 <= w <= k + 1)
        if not options:
            raise ValueError(f"no verify width of 1..{k + 1} rows among {sorted(widths)}")
        # expected accepted drafts per width, over n requests
        per_width = np.concatenate([[0.0], survival.sum(axis=0).cumsum()]) * n / survival.shape[0]
        tokens = n + per_width[np.array(options) - 1]
        ms = self.other_ms + self.table.along_tokens(n, np.array(options, dtype=np.float64), self._tree)
        return options[int(np.argmax(tokens / ms))]

    def learn(self, paths: list[list[int]]) -> None:
        """The latest choice's outcome: per request its accepted path of verify rows (0, then the accepted draft
        nodes). A verified draft whose parent is on the path was reached: accepted if on the path itself."""
        if self._pending is not None:
            self._resolve_pending()
        if self._last is None:
            return
        bins, parents, verified, columns = self._last
        self._last = None
        n, k = bins.shape
        on_path = np.zeros((n, k + 1), dtype=bool)
        rows = np.repeat(np.arange(n), [len(p) for p in paths])
        cols = np.fromiter((r for p in paths for r in p), dtype=np.int64, count=len(rows))
        if columns is not None:  # a narrowed tree's verify row r > 0 holds node columns[i, r - 1]
            cols = np.where(cols > 0, columns[rows, np.maximum(cols - 1, 0)] + 1, 0)
        on_path[rows, cols] = True
        reached = np.take_along_axis(on_path, parents, 1) & verified
        self.tried *= DECAY
        self.accepted *= DECAY
        np.add.at(self.tried, bins[reached], 1.0)
        np.add.at(self.accepted, bins[on_path[:, 1:] & verified], 1.0)

    def observe(self, step_ms: float, batch: int, rows: int) -> None:
        """A step's wall time, its batch size and its verify rows: what it spent beside the table's pass time (its
        tree grid's for the trees the latest choice verified)."""
        other = max(step_ms - self.table.at(batch, rows / batch, self._tree), 0.0)
        if self.other_ms is None:
            self.other_ms = other
        else:
            self.other_ms += SMOOTHING * (min(other, OUTLIER * self.other_ms) - self.other_ms)

    def as_dict(self) -> dict:
        rate = self._calibrated((np.arange(BINS) + 0.5) / BINS)[1]  # at each bin's middle
        return {"table": self.table.key, "drafts_verified": self.kept, "drafts_offered": self.offered,
                "acceptance_by_confidence": [round(float(r), 3) for r in rate],
                "other_ms": None if self.other_ms is None else round(self.other_ms, 3)}


def _tree_survival(calibrated: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """[B, K] each node's chance to survive: its own calibrated confidence times its parent's survival (0: the root).
    By pointer jumping: each round a node takes on the product up to the ancestor it points at and then points
    twice as far, so a tree of depth d takes log2(d) rounds, not one per node."""
    survival = calibrated.copy()
    up = np.asarray(parents, dtype=np.int64) - 1  # each node's parent column; -1: the root
    while (up >= 0).any():
        above = up >= 0
        at = np.maximum(up, 0)
        survival = np.where(above, survival * np.take_along_axis(survival, at, 1), survival)
        up = np.where(above, np.take_along_axis(up, at, 1), -1)
    return survival

