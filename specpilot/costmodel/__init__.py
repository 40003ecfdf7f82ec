"""The cost model (DESIGN §8): the device's measured ceilings and the deployment's shapes give each
step's floor and the speedup ceiling; a measured step breakdown minus the floors gives the gaps, ranked
by the speedup they cost."""

from specpilot.costmodel.calibrate import Ceilings, calibrate
from specpilot.costmodel.floors import Floors, Shapes, floors, shapes_of
from specpilot.costmodel.gaps import Gap, Measured, rank_gaps

__all__ = ["Ceilings", "Floors", "Gap", "Measured", "Shapes", "calibrate", "floors", "rank_gaps", "shapes_of"]
