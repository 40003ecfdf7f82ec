"""What long work shows while it runs: start-up phases in the log with their times, and progress bars
(on a terminal only, so logs and pipes stay clean)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("specpilot")
T = TypeVar("T")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Logs `name` when it starts and how long it took when it ends."""
    start = time.perf_counter()
    log.info("%s ...", name)
    yield
    log.info("%s: %.1f s", name, time.perf_counter() - start)


def progress_bars(transient: bool = False) -> Progress:
    """A rich Progress on stderr, drawn only when stderr is a terminal."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=transient, disable=not sys.stderr.isatty())


def bar(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate `items` under a transient progress bar."""
    with progress_bars(transient=True) as progress:
        yield from progress.track(items, total=total, description=description)
