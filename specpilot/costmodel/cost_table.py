"""`specpilot bench --profile-cost-table`: the engine's target timed over a grid of batch sizes and rows per
request, each request holding `context` positions already, as the engine would run the pass (CUDA graphs
where it uses them), as chains and as tree-masked verifies (a chain-shaped tree: the invariant kernel's tree
work does not depend on the tree's shape); the table is kept on disk for this device and model
(engine/cost_table.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from specpilot.costmodel.calibrate import median_seconds
from specpilot.engine.cost_table import CostTable, key_for
from specpilot.engine.engine import Engine
from specpilot.models.runner import ModelRunner
from specpilot.progress import bar
from specpilot.state.batch import ForwardBatch
from specpilot.state.graphs import GraphBackend
from specpilot.state.tree import chain_layout


def profile_cost_table(engine: Engine, batch_sizes: list[int], tokens: list[int], context: int = 512,
                       repeats: int = 5) -> CostTable:
    """Median ms of each (batch size, rows per request) pass; the engine must be idle."""
    batch_sizes, tokens = sorted(set(batch_sizes)), sorted(set(tokens))
    if engine.has_work:
        raise ValueError("the engine has requests in flight; profile an idle one")
    if max(batch_sizes) > engine.cache.num_free:
        raise ValueError(f"--cost-batch-sizes: {max(batch_sizes)} requests, but this engine holds "
                         f"{engine.cache.num_free} (--max-running-requests)")
    if context + max(tokens) > engine.context_length:
        raise ValueError(f"--cost-context {context} plus {max(tokens)} rows passes the context length "
                         f"{engine.context_length}")
    graphs = engine.config.cuda_graphs and GraphBackend.available(engine.device) and not engine.hybrid
    engine.model.set_batch_invariant(engine.exact)
    runner = ModelRunner(engine.model, engine.cache, engine.device, tap_layers=engine.runner.tap_layers)
    trees = ModelRunner(engine.model, engine.cache, engine.device, tap_layers=engine.runner.tap_layers)
    tree_tokens = tuple(t for t in tokens if t > 1)  # one row is no tree: a tree of it costs the chain's
    if graphs:
        runner.capture(q_lens=tuple(tokens), batch_sizes=tuple(batch_sizes))
        if tree_tokens:
            trees.capture(q_lens=tree_tokens, batch_sizes=tuple(batch_sizes), tree_qs=tree_tokens)
    rng = random.Random(0)
    vocab = engine.checkpoint.config.vocab_size
    slots = [engine.cache.allocate(context + max(tokens)) for _ in range(max(batch_sizes))]

    def tree_pass(b: int, rows: list[list[int]]) -> None:
        if graphs:  # a tree graph's inputs keep a chain's tree until a step lays its own
            trees.forward(slots[:b], [context] * b, rows)
            return
        batch = ForwardBatch.build(slots[:b], [context] * b, rows, engine.cache.max_len, engine.device)
        batch.verify = True
        batch.tree_mask, batch.tree_parents = torch.empty_like(batch.positions), torch.zeros_like(batch.positions)
        batch.place_tree(chain_layout(torch.tensor(rows, device=engine.device)[:, 1:]))
        trees.run(batch)

    try:
        for slot in slots:  # every request's context, written once
            runner.forward([slot], [0], [[rng.randrange(vocab) for _ in range(context)]], last_only=True)
        ms, tree_ms = [], []
        for b in bar(batch_sizes, "cost table: batch sizes"):
            row, tree_row = [], []
            for t in tokens:
                rows = [[rng.randrange(vocab) for _ in range(t)] for _ in range(b)]
                row.append(1e3 * median_seconds(lambda: runner.forward(slots[:b], [context] * b, rows),
                                                engine.device, repeats))
                tree_row.append(row[-1] if t == 1 else 1e3 * median_seconds(lambda: tree_pass(b, rows), engine.device,
                                                                            repeats))
            ms.append(tuple(row))
            tree_ms.append(tuple(tree_row))
    finally:
        for slot in slots:
            engine.cache.free(slot)
    return CostTable(key_for(engine.device, engine.checkpoint.source, engine.dtype, engine.exact), tuple(batch_sizes),
                     tuple(tokens), tuple(ms), context, graphs, tuple(tree_ms))


def cost_chart(table: CostTable, path: Path, footer: str) -> Path:
    """ms per pass against rows per request, a line per batch size; and ms per row, which is what a verify
    budget trades."""
    from specpilot.bench.charts import plt, save

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (b, row) in enumerate(zip(table.batch_sizes, table.ms)):
        ax1.plot(table.tokens, row, marker="o", color=f"C{i}", label=f"B={b}")
        ax2.plot(table.tokens, [ms / (b * t) for ms, t in zip(row, table.tokens)], marker="o", color=f"C{i}",
                 label=f"B={b}")
        if table.tree_ms is not None:  # dashed: the same passes as tree-masked verifies
            tree = table.tree_ms[i]
            ax1.plot(table.tokens, tree, "--", color=f"C{i}", label=f"B={b}, tree")
            ax2.plot(table.tokens, [ms / (b * t) for ms, t in zip(tree, table.tokens)], "--", color=f"C{i}")
    for ax, label in ((ax1, "ms per pass"), (ax2, "ms per row")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per request")
        ax.set_ylabel(label)
        ax.legend()
    ax1.set_title(f"cost table: {table.key}")
    return save(fig, path, footer)
