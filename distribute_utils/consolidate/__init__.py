"""Checkpoint consolidation building blocks: merge rules, streaming writers, input layouts, synthetic models.

* :mod:`.rules`: :class:`MergeRule` (``Concat``, ``Max``, ``Sum``, ``Same``, ``First``, ``ScalarMax``) and
  :class:`RuleTable` (ordered globs, rules files, Megatron/ModelOpt defaults);
* :mod:`.writers`: :class:`SafetensorsWriter` / :class:`TorchSaveWriter`, one tensor at a time, atomic;
  :func:`load_safetensors` (through `safetensors.safe_open`, memory-mapped);
* :mod:`.layouts`: the grid interface (:class:`CheckpointLayout`), the own ``mesh.json`` layout and
  :func:`plan_merge` from metadata; :mod:`.megatron`: Megatron-LM legacy checkpoints (``args`` read);
  :mod:`.dcp`: torch.distributed.checkpoint / Megatron torch_dist, read in batches; :mod:`.formats`:
  :func:`open_checkpoint` recognises them all; :mod:`.safe_load`: ``torch.load`` that runs no pickled code;
* :mod:`.synthetic`: deterministic GPT-like state dicts and their TP x PP sharding (tests, benchmarks);
* :mod:`.tp_pp`: :func:`consolidate_checkpoint`, the distributed driver (every rank reads its own shard,
  TP groups merge, stages stream to rank 0, which writes), and :func:`consolidate_local` (spawns the ranks).

The names below are what users call; constants, test writers and helpers stay in their modules
(``from distribute_utils.consolidate.synthetic import make_gpt_state_dict``).
"""

from __future__ import annotations

from ..errors import CheckpointFormatError, ConversionError, LayoutError, MergeError, RuleSyntaxError
from .dcp import DcpCheckpoint
from .formats import Checkpoint, open_checkpoint
from .grid import CheckpointLayout
from .megatron import MegatronLegacyLayout
from .merge_plan import MergePlanEntry
from .merge_rules import Concat, First, Max, MergeRule, Same, ScalarMax, Sum, Unknown, parse_rule
from .merge_write import write_merged
from .own_layout import OwnLayout, write_own_layout
from .rule_table import RuleTable
from .safe_load import UnsafeCheckpointError, safe_torch_load
from .safetensors_read import load_safetensors
from .safetensors_writer import SafetensorsWriter
from .specs import TensorSpec
from .torch_writer import TorchSaveWriter
from .tp_pp import (
    ConsolidationError,
    ConsolidationReport,
    consolidate_checkpoint,
    consolidate_local,
    plan_checkpoint,
)
from .writers import open_writer

__all__ = [
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointLayout",
    "Concat",
    "ConsolidationError",
    "ConsolidationReport",
    "ConversionError",
    "DcpCheckpoint",
    "First",
    "LayoutError",
    "Max",
    "MegatronLegacyLayout",
    "MergeError",
    "MergePlanEntry",
    # merge rules
    "MergeRule",
    "OwnLayout",
    "RuleSyntaxError",
    "RuleTable",
    # output
    "SafetensorsWriter",
    "Same",
    "ScalarMax",
    "Sum",
    "TensorSpec",
    "TorchSaveWriter",
    "Unknown",
    "UnsafeCheckpointError",
    # the driver and its errors
    "consolidate_checkpoint",
    "consolidate_local",
    "load_safetensors",
    # inputs
    "open_checkpoint",
    "open_writer",
    "parse_rule",
    "plan_checkpoint",
    "safe_torch_load",
    "write_merged",
    "write_own_layout",
]
