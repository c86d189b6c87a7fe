"""Whole-round gather latency from 4 KiB to 64 MiB per rank: what a job waits for, against a true floor.

On ``--nproc`` local ranks (gloo), one float32 tensor per rank is gathered to rank 0. Every
repetition runs every method once, in an order shuffled at each repetition (the same on every
rank), so that a change of load hits all methods alike and no method always follows the same one.
Each round starts after a ``dist.barrier()``; every rank stamps when it enters the call and when it
returns, on ``CLOCK_MONOTONIC`` (``time.perf_counter_ns``: one clock for every process of the host),
with its process CPU time (all its threads) at both. Rank 0 reads every byte it received in every
method (an int64 sum over each tensor, checked against the sum it must be) before its exit stamp.
The stamps are collected after the timed region. Per round:

- ``all done``: from the first rank's entry to the last rank's return (what the job waits for);
- ``rank 0``: rank 0's own entry to its return;
- ``cpu``: the process CPU time of every rank during its call, summed over the ranks.

Methods:

- ``ours``: :func:`distribute_utils.get_tensors_parallel` (default transport);
- ``floor``: each sender copies its bytes into its own warm ``/dev/shm`` segment that it and rank 0
  keep mapped from the start, and sends one Unix datagram to rank 0, which reads every byte of each
  segment as its datagram comes. No checks, no verdict: the least any gather through memory does;
- ``answered``: the floor, and each sender then waits for rank 0's one-byte answer, sent to each once
  rank 0 has read every segment: the least any gather does that tells every sender how the call ended
  (ours must: an error on any rank is raised on every rank). ``ours/answered`` is what our own work
  costs over that hop, ``answered/floor`` what the hop costs (not printed with ``--against``);
- ``bare``: the round's two messages in little Python, up to 64 KiB (the bench's bound; ours carries
  payloads of up to 288 KiB inside the claim): each sender sends its tensor in the library's own payload
  format (:func:`distribute_utils.wire.encode`'s bytes, its head kept per dtype and shape) inside one
  claim datagram; rank 0 takes each claim only from the process that rank runs as (the kernel's
  ``SCM_CREDENTIALS``), checks the claim's bytes, copies the payload out and decodes it
  (:func:`distribute_utils.wire.decode` where the head is new, a view where it is one it checked), then
  sends every sender a verdict, which each checks. No records, deadlines, fallbacks or error paths: a
  round with our format and our checks and little else; ``ours/bare`` is the rest of our per-call work;
- ``gloo``: ``dist.gather`` into preallocated outputs;
- ``modelopt``: ModelOpt's ``get_tensors_parallel`` (when ``nvidia-modelopt`` is installed).

Then the tiny round trip (``{"a": 1}`` from every rank): ``ours`` (``get_configs_parallel``),
``gather_object`` (``dist.gather_object``) and ``ping`` (each sender sends the bytes in one datagram
to rank 0 and waits for its one-byte reply; rank 0 reads them all, then replies).

    python scripts/bench_latency.py                 # the default sweep, 1-2.5 minutes on 2 cores
    python scripts/bench_latency.py --sizes 4K 64K --reps 20 --json out.json

Prints three tables (all done, rank 0, cpu) of medians with the ratios ours/floor, gloo/ours,
modelopt/ours, ours/answered, answered/floor, ours/bare and bare/floor of those medians, the 10th and 90th percentile of all
done, and the tiny round trip.

``--busy N`` runs N spinning processes beside the ranks (a machine shared with other jobs).

``--against REV`` runs the same rounds with ``then``, the package as it was at git revision ``REV``,
loaded in the same rank processes (renamed ``du_against``, its own state and threads), beside
``ours`` and the floor, interleaved and shuffled the same way; the tiny round trip likewise::

    python scripts/bench_latency.py --against HEAD~1 --sizes 4K 1M

Modes of earlier versions of this script (``--cpu``, ``--steps``, ``--cold``, ``--timeline``,
``--first``, ``--inline-threshold``, ``--store-ops``) timed rank 0 alone or wrapped the package's
private methods; they are in git history.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import io
import json
import mmap
import os
import random
import secrets
import socket
import statistics
import struct
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its results package, however it is loaded)

from results.facts import load_average, run_facts

from distribute_utils import get_configs_parallel, get_tensors_parallel, wire
from distribute_utils.launch import run_local

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}
CHOICES = {**SIZES, "16K": 16 << 10, "256K": 256 << 10, "256M": 256 << 20}  # the default sweep, and more
TINY = {"a": 1}
TINY_BYTES = b'{"a": 1}'
# One round's stamps on one rank: entry and return (ns, CLOCK_MONOTONIC) and process CPU in between (ns).
Stamp = tuple[int, int, int]


def _reps_for(nbytes: int, reps: int | None) -> int:
    """``reps``, or by size: enough rounds that a median holds still on a loaded machine."""
    if reps is not None:
        return reps
    return 150 if nbytes <= 1 << 20 else 30 if nbytes <= 16 << 20 else 10 if nbytes <= 64 << 20 else 5


def _modelopt() -> Any | None:
    try:
        import modelopt.torch.export.distribute as mo_dist  # type: ignore[import-untyped]
    except Exception:
        return None
    return mo_dist


def run_prefix() -> str:
    """Where this run's floor segments go: named by the launching process (``$DU_BENCH_RUN``, which its
    ranks inherit), which removes them at the end (see :func:`segments_removed_at_end`)."""
    return f"/dev/shm/du-bench-floor-{os.environ.get('DU_BENCH_RUN', 'solo')}-"


def sum_of_bytes(tensors: list[torch.Tensor]) -> int:
    """The sum of every tensor's bytes read as int64 (uint8 where the size is no multiple of 8): a read
    of every byte received."""
    total = 0
    for t in tensors:
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        total += int((raw.view(torch.int64) if raw.numel() % 8 == 0 else raw).sum())
    return total


class _Check:
    """Rank 0's expected checksum of one round (every rank's tensor is filled with its rank)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        world = dist.get_world_size() if dist.get_rank() == 0 else 0  # only rank 0 checks
        self.want = sum(sum_of_bytes([torch.full_like(tensor, float(r))]) for r in range(world))

    def __call__(self, method: str, got: int) -> None:
        if got != self.want:
            raise RuntimeError(f"{method}: rank 0 read checksum {got}, expected {self.want}")


class _Dgram:
    """One Unix datagram socket per rank (an abstract name), bound for the whole run; rank 0's name is
    known to all."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(f"\0du-bench-{os.environ.get('DU_BENCH_RUN', 'solo')}-{os.getpid()}")
        self.names = [f"\0du-bench-{os.environ.get('DU_BENCH_RUN', 'solo')}-{p}" for p in _all_pids()]

    def ping(self) -> None:
        """The bare tiny round: each sender sends its bytes and waits for a reply; rank 0 reads them all,
        then replies to each."""
        if self.rank != 0:
            self.sock.sendto(TINY_BYTES, self.names[0])
            self.sock.recv(1)
            return
        peers = []
        for _ in range(1, self.world):
            data, peer = self.sock.recvfrom(64)
            if data != TINY_BYTES:
                raise RuntimeError(f"ping: rank 0 read {data!r}")
            peers.append(peer)
        for peer in peers:
            self.sock.sendto(b"1", peer)

    def close(self) -> None:
        self.sock.close()


class _Floor:
    """The floor of one size: warm shared segments, one datagram per sender (see the module doc)."""

    def __init__(self, nbytes: int, dgram: _Dgram) -> None:
        self.nbytes, self.dgram = nbytes, dgram
        self.rank, self.world = dgram.rank, dgram.world
        self.maps: dict[int, mmap.mmap] = {}
        self.views: dict[int, torch.Tensor] = {}
        pids = _all_pids()
        if self.rank != 0:
            path = f"{run_prefix()}{nbytes}-{os.getpid()}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                self.maps[self.rank] = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            self.maps[self.rank][:] = bytes(nbytes)  # warm: every page written once
            self.views[self.rank] = torch.frombuffer(self.maps[self.rank], dtype=torch.uint8)
        dist.barrier()
        if self.rank == 0:
            for r in range(1, self.world):
                fd = os.open(f"{run_prefix()}{nbytes}-{pids[r]}", os.O_RDWR)
                try:
                    self.maps[r] = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                finally:
                    os.close(fd)
                self.views[r] = torch.frombuffer(self.maps[r], dtype=torch.uint8)
        dist.barrier()
        if self.rank != 0:  # every map made: the name goes now, so a killed run leaves nothing in /dev/shm
            os.unlink(f"{run_prefix()}{nbytes}-{os.getpid()}")

    def run(self, tensor: torch.Tensor, check: Callable[[str, int], None]) -> None:
        if self.rank != 0:
            self.views[self.rank].copy_(tensor.view(torch.uint8))  # one plain copy into the kept map
            self.dgram.sock.sendto(self.rank.to_bytes(4, "little"), self.dgram.names[0])
            return
        total = sum_of_bytes([tensor])
        for _ in range(1, self.world):
            sender = int.from_bytes(self.dgram.sock.recv(4), "little")
            total += sum_of_bytes([self.views[sender]])
        check("floor", total)

    def run_answered(self, tensor: torch.Tensor, check: Callable[[str, int], None]) -> None:
        """:meth:`run`, then each sender waits for rank 0's one-byte answer, sent once every segment is read."""
        sock = self.dgram.sock
        if self.rank != 0:
            self.views[self.rank].copy_(tensor.view(torch.uint8))
            sock.sendto(self.rank.to_bytes(4, "little"), self.dgram.names[0])
            if sock.recv(1) != b"1":
                raise RuntimeError(f"answered: rank {self.rank} read another answer")
            return
        total = sum_of_bytes([tensor])
        peers = []
        for _ in range(1, self.world):
            data, peer = sock.recvfrom(4)
            total += sum_of_bytes([self.views[int.from_bytes(data, "little")]])
            peers.append(peer)
        check("answered", total)
        for peer in peers:
            sock.sendto(b"1", peer)

    def close(self) -> None:
        dist.barrier()  # rank 0 lets go of its views first
        self.views.clear()
        for m in self.maps.values():
            m.close()


BARE_MAX = 64 << 10
"""The largest size ``bare`` runs at: its payload travels inside one datagram."""
_BARE_HEAD = struct.Struct("<QI")  # a bare message: the call's number, the sender's rank
_BARE_CLAIM = b"bare claim: the same bytes call after call, as a repeated gather's".ljust(64)
_BARE_VERDICT = b"bare verdict: success"
_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid


class _Bare:
    """The ``bare`` round (see the module doc): one socket per rank bound for the whole run, taking
    the kernel's credentials of each message.

    A sender keeps the head (prefix and header) :func:`wire.encode` made for its tensor's dtype and shape
    and sends it before the tensor's bytes: checked byte for byte against ``wire.encode`` the first time.
    Rank 0 decodes a sender's payload with :func:`wire.decode` (every check) the first time and whenever
    its head or length differs from the last one checked; otherwise it views the tensor's bytes at the
    same place (every check :func:`wire.decode` makes of a head is a function of its bytes)."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pids = _all_pids()
        self.names = [f"\0du-bench-bare-{os.environ.get('DU_BENCH_RUN', 'solo')}-{p}" for p in self.pids]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.names[self.rank])
        self.buffer = bytearray(2 * BARE_MAX)
        self.buffers = [self.buffer]
        self.ancillary = socket.CMSG_SPACE(_CREDENTIALS.size)
        self.uid, self.call = os.geteuid(), 0
        self.heads: dict[tuple[torch.dtype, torch.Size], bytes] = {}  # a sender's, by dtype and shape
        # Rank 0's, per sender: the payload's bytes before its tensor, its length, the tensor's dtype.
        self.checked: dict[int, tuple[bytes, int, torch.dtype]] = {}

    def _take(self, want: int | None) -> tuple[int, memoryview]:
        """One message: its sender's rank (``want``: the only one taken) and its bytes after the head."""
        size, ancillary, _, _ = self.sock.recvmsg_into(self.buffers, self.ancillary)
        call, rank = _BARE_HEAD.unpack_from(self.buffer)
        pid = uid = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, uid, _ = _CREDENTIALS.unpack_from(data)
        if (
            call != self.call
            or uid != self.uid
            or (want is not None and rank != want)
            or pid != self.pids[rank]
        ):
            raise RuntimeError(
                f"bare: rank {self.rank} took a message it must not (call {call}, rank {rank})"
            )
        return rank, memoryview(self.buffer)[_BARE_HEAD.size : size]

    def _encoded(self, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
        """A contiguous CPU tensor's payload: its kept head, then its bytes."""
        if type(tensor) is not torch.Tensor or not tensor.is_cpu or not tensor.is_contiguous():
            raise RuntimeError("bare: sends a plain contiguous CPU tensor")
        data = tensor.numpy().data.cast("B")
        head = self.heads.get((tensor.dtype, tensor.shape))
        if head is None:
            payload = wire.encode(tensor, root="tensor")
            head = bytes(payload.head)
            if b"".join(payload.buffers()) != head + data:
                raise RuntimeError("bare: wire.encode's payload is not the kept head and the tensor's bytes")
            self.heads[(tensor.dtype, tensor.shape)] = head
        return head, data

    def _decoded(self, rank: int, message: memoryview) -> torch.Tensor:
        """``rank``'s payload as its tensor, in a copy of its own."""
        known = self.checked.get(rank)
        if known is not None and message.nbytes == known[1] and message[: len(known[0])] == known[0]:
            return torch.frombuffer(bytearray(message[len(known[0]) :]), dtype=known[2])
        data = bytearray(message)
        value = wire.decode(data)
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise RuntimeError("bare: rank 0 decoded something other than a flat tensor")
        start = value.data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        if start + value.nbytes != len(data):
            raise RuntimeError("bare: the tensor's bytes do not end the payload")
        self.checked[rank] = (bytes(message[:start]), len(data), value.dtype)
        return value

    def run(self, tensor: torch.Tensor, check: Callable[[str, int], None]) -> None:
        self.call += 1
        head = _BARE_HEAD.pack(self.call, self.rank)
        if self.rank != 0:
            self.sock.sendmsg([head, _BARE_CLAIM, *self._encoded(tensor)], (), 0, self.names[0])
            if self._take(0)[1] != _BARE_VERDICT:
                raise RuntimeError(f"bare: rank {self.rank} read another verdict")
            return
        got = [tensor]
        for _ in range(1, self.world):
            rank, message = self._take(None)
            if message[: len(_BARE_CLAIM)] != _BARE_CLAIM:
                raise RuntimeError("bare: rank 0 read another claim")
            got.append(self._decoded(rank, message[len(_BARE_CLAIM) :]))
        check("bare", sum_of_bytes(got))
        for name in self.names[1:]:
            self.sock.sendmsg([head, _BARE_VERDICT], (), 0, name)

    def close(self) -> None:
        self.sock.close()


def _all_pids() -> list[int]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, os.getpid())
    return out


def _round(fn: Callable[[], None]) -> Stamp:
    """A barrier, then this rank's entry and return stamps around ``fn`` and its process CPU in between."""
    dist.barrier()
    cpu, start = time.process_time_ns(), time.perf_counter_ns()
    fn()
    end = time.perf_counter_ns()
    return start, end, time.process_time_ns() - cpu


def _interleaved(methods: dict[str, Callable[[], None]], reps: int, warm: int) -> dict[str, list[Stamp]]:
    """``warm`` untimed rounds of every method, then ``reps`` repetitions of every method in an order
    shuffled per repetition (the same on every rank)."""
    for fn in methods.values():
        for _ in range(warm):
            _round(fn)
    stamps: dict[str, list[Stamp]] = {m: [] for m in methods}
    names = list(methods)
    for rep in range(reps):
        for method in random.Random(rep).sample(names, len(names)):
            stamps[method].append(_round(methods[method]))
    return stamps


def _gatherers(against: Any | None) -> dict[str, Callable[..., Any]]:
    """The library calls timed as ``ours`` (and ``then``: the package at ``--against``'s revision)."""
    out: dict[str, Callable[..., Any]] = {"ours": get_tensors_parallel}
    if against is not None:
        out["then"] = against.get_tensors_parallel
    return out


def _size_methods(
    tensor: torch.Tensor, floor: _Floor, bare: _Bare, check: _Check, against: Any | None
) -> dict[str, Callable[[], None]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    methods: dict[str, Callable[[], None]] = {}

    def library(name: str, gather: Callable[..., Any]) -> Callable[[], None]:
        def call() -> None:
            with gather(tensor, ranks) as got:
                if rank == 0:
                    check(name, sum_of_bytes(list(got)))

        return call

    for name, gather in _gatherers(against).items():
        methods[name] = library(name, gather)
    methods["floor"] = lambda: floor.run(tensor, check)
    if against is None:
        outputs = [torch.empty_like(tensor) for _ in ranks] if rank == 0 else None

        def gloo() -> None:
            dist.gather(tensor, outputs, dst=0)
            if outputs is not None:
                check("gloo", sum_of_bytes(outputs))

        methods["gloo"] = gloo
        methods["answered"] = lambda: floor.run_answered(tensor, check)
        if tensor.nbytes <= BARE_MAX:
            methods["bare"] = lambda: bare.run(tensor, check)
        mo = _modelopt()
        if mo is not None:
            methods["modelopt"] = library("modelopt", mo.get_tensors_parallel)
    return methods


def _tiny_methods(dgram: _Dgram, against: Any | None) -> dict[str, Callable[[], None]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))

    def check(method: str, got: list[Any]) -> None:
        if got != [TINY] * world:
            raise RuntimeError(f"{method}: rank 0 read {got!r}")

    def library(name: str, gather: Callable[..., Any]) -> Callable[[], None]:
        def call() -> None:
            with gather(TINY, ranks) as got:
                if rank == 0:
                    check(name, list(got))

        return call

    methods = {"ours": library("ours", get_configs_parallel)}
    if against is not None:
        methods["then"] = library("then", against.get_configs_parallel)
    else:
        out: list[Any] | None = [None] * world if rank == 0 else None

        def gather_object() -> None:
            dist.gather_object(TINY, out, dst=0)
            if out is not None:
                check("gather_object", out)

        methods["gather_object"] = gather_object
    methods["ping"] = dgram.ping
    return methods


def _rank(sizes: list[str], reps: int | None, against_path: str | None) -> dict[str, Any]:
    """One rank's stamps, per size (and ``tiny``) and method."""
    torch.set_num_threads(1)  # four ranks on a few cores: no method gets more threads than another
    against = None
    if against_path is not None:
        sys.path.insert(0, against_path)
        import du_against  # type: ignore[import-not-found]

        against = du_against
    dgram, bare = _Dgram(), _Bare()
    report: dict[str, Any] = {}
    try:
        for name in sizes:
            nbytes = CHOICES[name]
            tensor = torch.full((nbytes // 4,), float(dist.get_rank()))
            floor = _Floor(nbytes, dgram)
            try:
                methods = _size_methods(tensor, floor, bare, _Check(tensor), against)
                count = _reps_for(nbytes, reps)
                report[name] = _interleaved(methods, count, warm=min(10, max(2, count // 10)))
            finally:
                floor.close()
        report["tiny"] = _interleaved(_tiny_methods(dgram, against), max(reps or 300, 2), warm=10)
    finally:
        dist.barrier()
        dgram.close()
        bare.close()
    return report


def _deciles(values: list[float]) -> tuple[float, float, float]:
    """The 10th, 50th and 90th percentile of ``values``."""
    cuts = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return cuts[0], statistics.median(values), cuts[-1]


def summarise(per_rank: list[dict[str, list[Stamp]]]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per method: (10th, 50th, 90th percentile) in ms of ``all done``, ``rank 0`` and ``cpu`` over its
    rounds, from every rank's stamps (``per_rank[rank][method][round]``)."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for method in per_rank[0]:
        rounds = list(zip(*(r[method] for r in per_rank), strict=True))
        figures = {
            "all done": [max(s[1] for s in r) - min(s[0] for s in r) for r in rounds],
            "rank 0": [r[0][1] - r[0][0] for r in rounds],
            "cpu": [sum(s[2] for s in r) for r in rounds],
        }
        out[method] = {k: _deciles([v / 1e6 for v in vs]) for k, vs in figures.items()}
    return out


def _table(title: str, rows: dict[str, dict[str, float]], ratios: list[tuple[str, str]]) -> None:
    """One table: a row per label, a column per method (ms, 3 decimals), then the ratios of the printed
    rows' unrounded values (2 decimals); ``-`` where a row has no such method (``bare`` at large sizes)."""
    methods = list(dict.fromkeys(m for row in rows.values() for m in row))
    print(title)
    print(
        f"{'':>10}" + "".join(f" {m:>13}" for m in methods) + "".join(f" {f'{a}/{b}':>18}" for a, b in ratios)
    )
    for label, row in rows.items():
        print(
            f"{label:>10}"
            + "".join(f" {row[m]:13.3f}" if m in row else f" {'-':>13}" for m in methods)
            + "".join(
                f" {row[a] / row[b]:18.2f}" if a in row and b in row else f" {'-':>18}" for a, b in ratios
            )
        )


def _print(summary: dict[str, Any], sizes: list[str], nproc: int, reps: dict[str, int], load: str) -> None:
    against = "then" in summary["tiny"]
    first = summary[sizes[0]]
    ratios = [("ours", "then"), ("ours", "floor"), ("then", "floor")] if against else [("ours", "floor")]
    if not against:
        ratios += [(m, "ours") for m in ("gloo", "modelopt") if m in first]
        ratios += [("ours", "answered"), ("answered", "floor"), ("ours", "bare"), ("bare", "floor")]
    print(
        f"whole-round gather, {nproc} ranks, one float32 tensor per rank to rank 0, every byte read; "
        f"medians over {', '.join(f'{s} {reps[s]}' for s in sizes)} rounds; load {load}"
    )
    for metric, what in (
        ("all done", "all done: first rank's entry to last rank's return (ms)"),
        ("rank 0", "rank 0: its entry to its return (ms)"),
        ("cpu", "cpu: process CPU of every rank during the round, summed (ms)"),
    ):
        _table(what, {s: {m: v[metric][1] for m, v in summary[s].items()} for s in sizes}, ratios)
    print(
        "all done, 10th/90th percentile (ms): "
        + "; ".join(
            f"{s} "
            + ", ".join(f"{m} {v['all done'][0]:.3f}/{v['all done'][2]:.3f}" for m, v in summary[s].items())
            for s in sizes
        )
    )
    tiny = summary["tiny"]
    tiny_ratios = (
        [("ours", "then"), ("ours", "ping")] if against else [("ours", "ping"), ("gather_object", "ours")]
    )
    _table(
        f"tiny round trip ({TINY}), medians over {reps['tiny']} rounds (ms)",
        {metric: {m: v[metric][1] for m, v in tiny.items()} for metric in ("all done", "rank 0", "cpu")},
        tiny_ratios,
    )


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
    selfish = [p for p in (into / "du_against").rglob("*.py") if imports_itself(p)]
    if selfish:
        raise SystemExit(
            f"--against {rev}: {selfish[0].name} imports distribute_utils by name; cannot load it twice"
        )


def imports_itself(path: Path) -> bool:
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
def segments_removed_at_end() -> Iterator[None]:
    """Name this run's floor segments, and remove them when it ends, however: ranks that failed before
    every map was made never unlinked theirs."""
    os.environ["DU_BENCH_RUN"] = secrets.token_hex(4)
    try:
        yield
    finally:
        for path in glob.glob(f"{run_prefix()}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(CHOICES))
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size (default: by size)")
    parser.add_argument("--json", help="write the percentiles here")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the ranks")
    parser.add_argument("--against", metavar="REV", help="compare with the package at git revision REV")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error(f"--nproc must be at least 2 (a gather needs a sender); got {args.nproc}")
    started, averages_before = time.time(), load_average()
    load_before = _load()
    with (
        _busy(args.busy),
        segments_removed_at_end(),
        tempfile.TemporaryDirectory(prefix="du-against-") as tmp,
    ):
        if args.against:
            _copy_at(args.against, Path(tmp))
        per_rank = run_local(_rank, args.nproc, args.sizes, args.reps, tmp if args.against else None)
    keys = [*args.sizes, "tiny"]
    summary = {k: summarise([r[k] for r in per_rank]) for k in keys}
    reps = {k: len(next(iter(per_rank[0][k].values()))) for k in keys}
    load = f"{load_before} before, {_load()} after (1/5/15 min)" + (
        f", {args.busy} spinning processes beside the ranks" if args.busy else ""
    )
    _print(summary, args.sizes, args.nproc, reps, load)
    if args.json:
        facts = run_facts(
            ["scripts/bench_latency.py", *(argv if argv is not None else sys.argv[1:])],
            started,
            averages_before,
        )
        Path(args.json).write_text(
            json.dumps(
                {"summary": summary, "reps": reps, "load": load, "nproc": args.nproc, "run": facts}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
