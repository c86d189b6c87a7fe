"""Internal. Merge rules: how the tensor-parallel shards of one tensor become one tensor.

A rule is a small frozen object with three operations:

* ``merged_shape(name, shapes, ranks, dtypes)``: metadata only; validates the shards' shapes (and dtypes)
  and returns the merged shape, so a driver can plan the whole output before reading any data;
* ``merge(name, shards, ranks)``: merges the shards of one tensor;
* ``split(name, tensor, parts)``: the inverse, used to build synthetic sharded checkpoints.

Rule text (``concat:0``, ``concat:-1``, ``max``, ``sum``, ``same``, ``first``, ``scalar_max:RULE``) is
parsed by :func:`parse_rule`. Which rule a tensor gets is decided by a :class:`~.rule_table.RuleTable`;
ModelOpt's quantization-scale rules are in :mod:`.quant_rules`.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import MergeError, RuleSyntaxError, plural_list
from ..wire import as_uint8
from .specs import TensorSpec

__all__ = [
    "RULE_NAMES",
    "Concat",
    "First",
    "Max",
    "MergeRule",
    "Same",
    "ScalarMax",
    "Shape",
    "Sum",
    "Unknown",
    "bitwise_equal",
    "is_scalar_shape",
    "parse_rule",
]

Shape = tuple[int, ...]

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
    """Every shard must be identical bit for bit; the first is kept.

    Attributes:
        known: the built-in tables' rule for a tensor the format keeps replicated (a norm, a row-parallel
            bias): shards that differ then come from different saves or a damaged file, and no rule
            fixes that, so the error does not suggest one (False: a user's or the fallback's ``same``).
    """

    known: bool = field(default=False, compare=False)

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
            which = f"{plural_list(noun, [ids[i] for i in differ])} {verb} from {noun} {ids[0]}"
            if self.known:
                raise MergeError(
                    f"tensor '{name}' is replicated (the same on every TP rank, as the checkpoint's "
                    f"format keeps it), but {which}: the shards come from different saves or a file is "
                    "damaged; no merge rule makes that right: consolidate the files of one save"
                )
            raise MergeError(
                f"tensor '{name}' should be identical on every shard (rule 'same'), but {which}; "
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


def is_scalar_shape(shape: Sequence[int]) -> bool:
    """Whether a shape holds exactly one element (0-d, or every dim 1): a per-tensor scale."""
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
        return Max() if shapes and all(is_scalar_shape(s) for s in shapes) else self.inner

    def _merged_shape(self, name: str, shapes: Sequence[Shape], ranks: Sequence[int] | None) -> Shape:
        return self._pick(shapes).merged_shape(name, shapes, ranks)  # (the picked rule's own checks)

    def _merge(self, name: str, shards: Sequence[torch.Tensor], ranks: Sequence[int] | None) -> torch.Tensor:
        return self._pick([tuple(t.shape) for t in shards]).merge(name, shards, ranks)

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
