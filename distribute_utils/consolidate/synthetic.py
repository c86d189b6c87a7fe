"""Synthetic GPT-like checkpoints with Megatron-core names, and TP x PP sharding of them.

Used by the demo, the tests and the consolidation benchmark: :func:`make_gpt_state_dict` builds a
deterministic state dict (optionally with ModelOpt quantization scales), :func:`shard_state_dict` splits
it the way Megatron would store it, so that merging the shards with the same rules must give the original
back bit for bit, and :func:`synthetic_size_for` picks dimensions for a target size.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import ArgumentError
from .grid import global_layer_name, local_layer_index
from .quant_rules import check_quant_format
from .rule_table import RuleTable
from .specs import TensorSpec

__all__ = [
    "SyntheticDims",
    "balanced_layers_per_stage",
    "gpt_specs",
    "make_gpt_state_dict",
    "shard_state_dict",
    "synthetic_size_for",
]

logger = logging.getLogger(__name__)

# (layer path inside a decoder layer, parallel kind, (out, in) as names of dimensions)
_LINEARS: tuple[tuple[str, str, tuple[str, str]], ...] = (
    ("self_attention.linear_qkv", "column", ("qkv", "hidden")),
    ("self_attention.linear_proj", "row", ("hidden", "hidden")),
    ("mlp.linear_fc1", "column", ("ffn", "hidden")),
    ("mlp.linear_fc2", "row", ("hidden", "ffn")),
)


def _weight_dtype(quant_format: str | None, dtype: torch.dtype) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "int8_sq": torch.int8}.get(quant_format or "", dtype)


def gpt_specs(
    num_layers: int,
    hidden: int,
    ffn_hidden: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    quant_format: str | None = None,
    awq_group_size: int = 8,
) -> list[TensorSpec]:
    """The tensors of :func:`make_gpt_state_dict`, in order, without creating them.

    Names follow Megatron core (local spec): ``embedding.word_embeddings.weight``,
    ``decoder.layers.<i>.{input_layernorm,pre_mlp_layernorm}.{weight,bias}``,
    ``decoder.layers.<i>.self_attention.{linear_qkv,linear_proj}.{weight,bias}``,
    ``decoder.layers.<i>.mlp.{linear_fc1,linear_fc2}.{weight,bias}``, ``decoder.final_layernorm.*``,
    ``output_layer.weight``. With ``quant_format`` each decoder linear layer also has
    ``weight_scale``/``activation_scale`` (and ``pre_quant_scale`` for int8_sq / int4_awq):

    * ``fp8``: weight float8_e4m3fn, scalar float32 scales;
    * ``int8_sq``: weight int8, per-output-channel float32 weight scale ``[out]``, scalar activation scale,
      per-input-channel pre-quant scale ``[in]``;
    * ``int4_awq``: weight in ``dtype``, per-block weight scale ``[out, in / awq_group_size]``, scalar
      activation scale, pre-quant scale ``[in]``.
    """
    check_quant_format(quant_format)
    if min(num_layers, hidden, ffn_hidden, vocab) < 1:
        raise ArgumentError(
            f"num_layers, hidden, ffn_hidden and vocab must be positive, got {num_layers}, {hidden}, {ffn_hidden}, "
            f"{vocab}"
        )
    if quant_format == "int4_awq" and (hidden % awq_group_size or ffn_hidden % awq_group_size):
        raise ArgumentError(
            f"int4_awq needs hidden and ffn_hidden divisible by awq_group_size={awq_group_size}"
        )
    dims = {"hidden": hidden, "ffn": ffn_hidden, "qkv": 3 * hidden}
    f32 = torch.float32
    specs = [TensorSpec("embedding.word_embeddings.weight", dtype, (vocab, hidden))]
    for i in range(num_layers):
        pre = f"decoder.layers.{i}."
        for norm, linears in (("input_layernorm", _LINEARS[:2]), ("pre_mlp_layernorm", _LINEARS[2:])):
            specs += [
                TensorSpec(f"{pre}{norm}.weight", dtype, (hidden,)),
                TensorSpec(f"{pre}{norm}.bias", dtype, (hidden,)),
            ]
            for layer, _parallel, (out_dim, in_dim) in linears:
                out, inp = dims[out_dim], dims[in_dim]
                name = pre + layer
                specs.append(TensorSpec(f"{name}.weight", _weight_dtype(quant_format, dtype), (out, inp)))
                specs.append(TensorSpec(f"{name}.bias", dtype, (out,)))
                if quant_format == "fp8":
                    specs += [
                        TensorSpec(f"{name}.weight_scale", f32, ()),
                        TensorSpec(f"{name}.activation_scale", f32, ()),
                    ]
                elif quant_format == "int8_sq":
                    specs += [
                        TensorSpec(f"{name}.weight_scale", f32, (out,)),
                        TensorSpec(f"{name}.activation_scale", f32, ()),
                        TensorSpec(f"{name}.pre_quant_scale", f32, (inp,)),
                    ]
                elif quant_format == "int4_awq":
                    specs += [
                        TensorSpec(f"{name}.weight_scale", dtype, (out, inp // awq_group_size)),
                        TensorSpec(f"{name}.activation_scale", f32, ()),
                        TensorSpec(f"{name}.pre_quant_scale", dtype, (inp,)),
                    ]
    specs += [
        TensorSpec("decoder.final_layernorm.weight", dtype, (hidden,)),
        TensorSpec("decoder.final_layernorm.bias", dtype, (hidden,)),
        TensorSpec("output_layer.weight", dtype, (vocab, hidden)),
    ]
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    # Per-tensor seed: values do not depend on which other tensors exist or on their order.
    # (torch's CPU generator keeps only 32 bits of the seed, so hash seed and name together)
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _make_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = _generator(seed, spec.name)
    leaf = spec.name.rsplit(".", 1)[-1]
    if spec.dtype == torch.int8:
        return torch.randint(-127, 128, spec.shape, generator=g, dtype=torch.int8)
    if leaf.endswith("scale"):
        return (torch.rand(spec.shape, generator=g) * 0.01 + 1e-3).to(spec.dtype)
    work = (
        spec.dtype
        if spec.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        else torch.float32
    )
    x = torch.randn(spec.shape, generator=g, dtype=work)
    is_norm_weight = "layernorm" in spec.name and leaf == "weight"
    x = x.mul_(0.1).add_(1.0) if is_norm_weight else x.mul_(0.02)
    return x if work == spec.dtype else x.to(spec.dtype)


def make_gpt_state_dict(
    num_layers: int,
    hidden: int,
    ffn_hidden: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    quant_format: str | None = None,
    awq_group_size: int = 8,
) -> dict[str, torch.Tensor]:
    """A deterministic GPT-like state dict with Megatron-core names (see :func:`gpt_specs`).

    Args:
        num_layers: decoder layers.
        hidden: hidden size.
        ffn_hidden: MLP inner size.
        vocab: vocabulary size (embedding and output layer rows).
        dtype: dtype of the unquantized tensors.
        seed: the same seed always gives the same tensors.
        quant_format: ``None``, ``"fp8"``, ``"int8_sq"`` or ``"int4_awq"``: adds ModelOpt-style scales.
        awq_group_size: int4_awq block size along the input dimension.
    """
    specs = gpt_specs(num_layers, hidden, ffn_hidden, vocab, dtype, quant_format, awq_group_size)
    return {s.name: _make_tensor(s, seed) for s in specs}


def balanced_layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """Splits layers over stages as evenly as possible, earlier stages taking the remainder: 5, 2 -> [3, 2]."""
    if pp < 1:
        raise ArgumentError(f"pp must be positive, got {pp}")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if p < extra else 0) for p in range(pp)]


def _is_first_stage_name(name: str) -> bool:
    return any("embedding" in part for part in name.split("."))


def shard_state_dict(
    sd: Mapping[str, torch.Tensor],
    tp: int,
    pp: int,
    rules: RuleTable | None = None,
    layers_per_stage: Sequence[int] | None = None,
    quant_format: str | None = None,
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Splits a full state dict into TP x PP shards, as a Megatron job would hold them.

    TP: each tensor is split with its rule's :meth:`~distribute_utils.consolidate.merge_rules.MergeRule.split`:
    ``concat:d`` chunks along ``d`` (must divide evenly); ``same``/``first`` replicate; ``max`` keeps the
    original on TP rank 0 and smaller-or-equal values elsewhere; ``sum`` the original on rank 0 and zeros
    elsewhere; so merging with the same rules gives the original back bit for bit.

    PP: decoder layers (names with ``layers.<i>.``) go to stages by ``layers_per_stage`` and are renumbered
    from 0 on each stage; names with an ``embedding`` component go to the first stage; everything else
    (final norm, output layer) to the last.

    Args:
        sd: the full state dict with global layer numbers.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        rules: merge rules; default ``RuleTable.default(quant_format)``.
        layers_per_stage: layers per stage (uneven allowed); default :func:`balanced_layers_per_stage`.
        quant_format: picks the default rules when ``rules`` is ``None``.

    Returns:
        ``{(tp_rank, pp_rank): {local_name: tensor}}``, stage by stage; tensors may share storage with ``sd``.
    """
    if tp < 1 or pp < 1:
        raise ArgumentError(f"tp and pp must be positive, got tp={tp}, pp={pp}")
    table = rules if rules is not None else RuleTable.default(quant_format)
    indices = {i for n in sd if (i := local_layer_index(n)) is not None}
    num_layers = len(indices)
    if indices != set(range(num_layers)):
        raise ArgumentError(f"layer indices must be 0..n-1, got {sorted(indices)}")
    lps = (
        list(layers_per_stage) if layers_per_stage is not None else balanced_layers_per_stage(num_layers, pp)
    )
    if len(lps) != pp or sum(lps) != num_layers or min(lps) < 0:
        raise ArgumentError(
            f"layers_per_stage {lps} must have {pp} non-negative entries summing to {num_layers}"
        )
    stage_of_layer: list[int] = []
    offsets: list[int] = []
    for p, n in enumerate(lps):
        offsets.append(len(stage_of_layer))
        stage_of_layer += [p] * n
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {(t, p): {} for p in range(pp) for t in range(tp)}
    for name, tensor in sd.items():
        layer = local_layer_index(name)
        if layer is not None:
            stage = stage_of_layer[layer]
            local = global_layer_name(name, -offsets[stage])
        else:
            stage = 0 if _is_first_stage_name(name) else pp - 1
            local = name
        parts = table.rule_for(name).split(name, tensor, tp)
        for t, part in enumerate(parts):
            out[(t, stage)][local] = part
    return out


@dataclass(frozen=True)
class SyntheticDims:
    """Model dimensions for :func:`make_gpt_state_dict`."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    vocab: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Exact size of the (unquantized) state dict in bytes."""
        return sum(
            s.nbytes for s in gpt_specs(self.num_layers, self.hidden, self.ffn_hidden, self.vocab, self.dtype)
        )

    def as_kwargs(self) -> dict[str, object]:
        """Keyword arguments for :func:`make_gpt_state_dict`."""
        return {
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "ffn_hidden": self.ffn_hidden,
            "vocab": self.vocab,
            "dtype": self.dtype,
        }


def synthetic_size_for(
    bytes_target: int, dtype: torch.dtype = torch.bfloat16, num_layers: int = 8, multiple: int = 128
) -> SyntheticDims:
    """Picks dimensions for a synthetic model of about ``bytes_target`` bytes.

    Shape: ``ffn_hidden = 4 * hidden``, ``vocab = 8 * hidden``, ``num_layers`` layers; ``hidden`` is a
    multiple of ``multiple`` (so TP sizes up to ``multiple`` divide it), the one giving the size closest to
    the target (at least ``multiple``). Use ``.nbytes`` for the exact size.

    Args:
        bytes_target: wanted size in bytes (the benchmark asks for ~2 GiB).
        dtype: element type.
        num_layers: decoder layers (8 divides PP sizes 1, 2, 4, 8).
        multiple: ``hidden`` granularity.
    """
    if bytes_target <= 0 or num_layers < 1 or multiple < 1:
        raise ArgumentError(
            f"bytes_target, num_layers and multiple must be positive, got {bytes_target}, {num_layers}, {multiple}"
        )
    per_h2 = (12 * num_layers + 16) * dtype.itemsize  # 12 h^2 per layer + 2 * 8 h^2 embeddings
    guess = max(1, round(math.sqrt(bytes_target / per_h2) / multiple))
    candidates = [
        SyntheticDims(num_layers, k * multiple, 4 * k * multiple, 8 * k * multiple, dtype)
        for k in range(max(1, guess - 1), guess + 2)
    ]
    best = min(candidates, key=lambda d: abs(d.nbytes - bytes_target))
    logger.debug("synthetic model for %d bytes: %s (%d bytes)", bytes_target, best, best.nbytes)
    return best
