"""Internal. Merging one tensor and writing it: where a merge rule meets a checkpoint writer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .merge_rules import MergeRule
from .safetensors_writer import SafetensorsWriter
from .specs import tensor_bytes
from .writer_base import CheckpointWriter

__all__ = ["MIN_RUN_BYTES", "write_merged"]


#: Shortest run worth placing on its own: below it, one ``cat`` and one write beat many small writes.
MIN_RUN_BYTES = 4096


def write_merged(
    writer: CheckpointWriter,
    name: str,
    rule: MergeRule,
    shards: Sequence[torch.Tensor],
    ranks: Sequence[int] | None = None,
) -> None:
    """Merges the TP shards of one tensor with ``rule`` and writes the result: where a rule meets a writer.

    Shards of a rule that gives byte runs (:meth:`MergeRule.byte_runs`: ``concat``, ``swiglu``) go straight
    to their places in a safetensors file with :meth:`SafetensorsWriter.write_part`, never building the
    merged tensor, when there is one run per shard or every run is at least :data:`MIN_RUN_BYTES`;
    otherwise the merged tensor is built and written. The writer knows nothing of rules.

    Raises:
        MergeError: the rule rejects the shards (tensor and ranks named).
        CheckpointFormatError: as :meth:`CheckpointWriter.write`.
    """
    if len(shards) > 1 and isinstance(writer, SafetensorsWriter):
        shapes = [tuple(t.shape) for t in shards]
        shape = rule.merged_shape(name, shapes, ranks, [t.dtype for t in shards])
        runs = rule.byte_runs(shapes, shards[0].dtype.itemsize)
        if runs is not None and (len(runs) == len(shards) or min(n for _, _, n in runs) >= MIN_RUN_BYTES):
            views = [tensor_bytes(t) for t in shards]
            parts, pos = [], 0
            for shard, start, n in runs:
                parts.append((pos, views[shard][start : start + n]))
                pos += n
            writer.write_part(name, shards[0].dtype, shape, parts)
            return
    writer.write(name, rule.merge(name, shards, ranks))
