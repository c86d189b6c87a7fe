"""Benchmark MeshLayout's group enumeration on a large 4-axis layout (no process group).

Enumerates every group along each axis (and one pair of axes) of a 1,048,576-rank layout,
checks that the groups partition the ranks, and prints the time per call. Target: well under
a few seconds per call on this 2-core machine.

Usage: python scripts/bench_layout.py [--shape 16 16 64 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from distribute_utils import MeshLayout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 16, 64, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layout = MeshLayout(args.shape, axis_names=[f"a{i}" for i in range(len(args.shape))])
    print(f"layout {layout.shape}: {layout.size:,} ranks")
    print(f"{'axes':<12}{'groups':>10}{'group size':>12}{'median s':>10}")
    cases: list[list[int]] = [[axis] for axis in range(layout.ndim)] + [[0, layout.ndim - 1]]
    worst = 0.0
    for axes in cases:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            groups = layout.groups_along(axes)
            times.append(time.perf_counter() - start)
        assert sum(len(g) for g in groups) == layout.size
        assert len(groups) == layout.size // math.prod(layout.shape[a] for a in axes)
        median = statistics.median(times)
        worst = max(worst, median)
        print(f"{axes!s:<12}{len(groups):>10,}{len(groups[0]):>12,}{median:>10.3f}")
    start = time.perf_counter()
    for rank in range(0, layout.size, layout.size // 1000):
        layout.group_of(rank, 1)
    print(f"group_of on 1,000 ranks: {time.perf_counter() - start:.3f} s")
    print(f"{'PASS' if worst < 3.0 else 'FAIL'}  slowest enumeration {worst:.3f} s (target < 3 s)")


if __name__ == "__main__":
    main()
