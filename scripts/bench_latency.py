"""Gather latency from 4 KiB to 256 MiB per rank: ours against the physical limit and the peers.

On ``--nproc`` local ranks (gloo), every repetition runs every method once, in turn
(interleaved, so that a change of load hits all methods alike; in an order shuffled at each
repetition, so no method always follows the same one and pays for what it left running, such as
ModelOpt's resource trackers unlinking its segments), barrier to barrier: a ``dist.barrier()``,
then the time on rank 0 until it holds every rank's tensor.

Methods, per size (one float32 tensor per rank to rank 0):

- ``ours``: :func:`distribute_utils.get_tensors_parallel` (default transport);
- ``limit``: the physical limit on this host: each sender copies its bytes into its own
  pre-touched, reused ``/dev/shm`` segment, through a shared map of it kept from the start (one
  plain copy), and posts one store key; rank 0 waits for the keys, maps each segment and views it
  (``torch.frombuffer``), no decoding, no checks;
- ``pwrite``: the same, written with ``pwrite`` (what the limit was until the library's senders
  copied into maps: up to twice as slow from 16 MiB, the kernel looks up every page);
- ``fresh``: the same with a new segment per repetition (create, ``posix_fallocate``, ``pwrite``,
  map, unlink), what a first gather of that size costs;
- ``gloo``: ``dist.gather`` into preallocated outputs;
- ``modelopt``: ModelOpt's ``get_tensors_parallel`` (when ``nvidia-modelopt`` is installed);
- up to 64 KiB (raw bytes that could travel inside the store; at 64 KiB ours does not: the
  payload, a little larger, goes through a pooled segment), ``bare`` and ``bare+wire``: our round's
  store protocol and nothing else (each sender posts its bytes in one key and waits for rank 0's
  verdict key; rank 0 posts its own key, reads the senders' in one ``multi_get``, views each
  payload, posts the verdict), with raw bytes, then with ``distribute_utils.wire`` encoding and
  decoding them. ``ours`` minus ``bare+wire`` is what the library adds around the protocol
  (checks, routing, the watchdog, key collection); ``bare+wire`` minus ``bare`` is the format;
- at the same sizes, ``direct``: the same round without the store, over Unix datagram sockets (each
  sender sends its bytes to rank 0's socket and waits for a one-byte verdict): what no store hop at
  all would cost, with no failure handling (a floor for any protocol, like ``limit``).

Then the tiny round trip (``{"a": 1}`` through ``get_configs_parallel``) and a decoder layer's
config of 64 small tensors (ours; ModelOpt's helper carries at most ~32 tensors in one config,
so both are also timed at 32).

    python scripts/bench_latency.py                 # full sweep, ~2 minutes on 2 cores
    python scripts/bench_latency.py --sizes 4K 64K --reps 20
    python scripts/bench_latency.py --json out.json

Prints one row per size with medians and the ratios ours/limit, gloo/ours, modelopt/ours (of the
medians), then ours/limit and gloo/ours paired: the median of each repetition's own ratio.

``--cpu`` measures instead what each method costs the machine, which wall times on a small shared
machine hide in noise: back-to-back rounds (no barrier between them), the CPU time per round of
each rank's process (all its threads) and of its main thread, and their sum over the ranks::

    python scripts/bench_latency.py --cpu --sizes 4K 64K

``--inline-threshold`` checks the size up to which a payload travels in its claim: on one host (this
benchmark's ranks) that is :data:`~distribute_utils.gather.ATTACHED_MAX_BYTES` (a direct round's claim
message), through the store :data:`~distribute_utils.gather.INLINE_MAX_BYTES`. Back-to-back rounds with
every payload inside the claim (where a message can hold it) against every payload through a pooled
segment (both thresholds and the pool's minimum overridden in the measuring processes only),
interleaved in blocks::

    python scripts/bench_latency.py --inline-threshold --sizes 32K 64K 1M

``--first`` times first gathers: each repetition's payload is 4 KiB larger than the last, so no pooled
segment holds it and every sender makes a new one (what the first gather of a size costs), against
``fresh``, interleaved, after one untimed call of each at the base size::

    python scripts/bench_latency.py --first --sizes 1M 16M 64M

``--store-ops`` times single requests of one client (rank 1) to the job's store (served by the
launching process, as torchrun's agent serves it), one at a time, nothing else running: what each
store hop of a round costs at the least. A read that waits (``get``, ``multi_get``) is two
requests, a ``wait`` for the key and then the read::

    python scripts/bench_latency.py --store-ops --nproc 2

``--steps`` splits one call's CPU on rank 0 and on a sender (thread time, median of back-to-back
rounds) into the store requests (``Call.post``, ``Call.wait_for``), the wire format (``encode``,
``decode``), the transports' ``publish`` and ``fetch``, and the rest: our own Python around them. On
rank 0, ``drop`` is what letting go of the last round's tensors costs (unmapping, finalizers). The
steps are timed by wrapping those methods for this run (about 1 µs each)::

    python scripts/bench_latency.py --steps --sizes 4K 1M --rounds 2000

With ``--cold`` every rank first evicts its caches before each call (writes a byte of every cache
line of 16 MiB and makes and drops a few thousand Python objects, then a barrier), as the other work
between two calls of a real job, or the other methods of the sweep, do: each step then costs what it
costs in the sweep, several times its back-to-back cost::

    python scripts/bench_latency.py --steps --cold --sizes 4K 1M --rounds 500

``--timeline`` follows cold calls of ours (caches evicted before each, as ``--cold``) on the clock all
processes share: when each rank leaves the barrier, when each sender's claim goes (and its thread CPU
until then), when rank 0 takes the last claim and when it returns. Per call it prints how far apart
the ranks left the barrier (which the sweep's time on rank 0 includes), the time from the last rank's
start to rank 0's return, and that span's parts: the last sender until its claim goes, the claim on
its way until rank 0 has it, rank 0 from then to its return (direct rounds only: every rank on this
host)::

    python scripts/bench_latency.py --timeline --sizes 4K 1M --rounds 300

``--busy N`` runs N spinning processes beside the ranks for the whole run: a machine shared with
other jobs (the load average then reaches about N plus the ranks' own share)::

    python scripts/bench_latency.py --busy 6 --sizes 4K --reps 40

``--against REV`` compares ours (this checkout) with the package as it was at git revision ``REV``,
both loaded in the same rank processes (the old one renamed ``du_against``, its own state and
threads) and called in turn within every repetition, the order alternating, barrier to barrier after
a ``dist.gather`` as in the sweep. It prints rank 0's wall time and the call's thread CPU summed over
the ranks. This machine's speed drifts by 10-20% between runs, which hides a change of a few percent
when two runs are compared; within one run both versions see the same machine::

    python scripts/bench_latency.py --against HEAD~3 --sizes 4K 64K 1M
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import io
import itertools
import json
import mmap
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distribute_utils import get_configs_parallel, get_tensors_parallel, wire
from distribute_utils.gather import INLINE_MAX_BYTES
from distribute_utils.launch import run_local

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}
CHOICES = {
    **SIZES,
    "16K": 16 << 10,
    "32K": 32 << 10,
    "128K": 128 << 10,
    "256K": 256 << 10,
}  # the default sweep, and more
LAYER_SHAPES = [(4096,), (128, 128), (), (128,)]
LAYER_DTYPES = [torch.float32, torch.float16, torch.float32, torch.bfloat16]


def _reps_for(nbytes: int, reps: int | None) -> int:
    """``reps``, or by size: enough that a median of rounds that spread over two modes holds still."""
    if reps is not None:
        return reps
    return 200 if nbytes <= 1 << 20 else 40 if nbytes <= 16 << 20 else 15 if nbytes <= 64 << 20 else 7


def _modelopt() -> Any | None:
    try:
        import modelopt.torch.export.distribute as mo_dist
        import modelopt.torch.export.model_config as mo_config
    except Exception:
        return None
    return mo_dist, mo_config


def _limit_prefix() -> str:
    """Where this run's limit segments go: named by the launching process (``$DU_BENCH_RUN``, which its
    ranks inherit), which removes them at the end (see :func:`_limits_removed_at_end`)."""
    return f"/dev/shm/du-bench-limit-{os.environ.get('DU_BENCH_RUN', 'solo')}-"


class _Limit:
    """The physical limit: a sender writes its bytes into /dev/shm, rank 0 maps and views them.

    ``how``: ``copy`` (into the sender's own shared map of its reused, pre-touched segment: one plain
    copy, the least any transport through memory can do), ``pwrite`` (into the same kind of segment
    with ``pwrite``, which looks up every page in the kernel) or ``fresh`` (a new segment per
    repetition: create, ``posix_fallocate``, ``pwrite``, map, unlink)."""

    def __init__(self, nbytes: int, how: str) -> None:
        self.nbytes, self.how = nbytes, how
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store().clone()
        self.rep = 0
        self.fd = -1
        self.mapped: mmap.mmap | None = None
        self.path = f"{_limit_prefix()}{how}-{os.getpid()}"
        if how != "fresh" and self.rank != 0:
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            os.posix_fallocate(self.fd, 0, nbytes)
            os.pwrite(self.fd, bytes(nbytes), 0)  # pre-touched
            if how == "copy":
                self.mapped = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        pids = [int(p) for p in _all_gather_str(str(os.getpid()))]
        self.paths = [f"{_limit_prefix()}{how}-{p}" for p in pids]

    def run(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.rep += 1
        tag = f"bench/limit/{self.how}/{self.nbytes}/{self.rep}"
        data = memoryview(tensor.numpy()).cast("B")
        if self.rank != 0:
            if self.mapped is not None:
                self.mapped[: self.nbytes] = data
            elif self.how == "pwrite":
                os.pwrite(self.fd, data, 0)
            else:
                path = f"{self.path}-{self.rep}"
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.posix_fallocate(fd, 0, self.nbytes)
                os.pwrite(fd, data, 0)
                os.close(fd)
            self.store.set(f"{tag}/{self.rank}", b"1")
            return []
        self.store.multi_get([f"{tag}/{r}" for r in range(1, self.world)])
        out = [tensor]
        for r in range(1, self.world):
            path = self.paths[r] if self.how != "fresh" else f"{self.paths[r]}-{self.rep}"
            fd = os.open(path, os.O_RDONLY)
            buf = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            if self.how == "fresh":
                os.unlink(path)
            out.append(torch.frombuffer(buf, dtype=torch.float32))
        return out

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
        if self.fd >= 0:
            os.close(self.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class _Bare:
    """Our round's store protocol alone (see the module doc), with or without the wire format."""

    def __init__(self, nbytes: int, use_wire: bool) -> None:
        self.nbytes, self.use_wire = nbytes, use_wire
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store().clone()
        self.rep = 0

    def run(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.rep += 1
        tag = f"bench/bare/{self.use_wire}/{self.nbytes}/{self.rep}"
        if self.rank != 0:
            data = (
                wire.encode(tensor, root="tensor").to_bytes() if self.use_wire else tensor.numpy().tobytes()
            )
            self.store.multi_set([f"{tag}/c/{self.rank}"], [data])
            self.store.multi_get([f"{tag}/v"])
            return []
        self.store.multi_set([f"{tag}/c/0"], [b"1"])
        values = self.store.multi_get([f"{tag}/c/{r}" for r in range(1, self.world)])
        if self.use_wire:
            got = [wire.decode(bytearray(v)) for v in values]
        else:
            got = [torch.frombuffer(bytearray(v), dtype=tensor.dtype) for v in values]
        self.store.set(f"{tag}/v", b"1")
        return [tensor, *got]


class _Direct:
    """The same round without the store: each rank's Unix datagram socket (abstract name), a sender sends
    its bytes to rank 0's and waits for a one-byte verdict; rank 0 receives one datagram per sender,
    views each, and sends the verdicts. No failure handling at all: what a direct channel would buy."""

    def __init__(self, nbytes: int) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * nbytes + (1 << 16))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * nbytes + (1 << 16))
        self.sock.bind(f"\0du-bench-direct-{os.getpid()}-{nbytes}")
        self.peers = [f"\0du-bench-direct-{p}-{nbytes}" for p in _all_gather_str(str(os.getpid()))]
        self.nbytes = nbytes

    def run(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.rank != 0:
            self.sock.sendto(memoryview(tensor.numpy()).cast("B"), self.peers[0])
            self.sock.recv(1)
            return []
        got = [tensor]
        for _ in range(1, self.world):
            buf = bytearray(self.nbytes)
            self.sock.recv_into(buf)
            got.append(torch.frombuffer(buf, dtype=tensor.dtype))
        for peer in self.peers[1:]:
            self.sock.sendto(b"1", peer)
        return got


def _all_gather_str(value: str) -> list[str]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _deciles(values: list[float]) -> tuple[float, float, float]:
    """The 10th, 50th and 90th percentile of ``values``."""
    cuts = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return cuts[0], statistics.median(values), cuts[-1]


def _timed(fn: Callable[[], Any]) -> float:
    """Barrier, then the time rank 0 spends in ``fn`` (it returns once rank 0 holds the data)."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    if dist.get_rank() == 0 and isinstance(result, list) and result:
        _ = [float(t.reshape(-1)[-1]) for t in result if isinstance(t, torch.Tensor) and t.numel()]
    return elapsed


def _bare_methods(nbytes: int, tensor: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """``bare`` and ``bare+wire`` (see the module doc), for sizes whose bytes could travel in the store."""
    if nbytes > INLINE_MAX_BYTES:
        return {}
    plain, with_wire, direct = _Bare(nbytes, use_wire=False), _Bare(nbytes, use_wire=True), _Direct(nbytes)
    return {
        "bare": lambda: plain.run(tensor),
        "bare+wire": lambda: with_wire.run(tensor),
        "direct": lambda: direct.run(tensor),
    }


def _gather_once(tensor: torch.Tensor, ranks: list[int]) -> None:
    """One call of ours whose results are let go at once (back-to-back rounds)."""
    with get_tensors_parallel(tensor, ranks):
        pass


def _back_to_back(fn: Callable[[], Any], rounds: int, launcher: int = 0) -> tuple[float, float, float, float]:
    """20 warm-up calls, a barrier, then ``rounds`` calls of ``fn`` in a row: seconds per call of wall
    time, of this process's CPU (all its threads), of this thread's CPU and of process ``launcher``'s
    CPU (the one that serves the store; the same figure on every rank; 0 when not given)."""
    for _ in range(20):
        fn()
    dist.barrier()
    wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    server = _process_cpu(launcher)
    for _ in range(rounds):
        fn()
    return (
        (time.perf_counter() - wall) / rounds,
        (time.process_time() - cpu) / rounds,
        (time.thread_time() - main) / rounds,
        (_process_cpu(launcher) - server) / rounds,
    )


def _process_cpu(pid: int) -> float:
    """Seconds of CPU process ``pid`` has used, all its threads, from ``/proc/<pid>/task/*/schedstat``
    (nanoseconds, unlike ``stat``'s ticks); 0 for pid 0."""
    total = 0
    for task in glob.glob(f"/proc/{pid}/task/*/schedstat") if pid else ():
        with contextlib.suppress(OSError), open(task) as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _each_size(sizes: list[str]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """Per size: its name, its bytes, and this rank's float32 tensor of that size (its rank in every element)."""
    rank = dist.get_rank()
    for name in sizes:
        nbytes = CHOICES[name]
        yield name, nbytes, torch.full((nbytes // 4,), float(rank))


def _sweep_rank(sizes: list[str], reps: int | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    mo = _modelopt()
    report: dict[str, Any] = {}
    for name, nbytes, tensor in _each_size(sizes):
        outputs = [torch.empty_like(tensor) for _ in ranks] if rank == 0 else None
        limits = {how: _Limit(nbytes, how) for how in ("copy", "pwrite", "fresh")}

        def ours(tensor: torch.Tensor = tensor) -> list[torch.Tensor]:
            with get_tensors_parallel(tensor, ranks) as got:
                return got

        def gloo(tensor: torch.Tensor = tensor, outputs: Any = outputs) -> Any:
            dist.gather(tensor, outputs, dst=0)
            return outputs

        methods: dict[str, Callable[[], Any]] = {
            "ours": ours,
            "limit": lambda limit=limits["copy"], tensor=tensor: limit.run(tensor),
            "pwrite": lambda limit=limits["pwrite"], tensor=tensor: limit.run(tensor),
            "fresh": lambda limit=limits["fresh"], tensor=tensor: limit.run(tensor),
            "gloo": gloo,
        }
        if mo is not None:

            def modelopt(tensor: torch.Tensor = tensor) -> list[torch.Tensor]:
                with mo[0].get_tensors_parallel(tensor, ranks) as got:
                    return list(got)

            methods["modelopt"] = modelopt
        methods.update(_bare_methods(nbytes, tensor))
        times: dict[str, list[float]] = {m: [] for m in methods}
        for fn in methods.values():  # warm-up: pools, connections, page cache
            _timed(fn)
        names = list(methods)
        for rep in range(_reps_for(nbytes, reps)):
            # Shuffled (the same order on every rank): no method always follows the same one and pays
            # for what it left running (ModelOpt's resource trackers unlinking, our janitor, ...).
            for method in random.Random(rep).sample(names, len(names)):
                times[method].append(_timed(methods[method]))
        dist.barrier()  # a sender's limit returns before rank 0 has opened its segment
        for limit in limits.values():
            limit.close()
        report[name] = {m: statistics.median(v) for m, v in times.items()}
        report[name]["load"] = os.getloadavg()[0]
        # Each repetition runs every method once, in turn: its ratios are a paired comparison.
        report[name]["paired ours/limit"] = statistics.median(
            o / x for o, x in zip(times["ours"], times["limit"])
        )
        report[name]["paired gloo/ours"] = statistics.median(
            g / o for g, o in zip(times["gloo"], times["ours"])
        )
        # Deciles: a median can sit in either of two modes (e.g. whether a third sender found a core).
        report[name]["spread"] = {m: _deciles(times[m]) for m in ("ours", "limit")}
    report["small"] = _small_rank(reps)
    report["layer"] = _layer_rank(mo, reps)
    return report if rank == 0 else {}


def _first_rank(sizes: list[str], reps: int | None) -> dict[str, Any]:
    """First gathers: each repetition's payload is 4 KiB larger than the last, so no pooled segment
    holds it and every sender makes a new one; against ``fresh`` (a new segment every time)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    report: dict[str, Any] = {}
    for name, nbytes, base in _each_size(sizes):
        fresh = _Limit(nbytes, "fresh")
        # Warm-up at the base size: a first call's set-up (connections, mailboxes) is no segment's cost.
        for warm in (functools.partial(_gather_once, base, ranks), functools.partial(fresh.run, base)):
            _timed(warm)
        times: dict[str, list[float]] = {"ours": [], "fresh": []}
        for rep in range(min(_reps_for(nbytes, reps), 40)):
            grown = torch.full((nbytes // 4 + 1024 * (rep + 1),), float(rank))

            def ours(tensor: torch.Tensor = grown) -> list[torch.Tensor]:
                with get_tensors_parallel(tensor, ranks) as got:
                    return got

            methods = [("ours", ours), ("fresh", functools.partial(fresh.run, base))]
            for method, fn in methods if rep % 2 else methods[::-1]:
                times[method].append(_timed(fn))
        dist.barrier()
        fresh.close()
        report[name] = {m: statistics.median(v) for m, v in times.items()}
    return report if rank == 0 else {}


def _cpu_rank(sizes: list[str], rounds: int, launcher: int) -> dict[str, Any]:
    """CPU time per round of each method, back to back: (process, main thread) in seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    report: dict[str, Any] = {}
    for name, nbytes, tensor in _each_size(sizes):
        outputs = [torch.empty_like(tensor) for _ in ranks] if rank == 0 else None
        limit = _Limit(nbytes, "copy")
        methods: dict[str, Callable[[], Any]] = {
            "ours": lambda tensor=tensor: _gather_once(tensor, ranks),
            "limit": lambda limit=limit, tensor=tensor: limit.run(tensor),
            "gloo": lambda tensor=tensor, outputs=outputs: dist.gather(tensor, outputs, dst=0),
            **_bare_methods(nbytes, tensor),
        }
        row = {}
        for method, fn in methods.items():
            row[method] = _back_to_back(fn, rounds, launcher)[1:]
            dist.barrier()  # (the launcher's CPU then includes the ranks' barrier: a few requests)
        limit.close()
        report[name] = row
    return report


def _store_ops_rank(reps: int) -> dict[str, float]:
    """Median seconds of single store requests from rank 1 (rank 0 only waits at the barrier)."""
    store = dist.distributed_c10d._get_default_store().clone()
    report: dict[str, float] = {}
    if dist.get_rank() == 1:
        store.set("bench/store-ops/k", b"x" * 64)
        ops: dict[str, Callable[[], Any]] = {
            "set (no reply)": lambda: store.set("bench/store-ops/s", b"y" * 64),
            "check": lambda: store.check(["bench/store-ops/k"]),
            "add": lambda: store.add("bench/store-ops/n", 1),
            "wait (key there)": lambda: store.wait(["bench/store-ops/k"]),
            "get (key there)": lambda: store.get("bench/store-ops/k"),
            "multi_get (key there)": lambda: store.multi_get(["bench/store-ops/k"]),
        }
        times: dict[str, list[float]] = {op: [] for op in ops}
        for _ in range(reps):
            for op, fn in ops.items():
                t0 = time.perf_counter()
                fn()
                times[op].append(time.perf_counter() - t0)
        report = {op: statistics.median(v) for op, v in times.items()}
    dist.barrier()
    return report


_STEPS = {
    "post": "store",
    "wait_for": "store",
    "encode": "wire",
    "decode": "wire",
    "publish": "publish",
    "fetch": "fetch",
}


@contextlib.contextmanager
def _steps_timed(events: list[tuple[str, int]]) -> Iterator[None]:
    """Wrap the methods of :data:`_STEPS` so that each call records its start and end (thread time)."""
    from distribute_utils import gather, sync

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            events.append((name, time.thread_time_ns()))
            try:
                return fn(*args, **kwargs)
            finally:
                events.append(("", time.thread_time_ns()))

        return wrapper

    owners = {"post": sync.Call, "wait_for": sync.Call}
    originals = {name: owners.get(name, gather._Gather).__dict__[name] for name in _STEPS}
    try:
        for name, original in originals.items():
            if isinstance(original, staticmethod):
                setattr(gather._Gather, name, staticmethod(timed(name, original.__func__)))
            else:
                setattr(owners.get(name, gather._Gather), name, timed(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(owners.get(name, gather._Gather), name, original)


def _evict(lines: bytearray) -> None:
    """What other work between two calls does to this rank's caches (``--cold``): one byte of every
    cache line of ``lines`` written, a few thousand Python objects made and dropped."""
    lines[::64] = bytes(len(lines) // 64)
    _ = {i: str(i) for i in range(3000)}


def _steps_rank(sizes: list[str], rounds: int, cold: bool = False) -> dict[str, Any]:
    """Median thread CPU (s) per call of each kind of step, on this rank, for each size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    events: list[tuple[str, int]] = []
    report: dict[str, Any] = {}
    lines = bytearray(16 << 20) if cold else bytearray()
    with _steps_timed(events):
        for name, _, tensor in _each_size(sizes):
            per_round: dict[str, list[float]] = {}
            for i in range(rounds + 50):
                if cold:
                    _evict(lines)
                    dist.barrier()
                events.clear()
                start = time.thread_time_ns()
                with get_tensors_parallel(tensor, ranks) as got:
                    pass
                end = time.thread_time_ns()
                del got
                dropped = time.thread_time_ns()
                if i < 50:
                    continue
                spent = dict.fromkeys(["python", *dict.fromkeys(_STEPS.values()), "drop"], 0)
                marks = [("", start), *events, ("", end)]
                for (step, t0), (_, t1) in itertools.pairwise(marks):
                    spent[_STEPS[step] if step else "python"] += t1 - t0
                spent["drop"] = dropped - end
                spent["call"] = end - start
                for step, ns in spent.items():
                    per_round.setdefault(step, []).append(ns / 1e9)
            report[name] = {step: statistics.median(v) for step, v in per_round.items()}
    return report if rank in (0, 1) else {}


@contextlib.contextmanager
def _claims_marked(marks: dict[str, int]) -> Iterator[None]:
    """Mark when this rank's claim goes (``sent``, and its thread CPU then) and when a claim was
    taken from the mailbox (``taken``: the last one's, on the first rank), by wrapping the two calls."""
    from distribute_utils import gather, sync

    send, take = sync.Call.send_direct, sync.Call._take

    def send_direct(self: Any, rank: int, kind: int, parts: Any, timeout: float = 0.0) -> bool:
        if kind == gather._CLAIM:  # (before: the woken first rank may take this sender's CPU in the call)
            marks["sent"], marks["sent cpu"] = time.perf_counter_ns(), time.thread_time_ns()
        return send(self, rank, kind, parts, timeout)

    def taken(messages: list[Any], kind: int, *rest: Any) -> None:
        if kind == gather._CLAIM and any(k == kind for _, k, _ in messages):
            marks["taken"] = time.perf_counter_ns()
        take(messages, kind, *rest)

    sync.Call.send_direct, sync.Call._take = send_direct, staticmethod(taken)  # type: ignore[method-assign]
    try:
        yield
    finally:
        sync.Call.send_direct, sync.Call._take = send, staticmethod(take)  # type: ignore[method-assign]


def _timeline_rank(sizes: list[str], rounds: int) -> dict[str, list[dict[str, int]]]:
    """Per call, caches evicted first (as ``--steps --cold``): this rank's marks in ns, on the clock every
    process shares (``perf_counter``: CLOCK_MONOTONIC) and on its thread's CPU clock."""
    ranks = list(range(dist.get_world_size()))
    lines = bytearray(16 << 20)
    report: dict[str, list[dict[str, int]]] = {}
    marks: dict[str, int] = {}
    with _claims_marked(marks):
        for name, _, tensor in _each_size(sizes):
            calls = report[name] = []
            for i in range(rounds + 20):
                _evict(lines)
                dist.barrier()
                marks.clear()
                marks["start"], marks["start cpu"] = time.perf_counter_ns(), time.thread_time_ns()
                with get_tensors_parallel(tensor, ranks):
                    marks["end"], marks["end cpu"] = time.perf_counter_ns(), time.thread_time_ns()
                if i >= 20:
                    calls.append(dict(marks))
    return report


_TIMELINE = {
    "spread": "the ranks leave the barrier (first to last)",
    "after": "from the last rank's start to rank 0's return",
    "sender": "the last sender to start: from its start until its claim goes",
    "on way": "from the last claim going to rank 0 taking it",
    "rank 0": "from rank 0 taking the last claim to its return",
    "cpu s": "a sender's thread CPU from its start until its claim goes",
    "cpu 0": "rank 0's thread CPU in the call",
}


def _timeline_rows(calls: list[list[dict[str, int]]]) -> dict[str, list[float]]:
    """The spans of :data:`_TIMELINE` of each call (``calls[rank][call]``: that rank's marks), in µs."""
    rows: dict[str, list[float]] = {k: [] for k in _TIMELINE}
    for marks in zip(*calls):
        first, senders = marks[0], marks[1:]
        last = max(senders, key=lambda m: m["start"])
        last_sent = max(m["sent"] for m in senders)
        spans = {
            "spread": max(m["start"] for m in marks) - min(m["start"] for m in marks),
            "after": first["end"] - max(m["start"] for m in marks),
            "sender": last["sent"] - last["start"],
            "on way": first["taken"] - last_sent,
            "rank 0": first["end"] - first["taken"],
            "cpu 0": first["end cpu"] - first["start cpu"],
        }
        for name, ns in spans.items():
            rows[name].append(ns / 1e3)
        rows["cpu s"] += [(m["sent cpu"] - m["start cpu"]) / 1e3 for m in senders]
    return rows


def _print_timeline(reports: list[dict[str, Any]], sizes: list[str]) -> None:
    print(
        f"where a cold call's wall time goes, {len(reports)} ranks, per call: median (10th-90th percentile), us"
    )
    for name in sizes:
        rows = _timeline_rows([r[name] for r in reports])
        print(f"{name}:")
        for key, values in rows.items():
            low, mid, high = _deciles(values)
            print(f"  {key:>7} {mid:7.1f} ({low:6.1f}-{high:7.1f})  {_TIMELINE[key]}")


def _inline_rank(sizes: list[str], rounds: int, blocks: int = 3) -> dict[str, Any]:
    """Wall seconds per back-to-back round (rank 0), per size and way: ``{size: {way: [block, ...]}}``."""
    from distribute_utils import gather, mailbox
    from distribute_utils.transports import host, shm

    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    kept = gather.ATTACHED_MAX_BYTES, host.INLINE_MAX_BYTES, shm._SegmentPool.MIN_BYTES
    report: dict[str, Any] = {}
    try:
        shm._SegmentPool.MIN_BYTES = 1 << 10
        for name in sizes:
            tensor = torch.full((CHOICES[name] // 4,), float(rank))
            ways = [("pooled segment", 1 << 10)]
            if CHOICES[name] + (4 << 10) <= mailbox.MAX_MESSAGE_BYTES:  # a claim message can hold it
                ways.insert(0, ("in the claim", 1 << 30))
            for _ in range(blocks):
                for way, threshold in ways:
                    gather.ATTACHED_MAX_BYTES = host.INLINE_MAX_BYTES = threshold
                    wall = _back_to_back(lambda tensor=tensor: _gather_once(tensor, ranks), rounds)[0]
                    report.setdefault(name, {}).setdefault(way, []).append(wall)
    finally:
        gather.ATTACHED_MAX_BYTES, host.INLINE_MAX_BYTES, shm._SegmentPool.MIN_BYTES = kept
    return report


def _copy_at(rev: str, into: Path) -> None:
    """Extract the package at git revision ``rev`` as module ``du_against`` under ``into`` (raises
    SystemExit when it imports itself by its absolute name: two copies would then mix)."""
    repo = Path(__file__).resolve().parent.parent
    command = ["git", "-c", "safe.directory=*", "-C", str(repo), "archive", rev, "distribute_utils"]
    done = subprocess.run(command, capture_output=True, check=False)  # a checkout of another owner: fine
    if done.returncode != 0:
        raise SystemExit(f"--against {rev}: git archive failed: {done.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(into, filter="data")
    (into / "distribute_utils").rename(into / "du_against")
    selfish = [p for p in (into / "du_against").rglob("*.py") if _imports_itself(p)]
    if selfish:
        raise SystemExit(
            f"--against {rev}: {selfish[0].name} imports distribute_utils by name; cannot load it twice"
        )


def _imports_itself(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("distribute_utils")
        ):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("distribute_utils") for a in node.names):
            return True
    return False


def _against_rank(sizes: list[str], reps: int | None, path: str) -> dict[str, Any]:
    """Per size and version (``ours``, ``then``): median wall and thread CPU of this rank's call, and each
    call's start and end (``time.perf_counter``, one clock for every process of the host)."""
    sys.path.insert(0, path)
    import du_against  # type: ignore[import-not-found]

    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    versions = {"ours": get_tensors_parallel, "then": du_against.get_tensors_parallel}
    report: dict[str, Any] = {}
    for name, nbytes, tensor in _each_size(sizes):
        outputs = [torch.empty_like(tensor) for _ in ranks] if rank == 0 else None
        times: dict[str, tuple[list[float], list[float], list[tuple[float, float]]]] = {
            v: ([], [], []) for v in versions
        }
        count = _reps_for(nbytes, reps)
        for i in range(count + 10):
            order = list(versions.items())
            for version, gather in order if i % 2 else order[::-1]:
                dist.gather(tensor, outputs, dst=0)  # as in the sweep: something else ran in between
                dist.barrier()
                start, cpu = time.perf_counter(), time.thread_time()
                with gather(tensor, ranks):
                    end, cpu = time.perf_counter(), time.thread_time() - cpu
                if i >= 10:
                    times[version][0].append(end - start)
                    times[version][1].append(cpu)
                    times[version][2].append((start, end))
        report[name] = {v: (statistics.median(w), statistics.median(c), s) for v, (w, c, s) in times.items()}
    return report


def _print_against(reports: list[dict[str, Any]], sizes: list[str], rev: str) -> None:
    print(
        f"ours (this checkout) against {rev}, {len(reports)} ranks, interleaved, barrier to barrier: "
        "rank 0's wall (median ms); all done: from the first rank's start to the last one's return "
        "(median ms); the call's thread CPU summed over ranks (medians, us)"
    )
    print(
        f"{'size':>5} {'ours':>8} {'then':>8} {'ratio':>6}   {'all ours':>8} {'all then':>8} {'ratio':>6}"
        f"   {'cpu ours':>9} {'cpu then':>9} {'ratio':>6}"
    )
    for name in sizes:
        wall = {v: reports[0][name][v][0] for v in ("ours", "then")}
        done = {v: _all_done([r[name][v][2] for r in reports]) for v in ("ours", "then")}
        cpu = {v: sum(r[name][v][1] for r in reports) for v in ("ours", "then")}
        print(
            f"{name:>5} {wall['ours'] * 1e3:8.3f} {wall['then'] * 1e3:8.3f} {wall['ours'] / wall['then']:6.2f}"
            f"   {done['ours'] * 1e3:8.3f} {done['then'] * 1e3:8.3f} {done['ours'] / done['then']:6.2f}"
            f"   {cpu['ours'] * 1e6:9.0f} {cpu['then'] * 1e6:9.0f} {cpu['ours'] / cpu['then']:6.2f}"
        )


def _all_done(spans: list[list[tuple[float, float]]]) -> float:
    """Median over calls of the time from the earliest rank's start to the latest rank's return
    (``spans[rank][call]`` is that rank's ``(start, end)``)."""
    return statistics.median(
        max(end for _, end in call) - min(start for start, _ in call) for call in zip(*spans)
    )


def _print_steps(reports: list[dict[str, Any]], sizes: list[str], cold: bool = False) -> None:
    steps = list(reports[0][sizes[0]])
    how = "caches evicted before each call" if cold else "back to back"
    print(f"thread CPU per call, {how}, {len(reports)} ranks, medians (us; steps as in the module doc)")
    print(f"{'size':>5} {'rank':>6} " + " ".join(f"{s:>8}" for s in steps))
    for name in sizes:
        for rank in (0, 1):
            row = reports[rank][name]
            print(f"{name:>5} {rank:>6} " + " ".join(f"{row[s] * 1e6:8.1f}" for s in steps))


def _print_cpu(reports: list[dict[str, Any]], sizes: list[str]) -> None:
    print(
        f"CPU time per round, back to back, {len(reports)} ranks (us): process (main thread) per rank; "
        "their sum; the store server's (the launching process)"
    )
    for name in sizes:
        for method in reports[0][name]:
            per_rank = [r[name][method] for r in reports]
            cells = " ".join(f"{p * 1e6:5.0f} ({m * 1e6:4.0f})" for p, m, _ in per_rank)
            server = reports[0][name][method][2]
            print(
                f"{name:>5} {method:>10}  {cells}  sum {sum(p for p, _, _ in per_rank) * 1e6:6.0f}"
                f"  store server {server * 1e6:5.0f}"
            )


def _small_rank(reps: int | None) -> dict[str, float]:
    ranks = list(range(dist.get_world_size()))

    def tiny() -> Any:
        with get_configs_parallel({"a": 1}, ranks) as got:
            return got

    for _ in range(20):
        _timed(tiny)
    times = [_timed(tiny) for _ in range(max(200, reps or 0))]
    return {"ours": statistics.median(times), "load": os.getloadavg()[0]}


def _layer(rank: int, layer: int, n: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank * 100_003 + layer)
    config: dict[str, Any] = {"name": f"layers.{layer}", "hidden_act": "silu", "eps": 1e-5, "tp_rank": rank}
    for j in range(n):
        config[f"tensor_{j:02d}"] = torch.randn(LAYER_SHAPES[j % 4], generator=gen).to(LAYER_DTYPES[j % 4])
    return config


def _modelopt_layer(config: dict[str, Any], mc: Any) -> Any:
    """The same tensors inside ModelOpt's own config dataclasses (its helper carries only those)."""
    tensors = [v for k, v in config.items() if k.startswith("tensor_")]
    linears = [mc.LinearConfig() for _ in range(8)]
    slots = ["weight", "bias", "activation_scaling_factor", "weights_scaling_factor"]
    for i, t in enumerate(tensors):
        setattr(linears[i // 4], slots[i % 4], t)
    qkv = mc.QKVConfig(q=linears[0], k=linears[1], v=linears[2])
    layer = mc.DecoderLayerConfig(decoder_type="llama", num_attention_heads=32, num_kv_heads=8)
    layer.attention = mc.AttentionConfig(qkv=qkv, dense=linears[3])
    layer.mlp = mc.MLPConfig(fc=linears[4], gate=linears[5], proj=linears[6], hidden_act="silu")
    layer.post_layernorm = mc.LayernormConfig(weight=linears[7].weight, eps=1e-5)
    return layer


def _layer_rank(mo: Any | None, reps: int | None) -> dict[str, Any]:
    rank, ranks = dist.get_rank(), list(range(dist.get_world_size()))
    out: dict[str, Any] = {}
    for n in (64, 32):
        configs = [_layer(rank, i, n) for i in range(16)]

        def ours(configs: list[Any] = configs) -> None:
            for c in configs:
                with get_configs_parallel(c, ranks) as got:
                    _ = [g["tensor_00"] for g in got]

        methods: dict[str, Callable[[], Any]] = {"ours": ours}
        if mo is not None and n <= 32:
            mo_configs = [_modelopt_layer(c, mo[1]) for c in configs]

            def modelopt(mo_configs: list[Any] = mo_configs) -> None:
                for c in mo_configs:
                    with mo[0].get_configs_parallel(c, ranks, None) as got:
                        _ = [g.attention.qkv.q.weight for g in got]

            methods["modelopt"] = modelopt
        for fn in methods.values():
            _timed(fn)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(max(5, min(reps or 10, 10))):
            for m, fn in methods.items():
                times[m].append(_timed(fn) / len(configs))
        out[str(n)] = {m: statistics.median(v) for m, v in times.items()}
    return out


@contextlib.contextmanager
def _busy(n: int) -> Iterator[None]:
    """``n`` processes that spin on a CPU each until the block ends (a shared machine's load)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


@contextlib.contextmanager
def _limits_removed_at_end() -> Iterator[None]:
    """Name this run's limit segments, and remove them when it ends, however: ranks that failed never
    closed theirs."""
    os.environ["DU_BENCH_RUN"] = secrets.token_hex(4)
    try:
        yield
    finally:
        for path in glob.glob(f"{_limit_prefix()}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(CHOICES))
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size (default: by size)")
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument("--cpu", action="store_true", help="CPU time per round instead (see above)")
    parser.add_argument(
        "--rounds", type=int, default=1000, help="rounds per method with --cpu, --steps, --timeline"
    )
    parser.add_argument("--steps", action="store_true", help="one call's CPU split into steps (see above)")
    parser.add_argument("--cold", action="store_true", help="with --steps: caches evicted before each call")
    parser.add_argument(
        "--timeline", action="store_true", help="where a cold call's wall time goes (see above)"
    )
    parser.add_argument("--inline-threshold", action="store_true", help="payloads in the claim vs pooled")
    parser.add_argument("--store-ops", action="store_true", help="time single store requests (see above)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the ranks (see above)")
    parser.add_argument("--against", metavar="REV", help="compare with the package at git revision REV")
    parser.add_argument("--first", action="store_true", help="first gathers: new segments (see above)")
    args = parser.parse_args(argv)
    if args.cold and not args.steps:
        parser.error("--cold goes with --steps (it evicts the caches before each call that --steps splits)")
    with _busy(args.busy), _limits_removed_at_end():
        if args.against:
            with tempfile.TemporaryDirectory(prefix="du-against-") as tmp:
                _copy_at(args.against, Path(tmp))
                reports = run_local(_against_rank, args.nproc, args.sizes, args.reps, tmp)
            _print_against(reports, args.sizes, args.against)
            return 0
        if args.first:
            first = run_local(_first_rank, args.nproc, args.sizes, args.reps)[0]
            print(
                f"first gathers (new segments), {args.nproc} ranks, medians (ms), load {os.getloadavg()[0]:.1f}"
            )
            print(f"{'size':>6} {'ours':>8} {'fresh':>8} {'ours/fresh':>11}")
            for name, row in first.items():
                print(
                    f"{name:>6} {row['ours'] * 1e3:8.2f} {row['fresh'] * 1e3:8.2f} {row['ours'] / row['fresh']:11.2f}"
                )
            return 0
        if args.store_ops:
            ops = run_local(_store_ops_rank, max(args.nproc, 2), args.reps or 5000)[1]
            print(f"one store request from rank 1, median us (load {os.getloadavg()[0]:.1f})")
            for op, seconds in ops.items():
                print(f"{op:>22} {seconds * 1e6:7.1f}")
            return 0
        if args.inline_threshold:
            report = run_local(_inline_rank, args.nproc, args.sizes, min(args.rounds, 300))[0]
            print(f"ms per back-to-back round, {args.nproc} ranks, per block (load {os.getloadavg()[0]:.1f})")
            for name, ways in report.items():
                for way, blocks in ways.items():
                    print(f"{name:>5} {way:>15} " + " ".join(f"{b * 1e3:6.2f}" for b in blocks))
            return 0
        if args.timeline:
            _print_timeline(
                run_local(_timeline_rank, args.nproc, args.sizes, min(args.rounds, 500)), args.sizes
            )
            return 0
        if args.steps:
            _print_steps(
                run_local(_steps_rank, args.nproc, args.sizes, args.rounds, args.cold), args.sizes, args.cold
            )
            return 0
        if args.cpu:
            # This process serves the store (run_local's TCPStore): its CPU is the store server's.
            _print_cpu(run_local(_cpu_rank, args.nproc, args.sizes, args.rounds, os.getpid()), args.sizes)
            return 0
        report = run_local(_sweep_rank, args.nproc, args.sizes, args.reps)[0]
    has_mo = any("modelopt" in v for k, v in report.items() if k in CHOICES)
    print(
        f"gather of one float32 tensor per rank to rank 0, {args.nproc} ranks, medians (ms), load {os.getloadavg()[0]:.1f}"
        + (f", {args.busy} spinning processes beside them" if args.busy else "")
    )
    head = f"{'size':>6} {'ours':>8} {'limit':>8} {'pwrite':>8} {'fresh':>8} {'gloo':>8}" + (
        f" {'modelopt':>9}" if has_mo else ""
    )
    print(head + f" {'ours/limit':>11} {'gloo/ours':>10}" + (f" {'mo/ours':>8}" if has_mo else ""))
    for name in args.sizes:
        row = report[name]
        line = f"{name:>6} " + " ".join(
            f"{row[m] * 1e3:8.2f}" for m in ("ours", "limit", "pwrite", "fresh", "gloo")
        )
        if has_mo:
            line += f" {row['modelopt'] * 1e3:9.2f}"
        line += f" {row['ours'] / row['limit']:11.2f} {row['gloo'] / row['ours']:10.2f}"
        if has_mo:
            line += f" {row['modelopt'] / row['ours']:8.1f}"
        print(line)
    print(
        "the same ratios paired (each repetition's own ratio, median over the repetitions): "
        + ", ".join(
            f"{name} {report[name]['paired ours/limit']:.2f} / {report[name]['paired gloo/ours']:.2f}"
            for name in args.sizes
        )
    )
    print(
        "spread (10th / 50th / 90th percentile, ms): "
        + ", ".join(
            f"{name} "
            + " · ".join(
                f"{m} " + "/".join(f"{x * 1e3:.2f}" for x in report[name]["spread"][m])
                for m in ("ours", "limit")
            )
            for name in args.sizes
        )
    )
    small = report["small"]
    print(
        f"tiny round trip ({{'a': 1}}, get_configs_parallel): {small['ours'] * 1e3:.3f} ms (load {small['load']:.1f})"
    )
    bare = [name for name in args.sizes if "bare" in report[name]]
    if bare:
        print(
            "where the time goes up to 64 KiB (ms): the store protocol alone, + the wire format, ours; no store"
        )
        print(f"{'size':>6} {'bare':>8} {'+wire':>8} {'ours':>8} {'direct':>8}")
        for name in bare:
            row = report[name]
            print(
                f"{name:>6} "
                + " ".join(f"{row[m] * 1e3:8.2f}" for m in ("bare", "bare+wire", "ours", "direct"))
            )
    for n, row in report["layer"].items():
        text = f"layer config of {n} tensors, per layer: ours {row['ours'] * 1e3:.2f} ms"
        if "modelopt" in row:
            text += f", ModelOpt {row['modelopt'] * 1e3:.2f} ms ({row['modelopt'] / row['ours']:.1f}x)"
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
