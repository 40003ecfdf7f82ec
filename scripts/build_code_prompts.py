"""Build specpilot/bench/data/code_prompts.jsonl.gz: code-completion prompts for drafter training.

Every public function or method of the Python standard library with a docstring and a real body becomes
one prompt: its signature and docstring, to be completed (the same kind of request as HumanEval, from
code HumanEval does not contain). Order and content are fixed by the stdlib this runs on; the shipped
file was built from CPython 3.11's (PSF license). Training only: there is no bench split.

    python scripts/build_code_prompts.py [--out specpilot/bench/data/code_prompts.jsonl.gz]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "specpilot" / "bench" / "data" / "code_prompts.jsonl.gz"
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
DOC_CHARS = (20, 1000)  # docstrings shorter say nothing, longer ones are reference manuals
MIN_BODY_STATEMENTS = 2  # the docstring and at least one statement
MAX_PROMPT_CHARS = 1500


def stub(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's source from its first decorator through its docstring, dedented."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    text = textwrap.dedent("".join(source_lines[start : node.body[0].end_lineno]))
    return text if len(text) <= MAX_PROMPT_CHARS else None


def functions(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1] and len(node.body) >= MIN_BODY_STATEMENTS:
                if (text := stub(lines, node)) is not None:
                    yield f"{rel.as_posix()}:{node.lineno}:{node.name}", text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    rows = []
    for fid, code in functions(root):
        if code not in seen:
            seen.add(code)
            rows.append({"id": f"stdlib-{fid}", "code": code})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as raw:  # mtime 0: the same stdlib gives the same bytes
        raw.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    print(f"{len(rows)} prompts from {root} (Python {sys.version.split()[0]}) -> {args.out} "
          f"({args.out.stat().st_size / 2**10:.0f} KiB)")


if __name__ == "__main__":
    main()
