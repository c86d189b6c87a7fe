"""Safe on a shared machine: what a second, unprivileged local user can do to a job.

As root, the tests act as a second user (``nobody``, uid 65534) in a subprocess, against this
process's transports and a real gather. The worst that user may achieve is to make a gather
fail with an error naming what they planted; never to have their data taken for a rank's.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distribute_utils import PayloadError, WorkspaceError, get_tensors_parallel, host_dir, hygiene, wire
from distribute_utils.transports import namespace as wsns
from distribute_utils.transports import shm
from distribute_utils.transports import workspace as ws

from harness import RankPool, job_leftovers

JOBS = Path(__file__).parent / "jobs"

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as a second user needs root (CI runs as root)"
)


def _as_other_user(script: str, stdin: bytes | None = None) -> None:
    """Run shell ``script`` as the second user (umask 022); fail the test if it fails."""

    def drop() -> None:
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)

    proc = subprocess.run(
        ["/bin/sh", "-c", f"umask 022; {script}"],
        preexec_fn=drop,
        capture_output=True,
        input=stdin,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the second user can reach (pytest's own tree is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="du-shared-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _shared_workspace(base: Path) -> Path:
    """A workspace like /tmp on a shared machine: world-writable, sticky."""
    workspace = base / "shared"
    workspace.mkdir()
    workspace.chmod(0o1777)
    return workspace


@needs_root
def test_another_users_segment_is_never_taken_for_a_ranks() -> None:
    token, rank = "00000000000000f1", 1
    path = shm.segment_path(token, rank, os.getpid())
    forged = wire.encode(torch.full((8,), 666.0)).to_bytes()
    _as_other_user(f"cat > {path}", stdin=forged)  # a valid payload, at the name a rank would use
    try:
        receipt = f"n:{os.getpid()}:{len(forged)}"  # what a forged claim in the store would say
        with pytest.raises(PayloadError, match=r"belongs to uid 65534, not to this job's user"):
            shm.SharedMemoryTransport().fetch(token, rank, receipt)
    finally:
        if os.path.exists(path):
            os.unlink(path)


@needs_root
def test_a_namespace_another_user_made_is_refused(shared_dir: Path) -> None:
    workspace = _shared_workspace(shared_dir)
    token = "predictable-job-1"
    squatted = workspace / f"{wsns.NAMESPACE_PREFIX}{token}"
    _as_other_user(f"mkdir -m 0777 {squatted}")
    with pytest.raises(WorkspaceError) as info:
        ws.WorkspaceTransport(workspace, token, 5.0)
    message = str(info.value)
    assert str(squatted) in message and "belongs to uid 65534 (nobody)" in message, message
    assert "DISTRIBUTE_UTILS_JOB_TOKEN" in message
    assert sorted(os.listdir(squatted)) == [], "nothing of ours was written into it"


@needs_root
@pytest.mark.parametrize("plant", ["directory", "symlink"])
def test_this_users_lock_directory_cannot_be_planted(shared_dir: Path, plant: str) -> None:
    workspace = _shared_workspace(shared_dir)
    target = shared_dir / "victim"
    target.mkdir()
    (target / "sweep.lock").write_text("precious")
    user_dir = wsns.user_dir(str(workspace))
    _as_other_user(f"mkdir -m 0777 {user_dir}" if plant == "directory" else f"ln -s {target} {user_dir}")
    with pytest.raises(WorkspaceError) as info:
        ws.WorkspaceTransport(workspace, "job-2", 5.0)
    expected = "belongs to uid 65534 (nobody)" if plant == "directory" else "is a symbolic link"
    assert user_dir in str(info.value) and expected in str(info.value), str(info.value)
    assert (target / "sweep.lock").read_text() == "precious", "the planted link's target was not touched"


def _token_then_gather(workspace: str, phase: int) -> dict[str, Any]:
    from distribute_utils.transports.namespace import job_token

    if phase == 0:
        return {"token": job_token()}
    rank = dist.get_rank()
    try:
        with get_tensors_parallel(
            torch.full((1000,), float(rank)),
            [0, 1, 2, 3],
            transport="workspace",
            workspace_path=workspace,
            timeout=20,
        ) as got:
            return {"got": [float(t[0]) for t in got]}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


@needs_root
def test_a_real_gather_refuses_a_squatted_namespace(ranks4: RankPool, shared_dir: Path) -> None:
    workspace = _shared_workspace(shared_dir)
    token = ranks4.run(_token_then_gather, str(workspace), 0)[0]["token"]
    squatted = workspace / f"{wsns.NAMESPACE_PREFIX}{token}"
    _as_other_user(f"mkdir -m 0777 {squatted}")
    results = ranks4.run(_token_then_gather, str(workspace), 1, timeout=90)
    for rank, r in enumerate(results):
        assert "got" not in r, f"rank {rank} took data through a namespace another user owns: {r}"
        assert "belongs to uid 65534" in r["message"] or "cannot take part" in r["message"], r
    assert os.listdir(squatted) == []


def test_dry_runs_and_doctor_create_nothing(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "du-job-gone").mkdir(mode=0o700)  # a namespace without owners: stale
    before = sorted(p.name for p in workspace.rglob("*"))
    out = io.StringIO()
    assert hygiene.clean(str(workspace), True, out) == 0
    assert "would remove" in out.getvalue()
    assert sorted(p.name for p in workspace.rglob("*")) == before, "a dry run changed the workspace"
    out = io.StringIO()
    hygiene.doctor(str(workspace), out)
    assert "round trip" in out.getvalue() and "result: ok" in out.getvalue(), out.getvalue()
    assert sorted(p.name for p in workspace.rglob("*")) == before, "doctor left something behind"


def _crafted_through_a_gather(module_dir: str, case: str) -> dict[str, Any]:
    import sys

    rank = dist.get_rank()
    value: Any = {"rank": rank}
    if case == "unimported_class" and rank == 1:
        sys.path.insert(0, module_dir)
        import du_planted_mod  # type: ignore[import-not-found]  # only the sender has it

        value = du_planted_mod.Config(1)
    if case == "oversized" and rank == 2:
        value = {"s": "x" * (64 * 2**20 + 1)}
    try:
        with get_tensors_parallel(torch.zeros(1), [0, 1, 2, 3]):  # the group is fine
            pass
        from distribute_utils import get_configs_parallel

        with get_configs_parallel(value, [0, 1, 2, 3], timeout=30) as got:
            return {"got": len(got)}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:300]}


def test_crafted_values_fail_cleanly_through_a_real_gather(ranks4: RankPool, tmp_path: Path) -> None:
    marker_dir = tmp_path / "imported-by"
    marker_dir.mkdir()
    (tmp_path / "du_planted_mod.py").write_text(
        "import dataclasses, os\n"
        f"open(os.path.join({str(marker_dir)!r}, str(os.getpid())), 'w').close()\n"
        "@dataclasses.dataclass\nclass Config:\n    x: int\n"
    )
    results = ranks4.run(_crafted_through_a_gather, str(tmp_path), "unimported_class", timeout=90)
    assert (
        results[0]["error"] == "PayloadError"
        and "is not imported on the reading rank" in results[0]["message"]
    )
    assert all("error" in r for r in results), results
    assert [p.name for p in marker_dir.iterdir()] == [str(ranks4.pids[1])], "only the sender ran the module"
    before = job_leftovers(set(ranks4.pids))  # (only this job's: another job may run on the machine)
    results = ranks4.run(_crafted_through_a_gather, str(tmp_path), "oversized", timeout=90)
    assert results[2]["error"] == "ArgumentError" and "over the limit" in results[2]["message"], results[2]
    assert results[0]["error"] == "ArgumentError" and "rank 2 cannot take part" in results[0]["message"], (
        results[0]
    )
    assert job_leftovers(set(ranks4.pids)) - before == set(), "nothing was written"


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a private /dev/shm")
def test_a_private_directory_another_user_made_first_sends_gathers_through_the_store() -> None:
    """Another local user makes this user's private directory on the host before the job starts (its
    name is predictable): no process of the job listens there, none writes into it, and every gather
    goes through the job's store, exactly, with a warning that names the directory and its owner."""
    private = host_dir.PRIVATE_DIR
    job = shlex.join([sys.executable, str(JOBS / "squatted_dir_job.py")])
    script = (
        "mount --make-rprivate / && mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "
        f"setpriv --reuid={OTHER_UID} --regid={OTHER_UID} --clear-groups mkdir -m 0777 {private} && "
        f"{job} && ls -A {private}"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--fork", "sh", "-c", script], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports_line, *left = proc.stdout.strip().splitlines()
    reports = json.loads(reports_line)
    assert [r["tensors"] for r in reports] == [[True, True], []] and reports[0]["configs"] == [0, 1], reports
    assert reports[0]["claims"] > 0, "the gathers went through the store (its claims are there)"
    assert f"{private} belongs to uid {OTHER_UID} (nobody)" in proc.stderr, proc.stderr[-3000:]
    assert "gathers go through the job's store" in proc.stderr
    assert left == [], f"the job wrote into the other user's directory: {left}"
