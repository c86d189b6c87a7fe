"""Tests of scripts/simulate_nodes.py: simulated hosts on one machine, with and without sshfs.

Need root, unshare, and for the sshfs cases sshfs + sshd (``.ci/system-deps.sh``); skipped
with the reason otherwise. Each 2 x 2 torchrun job costs ~7 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "simulate_nodes.py"
JOB = ROOT / "tests" / "jobs" / "check_nodes_job.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_nodes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("simulate_nodes", module)
    spec.loader.exec_module(module)
    return module


sn = _load()
REASON = sn.require_simulation_support("dir")
SSHFS_REASON = sn.require_simulation_support("sshfs")
needs_ns = pytest.mark.skipif(REASON is not None, reason=f"simulated nodes unavailable: {REASON}")
needs_sshfs = pytest.mark.skipif(
    SSHFS_REASON is not None, reason=f"sshfs workspace unavailable: {SSHFS_REASON}"
)
pytestmark = pytest.mark.root


def _processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes (not zombies) containing any of ``needles``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        cmd = sn.cmdline(int(entry))
        if cmd and sn.pid_alive(int(entry)) and any(n in cmd for n in needles):
            found.append(f"{entry}: {cmd[:300]}")
    return found


def _assert_nothing_left(result: sn.SimulationResult, *needles: str) -> None:
    """No process, mount or temporary directory of the run survives it."""
    run_dir = str(result.run_dir)
    assert not Path(run_dir).exists(), f"run dir {run_dir} was not removed"
    alive = [pid for pid in result.pids if sn.pid_alive(pid)]
    assert not alive, f"started processes still alive: {alive}"
    assert not _processes_mentioning(run_dir, *needles)
    assert not sn.find_mounts_anywhere(run_dir)
    with open("/proc/mounts", encoding="utf-8") as fh:
        assert run_dir not in fh.read()


def _summary(result: sn.SimulationResult) -> dict[str, object]:
    for line in result.nodes[0].output.splitlines():
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY ") :])
    raise AssertionError("no SUMMARY line from rank 0:\n" + result.format_outputs())


def _check_job(workspace: str, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    backing = tmp_path / "backing"
    backing.mkdir()
    result = sn.run_simulated(
        JOB,
        ["--token", token, "--expect-nodes", "2", "--expect-nproc", "2"],
        nodes=2,
        nproc_per_node=2,
        workspace=workspace,
        shm_size="64m",
        timeout=90,
        backing_dir=backing,
    )
    assert result.returncode == 0, result.format_outputs()
    summary = _summary(result)
    assert summary["errors"] == []
    infos = summary["infos"]
    assert isinstance(infos, list) and len(infos) == 4
    hosts = {(i["node"], i["host"]) for i in infos}
    assert hosts == {(0, "simnode0"), (1, "simnode1")}
    shm = {i["node"]: set() for i in infos}
    for i in infos:
        shm[i["node"]].add(i["shm_dev"])
    assert all(len(devs) == 1 for devs in shm.values()) and shm[0] != shm[1]
    assert [i["marker_visible"] for i in infos] == [i["node"] == 0 for i in infos]
    assert {i["workspace"] for i in infos} == {result.workspace_path}
    # The job removed its files: the backing directory (kept, ours) is empty again.
    assert result.leftovers == [] and list(backing.iterdir()) == []
    _assert_nothing_left(result, token)


@needs_ns
def test_two_nodes_dir_workspace(tmp_path: Path) -> None:
    """Hostnames and /dev/shm are per node; a plain directory is shared by all nodes."""
    _check_job("dir", tmp_path)


@needs_sshfs
def test_two_nodes_sshfs_workspace(tmp_path: Path) -> None:
    """Same through sshfs: each node mounts the export separately; nothing stays mounted."""
    _check_job("sshfs", tmp_path)


HANG = """\
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # worst case: only SIGKILL stops it
ws = os.environ["DU_WORKSPACE"]
fh = open(os.path.join(ws, "started-" + os.environ["RANK"]), "w")  # held open on the mount
fh.write("x")
fh.flush()
time.sleep(1e6)
"""


@needs_sshfs
def test_timeout_kills_hanging_job(tmp_path: Path) -> None:
    """A job that hangs (and ignores SIGTERM) is killed at the timeout; nothing survives."""
    script = tmp_path / f"hang_{uuid.uuid4().hex}.py"
    script.write_text(HANG)
    backing = tmp_path / "backing"
    backing.mkdir()
    timeout, grace = 8.0, 2.0
    t0 = time.monotonic()
    result = sn.run_simulated(
        script,
        nodes=2,
        nproc_per_node=2,
        workspace="sshfs",
        timeout=timeout,
        backing_dir=backing,
        kill_grace=grace,
    )
    elapsed = time.monotonic() - t0
    assert result.timed_out and result.returncode == sn.TIMEOUT_RETURNCODE, result.format_outputs()
    assert elapsed < timeout + grace + 4, f"took {elapsed:.1f} s"
    # The workers had started (each holds a file open on its node's mount) when they were killed.
    assert result.leftovers and set(result.leftovers) <= {f"started-{r}" for r in range(4)}, (
        result.format_outputs()
    )
    _assert_nothing_left(result, script.name)


@needs_ns
def test_cli_reports_failure_per_node(tmp_path: Path) -> None:
    """The CLI prefixes output with [node i], reports exit codes and fails if one node fails."""
    script = tmp_path / "fail_on_node1.py"
    script.write_text(
        "import os, sys\nprint('hello from', os.uname().nodename)\nsys.exit(int(os.environ['DU_SIM_NODE']) * 3)\n"
    )
    cli = [sys.executable, str(SCRIPT), "--nodes", "2", "--workspace", "none", "--timeout", "60"]
    cli += ["--fail-grace", "1", "--kill-grace", "2"]
    proc = subprocess.run(
        [*cli, "--", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr  # torchrun's code for a failed worker
    assert "[node 0] hello from simnode0" in out and "[node 1] hello from simnode1" in out
    assert "[node 1] exit code 1" in out
    # Node 0's torchrun then waits in its exit barrier for node 1: stopped after --fail-grace.
    assert "[node 0] exit code " in out
    assert not _processes_mentioning(script.name)


@needs_sshfs
def test_sshfs_attribute_cache_serves_stale_size(tmp_path: Path) -> None:
    """Documents the NFS-like hazard the workspace transport must survive (docs/simulated-nodes.md).

    Through mount B, a name that B has already looked up keeps its old size for ~20 s after it was
    deleted and recreated larger through mount A; reading it returns the NEW bytes truncated to the
    OLD size. A name B never looked up is exact at once, but B's cached listing misses it.
    """
    export = tmp_path / "export"
    export.mkdir()
    with (
        sn.sshfs_server(export, workdir=tmp_path) as endpoint,
        sn.sshfs_mount(endpoint, tmp_path / "a") as mount_a,
        sn.sshfs_mount(endpoint, tmp_path / "b") as mount_b,
    ):
        old, new = b"o" * 10, b"n" * 100
        Path(mount_a, "reused").write_bytes(old)
        assert Path(mount_b, "reused").stat().st_size == len(old)  # B caches the attributes
        Path(mount_a, "reused").unlink()
        Path(mount_a, "reused").write_bytes(new)
        stale_size = Path(mount_b, "reused").stat().st_size
        data = Path(mount_b, "reused").read_bytes()
        assert stale_size == len(old), f"sshfs no longer serves stale sizes ({stale_size}); update the docs"
        assert data == new[: len(data)], "content is never mixed, only truncated"
        print(f"stale size {stale_size}, first read {len(data)} of {len(new)} bytes")

        listed = os.listdir(mount_b)  # B now caches the directory listing (~20 s)
        Path(mount_a, "fresh-name").write_bytes(new)  # the remedy: a name never seen before
        assert "fresh-name" not in listed
        stale_listing = "fresh-name" not in os.listdir(mount_b)
        assert Path(mount_b, "fresh-name").stat().st_size == len(new)  # direct lookups are exact
        assert Path(mount_b, "fresh-name").read_bytes() == new
        assert stale_listing, "sshfs no longer caches listings; update docs/simulated-nodes.md"
    assert not sn.find_mounts_anywhere(str(tmp_path))
    assert not _processes_mentioning(str(tmp_path))
