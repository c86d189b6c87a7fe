"""Internal. What each ``distribute-utils`` command does, once :mod:`.cli` has parsed its arguments: ``demo``,
``consolidate`` (one process, local ranks, or one rank under torchrun; ``--dry-run``), ``doctor`` and
``clean`` (over :mod:`.hygiene`). Each ``cmd_*`` takes the parsed arguments and returns the exit code;
:class:`~.errors.UsageError` (exit code 2) and :func:`fail` (the one-line error) are shared with :mod:`.cli`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import interrupts
from .errors import LaunchError, UsageError, one_line

if TYPE_CHECKING:
    from .consolidate.formats import Checkpoint
    from .consolidate.hf_llama import HfConversion
    from .consolidate.layouts import MergePlanEntry
    from .consolidate.tp_pp import ConsolidationReport
    from .outputs import OutputTarget

__all__ = ["cmd_clean", "cmd_consolidate", "cmd_demo", "cmd_doctor", "fail"]

logger = logging.getLogger("distribute_utils.cli")  # (the command line's one logger, as before the split)


# -- demo ------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    if args.tp < 1 or args.pp < 1 or args.tp * args.pp != args.nproc:
        raise UsageError(
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp}, but --nproc is {args.nproc}"
        )
    if not args.size_mb > 0:
        raise UsageError(f"--size-mb must be positive, got {args.size_mb}")
    if args.keep is not None:
        from .demo import check_keep

        try:
            check_keep(args.keep, args.tp, args.pp, args.overwrite)
        except ValueError as exc:
            raise UsageError(f"--keep: {exc}") from None
    from .demo import demo_header, format_demo, run_demo

    print(demo_header(args.nproc, args.tp, args.pp), flush=True)  # at once: the rest takes seconds

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_demo(
        args.nproc,
        args.tp,
        args.pp,
        size_mb=args.size_mb,
        keep=args.keep,
        overwrite=args.overwrite,
        say=None if args.quiet else say,
    )
    print(format_demo(result, header=False, wall_seconds=time.perf_counter() - args.started))
    return 0


# -- consolidate -----------------------------------------------------------------------------------
_CHECKPOINT_MARKERS = re.compile(
    r"mp_rank_\d{2}(_\d{3}){0,2}|iter_\d{7}|release|latest_checkpointed_iteration\.txt|\.metadata"
)


def _open_input(path: str, names: str | None = None) -> Checkpoint:
    """Opens INPUT (a directory: :func:`_check_places` looked); what is not a checkpoint at all is a usage
    error, a broken checkpoint a failure."""
    from .consolidate.formats import open_checkpoint
    from .consolidate.layouts import MESH_FILE, LayoutError

    root = Path(path)
    try:
        return open_checkpoint(root, names=names)
    except LayoutError:
        recognised = (root / MESH_FILE).exists() or any(
            _CHECKPOINT_MARKERS.fullmatch(p.name) for p in root.iterdir()
        )
        if not recognised:
            raise UsageError(
                f"input '{root}' is not a checkpoint: expected mesh.json (distribute_utils layout), "
                ".metadata (torch.distributed.checkpoint, Megatron/NeMo torch_dist) or "
                "mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt directories (Megatron-LM legacy)"
            ) from None
        raise


def _consolidate_options(args: argparse.Namespace) -> dict[str, Any]:
    from .consolidate.rules import RuleSyntaxError
    from .consolidate.tp_pp import resolve_rules

    try:
        resolve_rules(args.rules, args.quant_format)
    except (OSError, RuleSyntaxError) as exc:
        raise UsageError(f"--rules: {one_line(exc)}") from None
    if args.to is not None and args.format != "safetensors":
        raise UsageError(f"--to {args.to} writes safetensors; leave out --format {args.format}")
    if args.hf_config and args.to is None:
        raise UsageError("--hf-config gives facts of a --to hf conversion; add --to hf")
    return {
        "format": args.format,
        "rules": args.rules,
        "quant_format": args.quant_format,
        "max_shard_size": args.max_shard_size,
        "workspace_path": args.workspace,
        "timeout": args.timeout,
        "progress": not args.quiet,
        "swiglu": args.swiglu,
        "names": args.megatron_names,
        "only": args.only,
        "strip_prefix": args.strip_prefix,
        "to": args.to,
        "hf_config": args.hf_config,
    }


def _prepare_output(args: argparse.Namespace, plan: list[MergePlanEntry] | None) -> OutputTarget:
    """Checks OUTPUT against the exact files this run writes (``plan`` decides them with
    ``--max-shard-size``); what is in the way is a usage error naming the files."""
    from .consolidate.writers import output_paths
    from .outputs import prepare_output

    specs = None if plan is None else [e.spec for e in plan]
    side: list[str] = []
    if args.to is not None:  # (config.json beside the weights; the split is the converted tensors')
        conversion = _conversion(args)
        specs, side = (conversion.specs if plan is not None else None), list(conversion.files)
    try:
        files, scheme = output_paths(args.format, args.output, specs, args.max_shard_size, side)
        target = prepare_output(args.output, args.overwrite, files, scheme, inside=args.input)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.target = target
    return target


def _plan(args: argparse.Namespace) -> tuple[Checkpoint, list[MergePlanEntry]]:
    """INPUT opened and planned with the command's options (metadata only)."""
    from .consolidate.tp_pp import plan_checkpoint

    return plan_checkpoint(
        args.input,
        args.rules,
        quant_format=args.quant_format,
        swiglu=args.swiglu,
        names=args.megatron_names,
        only=args.only,
        strip_prefix=args.strip_prefix,
    )


def _conversion(args: argparse.Namespace) -> HfConversion:
    """The ``--to`` conversion of INPUT's plan (metadata only)."""
    from .consolidate.hf_llama import parse_given
    from .consolidate.plan import plan_conversion

    checkpoint, entries = _plan(args)
    conversion = plan_conversion(checkpoint, entries, args.to, parse_given(args.hf_config), args.swiglu)
    assert conversion is not None
    return conversion


def _plan_if_needed(args: argparse.Namespace, needed: bool) -> list[MergePlanEntry] | None:
    """The merge plan, when the output's file names (``--max-shard-size``) or a fail-fast check need it."""
    return _plan(args)[1] if needed or args.max_shard_size is not None else None


def _print_consolidation(report: ConsolidationReport, args: argparse.Namespace) -> None:
    """The report, with the whole command's wall time (``wall_s``) beside the work's (``seconds``), and
    the files of the same names that the run replaced (``--overwrite``)."""
    wall = time.perf_counter() - args.started
    if args.target is not None:
        report.replaced = [os.fspath(p) for p in args.target.replaced]
    if args.json:
        print(json.dumps({**report.to_dict(), "wall_s": wall}, indent=2))
    else:
        print(report.summary(wall))


def _consolidate_as_torchrun_rank(
    args: argparse.Namespace, options: dict[str, Any], layout: Checkpoint
) -> int:
    """This process is one rank of a torchrun job: join it and consolidate.

    Every rank fails together (the library agrees on the outcome), so only rank 0 prints the cause;
    another rank prints only when it lost its peers.
    """
    from .consolidate.tp_pp import consolidate_checkpoint
    from .errors import PeerLostError

    needed = layout.tp * layout.stages
    world = int(os.environ["WORLD_SIZE"])
    if world not in (needed, 1) or (args.nproc is not None and args.nproc != world):
        raise UsageError(
            f"'{args.input}' is {layout.describe_grid()}: start {needed} ranks "
            f"(torchrun --nproc-per-node {needed}), not {world}"
        )
    import torch.distributed as dist

    target = None
    if os.environ["RANK"] == "0":  # the writer: its output folder is checked (and made) on its host
        target = _prepare_output(args, _plan_if_needed(args, False))
    undo = interrupts.on_interrupt(target.abandon if target is not None else lambda: None)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        report = consolidate_checkpoint(args.input, args.output, **options)
    except (OSError, ValueError, RuntimeError) as exc:
        undo.cancel()
        if target is not None:
            target.abandon()
        if rank == 0 or isinstance(exc, PeerLostError):
            print(f"distribute-utils consolidate: error (rank {rank}): {one_line(exc)}", file=sys.stderr)
        logger.debug("failure", exc_info=True)
        return 1
    finally:
        if created:
            dist.destroy_process_group()
    undo.cancel()
    if report.rank == 0:
        _print_consolidation(report, args)
    return 0


def _print_plan(args: argparse.Namespace) -> int:
    """``--dry-run``: the rule, shape and dtype of every output tensor, and the output size; writes nothing."""
    layout, plan = _plan(args)
    total = sum(e.spec.nbytes for e in plan)
    whole = layout.tp == 1 and layout.stages == 1  # (one shard of each tensor: copied as stored)

    def rule(e: MergePlanEntry) -> str:
        return "whole" if whole else str(e.rule)

    if args.json:
        rows = [
            {"name": e.name, "rule": rule(e), "shape": list(e.spec.shape), "dtype": str(e.spec.dtype)}
            for e in plan
        ]
        print(
            json.dumps(
                {"input": args.input, "layout": layout.kind, "tensors": rows, "bytes": total}, indent=2
            )
        )
        return 0
    width = max((len(e.name) for e in plan), default=4)
    print(f"{'tensor':<{width}}  {'rule':<12} {'dtype':<10} shape")
    for e in plan:
        dtype = str(e.spec.dtype).removeprefix("torch.")
        print(f"{e.name:<{width}}  {rule(e):<12} {dtype:<10} {list(e.spec.shape)}")
    print(
        f"{len(plan)} tensors, {total / 2**20:.1f} MiB, from {layout.describe_grid()} ({layout.kind}); nothing written"
        + ("; whole: each tensor is stored whole and copied as it is" if whole else "")
    )
    return 0


def _check_places(args: argparse.Namespace) -> None:
    """INPUT and OUTPUT looked at before torch is imported, so that a wrong path is answered at once."""
    from .outputs import check_output_place

    root = Path(args.input)
    if not root.exists():
        raise UsageError(f"input '{root}' does not exist")
    if not root.is_dir():
        raise UsageError(f"input '{root}' is not a directory: give the checkpoint directory")
    # (".metadata" is dcp_metadata.DCP_METADATA, whose module imports torch: named here to answer without it)
    if args.nproc not in (None, 1) and (root / ".metadata").is_file():
        raise UsageError(
            f"--nproc {args.nproc}: '{root}' is a torch.distributed.checkpoint, which one process "
            "consolidates (it reads every tensor whole from the files); leave out --nproc"
        )
    out = Path(args.output)
    file_named = out.suffix in (".safetensors", ".bin") and not out.is_dir()
    try:
        check_output_place(out.parent if file_named else out, inside=root)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_consolidate(args: argparse.Namespace) -> int:
    _check_places(args)
    from .consolidate.tp_pp import consolidate_local
    from .launch import under_torchrun

    options = _consolidate_options(args)
    layout = _open_input(args.input, args.megatron_names)
    if args.dry_run:
        return _print_plan(args)
    needed = layout.tp * layout.stages
    if under_torchrun():
        return _consolidate_as_torchrun_rank(args, options, layout)
    nproc = 1 if args.nproc is None else args.nproc
    if nproc != 1 and needed == 1:
        raise UsageError(
            f"--nproc {nproc}: '{args.input}' is {layout.describe_grid()}, which one process consolidates "
            "(it reads every tensor whole from the files); leave out --nproc"
        )
    if nproc not in (needed, 1):
        raise UsageError(
            f"--nproc {nproc} does not fit '{args.input}': {layout.describe_grid()} "
            f"needs {needed} ranks (or 1 to consolidate in this process)"
        )
    target = _prepare_output(args, _plan_if_needed(args, nproc > 1))  # nproc > 1: fail before spawning
    undo = interrupts.on_interrupt(target.abandon)
    try:
        if nproc > 1 and not args.quiet:
            print(f"starting {nproc} local ranks ...", file=sys.stderr)
        report = consolidate_local(args.input, args.output, nproc=nproc, **options)
    except (LaunchError, OSError, ValueError, RuntimeError) as exc:
        undo.cancel()
        target.abandon()
        fail(args, exc)
        return 1
    undo.cancel()  # (an Interrupted leaves it to interrupts.end)
    _print_consolidation(report, args)
    return 0


def fail(args: argparse.Namespace, exc: BaseException, code: int = 1) -> None:
    """The one-line error on stderr; with ``--json`` also ``{"error", "kind", "exit_code"}`` on stdout."""
    interrupts.settle()  # an interrupt being handled says why instead
    message = one_line(exc)
    if code == 1:
        print(f"distribute-utils {args.command}: error: {message}", file=sys.stderr)
        logger.debug("failure", exc_info=True)
    if getattr(args, "json", False):
        kind = "UsageError" if isinstance(exc, UsageError) else type(exc).__name__
        print(json.dumps({"error": message, "kind": kind, "exit_code": code}))


def cmd_doctor(args: argparse.Namespace) -> int:
    from .hygiene import doctor

    return doctor(args.workspace, sys.stdout, as_json=args.json)


def cmd_clean(args: argparse.Namespace) -> int:
    from .hygiene import clean

    return clean(args.workspace, args.dry_run, sys.stdout, as_json=args.json)
