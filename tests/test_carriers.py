"""The carriers through their one interface (``transports/base.py``, ``transports/carriers.py``), in one
process: every CPU carrier round-trips a payload by the call order the round uses; receipts are dispatched
by their tag only; the fault-injection point runs where it says. A new carrier adds its case here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distribute_utils import PayloadError, wire
from distribute_utils.transports import carriers, shm
from distribute_utils.transports.base import Carrier, Context
from distribute_utils.transports.inline import INLINE, AttachedCarrier
from distribute_utils.transports.namespace import FILE_SUFFIX, job_token
from distribute_utils.transports.workspace import WorkspaceTransport

TOKEN = "00000000000000f0"
VALUE = {"w": torch.arange(50_000, dtype=torch.float32), "name": "layer"}


def _ours() -> set[str]:
    return {
        n
        for n in os.listdir(shm.SHM_DIR)
        if n.startswith(shm.SEGMENT_PREFIX) and n.endswith(f"_{os.getpid()}")
    }


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[WorkspaceTransport]:
    with WorkspaceTransport(tmp_path, job_token(), 30.0) as ws:
        yield ws


def _senders(workspace: WorkspaceTransport, arrived: dict[int, Any]) -> dict[str, Carrier]:
    """One sending carrier of each CPU kind; ``arrived``: where an attached payload lands (the round puts
    what followed the claim there)."""
    return {
        "inline": INLINE,
        "attached": AttachedCarrier(arrived),
        "shm": shm.SharedMemoryTransport(),
        "workspace": workspace,
    }


@pytest.mark.parametrize("kind", ["inline", "attached", "shm", "workspace"])
def test_each_carrier_round_trips_by_its_receipt_alone(kind: str, workspace: WorkspaceTransport) -> None:
    context = Context(first=0, seconds=30.0, workspace=lambda: workspace)
    carrier = _senders(workspace, context.arrived)[kind]
    payload = wire.encode(VALUE, checksum=kind == "workspace")
    sent = carriers.publish(carrier, TOKEN, 1, payload)
    assert sent.receipt[0] == kind and carriers.carrier_of(sent.receipt, 1) is type(carrier)
    if isinstance(carrier, AttachedCarrier):  # the round sends it after the claim; the receiver keeps it
        assert carrier.outgoing is not None
        context.arrived[1] = memoryview(carrier.outgoing.to_bytes())
    got = wire.decode(carriers.Receiving(context).fetch(TOKEN, 1, sent.receipt))
    assert torch.equal(got["w"], VALUE["w"]) and got["name"] == "layer"
    del got
    sent.release(taken=True)
    assert _ours() == set(), "no segment left"
    assert [n for n in os.listdir(workspace.namespace) if n.endswith(FILE_SUFFIX)] == [], "no file left"


def test_a_receipt_of_no_known_carrier_is_refused_naming_its_sender() -> None:
    receiving = carriers.Receiving(Context(first=0, seconds=1.0))
    for receipt in (None, "n:1:2", ["teleport", b""], ["shm"], [1, 2]):
        with pytest.raises(PayloadError, match="rank 3 published its payload with an unknown receipt"):
            receiving.fetch(TOKEN, 3, receipt)
    with pytest.raises(PayloadError, match="no workspace_path"):
        receiving.fetch(TOKEN, 3, ["workspace", None])


def test_a_fault_at_published_releases_what_was_published() -> None:
    """A hook that raises at "published" fails the send as a later error would: the named segment is gone."""

    def fail(point: str, rank: int, carrier: Carrier, value: Any) -> None:
        if point == "published":
            assert _ours(), "called once the segment exists"
            raise RuntimeError("injected")

    before = carriers.inject(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            carriers.publish(shm.SharedMemoryTransport(), TOKEN, 1, wire.encode(VALUE))
    finally:
        carriers.inject(before)
    assert _ours() == set()


def test_fetching_and_fetched_hooks_see_each_payload_and_may_replace_it() -> None:
    seen: list[tuple[str, int, str]] = []

    def corrupt(point: str, rank: int, carrier: Carrier, value: Any) -> Any:
        seen.append((point, rank, carrier.kind))
        if point == "fetched":
            broken = bytearray(value)
            broken[0] ^= 0xFF
            return broken
        return None

    sent = carriers.publish(INLINE, TOKEN, 2, wire.encode(VALUE))
    before = carriers.inject(corrupt)
    try:
        buffer = carriers.Receiving(Context(first=0, seconds=1.0)).fetch(TOKEN, 2, sent.receipt)
    finally:
        carriers.inject(before)
    assert seen == [("fetching", 2, "inline"), ("fetched", 2, "inline")]
    with pytest.raises(PayloadError, match="magic"):
        wire.decode(buffer)


def test_every_carrier_declares_what_it_can_do() -> None:
    """Each carrier says where its receiver may run, what it does with GPU tensors, whether it needs the
    first rank's go or checksums, and what it reads; the router reads these, never a carrier's name."""
    from distribute_utils.transports import router

    for kind, cls in carriers.KINDS.items():
        assert cls.kind == kind
        assert cls.scope in ("host", "any"), (kind, cls.scope)
        assert cls.devices in ("keeps_gpu", "to_cpu"), (kind, cls.devices)
        assert isinstance(cls.needs_go, bool) and isinstance(cls.checksums, bool), kind
        assert isinstance(cls.settings, tuple) and all(isinstance(s, str) for s in cls.settings), kind
    # Between hosts: only carriers whose receivers may run anywhere; what the roles do around each.
    for name, asked in router.REQUESTS.items():
        if asked.forced is not None:
            assert asked.forced.scope == "any" and router.across(asked, True) is asked.forced, name
    auto = router.REQUESTS["auto"]
    assert router.across(auto, True).checksums and not router.across(auto, True).needs_go
    assert router.across(auto, False).needs_go, "a collective send waits for the first rank's go"
    assert router.cross_carrier(router.across(auto, False).kind) is router.across(auto, False)
