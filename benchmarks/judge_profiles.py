"""The sealed evaluator on one profile against another (not against stock): forcing of the candidate, then
interleaved pairs of the two and the paired test. It settles whether a profile the optimizer found beats
the shipped default, which the loop itself only compares through stock.

    python benchmarks/judge_profiles.py --candidate '{"tunables": {"ngram-assist": 3}}' \
        --against '{"tunables": {"ngram-assist": 2}}' [--device cuda] [--dataset humaneval] \
        [--num-prompts 10] [--max-new-tokens 256] [--repeats 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.engine.config import EngineConfig  # noqa: E402
from specpilot.optimizer import remote  # noqa: E402
from specpilot.optimizer.loop import plain_stock  # noqa: E402
from specpilot.optimizer.verdicts import REPEATS, Request  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidate", type=json.loads, required=True, help="a profile, as JSON")
    p.add_argument("--against", type=json.loads, required=True, help="the profile it must beat, as JSON")
    p.add_argument("--device", default="cuda")
    p.add_argument("--speculative-algorithm", default="dflash")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out")
    args = p.parse_args()
    out = out_dir(args.out)
    config, _ = plain_stock(EngineConfig(device=args.device, speculative_algorithm=args.speculative_algorithm,
                                         max_running_requests=1), set())
    profiles = [{"mechanisms": None, **args.candidate}, {"mechanisms": None, **args.against}]
    request = Request(config=config.to_fields(), candidate=profiles[0], stock=profiles[1], dataset=args.dataset,
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    path = out / "request.json"
    path.write_text(json.dumps(asdict(request)))
    proc = subprocess.run([sys.executable, *remote.PYTHON_FLAGS, "-m", "specpilot.optimizer.evaluator", str(path)],
                          cwd=out, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"the evaluator failed:\n{proc.stderr[-2000:]}")
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    write_json(out / "judge_profiles.json", {"candidate": profiles[0], "against": profiles[1], "verdict": verdict})
    print(json.dumps({k: verdict[k] for k in ("accepted", "reason", "speedup", "noise_band")}, indent=2))


if __name__ == "__main__":
    main()
