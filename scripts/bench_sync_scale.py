"""How synchronisation scales with the number of ranks: ours vs torch's store barrier.

N simulated ranks are N threads, each with its own client of one real ``TCPStore``. They
run the library's own code (:class:`distribute_utils.sync.GroupSync`):

- ``barrier``: our barrier (arrival key, counter, one go key);
- ``gather``: one gather call's agreement as the gather module makes it: every sender posts
  its claim and marker and waits for the first rank's verdict; the first reads its N-1
  participants' claims and posts the verdict (no payload: this measures the protocol);

side by side with torch's store-barrier pattern (``add`` on a counter, the last rank sets a
key the others wait on). Store operations are counted per rank.

    python scripts/bench_sync_scale.py                     # N = 64, 256, 1024, 4096
    python scripts/bench_sync_scale.py --ranks 64 256 --repeats 5
    python scripts/bench_sync_scale.py --real 2 4 8 16     # real processes instead

``--real``: real rank processes (gloo) on this machine: the median of our barrier, of a tiny
gather (``{"a": 1}`` to rank 0 through ``get_configs_parallel``) and of ``dist.barrier``
(gloo), 300 repetitions each, interleaved.

Prints one row per N (medians in ms), the ratios, and the growth exponent between the
smallest and largest N (1.0 is linear).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one "hostname" warning per connection otherwise

import argparse
import datetime
import math
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from distribute_utils import sync
from distribute_utils.gather import _Claim, _Verdict

_OPS = ("set", "get", "add", "multi_set", "multi_get", "check", "compare_set", "wait", "append", "delete_key")


class CountingStore:
    """A store client that counts the operations made through it (a real ``TCPStore`` inside)."""

    def __init__(self, inner: dist.Store) -> None:
        self._inner = inner
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in _OPS:

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return attr(*args, **kwargs)

            return counted
        return attr

    def clone(self) -> CountingStore:
        return CountingStore(self._inner.clone())


def _run_threads(n: int, body: Callable[[int], None]) -> float:
    """Run ``body(rank)`` on ``n`` threads released at once; seconds until the last returns."""
    start = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        start.wait()
        try:
            body(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def _gather_agreement(group: sync.GroupSync, timeout: float) -> None:
    """One gather call's store traffic, as :mod:`distribute_utils.gather` makes it."""
    call = group.new_call(timeout)
    ranks = list(group.ranks)
    digest = sync._digest(ranks)
    first = ranks[0]
    if group.rank == first:
        call.post({"c": _Claim("first", None, digest, "auto:False", None).pack()})
        claims = [_Claim.unpack(v) for v in call.wait_for("c", ranks[1:], timeout, "gather")]
        assert all(c.digest == digest for c in claims)
        call.post({"v": _Verdict(True, None, digest).pack()})
    else:
        claim = _Claim("send", None, digest, "auto:False", None, ["inline", b"x" * 64]).pack()
        call.post({"c": claim, "v": _Verdict(False, None, digest).pack()})
        verdict = _Verdict.unpack(call.wait_verdict(first, timeout, "gather"))
        assert verdict.receiver and verdict.digest == digest


def _torch_barrier(store: Any, n: int, tag: str, timeout: float) -> None:
    """torch's store-based barrier: one counter, and one key the last rank sets."""
    if store.add(f"{tag}/count", 1) == n:
        store.set(f"{tag}/go", b"1")
    else:
        store.wait([f"{tag}/go"], datetime.timedelta(seconds=timeout))


def run_scale(ns: list[int], repeats: int = 5, timeout: float = 120.0) -> dict[int, dict[str, float]]:
    """Measure every N in ``ns``; returns per N the medians (s) and store operations per rank."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 3 * max(ns) + 256
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(needed, soft)), hard))
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, use_libuv=True)
    report: dict[int, dict[str, float]] = {}
    for n in ns:
        clients = [
            CountingStore(dist.TCPStore("127.0.0.1", master.port, 1, is_master=False, use_libuv=True))
            for _ in range(n)
        ]
        ranks = tuple(range(n))
        groups = [sync.GroupSync(ranks, r, clients[r], f"bench/{n}") for r in range(n)]
        times: dict[str, list[float]] = {"ours_barrier": [], "ours_gather": [], "torch_barrier": []}
        ops: dict[str, list[float]] = {"ours_barrier": [], "ours_gather": [], "torch_barrier": []}
        for i in range(repeats):  # interleaved, so that load changes hit every method alike
            bodies: list[tuple[str, Callable[[int], None]]] = [
                (
                    "torch_barrier",
                    lambda r, c=clients, n=n, i=i: _torch_barrier(c[r], n, f"torch/{n}/{i}", timeout),
                ),
                ("ours_barrier", lambda r, g=groups: g[r].barrier(timeout)),
                ("ours_gather", lambda r, g=groups: _gather_agreement(g[r], timeout)),
            ]
            for name, body in bodies:
                before = sum(c.count for c in clients)
                times[name].append(_run_threads(n, body))
                ops[name].append((sum(c.count for c in clients) - before) / n)
        row = {name: statistics.median(v) for name, v in times.items()}
        row.update({f"{name}_ops": max(v) * n for name, v in ops.items()})
        report[n] = row
        del clients, groups
    return report


def _real_rank(repeats: int) -> dict[str, float]:
    from distribute_utils import barrier, get_configs_parallel

    ranks = list(range(dist.get_world_size()))

    def tiny() -> None:
        with get_configs_parallel({"a": 1}, ranks):
            pass

    methods: dict[str, Callable[[], None]] = {
        "ours_barrier": lambda: barrier(timeout=60),
        "ours_tiny_gather": tiny,
        "gloo_barrier": dist.barrier,
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    for fn in methods.values():
        for _ in range(20):
            fn()
    for _ in range(repeats):
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def run_real(nprocs: list[int], repeats: int = 300) -> dict[int, dict[str, float]]:
    """Median seconds on rank 0 of our barrier, a tiny gather and gloo's barrier, per world size."""
    from distribute_utils.launch import run_local

    return {n: run_local(_real_rank, n, repeats)[0] for n in nprocs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real", type=int, nargs="*", help="world sizes of real rank processes")
    args = parser.parse_args(argv)
    if args.real:
        print(f"real processes, medians on rank 0 (ms), load {os.getloadavg()[0]:.1f}")
        print(f"{'ranks':>6} {'our barrier':>12} {'tiny gather':>12} {'gloo barrier':>13}")
        for n, row in run_real(args.real).items():
            print(
                f"{n:>6} {row['ours_barrier'] * 1e3:>12.3f} {row['ours_tiny_gather'] * 1e3:>12.3f} "
                f"{row['gloo_barrier'] * 1e3:>13.3f}"
            )
        return 0
    report = run_scale(args.ranks, args.repeats)
    print(
        f"{'N':>6} {'torch barrier':>14} {'our barrier':>12} {'ratio':>6} {'our gather':>11} {'ops/rank b,g':>13}"
    )
    for n, row in report.items():
        print(
            f"{n:>6} {row['torch_barrier'] * 1e3:>11.1f} ms {row['ours_barrier'] * 1e3:>9.1f} ms "
            f"{row['ours_barrier'] / row['torch_barrier']:>6.2f} {row['ours_gather'] * 1e3:>8.1f} ms "
            f"{row['ours_barrier_ops'] / n:>6.1f},{row['ours_gather_ops'] / n:>5.1f}"
        )
    ns = sorted(report)
    for lo, hi in itertools.pairwise(ns):
        exponents = {
            name: math.log(report[hi][name] / report[lo][name]) / math.log(hi / lo)
            for name in ("torch_barrier", "ours_barrier", "ours_gather")
        }
        print(f"growth exponent {lo}->{hi}: " + ", ".join(f"{k} {v:.2f}" for k, v in exponents.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
