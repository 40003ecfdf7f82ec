"""Token forcing of SPECPILOT inside SGLang against SGLang's own AR on the same server args (issue 23's forcing; inside
`benchmarks/sglang_ferry.sh run`): SGLang AR stays up while each candidate server runs beside it, and
specpilot/forcing/served.py forces the candidate along AR's greedy tokens on every prompt — both servers continue the
same input at every segment, one request at a time — with a tie band of 0 by default: any position where the
candidate's token differs from AR's fails, whatever AR's margin there (reported beside).

    python benchmarks/sglang_force.py --model-path /tmp/smollm2 [--candidate specpilot specpilot-chain ngram dflash]
        [--dataset humaneval] [--num-prompts 8] [--max-new-tokens 128] [--tie-band 0] [--deterministic]
        [--attention-backend triton|flashinfer]
        [--temperature 0.8 --top-p 0.95 --sampling-seed 1] --out DIR

Candidates: this script's (`specpilot-chain`: the plugin drafting chains, its n-gram assistance at the default) and
sglang_plugin_serving.py's SGLang servers (`specpilot`: trees of top-4; SGLang's own `ngram` and `dflash`, forced for
comparison: SGLang does not claim them bitwise AR's). Writes DIR/sglang_force.json; exit code 1 when a SPECPILOT
candidate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_plugin_serving import BASE, SERVERS, add_kernel_arguments, launch, server_flags  # noqa: E402

from specpilot.bench import provenance  # noqa: E402
from specpilot.bench.datasets import DATASETS, apply_chat_template, load_prompts  # noqa: E402
from specpilot.drafters import EMBEDDED_DRAFTER  # noqa: E402
from specpilot.forcing.served import force_served, remembered, sglang_generate  # noqa: E402
from specpilot.models.checkpoint import load_tokenizer  # noqa: E402

CANDIDATES = SERVERS | {
    "specpilot-chain": f"{BASE} --speculative-algorithm SPECPILOT --speculative-draft-model-path {EMBEDDED_DRAFTER}",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="a Hugging Face model directory SGLang loads")
    ap.add_argument("--candidate", nargs="+", default=["specpilot", "specpilot-chain"],
                    choices=[name for name in CANDIDATES if name != "ar"])
    ap.add_argument("--dataset", default="humaneval", choices=DATASETS)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tie-band", type=float, default=0.0,
                    help="AR's top-1 minus top-2 logprob at or under which a differing token counts as a tie")
    ap.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled, with --sampling-seed")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--sampling-seed", type=int, default=1,
                    help="the requests' seed where sampled (SGLang draws keyed by it under --deterministic)")
    add_kernel_arguments(ap)
    ap.add_argument("--mem-fraction-static", type=float, default=0.35,
                    help="each server's share of GPU memory (two run side by side; less leaves room for other work)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # without prefill CUDA graphs: the first launch on a machine spends minutes compiling their kernels, and
    # forcing checks tokens, not prefill speed (both servers alike)
    extra = " --disable-prefill-cuda-graph"
    # seeded draws need SGLang's torch sampling backend (its FlashInfer one refuses a seed)
    extra += " --sampling-backend pytorch" if args.temperature > 0 else ""
    sampling = ({"temperature": args.temperature, "top_p": args.top_p, "sampling_seed": args.sampling_seed}
                if args.temperature > 0 else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model_path)
    prompts = [apply_chat_template(tokenizer, p) for p in load_prompts(args.dataset, args.num_prompts)]
    report: dict = {"provenance": provenance.collect(None, None), "dataset": args.dataset,
                    "max_new_tokens": args.max_new_tokens, "tie_band": args.tie_band,
                    "deterministic": args.deterministic, "sampling": sampling, "candidates": {}}
    failed = []
    flags = {name: server_flags(f, args) + extra for name, f in CANDIDATES.items()}
    ar = launch(args.model_path, flags["ar"], out / "ar.server.log", args.mem_fraction_static)
    try:
        reference = remembered(sglang_generate(ar.http(), with_margins=True, sampling=sampling))
        for name in args.candidate:
            ours = "SPECPILOT" in CANDIDATES[name]  # SGLang's own are forced for comparison, not held to pass
            entry = report["candidates"][name] = {"flags": flags[name]}
            try:
                server = launch(args.model_path, entry["flags"], out / f"{name}.server.log",
                                args.mem_fraction_static)
            except (RuntimeError, TimeoutError) as err:
                entry["error"] = str(err)[-3000:]
                print(f"{name}: did not start: {str(err)[-500:]}", flush=True)
                if ours:
                    failed.append(name)
                continue
            try:
                candidate = sglang_generate(server.http(), with_margins=False, sampling=sampling)
                verdict = force_served(reference, candidate, prompts, args.max_new_tokens, args.tie_band)
            finally:
                server.close()
            entry["verdict"] = verdict.as_dict()
            if not verdict.passed and ours:
                failed.append(name)
            print(f"{name}: {'passed' if verdict.passed else 'FAILED'} — {verdict.positions_checked} positions, "
                  f"{verdict.non_tie_mismatches} mismatches beyond the band, {verdict.tie_mismatches} within it, "
                  f"{verdict.identical_unforced} of {len(prompts)} prompts identical unforced", flush=True)
            (out / "sglang_force.json").write_text(json.dumps(report, indent=2))
    finally:
        ar.close()
    (out / "sglang_force.json").write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
