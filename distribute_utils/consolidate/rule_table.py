"""Internal. Rule tables: which merge rule applies to which tensor, by ordered ``fnmatch`` globs (first match wins).

:meth:`RuleTable.default` knows Megatron-style GPT names and ModelOpt's quantization scales
(:func:`~.quant_rules.quantized_rule`); the plain-text rules file format is described in
:meth:`RuleTable.from_text` and ``docs/consolidation.md``.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from ..errors import RuleSyntaxError, UnsupportedTypeError
from .merge_rules import Concat, MergeRule, Same, Unknown, parse_rule
from .quant_rules import SCALE_SUFFIXES, check_quant_format, quantized_rule

__all__ = [
    "COLUMN_PARALLEL_LAYERS",
    "REPLICATED",
    "ROW_PARALLEL_LAYERS",
    "RuleChoice",
    "RuleTable",
    "is_catch_all",
    "resolve_rules",
]

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

_SCALE_KINDS = ("weight_scale", "activation_scale", "pre_quant_scale")


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


def _as_rule(rule: MergeRule | str) -> MergeRule:
    if isinstance(rule, MergeRule):
        return rule
    if isinstance(rule, str):
        return parse_rule(rule)
    raise RuleSyntaxError(f"expected a MergeRule or rule text, got {type(rule).__name__}: {rule!r}")


# --------------------------------------------------------------------------------------------------------
# Rule tables.


# The default fallback of the constructors (rules are frozen: one instance serves every table).
_SAME = Same()


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
        self, entries: Iterable[tuple[str, MergeRule | str]] = (), fallback: MergeRule | str = _SAME
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
        cls, mapping: Mapping[str, MergeRule | str], fallback: MergeRule | str = _SAME
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
    def from_text(cls, text: str, source: str = "<rules>", fallback: MergeRule | str = _SAME) -> RuleTable:
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
    def from_file(cls, path: str | os.PathLike[str], fallback: MergeRule | str = _SAME) -> RuleTable:
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
        entries.extend((p, Same(known=True)) for p in REPLICATED)
        entries += _default_entries(quant_format)
        return cls(entries, fallback=Unknown())


def resolve_rules(
    rules: RuleTable | str | os.PathLike[str] | None = None,
    quant_format: str | None = None,
    gated: bool | None = False,
) -> RuleTable:
    """The rule table to use.

    Args:
        rules: a table (used as is), a rules file (its patterns first, then the defaults, then its catch-all
            ``*`` line if any: :meth:`RuleTable.then`), or ``None``
            (the defaults).
        quant_format: ``None``, ``"fp8"``, ``"int8_sq"`` or ``"int4_awq"``: picks the default table.
        gated: whether the MLP is gated (SwiGLU), ``None`` if unknown (see :meth:`RuleTable.default`).

    Raises:
        RuleSyntaxError: a malformed rules file (``path:line:`` in the message).
        FileNotFoundError: no such rules file.
    """
    default = RuleTable.default(quant_format, gated)
    if rules is None:
        return default
    if isinstance(rules, RuleTable):
        return rules
    if isinstance(rules, (str, os.PathLike)):
        return RuleTable.from_file(rules).then(default)
    raise UnsupportedTypeError(
        f"rules must be a RuleTable, a rules file path or None; got {type(rules).__name__}"
    )


@dataclass(frozen=True)
class RuleChoice:
    """The merge rules a consolidation was asked for, resolved by a checkpoint that merges TP shards
    (:meth:`table`, with what it knows of its MLP) and ignored by one of global tensors.

    Attributes:
        rules: a table, a rules file, or ``None`` (the defaults); see :func:`resolve_rules`.
        quant_format: picks the default table's scales.
        swiglu: whether the MLP is gated; ``None``: as the checkpoint says.
    """

    rules: RuleTable | str | os.PathLike[str] | None = None
    quant_format: str | None = None
    swiglu: bool | None = None

    @property
    def given(self) -> bool:
        """Whether rules or a quantization format were asked for (not only the defaults)."""
        return self.rules is not None or self.quant_format is not None

    def table(self, gated: bool | None) -> RuleTable:
        """The table, for a checkpoint whose MLP is ``gated`` (unless :attr:`swiglu` says otherwise)."""
        return resolve_rules(self.rules, self.quant_format, gated if self.swiglu is None else self.swiglu)
