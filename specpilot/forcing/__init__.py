"""Token forcing: prove a configuration lossless against stock AR, position by position."""

from specpilot.forcing.forcing import ForcingVerdict, run_forcing

__all__ = ["ForcingVerdict", "run_forcing"]
