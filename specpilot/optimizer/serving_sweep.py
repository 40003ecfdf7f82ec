"""`specpilot bench --serving --sweep`: the same serving load against several server settings (AR, stock
speculation, every mechanism that holds, or any flags) at a list of concurrencies, each setting's server
started here in turn (optimizer/remote.py), warmed up, then loaded by `bench --serving`'s client. One JSON,
one table and one chart (throughput and TPOT against concurrency, a line per setting)."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from specpilot.bench import provenance
from specpilot.bench.output import bench_output_dir
from specpilot.bench.serving import ServingBenchConfig, run_serving_bench
from specpilot.optimizer.remote import Server
from specpilot.progress import bar

DEFAULT_CONCURRENCY = (1, 4, 8, 16, 32, 64)
# name -> the flags a setting adds to --serve-flags (the last of a repeated flag wins)
DEFAULT_SETTINGS = {"ar": "--speculative-algorithm none", "stock": "--mechanisms stock", "all": ""}


def parse_settings(specs: list[str] | None) -> dict[str, str]:
    """`NAME=FLAGS` items (--setting) as {name: flags}; none given: DEFAULT_SETTINGS."""
    if not specs:
        return dict(DEFAULT_SETTINGS)
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--setting takes NAME=FLAGS (e.g. ar='--speculative-algorithm none'), got {spec!r}")
        if name.strip() in out:
            raise ValueError(f"--setting: {name.strip()!r} is named twice")
        out[name.strip()] = flags
    return out


def run_sweep(settings: dict[str, str], serve_flags: str, concurrencies: list[int], base: ServingBenchConfig,
              out: Path, warmup_prompts: int = 8) -> dict[str, Any]:
    """Per setting: start `specpilot serve SERVE_FLAGS SETTING_FLAGS`, send `warmup_prompts` (not reported),
    then at each concurrency max(base.num_prompts, 2 x C) prompts, with the scheduler's time in prefill steps,
    decode steps and publishing during each run; the report as it stands is written after every run."""
    report: dict[str, Any] = {"provenance": provenance.collect(None, None), "serve_flags": serve_flags,
                              "client": {k: v for k, v in vars(base).items() if k != "base_url"}
                              | {"request_rate": str(base.request_rate)},
                              "concurrency": concurrencies, "settings": {}}
    for name, flags in settings.items():
        try:
            server = Server.launch([*shlex.split(serve_flags), *shlex.split(flags)], out / f"{name}.server.log").ready()
        except (RuntimeError, TimeoutError) as err:  # bad flags: the server's own message, naming the setting
            raise ValueError(f"--setting {name} ({flags!r}): {err}") from err
        try:
            url = f"http://127.0.0.1:{server.port}"
            info = server.http().get("/get_server_info").json()
            report["provenance"]["dtype"] = report["provenance"]["dtype"] or info.get("dtype")
            runs: list[dict[str, Any]] = []
            report["settings"][name] = {"flags": flags, "speculative_algorithm": info.get("speculative_algorithm"),
                                        "speed": info.get("speed"), "runs": runs}
            if warmup_prompts:
                run_serving_bench(replace(base, base_url=url, num_prompts=warmup_prompts,
                                          max_concurrency=max(concurrencies)))
            for c in bar(concurrencies, f"{name}: concurrency"):
                cfg = replace(base, base_url=url, max_concurrency=c, num_prompts=max(base.num_prompts, 2 * c))
                before = _step_time(server)
                summary = run_serving_bench(cfg)[0]["summary"]
                after = _step_time(server)
                clock = {k: {"count": v["count"] - before[k]["count"], "seconds": v["seconds"] - before[k]["seconds"]}
                         for k, v in after.items()}
                runs.append({"concurrency": c, "num_prompts": cfg.num_prompts, "summary": summary,
                             "scheduler_time": clock})
                (out / "sweep.json").write_text(json.dumps(report, indent=2))
        finally:
            server.close()
    return report


def _step_time(server: Server) -> dict[str, dict[str, float]]:
    """The server's scheduler time by what it did (prefill steps, decode steps, publishing) since it started."""
    return server.http().get("/get_server_info").json()["internal_states"][0]["step_time"]


def sweep_chart(report: dict[str, Any], path: Path) -> Path:
    """Output throughput, its ratio to the first setting's and median TPOT against concurrency, one line per
    setting."""
    from specpilot.bench.charts import plt, save

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    first = next(iter(report["settings"]), None)
    base = {} if first is None else {r["concurrency"]: r["summary"]["output_throughput"]
                                     for r in report["settings"][first]["runs"]}
    for name, setting in report["settings"].items():
        cs = [r["concurrency"] for r in setting["runs"]]
        ax1.plot(cs, [r["summary"]["output_throughput"] for r in setting["runs"]], marker="o", label=name)
        shared = [r for r in setting["runs"] if base.get(r["concurrency"])]
        ax2.plot([r["concurrency"] for r in shared],
                 [r["summary"]["output_throughput"] / base[r["concurrency"]] for r in shared], marker="o", label=name)
        ax3.plot(cs, [r["summary"]["tpot_ms"]["p50"] or 0.0 for r in setting["runs"]], marker="o", label=name)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    for ax, label in ((ax1, "output tokens/s"), (ax2, f"output tokens/s ÷ {first}'s"), (ax3, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    eos = "ignore EOS" if report["client"].get("ignore_eos", True) else "stop at EOS"
    ax1.set_title(f"specpilot bench --serving --sweep ({eos})")
    return save(fig, path, provenance.label(report["provenance"]))


def sweep_table(report: dict[str, Any]) -> Any:
    """A row per concurrency: each setting's throughput (and its ratio to the first setting's), TPOT, TTFT and
    accept length."""
    from rich.table import Table

    names = list(report["settings"])
    table = Table(title="serving sweep (output tok/s, x the first setting; median TPOT / TTFT ms; accept length)")
    table.add_column("C", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    by_c = {name: {r["concurrency"]: r["summary"] for r in s["runs"]} for name, s in report["settings"].items()}
    for c in report["concurrency"]:
        cells = []
        first = by_c[names[0]].get(c)
        for name in names:
            s = by_c[name].get(c)
            if s is None:
                cells.append("-")
                continue
            ratio = f" ({s['output_throughput'] / first['output_throughput']:.2f}x)" if first and name != names[0] \
                and first["output_throughput"] else ""
            accept = s["accept_length"]
            cells.append(f"{s['output_throughput']:.0f}{ratio}  {s['tpot_ms']['p50'] or 0:.1f} / "
                         f"{s['ttft_ms']['p50'] or 0:.0f}  {'-' if accept is None else f'{accept:.2f}'}")
        table.add_row(str(c), *cells)
    return table


def run_from_args(args: argparse.Namespace) -> int:
    from rich.console import Console

    settings = parse_settings(args.setting)
    base = ServingBenchConfig(backend=args.backend, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                              request_rate=args.request_rate, ignore_eos=not args.disable_ignore_eos, seed=args.seed,
                              client_processes=args.client_processes)
    out = bench_output_dir(args.output_dir)
    report = run_sweep(settings, args.serve_flags, args.concurrency or list(DEFAULT_CONCURRENCY), base, out,
                       args.warmup_prompts)
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    sweep_chart(report, out / "sweep.png")
    Console().print(sweep_table(report))
    print(f"results in {out}/: sweep.json, sweep.png, a server log per setting")
    failed = sum(r["summary"]["failed"] for s in report["settings"].values() for r in s["runs"])
    return 0 if not failed else 1
