"""Merge rules: how the tensor-parallel shards of one tensor become one tensor.

A rule is a small frozen object with three operations:

* ``merged_shape(name, shapes, ranks, dtypes)``: metadata only; validates the shards' shapes (and dtypes)
  and returns the merged shape, so a driver can plan the whole output before reading any data;
* ``merge(name, shards, ranks)``: merges the shards of one tensor;
* ``split(name, tensor, parts)``: the inverse, used to build synthetic sharded checkpoints.

A :class:`RuleTable` maps tensor names to rules with ordered ``fnmatch`` globs (first match wins).
:meth:`RuleTable.default` knows Megatron-style GPT names and ModelOpt's quantization scales.
Rule text (``concat:0``, ``concat:-1``, ``max``, ``sum``, ``same``, ``first``, ``scalar_max:RULE``) is
parsed by :func:`parse_rule`; the plain-text rules file format is described in
:meth:`RuleTable.from_text` and ``docs/consolidation.md``.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from ..errors import ArgumentError, MergeError, RuleSyntaxError, plural_list
from ..wire import as_uint8
from .writers import CheckpointWriter, SafetensorsWriter, TensorSpec, tensor_bytes

__all__ = [
    "COLUMN_PARALLEL_LAYERS",
    "QUANT_FORMATS",
    "ROW_PARALLEL_LAYERS",
    "RULE_NAMES",
    "SCALE_SUFFIXES",
    "Concat",
    "First",
    "Max",
    "MergeError",
    "MergeRule",
    "RuleSyntaxError",
    "RuleTable",
    "Same",
    "ScalarMax",
    "Sum",
    "Unknown",
    "check_quant_format",
    "is_catch_all",
    "parse_rule",
    "quantized_rule",
    "write_merged",
]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
ParallelKind = Literal["column", "row"]
TensorKind = Literal["weight", "bias", "weight_scale", "activation_scale", "pre_quant_scale"]

#: Rule names accepted by :func:`parse_rule` (``concat`` needs ``:<dim>``).
RULE_NAMES: tuple[str, ...] = (
    "concat:<dim>",
    "concat:<dim>:<parts>",
    "swiglu",
    "max",
    "sum",
    "same",
    "first",
    "scalar_max:<rule>",
    "unknown",
)


def _labels(count: int, ranks: Sequence[int] | None) -> list[str]:
    """Names the shards in messages: ``rank R`` when ranks are known, else ``shard i``."""
    if ranks is not None and len(ranks) == count:
        return [f"rank {r}" for r in ranks]
    return [f"shard {i}" for i in range(count)]


def _describe(values: Sequence[object], ranks: Sequence[int] | None) -> str:
    return ", ".join(f"{label}: {value}" for label, value in zip(_labels(len(values), ranks), values))


def _check_ranks(name: str, count: int, ranks: Sequence[int] | None) -> None:
    if ranks is not None and len(ranks) != count:
        raise MergeError(f"tensor '{name}': got {count} shards but {len(ranks)} ranks {list(ranks)}")


def _check_dtypes(
    name: str, rule: MergeRule, dtypes: Sequence[torch.dtype], ranks: Sequence[int] | None
) -> None:
    if any(d != dtypes[0] for d in dtypes):
        raise MergeError(
            f"cannot merge tensor '{name}' with rule {rule}: shard dtypes differ "
            f"({_describe([str(d) for d in dtypes], ranks)})"
        )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_uint8(a), as_uint8(b))


_UPCAST_FOR_REDUCE = {
    torch.float8_e4m3fn: torch.float32,
    torch.float8_e5m2: torch.float32,
    torch.float8_e4m3fnuz: torch.float32,
    torch.float8_e5m2fnuz: torch.float32,
}


class MergeRule(ABC):
    """How the shards of one tensor are merged (and split).

    Subclasses are frozen dataclasses; ``str(rule)`` gives the rule text that :func:`parse_rule` reads.
    """

    #: Whether every shard must have the same shape.
    equal_shapes: ClassVar[bool] = True

    @abstractmethod
    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        """Rule-specific shape check and merged shape; ``shapes`` is non-empty."""

    @abstractmethod
    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        """Rule-specific merge; shards are validated already."""

    @abstractmethod
    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """Splits a full tensor into ``parts`` shards such that ``merge`` gives it back bit for bit.

        Args:
            name: tensor name, for messages.
            tensor: the full tensor.
            parts: number of shards (the TP size).

        Returns:
            ``parts`` tensors; they may share storage with ``tensor``.
        """

    def merged_shape(
        self,
        name: str,
        shapes: Sequence[Sequence[int]],
        ranks: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> Shape:
        """Validates shard metadata and returns the merged shape, without touching data.

        Args:
            name: tensor name, for messages.
            shapes: the shape of each shard, in rank order.
            ranks: the rank holding each shard (named in errors); positions are used when ``None``.
            dtypes: optionally the dtype of each shard; they must all agree.

        Returns:
            The shape of the merged tensor.

        Raises:
            MergeError: no shards, or shapes/dtypes that this rule cannot merge.
        """
        if not shapes:
            raise MergeError(f"tensor '{name}': no shards to merge")
        _check_ranks(name, len(shapes), ranks)
        if dtypes is not None:
            _check_dtypes(name, self, dtypes, ranks)
        norm = [tuple(int(d) for d in s) for s in shapes]
        if self.equal_shapes and any(s != norm[0] for s in norm):
            raise MergeError(
                f"cannot merge tensor '{name}' with rule {self}: it needs equal shapes, got "
                f"{_describe(norm, ranks)}"
            )
        return self._merged_shape(name, norm, ranks)

    def byte_runs(self, shapes: Sequence[Sequence[int]], itemsize: int) -> list[tuple[int, int, int]] | None:
        """The merged tensor's bytes as runs of shard bytes, in output order: ``(shard, start, length)``;
        ``None`` when the merge computes new values (``max``, ``sum``) or keeps one shard.

        Lets a writer place every shard straight into the output without building the merged tensor.
        ``shapes`` must already be validated (:meth:`merged_shape`).
        """
        return None

    def merged_spec(
        self, name: str, specs: Sequence[TensorSpec], ranks: Sequence[int] | None = None
    ) -> TensorSpec:
        """Like :meth:`merged_shape` on :class:`TensorSpec` objects; returns the merged spec."""
        shape = self.merged_shape(name, [s.shape for s in specs], ranks, [s.dtype for s in specs])
        return TensorSpec(name, specs[0].dtype, shape)

    def merge(
        self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Merges the shards of one tensor.

        Args:
            name: tensor name, for messages.
            shards: one tensor per TP rank, in rank order.
            ranks: the rank holding each shard (named in errors); positions are used when ``None``.

        Returns:
            The merged tensor (for ``same``/``first`` it is ``shards[0]`` itself, not a copy).

        Raises:
            MergeError: shapes, dtypes or (for ``same``) contents disagree.
        """
        self.merged_shape(name, [tuple(t.shape) for t in shards], ranks, [t.dtype for t in shards])
        return self._merge(name, shards, ranks)


@dataclass(frozen=True)
class Concat(MergeRule):
    """Concatenate along ``dim`` (negative counts from the end); other dims must agree.

    With ``parts > 1`` every shard is itself ``parts`` equal blocks along ``dim`` (a gated MLP's
    ``linear_fc1`` holds ``[gate_t; up_t]`` on TP rank ``t``) and the output is block by block:
    ``[gate_0; gate_1; ...; up_0; up_1; ...]``, as Megatron merges SwiGLU (rule text ``concat:0:2``,
    alias ``swiglu``).
    """

    dim: int = 0
    parts: int = 1
    equal_shapes: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise RuleSyntaxError(f"concat needs parts >= 1, got {self.parts}")

    def __str__(self) -> str:
        return f"concat:{self.dim}" if self.parts == 1 else f"concat:{self.dim}:{self.parts}"

    def byte_runs(self, shapes: Sequence[Sequence[int]], itemsize: int) -> list[tuple[int, int, int]]:
        """See :meth:`MergeRule.byte_runs`: outer index by outer index, block by block, shard by shard."""
        dim = self.dim % len(shapes[0])
        outer = math.prod(shapes[0][:dim])
        rows = [math.prod(s[dim:]) * itemsize for s in shapes]  # bytes of one outer index, per shard
        runs: list[tuple[int, int, int]] = []
        for i in range(outer):
            for part in range(self.parts):
                for shard, row in enumerate(rows):
                    block = row // self.parts
                    runs.append((shard, i * row + part * block, block))
        return runs

    def _norm_dim(self, name: str, ndim: int) -> int:
        if ndim == 0:
            raise MergeError(
                f"cannot concatenate tensor '{name}' along dim {self.dim}: it is a 0-d (scalar) tensor; "
                "use max, sum, same or first for scalars"
            )
        if not -ndim <= self.dim < ndim:
            raise MergeError(
                f"cannot concatenate tensor '{name}' along dim {self.dim}: it has only {ndim} dims"
            )
        return self.dim % ndim

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        ndims = {len(s) for s in shapes}
        if len(ndims) != 1:
            raise MergeError(
                f"cannot concatenate tensor '{name}': shards have different numbers of dims "
                f"({_describe(shapes, ranks)})"
            )
        dim = self._norm_dim(name, len(shapes[0]))
        rest = [s[:dim] + s[dim + 1 :] for s in shapes]
        if any(r != rest[0] for r in rest):
            raise MergeError(
                f"cannot concatenate tensor '{name}' along dim {self.dim}: the other dims differ "
                f"({_describe(shapes, ranks)})"
            )
        odd = [s for s in shapes if s[dim] % self.parts]
        if odd:
            raise MergeError(
                f"cannot merge tensor '{name}' with rule {self}: every shard must hold {self.parts} equal "
                f"blocks along dim {self.dim}, got {_describe(shapes, ranks)}"
            )
        total = sum(s[dim] for s in shapes)
        return (*shapes[0][:dim], total, *shapes[0][dim + 1 :])

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        if self.parts == 1:
            return torch.cat([s.detach() for s in shards], dim=self.dim)
        blocks = [s.detach().chunk(self.parts, dim=self.dim) for s in shards]
        return torch.cat([b[part] for part in range(self.parts) for b in blocks], dim=self.dim)

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        dim = self._norm_dim(name, tensor.dim())
        size = tensor.shape[dim]
        if parts <= 0 or size % (parts * self.parts):
            raise MergeError(
                f"cannot split tensor '{name}' of shape {tuple(tensor.shape)} into {parts} equal parts "
                f"of {self.parts} blocks along dim {self.dim}"
            )
        blocks = [torch.split(b, size // self.parts // parts, dim=dim) for b in tensor.chunk(self.parts, dim)]
        return [torch.cat([b[t] for b in blocks], dim=dim).contiguous() for t in range(parts)]


@dataclass(frozen=True)
class Unknown(MergeRule):
    """No known rule: a single shard is kept, several are an error naming the tensor and the fix.

    The fallback of :meth:`RuleTable.default`, so that a tensor split in a way nobody described is never
    merged by guess.
    """

    hint: str = field(default="", compare=False)
    equal_shapes: ClassVar[bool] = False

    def __str__(self) -> str:
        return "unknown"

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        if len(shapes) > 1:
            why = f" ({self.hint})" if self.hint else ""
            raise MergeError(
                f"no merge rule is known for tensor '{name}'{why}, shards {_describe(shapes, ranks)}; "
                "say how its tensor-parallel shards combine with --rules, e.g. a line "
                f"'{name} concat:0' (split along dim 0), 'concat:1', 'swiglu', 'same' (replicated) or 'max'"
            )
        return shapes[0]

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        return shards[0]

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        if parts != 1:
            raise MergeError(f"tensor '{name}' has no known merge rule, so it cannot be split")
        return [tensor]


def _reduce(shards: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Elementwise max/sum over shards, one running buffer, exact for float8 (via float32)."""
    dtype = shards[0].dtype
    work = _UPCAST_FOR_REDUCE.get(dtype, dtype)
    out = shards[0].detach().to(work, copy=True)
    fn = torch.maximum if op == "max" else torch.add
    for s in shards[1:]:
        fn(out, s.detach().to(work), out=out)
    return out if work == dtype else out.to(dtype)


@dataclass(frozen=True)
class Max(MergeRule):
    """Elementwise maximum of equally shaped shards (scales: the largest amax wins)."""

    def __str__(self) -> str:
        return "max"

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        return shapes[0]

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        return shards[0] if len(shards) == 1 else _reduce(shards, "max")

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        # The original on shard 0, values <= it elsewhere: the max gives the original back exactly.
        if tensor.dtype == torch.bool:
            lower = torch.zeros_like(tensor)
        elif tensor.is_floating_point():
            wide = tensor.detach().to(torch.float64)
            lower = torch.minimum(wide, wide * 0.5).to(tensor.dtype)
        else:
            lower = torch.minimum(tensor, torch.div(tensor, 2, rounding_mode="floor"))
        return [tensor] + [lower.clone() for _ in range(parts - 1)]


@dataclass(frozen=True)
class Sum(MergeRule):
    """Elementwise sum of equally shaped shards, in rank order."""

    def __str__(self) -> str:
        return "sum"

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        return shapes[0]

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        return shards[0] if len(shards) == 1 else _reduce(shards, "sum")

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        # The original on shard 0 and zeros elsewhere: x + 0 == x.
        return [tensor] + [torch.zeros_like(tensor) for _ in range(parts - 1)]


@dataclass(frozen=True)
class Same(MergeRule):
    """Every shard must be identical bit for bit; the first is kept."""

    def __str__(self) -> str:
        return "same"

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        return shapes[0]

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        first = as_uint8(shards[0])
        differ = [i for i in range(1, len(shards)) if not torch.equal(first, as_uint8(shards[i]))]
        if differ:
            noun, ids = ("rank", list(ranks)) if ranks is not None else ("shard", list(range(len(shards))))
            verb = "differs" if len(differ) == 1 else "differ"
            raise MergeError(
                f"tensor '{name}' should be identical on every shard (rule 'same'), but "
                f"{plural_list(noun, [ids[i] for i in differ])} {verb} from {noun} {ids[0]}; "
                "if this tensor is really split or reduced across ranks, give it a rule "
                "(concat:<dim>, max, sum, first)"
            )
        return shards[0]

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return [tensor] * parts


@dataclass(frozen=True)
class First(MergeRule):
    """Keep the first shard, ignore the others (their shapes may differ; dtypes must agree)."""

    equal_shapes: ClassVar[bool] = False

    def __str__(self) -> str:
        return "first"

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        return shapes[0]

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        return shards[0]

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return [tensor] * parts


def _is_scalar(shape: Sequence[int]) -> bool:
    n = 1
    for d in shape:
        n *= int(d)
    return n == 1


@dataclass(frozen=True)
class ScalarMax(MergeRule):
    """``max`` when every shard is a scalar (0-d or one element), else ``inner``.

    ModelOpt merges per-tensor scales (one element) with max, and per-channel or per-block scales of the
    same name with concat; this rule picks between them from the shapes alone.
    """

    inner: MergeRule = Concat(0)
    equal_shapes: ClassVar[bool] = False

    def __str__(self) -> str:
        return f"scalar_max:{self.inner}"

    def _pick(self, shapes: Sequence[Sequence[int]]) -> MergeRule:
        return Max() if shapes and all(_is_scalar(s) for s in shapes) else self.inner

    def merged_shape(
        self,
        name: str,
        shapes: Sequence[Sequence[int]],
        ranks: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> Shape:
        return self._pick(shapes).merged_shape(name, shapes, ranks, dtypes)

    def merge(
        self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None = None
    ) -> torch.Tensor:
        return self._pick([tuple(t.shape) for t in shards]).merge(name, shards, ranks)

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        raise NotImplementedError  # pragma: no cover - merged_shape is overridden

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - merge is overridden

    def split(self, name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return self._pick([tuple(tensor.shape)]).split(name, tensor, parts)


_SIMPLE_RULES: dict[str, MergeRule] = {
    "max": Max(),
    "sum": Sum(),
    "same": Same(),
    "first": First(),
    "unknown": Unknown(),
    "swiglu": Concat(0, 2),
}


def parse_rule(text: str) -> MergeRule:
    """Parses rule text: ``concat:<dim>``, ``max``, ``sum``, ``same``, ``first`` or ``scalar_max:<rule>``.

    Args:
        text: the rule, case-insensitive, surrounding blanks ignored.

    Returns:
        The rule object.

    Raises:
        RuleSyntaxError: unknown rule or bad dim (the message lists the valid rules).
    """
    raw = text.strip()
    low = raw.lower()
    if low in _SIMPLE_RULES:
        return _SIMPLE_RULES[low]
    if low.startswith("scalar_max:"):
        return ScalarMax(parse_rule(raw[len("scalar_max:") :]))
    if low.startswith("concat"):
        m = re.fullmatch(r"concat:\s*([+-]?\d+)(?::\s*(\d+))?", low)
        if m is None or (m.group(2) is not None and int(m.group(2)) < 1):
            raise RuleSyntaxError(
                f"bad concat rule {raw!r}: write concat:<dim> or concat:<dim>:<parts>, e.g. concat:0, "
                "concat:-1, or concat:0:2 for a gated MLP's [gate; up]"
            )
        return Concat(int(m.group(1)), int(m.group(2) or 1))
    raise RuleSyntaxError(f"unknown merge rule {raw!r}; valid rules: {', '.join(RULE_NAMES)}")


def _as_rule(rule: MergeRule | str) -> MergeRule:
    if isinstance(rule, MergeRule):
        return rule
    if isinstance(rule, str):
        return parse_rule(rule)
    raise RuleSyntaxError(f"expected a MergeRule or rule text, got {type(rule).__name__}: {rule!r}")


# --------------------------------------------------------------------------------------------------------
# Megatron names and ModelOpt quantization rules.

#: Column-parallel layers (output features split across TP): weight/bias concat on dim 0.
COLUMN_PARALLEL_LAYERS: tuple[str, ...] = (
    "linear_qkv",
    "query_key_value",
    "linear_fc1",
    "dense_h_to_4h",
    "word_embeddings",
    "output_layer",
)
#: Row-parallel layers (input features split across TP): weight concat on dim 1, bias not split.
ROW_PARALLEL_LAYERS: tuple[str, ...] = ("linear_proj", "self_attention.dense", "linear_fc2", "dense_4h_to_h")

#: Tensors every TP rank holds whole (norms, position embeddings, MoE routers): ``same``.
REPLICATED: tuple[str, ...] = (
    "*norm.weight",
    "*norm.bias",
    "*.layer_norm_weight",
    "*.layer_norm_bias",
    "*position_embeddings.weight",
    "*.router.weight",
    "*.router.expert_bias",
    "*.inv_freq",
)
# The first layer of a gated MLP holds [gate; up] on every TP rank.
_GATED_LAYERS: tuple[str, ...] = ("linear_fc1", "dense_h_to_4h")

#: Accepted name suffixes (after ``<layer>.``) for each kind of tensor.
SCALE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "weight": ("weight",),
    "bias": ("bias",),
    "weight_scale": ("weight_scale", "weights_scaling_factor", "weight_scale_2", "weights_scaling_factor_2"),
    "activation_scale": ("activation_scale", "activation_scaling_factor", "input_scale"),
    "pre_quant_scale": ("pre_quant_scale", "prequant_scaling_factor"),
}

#: Quantization formats known to :func:`quantized_rule` (``None``: not quantized).
QUANT_FORMATS: tuple[str | None, ...] = (None, "fp8", "int8_sq", "int4_awq")

# Weight and bias rules do not depend on the quantization format.
_PLAIN_RULES: dict[tuple[str, str], MergeRule] = {
    ("column", "weight"): Concat(0),
    ("row", "weight"): Concat(1),
    ("column", "bias"): Concat(0),
    ("row", "bias"): Same(),
}

# ModelOpt's merge table (postprocess.py), ws/as/ps = weight/activation/pre-quant scale:
#        ws  as  ps
#  FC    M   M   -
#  FR    M   M   -
#  I8C   C0  M   S
#  I8R   M   M   C0
#  I4C   C0  M   S      (ModelOpt re-smooths differing AWQ column pre-quant scales; we require equality)
#  I4R   C1  M   C0
_QUANT_RULES: dict[tuple[str, str, str], MergeRule] = {
    ("fp8", "column", "weight_scale"): Max(),
    ("fp8", "row", "weight_scale"): Max(),
    ("fp8", "column", "activation_scale"): Max(),
    ("fp8", "row", "activation_scale"): Max(),
    ("int8_sq", "column", "weight_scale"): Concat(0),
    ("int8_sq", "column", "activation_scale"): Max(),
    ("int8_sq", "column", "pre_quant_scale"): Same(),
    ("int8_sq", "row", "weight_scale"): Max(),
    ("int8_sq", "row", "activation_scale"): Max(),
    ("int8_sq", "row", "pre_quant_scale"): Concat(0),
    ("int4_awq", "column", "weight_scale"): Concat(0),
    ("int4_awq", "column", "activation_scale"): Max(),
    ("int4_awq", "column", "pre_quant_scale"): Same(),
    ("int4_awq", "row", "weight_scale"): Concat(1),
    ("int4_awq", "row", "activation_scale"): Max(),
    ("int4_awq", "row", "pre_quant_scale"): Concat(0),
}

_SCALE_KINDS = ("weight_scale", "activation_scale", "pre_quant_scale")


def check_quant_format(quant_format: str | None) -> None:
    """Raises :class:`ArgumentError` (a ``ValueError``) unless ``quant_format`` is one of :data:`QUANT_FORMATS`."""
    if quant_format not in QUANT_FORMATS:
        raise ArgumentError(
            f"unknown quant_format {quant_format!r}; valid: {', '.join(map(str, QUANT_FORMATS))}"
        )


def _check_quant_args(quant_format: str | None, parallel: str, kind: str) -> None:
    check_quant_format(quant_format)
    if parallel not in ("column", "row"):
        raise ArgumentError(f"unknown parallel kind {parallel!r}; valid: column, row")
    if kind not in SCALE_SUFFIXES:
        raise ArgumentError(f"unknown tensor kind {kind!r}; valid: {', '.join(SCALE_SUFFIXES)}")


def quantized_rule(
    quant_format: str | None,
    parallel: ParallelKind,
    kind: TensorKind,
    shape: Sequence[int] | None = None,
) -> MergeRule:
    """The merge rule for one tensor of a (possibly quantized) linear layer, after ModelOpt.

    Args:
        quant_format: ``"fp8"``, ``"int8_sq"``, ``"int4_awq"`` or ``None`` (not quantized).
        parallel: ``"column"`` or ``"row"`` parallel layer.
        kind: ``"weight"``, ``"bias"``, ``"weight_scale"``, ``"activation_scale"`` or ``"pre_quant_scale"``.
        shape: the shard shape; a scalar (0-d or one element) scale always merges with ``Max``. When
            ``None``, scale rules that depend on it are wrapped in :class:`ScalarMax`.

    Returns:
        The rule.

    Raises:
        ValueError: unknown argument, or a scale that the format does not have (e.g. an fp8 pre-quant scale,
            or any scale when ``quant_format`` is ``None``).
    """
    _check_quant_args(quant_format, parallel, kind)
    if kind in ("weight", "bias"):
        return _PLAIN_RULES[(parallel, kind)]
    if quant_format is None:
        raise ArgumentError(
            f"tensor kind {kind!r} only exists in quantized models: pass quant_format (valid: "
            f"{', '.join(q for q in QUANT_FORMATS if q)})"
        )
    rule = _QUANT_RULES.get((quant_format, parallel, kind))
    if rule is None:
        have = [k for (q, par, k) in _QUANT_RULES if (q, par) == (quant_format, parallel)]
        raise ArgumentError(
            f"{quant_format} {parallel}-parallel layers have no {kind}; valid: weight, bias, {', '.join(have)}"
        )
    if isinstance(rule, Max):
        return rule
    if shape is None:
        return ScalarMax(rule)
    return Max() if _is_scalar(shape) else rule


def _layer_patterns(layer: str, suffix: str) -> list[str]:
    """Globs for ``<anything>.<layer>.<suffix>`` and a top-level ``<layer>.<suffix>``."""
    return [f"*.{layer}.{suffix}", f"{layer}.{suffix}"]


def _default_entries(quant_format: str | None) -> list[tuple[str, MergeRule]]:
    entries: list[tuple[str, MergeRule]] = []
    for parallel, layers in (("column", COLUMN_PARALLEL_LAYERS), ("row", ROW_PARALLEL_LAYERS)):
        for layer in layers:
            for kind, suffixes in SCALE_SUFFIXES.items():
                if kind in _SCALE_KINDS and quant_format is None:
                    continue
                try:
                    rule = quantized_rule(quant_format, parallel, kind)  # type: ignore[arg-type]
                except ValueError:
                    continue  # this format has no such scale: falls through to the fallback
                for suffix in suffixes:
                    entries.extend((p, rule) for p in _layer_patterns(layer, suffix))
    return entries


# --------------------------------------------------------------------------------------------------------
# Rule tables.


def is_catch_all(pattern: str) -> bool:
    """Whether a pattern matches every tensor name (it is made of ``*`` only): see :meth:`RuleTable.then`."""
    return bool(pattern) and set(pattern) == {"*"}


@dataclass(frozen=True)
class _Entry:
    pattern: str
    rule: MergeRule
    regex: re.Pattern[str]


class RuleTable:
    """Ordered ``(pattern, rule)`` pairs; the first pattern matching a tensor name wins.

    Patterns are :mod:`fnmatch` globs matched case-sensitively against the *full* tensor name:
    ``*`` matches any run of characters *including dots*, ``?`` one character, ``[seq]`` a set.
    ``*.linear_qkv.weight`` therefore matches ``decoder.layers.7.self_attention.linear_qkv.weight``.
    A name matching no pattern gets ``fallback`` (``same`` unless told otherwise).
    """

    def __init__(
        self, entries: Iterable[tuple[str, MergeRule | str]] = (), fallback: MergeRule | str = Same()
    ) -> None:
        """Builds a table.

        Args:
            entries: ``(glob, rule)`` pairs in priority order; rules may be rule text.
            fallback: the rule for names that match no pattern.
        """
        self._entries: list[_Entry] = []
        for pattern, rule in entries:
            if not isinstance(pattern, str) or not pattern or any(c.isspace() for c in pattern):
                raise RuleSyntaxError(f"bad pattern {pattern!r}: a non-empty glob without blanks is needed")
            self._entries.append(_Entry(pattern, _as_rule(rule), re.compile(fnmatch.translate(pattern))))
        self.fallback: MergeRule = _as_rule(fallback)

    def __repr__(self) -> str:
        return f"RuleTable({len(self._entries)} patterns, fallback={self.fallback})"

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[str, MergeRule]]:
        return iter([(e.pattern, e.rule) for e in self._entries])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RuleTable):
            return NotImplemented
        return list(self) == list(other) and self.fallback == other.fallback

    __hash__ = None  # type: ignore[assignment]

    def match(self, name: str) -> tuple[str | None, MergeRule]:
        """Returns ``(pattern, rule)`` for a name; the pattern is ``None`` when the fallback applies."""
        for e in self._entries:
            if e.regex.match(name):
                return e.pattern, e.rule
        return None, self.fallback

    def rule_for(self, name: str) -> MergeRule:
        """Returns the rule for a full tensor name (first matching pattern, else the fallback)."""
        return self.match(name)[1]

    def then(self, other: RuleTable) -> RuleTable:
        """A table trying this table's patterns first, then ``other``'s, then this table's catch-alls.

        A *catch-all* is a pattern made of ``*`` only (it matches every name): it would shadow every pattern
        of ``other``, so it is tried after them and decides only the names that neither this table's other
        patterns nor ``other``'s name. The result's fallback is ``other``'s (reached only when this table
        has no catch-all). Typical use: ``RuleTable.from_file(path).then(RuleTable.default())`` lets a user
        file override or extend the defaults, and a ``* same`` line there replaces the defaults' ``unknown``.
        """
        catch_alls = [(p, r) for p, r in self if is_catch_all(p)]
        mine = [(p, r) for p, r in self if not is_catch_all(p)]
        return RuleTable([*mine, *other, *catch_alls], fallback=other.fallback)

    def to_text(self) -> str:
        """The table in rules-file format (readable back with :meth:`from_text`)."""
        lines = [f"{e.pattern} {e.rule}" for e in self._entries]
        lines.append(f"* {self.fallback}  # fallback")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, MergeRule | str], fallback: MergeRule | str = Same()
    ) -> RuleTable:
        """Builds a table from ``{pattern: rule}`` in the mapping's order.

        Raises:
            RuleSyntaxError: a bad rule; the message names the pattern.
        """
        entries: list[tuple[str, MergeRule]] = []
        for pattern, rule in mapping.items():
            try:
                entries.append((pattern, _as_rule(rule)))
            except RuleSyntaxError as exc:
                raise RuleSyntaxError(f"pattern {pattern!r}: {exc}") from None
        return cls(entries, fallback=fallback)

    @classmethod
    def from_text(cls, text: str, source: str = "<rules>", fallback: MergeRule | str = Same()) -> RuleTable:
        """Parses the plain-text rules format.

        One ``PATTERN RULE`` pair per line, separated by blanks; ``#`` starts a comment (whole line or
        trailing); blank lines are ignored; the first matching line wins. Example::

            # column-parallel
            *.linear_qkv.weight   concat:0
            *.linear_proj.weight  concat:1
            *.weight_scale        scalar_max:concat:0
            *                     same

        Args:
            text: the file contents.
            source: name used in error messages (a path).
            fallback: the rule for names that match no line.

        Raises:
            RuleSyntaxError: ``<source>:<line>: ...`` for a malformed line or unknown rule.
        """
        entries: list[tuple[str, MergeRule]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2:
                raise RuleSyntaxError(
                    f"{source}:{lineno}: expected 'PATTERN RULE' (two fields separated by blanks), got {raw.strip()!r}"
                )
            try:
                entries.append((fields[0], parse_rule(fields[1])))
            except RuleSyntaxError as exc:
                raise RuleSyntaxError(f"{source}:{lineno}: {exc}") from None
        return cls(entries, fallback=fallback)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], fallback: MergeRule | str = Same()) -> RuleTable:
        """Reads a rules file (format: :meth:`from_text`); errors carry ``path:line``."""
        with open(path, encoding="utf-8") as f:
            return cls.from_text(f.read(), source=os.fspath(path), fallback=fallback)

    @classmethod
    def default(cls, quant_format: str | None = None, gated: bool | None = False) -> RuleTable:
        """The built-in table for Megatron-style GPT names (core and legacy), optionally quantized.

        Column-parallel layers (:data:`COLUMN_PARALLEL_LAYERS`): weight and bias ``concat:0``; a gated
        MLP's ``linear_fc1`` / ``dense_h_to_4h`` (``gated=True``) ``swiglu``. Row-parallel layers
        (:data:`ROW_PARALLEL_LAYERS`): weight ``concat:1``, bias ``same``. Replicated tensors
        (:data:`REPLICATED`: norms, position embeddings, routers) ``same``. With ``quant_format`` the
        ModelOpt scale rules of :func:`quantized_rule` are added for the suffixes in :data:`SCALE_SUFFIXES`.
        Anything else gets :class:`Unknown`: an error if it is split, naming the tensor and ``--rules``.

        Args:
            quant_format: ``None``, ``"fp8"``, ``"int8_sq"`` or ``"int4_awq"``.
            gated: whether the MLP is gated (SwiGLU); ``None`` when unknown: a split ``linear_fc1`` is then
                an error that asks which it is.
        """
        check_quant_format(quant_format)
        fc1: MergeRule
        if gated is None:
            fc1 = Unknown(
                "the MLP may be gated (SwiGLU: each shard is [gate; up]) and the checkpoint does not say; "
                "pass --swiglu or --no-swiglu"
            )
        else:
            fc1 = Concat(0, 2) if gated else Concat(0)
        entries: list[tuple[str, MergeRule]] = []
        for layer in _GATED_LAYERS:
            for suffix in ("weight", "bias"):
                entries.extend((p, fc1) for p in _layer_patterns(layer, suffix))
                entries.append((f"*.{layer}.{suffix}[0-9]*", fc1))  # TE grouped experts: weight0, ...
        entries.append(("*.linear_fc2.weight[0-9]*", Concat(1)))  # TE grouped experts, row-parallel
        entries.extend((p, Same()) for p in REPLICATED)
        entries += _default_entries(quant_format)
        return cls(entries, fallback=Unknown())


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
