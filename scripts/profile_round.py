"""Python calls per gather round, by function, on the first rank and on a sender (cProfile).

Four local ranks (gloo, one host: the direct round) gather one float32 tensor of ``--elements`` (1024)
elements per rank to rank 0, ``--rounds`` times after 200 warm-up rounds (fewer for large tensors); ranks
0 and 1 profile the timed rounds with ``cProfile`` (its clock: ``time.thread_time``, the calling thread's
CPU). Prints each profiled rank's calls
per round (every Python and built-in call cProfile counts) and its busiest functions. Calls, not time, are
what the profile counts: compare two revisions with ``--against REV`` (the package at REV, one after the
other). Before profiling, the same ranks time ``--rounds`` rounds unprofiled, each after a ``dist.barrier()``
(as ``bench_latency.py``'s rounds start): the median of the calling thread's CPU per round (``time.thread_time_ns``;
rank 0's includes summing the four tensors it got).

    python scripts/profile_round.py                      # this tree
    python scripts/profile_round.py --against dea47a4    # and the package at dea47a4, one after the other
    python scripts/profile_round.py --elements 16777216 --rounds 10 --sort tottime    # 64 MiB per rank
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rank(rounds: int, top: int, sort: str = "ncalls", elements: int = 1024) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from distribute_utils import get_tensors_parallel

    rank, ranks = dist.get_rank(), list(range(dist.get_world_size()))
    value = torch.full((elements,), float(rank))

    def one() -> None:
        with get_tensors_parallel(value, ranks) as got:
            for tensor in got:
                tensor.sum()

    for _ in range(min(200, max(3, 2**28 // (4 * elements)))):  # (warm-up: at most about 256 MiB per rank)
        one()
    cpu = []  # each round's thread CPU, unprofiled, after a barrier (as bench_latency's rounds start)
    for _ in range(rounds):
        dist.barrier()
        start = time.thread_time_ns()
        one()
        cpu.append(time.thread_time_ns() - start)
    cpu.sort()
    dist.barrier()
    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    for _ in range(rounds):
        one()
    profile.disable()
    dist.barrier()
    if rank > 1:
        return None
    import distribute_utils

    stats = pstats.Stats(profile, stream=io.StringIO())
    calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats(sort).print_stats(top)
    return {
        "calls_per_round": calls / rounds,
        "cpu_us": cpu[len(cpu) // 2] / 1e3,
        "table": out.getvalue(),
        "package": distribute_utils.__file__,
    }


def tree_at(rev: str, where: Path) -> Path:
    """The repository's tree at ``rev`` (``git archive``), written into ``where`` (made here)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def profile_tree(
    tree: Path, rounds: int, top: int = 25, sort: str = "ncalls", elements: int = 1024
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first rank's and a sender's profile (as :func:`_rank` returns them) of the package in ``tree``,
    on 4 fresh local ranks; raises SystemExit when the ranks ran another copy of the package."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2])\n"
        "import json, profile_round\n"
        "from distribute_utils.launch import run_local\n"
        "print(json.dumps(run_local(profile_round._rank, 4, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))[:2]))\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(tree),
            str(ROOT / "scripts"),
            str(rounds),
            str(top),
            sort,
            str(elements),
        ],
        capture_output=True,
        text=True,
        check=True,
        # (the ranks are forked from a fresh server process: the tree comes first on its path too,
        # before its working directory and the package as installed)
        cwd=tree,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p),
        },
    )
    first, sender = json.loads(done.stdout.strip().splitlines()[-1])
    for profiled in (first, sender):
        if not Path(profiled["package"]).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{tree}: the ranks ran the package at {profiled['package']}, not {tree}'s")
    return first, sender


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--top", type=int, default=25, help="functions listed per rank")
    parser.add_argument(
        "--sort",
        default="ncalls",
        choices=("ncalls", "tottime", "cumulative"),
        help="the order they are listed in",
    )
    parser.add_argument("--elements", type=int, default=1024, help="float32 elements per rank (4 KiB)")
    parser.add_argument("--against", metavar="REV", help="also profile the package at git revision REV")
    parser.add_argument("--quiet", action="store_true", help="only the calls per round")
    args = parser.parse_args(argv)
    trees = [("this tree", ROOT)]
    with tempfile.TemporaryDirectory(prefix="du-profile-") as tmp:
        if args.against:
            trees.append((args.against, tree_at(args.against, Path(tmp) / "tree")))
        for label, tree in trees:
            first, sender = profile_tree(tree, args.rounds, args.top, args.sort, args.elements)
            print(
                f"{label}: calls per round, first rank {first['calls_per_round']:.1f}, a sender "
                f"{sender['calls_per_round']:.1f}; thread CPU per round (median, µs, unprofiled), first rank "
                f"{first['cpu_us']:.0f}, a sender {sender['cpu_us']:.0f}"
            )
            if not args.quiet:
                print(f"--- first rank ({label})\n{first['table']}--- a sender ({label})\n{sender['table']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
