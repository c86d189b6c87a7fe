"""Internal. Run a function on N local ranks, or as one rank of a job started by ``torchrun``.

Used by the CLI: ``distribute-utils demo`` and ``consolidate --nproc N`` spawn their own
ranks (gloo over a ``TCPStore`` on 127.0.0.1 hosted by the launching process, so a dying rank
never takes the rendezvous with it); under ``torchrun`` they join the existing job instead.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from . import interrupts
from .errors import ArgumentError, LaunchError
from .processes import ProcessInfo, process_alive, this_process
from .temporaries import remove_abandoned_by
from .transports import carriers

__all__ = ["LaunchError", "run_local", "under_torchrun"]

logger = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """Whether this process was started as one rank of a ``torchrun`` (or similar) job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    conn: Connection,
    args: tuple,
    level: int,
    launcher: ProcessInfo,
) -> None:
    # A signal ends this rank at once, whatever it waits in (interrupts), silently: the launching
    # process reports. So does the launching process's death.
    interrupts.install()
    # Its process group is the forkserver's, not the terminal's foreground one (_start_forkserver): with
    # SIGTTOU ignored, what it writes on a terminal set to `stty tostop` still comes out (else it stops).
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    _end_with_launcher(launcher)
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as exc:
        result = ("err", (f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc))))
    finally:
        dist.destroy_process_group()
    try:
        conn.send_bytes(pickle.dumps(result))
    except Exception:
        # The launcher died while this rank ran, and its watch has not ended the rank yet: end as it would.
        if not process_alive(launcher):
            interrupts.end(signal.SIGTERM)
        conn.send_bytes(pickle.dumps(("err", ("result could not be sent back", traceback.format_exc()))))
    # Run the exit handlers (they remove workspace namespaces), then skip the seconds that
    # tearing down torch's modules costs: the result is already with the parent.
    with interrupts.uninterruptible():
        atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_with_launcher(launcher: ProcessInfo) -> None:
    """Ends this rank (as SIGTERM would: undo, exit 143) when the launching process is gone, however it
    went (SIGKILL included). Our parent is the forkserver, which lives as long as any rank does, so
    ``PR_SET_PDEATHSIG`` cannot tell; a pidfd of the launcher becomes readable when it exits."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(launcher.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): look every second
            while process_alive(launcher):
                time.sleep(1.0)
        else:
            if process_alive(launcher):  # the same process, not a reuse of its pid
                select.select([fd], [], [])
        interrupts.end(signal.SIGTERM)

    threading.Thread(target=watch, name="distribute-utils-launcher-watch", daemon=True).start()


def _signal_of(exitcode: int | None) -> int | None:
    """The interrupt a rank exited on (by :func:`interrupts.end`, or killed by it), if any."""
    for sig in interrupts.EXIT_SIGNALS:
        if exitcode in (-sig, interrupts.exit_code(sig)):
            return int(sig)
    return None


class _Ranks:
    """The spawned rank processes; :meth:`stop` ends those still running and removes what they left."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.reported: set[int] = set()  # ranks that sent their result (they are exiting by themselves)
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Waits for ranks that reported, SIGTERMs the others; SIGKILLs what is left after the grace, then
        removes the shared-memory segments and temporary files of the ranks it had to kill."""
        with self._lock:
            for rank, proc in enumerate(self.procs):
                if rank not in self.reported and proc.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            for rank, proc in enumerate(self.procs):
                if proc.is_alive():
                    logger.warning("rank %d did not stop within %g s; killing it", rank, STOP_GRACE_S)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
                if proc.exitcode == -signal.SIGKILL:
                    carriers.remove_left_by(None, proc.pid)
                    remove_abandoned_by(proc.pid)


#: Seconds ranks get to end by themselves before they are killed.
STOP_GRACE_S = 10.0


def run_local(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks joined in a gloo group.

    ``fn`` must be importable (a module-level function). Returns every rank's result. The ranks end
    with this call however it ends: an interrupt (see :mod:`.interrupts`) stops them too.

    Raises:
        LaunchError: a rank raised or died; the others are stopped and every process reaped.
        Interrupted: a rank was ended by SIGINT or SIGTERM; the others are stopped.
    """
    if nproc < 1:
        raise ArgumentError(f"nproc must be >= 1; got {nproc}")
    # Ranks fork from a server that imported torch once: on 2 cores, four processes each
    # importing torch at the same time cost ~10 s before any work starts.
    ctx = mp.get_context("forkserver")
    _remove_temp_dir_on_interrupt()
    ctx.set_forkserver_preload(["torch", "torch.distributed", "distribute_utils.gather", fn.__module__])
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    level = logging.getLogger().getEffectiveLevel()
    ranks = _Ranks()
    conns: list[Connection] = []
    try:
        with interrupts.on_interrupt(ranks.stop):
            try:
                return _run(ctx, ranks, conns, fn, nproc, store.port, args, level, timeout)
            finally:
                interrupts.settle()  # an interrupt being handled stops the ranks itself
                ranks.stop()
    finally:
        for conn in conns:
            conn.close()


def _start_forkserver() -> None:
    """Starts multiprocessing's forkserver (if not running) in a process group of its own, so that a
    terminal's Ctrl-C, which goes to the terminal's foreground group, never reaches it (or the ranks it
    forks): it would interrupt the server's start-up or its import of torch with a traceback. The
    launcher alone receives it and stops the ranks (:class:`_Ranks`); the server ends with the launcher.
    multiprocessing has no option for this: its spawn function is replaced while the server starts (so
    multiprocessing's resource tracker, which it starts first, gets a group of its own too: it ignores
    SIGINT anyway). Main thread only, as :func:`run_local` is called: the replacement is not thread-safe."""
    from multiprocessing import forkserver

    original = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _spawn_in_own_group
    try:
        forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = original


#: The helper processes started by :func:`_spawn_in_own_group` (kept: a collected ``Popen`` of a running
#: process may later be reaped by ``subprocess``, which multiprocessing's own ``waitpid`` would not expect).
_SPAWNED: list[subprocess.Popen[bytes]] = []


def _spawn_in_own_group(path: bytes | str, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds``, with the child in a new process group (set before it
    runs anything: no moment where a Ctrl-C reaches it)."""
    group: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    )
    proc = subprocess.Popen(args, executable=path, pass_fds=tuple(passfds), close_fds=True, **group)
    _SPAWNED.append(proc)
    return proc.pid


#: multiprocessing temporary folders whose removal on an interrupt is registered.
_TEMP_DIRS: set[str] = set()


def _remove_temp_dir_on_interrupt() -> None:
    """multiprocessing keeps the forkserver's socket in a ``pymp-*`` folder (its ranks share it) that it
    removes at exit; an interrupt leaves with ``os._exit`` (no atexit), so it is removed as an undo action
    (registered once, before the ranks' stop: undo actions run newest first)."""
    tempdir = multiprocessing.util.get_temp_dir()
    if tempdir not in _TEMP_DIRS:
        _TEMP_DIRS.add(tempdir)
        interrupts.on_interrupt(lambda: shutil.rmtree(tempdir, ignore_errors=True))


def _run(
    ctx: Any,
    ranks: _Ranks,
    conns: list[Connection],
    fn: Callable[..., Any],
    nproc: int,
    port: int,
    args: tuple,
    level: int,
    timeout: float | None,
) -> list[Any]:
    _start_forkserver()
    for rank in range(nproc):
        parent, child = ctx.Pipe(duplex=False)
        # Not daemonic: a rank may start processes of its own (megatron-core's checkpoint writers,
        # data loaders). Nothing depends on the flag: every rank is reaped before run_local returns,
        # and a rank ends with its launcher (the pidfd watch).
        proc = ctx.Process(
            target=_rank_main, args=(fn, rank, nproc, port, child, args, level, this_process()), daemon=False
        )
        with interrupts.uninterruptible():  # an interrupt then sees the process and stops it
            proc.start()
            ranks.procs.append(proc)
        child.close()
        conns.append(parent)
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        ready = wait(list(pending.values()), timeout=timeout)
        if not ready:
            raise LaunchError(f"ranks {sorted(pending)} did not finish within {timeout} s")
        for rank in [r for r, c in pending.items() if c in ready]:
            try:
                kind, value = pickle.loads(pending.pop(rank).recv_bytes())
            except EOFError:
                proc = ranks.procs[rank]
                proc.join(5)
                signum = _signal_of(proc.exitcode)
                if signum is not None:
                    raise interrupts.Interrupted(signum) from None
                raise LaunchError(f"rank {rank} died (exit code {proc.exitcode})") from None
            ranks.reported.add(rank)
            if kind == "err":
                summary, trace = value
                logger.debug("rank %d failed:\n%s", rank, trace)
                raise LaunchError(f"rank {rank}: {summary}")
            results[rank] = value
    return [results[r] for r in range(nproc)]
