"""Token forcing: prove a configuration lossless against stock AR, position by position."""

from specpilot.forcing.forcing import ForcingVerdict, StockRun, run_forcing, run_stock

__all__ = ["ForcingVerdict", "StockRun", "run_forcing", "run_stock"]
