"""Internal. Planning a consolidation from metadata alone: every output tensor, where its shards are, its rule and
its merged spec (:func:`plan_merge`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import LayoutError
from .merge_rules import MergeRule
from .rule_table import RuleTable
from .specs import TensorSpec

__all__ = ["MergePlanEntry", "PlannedLayout", "plan_merge"]


class PlannedLayout(Protocol):
    """What :func:`plan_merge` reads of a checkpoint (:class:`~.grid.CheckpointLayout` is one)."""

    tp: int
    gated_mlp: bool | None

    @property
    def stages(self) -> int: ...

    def shard_specs(self, tp_rank: int, stage: int) -> list[TensorSpec]: ...

    def describe_stage(self, stage: int) -> str: ...

    def file_for(self, tp_rank: int, stage: int) -> Path: ...

    def is_replica(self, local: str, stage: int) -> bool: ...

    def global_name(self, name: str, stage: int) -> str: ...


@dataclass(frozen=True)
class MergePlanEntry:
    """One output tensor: where its shards are and how to merge them.

    Attributes:
        name: global (renumbered) name in the output.
        pp_rank: the stage (grid row, see :class:`~.grid.CheckpointLayout`) holding it.
        local_name: its name inside that stage's shard files.
        rule: the merge rule over the stage's TP shards.
        spec: the merged tensor's spec (``spec.name == name``).
    """

    name: str
    pp_rank: int
    local_name: str
    rule: MergeRule
    spec: TensorSpec


def plan_merge(layout: PlannedLayout, rules: RuleTable | None = None) -> list[MergePlanEntry]:
    """Plans a consolidation from metadata alone, stage by stage, in file order.

    Checks that every TP rank of a stage holds the same names, that the rule accepts their dtypes and
    shapes, and that no global name comes from two stages. What a stage holds as a replica of another
    stage's tensor (:meth:`~.grid.CheckpointLayout.is_replica`) is left out.

    Args:
        layout: the opened checkpoint.
        rules: merge rules; ``RuleTable.default()`` for the layout's MLP kind when ``None``.

    Raises:
        LayoutError: names differ between TP ranks, or a name appears on two stages.
        MergeError: a rule rejects the shards' shapes or dtypes, or no rule is known for a split tensor.
    """
    table = rules if rules is not None else RuleTable.default(gated=layout.gated_mlp)
    plan: list[MergePlanEntry] = []
    seen: dict[str, int] = {}
    ranks_tp = list(range(layout.tp))
    for s in range(layout.stages):
        per_rank = [{spec.name: spec for spec in layout.shard_specs(t, s)} for t in ranks_tp]
        names = list(per_rank[0])
        for t in ranks_tp[1:]:
            if set(per_rank[t]) != set(names):
                missing = sorted(set(names) - set(per_rank[t]))[:5]
                extra = sorted(set(per_rank[t]) - set(names))[:5]
                raise LayoutError(
                    f"{layout.describe_stage(s)}: TP rank {t} holds different tensors than TP rank 0 "
                    f"(missing {missing}, extra {extra}) in '{layout.file_for(t, s)}'"
                )
        for local in names:
            if layout.is_replica(local, s):
                continue
            name = layout.global_name(local, s)
            if name in seen:
                raise LayoutError(
                    f"tensor '{name}' comes from {layout.describe_stage(seen[name])} and "
                    f"{layout.describe_stage(s)}; check layers_per_stage (or, for tied embeddings, the "
                    "checkpoint's untie_embeddings_and_output_weights)"
                )
            seen[name] = s
            rule = table.rule_for(name)
            spec = rule.merged_spec(name, [per_rank[t][local] for t in ranks_tp], ranks_tp)
            plan.append(MergePlanEntry(name, s, local, rule, spec))
    return plan
