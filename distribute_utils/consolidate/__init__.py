"""Checkpoint consolidation building blocks: merge rules, streaming writers, input layouts, synthetic models.

* :mod:`.rules`: :class:`MergeRule` (``Concat``, ``Max``, ``Sum``, ``Same``, ``First``, ``ScalarMax``) and
  :class:`RuleTable` (ordered globs, rules files, Megatron/ModelOpt defaults);
* :mod:`.writers`: :class:`SafetensorsWriter` / :class:`TorchSaveWriter`, one tensor at a time, atomic;
  :func:`load_safetensors` (zero-copy mmap reader);
* :mod:`.layouts`: :func:`open_checkpoint` for the own ``mesh.json`` layout and Megatron-LM legacy
  checkpoints, :func:`plan_merge` from metadata;
* :mod:`.synthetic`: deterministic GPT-like state dicts and their TP x PP sharding.
"""

from __future__ import annotations

from .layouts import (
    MEGATRON_FILE,
    MESH_FILE,
    CheckpointLayout,
    LayoutError,
    MegatronLegacyLayout,
    MergePlanEntry,
    MeshLayout,
    global_layer_name,
    open_checkpoint,
    plan_merge,
    safe_torch_load,
    write_megatron_legacy,
    write_own_layout,
)
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
    parse_rule,
    quantized_rule,
)
from .synthetic import (
    SyntheticDims,
    balanced_layers_per_stage,
    gpt_specs,
    make_gpt_state_dict,
    shard_state_dict,
    synthetic_size_for,
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
    "DTYPE_TO_SAFETENSORS",
    "MEGATRON_FILE",
    "MESH_FILE",
    "QUANT_FORMATS",
    "ROW_PARALLEL_LAYERS",
    "RULE_NAMES",
    "SAFETENSORS_TO_DTYPE",
    "SCALE_SUFFIXES",
    "CheckpointFormatError",
    "CheckpointLayout",
    "CheckpointWriter",
    "Concat",
    "First",
    "LayoutError",
    "Max",
    "MegatronLegacyLayout",
    "MergeError",
    "MergePlanEntry",
    "MergeRule",
    "MeshLayout",
    "RuleSyntaxError",
    "RuleTable",
    "SafetensorsWriter",
    "Same",
    "ScalarMax",
    "Sum",
    "SyntheticDims",
    "TensorSpec",
    "TorchSaveWriter",
    "balanced_layers_per_stage",
    "global_layer_name",
    "gpt_specs",
    "load_safetensors",
    "make_gpt_state_dict",
    "open_checkpoint",
    "open_writer",
    "parse_rule",
    "parse_size",
    "plan_merge",
    "quantized_rule",
    "read_safetensors_metadata",
    "read_safetensors_specs",
    "safe_torch_load",
    "safetensors_dtype",
    "shard_state_dict",
    "synthetic_size_for",
    "write_megatron_legacy",
    "write_own_layout",
]
