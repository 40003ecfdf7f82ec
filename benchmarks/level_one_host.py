"""Host time of two-level's level 1 per step, as the graphed step runs it (`choose_ahead`, then `learn` and
`observe`), on CPU tensors: what the host spends beside the device's work, for a chain or a top-4 tree of
`--drafts` nodes at each batch size. The cost table is synthetic (a pass of 1 ms plus 0.05 ms a row per request),
so level 1 takes part at every batch; `--flat` prices every width alike, where it sits the step out.

    python benchmarks/level_one_host.py [--batch 1 8 32] [--drafts 15] [--steps 300] [--repeats 5] [--flat]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.engine.cost_table import CostTable  # noqa: E402
from specpilot.engine.two_level import VerifyLengths  # noqa: E402
from specpilot.state.tree import TreeLayout  # noqa: E402

BATCHES, TOKENS = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16)
WIDTHS = [2, 4, 8, 16]


def table(flat: bool) -> CostTable:
    ms = tuple(tuple(1.0 + (0.0 if flat else 0.05 * b * t) for t in TOKENS) for b in BATCHES)
    return CostTable("synthetic", BATCHES, TOKENS, ms, 512, True, ms)


def top4_tree(n: int, k: int, seed: int) -> TreeLayout:
    """A draft tree of k nodes whose node j hangs under one of the four nodes before it (0: the root)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.zeros(n, k, dtype=torch.int64)
    ancestors = torch.zeros(n, k + 1, dtype=torch.int64)
    ancestors[:, 0] = 1
    for j in range(1, k + 1):
        parent = torch.randint(max(0, j - 4), j, (n,), generator=gen)
        parents[:, j - 1] = parent
        ancestors[:, j] = ancestors.gather(1, parent[:, None])[:, 0] | (1 << j)
    tokens = torch.zeros(n, k, dtype=torch.int64)
    depth = torch.zeros(n, k, dtype=torch.int64)
    return TreeLayout(tokens, parents, depth, ancestors)


def per_step_ms(n: int, k: int, tree: bool, flat: bool, steps: int) -> float:
    lengths = VerifyLengths(table(flat))
    confidences = torch.rand(n, k, generator=torch.Generator().manual_seed(n))
    layout = top4_tree(n, k, seed=n) if tree else None
    paths = [[0, 1]] * n  # the first draft accepted: a path every width keeps

    def step() -> None:
        width, _ = lengths.choose_ahead(confidences, layout, WIDTHS)
        lengths.learn(paths)
        lengths.observe(2.0 + 0.05 * n * width, n, n * width)

    for _ in range(5):  # measured steps first, as a running server's
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--drafts", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = [(n, tree) for n in args.batch for tree in (False, True)]
    seen: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleaved
        for n, tree in cases:
            seen[(n, tree)].append(per_step_ms(n, args.drafts, tree, args.flat, args.steps))
    rows = [{"batch": n, "draft": "tree" if tree else "chain", "median_ms": statistics.median(v), "min_ms": min(v),
             "max_ms": max(v)} for (n, tree), v in seen.items()]
    for r in rows:
        print(f"B={r['batch']:>2} {r['draft']:>5}: {r['median_ms']:.3f} ms a step ({r['min_ms']:.3f}-{r['max_ms']:.3f})")
    write_json(out_dir(args.out) / "level_one_host.json",
               {"provenance": collect(torch.device("cpu"), "float32"), "command": " ".join(sys.argv),
                "flat": args.flat, "rows": rows})


if __name__ == "__main__":
    main()
