"""One rank of a fault-injection job: gathers while a chosen rank dies, hangs or finds no room.

Started by ``tests/test_faults.py``, either directly (``RANK``, ``WORLD_SIZE`` and
``DU_STORE_PORT``: the test process hosts the job's ``TCPStore``, so the death of any rank,
rank 0 included, never takes the rendezvous with it), or directly as ``mp.spawn`` / ``env://``
jobs start (``DU_STORE_ON_RANK0``, ``MASTER_ADDR``, ``MASTER_PORT``: rank 0 hosts the store, and
every survivor then makes one more gather, without rank 0, reported as ``later``), or under
``torchrun`` (``MASTER_ADDR`` set). Usage: ``fault_job.py CASE``. Every surviving rank writes ``$DU_RESULTS/rank<r>.json``
and exits by itself; a rank that is meant to die SIGKILLs itself at the injection point
(writing ``$DU_RESULTS/note<r>.json`` first when there is something to record).

Cases (the victim is the last rank unless the name says "first rank"):

- ``sender_dies_before_gather``: after the ranks met, the victim dies before entering.
- ``sender_dies_before_meeting``: the victim dies right after ``init_process_group``, before
  any exchange: its peers cannot watch its pid, so the timeout (``$DISTRIBUTE_UTILS_TIMEOUT``)
  names it.
- ``sender_hangs``: the victim stays away (alive, unresponsive) until every other rank has timed
  out, then enters the gather late.
- ``sender_dies_mid_publish``: the victim dies with its segment half written.
- ``sender_dies_after_publish``: the victim dies in the body of its ``with`` block.
- ``sender_dies_while_reader_reads``: the victim dies right after posting its claim; the first
  rank fetches its payload only after it has died.
- ``first_rank_dies_before_gather`` / ``first_rank_dies_mid_read``: rank 0 dies before
  entering, or after fetching the first payload it reads (the first claim to come); when it hosts
  the store (``DU_STORE_ON_RANK0``), once it has fetched every sender's payload, before its verdict
  (dying at the first let a slow sender still be in the setup barrier, on the store that goes with
  rank 0: a failure of the test's own setup, not of the gather).
- ``first_rank_dies_while_idle``: rank 0 dies before any rank used the library (with
  ``DU_STORE_ON_RANK0``: its store goes with it); the others then enter a gather.
- ``workspace_sender_dies_mid_publish``: as ``sender_dies_mid_publish`` through the workspace
  (``$DU_WORKSPACE``), leaving a half-written temporary file.
- ``workspace_rounds``: a healthy job, ``$DU_ROUNDS`` gathers through the workspace with the
  receiver rotating (``$DU_AWAIT_LIVE_NAMESPACE``: first wait until another job's namespace is live;
  ``$DU_DONE_FILE``: create it when done; ``$DU_HOLD_UNTIL``: stay, namespace live, until it exists).
- ``shm_fallback``: 4 ranks gather ``$DU_PER_RANK_MIB`` MiB each with a workspace given, in a
  /dev/shm too small for all of it.
- ``workspace_full_ro``: a gather into a full workspace (``$DU_FULL_WS``), then into a
  read-only one (``$DU_RO_WS``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import distribute_utils
from distribute_utils import PeerLostError, get_tensors_parallel, sync, wire
from distribute_utils.processes import pid_start_time, process_alive
from distribute_utils.transports import carriers, shm

RESULTS = os.environ.get("DU_RESULTS", ".")
TIMEOUT = float(os.environ.get("DU_TIMEOUT", "5"))
ELEMENTS = 96 * 1024  # 384 KiB of float32 per rank: above the inline and attached limits, so through /dev/shm
# This job exercises named segments (a dead sender's pooled segment dies with it; the pool
# has tests of its own in test_shm.py): no pooled segments here.
shm.SharedMemoryTransport.pooling = False


def _die(note: dict[str, Any] | None = None) -> None:
    """SIGKILL this process (after recording ``note``): no handler, no atexit, no cleanup."""
    if note is not None:
        _write(f"note{dist.get_rank()}.json", note)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


def _write(name: str, data: dict[str, Any]) -> None:
    tmp = os.path.join(RESULTS, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.rename(tmp, os.path.join(RESULTS, name))


def _value(rank: int, elements: int = ELEMENTS) -> torch.Tensor:
    return torch.full((elements,), float(rank + 1))


def _check(got: list[torch.Tensor], ranks: list[int], elements: int = ELEMENTS) -> list[str]:
    """What is wrong with ``got`` (empty when every rank's tensor arrived exactly)."""
    if len(got) != len(ranks):
        return [f"got {len(got)} results for ranks {ranks}"]
    return [f"rank {r}" for r, t in zip(ranks, got) if not torch.equal(t, _value(r, elements))]


def _half_then_die(self: wire.EncodedPayload, fd: int, base: int = 0) -> None:
    """Replacement of ``EncodedPayload.write_to_fd``: write half the payload, then die."""
    data = self.to_bytes()
    half = len(data) // 2
    os.pwrite(fd, data[:half], base)
    path = os.readlink(f"/proc/self/fd/{fd}")
    _die({"path": path, "written": half, "nbytes": len(data), "size": os.fstat(fd).st_size})


class _Warnings(logging.Handler):
    """Keeps the library's warnings, for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _gather(report: dict[str, Any], ranks: list[int], **kwargs: Any) -> None:
    """One gather; records outcome, error, elapsed time and whether the data arrived exactly."""
    rank = dist.get_rank()
    elements = kwargs.pop("elements", ELEMENTS)
    body = kwargs.pop("body", None)
    start = time.monotonic()
    try:
        with get_tensors_parallel(_value(rank, elements), ranks, **kwargs) as got:
            if rank == ranks[0]:
                report["wrong"] = _check(got, ranks, elements)
                report["received"] = len(got)
            if body is not None:
                body()
        report["outcome"] = "ok"
    except Exception as exc:
        report["outcome"] = "error"
        report["error_type"] = type(exc).__name__
        report["message"] = str(exc)
        report["missing"] = list(getattr(exc, "missing", ()))
    report["elapsed"] = time.monotonic() - start


def _await_live_namespace(workspace: str, timeout: float = 60.0) -> str:
    """Wait until another job has a namespace with a live owner in ``workspace``; its name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in os.listdir(workspace) if os.path.isdir(workspace) else []:
            directory = os.path.join(workspace, name)
            if not name.startswith("du-job-") or not os.path.isdir(directory):
                continue
            for record in os.listdir(directory):
                if record.startswith("owner-") and record.endswith(".json"):
                    try:
                        with open(os.path.join(directory, record)) as f:
                            owner = json.load(f)
                    except (OSError, ValueError):
                        continue
                    if pid_start_time(int(owner["pid"])) == int(owner["start_time"]):
                        return name
        time.sleep(0.01)
    raise TimeoutError(f"no other job opened a namespace in {workspace} within {timeout:g} s")


def _await_file(path: str, timeout: float = 120.0) -> None:
    """Waits until ``path`` exists (another job's signal)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.01)


def _payload_files(workspace: str) -> list[str]:
    """Files in ``workspace`` other than this user's lock directory and the owner records."""
    found = []
    for directory, _, files in os.walk(workspace):
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), workspace)
            if not name.startswith("owner-") and not relative.startswith(".du-"):
                found.append(relative)
    return sorted(found)


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _wait_for(keys: list[str]) -> None:
    """Waits until the other ranks have posted ``keys`` in the job's store (an event, not a sleep)."""
    store = _store()
    store.set_timeout(datetime.timedelta(seconds=120))
    store.wait(keys)


def _await_refused(port: int, timeout: float = 60.0) -> None:
    """Waits until 127.0.0.1:``port`` refuses connections (the store's host has died: an event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"the store at 127.0.0.1:{port} still answers after {timeout:g} s")


def _next_sync(report: dict[str, Any]) -> None:
    """The synchronisation after the gather: a barrier that must name a dead rank."""
    start = time.monotonic()
    try:
        distribute_utils.barrier(timeout=TIMEOUT)
        report["next_sync"] = "ok"
    except PeerLostError as exc:
        report["next_sync"] = str(exc)
        report["next_missing"] = list(exc.missing)
    report["next_elapsed"] = time.monotonic() - start


def run_case(case: str, report: dict[str, Any]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    victim = world - 1
    if case == "sender_dies_before_meeting":
        if rank == victim:
            _die()
        _gather(report, ranks)  # no timeout argument: $DISTRIBUTE_UTILS_TIMEOUT applies
        return
    if case == "first_rank_dies_while_idle":
        if rank == 0:  # dies before anybody used distribute_utils; the others then enter a gather
            _wait_for([f"idle_{r}" for r in ranks if r != 0])
            _die()
        _store().set(f"idle_{rank}", "1")
        _await_refused(int(os.environ["MASTER_PORT"]))
        _gather(report, ranks, timeout=TIMEOUT)
        return
    distribute_utils.barrier(timeout=60)  # the ranks meet: peers know each other's pid
    if case == "sender_dies_before_gather":
        if rank == victim:
            _die()
        _gather(report, ranks, timeout=TIMEOUT)
    elif case == "sender_hangs":
        if rank == victim:  # alive but late: it enters only once every other rank has given up
            _wait_for([f"gave_up_{r}" for r in ranks if r != victim])
        _gather(report, ranks, timeout=TIMEOUT)
        if rank != victim:
            _store().set(f"gave_up_{rank}", "1")
    elif case in ("sender_dies_mid_publish", "workspace_sender_dies_mid_publish"):
        if rank == victim:
            wire.EncodedPayload.write_to_fd = _half_then_die  # type: ignore[method-assign]
        options: dict[str, Any] = {"timeout": TIMEOUT}
        if case.startswith("workspace"):
            options.update(transport="workspace", workspace_path=os.environ["DU_WORKSPACE"])
        _gather(report, ranks, **options)
    elif case == "sender_dies_after_publish":
        _gather(report, ranks, timeout=TIMEOUT, body=_die if rank == victim else None)
        _next_sync(report)
    elif case == "sender_dies_while_reader_reads":
        if rank == 0:
            victim_info = sync.companion(None).peers(TIMEOUT)[victim]

            def fetch_after_death(point: str, r: int, carrier: Any, receipt: Any) -> None:
                if point == "fetching" and r == victim:
                    deadline = time.monotonic() + 30
                    while process_alive(victim_info) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    report["victim_dead_before_fetch"] = not process_alive(victim_info)

            carriers.inject(fetch_after_death)
        if rank == victim:  # dies once its claim is posted (store round) or delivered (direct round)
            sync.Call.wait_verdict = lambda *args, **kwargs: _die()  # type: ignore[method-assign]
            send = sync.Call.send_direct

            def send_then_die(self: sync.Call, to: int, kind: int, *args: Any, **kwargs: Any) -> bool:
                if send(self, to, kind, *args, **kwargs) and to == 0:
                    _die()
                return False

            sync.Call.send_direct = send_then_die  # type: ignore[method-assign]
        _gather(report, ranks, timeout=TIMEOUT)
        _next_sync(report)
    elif case == "first_rank_dies_before_gather":
        if rank == 0:  # dies once every sender is entering the gather
            _wait_for([f"entering_{r}" for r in ranks if r != 0])
            _die()
        _store().set(f"entering_{rank}", "1")
        _gather(report, ranks, timeout=TIMEOUT)
    elif case == "first_rank_dies_mid_read":
        if rank == 0:
            fetched: list[int] = []
            # Hosting the store, it dies once every sender's payload is fetched: every sender is then in
            # the gather, past the setup barrier whose store goes with this process.
            wanted = len(ranks) - 1 if "DU_STORE_ON_RANK0" in os.environ else 1

            def fetch_then_die(point: str, r: int, carrier: Any, buffer: Any) -> None:
                if point == "fetched":
                    fetched.append(r)
                    if len(fetched) == wanted:
                        _die({"fetched": fetched[0] if wanted == 1 else fetched})

            carriers.inject(fetch_then_die)
        _gather(report, ranks, timeout=TIMEOUT)
    elif case == "workspace_rounds":
        if os.environ.get("DU_AWAIT_LIVE_NAMESPACE"):
            report["other_live_namespace"] = _await_live_namespace(os.environ["DU_WORKSPACE"])
        wrong: list[str] = []
        for i in range(int(os.environ.get("DU_ROUNDS", "20"))):
            order = ranks[i % world :] + ranks[: i % world]  # every rank receives in turn
            elements = 1000 + 997 * (i % 7)  # sizes change every round
            round_report: dict[str, Any] = {}
            _gather(
                round_report,
                order,
                elements=elements,
                transport="workspace",
                workspace_path=os.environ["DU_WORKSPACE"],
                timeout=30,
            )
            if round_report["outcome"] != "ok":
                wrong.append(f"round {i}: {round_report['message']}")
            wrong += [f"round {i}: {w}" for w in round_report.get("wrong", [])]
        report["outcome"] = "ok" if not wrong else "error"
        report["wrong"] = wrong
        if os.environ.get("DU_DONE_FILE"):  # tell the other job that this one is done
            open(os.environ["DU_DONE_FILE"], "a").close()
        if os.environ.get("DU_HOLD_UNTIL"):  # keep this job's namespace live until the other job is done
            _await_file(os.environ["DU_HOLD_UNTIL"])
    elif case == "shm_fallback":
        elements = int(os.environ.get("DU_PER_RANK_MIB", "32")) * 2**20 // 4
        handler = _Warnings()
        logging.getLogger("distribute_utils").addHandler(handler)
        _gather(report, ranks, elements=elements, workspace_path=os.environ["DU_WORKSPACE"], timeout=60)
        report["warnings"] = handler.messages
        dist.barrier()
        report["shm_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
    elif case == "workspace_full_ro":
        for key, env in (("full", "DU_FULL_WS"), ("ro", "DU_RO_WS")):
            sub: dict[str, Any] = {}
            # 1 MiB per rank: more than the 1 MiB tmpfs of the "full" workspace can take.
            _gather(
                sub, ranks, transport="workspace", workspace_path=os.environ[env], timeout=30, elements=2**18
            )
            dist.barrier()
            sub["left"] = _payload_files(os.environ[env])  # owner records stay until exit
            report[key] = sub
    else:
        raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    case = sys.argv[1]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if "DU_STORE_PORT" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(
            "127.0.0.1",
            int(os.environ["DU_STORE_PORT"]),
            world,
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    elif "DU_STORE_ON_RANK0" in os.environ:  # as mp.spawn / env:// jobs start: rank 0 hosts the store
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    else:  # under torchrun
        dist.init_process_group("gloo")
    report: dict[str, Any] = {"rank": dist.get_rank(), "pid": os.getpid(), "case": case}
    run_case(case, report)
    if "DU_STORE_ON_RANK0" in os.environ:  # the store is gone with rank 0: a later call must say so at once
        later: dict[str, Any] = {}
        _gather(later, [r for r in range(dist.get_world_size()) if r != 0], timeout=TIMEOUT)
        report["later"] = later
    _write(f"rank{dist.get_rank()}.json", report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
