"""The ``distribute-utils`` command line: ``demo``, ``consolidate``, ``doctor``, ``clean``.

``main(argv) -> int`` parses, configures logging and dispatches. Exit codes: 0 ok, 1 failure
(a one-line cause on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import __version__
from .launch import LaunchError, run_local

__all__ = ["main"]

logger = logging.getLogger("distribute_utils.cli")


# -- demo ------------------------------------------------------------------------------------------
def _demo_mesh_rank(tp: int, pp: int) -> dict:
    """One rank of the mesh part of the demo: groups, a collective and a barrier per axis."""
    from .gather import gather_configs
    from .mesh import ProcessGroupMesh

    mesh = ProcessGroupMesh(pp, tp, axis_names=("pp", "tp"))
    report: dict = {"rank": mesh.rank, "coord": mesh.coordinate(), "axes": {}}
    for axis in ("pp", "tp"):
        group = mesh.get_group_along_axis(axis)
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
    return {"layout": repr(mesh.layout), "reports": everything}


def _print_mesh_report(result: dict) -> None:
    print(f"mesh: {result['layout']}")
    for report in sorted(result["reports"], key=lambda r: r["rank"]):
        parts = [
            f"{axis} group {info['ranks']}: all_reduce sum {info['all_reduce_sum']}, barrier ok ({info['ms']:.1f} ms)"
            for axis, info in report["axes"].items()
        ]
        print(f"  rank {report['rank']} at {tuple(report['coord'])}: " + "; ".join(parts))


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.tp * args.pp != args.nproc:
        raise _UsageError(
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp}, but --nproc is {args.nproc}"
        )
    results = run_local(_demo_mesh_rank, args.nproc, args.tp, args.pp, timeout=600)
    _print_mesh_report(results[0])
    return 0


# -- plumbing --------------------------------------------------------------------------------------
class _UsageError(Exception):
    """Arguments that parse but do not make sense together (exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``distribute-utils`` (all subcommands)."""
    parser = argparse.ArgumentParser(
        prog="distribute-utils",
        description="Gather configs and tensor shards to one rank at the end of a distributed PyTorch job, "
        "and consolidate tensor/pipeline-parallel checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, warnings and errors only"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the built-in end-to-end demo on local processes",
        description="Start N local ranks (gloo, shared memory), build a TP x PP mesh, create its groups, run a "
        "collective and a barrier per axis, and print what each group did.",
    )
    demo.add_argument("--nproc", type=int, default=4, help="number of local ranks (default 4)")
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    demo.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def _configure_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distribute-utils``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose, args.quiet)
    try:
        return int(args.handler(args))
    except _UsageError as exc:
        parser.error(str(exc))  # exits with code 2
    except (LaunchError, OSError, ValueError, RuntimeError) as exc:
        print(f"distribute-utils {args.command}: error: {exc}", file=sys.stderr)
        logger.debug("failure", exc_info=True)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
