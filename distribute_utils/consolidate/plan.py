"""Internal. Planning a consolidation from metadata alone: the rules, the merge plan, its batches, the options.

Any process may call these; no collective. :func:`plan_checkpoint` opens a checkpoint and asks it for its
plan (:meth:`~.formats.Checkpoint.plan`: a grid of TP shards merges by the rules, a checkpoint of global
tensors ignores them). :class:`JobPlan` cuts the plan into batches: each stage's tensors, in plan order, in
batches of at most ``batch_bytes`` merged bytes (a larger tensor travels alone), so that every rank knows
every batch without a message; :meth:`JobPlan.digest` is what the ranks compare before anything moves.
:class:`Options` is what a consolidation is asked to do, the same on every rank, whichever job runs it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ..errors import ArgumentError, SpaceError
from .formats import Checkpoint, open_checkpoint
from .hf_llama import HfConversion, plan_hf
from .merge_plan import MergePlanEntry
from .rule_table import RuleChoice, RuleTable, resolve_rules
from .writer_base import CheckpointWriter
from .writers import open_writer

__all__ = [
    "JobPlan",
    "Options",
    "RuleChoice",
    "check_space",
    "make_batches",
    "plan_checkpoint",
    "plan_conversion",
    "resolve_rules",
    "select_entries",
]

logger = logging.getLogger(__name__)


def plan_checkpoint(
    input_dir: str | os.PathLike[str],
    rules: RuleTable | str | os.PathLike[str] | None = None,
    *,
    quant_format: str | None = None,
    layers_per_stage: Sequence[int] | None = None,
    iteration: int | str | None = None,
    swiglu: bool | None = None,
    names: str | None = None,
    only: str | None = None,
    strip_prefix: str | None = None,
) -> tuple[Checkpoint, list[MergePlanEntry]]:
    """Opens a checkpoint and plans its consolidation from metadata; no collective, any process.

    Merge errors found while planning (e.g. shapes that cannot be concatenated) are extended with the stage
    and, for each TP rank, its global rank and shard file. ``swiglu`` overrides what the checkpoint says
    about its MLP (a Megatron checkpoint's ``args.swiglu``); ``names`` picks Megatron torch_dist's
    layer-norm names (``"te"`` or ``"local"``, default from its ``args``). A DCP checkpoint holds global
    tensors: ``rules`` and ``quant_format`` do not apply to it. ``only`` and ``strip_prefix``: see
    :func:`select_entries`.

    Raises:
        FileNotFoundError: the directory or a shard file is missing (path named).
        LayoutError: not a known layout, or an inconsistent one.
        MergeError: the shards of a tensor cannot be merged (tensor, ranks and files named).
    """
    checkpoint = open_checkpoint(input_dir, layers_per_stage, iteration, names=names)
    kept, _ = select_entries(checkpoint.plan(RuleChoice(rules, quant_format, swiglu)), only, strip_prefix)
    return checkpoint, kept


def select_entries(
    entries: list[MergePlanEntry], only: str | None, strip_prefix: str | None
) -> tuple[list[MergePlanEntry], list[tuple[str, str]]]:
    """The entries whose names start with ``only`` (all when None), renamed without ``strip_prefix`` where
    they start with it (a DCP ``model.`` prefix, so that the output loads into the bare module); and
    ``(name, why)`` of those left out.

    Raises:
        ArgumentError: ``only`` keeps no tensor (the names' first parts are listed), or two names become
            one once stripped."""
    kept = [e for e in entries if only is None or e.name.startswith(only)]
    dropped = [
        (e.name, f"not under --only {only}")
        for e in entries
        if only is not None and not e.name.startswith(only)
    ]
    if entries and not kept:
        heads = sorted({e.name.split(".", 1)[0] + "." for e in entries})
        raise ArgumentError(
            f"--only {only!r} keeps none of the {len(entries)} tensors; their names start with "
            f"{', '.join(heads[:8])}"
        )
    if strip_prefix:
        renamed: list[MergePlanEntry] = []
        seen: dict[str, str] = {}
        for e in kept:
            name = e.name.removeprefix(strip_prefix)
            if not name:
                raise ArgumentError(
                    f"--strip-prefix {strip_prefix!r} leaves tensor '{e.name}' without a name"
                )
            if name in seen:
                raise ArgumentError(
                    f"--strip-prefix {strip_prefix!r} makes '{seen[name]}' and '{e.name}' both '{name}'; "
                    "keep one part of the checkpoint with --only"
                )
            seen[name] = e.name
            renamed.append(dataclasses.replace(e, name=name, spec=dataclasses.replace(e.spec, name=name)))
        kept = renamed
    return kept, dropped


def plan_conversion(
    checkpoint: Checkpoint,
    entries: list[MergePlanEntry],
    to: str | None,
    given: dict[str, Any],
    swiglu: bool | None = None,
) -> HfConversion | None:
    """Where each planned tensor goes in the checkpoint ``to`` asks for (``"hf"``: :func:`~.hf_llama.plan_hf`,
    from the checkpoint's Megatron args and ``given``), or None when ``to`` is None.

    Raises:
        ConversionError: as :func:`~.hf_llama.plan_hf`."""
    if to is None:
        return None
    args = getattr(checkpoint, "model_args", None)  # (Megatron checkpoints: their args)
    return plan_hf(checkpoint.kind, args, entries, given, swiglu)


def make_batches(
    plan: Sequence[MergePlanEntry], stages: int, batch_bytes: int
) -> list[list[tuple[MergePlanEntry, ...]]]:
    """Per stage, its entries in plan order cut into batches of at most ``batch_bytes`` merged bytes (a
    larger tensor alone)."""
    batches_of: list[list[list[MergePlanEntry]]] = [[] for _ in range(stages)]
    sizes = [0] * stages
    for entry in plan:
        p = entry.pp_rank
        batches = batches_of[p]
        if not batches or (batches[-1] and sizes[p] + entry.spec.nbytes > batch_bytes):
            batches.append([])
            sizes[p] = 0
        batches[-1].append(entry)
        sizes[p] += entry.spec.nbytes
    return [[tuple(b) for b in batches] for batches in batches_of]


def check_space(output: str | os.PathLike[str], nbytes: int) -> None:
    """Fails early, naming the path, when the output's filesystem cannot hold ``nbytes``.

    Raises:
        SpaceError: (an ``OSError``) ``ENOSPC``, with the bytes needed and free.
    """
    probe = Path(output).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise SpaceError(
            errno.ENOSPC,
            f"no space left for the consolidated checkpoint: it needs {nbytes:,} bytes, "
            f"the filesystem of '{probe}' has {free:,} free",
            os.fspath(output),
        )


class JobPlan:
    """An opened checkpoint, its merge plan and the plan's batches; the same on every rank.

    Attributes:
        checkpoint: the opened checkpoint.
        entries: one per output tensor, in output order.
        tp: tensor-parallel size of the input.
        stages: its pipeline stages (``pp * ep``).
        batch_bytes: merged bytes per stage and batch.
        batches: per stage, its batches (see :func:`make_batches`).
        rounds: batches of the largest stage.
        total_bytes: bytes of the output's tensors.
        left_out: ``(name, why)`` of what the checkpoint holds and the output does not (see
            :meth:`~.formats.Checkpoint.left_out` and :func:`select_entries`).
        conversion: where each merged tensor goes in a Hugging Face checkpoint (``to="hf"``), or None:
            written as merged, under its own name.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        entries: list[MergePlanEntry],
        batch_bytes: int,
        left_out: list[tuple[str, str]] | None = None,
        conversion: HfConversion | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.entries = entries
        self.conversion = conversion
        self.left_out = (left_out or []) + (conversion.left_out if conversion is not None else [])
        self.tp, self.stages = checkpoint.tp, checkpoint.stages
        self.batch_bytes = batch_bytes
        self.batches = make_batches(entries, self.stages, batch_bytes)
        self.rounds = max((len(b) for b in self.batches), default=0)
        self.total_bytes = sum(e.spec.nbytes for e in entries)

    def digest(self, *parts: object) -> str:
        """A digest of the plan (and of ``parts``): ranks that planned the same consolidation agree on it."""
        rows = [
            [e.name, e.pp_rank, e.local_name, str(e.rule), str(e.spec.dtype), list(e.spec.shape)]
            for e in self.entries
        ]
        packed = msgpack.packb([rows, [repr(p) for p in parts]])
        return hashlib.blake2b(packed, digest_size=16).hexdigest()


@dataclass(frozen=True)
class Options:
    """What a consolidation is asked to do, the same on every rank, whichever way it runs (one process, or
    one rank per shard): the plan's inputs and the output's shape (see
    :func:`~.tp_pp.consolidate_checkpoint` for each)."""

    format: str
    rules: RuleChoice
    max_shard_size: int | None
    progress: bool
    batch_bytes: int
    layers_per_stage: Sequence[int] | None
    iteration: int | str | None
    names: str | None
    only: str | None = None
    strip_prefix: str | None = None
    to: str | None = None
    hf_config: tuple[tuple[str, Any], ...] = ()

    def plan(self, input_dir: str | os.PathLike[str]) -> JobPlan:
        """Opens ``input_dir`` and plans it (metadata only; see :func:`plan_checkpoint`), with its
        conversion when ``to`` asks for one (refused here, before anything is written)."""
        checkpoint = open_checkpoint(input_dir, self.layers_per_stage, self.iteration, names=self.names)
        kept, dropped = select_entries(checkpoint.plan(self.rules), self.only, self.strip_prefix)
        conversion = plan_conversion(checkpoint, kept, self.to, dict(self.hf_config), self.rules.swiglu)
        return JobPlan(checkpoint, kept, self.batch_bytes, checkpoint.left_out() + dropped, conversion)

    def open_writer(self, output: str | os.PathLike[str], plan: JobPlan) -> CheckpointWriter:
        """Rank 0 (or the one process): checks the space, then opens the output's writer (a conversion's
        tensors and files, when there is one)."""
        check_space(output, plan.total_bytes)
        conversion = plan.conversion
        if conversion is None:
            return open_writer(self.format, output, [e.spec for e in plan.entries], self.max_shard_size)
        return open_writer(
            self.format, output, conversion.specs, self.max_shard_size, side_files=conversion.files
        )
