"""Internal. The built-in demo (``distribute-utils demo``): a mesh tour, then a real checkpoint consolidation.

One spawn of ``nproc`` local ranks (gloo, shared memory) does both parts:

1. **mesh**: every rank builds a ``ProcessGroupMesh(pp, tp)``, creates the group of each axis, runs an
   ``all_reduce`` and a barrier on it, and the reports are gathered to rank 0 (TP, then PP);
2. **consolidation**: a synthetic GPT-like model (:mod:`distribute_utils.consolidate.synthetic`) sharded
   TP x PP into a temporary directory in the own layout is consolidated by
   :func:`~distribute_utils.consolidate.consolidate_checkpoint` on the same ranks (the code path of
   ``distribute-utils consolidate``), and the output is compared bit for bit with the unsharded original.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import interrupts
from .errors import ArgumentError, ConsolidationError

if TYPE_CHECKING:
    import torch

    from .outputs import OutputTarget

__all__ = ["DemoResult", "check_keep", "demo_header", "format_demo", "mesh_rank", "run_demo"]

logger = logging.getLogger(__name__)


def mesh_rank(tp: int, pp: int, progress: bool = False) -> dict[str, Any]:
    """One rank of the mesh part: groups, a collective and a barrier per axis; reports gathered to rank 0.

    Must be called on every rank of a job of ``tp * pp`` ranks. ``progress``: rank 0 says on stderr when
    the ranks have joined and when the consolidation starts (the seconds in between are otherwise silent).

    Returns:
        On rank 0 ``{"layout": str, "reports": [one dict per rank]}``; elsewhere the same with
        ``reports == []``.
    """
    import torch
    import torch.distributed as dist

    from .gather import gather_configs
    from .mesh import ProcessGroupMesh

    def say(line: str) -> None:
        if progress and dist.get_rank() == 0:
            print(line, file=sys.stderr, flush=True)

    say(f"{dist.get_world_size()} ranks joined; [1/2] building the mesh ...")
    mesh = ProcessGroupMesh(pp, tp, axis_names=("pp", "tp"))
    report: dict[str, Any] = {"rank": mesh.rank, "coord": mesh.coordinate(), "axes": {}}
    for axis in ("pp", "tp"):
        group = mesh.get_group_along_axis(axis)
        assert group is not None  # no indices_at_axis: every rank is in a group along each axis
        value = torch.tensor([mesh.rank], dtype=torch.int64)
        start = time.perf_counter()
        dist.all_reduce(value, group=group)
        mesh.barrier(axis, timeout=60)
        report["axes"][axis] = {
            "ranks": mesh.get_ranks_in_group(group),
            "all_reduce_sum": int(value),
            "ms": (time.perf_counter() - start) * 1e3,
        }
    with gather_configs(report, mesh, "tp", timeout=60) as tp_reports:
        merged = tp_reports
    with gather_configs(merged, mesh, "pp", timeout=60) as stage_reports:
        everything = [r for stage in stage_reports for r in stage]
    mesh.destroy_mesh_process_groups()
    say("[2/2] consolidating the checkpoint on the same ranks ...")
    return {"layout": repr(mesh.layout), "reports": everything}


def _mesh_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"  mesh: {result['layout']}"]
    for report in sorted(result["reports"], key=lambda r: r["rank"]):
        parts = [
            f"{axis} group {info['ranks']}: all_reduce sum {info['all_reduce_sum']}, "
            f"barrier ok ({info['ms']:.1f} ms)"
            for axis, info in report["axes"].items()
        ]
        lines.append(f"  rank {report['rank']} at {tuple(report['coord'])}: " + "; ".join(parts))
    return lines


@dataclass
class DemoResult:
    """What :func:`run_demo` did.

    Attributes:
        nproc: ranks spawned.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        mesh: rank 0's result of :func:`mesh_rank`.
        report: rank 0's consolidation report.
        model: a one-line description of the synthetic model.
        model_bytes: its size in bytes.
        layers_per_stage: decoder layers per PP stage of the sharded checkpoint.
        verified: tensors found bit-identical to the original.
        seconds: wall time of the whole demo (spawn included).
        kept: where the checkpoint and output were kept, or ``None`` (removed).
    """

    nproc: int
    tp: int
    pp: int
    mesh: dict[str, Any]
    report: Any
    model: str
    model_bytes: int
    layers_per_stage: list[int]
    verified: int
    seconds: float
    kept: str | None


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def check_keep(keep: str | os.PathLike[str], tp: int, pp: int, overwrite: bool = False) -> list[OutputTarget]:
    """Checks ``--keep DIR`` before anything is written: ``DIR/checkpoint`` (``mesh.json`` +
    ``rank_NNNNN.safetensors``) and ``DIR/consolidated`` (``model.safetensors``) as any output is checked
    (:func:`~.outputs.prepare_output`): files of the names the demo writes are replaced only with
    ``overwrite``, files of those naming schemes it would not write (a larger grid's shards) are refused,
    other files are left alone. A missing ``DIR`` needs an existing parent.

    Raises:
        OutputError: what is in the way, named.
    """
    from .consolidate.writers import output_paths
    from .outputs import prepare_output

    root = Path(keep)
    if not root.exists():
        return [prepare_output(root, overwrite, [root / "checkpoint"])]  # the parent is all to check
    ckpt = [root / "checkpoint" / "mesh.json"]
    ckpt += [root / "checkpoint" / f"rank_{r:05d}.safetensors" for r in range(tp * pp)]
    files, scheme = output_paths("safetensors", root / "consolidated")
    return [
        prepare_output(root / "checkpoint", overwrite, ckpt, r"mesh\.json|rank_\d{5}\.safetensors"),
        prepare_output(root / "consolidated", overwrite, files, scheme),
    ]


def run_demo(
    nproc: int = 4,
    tp: int = 2,
    pp: int = 2,
    size_mb: float = 64.0,
    keep: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    say: Callable[[str], object] | None = None,
) -> DemoResult:
    """Runs the demo on ``nproc`` freshly spawned local ranks; call it in a plain process.

    Args:
        nproc: ranks to spawn; must equal ``tp * pp``.
        tp: tensor-parallel size (the synthetic dims are multiples of 128, so up to 128).
        pp: pipeline-parallel size.
        size_mb: approximate model size in MB (10**6 bytes).
        keep: keep the sharded checkpoint (``DIR/checkpoint``) and the output (``DIR/consolidated``) here;
            ``None``: a temporary directory, removed at the end. Files there of the names the demo writes
            are refused unless ``overwrite`` (see :func:`check_keep`): the demo never deletes what it did
            not write.
        overwrite: with ``keep``: replace the files of those names.
        say: called with a short progress line before each slow step (the CLI prints them on stderr).

    Raises:
        ValueError: ``tp * pp != nproc`` or a non-positive size; OutputError: ``keep`` holds files in the
            way (named).
        ConsolidationError: the consolidation failed (cause and rank named).
        ConsolidationError: also, never expected: the output differs from the original (tensor named).
    """
    if tp < 1 or pp < 1 or tp * pp != nproc:
        raise ArgumentError(
            f"--tp {tp} x --pp {pp} = {tp * pp}, but --nproc is {nproc}; give --tp and --pp >= 1 whose product "
            "is --nproc"
        )
    if not size_mb > 0:
        raise ArgumentError(f"size_mb must be positive, got {size_mb}")
    progress = say is not None
    say = say or (lambda line: None)
    say(f"writing a ~{size_mb:g} MB synthetic model sharded TP {tp} x PP {pp} ...")
    import torch

    from .consolidate import load_safetensors, write_own_layout
    from .consolidate.synthetic import (
        balanced_layers_per_stage,
        make_gpt_state_dict,
        shard_state_dict,
        synthetic_size_for,
    )
    from .consolidate.tp_pp import consolidate_on_local_ranks

    start = time.perf_counter()
    if keep is not None:
        check_keep(keep, tp, pp, overwrite)
    root = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="du_demo_"))
    ckpt, out = root / "checkpoint", root / "consolidated"
    # An interrupt removes what this run made: the temporary root, or the kept directories it created
    # (existing ones keep what they held; the files are published complete or not at all).
    made = [root] if keep is None else [p for p in (root, ckpt, out) if not p.exists()]
    undo = interrupts.on_interrupt(functools.partial(_remove_made, made))
    try:
        num_layers = max(8, pp)
        dims = synthetic_size_for(int(size_mb * 1e6), num_layers=num_layers)
        original = make_gpt_state_dict(**dims.as_kwargs())  # type: ignore[arg-type]
        layers = balanced_layers_per_stage(num_layers, pp)
        write_own_layout(
            ckpt, shard_state_dict(original, tp, pp, layers_per_stage=layers), layers_per_stage=layers
        )
        options = {"progress": False, "timeout": 120}
        before = functools.partial(mesh_rank, tp, pp, progress)
        say(f"starting {nproc} local ranks ...")
        report, befores = consolidate_on_local_ranks(
            ckpt, out, nproc, before=before, launch_timeout=600, **options
        )
        merged = load_safetensors(report.files[0])
        if set(merged) != set(original):
            raise ConsolidationError(f"output names differ: {sorted(set(merged) ^ set(original))[:5]}")
        verified = 0
        for name, tensor in original.items():
            got = merged[name]
            if (
                got.dtype != tensor.dtype
                or got.shape != tensor.shape
                or not torch.equal(_bits(got), _bits(tensor))
            ):
                raise ConsolidationError(f"tensor '{name}' of the output differs from the original")
            verified += 1
        del merged
        model = (
            f"synthetic GPT, {dims.num_layers} layers, hidden {dims.hidden}, ffn {dims.ffn_hidden}, "
            f"vocab {dims.vocab}, {str(dims.dtype).removeprefix('torch.')}"
        )
        return DemoResult(
            nproc=nproc,
            tp=tp,
            pp=pp,
            mesh=befores[0],
            report=report,
            model=model,
            model_bytes=dims.nbytes,
            layers_per_stage=layers,
            verified=verified,
            seconds=time.perf_counter() - start,
            kept=os.fspath(root) if keep is not None else None,
        )
    finally:
        undo.cancel()
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _remove_made(made: list[Path]) -> None:
    """Removes the directories a demo run wrote into (the kept ones were new, empty, or given up to
    ``overwrite``), newest first."""
    for d in reversed(made):
        shutil.rmtree(d, ignore_errors=True)


def demo_header(nproc: int, tp: int, pp: int) -> str:
    """The report's first line, which the command prints before it starts the ranks (no torch import)."""
    return f"distribute-utils demo: {nproc} local ranks (gloo + shared memory), TP {tp} x PP {pp}"


def format_demo(result: DemoResult, header: bool = True, wall_seconds: float | None = None) -> str:
    """The demo's printed report, with the next step to try; ``header=False`` leaves out :func:`demo_header`
    (printed already); ``wall_seconds``: the whole command's time, said beside the demo's own."""
    r = result.report
    lines = [
        *([demo_header(result.nproc, result.tp, result.pp), ""] if header else []),
        "[1/2] mesh: groups, a collective and a barrier per axis",
        *_mesh_lines(result.mesh),
        "",
        "[2/2] checkpoint consolidation (the code path of `distribute-utils consolidate`)",
        f"  model:      {result.model}: {r.tensors} tensors, {result.model_bytes / 2**20:.1f} MiB",
        f"  layout:     own (mesh.json), safetensors shards, TP {r.tp} x PP {r.pp}, "
        f"layers per stage {result.layers_per_stage}",
        f"  transport:  {r.transport} ({r.rounds} round{'' if r.rounds == 1 else 's'} of "
        f"<= {r.batch_bytes / 2**20:.0f} MiB per stage)",
        f"  moved:      {r.tensors} tensors, {r.bytes / 2**20:.1f} MiB in {r.seconds:.2f} s "
        f"({r.mib_per_s:.0f} MiB/s)",
        f"  peak memory of rank 0 (VmHWM): {r.peak_rss_bytes / 2**20:.0f} MiB",
        f"  verified bit-exact: {result.verified} tensors",
    ]
    if result.kept is not None:
        lines.append(f"  kept in:    {result.kept} (checkpoint/, consolidated/)")
    done = f"done in {result.seconds:.1f} s"
    if wall_seconds is not None:
        done = f"done: {wall_seconds:.1f} s for the whole command (start-up included), {result.seconds:.1f} s of it the demo's work"
    lines.append(done)
    if result.kept is not None:
        lines.append(
            f"next: distribute-utils consolidate {result.kept}/checkpoint OUT  (your own checkpoint: the same "
            "command; see docs/quickstart.md)"
        )
    else:
        lines.append(
            "next: distribute-utils demo --keep DIR keeps a checkpoint to try `distribute-utils consolidate "
            "DIR/checkpoint OUT` on; see docs/quickstart.md"
        )
    return "\n".join(lines)
