"""SIGINT / SIGTERM: every process ends, every temporary goes, one line, exit 130 / 143.

Real commands in their own session (``setsid``), signalled at start-up, mid-gather and mid-write, to the
launching process, to one rank and to the whole process group; and under real ``torchrun``. Moments are
found by watching what the command does (its stderr, its output temporary, its rank processes), never by
sleeping; "mid-gather" stops one rank with SIGSTOP first, so that the others are certainly blocked in a
store wait (where a plain Python handler would not run until the timeout), and continues it after the
signal. Also: the interrupt machinery itself in a small real process, and ``clean`` removing the
temporaries of a consolidation that was killed outright.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from distribute_utils.consolidate import write_own_layout
from distribute_utils.consolidate.synthetic import (
    balanced_layers_per_stage,
    make_gpt_state_dict,
    shard_state_dict,
    synthetic_size_for,
)
from distribute_utils.temporaries import RECORD_DIR

from harness import temporaries_clean_would_remove, torchrun_argv

MESSAGE = "distribute-utils consolidate: interrupted; nothing written"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
BAR = "consolidating:"  # tqdm's progress bar (drawn only when stderr is a terminal)


# -- processes, observed through /proc ---------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: every process the command started."""
    found = []
    for pid in _pids():
        fields = _stat(pid)
        if fields and int(fields[3]) == sid and fields[0] != "Z":
            found.append(pid)
    return found


def _children(pid: int) -> list[int]:
    return [p for p in _pids() if (f := _stat(p)) and int(f[1]) == pid and f[0] != "Z"]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if (f := _stat(p)) and f[0] != "Z"]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ranks(launcher: int) -> list[int]:
    """The rank processes of a launching process (children of its multiprocessing forkserver)."""
    servers = [c for c in _children(launcher) if "forkserver" in _cmdline(c)]
    return sorted(r for s in servers for r in _children(s))


def _holder(path_part: str, among: list[int]) -> int | None:
    """The process among ``among`` that holds a file whose path contains ``path_part`` open."""
    for pid in among:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if path_part in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    return pid
            except OSError:
                continue
    return None


def _until(
    what: str, condition: Callable[[], object], proc: subprocess.Popen, timeout: float = 120
) -> object:
    """Polls ``condition`` until it is truthy; fails (naming ``what``) if the command ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}")
        time.sleep(0.002)
    pytest.fail(f"timed out waiting for {what}")


def _temp_with_data(out: Path) -> Path | None:
    """The output temporary once bytes were written into it (it is created sparse, at full size)."""
    for p in out.glob(".*.tmp-*") if out.is_dir() else ():
        try:
            if p.stat().st_blocks > 0:
                return p
        except FileNotFoundError:
            continue
    return None


def _records() -> set[str]:
    """The temporaries records (``*.json``; the directory also holds processes' sockets)."""
    try:
        return {n for n in os.listdir(RECORD_DIR) if n.endswith(".json")}
    except FileNotFoundError:
        return set()


def _segments(pids: set[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("du_") and int(n.rsplit("_", 1)[-1]) in pids]


# -- the command --------------------------------------------------------------------------------------
class Command:
    """``python -m distribute_utils ARGS`` in a session of its own, stderr read as it comes."""

    def __init__(self, *args: str, cwd: Path | None = None) -> None:
        self.err_path = (
            Path(os.environ.get("TMPDIR", "/tmp")) / f"du-interrupt-{os.getpid()}-{time.time_ns()}"
        )
        self._err = open(self.err_path, "w+b")  # noqa: SIM115 - read while the command runs
        # Its own TMPDIR: what multiprocessing leaves there (pymp-*) is seen, and only that.
        self.tmp = Path(tempfile.mkdtemp(prefix="du-interrupt-tmp-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distribute_utils", *args],
            stdout=subprocess.PIPE,
            stderr=self._err,
            start_new_session=True,
            cwd=cwd,
            env={**os.environ, "TMPDIR": str(self.tmp)},
        )
        self.sid = self.proc.pid
        self.seen: set[int] = set()

    def stderr(self) -> str:
        return self.err_path.read_bytes().decode(errors="replace")

    def watch(self) -> list[int]:
        """The session's processes now (remembered, to check later that each has ended)."""
        now = _session(self.sid)
        self.seen.update(now)
        return now

    def finish(self, timeout: float = 60) -> tuple[int, str, str, float]:
        """Waits for the launching process; ``(exit code, stdout, stderr, seconds it took)``."""
        start = time.monotonic()
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.sid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"the command did not end within {timeout} s of the signal:\n{self.stderr()[-3000:]}")
        took = time.monotonic() - start
        return self.proc.returncode, out.decode(errors="replace"), self.stderr(), took

    def others_gone(self, timeout: float = 30) -> list[int]:
        """Waits until no process of the session is left; returns those left at the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = _session(self.sid)
            if not left:
                return []
            time.sleep(0.05)
        return _session(self.sid)

    def close(self) -> None:
        left = _session(self.sid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self._err.close()
        self.err_path.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def temporaries_left(self) -> list[str]:
        """What the command left in its TMPDIR (multiprocessing's pymp-* folders, ...)."""
        return sorted(p.name for p in self.tmp.iterdir())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TP2 x PP2 checkpoint of ~200 MB: a few seconds of work for 4 ranks on 2 cores."""
    dims = synthetic_size_for(int(200e6), num_layers=8)
    layers = balanced_layers_per_stage(8, 2)
    root = tmp_path_factory.mktemp("interrupt") / "ckpt"
    state = make_gpt_state_dict(**dims.as_kwargs())  # type: ignore[arg-type]
    write_own_layout(root, shard_state_dict(state, 2, 2, layers_per_stage=layers), layers_per_stage=layers)
    return root


def _check_clean_end(
    cmd: Command, sig: signal.Signals, out: Path, records_before: set[str], extra: str = ""
) -> None:
    code, stdout, stderr, took = cmd.finish()
    lines = [seg for line in stderr.split("\n") for seg in [line.rsplit("\r", 1)[-1].strip()] if seg]
    ours = [ln for ln in lines if not ln.startswith(BAR) and ln != "starting 4 local ranks ..."]
    assert code == CODES[sig], f"exit {code}, expected {CODES[sig]} {extra}\n{stderr[-3000:]}"
    assert ours == [MESSAGE], f"expected exactly one line {MESSAGE!r} {extra}; stderr was:\n{stderr[-3000:]}"
    assert took < 30, f"took {took:.1f} s to end after the signal"
    assert stdout == "", stdout
    left = cmd.others_gone()
    assert not left, f"processes left: {[(p, _cmdline(p)) for p in left]}"
    assert not out.exists(), f"the output folder it created is left: {list(out.iterdir())}"
    assert not _segments(cmd.seen), _segments(cmd.seen)
    assert _records() <= records_before, "a temporaries record was left"
    assert not cmd.temporaries_left(), f"left in TMPDIR: {cmd.temporaries_left()}"


# -- the interrupt machinery in a small real process -------------------------------------------------
_BLOCKED_IN_A_STORE_WAIT = textwrap.dedent(
    """
    import datetime, os, sys
    import torch.distributed as dist
    from distribute_utils import interrupts

    log = open(sys.argv[1], "a", buffering=1)
    interrupts.install(lambda signum: log.write(f"end {signum}\\n"))
    interrupts.on_interrupt(lambda: log.write("undo first\\n"))
    interrupts.on_interrupt(lambda: log.write("undo second\\n"))
    with interrupts.uninterruptible():
        log.write("in section\\n")
        while not interrupts.ending():  # the signal arrived: the end waits for this section
            pass
        log.write("section done\\n")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=300))
    log.write("waiting\\n")
    store.wait(["never"])  # torch retries EINTR: a Python handler would run only after 300 s
    log.write("returned\\n")
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_ends_a_process_blocked_in_a_store_wait(tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "log"
    log.touch()
    script = tmp_path / "blocked.py"
    script.write_text(_BLOCKED_IN_A_STORE_WAIT)
    proc = subprocess.Popen([sys.executable, str(script), str(log)], stderr=subprocess.PIPE)
    try:
        _until("the section", lambda: "in section" in log.read_text(), proc)
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # The section finished before anything was undone; newest undo first; the end's report last; the
    # store wait was never reached (the exit came first) or never returned.
    got = log.read_text().splitlines()
    assert got[:2] == ["in section", "section done"], got
    rest = [ln for ln in got[2:] if ln != "waiting"]
    assert rest == ["undo second", "undo first", f"end {int(sig)}"], got
    assert proc.returncode == CODES[sig], (proc.returncode, err)
    assert b"Traceback" not in err, err


def test_a_signal_during_a_store_wait_ends_it(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.touch()
    script = tmp_path / "blocked.py"
    script.write_text(_BLOCKED_IN_A_STORE_WAIT.replace("while not interrupts.ending():", "while False:"))
    proc = subprocess.Popen([sys.executable, str(script), str(log)], stderr=subprocess.PIPE)
    try:
        _until("the store wait", lambda: "waiting" in log.read_text(), proc)
        os.kill(proc.pid, signal.SIGTERM)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert log.read_text().splitlines()[-1] == "end 15", log.read_text()
    assert took < 30, f"{took:.1f} s (the wait's own timeout is 300 s)"


# -- the real command -----------------------------------------------------------------------------------
def _signal_to(target: str, cmd: Command, sig: signal.Signals, rank: int | None = None) -> None:
    if target == "parent":
        os.kill(cmd.proc.pid, sig)
    elif target == "group":
        os.killpg(cmd.sid, sig)
    else:
        assert rank is not None
        os.kill(rank, sig)


def _signal_while_stopped(stopped: int, target: str, cmd: Command, sig: signal.Signals, rank: int) -> None:
    """Stops process ``stopped`` (SIGSTOP), sends ``sig`` to ``target``, then lets ``stopped`` go on."""
    os.kill(stopped, signal.SIGSTOP)
    try:
        _signal_to(target, cmd, sig, rank)
    finally:
        os.kill(stopped, signal.SIGCONT)


def _consolidate(ckpt: Path, out: Path, *extra: str) -> Command:
    return Command("consolidate", str(ckpt), str(out), *extra)


@pytest.mark.parametrize(
    "target,sig",
    [("parent", signal.SIGINT), pytest.param("group", signal.SIGTERM, marks=pytest.mark.slow)],
)
def test_interrupt_at_start_up(ckpt: Path, tmp_path: Path, target: str, sig: signal.Signals) -> None:
    out, records = tmp_path / "out", _records()
    cmd = _consolidate(ckpt, out, "--nproc", "4")
    try:
        _until("ranks are being started", lambda: "starting 4 local ranks" in cmd.stderr(), cmd.proc)
        cmd.watch()
        _signal_to(target, cmd, sig)
        _check_clean_end(cmd, sig, out, records, f"({target}, start-up)")
    finally:
        cmd.close()


def _forkserver(launcher: int) -> int | None:
    servers = [c for c in _children(launcher) if "forkserver" in _cmdline(c)]
    return servers[0] if servers else None


def _importing_torch(pid: int | None) -> bool:
    """Whether process ``pid`` has begun importing torch (its library is mapped)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except (OSError, TypeError):
        return False


_START_UP_POINTS: dict[str, Callable[[Command], object]] = {
    # the forkserver's interpreter has just started (the moment its process runs Python)
    "forkserver_made": lambda cmd: _forkserver(cmd.proc.pid),
    # it imports torch (seconds on 2 cores)
    "forkserver_importing_torch": lambda cmd: _importing_torch(_forkserver(cmd.proc.pid)),
    # the first rank forked from it (joining the store and the gloo group)
    "ranks_forked": lambda cmd: _ranks(cmd.proc.pid),
}


@pytest.mark.parametrize(
    "point",
    [
        "forkserver_importing_torch",
        pytest.param("forkserver_made", marks=pytest.mark.slow),
        pytest.param("ranks_forked", marks=pytest.mark.slow),
    ],
)
def test_a_terminals_ctrl_c_during_rank_start_up_is_one_line(ckpt: Path, tmp_path: Path, point: str) -> None:
    """Ctrl-C in a terminal signals the whole process group: the forkserver too, which imports torch
    (before, its KeyboardInterrupt traceback of 5 to 57 lines came out, at some moments of start-up)."""
    out, records = tmp_path / "out", _records()
    cmd = _consolidate(ckpt, out, "--nproc", "4")
    try:
        _until(point, lambda: _START_UP_POINTS[point](cmd), cmd.proc)
        cmd.watch()
        os.killpg(cmd.sid, signal.SIGINT)
        _check_clean_end(cmd, signal.SIGINT, out, records, f"(group, {point})")
    finally:
        cmd.close()


@pytest.mark.parametrize(
    "target,sig",
    [
        ("rank", signal.SIGTERM),
        pytest.param("parent", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param("group", signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_interrupt_mid_gather(ckpt: Path, tmp_path: Path, target: str, sig: signal.Signals) -> None:
    """One rank is stopped, so every other one soon waits for it in a store wait; then the signal."""
    out, records = tmp_path / "out", _records()
    cmd = _consolidate(ckpt, out, "--nproc", "4")
    try:
        ranks = _until("4 ranks", lambda: (r := _ranks(cmd.proc.pid)) and len(r) == 4 and r, cmd.proc)
        _until("the output temporary", lambda: out.is_dir() and any(out.glob(".*.tmp-*")), cmd.proc)
        cmd.watch()
        writer = _holder(".tmp-", ranks)
        senders = [r for r in ranks if r != writer]
        _signal_while_stopped(senders[0], target, cmd, sig, senders[1])
        _check_clean_end(cmd, sig, out, records, f"({target}, mid-gather)")
    finally:
        cmd.close()


@pytest.mark.parametrize(
    "nproc,target,sig",
    [
        ("4", "group", signal.SIGINT),
        ("1", "parent", signal.SIGTERM),
        pytest.param("4", "rank", signal.SIGINT, marks=pytest.mark.slow),  # the writing rank
        pytest.param("1", "group", signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_interrupt_mid_write(
    ckpt: Path, tmp_path: Path, nproc: str, target: str, sig: signal.Signals
) -> None:
    out, records = tmp_path / "out", _records()
    cmd = _consolidate(ckpt, out, "--nproc", nproc)
    try:
        temp = _until("bytes in the output temporary", lambda: _temp_with_data(out), cmd.proc)
        procs = cmd.watch()
        writer = _holder(".tmp-", procs)
        assert writer is not None, "nobody holds the output temporary"
        assert isinstance(temp, Path)
        _signal_while_stopped(writer, target, cmd, sig, writer)  # held mid-write while the signal is sent
        _check_clean_end(cmd, sig, out, records, f"(nproc {nproc}, {target}, mid-write)")
    finally:
        cmd.close()


def test_interrupt_of_the_demo_while_its_ranks_run(tmp_path: Path) -> None:
    """The demo's first line comes before the ranks start; SIGINT then ends everything, leaving nothing."""
    cmd = Command("demo", "--size-mb", "8")
    try:
        assert cmd.proc.stdout is not None
        first = cmd.proc.stdout.readline().decode()  # printed at once, not at the end
        assert first.startswith("distribute-utils demo: 4 local ranks"), first
        _until("4 ranks", lambda: len(_ranks(cmd.proc.pid)) == 4, cmd.proc)
        cmd.watch()
        os.kill(cmd.proc.pid, signal.SIGINT)
        code, _, stderr, _ = cmd.finish()
        assert code == 130, stderr
        assert stderr.strip().splitlines()[-1] == "distribute-utils demo: interrupted; nothing written", (
            stderr
        )
        assert not cmd.others_gone(), "processes left"
        assert not cmd.temporaries_left(), f"left in TMPDIR: {cmd.temporaries_left()}"
        assert not _segments(cmd.seen)
    finally:
        cmd.close()


def test_interrupt_with_json_prints_an_error_object(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = _consolidate(ckpt, out, "--json")
    try:
        _until("bytes in the output temporary", lambda: _temp_with_data(out), cmd.proc)
        os.kill(cmd.proc.pid, signal.SIGSTOP)
        os.kill(cmd.proc.pid, signal.SIGINT)
        os.kill(cmd.proc.pid, signal.SIGCONT)
        code, stdout, stderr, _ = cmd.finish()
    finally:
        cmd.close()
    assert code == 130, stderr
    want = {"error": "interrupted; nothing written", "kind": "Interrupted", "exit_code": 130}
    assert json.loads(stdout or "null") == want, f"stdout {stdout!r}, stderr {stderr[-2000:]!r}"
    assert not out.exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("target", ["torchrun", pytest.param("rank", marks=pytest.mark.slow)])
def test_interrupt_under_torchrun_each_rank_ends_cleanly(ckpt: Path, tmp_path: Path, target: str) -> None:
    """torchrun forwards SIGTERM to its ranks (or one rank is signalled): each rank removes its
    temporaries, prints its one line and exits 143; nothing is left."""
    out, records = tmp_path / "out", _records()
    err_path = tmp_path / "torchrun.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            torchrun_argv(4, "-m", "distribute_utils", "consolidate", str(ckpt), str(out)),
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    try:
        _until("bytes in the output temporary", lambda: _temp_with_data(out), proc)
        # torchrun starts each rank in a session of its own: its children, then.
        ranks = [p for p in _children(proc.pid) if "distribute_utils" in _cmdline(p)]
        assert len(ranks) == 4, [(p, _cmdline(p)) for p in _children(proc.pid)]
        writer = _holder(".tmp-", ranks)
        assert writer is not None
        if target == "torchrun":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.kill(writer, signal.SIGTERM)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("torchrun did not end")
        deadline = time.monotonic() + 30
        while _alive([proc.pid, *ranks]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive([proc.pid, *ranks]), "processes left"
        stderr = err_path.read_text(errors="replace")
        said = re.findall(r"distribute-utils consolidate: interrupted; nothing written", stderr)
        # The signalled rank says it, and so does each rank torchrun then stops with SIGTERM.
        assert len(said) == 4 if target == "torchrun" else len(said) >= 1, stderr[-4000:]
        # torchrun prints its own SignalException traceback; none comes from a rank.
        assert "/distribute_utils/" not in stderr, stderr[-4000:]
        assert not out.exists(), list(out.iterdir())
        assert _records() <= records
    finally:
        for pid in _alive([proc.pid, *_children(proc.pid)]):
            os.kill(pid, signal.SIGKILL)


def test_clean_removes_the_temporaries_of_a_killed_consolidation(ckpt: Path, tmp_path: Path) -> None:
    """SIGKILL leaves the output temporary (nothing can run); ``clean`` finds it through the record the
    writer made and removes it; a running consolidation's temporary is never touched."""
    out, live_out = tmp_path / "out", tmp_path / "live"
    killed = _consolidate(ckpt, out)
    live: Command | None = None
    try:
        temp = _until("the killed one's temporary", lambda: _temp_with_data(out), killed.proc)
        killed.proc.kill()
        killed.finish()
        assert isinstance(temp, Path) and temp.exists()
        # Started only now and stopped in the poll that sees its temporary: a fast machine finished it
        # while the first one was still being watched.
        live = _consolidate(ckpt, live_out)
        live_temp = _until("the live one's temporary", lambda: _stop_once_written(live, live_out), live.proc)
        try:
            listed = temporaries_clean_would_remove()
            assert str(temp) in listed and str(live_temp) not in listed, listed
            assert temp.exists(), "a dry run removes nothing"
            done = subprocess.run(
                [sys.executable, "-m", "distribute_utils", "clean"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
            assert f"removed temporary {temp}" in done.stdout, done.stdout
            assert not temp.exists()
            assert isinstance(live_temp, Path) and live_temp.exists(), (
                "a live consolidation's file was removed"
            )
        finally:
            os.kill(live.proc.pid, signal.SIGCONT)
        code, _, stderr, _ = live.finish(timeout=300)
        assert code == 0, stderr
        assert (live_out / "model.safetensors").exists()
    finally:
        killed.close()
        if live is not None:
            live.close()


def _stop_once_written(cmd: Command, out: Path) -> Path | None:
    """The output temporary once it holds data, with ``cmd`` stopped (SIGSTOP) at once: still running
    (its record names a live process) but unable to finish while the test looks."""
    temp = _temp_with_data(out)
    if temp is not None:
        os.kill(cmd.proc.pid, signal.SIGSTOP)
    return temp


def test_ranks_end_when_the_launching_process_is_killed(ckpt: Path, tmp_path: Path) -> None:
    """SIGKILL gives the launching process no chance; its ranks still end (their parent, the forkserver,
    exits with it, and Linux then sends them SIGTERM) and remove their temporaries and segments."""
    out, records = tmp_path / "out", _records()
    cmd = _consolidate(ckpt, out, "--nproc", "4")
    try:
        _until("bytes in the output temporary", lambda: _temp_with_data(out), cmd.proc)
        cmd.watch()
        os.kill(cmd.proc.pid, signal.SIGKILL)
        cmd.finish()
        left = cmd.others_gone()
        assert not left, f"processes left: {[(p, _cmdline(p)) for p in left]}"
        assert not list(out.glob(".*.tmp-*")), list(out.iterdir())
        assert not _segments(cmd.seen), _segments(cmd.seen)
        assert _records() <= records
        assert "Traceback" not in cmd.stderr(), cmd.stderr()[-3000:]
    finally:
        cmd.close()
