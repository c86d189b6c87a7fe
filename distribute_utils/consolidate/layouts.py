"""Internal. Where the grid interface, the own layout and merge planning were defined before they got modules of
their own; kept for the names imported from here: :mod:`.grid` (the interface every grid format
implements), :mod:`.own_layout` (``mesh.json`` plus one file per rank) and :mod:`.merge_plan`
(:func:`plan_merge`).
"""

from __future__ import annotations

from ..errors import LayoutError
from .grid import global_layer_name
from .merge_plan import MergePlanEntry, plan_merge
from .own_layout import MESH_FILE

__all__ = ["MESH_FILE", "LayoutError", "MergePlanEntry", "global_layer_name", "plan_merge"]
