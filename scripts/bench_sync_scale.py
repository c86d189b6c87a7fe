"""How the real barrier and gather round scale with the number of ranks, every store key counted.

N simulated ranks are N threads of this process on one real ``TCPStore``. Each has its own client of
it (as a real rank has: a client blocks in a wait, so it cannot be shared), its own peer directory
(:class:`distribute_utils.incarnation.PeerDirectory`) and its own companion of the world
(:class:`distribute_utils.sync.GroupSync`), built through their public constructors, and runs the
library's own round: :func:`distribute_utils.gather.gather_on`, the sender and first-rank roles of
every gather, through the claim/verdict channel's store implementation
(:class:`distribute_utils.channel.StoreChannel`). Nothing of the round is re-implemented here.

Every store client a simulated rank uses is wrapped in :class:`CountingStore`, this script's proxy
(the ``store`` argument of those constructors is the seam): it counts every key of every operation
(a ``multi_get`` of N keys counts N) and the bytes of key names and values both ways. The clients the
library clones for its background threads (the watchdog, the janitor) are one shared client, counted
apart ("background").

Simulated topology: one ``/dev/shm`` (the round's plan is "one host"), eight ranks per pid namespace
(the watchdog's local peers, as eight ranks per host), no mailbox (the threads share a pid, so their
network namespace is given as unknown): every round goes through the store.

Per N, interleaved per repetition, timed from the release of all threads until the last one has
returned and the janitor has deleted the keys the call made due (after a barrier: every key of the
calls before it), so that the store's work of deleting is inside the clock (here one thread deletes
the keys of all N simulated ranks, where each rank of a job deletes its own few in its own process).
The store's server is a thread of this process: its CPU time in each call (``schedstat``) is reported
too, with its growth exponent from 256 ranks up (target 1.2): key counts alone are linear by
construction, the server's CPU is what it really pays.

- ``torch barrier``: torch's own store barrier, the O(N) reference, its real sequence of store calls
  (``torch.distributed.distributed_c10d._store_based_barrier``'s: ``add`` 1 on a counter, ``add`` 0 to
  read it, the last rank sets a key, every rank ``wait``s on it), without its Python around them;
- ``torch lean``: the leaner barrier of ``torch.distributed.elastic.utils.store.barrier`` (``add``, the last
  rank sets, the others ``wait``), this script's reference before; our barrier's ratio to it is printed,
  not judged;
- ``our barrier``: :meth:`GroupSync.barrier` (an arrival key, the counter, the key waited on);
- ``tiny gather``: ``{"a": 1}`` of every rank to rank 0 over the world;
- ``tp x pp``: ModelOpt's export pattern with TP 8: every rank gathers a small layer config to the
  first rank of its pipeline list over the world (N/8 lists of N/8 ranks at once), then the first
  pipeline stage merges its 8 TP shards on a group of its own.

The first call of each kind is timed and counted apart from the steady state (median over
``--repeats``). ``--real N ...`` runs real rank processes of one host instead: their gathers take the
direct round (claims and verdicts through the ranks' mailboxes, no store), what every one-host job
takes; its medians on rank 0 are printed beside gloo's barrier. Keys and bytes are reported for the first rank (rank 0) and the busiest other rank.
Targets (met/missed printed): a sender's keys per round O(1) (the same at every N), the first rank's
O(its list), our barrier within 2x torch's at every N, a growth exponent of the store's own work (the
keys it serves per call, and its server thread's CPU per call) vs N (least squares over N >= 256) of
at most 1.2; the time's exponent is printed beside it, not judged (threads of one process on few cores grow faster than the store's work:
torch's own barrier included).

    python scripts/bench_sync_scale.py                     # N = 64, 256, 1024, 4096
    python scripts/bench_sync_scale.py --ranks 64 256 --repeats 5
    python scripts/bench_sync_scale.py --real 2 4 8 16     # real processes instead (medians on rank 0)
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one "hostname" warning per connection otherwise

import argparse
import dataclasses
import datetime
import json
import math
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distribute_utils import gather, liveness, sync
from distribute_utils.incarnation import PeerDirectory, this_process

TP = 8  # ranks per pid namespace, and the tensor-parallel size of the tp x pp pattern
KINDS = ("torch_barrier", "torch_lean", "our_barrier", "tiny_gather", "tp_pp")
TARGET_RATIO = 2.0
TARGET_EXPONENT = 1.2


class Counts:
    """Store work through one client: keys read and written, bytes sent and received. (Plain classes
    here, no dataclasses: the tests load this script as a module that is not in ``sys.modules``.)"""

    __slots__ = ("read", "received", "sent", "written")

    def __init__(self, read: int = 0, written: int = 0, sent: int = 0, received: int = 0) -> None:
        self.read, self.written, self.sent, self.received = read, written, sent, received

    def copy(self) -> Counts:
        return Counts(self.read, self.written, self.sent, self.received)

    @property
    def keys(self) -> int:
        return self.read + self.written

    @property
    def bytes(self) -> int:
        return self.sent + self.received

    def minus(self, other: Counts) -> Counts:
        return Counts(
            self.read - other.read,
            self.written - other.written,
            self.sent - other.sent,
            self.received - other.received,
        )


def _size(value: Any) -> int:
    return len(value.encode() if isinstance(value, str) else value)


class CountingStore:
    """A store client that counts the keys and bytes of every operation made through it (a real store
    inside). ``clone()`` gives ``background``: the one client the library's threads share here."""

    def __init__(self, inner: dist.Store, background: CountingStore | None = None) -> None:
        self.inner = inner
        self.counts = Counts()
        self.background = background
        self.lock = threading.Lock()  # (the background proxy is shared between threads)

    def _count(self, read: int = 0, written: int = 0, sent: int = 0, received: int = 0) -> None:
        with self.lock:
            c = self.counts
            c.read, c.written, c.sent, c.received = (
                c.read + read,
                c.written + written,
                c.sent + sent,
                c.received + received,
            )

    def clone(self) -> CountingStore:
        return self.background if self.background is not None else self

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def set(self, key: str, value: bytes) -> None:
        self._count(written=1, sent=_size(key) + _size(value))
        self.inner.set(key, value)  # type: ignore[arg-type]  # torch's stub: set takes bytes too

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count(read=1, sent=_size(key), received=len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._count(written=1, sent=_size(key) + 8, received=8)
        return self.inner.add(key, amount)

    def append(self, key: str, value: bytes) -> None:
        self._count(written=1, sent=_size(key) + _size(value))
        self.inner.append(key, value)  # type: ignore[attr-defined]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        value = self.inner.compare_set(key, expected, desired)  # type: ignore[arg-type]
        self._count(written=1, sent=_size(key) + _size(expected) + _size(desired), received=len(value))
        return value

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._count(written=len(keys), sent=sum(map(_size, keys)) + sum(map(_size, values)))
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)  # type: ignore[attr-defined]
        self._count(read=len(keys), sent=sum(map(_size, keys)), received=sum(map(len, values)))
        return values

    def check(self, keys: list[str]) -> bool:
        self._count(read=len(keys), sent=sum(map(_size, keys)), received=1)
        return self.inner.check(keys)

    def wait(self, keys: list[str], *timeout: datetime.timedelta) -> None:
        self._count(read=len(keys), sent=sum(map(_size, keys)))
        self.inner.wait(keys, *timeout)

    def delete_key(self, key: str) -> bool:
        self._count(written=1, sent=_size(key), received=1)
        return self.inner.delete_key(key)


class World:
    """N simulated ranks: their counting clients, companions of the world and of the TP group."""

    def __init__(
        self,
        n: int,
        stores: list[CountingStore],
        world: list[sync.GroupSync],
        tp: dict[int, sync.GroupSync],
        background: CountingStore,
    ) -> None:
        self.n, self.stores, self.world, self.tp, self.background = n, stores, world, tp, background
        self.torch_rounds = 0
        self.server_ns = 0  # the store server's CPU in the last call (ns; 0 with no server thread here)
        self.deleting_s = 0.0  # the janitor's deleting after the last call, inside its clock


def connect(port: int, count: int, workers: int = 128) -> list[dist.TCPStore]:
    """``count`` new clients of the store at ``port``, made in parallel (a connection stalls 5 s now and
    then on this machine: the server's reverse lookup, see docs/performance.md)."""
    if count == 0:
        return []

    def one(_: int) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, 1, is_master=False, use_libuv=True)

    with ThreadPoolExecutor(min(workers, count)) as pool:
        return list(pool.map(one, range(count)))


def make_world(master: dist.Store, n: int) -> World:
    """``n`` simulated ranks, each with a peer directory and companions: on ``master``'s server, each
    through a client of its own, when it is a ``TCPStore``; else all on ``master`` (a ``HashStore``: the
    same keys, no connections to make, for counting)."""
    real = connect(master.port, n + 1) if isinstance(master, dist.TCPStore) else [master] * (n + 1)
    background = CountingStore(real[n])
    stores = [CountingStore(real[r], background) for r in range(n)]
    me = this_process()
    prefix = f"bench/{n}/{time.monotonic_ns()}"
    ranks = tuple(range(n))
    world, tp = [], {}
    for r in range(n):
        info = dataclasses.replace(me, pid_namespace=10**9 + r // TP, net_namespace=-1)
        store = cast(dist.Store, stores[r])  # (a proxy with the Store methods the library calls)
        directory = PeerDirectory(store, prefix, r, info)
        world.append(sync.GroupSync(ranks, r, store, f"{prefix}/world", directory))
        if r < min(TP, n):
            tp[r] = sync.GroupSync(tuple(range(min(TP, n))), r, store, f"{prefix}/tp", directory)
    return World(n, stores, world, tp, background)


def thread_ids() -> set[int]:
    """This process's threads (their ids as ``/proc/self/task`` names them)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_cpu_ns(tids: set[int]) -> int:
    """CPU time so far of the threads ``tids`` of this process, in ns (``schedstat``: not the 10 ms ticks
    of ``stat``)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


SERVER_THREADS: set[int] = set()
"""The threads of the store's server (those a master ``TCPStore`` started here; see :func:`run_scale`)."""


def run_threads(n: int, body: Callable[[int], None]) -> float:
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


def torch_barrier(store: CountingStore, n: int, tag: str, timeout: float) -> None:
    """torch's own store barrier, its real sequence of store calls: ``_store_based_barrier`` of
    ``torch.distributed.distributed_c10d`` (what ``init_process_group`` and ``new_group`` run with
    ``TORCH_DIST_INIT_BARRIER=1``): ``add`` 1 to a counter, ``add`` 0 to read it, the last rank sets a key,
    every rank ``wait``s on it. Its calls only: none of its Python around them (logging, clocks), which the
    simulation would run under one interpreter lock for every rank."""
    count = f"{tag}/count"
    store.add(count, 1)
    if store.add(count, 0) == n:
        store.set(f"{tag}/go", b"1")
    store.wait([f"{tag}/go"], datetime.timedelta(seconds=timeout))


def torch_lean(store: CountingStore, n: int, tag: str, timeout: float) -> None:
    """A leaner barrier of torch's store calls, ``torch.distributed.elastic.utils.store.barrier``'s (``add``,
    the last rank sets a key, the others ``wait``): this script's reference before it ran
    ``_store_based_barrier``'s calls (printed, not judged)."""
    if store.add(f"{tag}/count", 1) == n:
        store.set(f"{tag}/go", b"1")
    else:
        store.wait([f"{tag}/go"], datetime.timedelta(seconds=timeout))


def tiny_gather(w: World, rank: int, timeout: float) -> None:
    got = gather.gather_on(w.world[rank], {"a": 1}, list(range(w.n)), world_size=w.n, timeout=timeout)
    assert (rank == 0) == bool(got) and all(c == {"a": 1} for c in got)


def tp_pp(w: World, rank: int, timeout: float) -> None:
    """ModelOpt's pattern: the pipeline merge over the world, then the TP merge on the first stage."""
    tp = min(TP, w.n)
    layer = {"rank": rank, "w": torch.full((16,), float(rank))}
    pipeline = list(range(rank % tp, w.n, tp))
    merged = gather.gather_on(w.world[rank], layer, pipeline, world_size=w.n, timeout=timeout)
    assert [c["rank"] for c in merged] == (pipeline if rank == pipeline[0] else [])
    if rank < tp:
        shards = gather.gather_on(w.tp[rank], layer["w"], list(range(tp)), world_size=w.n, timeout=timeout)
        assert len(shards) == (tp if rank == 0 else 0)


def run_kind(w: World, kind: str, timeout: float) -> tuple[float, list[Counts]]:
    """One call of ``kind`` on every simulated rank: seconds, and each rank's store work in it."""
    if kind in ("torch_barrier", "torch_lean"):
        w.torch_rounds += 1
        tag = f"torch/{w.n}/{time.monotonic_ns()}/{w.torch_rounds}"
        reference = torch_barrier if kind == "torch_barrier" else torch_lean
        body: Callable[[int], None] = lambda r: reference(w.stores[r], w.n, tag, timeout)  # noqa: E731
    elif kind == "our_barrier":
        body = lambda r: w.world[r].barrier(timeout)  # noqa: E731
    elif kind == "tiny_gather":
        body = lambda r: tiny_gather(w, r, timeout)  # noqa: E731
    else:
        body = lambda r: tp_pp(w, r, timeout)  # noqa: E731
    # One thread of this process deletes every simulated rank's keys of earlier calls (in a job, each
    # rank's own janitor deletes its few): what is due before the call is not this call's; what the call
    # makes due (a barrier: the keys of every call before it) is deleted inside its clock.
    liveness.JANITOR.drain(timeout)
    before = [s.counts.copy() for s in w.stores]
    server = thread_cpu_ns(SERVER_THREADS)
    seconds = run_threads(w.n, body)
    start = time.perf_counter()
    liveness.JANITOR.drain(timeout)
    deleting = time.perf_counter() - start
    w.server_ns = thread_cpu_ns(SERVER_THREADS) - server
    w.deleting_s = deleting
    return seconds + deleting, [s.counts.minus(b) for s, b in zip(w.stores, before)]


def summary(counts: list[Counts]) -> dict[str, int]:
    """The first rank's keys and bytes, the busiest other rank's (by keys), and every rank's keys together
    (the store's work)."""
    busiest = max(counts[1:], key=lambda c: (c.keys, c.bytes)) if len(counts) > 1 else Counts()
    return {
        "all_keys": sum(c.keys for c in counts),
        "first_keys": counts[0].keys,
        "first_bytes": counts[0].bytes,
        "other_keys": busiest.keys,
        "other_bytes": busiest.bytes,
    }


def run_scale(
    ns: list[int],
    repeats: int = 3,
    timeout: float = 300.0,
    kinds: tuple[str, ...] = KINDS,
    store: str = "tcp",
) -> dict[int, dict[str, Any]]:
    """Measure every N in ``ns``: per kind, the first call's and the steady state's seconds (median over
    ``repeats``) and store work (the first rank's and the busiest other rank's). ``store``: "tcp" (a real
    ``TCPStore``, a client per rank) or "hash" (an in-process ``HashStore``: keys counted alike, fast)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 3 * max(ns) + 256
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, needed), hard))
    threading.stack_size(512 * 1024)
    master: dist.Store
    if store == "tcp":
        before = thread_ids()
        master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, use_libuv=True)
        SERVER_THREADS.clear()
        SERVER_THREADS.update(thread_ids() - before)  # (the server's loop: started by the master here)
    else:
        master = dist.HashStore()
    report: dict[int, dict[str, Any]] = {}
    for n in ns:
        w = make_world(master, n)
        row: dict[str, Any] = {}
        for kind in kinds:
            seconds, counts = run_kind(w, kind, timeout)
            row[f"{kind}/first"] = {"seconds": seconds, "server_us": w.server_ns / 1e3, **summary(counts)}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        served: dict[str, list[float]] = {k: [] for k in kinds}
        deleting: dict[str, list[float]] = {k: [] for k in kinds}
        last: dict[str, list[Counts]] = {}
        for _ in range(repeats):  # interleaved, so that load changes hit every kind alike
            for kind in kinds:
                seconds, last[kind] = run_kind(w, kind, timeout)
                times[kind].append(seconds)
                served[kind].append(w.server_ns / 1e3)
                deleting[kind].append(w.deleting_s)
        for kind in kinds:
            row[f"{kind}/steady"] = {
                "seconds": statistics.median(times[kind]),
                "server_us": statistics.median(served[kind]),
                "deleting_s": statistics.median(deleting[kind]),
                **summary(last[kind]),
            }
        row["background_keys_per_rank"] = w.background.counts.keys / n
        report[n] = row
        print(f"N={n} done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    return report


def store_work(n: int, cell: dict[str, Any]) -> float:
    """Keys the store serves in one call of ``n`` ranks: every rank's together."""
    return float(cell["all_keys"])


def server_cpu(n: int, cell: dict[str, Any]) -> float:
    """The store server thread's CPU in one call of ``n`` ranks (µs)."""
    return float(cell.get("server_us", 0.0))


def growth(
    report: dict[int, dict[str, Any]],
    key: str,
    measure: Callable[[int, dict[str, Any]], float] = lambda n, cell: float(cell["seconds"]),
) -> float | None:
    """Least-squares slope of log(``measure``: seconds by default) against log(N) over N >= 256 (all N
    when fewer than two)."""
    ns = sorted(n for n in report if n >= 256)
    if len(ns) < 2:
        ns = sorted(report)
    if len(ns) < 2:
        return None
    xs = [math.log(n) for n in ns]
    ys = [math.log(max(measure(n, report[n][key]), 1e-12)) for n in ns]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def verdicts(report: dict[int, dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """Each target: its name, whether it is met, and the figures it was judged on."""
    ns = sorted(report)
    out = []
    for kind in ("tiny_gather", "tp_pp"):
        if f"{kind}/first" not in report[ns[0]]:
            continue
        for phase in ("first", "steady"):
            sender = [report[n][f"{kind}/{phase}"]["other_keys"] for n in ns]
            if kind == "tiny_gather":
                out.append((f"{kind} {phase}: a sender's keys O(1)", max(sender) <= min(sender), str(sender)))
            first = [report[n][f"{kind}/{phase}"]["first_keys"] / n for n in ns]
            out.append(
                (
                    f"{kind} {phase}: the first rank's keys O(list) (keys/N)",
                    first[-1] <= 1.1 * first[0],
                    ", ".join(f"{f:.2f}" for f in first),
                )
            )
    if "our_barrier/steady" in report[ns[0]]:
        ratios = [
            report[n]["our_barrier/steady"]["seconds"] / report[n]["torch_barrier/steady"]["seconds"]
            for n in ns
        ]
        out.append(
            (
                f"our barrier within {TARGET_RATIO:g}x torch's at every N",
                max(ratios) <= TARGET_RATIO,
                ", ".join(f"{r:.2f}" for r in ratios),
            )
        )
    # The target is on the store's own work: the keys it serves per call. The time's exponent is shown too:
    # threads of one process on few cores grow faster than that (torch's own barrier included).
    for kind in ("torch_barrier", "our_barrier", "tiny_gather", "tp_pp"):
        if f"{kind}/steady" not in report[ns[0]]:
            continue
        slope = growth(report, f"{kind}/steady", store_work)
        timed = growth(report, f"{kind}/steady")
        if slope is not None and timed is not None:
            out.append(
                (
                    f"{kind} growth exponent of the store's work (keys served) <= {TARGET_EXPONENT:g}",
                    slope <= TARGET_EXPONENT,
                    f"{slope:.2f} (of the time, not judged: {timed:.2f})",
                )
            )
        cpu = growth(report, f"{kind}/steady", server_cpu)
        if cpu is not None and all(report[n][f"{kind}/steady"].get("server_us") for n in ns):
            per = ", ".join(f"{report[n][kind + '/steady']['server_us']:.0f}" for n in ns)
            out.append(
                (
                    f"{kind} growth exponent of the store server's CPU <= {TARGET_EXPONENT:g}",
                    cpu <= TARGET_EXPONENT,
                    f"{cpu:.2f} ({per} µs at N = {', '.join(map(str, ns))})",
                )
            )
    return out


def print_report(report: dict[int, dict[str, Any]]) -> None:
    print(
        f"{'N':>5} {'kind':>13} {'phase':>6} {'ms':>9} {'rank 0 keys':>11} {'bytes':>9} {'other keys':>10} "
        f"{'bytes':>7} {'server us':>10}"
    )
    for n, row in report.items():
        for name, cell in row.items():
            if not isinstance(cell, dict):
                continue
            kind, phase = name.split("/")
            print(
                f"{n:>5} {kind:>13} {phase:>6} {cell['seconds'] * 1e3:>9.1f} {cell['first_keys']:>11} "
                f"{cell['first_bytes']:>9} {cell['other_keys']:>10} {cell['other_bytes']:>7} "
                f"{cell.get('server_us', 0.0):>10.0f}"
            )
        print(f"{n:>5} background (watchdog, janitor) keys per rank: {row['background_keys_per_rank']:.1f}")
    for name, ok, figures in verdicts(report):
        print(f"{'met   ' if ok else 'MISSED'} {name}: {figures}")
    ns = sorted(report)
    if all("torch_lean/steady" in report[n] and "our_barrier/steady" in report[n] for n in ns):
        ratios = [
            report[n]["our_barrier/steady"]["seconds"] / report[n]["torch_lean/steady"]["seconds"] for n in ns
        ]
        print(
            f"       our barrier over torch's leaner barrier (not judged): {', '.join(f'{r:.2f}' for r in ratios)}"
        )


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--store", choices=["tcp", "hash"], default="tcp", help="hash: in-process, counts only"
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--real", type=int, nargs="*", help="world sizes of real rank processes")
    args = parser.parse_args(argv)
    if args.real:
        print(
            "real processes of one host (gathers take the direct round: mailboxes, no store), medians on "
            f"rank 0 (ms), load {os.getloadavg()[0]:.1f}"
        )
        print(f"{'ranks':>6} {'our barrier':>12} {'tiny gather':>12} {'gloo barrier':>13}")
        for n, row in run_real(args.real).items():
            print(
                f"{n:>6} {row['ours_barrier'] * 1e3:>12.3f} {row['ours_tiny_gather'] * 1e3:>12.3f} "
                f"{row['gloo_barrier'] * 1e3:>13.3f}"
            )
        return 0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"commit {commit or '?'}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    from results.facts import load_average, run_facts

    started, load_before = time.time(), load_average()
    report = run_scale(args.ranks, args.repeats, kinds=tuple(args.kinds), store=args.store)
    print_report(report)
    if args.json:
        facts = run_facts(sys.argv, started, load_before)
        Path(args.json).write_text(json.dumps({"commit": commit, "report": report, "run": facts}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
