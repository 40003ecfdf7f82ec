"""Results of worker threads arrive through call_from_thread; one that lands while its screen is being
taken down (the app closing, a mode switched) finds no widgets to fill, and is dropped."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from textual.css.query import NoMatches

F = TypeVar("F", bound=Callable[..., Any])


def while_shown(method: F) -> F:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.is_attached:
            return None
        try:
            return method(self, *args, **kwargs)
        except NoMatches:
            return None

    return run  # type: ignore[return-value]
