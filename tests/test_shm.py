"""The shared-memory transport on its own: names, modes, exact sizes, the background spare."""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from distribute_utils import PayloadError, wire
from distribute_utils.transports import shm

PID = os.getpid()


def _ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("du_") and n.endswith(f"_{PID}")}


def _transport() -> shm.SharedMemoryTransport:
    return shm.SharedMemoryTransport({0: PID, 1: PID})


def test_segment_is_private_exact_and_gone_after_fetch() -> None:
    transport = _transport()
    payload = wire.encode({"w": torch.arange(1000, dtype=torch.int32)})
    transport.publish("00000000000000aa", 1, payload)
    path = shm.segment_path("00000000000000aa", 1, PID)
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == payload.nbytes
    buf = transport.fetch("00000000000000aa", 1)
    assert not os.path.exists(path)  # unlinked at attach
    assert torch.equal(wire.decode(buf)["w"], torch.arange(1000, dtype=torch.int32))
    transport.release("00000000000000aa", 1)  # idempotent after the reader took it


def test_publishing_twice_under_one_name_is_refused() -> None:
    transport = _transport()
    payload = wire.encode(1)
    transport.publish("00000000000000ab", 1, payload)
    try:
        with pytest.raises(FileExistsError):
            transport.publish("00000000000000ab", 1, payload)
    finally:
        transport.release("00000000000000ab", 1)
    assert _ours() == set()


def test_a_segment_whose_size_disagrees_with_its_payload_is_rejected() -> None:
    transport = _transport()
    transport.publish("00000000000000ac", 1, wire.encode(torch.zeros(100)))
    path = shm.segment_path("00000000000000ac", 1, PID)
    os.truncate(path, os.stat(path).st_size + 64)
    with pytest.raises(PayloadError, match=r"holds .* bytes but its payload says"):
        transport.fetch("00000000000000ac", 1)
    assert not os.path.exists(path)
    with pytest.raises(PayloadError, match="published no segment"):
        transport.fetch("00000000000000ad", 1)


def test_spare_segment_is_invisible_and_reused_for_the_next_large_payload() -> None:
    transport = _transport()
    big = torch.arange(2 * 2**20, dtype=torch.float32)  # 8 MiB, above the spare threshold
    transport.publish("00000000000000b0", 1, wire.encode(big))
    wire.decode(transport.fetch("00000000000000b0", 1))
    deadline = time.monotonic() + 10
    while shm._SPARE._ready is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shm._SPARE._ready is not None, "no spare was reserved after a large publish"
    assert _ours() == set(), "the spare must not be visible in /dev/shm"
    spare_inode = os.fstat(shm._SPARE._ready[0]).st_ino
    # A payload that fits takes the spare over: same pages, the round's name, the exact size.
    payload = wire.encode(big * 2)
    transport.publish("00000000000000b1", 1, payload)
    path = shm.segment_path("00000000000000b1", 1, PID)
    assert os.stat(path).st_ino == spare_inode
    assert os.stat(path).st_size == payload.nbytes and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    got = wire.decode(transport.fetch("00000000000000b1", 1))
    assert torch.equal(got, big * 2)
    # A payload far smaller than the spare does not take it.
    while shm._SPARE._ready is None and time.monotonic() < deadline:
        time.sleep(0.01)
    before = shm._SPARE._ready
    transport.publish("00000000000000b2", 1, wire.encode(torch.zeros(10)))
    assert shm._SPARE._ready == before
    wire.decode(transport.fetch("00000000000000b2", 1))
    assert _ours() == set()
