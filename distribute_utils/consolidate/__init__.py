"""Checkpoint consolidation building blocks: merge rules, streaming writers, input layouts, synthetic models.

* :mod:`.rules`: :class:`MergeRule` (``Concat``, ``Max``, ``Sum``, ``Same``, ``First``, ``ScalarMax``) and
  :class:`RuleTable` (ordered globs, rules files, Megatron/ModelOpt defaults);
* :mod:`.writers`: :class:`SafetensorsWriter` / :class:`TorchSaveWriter`, one tensor at a time, atomic;
  :func:`load_safetensors` (zero-copy mmap reader);
* :mod:`.layouts`: the grid interface (:class:`CheckpointLayout`), the own ``mesh.json`` layout and
  :func:`plan_merge` from metadata; :mod:`.megatron`: Megatron-LM legacy checkpoints (``args`` read);
  :mod:`.dcp`: torch.distributed.checkpoint / Megatron torch_dist, read in batches; :mod:`.formats`:
  :func:`open_checkpoint` recognises them all; :mod:`.safe_load`: ``torch.load`` that runs no pickled code;
* :mod:`.synthetic`: deterministic GPT-like state dicts and their TP x PP sharding;
* :mod:`.tp_pp`: :func:`consolidate_checkpoint`, the distributed driver (every rank reads its own shard,
  TP groups merge, stages stream to rank 0, which writes), and :func:`consolidate_local` (spawns the ranks).
"""

from __future__ import annotations

from .dcp import DCP_METADATA, MEGATRON_NAMES, DcpCheckpoint
from .formats import Checkpoint, open_checkpoint
from .layouts import (
    MESH_FILE,
    CheckpointLayout,
    LayoutError,
    MergePlanEntry,
    OwnLayout,
    global_layer_name,
    plan_merge,
    write_own_layout,
)
from .megatron import MEGATRON_FILE, MegatronArgs, MegatronLegacyLayout, write_megatron_legacy
from .rules import (
    COLUMN_PARALLEL_LAYERS,
    QUANT_FORMATS,
    ROW_PARALLEL_LAYERS,
    RULE_NAMES,
    SCALE_SUFFIXES,
    Concat,
    First,
    Max,
    MergeError,
    MergeRule,
    RuleSyntaxError,
    RuleTable,
    Same,
    ScalarMax,
    Sum,
    Unknown,
    parse_rule,
    quantized_rule,
)
from .safe_load import StandIn, UnsafeCheckpointError, safe_torch_load
from .synthetic import (
    SyntheticDims,
    balanced_layers_per_stage,
    gpt_specs,
    make_gpt_state_dict,
    shard_state_dict,
    synthetic_size_for,
)
from .tp_pp import (
    DEFAULT_BATCH_BYTES,
    OUTPUT_FORMATS,
    ConsolidationError,
    ConsolidationReport,
    consolidate_checkpoint,
    consolidate_local,
    peak_rss_bytes,
    plan_checkpoint,
    resolve_rules,
)
from .writers import (
    DTYPE_TO_SAFETENSORS,
    SAFETENSORS_TO_DTYPE,
    CheckpointFormatError,
    CheckpointWriter,
    SafetensorsWriter,
    TensorSpec,
    TorchSaveWriter,
    load_safetensors,
    open_writer,
    parse_size,
    read_safetensors_metadata,
    read_safetensors_specs,
    safetensors_dtype,
)

__all__ = [
    "COLUMN_PARALLEL_LAYERS",
    "DCP_METADATA",
    "DEFAULT_BATCH_BYTES",
    "DTYPE_TO_SAFETENSORS",
    "MEGATRON_FILE",
    "MEGATRON_NAMES",
    "MESH_FILE",
    "OUTPUT_FORMATS",
    "QUANT_FORMATS",
    "ROW_PARALLEL_LAYERS",
    "RULE_NAMES",
    "SAFETENSORS_TO_DTYPE",
    "SCALE_SUFFIXES",
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointLayout",
    "CheckpointWriter",
    "Concat",
    "ConsolidationError",
    "ConsolidationReport",
    "DcpCheckpoint",
    "First",
    "LayoutError",
    "Max",
    "MegatronArgs",
    "MegatronLegacyLayout",
    "MergeError",
    "MergePlanEntry",
    "MergeRule",
    "OwnLayout",
    "RuleSyntaxError",
    "RuleTable",
    "SafetensorsWriter",
    "Same",
    "ScalarMax",
    "StandIn",
    "Sum",
    "SyntheticDims",
    "TensorSpec",
    "TorchSaveWriter",
    "Unknown",
    "UnsafeCheckpointError",
    "balanced_layers_per_stage",
    "consolidate_checkpoint",
    "consolidate_local",
    "global_layer_name",
    "gpt_specs",
    "load_safetensors",
    "make_gpt_state_dict",
    "open_checkpoint",
    "open_writer",
    "parse_rule",
    "parse_size",
    "peak_rss_bytes",
    "plan_checkpoint",
    "plan_merge",
    "quantized_rule",
    "read_safetensors_metadata",
    "read_safetensors_specs",
    "resolve_rules",
    "safe_torch_load",
    "safetensors_dtype",
    "shard_state_dict",
    "synthetic_size_for",
    "write_megatron_legacy",
    "write_own_layout",
]
