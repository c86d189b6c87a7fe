"""Internal. Operator checks: what ``distribute-utils doctor`` reports and ``distribute-utils clean`` removes.

``doctor`` looks at everything a gather depends on and says what would make one fail:

- ``/dev/shm``: present, writable, its size and free space. A gather on one host needs room
  for every sender's payload at once; below :data:`SHM_MIN_FREE_BYTES` (64 MiB, Docker's
  default ``--shm-size``) free, doctor reports a problem;
- the files carriers name on this host (each carrier's ``files_on_host``: segments
  ``du_<token>_<rank>_<pid>`` in ``/dev/shm``, payload files on local disk): the owner pid from the
  name, alive or dead in this pid namespace, the size. Files of dead owners are notes, not problems
  (they only take space, which the free-space check sees): ``clean`` removes them;
- the workspace, when given: a directory, writable, its filesystem, free space, and the time
  of one small round trip through :class:`~distribute_utils.transports.WorkspaceTransport`
  (write, ``fsync``, rename, read, checksum), as a gather does it; its job namespaces with
  their owners (alive, dead, or on another host: unknown), age, and whether the next job's
  sweep will remove them;
- torch: version, ``torch.distributed`` and its backends (gloo, nccl, mpi), CUDA;
- store connections: how fast a local ``TCPStore`` takes clients, and the name lookup torch makes for each
  (:mod:`.store_check`): a slow resolver makes launches and barriers wait seconds.

``clean`` removes what dead jobs left, and nothing else: carriers' files whose owner pid does not run
in this pid namespace, and namespaces :func:`~distribute_utils.transports.sweep_stale_namespaces`
judges stale (every owner on this host and exited, or untouched for 24 h with owners
elsewhere). A live job's segments and namespaces are never touched. Caveat: a pid can only be
checked in this pid namespace; if ``/dev/shm`` is shared with containers in other pid
namespaces (``--ipc=host``), run ``clean`` where the jobs ran, or when none is running.

Both write their report to ``out`` and return the exit code (0 ok, 1 problem).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO, cast

from . import host_dir
from .errors import DistributeError
from .processes import SHM_DIR, pid_alive, process_alive, this_process
from .temporaries import RECORD_DIR, find_abandoned, remove_abandoned

if TYPE_CHECKING:
    from .transports.named_files import HostFile

__all__ = [
    "PROBE_BYTES",
    "SHM_MIN_FREE_BYTES",
    "NamespaceInfo",
    "carrier_files",
    "clean",
    "doctor",
    "find_segments",
    "held_unnamed_files",
    "inspect_namespaces",
    "workspace_round_trip",
]

SHM_MIN_FREE_BYTES = 64 * 2**20
"""Free ``/dev/shm`` below which ``doctor`` reports a problem (Docker's default size)."""
PROBE_BYTES = 2**20
"""Size of the payload of ``doctor``'s workspace round trip."""

_SEGMENT_RE = re.compile(r"du_(?P<token>[0-9a-f]+)_(?P<rank>\d+)_(?P<pid>\d+)")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# -- files carriers name on this host ---------------------------------------------------------
def find_segments(shm_dir: str = SHM_DIR) -> list[HostFile]:
    """Every ``du_*`` entry of ``shm_dir``, sorted by name (empty when it does not exist): the
    shared-memory carrier's files (see :func:`carrier_files`)."""
    from .transports.shm import SharedMemoryTransport

    return SharedMemoryTransport.files_on_host(shm_dir)


def carrier_files(shm_dir: str = SHM_DIR) -> list[tuple[str, str, list[HostFile]]]:
    """``(kind, label, files)`` of every carrier that names files on this host (``files_on_host``, see
    :class:`.transports.base.Carrier`), in :data:`.transports.carriers.KINDS` order."""
    from .transports.carriers import KINDS

    found, seen = [], set()
    for kind, cls in KINDS.items():
        listing = getattr(cls, "files_on_host", None)
        if listing is not None and cls not in seen:
            seen.add(cls)
            found.append((kind, cast(str, getattr(cls, "files_label", kind)), listing(shm_dir)))
    return found


# -- namespaces --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NamespaceInfo:
    """One job namespace of a workspace.

    Attributes:
        path: the ``du-job-<token>`` directory.
        age_s: seconds since anything in it last changed.
        owners: ``(who, state)`` per owner record; state is ``"alive"``, ``"dead"`` or
            ``"unknown (another host)"``.
        unreadable: owner records that could not be read.
        stale: why the next sweep (or ``clean``) removes it; None when it is kept.
    """

    path: str
    age_s: float
    owners: tuple[tuple[str, str], ...]
    unreadable: int
    stale: str | None


def inspect_namespaces(workspace: str) -> list[NamespaceInfo]:
    """The job namespaces in ``workspace`` and their owners (reads only)."""
    from .transports import namespace as wsns

    me = this_process()
    now = time.time()
    found = []
    for entry in sorted(os.scandir(workspace), key=lambda e: e.name):
        if not entry.name.startswith(wsns.NAMESPACE_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            records, unreadable, newest = wsns.owner_records(entry.path)
            stale = wsns.judge(entry.path, me, wsns.DEFAULT_SWEEP_AGE_S, now)
        except OSError:
            continue  # removed meanwhile
        owners = []
        for r in records:
            info = wsns.owner_process(r)
            if me.can_watch(info):
                state = "alive" if process_alive(info) else "dead"
            else:
                state = "unknown (another host)"
            owners.append((f"{info.hostname} pid {info.pid}", state))
        found.append(NamespaceInfo(entry.path, now - newest, tuple(owners), unreadable, stale))
    return found


def workspace_round_trip(workspace: str, nbytes: int = PROBE_BYTES, timeout: float = 30.0) -> float:
    """Seconds one payload of ``nbytes`` takes through the workspace, as in a gather.

    Publishes (write, ``fsync``, rename) and fetches (read, length and checksum check) a
    payload in a namespace of its own, then removes it. The workspace must exist.

    Raises:
        WorkspaceError: not a directory or not writable; SpaceError: no room;
        PayloadError: the bytes read back differ from those written.
    """
    import torch

    from . import wire
    from .errors import PayloadError
    from .transports.workspace import WorkspaceTransport

    data = torch.arange(nbytes // 4, dtype=torch.int32)
    payload = wire.encode({"doctor": data}, checksum=True)
    token = secrets.token_hex(8)
    probe = f"doctor-{secrets.token_hex(8)}"  # a namespace no other process knows: no lock needed
    with WorkspaceTransport(workspace, probe, timeout, read_mode="read", lock=False) as tr:
        start = time.perf_counter()
        try:
            tr.publish(token, 0, payload)
            back = cast("dict[str, torch.Tensor]", wire.decode(tr.fetch(token, 0)))
        finally:
            tr.release(token, 0)
        elapsed = time.perf_counter() - start
    if not torch.equal(back["doctor"], data):
        raise PayloadError(f"the round trip through {workspace} returned different bytes")
    return elapsed


# -- doctor ------------------------------------------------------------------------------------
class _Report:
    """Doctor's findings: lines for people, and the same facts in :attr:`data` for ``--json``."""

    def __init__(self, out: TextIO, as_json: bool = False) -> None:
        self.out = out
        self.as_json = as_json
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.data: dict[str, Any] = {
            "problems": self.problems,
            "warnings": self.warnings,
            "notes": self.notes,
        }

    def line(self, text: str = "", indent: int = 1) -> None:
        if not self.as_json:
            self.out.write("  " * indent + text + "\n")

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.line(f"PROBLEM: {text}", 2)

    def warning(self, text: str) -> None:
        """What makes gathers slow, not fail (the exit code stays 0)."""
        self.warnings.append(text)
        self.line(f"SLOW: {text}", 2)

    def note(self, text: str) -> None:
        self.notes.append(text)


def _torch_section(rep: _Report) -> None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        rep.line("torch: not importable")
        rep.problem(f"cannot import torch: {exc}")
        return
    available = dist.is_available()
    backends = []
    if available:
        for name in ("gloo", "nccl", "mpi"):
            check = getattr(dist, f"is_{name}_available", None)
            backends.append(f"{name} {'yes' if check is not None and check() else 'no'}")
    cuda = torch.cuda.is_available()
    rep.data["torch"] = {
        "version": torch.__version__,
        "distributed": available,
        "backends": {b.split()[0]: b.endswith("yes") for b in backends},
        "cuda_devices": torch.cuda.device_count() if cuda else 0,
    }
    rep.line(
        f"torch {torch.__version__}; torch.distributed: {'yes' if available else 'no'}"
        + (f" ({', '.join(backends)})" if backends else "")
        + f"; CUDA: {f'{torch.cuda.device_count()} device(s)' if cuda else 'not available'}"
    )
    if not available:
        rep.problem("torch.distributed is not available in this torch build: gathers cannot run")


def _store_section(rep: _Report) -> None:
    """How fast this host makes the store connections every rank needs (:mod:`.store_check`)."""
    from .store_check import MAPPED_LOOPBACK, SLOW_S, check_store_connections

    found = check_store_connections()
    source = "/etc/hosts" if found.in_hosts_file else "the DNS server (/etc/resolv.conf)"
    rep.data["store"] = {
        "lookups_s": found.lookups,
        "connects_s": found.connects,
        "lookup_answered_by": "hosts_file" if found.in_hosts_file else "dns",
    }
    rep.line(
        f"store connections on 127.0.0.1: {len(found.connects)}, slowest {max(found.connects, default=0) * 1e3:.1f} ms;"
        f" name of a local peer ({MAPPED_LOOPBACK}, looked up by torch's store at each connection): from "
        f"{source}, slowest {max(found.lookups, default=0) * 1e3:.1f} ms of {len(found.lookups)}"
    )
    if found.slowest > SLOW_S:
        rep.warning(
            f"a store connection or its name lookup took {found.slowest:.1f} s: torch's TCPStore looks up the "
            f"name of every connecting address, and {source} is slow to answer for {MAPPED_LOOPBACK}; every "
            "rank's connections (a launch, a new group, a barrier's first use) may wait as long. Fix: add the "
            f"line '{MAPPED_LOOPBACK} localhost' to /etc/hosts (then no lookup leaves the host), or make the DNS "
            "server answer (options timeout:1 in /etc/resolv.conf shortens each wait)"
        )


def _shm_section(rep: _Report, shm_dir: str) -> None:
    rep.data["shm"] = shm = {"path": shm_dir, "exists": os.path.isdir(shm_dir)}
    if not os.path.isdir(shm_dir):
        rep.line(f"{shm_dir}: missing")
        rep.problem(
            f"{shm_dir} does not exist: ranks on one host cannot share memory (pass a workspace_path)"
        )
        return
    st = os.statvfs(shm_dir)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    writable = os.access(shm_dir, os.W_OK | os.X_OK)
    shm.update(size_bytes=size, free_bytes=free, writable=writable)
    rep.line(
        f"{shm_dir}: size {_size(size)}, {_size(free)} free, {'writable' if writable else 'NOT writable'}"
    )
    if not writable:
        rep.problem(f"{shm_dir} is not writable for this user: no segment can be created")
    if free < SHM_MIN_FREE_BYTES:
        rep.problem(
            f"{shm_dir} has {_size(free)} free, less than {_size(SHM_MIN_FREE_BYTES)}: gathers of larger "
            "payloads fail with SpaceError where transport='shm', and go through the local disk "
            "(slower) with transport='auto' (enlarge it, e.g. docker --shm-size)"
        )
    held = held_unnamed_files(shm_dir)
    total = sum(size for _, size in held)
    pids = sorted({pid for pid, _ in held})
    shm["unnamed_held"] = {"files": len(held), "bytes": total, "pids": pids}
    rep.line(
        f"unnamed files held open in {shm_dir} (pooled segments of running gathers, and others'): "
        f"{len(held)}, {_size(total)}" + (f", by pids {pids[:8]}" if pids else "")
    )
    _temporaries_section(rep, shm_dir)


def _carrier_files_section(rep: _Report, shm_dir: str) -> None:
    """The files each carrier named on this host, their owners alive or dead."""
    listed = rep.data["carrier_files"] = {}
    for kind, label, files in carrier_files(shm_dir):
        listed[kind] = [
            {"path": f.path, "bytes": f.size, "owner_pid": f.pid, "alive": f.alive, "stale": f.stale}
            for f in files
        ]
        ours = [f for f in files if f.pid is not None]
        rep.line(f"{label}: {len(ours)}, {_size(sum(f.size for f in ours))}")
        for f in files:
            if f.pid is None:
                rep.line(f"{f.name}  {_size(f.size)}  not a distribute_utils name: left alone", 2)
                continue
            state = "alive" if f.alive else "dead"
            tail = "  -> stale: `distribute-utils clean` removes it" if f.stale else ""
            rep.line(f"{f.name}  {_size(f.size)}  owner pid {f.pid} {state}{tail}", 2)
            if f.stale:
                rep.note(f"stale {kind} file {f.path}")


def _temporaries_section(rep: _Report, shm_dir: str) -> None:
    abandoned = find_abandoned(_record_dir(shm_dir))
    files = [(p, item) for item in abandoned for p in item.paths]
    rep.data["abandoned_temporaries"] = [
        {"path": p, "owner_pid": item.owner.pid, "record": item.record} for p, item in files
    ]
    rep.line(
        f"temporary files of dead consolidations: {len(files)}, {_size(sum(a.nbytes for a in abandoned))}"
    )
    for path, item in files:
        rep.line(f"{path}  owner pid {item.owner.pid} dead  -> stale: `distribute-utils clean` removes it", 2)
        rep.note(f"stale temporary {path}")
    dead: list[str] = []
    try:
        host_dir.check(_record_dir(shm_dir))
        dead = host_dir.dead_sockets(_record_dir(shm_dir))
    except PermissionError as exc:
        rep.line(f"private directory: {exc}; this user's gathers on this host go through the store")
        rep.note(f"unusable private directory {_record_dir(shm_dir)}")
    except OSError:  # not made yet: the first gather makes it
        pass
    rep.data["dead_sockets"] = dead
    rep.line(f"sockets of processes that died: {len(dead)}")
    for path in dead:
        rep.line(f"{path}  nothing listens  -> stale: `distribute-utils clean` removes it", 2)
        rep.note(f"stale socket {path}")


def _record_dir(shm_dir: str) -> str:
    """Where the temporaries records of ``shm_dir``'s host are (see :mod:`.temporaries`)."""
    return os.path.join(shm_dir, os.path.basename(RECORD_DIR))


def held_unnamed_files(shm_dir: str = SHM_DIR) -> list[tuple[int, int]]:
    """``(pid, bytes)`` of every unnamed (or deleted) file in ``shm_dir`` that a process this
    user can inspect holds open: where pooled segments live (they never have a name), so
    ``doctor`` can show the shared memory running jobs keep warm."""
    found = []
    prefix = shm_dir.rstrip("/") + "/"
    for pid_dir in os.listdir("/proc"):
        if not pid_dir.isdigit():
            continue
        fd_dir = f"/proc/{pid_dir}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith(prefix) and target.endswith("(deleted)"):
                    found.append((int(pid_dir), os.stat(f"{fd_dir}/{fd}").st_size))
            except OSError:
                continue
    return found


def _workspace_section(rep: _Report, workspace: str) -> None:
    from .transports import files as wsfiles

    path = os.path.abspath(workspace)
    info: dict[str, Any] = {"path": path}
    rep.data["workspace"] = info
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            rep.line(f"workspace {path}: does not exist yet; the first gather creates it (its parent exists)")
            rep.note(f"workspace {path} does not exist yet")
        else:
            rep.line(f"workspace {path}: missing")
            rep.problem(
                f"workspace {path} does not exist and cannot be created (parent {parent} missing or not "
                "writable): mount the shared directory on every node"
            )
        return
    if not os.path.isdir(path):
        rep.line(f"workspace {path}: not a directory")
        rep.problem(f"workspace {path} is not a directory; pass a directory that every node shares")
        return
    free = wsfiles.free_bytes(path)
    fs = wsfiles.filesystem_type(path)
    info.update(filesystem=fs, free_bytes=free)
    try:
        seconds = workspace_round_trip(path)
        info["round_trip_s"] = seconds
    except (OSError, DistributeError) as exc:
        rep.line(f"workspace {path}: {fs}, {_size(free or 0)} free")
        rep.problem(f"workspace round trip failed: {exc}")
    else:
        rep.line(
            f"workspace {path}: {fs}, {_size(free or 0)} free, writable; round trip of "
            f"{_size(PROBE_BYTES)} (write + fsync + rename + read + checksum): {seconds * 1000:.1f} ms"
        )
    try:
        namespaces = inspect_namespaces(path)
    except OSError as exc:
        rep.problem(f"cannot list workspace {path}: {exc}")
        return
    info["namespaces"] = [
        {
            "path": ns.path,
            "age_s": ns.age_s,
            "owners": [{"process": who, "state": state} for who, state in ns.owners],
            "unreadable_records": ns.unreadable,
            "stale": ns.stale,
        }
        for ns in namespaces
    ]
    rep.line(f"namespaces in the workspace: {len(namespaces)}")
    for ns in namespaces:
        owners = ", ".join(f"{who} ({state})" for who, state in ns.owners) or "no owner record"
        if ns.unreadable:
            owners += f", {ns.unreadable} unreadable record(s)"
        tail = f"  -> stale: {ns.stale}" if ns.stale else ""
        rep.line(f"{os.path.basename(ns.path)}  age {ns.age_s / 3600:.1f} h  owners: {owners}{tail}", 2)
        if ns.stale:
            rep.note(f"stale namespace {ns.path}")


def doctor(workspace: str | None, out: TextIO, *, shm_dir: str = SHM_DIR, as_json: bool = False) -> int:
    """Check what gathers depend on on this host; write the report to ``out``.

    Reads only, apart from a small round trip in a namespace of its own in ``workspace``
    (removed afterwards).

    Args:
        workspace: the workspace directory to check, or None.
        out: where the report goes.
        shm_dir: the shared-memory directory (``/dev/shm``).
        as_json: write one JSON object (the same facts, ``problems``, ``notes``, ``exit_code``) instead.

    Returns:
        0 when nothing would make a gather fail, 1 otherwise (each problem is named).
    """
    rep = _Report(out, as_json)
    rep.line("distribute-utils doctor", 0)
    _torch_section(rep)
    _store_section(rep)
    _shm_section(rep, shm_dir)
    _carrier_files_section(rep, shm_dir)
    if workspace is not None:
        _workspace_section(rep, os.fspath(workspace))
    else:
        rep.line("workspace: none given (pass one to check it)")
    code = 1 if rep.problems else 0
    if rep.problems:
        rep.line(f"result: {len(rep.problems)} problem(s) would make a gather fail:", 0)
        for problem in rep.problems:
            rep.line(f"- {problem}")
    else:
        stale = sum(note.startswith("stale") for note in rep.notes)
        notes = f" ({stale} stale leftover(s): `distribute-utils clean` removes them)" if stale else ""
        rep.line(f"result: ok{notes}", 0)
    for warning in rep.warnings:
        rep.line(f"slow: {warning}", 0)
    if as_json:
        out.write(json.dumps({**rep.data, "exit_code": code}, indent=2) + "\n")
    return code


# -- clean -------------------------------------------------------------------------------------
def clean(
    workspace: str | None, dry_run: bool, out: TextIO, *, shm_dir: str = SHM_DIR, as_json: bool = False
) -> int:
    """Remove what dead jobs left: the files carriers named on this host (segments in ``shm_dir``,
    payload files on local disk: :func:`carrier_files`), dead processes' sockets, the temporary output files of dead
    consolidations (from their records, see :mod:`.temporaries`), and namespaces in ``workspace``.

    Never touches a live process's files or a live job's namespace (see the module doc).

    Args:
        workspace: the workspace directory to sweep, or None for this host only.
        dry_run: only print what would be removed.
        out: where the report goes.
        shm_dir: the shared-memory directory (``/dev/shm``).
        as_json: write one JSON object (``removed``: kind (a carrier's, ``temporary``, ``socket``,
            ``namespace``), path, bytes, reason; ``kept_live_files``;
            ``failures``; ``dry_run``; ``exit_code``) instead of lines.

    Returns:
        0 on success, 1 when something could not be removed or the workspace is unusable.
    """
    from .transports.namespace import sweep_stale_namespaces

    verb = "would remove" if dry_run else "removed"
    removed: list[dict[str, Any]] = []
    failures: list[str] = []

    def done(kind: str, path: str, nbytes: int | None, reason: str) -> None:
        removed.append({"kind": kind, "path": path, "bytes": nbytes, "reason": reason})
        if as_json:
            return
        if nbytes is not None:  # (a carrier's file)
            out.write(f"{verb} {path} ({_size(nbytes)}, {reason})\n")
        else:
            out.write(f"{verb} {kind} {path}: {reason}\n")

    def failed(text: str) -> None:
        failures.append(text)
        if not as_json:
            out.write(text + "\n")

    summary: list[str] = []
    live = 0
    for kind, label, files in carrier_files(shm_dir):
        gone = []
        for f in (f for f in files if f.stale):
            if pid_alive(f.pid or 0):  # started meanwhile (pid reuse): keep it
                continue
            if not dry_run:
                try:
                    os.unlink(f.path)
                except FileNotFoundError:
                    continue  # its reader took it meanwhile
                except OSError as exc:
                    failed(f"could not remove {f.path}: {exc.strerror or exc}")
                    continue
            gone.append(f)
            done(kind, f.path, f.size, f"owner pid {f.pid} has exited")
        kept = sum(1 for f in files if f.alive)
        live += kept
        summary.append(
            f"{verb} {len(gone)} {label} ({_size(sum(f.size for f in gone))}), kept {kept} of live processes"
        )
    for item in find_abandoned(_record_dir(shm_dir)):
        gone_paths = item.paths if dry_run else remove_abandoned(item)
        for path in gone_paths:
            done("temporary", path, None, f"an unfinished output of pid {item.owner.pid}, which has exited")
    record_dir = _record_dir(shm_dir)
    dead: list[str] = []
    try:
        if os.path.lexists(record_dir):
            host_dir.check(record_dir)  # (never act in a directory another user made or can reach)
            dead = host_dir.dead_sockets(record_dir) if dry_run else host_dir.remove_dead_sockets(record_dir)
    except OSError as exc:
        failed(f"not looking for dead sockets: {exc}")
    for path in dead:
        done("socket", path, None, "nothing listens on it: its process has exited")
    summary += [
        f"{verb} {sum(r['kind'] == 'temporary' for r in removed)} temporary file(s)",
        f"{verb} {len(dead)} socket(s)",
    ]
    if workspace is not None and not os.path.isdir(workspace):
        failed(f"workspace {os.path.abspath(workspace)} is not a directory: no namespace to sweep")
    elif workspace is not None:
        try:
            swept = sweep_stale_namespaces(os.fspath(workspace), dry_run=dry_run)
        except (OSError, DistributeError) as exc:
            failed(f"cannot sweep workspace {workspace}: {exc}")
        else:
            for path, reason in swept:  # a namespace it could not remove is logged, not listed
                done("namespace", path, None, reason)
            summary.append(f"{verb} {len(swept)} namespace(s) in {os.path.abspath(workspace)}")
    code = 1 if failures else 0
    if as_json:
        body = {
            "dry_run": dry_run,
            "removed": removed,
            "kept_live_files": live,
            "failures": failures,
            "exit_code": code,
        }
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        tail = f"; {len(failures)} failure(s)" if failures else ""
        out.write("clean: " + "; ".join(summary) + tail + "\n")
    return code
