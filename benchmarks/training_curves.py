"""Drafter training runs side by side: each run's validation curves (the chain's tau and the top-4 tree's, against
epochs; a continued drafter's starting validation at 0) and its training loss (per step, smoothed), from the
training.json each `specpilot train-drafter` run writes, in one PNG and one JSON. Recipe variants trained on the
same data (benchmarks/gpu_drafter.sh variants) are compared this way.

    python3 benchmarks/training_curves.py NAME=RUN_DIR [NAME=RUN_DIR ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.training.train import VALIDATION_TOPK  # noqa: E402

TREE_KEY = f"tau_top{VALIDATION_TOPK}"
SMOOTHING = 50  # steps per point of the loss curve


def curves(report: dict) -> dict:
    """A run's figures to plot: validation taus per epoch, the loss averaged over SMOOTHING steps, the summary."""
    validation = report.get("validation") or []
    losses = report.get("step_losses") or []
    window = max(1, min(SMOOTHING, len(losses) // 20 or 1))
    smoothed = [sum(losses[i : i + window]) / len(losses[i : i + window]) for i in range(0, len(losses), window)]
    tree = [v.get(TREE_KEY) for v in validation]
    best = max(range(len(tree)), key=lambda i: tree[i] or 0.0) + 1 if tree else None
    best = report.get("best_epoch", best)
    start = report.get("start_validation")
    return {
        "epoch": validation_epochs(report), "tau": [v["tau"] for v in validation], "tree_tau": tree,
        "start": None if start is None else {"tau": start["tau"], "tree_tau": start.get(TREE_KEY)},
        "loss_steps": list(range(0, len(losses), window)), "loss": smoothed,
        "best_epoch": best, "stopped_early": report.get("stopped_early"),
        "parameters": report.get("draft", {}).get("parameters"),
        "recipe": {k: report["args"].get(k) for k in ("distill", "rank_loss", "rank_topk", "num_layers",
                                                      "intermediate_size", "num_taps", "lr", "epochs", "patience")
                   if k in report.get("args", {})},
    }


def validation_epochs(report: dict) -> list[float]:
    """Where each validation sits, in epochs: its step over the steps of an epoch (runs from before validations
    carried their step validated at each epoch's end)."""
    validation = report.get("validation") or []
    epochs = report.get("args", {}).get("epochs")
    if not epochs or not all("step" in v for v in validation):
        return list(range(1, len(validation) + 1))
    per_epoch = report["total_steps"] / epochs
    return [round(v["step"] / per_epoch, 3) for v in validation]


def chart(runs: dict[str, dict], path: Path) -> None:
    validated = any(run["tau"] for run in runs.values())  # a run without validations draws its loss alone
    fig, axes = plt.subplots(1, 2 if validated else 1, figsize=(12 if validated else 7, 4.5), squeeze=False)
    taus, loss = axes[0] if validated else (None, axes[0][0])
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i}"
        if run["parameters"]:
            name = f"{name} ({run['parameters'] * 2 / 1e6:.1f} MB bf16)"
        if taus is not None:
            epochs, chain, tree = run["epoch"], run["tau"], run["tree_tau"]
            if run["start"]:  # a continued drafter starts from its validation at step 0
                epochs, chain, tree = [0, *epochs], [run["start"]["tau"], *chain], [run["start"]["tree_tau"], *tree]
            taus.plot(epochs, chain, "--", color=color, label=f"{name}: chain")
            if any(t is not None for t in tree):
                taus.plot(epochs, tree, "-", color=color, label=f"{name}: top-{VALIDATION_TOPK} tree")
            if run["best_epoch"]:
                taus.axvline(run["epoch"][run["best_epoch"] - 1], color=color, alpha=0.25)
        loss.plot(run["loss_steps"], run["loss"], color=color, label=name)
    if taus is not None:
        taus.set(xlabel="epoch", ylabel="validation tau (chained as decoding)", title="validation")
        taus.xaxis.set_major_locator(MaxNLocator(integer=True))
        taus.legend(fontsize=8)
    loss.set(xlabel="step", ylabel="training loss", title="training loss (smoothed)")
    loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run(spec: str) -> tuple[str, Path]:
    name, sep, directory = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=RUN_DIR, got {spec!r}")
    path = Path(directory) / "training.json"
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{name}: {path} does not exist (a train-drafter run writes it)")
    return name, path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=_run, help="NAME=RUN_DIR of each train-drafter run")
    parser.add_argument("--out", default=None, help="directory for training_curves.{png,json} (default $OUT)")
    args = parser.parse_args(argv)
    runs = {name: curves(json.loads(path.read_text())) for name, path in args.runs}
    out = out_dir(args.out)
    chart(runs, out / "training_curves.png")
    write_json(out / "training_curves.json", runs)
    for name, run in runs.items():
        tree = run["tree_tau"][-1] if run["tree_tau"] else None
        print(f"{name}: {len(run['tau'])} validations, last tau {run['tau'][-1] if run['tau'] else None}, "
              f"tree {tree}, best epoch {run['best_epoch']}")
    print(f"wrote {out / 'training_curves.png'}")


if __name__ == "__main__":
    main()
