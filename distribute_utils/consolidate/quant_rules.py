"""Internal. ModelOpt's merge rules for the tensors of a (possibly quantized) linear layer.

:func:`quantized_rule` says how the TP shards of a column- or row-parallel layer's weight, bias and
quantization scales (weight, activation and pre-quant scales of ``fp8``, ``int8_sq`` and ``int4_awq``)
merge, after ModelOpt's ``postprocess.py``. :class:`~.rule_table.RuleTable.default` names the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..errors import ArgumentError
from .merge_rules import Concat, Max, MergeRule, Same, ScalarMax, is_scalar_shape

__all__ = [
    "QUANT_FORMATS",
    "SCALE_SUFFIXES",
    "ParallelKind",
    "TensorKind",
    "check_quant_format",
    "quantized_rule",
]

ParallelKind = Literal["column", "row"]
TensorKind = Literal["weight", "bias", "weight_scale", "activation_scale", "pre_quant_scale"]

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
    ("row", "bias"): Same(known=True),
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
    return Max() if is_scalar_shape(shape) else rule
