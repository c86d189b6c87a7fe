"""A sender waits for its verdict as SCHED_BATCH (woken, it does not preempt the first rank)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distribute_utils import get_tensors_parallel
from distribute_utils._sched import BehindPeers

from harness import RankPool


def _policy_and_nice() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_behind_peers_is_batch_inside_and_gives_back_policy_and_nice() -> None:
    before = _policy_and_nice()
    assert before[0] == os.SCHED_OTHER
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before[1] + 1)  # a thread's own nice
    try:
        with BehindPeers():
            inside = _policy_and_nice()
        assert inside == (os.SCHED_BATCH, before[1] + 1), "batch, the nice value kept"
        assert _policy_and_nice() == (os.SCHED_OTHER, before[1] + 1)
        with pytest.raises(KeyError), BehindPeers():
            raise KeyError("the block failed")
        assert _policy_and_nice()[0] == os.SCHED_OTHER, "given back after an exception too"
    finally:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before[1])


def test_behind_peers_leaves_another_policy_alone() -> None:
    """A thread its user made SCHED_IDLE stays so (it may not even come back from SCHED_BATCH)."""
    seen: dict[str, int] = {}

    def idle_thread() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        with BehindPeers():
            seen["inside"] = os.sched_getscheduler(0)
        seen["after"] = os.sched_getscheduler(0)

    worker = threading.Thread(target=idle_thread)
    worker.start()
    worker.join()
    assert seen == {"inside": os.SCHED_IDLE, "after": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "only the calling thread is touched"


def _policy_while_waiting_for_the_verdict(key: str) -> dict[str, Any]:
    """Rank 0 enters the gather only once rank 1's watcher has seen rank 1 wait for it as SCHED_BATCH."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    seen: list[int] = []
    if rank > 1:
        return {"seen": seen, "after": os.sched_getscheduler(0)}
    # The group's first meeting, behind us: the next gather goes straight to its verdict.
    with get_tensors_parallel(torch.zeros(1), [0, 1], [0, 1], timeout=60) as warm:
        assert len(warm) == (2 if rank == 0 else 0)
    if rank == 1:
        tid = threading.get_native_id()

        def watch() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                policy = os.sched_getscheduler(tid)
                if policy == os.SCHED_BATCH:
                    seen.append(policy)
                    store.set(key, b"1")
                    return
                time.sleep(0.001)
            store.set(key, b"0")

        threading.Thread(target=watch, daemon=True).start()
    if rank == 0:
        store.wait([key])
    with get_tensors_parallel(torch.full((1000,), float(rank)), [0, 1], [0, 1], timeout=60) as got:
        values = [float(t[0]) for t in got]
    return {
        "seen": seen,
        "after": os.sched_getscheduler(0),
        "got": values,
        "key": store.get(key),
    }


def test_a_sender_waits_for_its_verdict_as_batch_and_comes_back(ranks4: RankPool) -> None:
    results = ranks4.run(_policy_while_waiting_for_the_verdict, f"sched-test/{uuid.uuid4().hex}")
    assert results[1]["seen"] == [os.SCHED_BATCH] and results[0]["key"] == b"1", results[1]
    assert results[0]["got"] == [0.0, 1.0]
    assert all(r["after"] == os.SCHED_OTHER for r in results), results


def test_behind_peers_where_the_policy_may_not_change_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container that forbids sched_setscheduler (EPERM): the wait goes on unchanged, no error."""

    def refused(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    with BehindPeers():
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
