"""Fault injection on real processes: ranks SIGKILLed or hung at chosen points of a gather.

Every case starts a fresh job of independent processes (``tests/jobs/fault_job.py``; this
test hosts the job's ``TCPStore`` so any rank, rank 0 included, can die without taking the
rendezvous along) and checks, after every process of the job has exited:

- the survivors raised a clear error naming the lost rank(s) within the configured timeout,
  or, where the lost rank had already published, delivered its data exactly and named it at
  the next synchronisation;
- every survivor exited by itself (none hangs), the victim by its signal;
- nothing is left: no ``du_*`` segment of the job's pids in ``/dev/shm``, and in a workspace
  no file of the job once the next job has opened it (dead jobs' namespaces are swept).

Root-only cases run ``torchrun`` in a private mount namespace: a 64 MiB ``/dev/shm`` with a
workspace to fall back to, and a full or read-only workspace. The last test prints the
summary table (``docs/reliability.md`` records one); set ``DU_RELIABILITY_TABLE=path`` to
also write it as Markdown.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from distribute_utils import liveness, sync
from distribute_utils.transports.namespace import NAMESPACE_PREFIX

from harness import free_port, torchrun_argv

JOB = Path(__file__).parent / "jobs" / "fault_job.py"
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5.0  # the gather timeout of most cases (DU_TIMEOUT in the job)
SHORT_TIMEOUT_S = 3.0  # the cases that must wait for the timeout
SLACK_S = 4.0  # scheduling slack on a loaded 2-core machine
JOB_LIMIT_S = 120.0  # a job still running after this has hung

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a private mount namespace",
)


def test_a_forked_child_runs_its_own_watchdog() -> None:
    """A fork copies the watchdog's state but not its thread: the child must start one of its own,
    or no dead peer of the child's would ever be tombstoned (its waits would last the whole timeout)."""
    dog = liveness.Watchdog()
    watch = liveness.Watch(None, None, {}, None)  # type: ignore[arg-type]  # nothing to check: no grace passes
    dog.remove(dog.add(watch))
    assert dog.running
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        dog.add(watch)  # (it starts a thread only where it has none: an inherited one would stop it)
        ok = dog.running
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    dog.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child found the parent's thread, or started none"


# -- the summary ------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the summary: a fault injected, or concurrent jobs run."""

    case: str
    kind: str  # "fault" | "concurrent jobs"
    passed: bool = False
    lost: bool | None = None  # data lost or wrong, a survivor hung or died
    leaked: bool | None = None  # segments or workspace files left behind
    detail: str = ""
    jobs: int = 1  # jobs started for this row


ROWS: list[Row] = []


@pytest.fixture
def row(request: pytest.FixtureRequest) -> Iterator[Row]:
    """A summary row for this test; it counts as passed only if the test sets ``passed``."""
    entry = Row(case=request.node.name.removeprefix("test_"), kind="fault")
    yield entry
    ROWS.append(entry)


def _table(rows: list[Row]) -> str:
    def yn(value: bool | None) -> str:
        return "-" if value is None else "yes" if value else "no"

    lines = [
        "| case | kind | passed | lost anything | leaked anything | what the survivors saw |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(
            f"| {r.case} | {r.kind} | {'yes' if r.passed else 'NO'} | {yn(r.lost)} | {yn(r.leaked)} | {detail} |"
        )
    faults = sum(r.kind == "fault" for r in rows)
    jobs = sum(r.jobs for r in rows if r.kind == "concurrent jobs")
    lines.append("")
    lines.append(
        f"{faults} faults injected, {jobs} concurrent jobs run; "
        f"{sum(r.passed for r in rows)}/{len(rows)} passed, "
        f"{sum(bool(r.lost) for r in rows)} lost anything, {sum(bool(r.leaked) for r in rows)} leaked anything"
    )
    return "\n".join(lines)


# -- running a job ----------------------------------------------------------------------------
@dataclass
class Job:
    """What one job did: per-rank reports, exit codes and the pids to check for leftovers."""

    pids: list[int]
    returncodes: list[int | None]
    reports: dict[int, dict[str, Any]]
    notes: dict[int, dict[str, Any]]
    stderr: list[str]
    wall_s: float
    hung: list[int] = field(default_factory=list)

    def survivors(self, victim: int) -> list[dict[str, Any]]:
        return [self.reports[r] for r in sorted(self.reports) if r != victim]

    def explain(self) -> str:
        parts = [f"returncodes {self.returncodes}, hung {self.hung}, wall {self.wall_s:.1f} s"]
        parts += [f"rank {r}: {json.dumps(rep)[:1500]}" for r, rep in sorted(self.reports.items())]
        parts += [f"--- stderr of rank {r} ---\n{err[-2000:]}" for r, err in enumerate(self.stderr) if err]
        return "\n".join(parts)


def _launch(
    case: str,
    world: int,
    results: Path,
    env: dict[str, str] | None = None,
    limit: float = JOB_LIMIT_S,
    store_port: int | None = None,
) -> Job:
    """Run ``fault_job.py CASE`` on ``world`` independent processes and wait for all to exit: with the
    job's store hosted here, or with ``store_port``, by rank 0 on that port (as ``env://`` jobs start)."""
    results.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    base.update(DU_RESULTS=str(results), DU_TIMEOUT=str(TIMEOUT_S))
    store = None
    if store_port is None:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        base.update(DU_STORE_PORT=str(store.port))
    else:
        base.update(DU_STORE_ON_RANK0="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    base.update(env or {})
    procs, logs = [], []
    start = time.monotonic()
    try:
        for rank in range(world):
            log = open(results / f"stderr{rank}.txt", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOB), case],
                    env=dict(base, RANK=str(rank), WORLD_SIZE=str(world)),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
        hung = []
        for rank, proc in enumerate(procs):
            try:
                proc.wait(max(0.1, start + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
    finally:
        for proc in procs:  # only after the limit: a hung rank fails the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        del store
    wall = time.monotonic() - start

    def load(name: str) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in range(world):
            path = results / f"{name}{rank}.json"
            if path.exists():
                found[rank] = json.loads(path.read_text())
        return found

    return Job(
        pids=[p.pid for p in procs],
        returncodes=[p.returncode for p in procs],
        reports=load("rank"),
        notes=load("note"),
        stderr=[(results / f"stderr{r}.txt").read_text() for r in range(world)],
        wall_s=wall,
        hung=hung,
    )


def _segments_of(pids: list[int]) -> list[str]:
    """``du_*`` segments in /dev/shm named with one of ``pids`` (``du_<token>_<rank>_<pid>``)."""
    found = []
    for name in os.listdir("/dev/shm"):
        tail = name.rsplit("_", 1)[-1]
        if name.startswith("du_") and tail.isdigit() and int(tail) in pids:
            found.append(name)
    return sorted(found)


def _workspace_files(workspace: Path) -> list[str]:
    """Everything in ``workspace`` except this user's lock directory."""
    return sorted(
        str(p.relative_to(workspace))
        for p in workspace.rglob("*")
        if not str(p.relative_to(workspace)).startswith(".du-")
    )


def _exited_cleanly(job: Job, victim: int | None) -> bool:
    """Every survivor exited with 0 by itself and wrote its report; the victim died by SIGKILL."""
    for rank, code in enumerate(job.returncodes):
        if rank == victim:
            if code != -signal.SIGKILL:
                return False
        elif code != 0 or rank not in job.reports:
            return False
    return not job.hung


def _names(message: str, rank: int) -> bool:
    return f"[{rank}]" in message or f"rank {rank}" in message or f"({rank})" in message


def _check_named_within(job: Job, victim: int, bound: float) -> None:
    """Every survivor failed its gather naming ``victim`` within ``bound`` seconds."""
    for report in job.survivors(victim):
        assert report["outcome"] == "error", job.explain()
        assert _names(report["message"], victim), report["message"]
        assert report["elapsed"] < bound, (report["elapsed"], bound, report["message"])


# -- a non-first rank dies ----------------------------------------------------------------------
def test_sender_killed_before_entering(tmp_path: Path, row: Row) -> None:
    job = _launch("sender_dies_before_gather", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=2)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    _check_named_within(job, victim=2, bound=TIMEOUT_S)
    for report in job.survivors(2):
        assert report["error_type"] == "PeerLostError" and report["missing"] == [2], report
        assert "rank(s) [2] exited" in report["message"]
    assert not row.leaked
    row.detail = f"PeerLostError naming [2] after {max(r['elapsed'] for r in job.survivors(2)):.2f} s"
    row.passed = True


def test_sender_killed_before_meeting_env_timeout(tmp_path: Path, row: Row) -> None:
    # Before the ranks have met, nobody knows the victim's pid: only the timeout can name it,
    # and here the timeout comes from $DISTRIBUTE_UTILS_TIMEOUT (no argument is passed).
    env = {sync.TIMEOUT_ENV: str(SHORT_TIMEOUT_S)}
    job = _launch("sender_dies_before_meeting", 3, tmp_path, env=env)
    row.lost = not _exited_cleanly(job, victim=2)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    for report in job.survivors(2):
        assert report["error_type"] == "PeerLostError" and report["missing"] == [2], report
        assert f"rank(s) [2] did not arrive within {SHORT_TIMEOUT_S:g} s" in report["message"]
        assert "$DISTRIBUTE_UTILS_TIMEOUT" in report["message"]
        assert SHORT_TIMEOUT_S - 0.1 <= report["elapsed"] < SHORT_TIMEOUT_S + SLACK_S, report
    assert not row.leaked
    row.detail = f"PeerLostError naming [2] at the ${sync.TIMEOUT_ENV}={SHORT_TIMEOUT_S:g} s timeout"
    row.passed = True


def test_sender_hangs_timeout_argument_wins(tmp_path: Path, row: Row) -> None:
    # A live but unresponsive rank: the watchdog sees its pid alive, so the timeout names it.
    # The argument (3 s) wins over the environment (600 s).
    env = {sync.TIMEOUT_ENV: "600", "DU_TIMEOUT": str(SHORT_TIMEOUT_S)}
    job = _launch("sender_hangs", 3, tmp_path, env=env)
    row.lost = bool(job.hung) or any(code != 0 for code in job.returncodes)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    for report in job.survivors(2):
        assert report["missing"] == [2], report
        assert f"rank(s) [2] did not arrive within {SHORT_TIMEOUT_S:g} s" in report["message"]
        assert SHORT_TIMEOUT_S - 0.1 <= report["elapsed"] < SHORT_TIMEOUT_S + SLACK_S, report
    late = job.reports[2]  # enters when the others have given up: fails too, never hangs
    assert late["outcome"] == "error" and _names(late["message"], 0), late
    assert not row.leaked
    row.detail = f"PeerLostError naming [2] at the {SHORT_TIMEOUT_S:g} s timeout (argument; $DISTRIBUTE_UTILS_TIMEOUT=600); the late rank then fails naming the first"
    row.passed = True


def test_sender_killed_mid_publish_partial_segment_removed(tmp_path: Path, row: Row) -> None:
    job = _launch("sender_dies_mid_publish", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=2)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    note = job.notes[2]  # the victim's half-written segment existed when it died
    assert note["path"].startswith("/dev/shm/du_") and note["written"] < note["nbytes"] == note["size"]
    assert not os.path.exists(note["path"]), "the reader discards a failed round's segments"
    first, other = job.reports[0], job.reports[1]
    assert first["error_type"] == "PeerLostError" and first["missing"] == [2], first
    assert other["error_type"] == "PeerLostError" and other["missing"] == [2], other
    assert "rank(s) [2] exited" in other["message"], other
    _check_named_within(job, victim=2, bound=TIMEOUT_S)
    assert not row.leaked
    row.detail = "first rank: PeerLostError naming [2], removes the partial segment; other sender: PeerLostError naming [2]"
    row.passed = True


def test_sender_killed_after_publish_data_arrives(tmp_path: Path, row: Row) -> None:
    # Killed in the body of its `with` block: its payload was complete, so the gather delivers
    # it; the death shows at the next synchronisation.
    job = _launch("sender_dies_after_publish", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=2) or job.reports.get(0, {}).get("wrong") != []
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    assert job.reports[0]["outcome"] == "ok" and job.reports[0]["received"] == 3
    for report in job.survivors(2):
        assert report["next_missing"] == [2] and "rank(s) [2] exited" in report["next_sync"], report
        assert report["next_elapsed"] < TIMEOUT_S
    assert not row.leaked
    row.detail = "gather completes with exact data; the next barrier raises PeerLostError naming [2]"
    row.passed = True


def test_sender_killed_while_first_rank_reads(tmp_path: Path, row: Row) -> None:
    # The victim dies once its claim is posted; the first rank fetches its segment only once it
    # is dead: a named segment outlives its writer, so the bytes are intact, and fetching
    # removes it.
    job = _launch("sender_dies_while_reader_reads", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=2) or job.reports.get(0, {}).get("wrong") != []
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    first = job.reports[0]
    assert first["victim_dead_before_fetch"] and first["outcome"] == "ok" and first["received"] == 3
    for report in job.survivors(2):
        assert report["next_missing"] == [2], report
    assert not row.leaked
    row.detail = "the dead sender's published data arrives exactly; the next barrier names [2]"
    row.passed = True


# -- the first rank dies ------------------------------------------------------------------------
def test_first_rank_killed_while_senders_wait(tmp_path: Path, row: Row) -> None:
    job = _launch("first_rank_dies_before_gather", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=0)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    for report in job.survivors(0):
        assert report["error_type"] == "PeerLostError" and report["missing"] == [0], report
    _check_named_within(job, victim=0, bound=TIMEOUT_S + 1)
    assert not row.leaked, "senders remove their own segments when the first rank is lost"
    row.detail = "PeerLostError naming [0]; each sender removes its own segment"
    row.passed = True


def test_first_rank_killed_mid_read(tmp_path: Path, row: Row) -> None:
    job = _launch("first_rank_dies_mid_read", 3, tmp_path)
    row.lost = not _exited_cleanly(job, victim=0)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    # It reads each payload as its claim comes: whichever came first, then it died before the other.
    assert job.notes[0] in ({"fetched": 1}, {"fetched": 2}), "it died after fetching one sender's payload"
    for report in job.survivors(0):
        assert report["error_type"] == "PeerLostError" and report["missing"] == [0], report
    _check_named_within(job, victim=0, bound=TIMEOUT_S + 1)
    assert not row.leaked
    row.detail = "PeerLostError naming [0] on both senders; no segment left"
    row.passed = True


# -- the first rank hosts the store (mp.spawn / env:// jobs) and dies ----------------------------
STORE_TIMEOUT_S = 30.0  # the gather timeout of these cases: the store's loss must show well before it


@pytest.mark.parametrize(
    "case",
    ["first_rank_dies_before_gather", "first_rank_dies_mid_read", "first_rank_dies_while_idle"],
    ids=["while_senders_wait", "after_mapping_a_payload", "while_idle"],
)
def test_first_rank_hosting_the_store_killed(tmp_path: Path, row: Row, case: str) -> None:
    # Rank 0 hosts the TCPStore and is SIGKILLed: a new store client (a clone connects with the
    # store's own timeout, 120 s here, and retries) must never keep the survivors waiting. Each raises
    # PeerLostError naming the store within seconds, a later gather (without rank 0) raises it at
    # once, and the process exits normally.
    port = free_port()
    job = _launch(case, 3, tmp_path, env={"DU_TIMEOUT": str(STORE_TIMEOUT_S)}, store_port=port)
    row.lost = not _exited_cleanly(job, victim=0)
    row.leaked = bool(_segments_of(job.pids))
    assert not row.lost, job.explain()
    address = f"127.0.0.1:{port}"
    for report in job.survivors(0):
        later = report["later"]
        for outcome in (report, later):
            assert outcome["error_type"] == "PeerLostError", job.explain()
            assert f"the job's rendezvous store at {address} is gone" in outcome["message"], outcome
        assert report["elapsed"] < STORE_TIMEOUT_S / 3, report
        assert later["elapsed"] < SLACK_S, later
    for err in job.stderr[1:]:  # the survivors exited by themselves, not by an abort
        assert "terminate called" not in err and "Aborted" not in err, err[-2000:]
    assert not row.leaked
    slowest = max(r["elapsed"] for r in job.survivors(0))
    row.detail = (
        f"PeerLostError naming the store at 127.0.0.1:<port> after {slowest:.2f} s; a later gather at once"
    )
    row.passed = True


# -- the workspace: a dead job's leftovers, then two live jobs sharing it -----------------------
def test_workspace_dead_job_swept_and_two_live_jobs_share_it(tmp_path: Path, row: Row) -> None:
    workspace = tmp_path / "ws"
    env = {"DU_WORKSPACE": str(workspace)}
    dead = _launch("workspace_sender_dies_mid_publish", 3, tmp_path / "dead", env=env)
    lost = not _exited_cleanly(dead, victim=2)
    assert not lost, dead.explain()
    for report in dead.survivors(2):
        assert _names(report["message"], 2) and report["elapsed"] < TIMEOUT_S, report
    left = _workspace_files(workspace)
    namespaces = {name.split("/")[0] for name in left}
    assert len(namespaces) == 1, left
    assert any(".tmp-" in name for name in left), f"the victim's half-written temporary file: {left}"
    assert all(".tmp-" in name or "/owner-" in name for name in left if "/" in name), left

    # Two jobs at once in the same workspace, every payload through files, receivers rotating.
    # Job B starts its gathers only once job A's namespace is live, so B's sweep must keep it.
    results: dict[str, Job] = {}
    rounds = {"DU_ROUNDS": "30"}

    def run(name: str, extra: dict[str, str]) -> None:
        results[name] = _launch("workspace_rounds", 2, tmp_path / name, env={**env, **rounds, **extra})

    # A stays (its namespace live) until B is done, however fast A's own rounds are.
    done = str(tmp_path / "b_done")
    threads = [
        threading.Thread(target=run, args=("a", {"DU_HOLD_UNTIL": done})),
        threading.Thread(target=run, args=("b", {"DU_AWAIT_LIVE_NAMESPACE": "1", "DU_DONE_FILE": done})),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    a, b = results["a"], results["b"]
    live_lost = not (_exited_cleanly(a, None) and _exited_cleanly(b, None))
    live_lost = live_lost or any(rep["wrong"] for job in (a, b) for rep in job.reports.values())
    remaining = _workspace_files(workspace)
    leaked = bool(remaining) or any(_segments_of(job.pids) for job in (dead, a, b))
    row.lost, row.leaked = lost or live_lost, leaked
    assert not live_lost, a.explain() + "\n" + b.explain()
    assert all(rep["other_live_namespace"].startswith(NAMESPACE_PREFIX) for rep in b.reports.values())
    assert not leaked, f"left in the workspace: {remaining}"
    row.detail = (
        "survivors name [2]; its half-written file stays until the next job opens the workspace, "
        "which sweeps the dead namespace"
    )
    row.passed = True
    ROWS.append(
        Row(
            case="two_jobs_share_one_workspace",
            kind="concurrent jobs",
            passed=True,
            lost=False,
            leaked=False,
            jobs=2,
            detail="2 jobs x 2 ranks x 30 rounds through files, receivers rotating; exact, namespaces kept while live",
        )
    )


# -- /dev/shm too small, disk full, read-only workspace (root: private mount namespace) ----------
def _torchrun_in_namespace(
    mounts: str, case: str, nproc: int, env: dict[str, str]
) -> subprocess.CompletedProcess:
    script = f"mount --make-rprivate / && {mounts} && exec {shlex.join(torchrun_argv(nproc, str(JOB), case))}"
    full_env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        # A private pid namespace too: if anything hangs, killing unshare takes every process along.
        [
            "unshare",
            "--mount",
            "--ipc",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sh",
            "-c",
            script,
        ],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=JOB_LIMIT_S,
    )


@needs_root
def test_small_dev_shm_falls_back_to_the_workspace(tmp_path: Path, row: Row) -> None:
    # 4 ranks x 32 MiB = 128 MiB to gather through a 64 MiB /dev/shm, with a workspace given and a local
    # disk (the local-disk carrier's directory, tried first) of 1 MiB.
    row.case, row.kind = "dev_shm_too_small_with_workspace", "fault"
    results, workspace, disk = tmp_path / "results", tmp_path / "ws", tmp_path / "disk"
    results.mkdir()
    disk.mkdir()
    env = {
        "DU_RESULTS": str(results),
        "DU_WORKSPACE": str(workspace),
        "DU_PER_RANK_MIB": "32",
        "DISTRIBUTE_UTILS_LOCAL_DIR": str(disk),
    }
    mounts = f"mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && mount -t tmpfs -o size=1m tmpfs {disk}"
    proc = _torchrun_in_namespace(mounts, "shm_fallback", 4, env)
    assert "SIGBUS" not in proc.stderr and "Bus error" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((results / f"rank{r}.json").read_text()) for r in range(4)]
    row.lost = reports[0].get("wrong") != [] or any(r["outcome"] != "ok" for r in reports)
    row.leaked = any(r["shm_left"] for r in reports) or bool(_workspace_files(workspace))
    assert not row.lost, reports
    assert reports[0]["received"] == 4
    fell_back = [r["rank"] for r in reports if r["warnings"]]
    assert len(fell_back) >= 1, "/dev/shm holds at most one 32 MiB payload"
    for r in reports:
        for message in r["warnings"]:
            assert "/dev/shm cannot hold rank" in message and str(workspace) in message, message
    assert "it goes through the workspace" in proc.stderr, "the choice is logged"
    assert not row.leaked
    row.detail = f"ranks {fell_back} logged the fallback and went through the workspace; rank 0 got every rank's 32 MiB exactly"
    row.passed = True


@needs_root
def test_full_and_read_only_workspace_in_a_gather(tmp_path: Path, row: Row) -> None:
    row.case, row.kind = "workspace_full_then_read_only", "fault"
    results, full, src, ro = tmp_path / "results", tmp_path / "full", tmp_path / "src", tmp_path / "ro"
    for d in (results, full, src, ro):
        d.mkdir()
    mounts = (
        f"mount -t tmpfs -o size=1m,mode=0700 tmpfs {full} && "
        f"mount --bind {src} {ro} && mount -o remount,bind,ro {ro}"
    )
    env = {"DU_RESULTS": str(results), "DU_FULL_WS": str(full), "DU_RO_WS": str(ro)}
    proc = _torchrun_in_namespace(mounts, "workspace_full_ro", 3, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((results / f"rank{r}.json").read_text()) for r in range(3)]
    row.lost = False  # nothing was expected to arrive: the point is a clear error everywhere
    row.leaked = any(r[key]["left"] for r in reports for key in ("full", "ro")) or bool(os.listdir(src))
    for r in reports:
        full_error, ro_error = r["full"], r["ro"]
        assert full_error["outcome"] == ro_error["outcome"] == "error", r
        assert f"{full}/du-job-" in full_error["message"] and "has no room" in full_error["message"], r
        assert str(ro) in ro_error["message"] and "Read-only file system" in ro_error["message"], r
        # Every rank raises the type of the error (the first rank naming the sender it came from).
        assert full_error["error_type"] == "SpaceError" and ro_error["error_type"] == "WorkspaceError", r
        if r["rank"] == 0:
            assert full_error["message"].startswith("rank 1 cannot take part in the gather: "), r
            assert ro_error["message"].startswith("rank 1 cannot take part in the gather: "), r
    assert not row.leaked, "nothing half-written stays visible"
    row.detail = "senders: SpaceError / WorkspaceError naming the path; first rank: the same types naming the rank and path"
    row.passed = True


# -- the summary --------------------------------------------------------------------------------
def test_zz_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Print the table of every case run above; fail if any lost or leaked anything."""
    if not ROWS:
        pytest.skip("no fault case ran")
    table = _table(ROWS)
    with capsys.disabled():
        print("\n\nFault injection summary\n" + table)
    target = os.environ.get("DU_RELIABILITY_TABLE")
    if target:
        with open(target, "a") as f:
            f.write("### Faults\n\n" + table + "\n\n")
    bad = [r.case for r in ROWS if not r.passed or r.lost or r.leaked]
    assert not bad, f"cases that failed, lost or leaked: {bad}"
