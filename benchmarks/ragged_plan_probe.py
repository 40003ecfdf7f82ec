"""CUDA: which of `ragged`'s plan-stage calls block the host. Each call runs right after ~20 ms of queued GPU work
(torch.cuda._sleep): a call that returns in microseconds queues; one that takes about the queued time waits. On
CPU (no queued work) it times the calls' own cost.

    python benchmarks/ragged_plan_probe.py
"""

import time

import torch

from specpilot.engine.cost_table import CostTable
from specpilot.engine.two_level import VerifyLengths
from specpilot.state.graphs import ragged_token_buckets
from specpilot.state.static_batch import RaggedStaticBatch
from specpilot.state.transfer import HostCopy, to_device

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
n, k = 32, 15
# a table of the H200's shape (docs/results/2026-12-05_h200_s24/force/cost_table.json): rows cost little at first
lv = VerifyLengths(CostTable("probe", (1, 8, 32), (1, 16), ((1.0, 1.1), (1.1, 1.6), (1.6, 3.2)), context=0, graphs=True))
lv.other_ms = 2.5
buckets = ragged_token_buckets(n, k + 1)
conf = torch.rand(n, k, device=dev)
drafts = torch.randint(0, 1000, (n, k), device=dev)
batch = RaggedStaticBatch(n, n * (k + 1), k + 1, dev, 99, 2048, 2048)
slots, starts, firsts = list(range(n)), [100 + i for i in range(n)], [7] * n


def calls():
    lengths = rows = None

    def choose():
        nonlocal lengths, rows
        lengths, rows = lv.choose_rows_ahead(conf, buckets)

    yield "choose_rows_ahead", choose
    yield "learn", lambda: lv.learn([[0, 1]] * n)
    yield "_log_rates", lambda: lv._log_rates(conf)
    yield "select_chains", lambda: lv.select_chains(conf, 200)
    yield "sort", lambda: torch.sort(-conf.flatten(), stable=True)
    yield "index_add_", lambda: torch.zeros(n, dtype=torch.long, device=dev).index_add_(
        0, torch.arange(200, device=dev) // k, torch.ones(200, dtype=torch.long, device=dev))
    yield "HostCopy.of", lambda: HostCopy.of(conf.flatten())
    if dev.type == "cuda":
        yield "pin_memory", lambda: torch.zeros(480).pin_memory()
    yield "to_device x3", lambda: [to_device(v, dev) for v in (slots, starts, firsts)]
    t = [to_device(v, dev) for v in (slots, starts, firsts)]
    yield "lay_out", lambda: batch.lay_out(*t, drafts, lengths, n, rows)


for repeat in range(3):
    for name, call in calls():
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # ~10-20 ms of GPU work queued
        start = time.perf_counter()
        call()
        ms = 1e3 * (time.perf_counter() - start)
        if repeat == 2:
            print(f"{name:18s} {ms:8.3f} ms{'   <- waited' if ms > 2 else ''}")
