"""Run test functions on real ranks: spawned processes joined in a real gloo process group.

A :class:`RankPool` starts ``world_size`` processes once (spawn start method, gloo over a
``TCPStore`` hosted by the parent, so a rank's death never takes the rendezvous with it) and
runs one function after another on all of them. Spawning costs seconds on this machine, so
the test suite keeps one pool per world size alive for the whole session (see conftest.py).

- Child tracebacks come back to the parent and fail the test with every rank's traceback.
- Every run has a hard timeout: on expiry the pool is killed (SIGKILL, process group) and
  reaped, and the test fails naming the ranks that did not answer.
- After any failure the pool is discarded and a fresh one is started for the next test, so
  one broken test cannot poison the next.
- ``run(..., expect_deaths=True)`` is for fault injection: ranks that die return a
  :class:`Died` record instead of failing the test; the pool is discarded afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MEGATRON_SAVES",
    "SCRIPTS",
    "Died",
    "RankFailure",
    "RankPool",
    "free_port",
    "job_leftovers",
    "load_script",
    "relabel_devices",
    "remake_group",
    "shm_entries",
    "torchrun_argv",
    "without_args",
]

_SPAWN = mp.get_context("spawn")
#: The repository's scripts/ directory.
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(nproc: int, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` on one node with ``nproc`` ranks, then ``args`` (the program)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]


def load_script(name: str) -> Any:
    """The module ``scripts/<name>.py`` (benchmarks double as test fixtures)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEGATRON_SAVES: dict[str, dict[str, Any]] = {
    "swiglu": dict(case="swiglu", tp=2, pp=2),
    "moe": dict(case="moe", tp=2, pp=1, ep=2),
    "dense": dict(case="dense", tp=2, pp=2),
    "gqa_tied_vpp": dict(case="gqa", tp=2, pp=2, vp=2),
    "uneven": dict(case="uneven", tp=1, pp=2),
    "llama": dict(case="llama", tp=2, pp=2),
}
"""Real megatron-core saves the tests consolidate (``scripts/megatron_checkpoints.py`` cases on a grid),
written once per session by the ``megatron_save`` fixture."""


def without_args(legacy: Path, copy: Path) -> Path:
    """A copy of Megatron legacy files with their ``args`` removed (as tools other than Megatron-LM write
    them); returns ``copy``."""
    from distribute_utils.consolidate import open_checkpoint

    src = open_checkpoint(legacy)
    for t, s in src.shards():
        obj = torch.load(src.file_for(t, s), weights_only=False)
        del obj["args"]
        dst = copy / src.file_for(t, s).relative_to(src.root)
        dst.parent.mkdir(parents=True)
        torch.save(obj, dst)
    return copy


@dataclass(frozen=True)
class Died:
    """What a rank returned when its process died during the run."""

    exitcode: int | None


class RankFailure(AssertionError):
    """One or more ranks raised, died or did not answer; holds every rank's report."""


def _worker_main(
    rank: int, world_size: int, host: str, port: int, conn: Connection, env: dict[str, str]
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
                payload = pickle.dumps(reply)
            except BaseException as exc:  # report everything, including test assertion errors
                payload = pickle.dumps(("err", "".join(traceback.format_exception(exc))))
            conn.send_bytes(payload)
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` live ranks in one gloo group, reused across runs."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self._env = dict(env or {})
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent, child = _SPAWN.Pipe()
            proc = _SPAWN.Process(
                target=_worker_main,
                args=(rank, world_size, "127.0.0.1", self._store.port, child, self._env),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.broken = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop_store(self) -> None:
        """Stop the rendezvous store's server (held by this process): the ranks' store calls fail from
        now on, as when the process hosting a job's store dies. The pool cannot run again after it."""
        self._store = None
        gc.collect()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        expect_deaths: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            RankFailure: a rank raised, died (unless ``expect_deaths``) or missed the timeout.
        """
        if self.broken:
            raise RuntimeError("this pool is broken; start a new one")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    kind, value = pickle.loads(pending[rank].recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(5)
                    code = self._procs[rank].exitcode
                    if expect_deaths:
                        results[rank] = Died(code)
                    else:
                        errors[rank] = f"process died with exit code {code}"
                else:
                    (results if kind == "ok" else errors)[rank] = value
                del pending[rank]
        if pending:
            errors.update({r: f"no answer within {timeout:g} s (killed)" for r in pending})
        if errors or pending or expect_deaths:
            self.close(kill=bool(pending) or expect_deaths)
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise RankFailure(f"{len(errors)} of {self.world_size} ranks failed in {fn.__name__}:\n{report}")
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop every rank (politely unless ``kill``) and reap it. Idempotent."""
        self.broken = True
        if not kill:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
            for proc in self._procs:
                proc.join(10)
        for proc in self._procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        for conn in self._conns:
            conn.close()
        self._conns = []


def relabel_devices(payload: bytes, devices: dict[int, str]) -> bytes:
    """``payload`` (a wire payload without a checksum) as a sender whose tensor ``i`` was on
    ``devices[i]`` would have written it: what a CPU-only test needs to stand for a CUDA sender.

    The header's tensor entries get the new device names and the tensor bytes move to the offsets the
    longer header gives, laid out as docs/wire-format.md says (each tensor at the next multiple of 64).
    """
    import msgpack

    from distribute_utils.wire import ALIGN, PREFIX_SIZE, VERSION, read_prefix

    def align(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    flags, header_len, _, _ = read_prefix(payload)
    assert flags == 0, "relabel_devices takes payloads without a checksum"
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    unpacker.feed(payload[PREFIX_SIZE : PREFIX_SIZE + header_len])
    spans: dict[str, Any] = {}
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        start = unpacker.tell()
        spans[key] = unpacker.unpack()
        if key == "v":
            spans["v_raw"] = payload[PREFIX_SIZE + start : PREFIX_SIZE + unpacker.tell()]
    entries = spans["t"]
    data = [payload[offset : offset + nbytes] for _, _, offset, nbytes, _ in entries]
    for index, device in devices.items():
        entries[index][4] = device
    base = b"\x82\xa1v" + spans["v_raw"] + b"\xa1t"
    start = align(PREFIX_SIZE + len(base) + 1)
    while True:  # offsets and the header's length depend on each other: to the fixed point
        cursor = start
        for entry, raw in zip(entries, data):
            entry[2], cursor = cursor, align(cursor + len(raw))
        header = base + msgpack.packb(entries)
        if align(PREFIX_SIZE + len(header)) <= start:
            break
        start = align(PREFIX_SIZE + len(header))
    out = bytearray(PREFIX_SIZE) + header
    for entry, raw in zip(entries, data):
        out += bytes(entry[2] - len(out)) + raw
    struct.pack_into("<4sHHQQQ", out, 0, b"DUW1", VERSION, 0, len(header), len(out), 0)
    return bytes(out)


def temporaries_clean_would_remove() -> list[str]:
    """The temporary files ``distribute-utils clean --dry-run --json`` lists (it removes nothing)."""
    import json
    import subprocess

    dry = subprocess.run(
        [sys.executable, "-m", "distribute_utils", "clean", "--dry-run", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    return [r["path"] for r in json.loads(dry.stdout)["removed"] if r["kind"] == "temporary"]


def job_store() -> dist.TCPStore:
    """In a rank: the job's ``TCPStore`` under the default group's store (and the prefixes of groups
    re-made on it before)."""
    store = dist.distributed_c10d._get_default_store()
    while not isinstance(store, dist.TCPStore):
        store = store.underlying_store
    return store


def remake_group(rank: int, tag: str, between: Callable[[], Any] | None = None) -> Any:
    """In a rank: destroy the default group and make it again on the same store (under the prefix
    ``tag``), this process as ``rank``; ``between()``, when given, runs with no default group, and its
    result is returned."""
    store = job_store()
    host, port, world = store.host, store.port, dist.get_world_size()
    dist.destroy_process_group()
    done = between() if between is not None else None
    client = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(tag, client), rank=rank, world_size=world)
    return done


def shm_entries(pids: set[int]) -> set[str]:
    """Segments in /dev/shm made by processes ``pids`` (names end in ``_<pid>``)."""
    return {
        name
        for name in os.listdir("/dev/shm")
        if name.startswith("du_")
        and name.rsplit("_", 1)[-1].isdigit()
        and int(name.rsplit("_", 1)[-1]) in pids
    }


def job_leftovers(pids: set[int]) -> set[str]:
    """What processes ``pids`` have in /dev/shm: their segments (:func:`shm_entries`) and, in this user's
    private directory there, their records and sockets (named ``<pid>-...``). Never anything of another
    process, so another job on the machine cannot change it (docs/api.md: leftovers are named by pid)."""
    from distribute_utils import host_dir

    mine = set(shm_entries(pids))
    try:
        names = os.listdir(host_dir.PRIVATE_DIR)
    except OSError:
        names = []
    for name in names:
        head = name.split("-", 1)[0]
        if head.isdigit() and int(head) in pids:
            mine.add(os.path.join(host_dir.PRIVATE_DIR, name))
    return mine
