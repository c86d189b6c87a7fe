"""Run a function on N local ranks, or as one rank of a job started by ``torchrun``.

Used by the CLI: ``distribute-utils demo`` and ``consolidate --nproc N`` spawn their own
ranks (gloo over a ``TCPStore`` on 127.0.0.1 hosted by the launching process, so a dying rank
never takes the rendezvous with it); under ``torchrun`` they join the existing job instead.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from .errors import LaunchError

__all__ = ["LaunchError", "run_local", "under_torchrun"]

logger = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """Whether this process was started as one rank of a ``torchrun`` (or similar) job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, conn: Connection, args: tuple, level: int
) -> None:
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
        conn.send_bytes(pickle.dumps(("err", ("result could not be sent back", traceback.format_exc()))))
    # Run the exit handlers (they remove workspace namespaces), then skip the seconds that
    # tearing down torch's modules costs: the result is already with the parent.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks joined in a gloo group.

    ``fn`` must be importable (a module-level function). Returns every rank's result.

    Raises:
        LaunchError: a rank raised or died; the others are stopped and every process reaped.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1; got {nproc}")
    # Ranks fork from a server that imported torch once: on 2 cores, four processes each
    # importing torch at the same time cost ~10 s before any work starts.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "distribute_utils.gather", fn.__module__])
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    level = logging.getLogger().getEffectiveLevel()
    procs, conns = [], []
    try:
        for rank in range(nproc):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main, args=(fn, rank, nproc, store.port, child, args, level), daemon=True
            )
            proc.start()
            child.close()
            procs.append(proc)
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
                    procs[rank].join(5)
                    raise LaunchError(f"rank {rank} died (exit code {procs[rank].exitcode})") from None
                if kind == "err":
                    summary, trace = value
                    logger.debug("rank %d failed:\n%s", rank, trace)
                    raise LaunchError(f"rank {rank}: {summary}")
                results[rank] = value
        return [results[r] for r in range(nproc)]
    finally:
        for proc in procs:
            proc.join(timeout=2 if proc.is_alive() else 0)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
        for conn in conns:
            conn.close()
