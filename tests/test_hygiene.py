"""``doctor`` and ``clean`` (distribute_utils.hygiene), run directly on real leftovers.

A dead job and a live job are real processes: each opens a workspace namespace and publishes
a payload there; the dead one then SIGKILLs itself, the live one waits. Their segments sit in
a private shared-memory directory of the test (``shm_dir``), so other jobs on the machine are
never looked at, let alone removed. Root-only tests use a private mount namespace: a 16 MiB
``/dev/shm`` and a read-only workspace for ``doctor``, and real segments of a killed and a
live process in a private ``/dev/shm`` for ``clean``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from distribute_utils import hygiene
from distribute_utils.transports.namespace import NAMESPACE_PREFIX

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a private mount namespace",
)

_JOB = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from distribute_utils import wire
    from distribute_utils.transports.workspace import WorkspaceTransport

    workspace, token, mode = sys.argv[1:4]
    tr = WorkspaceTransport(workspace, token, 5.0)
    tr.publish("r0und", 1, wire.encode(torch.ones(1000), checksum=True))
    print(os.getpid(), flush=True)
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # live until the test closes stdin
    tr.release("r0und", 1)
    tr.close()
    """
)


@dataclass
class Scene:
    """A workspace and a shared-memory directory holding a dead and a live job's leftovers."""

    workspace: Path
    shm_dir: Path
    live: subprocess.Popen
    dead_pid: int
    dead_ns: Path
    live_ns: Path
    dead_segment: Path
    live_segment: Path
    foreign: Path


def _start(workspace: Path, token: str, mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _JOB, str(workspace), token, mode],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    return proc, pid


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    workspace, shm_dir = tmp_path / "ws", tmp_path / "shm"
    workspace.mkdir()
    shm_dir.mkdir()
    dead, dead_pid = _start(workspace, "deadjob", "die")
    assert dead.wait(30) == -signal.SIGKILL
    live, live_pid = _start(workspace, "livejob", "live")
    try:
        segments = []
        for pid, size in ((dead_pid, 3 * 2**20), (live_pid, 2**20)):
            path = shm_dir / f"du_{os.urandom(8).hex()}_1_{pid}"
            with open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600), "wb") as f:
                f.truncate(size)
            segments.append(path)
        foreign = shm_dir / "du_not_one_of_ours"
        foreign.write_bytes(b"x")
        yield Scene(
            workspace,
            shm_dir,
            live,
            dead_pid,
            workspace / f"{NAMESPACE_PREFIX}deadjob",
            workspace / f"{NAMESPACE_PREFIX}livejob",
            segments[0],
            segments[1],
            foreign,
        )
    finally:
        live.communicate("", timeout=30)


def test_doctor_reports_what_is_there(scene: Scene) -> None:
    out = io.StringIO()
    code = hygiene.doctor(str(scene.workspace), out, shm_dir=str(scene.shm_dir))
    text = out.getvalue()
    assert code == 0, text
    assert "torch 2." in text and "gloo yes" in text and "CUDA:" in text
    assert f"{scene.shm_dir}: size" in text and "free, writable" in text
    assert f"{scene.dead_segment.name}  3.0 MiB  owner pid {scene.dead_pid} dead  -> stale" in text
    assert f"{scene.live_segment.name}  1.0 MiB  owner pid {scene.live.pid} alive\n" in text
    assert "du_not_one_of_ours  1 B  not a distribute_utils name: left alone" in text
    assert f"workspace {scene.workspace}: " in text and "writable; round trip of 1.0 MiB" in text
    assert "namespaces in the workspace: 2" in text
    dead_line = next(line for line in text.splitlines() if "du-job-deadjob" in line)
    assert f"pid {scene.dead_pid} (dead)" in dead_line and "stale: every owner ran on this host" in dead_line
    live_line = next(line for line in text.splitlines() if "du-job-livejob" in line)
    assert f"pid {scene.live.pid} (alive)" in live_line and "stale" not in live_line
    assert "result: ok (2 stale leftover(s)" in text
    # doctor changes nothing: its own probe namespace is gone, the leftovers are still there
    assert sorted(
        p.name for p in scene.workspace.iterdir() if p.is_dir() and not p.name.startswith(".du-")
    ) == [
        scene.dead_ns.name,
        scene.live_ns.name,
    ]
    assert scene.dead_segment.exists() and scene.dead_ns.exists()


def test_clean_removes_dead_jobs_leftovers_only(scene: Scene) -> None:
    out = io.StringIO()
    assert hygiene.clean(str(scene.workspace), True, out, shm_dir=str(scene.shm_dir)) == 0
    text = out.getvalue()
    assert f"would remove {scene.dead_segment} (3.0 MiB, owner pid {scene.dead_pid} has exited)" in text
    assert f"would remove namespace {scene.dead_ns}: every owner ran on this host and has exited" in text
    assert "would remove 1 segment(s) (3.0 MiB), kept 1 of live processes" in text
    assert scene.dead_segment.exists() and scene.dead_ns.exists(), "a dry run removes nothing"

    out = io.StringIO()
    assert hygiene.clean(str(scene.workspace), False, out, shm_dir=str(scene.shm_dir)) == 0
    text = out.getvalue()
    assert f"removed {scene.dead_segment}" in text and f"removed namespace {scene.dead_ns}" in text
    assert (
        "clean: removed 1 segment(s) (3.0 MiB), kept 1 of live processes; "
        "removed 0 payload file(s) on local disk (0 B), kept 0 of live processes; "
        "removed 0 temporary file(s); removed 0 socket(s); "
        "removed 1 namespace(s)" in text
    )
    assert not scene.dead_segment.exists() and not scene.dead_ns.exists()
    assert scene.live_segment.exists() and scene.foreign.exists(), "live and unknown segments are kept"
    live_files = sorted(p.name for p in scene.live_ns.iterdir())
    assert "r0und_1.du" in live_files and any(n.startswith("owner-") for n in live_files), live_files

    out = io.StringIO()  # nothing left to do: idempotent
    assert hygiene.clean(str(scene.workspace), False, out, shm_dir=str(scene.shm_dir)) == 0
    assert "removed 0 segment(s)" in out.getvalue() and "removed 0 namespace(s)" in out.getvalue()


def test_doctor_and_clean_name_unusable_paths(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    for workspace, expected in (
        (a_file, f"workspace {a_file} is not a directory"),
        (tmp_path / "no" / "ws", f"workspace {tmp_path / 'no' / 'ws'} does not exist and cannot be created"),
    ):
        out = io.StringIO()
        assert hygiene.doctor(str(workspace), out, shm_dir=str(shm_dir)) == 1
        assert expected in out.getvalue() and "result: 1 problem(s)" in out.getvalue(), out.getvalue()
        out = io.StringIO()
        assert hygiene.clean(str(workspace), False, out, shm_dir=str(shm_dir)) == 1
        assert "is not a directory: no namespace to sweep" in out.getvalue()
    out = io.StringIO()
    assert hygiene.doctor(None, out, shm_dir=str(tmp_path / "missing")) == 1
    assert f"{tmp_path / 'missing'} does not exist" in out.getvalue()
    out = io.StringIO()  # a workspace that does not exist yet but can be: a note, not a problem
    assert hygiene.doctor(str(tmp_path / "new"), out, shm_dir=str(shm_dir)) == 0
    assert "does not exist yet; the first gather creates it" in out.getvalue()
    assert not (tmp_path / "new").exists(), "doctor creates nothing"


_IN_NAMESPACE = textwrap.dedent(
    """
    import io, json, os, signal, sys, time
    import torch
    from distribute_utils import hygiene, wire
    from distribute_utils.transports.shm import SharedMemoryTransport

    ro = sys.argv[1]
    report = {}

    # Real segments in this private /dev/shm: one of a process that is then SIGKILLed, one of
    # a live process. (Forked before this process runs any torch operation.)
    children = {}
    for mode in ("die", "live"):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            SharedMemoryTransport().publish("ab" * 8, 1, wire.encode(torch.ones(2**18)))
            os.write(write, b"x")
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
            os._exit(0)
        os.close(write)
        os.read(read, 1)
        children[mode] = pid
    os.waitpid(children["die"], 0)
    report["before"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
    out = io.StringIO()
    report["clean_code"] = hygiene.clean(None, False, out)
    report["clean"] = out.getvalue()
    report["after"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
    report["children"] = children
    out = io.StringIO()
    report["doctor_code"] = hygiene.doctor(ro, out)
    report["doctor"] = out.getvalue()
    os.kill(children["live"], signal.SIGKILL)
    os.waitpid(children["live"], 0)
    print(json.dumps(report))
    """
)


@needs_root
def test_doctor_small_shm_and_read_only_workspace_clean_real_segments(tmp_path: Path) -> None:
    script = tmp_path / "inside.py"
    script.write_text(_IN_NAMESPACE)
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    shell = (
        "mount --make-rprivate / && mount -t tmpfs -o size=16m,mode=1777 tmpfs /dev/shm && "
        f"mount --bind {src} {ro} && mount -o remount,bind,ro {ro} && exec {sys.executable} {script} {ro}"
    )
    proc = subprocess.run(
        # A private pid namespace too: if anything hangs, killing unshare takes every process along.
        ["unshare", "--mount", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", shell],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    doctor = report["doctor"]
    assert report["doctor_code"] == 1, doctor
    assert "/dev/shm: size 16.0 MiB" in doctor
    assert "less than 64.0 MiB: gathers of larger payloads fail with SpaceError" in doctor
    assert "workspace round trip failed" in doctor and "Read-only file system" in doctor and str(ro) in doctor
    assert "result: 2 problem(s)" in doctor
    assert f"du_{'ab' * 8}_1_{report['children']['live']}  1.0 MiB  owner pid" in doctor
    dead, live = report["children"]["die"], report["children"]["live"]
    assert sorted(int(n.rsplit("_", 1)[-1]) for n in report["before"]) == sorted([dead, live])
    assert report["clean_code"] == 0, report["clean"]
    assert f"owner pid {dead} has exited" in report["clean"]
    assert report["after"] == [f"du_{'ab' * 8}_1_{live}"], report


def test_find_segments_parses_names(tmp_path: Path) -> None:
    (tmp_path / "du_0123456789abcdef_3_1").write_bytes(b"abc")  # pid 1 always runs
    (tmp_path / "du_zz_3_4").write_bytes(b"")
    (tmp_path / "sem.mp-x").write_bytes(b"")
    (tmp_path / "du_dir").mkdir()
    found = hygiene.find_segments(str(tmp_path))
    assert [(s.name, s.pid, s.alive, s.size) for s in found] == [
        ("du_0123456789abcdef_3_1", 1, True, 3),
        ("du_zz_3_4", None, None, 0),
    ]
    assert hygiene.find_segments(str(tmp_path / "missing")) == []


def _doctor_with(tmp_path: Path, resolv: str, hosts_extra: str = "") -> dict:
    """``distribute-utils doctor --json`` in a private mount namespace whose /etc/resolv.conf (and
    /etc/hosts) are the given ones."""
    conf, hosts = tmp_path / "resolv.conf", tmp_path / "hosts"
    conf.write_text(resolv)
    hosts.write_text(Path("/etc/hosts").read_text() + hosts_extra)
    shell = (
        f"mount --bind {conf} /etc/resolv.conf && mount --bind {hosts} /etc/hosts && "
        f"exec {sys.executable} -m distribute_utils doctor --json"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", shell], capture_output=True, text=True, timeout=120
    )
    return json.loads(proc.stdout)


@needs_root
def test_doctor_names_a_resolver_that_makes_store_connections_wait(tmp_path: Path) -> None:
    """torch's store looks up the name of each connecting local address (::ffff:127.0.0.1); a DNS server
    that does not answer makes every connection wait its timeout (here 1 s: an address nothing answers
    on). doctor says so and what to do; with the address in /etc/hosts nothing leaves the host."""
    silent = "nameserver 192.0.2.1\noptions timeout:1 attempts:1\n"  # (TEST-NET-1: never answers)
    slow = _doctor_with(tmp_path, silent)
    assert slow["store"]["lookup_answered_by"] == "dns", slow["store"]
    warning = next(w for w in slow["warnings"] if "store connection" in w)  # (slow, not failing: exit 0)
    assert "'::ffff:127.0.0.1 localhost' to /etc/hosts" in warning, warning
    assert not [p for p in slow["problems"] if "store" in p], slow["problems"]
    fixed = _doctor_with(tmp_path, silent, "::ffff:127.0.0.1 localhost\n")
    assert fixed["store"]["lookup_answered_by"] == "hosts_file", fixed["store"]
    assert max(fixed["store"]["lookups_s"] + fixed["store"]["connects_s"]) < 0.5, fixed["store"]
    assert fixed["warnings"] == [], fixed["warnings"]
