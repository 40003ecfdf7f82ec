"""The app's command line, shared by `specpilot tui` and `python -m specpilot.tui`. Both start without
building the main CLI's other parsers, which import torch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from specpilot.memory import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=DEFAULT_PATH, help="the memory file (default: ./%(default)s)")
    p.add_argument("--server", default="http://127.0.0.1:30000", help="the server's URL (default: %(default)s)")
    p.add_argument("--mode", choices=["rounds", "memory", "server"], default="rounds", help="the first screen")


def run(args: argparse.Namespace) -> int:
    from specpilot.tui.app import SpecPilotApp

    SpecPilotApp(args.db, server=args.server, mode=args.mode).run()
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m specpilot.tui") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


DESCRIPTION = ("A Textual app: start, pause, resume and stop optimizer rounds (each its own process: closing the "
               "app leaves it running), browse the memory, and watch a running server with a streamed, "
               "colour-coded generation.")
