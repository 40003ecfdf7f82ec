"""The app's own widgets: the gap chart, the accept-length histogram and the token view."""

from specpilot.tui.widgets.bars import GapChart, Histogram
from specpilot.tui.widgets.tokens import ORIGIN_STYLES, TokenView

__all__ = ["ORIGIN_STYLES", "GapChart", "Histogram", "TokenView"]
