#!/usr/bin/env python3
"""Run a torchrun job as several simulated hosts ("nodes") on one machine.

Each node is one ``torchrun --nnodes K --node-rank i`` inside its own IPC, mount, UTS and PID
namespaces (``unshare``), with a private tmpfs on ``/dev/shm`` and hostname ``simnode{i}``, so
POSIX shared memory made on one node is invisible on the others, exactly as on separate hosts.
The nodes still share the network (gloo over ``lo``) and, optionally, a workspace directory:

* ``none``: no shared directory;
* ``dir``: a plain directory on the host, shared by all nodes (a perfectly coherent "NFS");
* ``sshfs``: a private ``sshd`` on 127.0.0.1 exports a directory over SFTP and *each node mounts
  it separately* with sshfs (FUSE), default caches on, which reproduces the attribute-cache
  hazards of a real network filesystem (NFS): a name deleted and recreated through one mount may
  show its old size through another mount for a while.

The job sees the workspace path in ``DU_WORKSPACE`` (same string on every node) and its node
index in ``DU_SIM_NODE``. Needs root (namespaces, mounts); see ``require_simulation_support``.

Command line::

    python scripts/simulate_nodes.py --nodes 2 --nproc-per-node 2 --workspace sshfs -- job.py --arg

Python::

    result = run_simulated("job.py", ["--arg"], nodes=2, nproc_per_node=2, workspace="sshfs")
    assert result.returncode == 0, result.format_outputs()

Everything started (sshd, sshfs, unshare, torchrun and its workers) is stopped by PID or by
tearing down its PID namespace, also on timeout, Ctrl-C or an exception; nothing stays mounted.
Internally the script re-executes itself as ``--node-agent SPEC`` inside each namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TextIO

log = logging.getLogger("simulate_nodes")

WORKSPACE_MODES = ("none", "dir", "sshfs")
TIMEOUT_RETURNCODE = 124
"""Return code of a simulation stopped by its timeout (as ``timeout(1)``)."""

_NODE_AGENT_FLAG = "--node-agent"
_SHM_SIZE_RE = re.compile(r"^[0-9]+[kKmMgG%]?$")
_PR_SET_PDEATHSIG = 1

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _libc = None
    _prctl = None


def _die_with_parent() -> None:
    """``preexec_fn``: SIGKILL the child when the thread that started it dies (PR_SET_PDEATHSIG).

    This is what cleans up when the controller itself is SIGKILLed: sshd and every ``unshare``
    die, and ``unshare --kill-child --pid`` takes its whole PID namespace with it.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


# --------------------------------------------------------------------------- support checks


def _find_program(name: str) -> str | None:
    """Absolute path of ``name`` on PATH or in the sbin directories (sshd lives in /usr/sbin)."""
    extra = os.pathsep.join(("/usr/local/sbin", "/usr/sbin", "/sbin"))
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + extra)


@functools.cache
def _namespace_probe() -> str | None:
    """Check once that ``unshare`` can really create the namespaces (fails in unprivileged containers)."""
    unshare = _find_program("unshare")
    if unshare is None:
        return "unshare (util-linux) is not installed"
    cmd = [unshare, "--ipc", "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
    cmd += ["--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare probe failed: {exc}"
    if proc.returncode != 0:
        return f"unshare cannot create namespaces here: {proc.stderr.strip() or proc.returncode}"
    return None


def require_simulation_support(workspace: str = "sshfs") -> str | None:
    """Return why simulated nodes cannot run here (for ``pytest.mark.skipif``), or None if they can.

    Args:
        workspace: the workspace mode that will be used; ``sshfs`` also needs sshfs, sshd,
            ssh-keygen and ``/dev/fuse``.
    """
    if not sys.platform.startswith("linux"):
        return "simulated nodes need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated nodes need root (unshare, mount); CI runs them as root"
    if workspace not in WORKSPACE_MODES:
        return f"unknown workspace mode {workspace!r}; choose one of {', '.join(WORKSPACE_MODES)}"
    for prog in ("unshare", "mount", "umount"):
        if _find_program(prog) is None:
            return f"{prog} is not installed (util-linux / mount)"
    if workspace == "sshfs":
        for prog, pkg in (("sshfs", "sshfs"), ("sshd", "openssh-server"), ("ssh-keygen", "openssh-client")):
            if _find_program(prog) is None:
                return f"{prog} is not installed (apt-get install {pkg}; see .ci/system-deps.sh)"
        if not os.path.exists("/dev/fuse"):
            return "/dev/fuse is missing (FUSE unavailable; containers need --device /dev/fuse)"
    return _namespace_probe()


# --------------------------------------------------------------------------- process helpers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may contain spaces.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first), found through /proc."""
    tree = _children_map()
    found: list[int] = []
    stack = list(tree.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(tree.get(child, []))
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _stop_process(proc: subprocess.Popen[bytes], grace: float, group: bool = False) -> None:
    """SIGTERM ``proc`` (its process group if ``group``), wait ``grace`` s, then SIGKILL; reap it."""
    if proc.poll() is None:
        log.debug("stopping pid %d (group=%s)", proc.pid, group)
        _send(proc, signal.SIGTERM, group)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.1f s; sending SIGKILL", proc.pid, grace)
            _send(proc, signal.SIGKILL, group)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(grace, 5.0))


def _send(proc: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    """Send ``sig`` to a still-unreaped child (its group if it leads one), never to a reused PID."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def _run_quiet(cmd: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a short helper command, capturing its output."""
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)


# --------------------------------------------------------------------------- mounts


def _unescape_mount_field(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str]]:
    """``(mount point, fs type, source)`` of every mount in a mountinfo file."""
    rows: list[tuple[str, str, str]] = []
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return rows
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 2:
            rows.append((_unescape_mount_field(fields[4]), tail[0], _unescape_mount_field(tail[1])))
    return rows


def _is_mounted(mountpoint: str, fstype_prefix: str = "") -> bool:
    return any(mp == mountpoint and fs.startswith(fstype_prefix) for mp, fs, _ in mounts())


def find_mounts_anywhere(needle: str) -> list[str]:
    """Mounts in ANY mount namespace whose mount point or source contains ``needle``.

    Scans ``/proc/*/mountinfo`` so it also sees mounts inside the nodes' private namespaces
    (as long as a process keeps one alive). Returns ``"pid: mountpoint fstype source"`` lines.
    """
    found: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for row in mounts(f"/proc/{entry}/mountinfo"):
            if (needle in row[0] or needle in row[2]) and row not in seen:
                seen.add(row)
                found.append(f"{entry}: {' '.join(row)}")
    return found


def _unmount(mountpoint: str) -> None:
    """Unmount a FUSE mount: fusermount3/fusermount ``-u``, then a lazy ``umount -l``."""
    attempts: list[list[str]] = []
    for prog in ("fusermount3", "fusermount"):
        path = _find_program(prog)
        if path:
            attempts.append([path, "-u", mountpoint])
    attempts.append([_find_program("umount") or "umount", "-l", mountpoint])
    for cmd in attempts:
        if not _is_mounted(mountpoint):
            return
        try:
            proc = _run_quiet(cmd, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("%s failed: %s", cmd[0], exc)
            continue
        if proc.returncode != 0:
            log.debug("%s: %s", " ".join(cmd), proc.stderr.strip())
    if _is_mounted(mountpoint):
        log.error("could not unmount %s", mountpoint)


# --------------------------------------------------------------------------- sshd + sshfs


@dataclasses.dataclass(frozen=True)
class SshEndpoint:
    """A private sshd exporting ``export_dir`` over SFTP to root@127.0.0.1:``port``."""

    port: int
    identity_file: str
    export_dir: str
    sshd_pid: int


_SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port {port}
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UseDNS no
PrintMotd no
AllowTcpForwarding no
X11Forwarding no
PermitTTY no
MaxStartups 64:30:128
LogLevel ERROR
Subsystem sftp internal-sftp
ForceCommand internal-sftp
"""


def _keygen(path: Path) -> None:
    keygen = _find_program("ssh-keygen")
    if keygen is None:
        raise FileNotFoundError("ssh-keygen is not installed (openssh-client)")
    proc = _run_quiet([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "simulate_nodes", "-f", str(path)])
    if proc.returncode != 0:
        raise RuntimeError(f"ssh-keygen failed for '{path}': {proc.stderr.strip()}")


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float, log_file: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sshd exited with code {proc.returncode} before listening on 127.0.0.1:{port}: "
                f"{log_file.read_text(errors='replace').strip()}"
            )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"sshd did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


@contextlib.contextmanager
def sshfs_server(
    export_dir: str | os.PathLike[str],
    port: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> Iterator[SshEndpoint]:
    """Start a private sshd that exports ``export_dir``; stop it (and its sessions) on exit.

    Fresh ed25519 host and client keys are made in a new temporary directory (inside ``workdir``
    if given), removed afterwards. The key only allows SFTP (``ForceCommand internal-sftp``)
    and sshd listens on 127.0.0.1 only.
    """
    sshd = _find_program("sshd")
    if sshd is None:
        raise FileNotFoundError("sshd is not installed (apt-get install openssh-server)")
    export = str(Path(export_dir).resolve())
    if not os.path.isdir(export):
        raise NotADirectoryError(f"export directory '{export}' does not exist")
    # sshd refuses to start without its privilege-separation directory (normally made by systemd).
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    keydir = Path(tempfile.mkdtemp(prefix="du-simnodes-ssh-", dir=workdir))
    proc: subprocess.Popen[bytes] | None = None
    try:
        host_key, client_key = keydir / "host_ed25519", keydir / "client_ed25519"
        _keygen(host_key)
        _keygen(client_key)
        authorized = keydir / "authorized_keys"
        authorized.write_text("restrict " + (keydir / "client_ed25519.pub").read_text())
        authorized.chmod(0o600)
        port = port or free_port()
        config = keydir / "sshd_config"
        config.write_text(_SSHD_CONFIG.format(port=port, host_key=host_key, authorized_keys=authorized))
        log_file = keydir / "sshd.log"
        with open(log_file, "wb") as log_fh:
            proc = subprocess.Popen(
                [sshd, "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.debug("sshd pid %d on 127.0.0.1:%d exporting %s", proc.pid, port, export)
        _wait_for_port(port, proc, 15.0, log_file)
        yield SshEndpoint(port=port, identity_file=str(client_key), export_dir=export, sshd_pid=proc.pid)
    finally:
        if proc is not None:
            # Per-connection sshd children call setsid(), so they are not in sshd's group: find them first.
            sessions = descendants(proc.pid)
            _stop_process(proc, grace=5.0)
            for pid in sessions:
                _signal_pid(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while any(pid_alive(p) for p in sessions) and time.monotonic() < deadline:
                time.sleep(0.02)
            for pid in sessions:
                if pid_alive(pid):
                    _signal_pid(pid, signal.SIGKILL)
            _stop_ssh_clients(str(keydir))
        shutil.rmtree(keydir, ignore_errors=True)


def _stop_ssh_clients(keydir: str) -> None:
    """Stop ssh clients still using this server's key (sshfs double-forks them to init).

    They normally exit by themselves once their sshfs is unmounted or the server is gone.
    """
    needle = f"IdentityFile={keydir}{os.sep}"
    deadline = time.monotonic() + 5.0
    while True:
        clients = [
            int(e)
            for e in os.listdir("/proc")
            if e.isdigit() and _program(int(e)) == "ssh" and needle in cmdline(int(e))
        ]
        clients = [p for p in clients if pid_alive(p)]
        if not clients:
            return
        sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
        for pid in clients:
            _signal_pid(pid, sig)
        time.sleep(0.05)


def _sshfs_command(endpoint: SshEndpoint, mountpoint: str) -> list[str]:
    sshfs = _find_program("sshfs")
    if sshfs is None:
        raise FileNotFoundError("sshfs is not installed (apt-get install sshfs)")
    options = ",".join(
        (
            f"IdentityFile={endpoint.identity_file}",
            "IdentitiesOnly=yes",
            "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null",
            "BatchMode=yes",
            "LogLevel=ERROR",
        )
    )
    # -f: stay in the foreground so we own its PID. sshfs's default caches stay ON on purpose.
    return [sshfs, "-f", "-F", "/dev/null", "-p", str(endpoint.port), "-o", options]


@contextlib.contextmanager
def sshfs_mount(
    endpoint: SshEndpoint, mountpoint: str | os.PathLike[str], timeout: float = 20.0
) -> Iterator[str]:
    """Mount the endpoint's export at ``mountpoint`` with sshfs (default caching); unmount on exit."""
    target = str(Path(mountpoint).resolve())
    os.makedirs(target, exist_ok=True)
    cmd = [*_sshfs_command(endpoint, target), f"root@127.0.0.1:{endpoint.export_dir}", target]
    log.debug("mounting: %s", " ".join(cmd))
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent
    )
    try:
        deadline = time.monotonic() + timeout
        while not _is_mounted(target, "fuse"):
            if proc.poll() is not None:
                raise RuntimeError(f"sshfs exited with code {proc.returncode} before mounting '{target}'")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sshfs did not mount '{target}' within {timeout:.0f} s")
            time.sleep(0.02)
        yield target
    finally:
        _unmount(target)
        _stop_process(proc, grace=5.0)


# --------------------------------------------------------------------------- node agent


class _Terminate(Exception):
    """Raised in the node agent when it is asked to stop."""


def _node_agent(spec: Mapping[str, object]) -> int:
    """Body of one simulated node; runs as PID 1 of the node's namespaces.

    Mounts a private /dev/shm, sets the hostname, optionally mounts the sshfs workspace, runs
    torchrun, then kills whatever is left in the namespace and unmounts.
    """
    node = int(spec["node"])  # type: ignore[call-overload]
    logging.basicConfig(
        level=str(spec.get("log_level", "WARNING")), format=f"[simnode{node} agent] %(message)s"
    )
    torchrun: subprocess.Popen[bytes] | None = None
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received signal %d; stopping torchrun", signum)
        already = stopping.is_set()
        stopping.set()
        if torchrun is None:
            if not already:
                raise _Terminate(signum)  # still setting up: unwind (unmounts) and exit
        elif torchrun.returncode is None:
            _send(torchrun, signal.SIGTERM, group=True)
        # torchrun already reaped: cleanup is under way, let it finish.

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    try:
        proc = _run_quiet(
            ["mount", "-t", "tmpfs", "-o", f"size={spec['shm_size']},mode=1777", "tmpfs", "/dev/shm"]
        )
        if proc.returncode != 0:
            print(f"cannot mount a private /dev/shm: {proc.stderr.strip()}", file=sys.stderr, flush=True)
            return 2
        hosts_file = spec.get("hosts_file")
        if hosts_file and os.path.exists("/etc/hosts"):
            _run_quiet(["mount", "--bind", str(hosts_file), "/etc/hosts"])
        socket.sethostname(str(spec["hostname"]))
        with contextlib.ExitStack() as stack:
            ssh = spec.get("sshfs")
            if isinstance(ssh, dict):
                endpoint = SshEndpoint(**ssh["endpoint"])
                stack.enter_context(sshfs_mount(endpoint, str(ssh["mountpoint"])))
            stack.callback(_kill_namespace_except_self)
            if stopping.is_set():
                return 128 + int(signal.SIGTERM)
            cmd = [str(c) for c in spec["command"]]  # type: ignore[attr-defined]
            log.info("running %s", " ".join(cmd))
            torchrun = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
            grace, kill_at = float(spec.get("grace", 5.0)), None  # type: ignore[arg-type]
            while (rc := torchrun.poll()) is None:  # poll: a blocking wait() would not see `stopping`
                if stopping.is_set() and kill_at is None:
                    kill_at = time.monotonic() + grace
                if kill_at is not None and time.monotonic() >= kill_at:
                    log.warning("torchrun ignored SIGTERM for %.1f s; killing it", grace)
                    _send(torchrun, signal.SIGKILL, group=True)
                    kill_at = float("inf")
                time.sleep(0.05)
            return rc if rc >= 0 else 128 - rc
    except _Terminate as exc:
        return 128 + int(exc.args[0])
    except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
        print(f"simnode{node}: {exc}", file=sys.stderr, flush=True)
        return 2


def _kill_namespace_except_self() -> None:
    """SIGKILL every process left in this PID namespace except PID 1 and sshfs (unmounted next).

    Only acts as PID 1 of a fresh PID namespace (with its own /proc), never on the host.
    """
    me = os.getpid()
    if me != 1:
        return
    # sshfs double-forks its ssh client, which is therefore a child of PID 1, not of sshfs.
    victims = [
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and int(e) != me and _program(int(e)) not in ("sshfs", "ssh")
    ]
    for pid in victims:
        _signal_pid(pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def cmdline(pid: int) -> str:
    """The command line of ``pid`` with spaces between arguments ("" if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _program(pid: int) -> str:
    """Basename of the program ``pid`` runs ("" if gone)."""
    return os.path.basename(cmdline(pid).split(" ", 1)[0])


# --------------------------------------------------------------------------- controller


@dataclasses.dataclass
class NodeResult:
    """Exit code and combined stdout/stderr of one simulated node."""

    index: int
    returncode: int | None
    output: str


@dataclasses.dataclass
class SimulationResult:
    """Outcome of ``run_simulated``.

    Attributes:
        returncode: 0 if every node succeeded, ``TIMEOUT_RETURNCODE`` on timeout, otherwise the
            first non-zero node exit code.
        nodes: per-node results, in node order.
        backing_dir: the host directory behind the workspace (None for ``workspace="none"``);
            deleted after the run unless the caller passed ``backing_dir``.
        workspace_path: the path the job saw in ``DU_WORKSPACE``.
        leftovers: files and directories left in the backing directory after the job (relative).
        timed_out: whether the run was stopped by the timeout.
        duration: wall time in seconds.
        pids: host PIDs this run started directly (unshare per node, sshd): all gone on return.
        run_dir: the run's temporary directory (keys, mount point), removed on return; every
            helper process (node agents, sshd, sshfs, ssh) has it in its command line.
    """

    returncode: int
    nodes: list[NodeResult]
    backing_dir: Path | None
    workspace_path: str | None
    leftovers: list[str]
    timed_out: bool
    duration: float
    pids: list[int]
    run_dir: Path

    @property
    def outputs(self) -> list[str]:
        """Per-node output, in node order."""
        return [n.output for n in self.nodes]

    def format_outputs(self) -> str:
        """All node outputs, each line prefixed with ``[node i]``; handy in assertion messages."""
        lines = [f"returncode={self.returncode} timed_out={self.timed_out} duration={self.duration:.1f}s"]
        for n in self.nodes:
            lines.append(f"[node {n.index}] exit code {n.returncode}")
            lines.extend(f"[node {n.index}] {line}" for line in n.output.splitlines())
        return "\n".join(lines)


class _OutputPump(threading.Thread):
    """Reads one node's output, keeps it, and optionally echoes it prefixed with ``[node i]``."""

    def __init__(self, index: int, pipe: object, stream: TextIO | None, lock: threading.Lock) -> None:
        super().__init__(name=f"simnode{index}-output", daemon=True)
        self.index, self.pipe, self.stream, self.lock = index, pipe, stream, lock
        self.lines: list[str] = []

    def run(self) -> None:
        for raw in iter(self.pipe.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            if self.stream is not None:
                with self.lock:
                    self.stream.write(f"[node {self.index}] {line}\n")
                    self.stream.flush()


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (tells a PID from a later reuse)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _reap_stale_run_dirs(own: Path) -> None:
    """Remove run directories of earlier runs whose controller died (SIGKILL leaves them behind).

    Only directories with an ``owner`` file naming a dead process and with no mount anywhere.
    """
    for candidate in own.parent.glob("du-simnodes-*"):
        try:
            pid_text, start = (candidate / "owner").read_text().split()
        except (OSError, ValueError):
            continue
        if candidate == own or _start_time(int(pid_text)) == start:
            continue
        if find_mounts_anywhere(str(candidate)):
            log.warning("stale run dir %s still has mounts; leaving it", candidate)
            continue
        log.info("removing stale run dir %s", candidate)
        shutil.rmtree(candidate, ignore_errors=True)


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _hosts_file(path: Path, nodes: int) -> Path:
    """/etc/hosts for the nodes: simnode{i} -> its own loopback address 127.0.x.y (all on lo).

    A distinct address per name makes ``socket.getfqdn()`` (torchrun's error reports) answer
    ``simnode{i}`` rather than ``localhost``, without any DNS lookup.
    """
    try:
        base = Path("/etc/hosts").read_text()
    except OSError:
        base = "127.0.0.1 localhost\n"
    lines = [base.rstrip("\n"), "# simulate_nodes.py"]
    lines += [f"127.0.{1 + i // 254}.{1 + i % 254} simnode{i}" for i in range(nodes)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_simulated(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    nodes: int = 2,
    nproc_per_node: int = 1,
    workspace: str = "dir",
    shm_size: str = "1g",
    timeout: float = 120.0,
    backing_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    stream: TextIO | None = None,
    fail_fast_grace: float = 5.0,
    kill_grace: float = 5.0,
) -> SimulationResult:
    """Run ``script`` under torchrun on ``nodes`` simulated hosts x ``nproc_per_node`` ranks.

    Must be called from the main thread of a root process (children are tied to the calling
    thread's lifetime through PR_SET_PDEATHSIG).

    Args:
        script: the Python file torchrun runs on every rank.
        args: arguments of the script.
        nodes: number of simulated hosts.
        nproc_per_node: ranks per host.
        workspace: ``none``, ``dir`` (a plain shared directory) or ``sshfs`` (each node mounts
            the directory through its own sshfs client).
        shm_size: size of each node's private /dev/shm tmpfs (``mount -o size=``).
        timeout: seconds before every process is stopped; the result then has ``timed_out``.
        backing_dir: host directory behind the workspace; kept afterwards. A temporary one
            (deleted afterwards) when None.
        env: extra environment variables for every node.
        port: torchrun master port; a free one when None.
        stream: if given, node output is echoed there live, lines prefixed with ``[node i]``.
        fail_fast_grace: once one node has failed, seconds the others get to finish before they
            are stopped (a failed rank usually leaves its peers hanging in a collective).
        kill_grace: seconds between SIGTERM and SIGKILL when stopping nodes.
    """
    if workspace not in WORKSPACE_MODES:
        raise ValueError(f"unknown workspace mode {workspace!r}; choose one of {', '.join(WORKSPACE_MODES)}")
    if nodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nodes and nproc_per_node must be >= 1, got {nodes} and {nproc_per_node}")
    if not _SHM_SIZE_RE.match(shm_size):
        raise ValueError(f"shm_size {shm_size!r} is not a tmpfs size such as '64m', '1g' or '50%'")
    reason = require_simulation_support(workspace)
    if reason:
        raise RuntimeError(f"cannot simulate nodes here: {reason}")
    script_path = Path(script).resolve()
    if not script_path.is_file():
        raise FileNotFoundError(f"job script '{script_path}' does not exist")

    start = time.monotonic()
    deadline = start + timeout
    root = Path(tempfile.mkdtemp(prefix="du-simnodes-"))
    (root / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    _reap_stale_run_dirs(root)
    backing: Path | None = None
    own_backing = backing_dir is None
    if workspace != "none":
        backing = Path(backing_dir).resolve() if backing_dir is not None else root / "workspace"
        backing.mkdir(parents=True, exist_ok=True)
    mountpoint = root / "mnt"
    workspace_path = {"none": None, "dir": str(backing), "sshfs": str(mountpoint)}[workspace]

    port = port or free_port()
    node_env = dict(os.environ)
    node_env.update(
        {
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": node_env.get("OMP_NUM_THREADS", "1"),
            "DU_SIM_NODES": str(nodes),
        }
    )
    if workspace_path is not None:
        node_env["DU_WORKSPACE"] = workspace_path
    node_env.update(env or {})

    procs: list[subprocess.Popen[bytes]] = []
    failed: list[int] = []
    pumps: list[_OutputPump] = []
    pids: list[int] = []
    timed_out = False
    lock = threading.Lock()
    unshare = _find_program("unshare") or "unshare"
    try:
        with contextlib.ExitStack() as stack:
            endpoint: SshEndpoint | None = None
            if workspace == "sshfs":
                assert backing is not None
                mountpoint.mkdir()
                endpoint = stack.enter_context(sshfs_server(backing, workdir=root))
                pids.append(endpoint.sshd_pid)
            hosts = _hosts_file(root / "hosts", nodes)
            for i in range(nodes):
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
                torchrun += ["--node-rank", str(i), "--nproc-per-node", str(nproc_per_node)]
                torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
                torchrun += [str(script_path), *map(str, args)]
                spec: dict[str, object] = {
                    "node": i,
                    "hostname": f"simnode{i}",
                    "shm_size": shm_size,
                    "hosts_file": str(hosts),
                    "command": torchrun,
                    "grace": kill_grace / 2,  # the agent must finish before we SIGKILL it
                    "log_level": logging.getLevelName(log.getEffectiveLevel()),
                    "root": str(root),
                    "sshfs": None
                    if endpoint is None
                    else {"endpoint": dataclasses.asdict(endpoint), "mountpoint": str(mountpoint)},
                }
                cmd = [unshare, "--ipc", "--mount", "--uts", "--pid", "--fork", "--kill-child"]
                cmd += ["--mount-proc", "--propagation", "private"]
                cmd += [sys.executable, str(Path(__file__).resolve()), _NODE_AGENT_FLAG, json.dumps(spec)]
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env={**node_env, "DU_SIM_NODE": str(i)},
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
                procs.append(proc)
                pids.append(proc.pid)
                pump = _OutputPump(i, proc.stdout, stream, lock)
                pump.start()
                pumps.append(pump)
            log.debug("started nodes %s (master port %d)", [p.pid for p in procs], port)

            first_failure: float | None = None  # `failed`: nodes in the order they failed on their own
            while [p.poll() for p in procs].count(None):  # poll every node (no short-circuit)
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    log.warning("timeout after %.0f s; stopping all nodes", timeout)
                    break
                failed += [
                    i for i, p in enumerate(procs) if p.returncode not in (None, 0) and i not in failed
                ]
                if first_failure is None and failed:
                    first_failure = now
                if first_failure is not None and now - first_failure > fail_fast_grace:
                    log.warning("a node failed %.0f s ago; stopping the others", fail_fast_grace)
                    break
                time.sleep(0.05)
            _stop_nodes(procs, kill_grace)
            # Sessions and mounts end with the nodes; the ExitStack now stops sshd.
    finally:
        _stop_nodes(procs, kill_grace)
        for pump in pumps:
            pump.join(timeout=5.0)
        leftovers = _leftovers(backing) if backing is not None and backing.exists() else []
        _remove_root(root, backing if own_backing else None)

    results = [
        NodeResult(i, p.returncode, "\n".join(pump.lines))
        for i, (p, pump) in enumerate(zip(procs, pumps, strict=True))
    ]
    if timed_out:
        rc = TIMEOUT_RETURNCODE
    elif failed:  # the node that failed first, not one we stopped afterwards
        rc = results[failed[0]].returncode or 1
    else:
        rc = next((r.returncode or 1 for r in results if r.returncode != 0), 0)
    return SimulationResult(
        returncode=rc,
        nodes=results,
        backing_dir=backing,
        workspace_path=workspace_path,
        leftovers=leftovers,
        timed_out=timed_out,
        duration=time.monotonic() - start,
        pids=pids,
        run_dir=root,
    )


def _stop_nodes(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every live node's process group, then SIGKILL what is left after ``grace`` s.

    A node's group holds ``unshare`` and the node agent (PID 1 of its namespace); SIGKILL of
    ``unshare`` kills the agent (``--kill-child``), whose death empties the PID namespace.
    """
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _send(p, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in live:
        if p.poll() is None:
            log.warning("node pid %d ignored SIGTERM for %.1f s; sending SIGKILL", p.pid, grace)
            _send(p, signal.SIGKILL, group=True)
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10.0)


def _remove_root(root: Path, own_backing: Path | None) -> None:
    """Delete the run's temporary directory, never through a mount (that would delete remote files)."""
    stray = [mp for mp, _, _ in mounts() if mp == str(root) or mp.startswith(str(root) + os.sep)]
    for mp in sorted(stray, reverse=True):
        log.error("unexpected mount left at %s; unmounting", mp)
        _unmount(mp)
    if any(mp.startswith(str(root) + os.sep) for mp, _, _ in mounts()):
        log.error("mounts remain under %s; leaving it in place", root)
        return
    shutil.rmtree(root, ignore_errors=True)
    if own_backing is not None and own_backing.exists():  # pragma: no cover - inside root normally
        shutil.rmtree(own_backing, ignore_errors=True)


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="simulate_nodes.py",
        description="Run SCRIPT under torchrun on K simulated hosts (namespaces) of this machine.",
        usage="%(prog)s --nodes K --nproc-per-node M [options] -- SCRIPT [ARGS...]",
    )
    parser.add_argument("--nodes", type=int, default=2, help="number of simulated hosts (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per host (default 1)")
    parser.add_argument("--workspace", choices=WORKSPACE_MODES, default="dir", help="shared directory kind")
    parser.add_argument("--shm-size", default="1g", help="size of each node's /dev/shm tmpfs (default 1g)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before everything is killed")
    parser.add_argument("--port", type=int, default=None, help="torchrun master port (default: a free one)")
    parser.add_argument(
        "--fail-grace",
        type=float,
        default=5.0,
        metavar="SEC",
        help="once a node has failed, stop the others after SEC seconds (default 5)",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=5.0,
        metavar="SEC",
        help="seconds between SIGTERM and SIGKILL when stopping nodes (default 5)",
    )
    parser.add_argument(
        "--keep-workspace",
        metavar="DIR",
        default=None,
        help="use DIR as the workspace's backing directory and keep it afterwards",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("script", help="the torchrun job script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        ns = parser.parse_args([*argv[:cut], "_"])
        rest = argv[cut + 1 :]
        if not rest:
            parser.error("no SCRIPT after '--'")
        ns.script, ns.args = rest[0], rest[1:]
        return ns
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_NODE_AGENT_FLAG]:
        return _node_agent(json.loads(argv[1]))
    ns = _parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO, format="%(levelname)s %(message)s"
    )
    reason = require_simulation_support(ns.workspace)
    if reason:
        print(f"simulate_nodes: cannot run here: {reason}", file=sys.stderr)
        return 2

    def on_sigterm(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = run_simulated(
            ns.script,
            ns.args,
            nodes=ns.nodes,
            nproc_per_node=ns.nproc_per_node,
            workspace=ns.workspace,
            shm_size=ns.shm_size,
            timeout=ns.timeout,
            backing_dir=ns.keep_workspace,
            port=ns.port,
            stream=sys.stdout,
            fail_fast_grace=ns.fail_grace,
            kill_grace=ns.kill_grace,
        )
    except KeyboardInterrupt:
        print("simulate_nodes: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"simulate_nodes: {exc}", file=sys.stderr)
        return 2
    for node in result.nodes:
        print(f"[node {node.index}] exit code {node.returncode}")
    if result.timed_out:
        print(f"simulate_nodes: timed out after {ns.timeout:.0f} s; all processes killed")
    if result.backing_dir is not None:
        kept = "kept" if ns.keep_workspace else "removed"
        print(f"workspace backing dir: {result.backing_dir} ({kept}); leftovers: {len(result.leftovers)}")
        for name in result.leftovers[:50]:
            print(f"  leftover: {name}")
    print(f"simulate_nodes: exit code {result.returncode} after {result.duration:.1f} s")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
