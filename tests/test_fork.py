"""A process forked from a rank after it joined the default process group is refused by every entry point.

The child inherits the parent's store client, gloo connections and this package's sockets: whatever it
sent through them would mix with the parent's traffic. Every public call that synchronises raises
``ForkedProcessError`` in the child, before touching any of them, with the message documented in
docs/api.md; the parent gathers on unharmed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import (
    ProcessGroupMesh,
    barrier,
    gather_configs,
    gather_tensors,
    get_configs_parallel,
    get_tensors_parallel,
    modelopt,
)

CHILD_LIMIT_S = 60  # a child that hangs (the fault this tests) is ended by SIGALRM after this long


def _entered(make: Callable[[], AbstractContextManager[Any]]) -> Callable[[], None]:
    def run() -> None:
        with make():
            pass

    return run


def _entry_points(mesh: ProcessGroupMesh, tensor: torch.Tensor) -> dict[str, Callable[[], None]]:
    ranks = [0, 1]
    return {
        "get_tensors_parallel": _entered(lambda: get_tensors_parallel(tensor, ranks, timeout=10)),
        "get_configs_parallel": _entered(lambda: get_configs_parallel({"t": tensor}, ranks, timeout=10)),
        "gather_tensors": _entered(lambda: gather_tensors(tensor, mesh, "tp", timeout=10)),
        "gather_configs": _entered(lambda: gather_configs({"t": tensor}, mesh, "tp", timeout=10)),
        "modelopt.get_tensors_parallel": _entered(lambda: modelopt.get_tensors_parallel(tensor, ranks)),
        "modelopt.get_configs_parallel": _entered(
            lambda: modelopt.get_configs_parallel({"t": tensor}, ranks, None)
        ),
        "barrier": lambda: barrier(timeout=10),
        "barrier(ranks)": lambda: barrier(ranks, timeout=10),
        "mesh.barrier": lambda: mesh.barrier("tp", timeout=10),
    }


def _fork_and_call_every_entry_point() -> dict[str, Any]:
    """On every rank: gather once, fork a child that calls every entry point (recording what each
    raised), then gather again in the parent."""
    rank = dist.get_rank()
    mesh = ProcessGroupMesh(2, axis_names=("tp",))
    mesh.get_group_along_axis("tp")
    tensor = torch.full((1000,), float(rank))
    with get_tensors_parallel(tensor, [0, 1]) as got:  # the parent's sockets and store clients are in use
        assert len(got) == (2 if rank == 0 else 0)
    calls = _entry_points(mesh, tensor)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: never returns, never runs the parent's exit handlers
        try:
            os.close(read_end)
            signal.alarm(CHILD_LIMIT_S)
            os.environ["DISTRIBUTE_UTILS_TIMEOUT"] = "10"  # (ModelOpt's functions take no timeout)
            raised: dict[str, list[str]] = {}
            for name, call in calls.items():
                try:
                    call()
                    raised[name] = ["", "returned"]
                except BaseException as exc:
                    raised[name] = [type(exc).__name__, str(exc)]
            with os.fdopen(write_end, "w") as out:
                json.dump({"pid": os.getpid(), "raised": raised}, out)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        text = answer.read()  # until the child exits (or is ended by its alarm)
    _, status = os.waitpid(child, 0)
    with get_configs_parallel({"after": rank}, [0, 1], timeout=60) as configs:  # the parent gathers on
        after = configs
    return {"status": status, "child": json.loads(text) if text else None, "after": after, "pid": os.getpid()}


def test_every_entry_point_refuses_a_process_forked_after_the_group_was_made(pools) -> None:
    results = pools.get(2).run(_fork_and_call_every_entry_point, timeout=300)
    assert results[0]["after"] == [{"after": 0}, {"after": 1}] and results[1]["after"] == []
    for rank, result in enumerate(results):
        assert result["status"] == 0 and result["child"] is not None, f"rank {rank}'s child: {result}"
        child = result["child"]
        for name, (kind, message) in child["raised"].items():
            assert kind == "ForkedProcessError", f"rank {rank}'s child, {name}: {kind}: {message}"
            assert (
                f"called in a process (pid {child['pid']}) forked after its parent (pid {result['pid']})"
                in message
            ), message
            assert message.endswith("gather in the parent or start the child with spawn"), message
