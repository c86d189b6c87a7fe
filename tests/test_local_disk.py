"""The local-disk carrier: payloads in files on this host's disk when /dev/shm has no room.

Through its interface (publish, then the receiving side's fetch through ``carriers.Receiving``), as a
real second user, with a real process killed after publishing, and in a real torchrun job whose
private /dev/shm is too small (test_small_shm.py).
"""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from distribute_utils import PayloadError, hygiene, wire
from distribute_utils.transports import carriers
from distribute_utils.transports.base import Context
from distribute_utils.transports.local_disk import LOCAL_DIR_ENV, LocalDiskCarrier, local_dir


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local directory of the test's own (``$DISTRIBUTE_UTILS_LOCAL_DIR``)."""
    monkeypatch.setenv(LOCAL_DIR_ENV, str(tmp_path))
    return tmp_path


def _fetch(token: str, rank: int, receipt: list[object]) -> object:
    receiving = carriers.Receiving(Context(first=0, seconds=10))
    return receiving.fetch(token, rank, [LocalDiskCarrier.kind, receipt])


def test_a_payload_goes_through_a_private_file_exactly_and_leaves_nothing(disk: Path) -> None:
    value = {"w": torch.randn(1000, dtype=torch.bfloat16), "n": 3, "e": torch.empty(0, 2)}
    sent = carriers.publish(LocalDiskCarrier(), "00000000000000a1", 1, wire.encode(value))
    private = Path(local_dir())
    assert private.parent == disk and stat.S_IMODE(private.stat().st_mode) == 0o700
    (path,) = private.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.name.endswith(f"_1_{os.getpid()}")
    got = wire.decode(_fetch("00000000000000a1", 1, sent.data))
    assert torch.equal(got["w"].view(torch.int16), value["w"].view(torch.int16)) and got["n"] == 3
    assert got["e"].shape == (0, 2)
    assert list(private.iterdir()) == [], "the first rank unlinks the file once mapped"
    sent.release(taken=True)  # idempotent: nothing left to remove


def test_an_unfetched_payload_is_removed_by_its_sender_or_the_first_rank(disk: Path) -> None:
    for who in ("sender", "first rank"):
        sent = carriers.publish(LocalDiskCarrier(), "00000000000000a2", 2, wire.encode(torch.ones(10)))
        if who == "sender":
            sent.release(taken=False)
        else:
            carriers.Receiving(Context(first=0, seconds=10)).discard(
                "00000000000000a2", 2, [LocalDiskCarrier.kind, sent.data]
            )
        assert list(Path(local_dir()).iterdir()) == [], who


def test_receipts_pointing_elsewhere_are_refused(
    disk: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sent = carriers.publish(LocalDiskCarrier(), "00000000000000a3", 1, wire.encode(torch.ones(10)))
    open_dir = tmp_path_factory.mktemp("open")
    open_dir.chmod(0o777)
    for receipt, says in (
        ([str(open_dir), os.getpid(), sent.data[2]], "unusable directory"),
        (["relative", os.getpid(), 1], "malformed local-disk receipt"),
        ([sent.data[0], os.getpid(), sent.data[2] + 64], "holds"),
    ):
        with pytest.raises(PayloadError, match=says):
            _fetch("00000000000000a3", 1, receipt)
    sent.release(taken=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root (CI runs as root)")
def test_another_users_file_at_a_ranks_name_is_refused(disk: Path) -> None:
    sent = carriers.publish(LocalDiskCarrier(), "00000000000000a4", 1, wire.encode(torch.ones(10)))
    (path,) = Path(local_dir()).iterdir()
    os.chown(path, 65534, 65534)  # as if another user had put it there
    with pytest.raises(PayloadError, match="belongs to uid 65534"):
        _fetch("00000000000000a4", 1, sent.data)
    sent.release(taken=False)


def test_a_killed_senders_file_is_found_and_removed_by_clean(disk: Path) -> None:
    """A sender killed after it published leaves its file; doctor lists it, clean removes it (never a
    live process's file), and so does the first rank that sees the sender die (remove_left_by)."""
    script = (
        "import os, sys, torch\n"
        "from distribute_utils import wire\n"
        "from distribute_utils.transports import carriers\n"
        "from distribute_utils.transports.local_disk import LocalDiskCarrier\n"
        "carriers.publish(LocalDiskCarrier(), '00000000000000a5', int(sys.argv[1]), wire.encode(torch.ones(10)))\n"
        "print('published', flush=True)\n"
        "sys.stdin.read()\n"
    )
    live = carriers.publish(LocalDiskCarrier(), "00000000000000a6", 0, wire.encode(torch.ones(10)))
    gone = []
    for rank in (1, 2):
        proc = subprocess.Popen(
            ["python", "-c", script, str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "published\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        gone.append(proc.pid)
    report = io.StringIO()
    hygiene.doctor(None, report)
    text = report.getvalue()
    assert "payload file(s) on local disk: 3, " in text, text
    assert f"du_00000000000000a5_1_{gone[0]}  104 B  owner pid {gone[0]} dead  -> stale" in text, text
    assert f"du_00000000000000a6_0_{os.getpid()}  104 B  owner pid {os.getpid()} alive\n" in text, text
    assert carriers.remove_left_by(2, gone[1]) == [
        str(Path(local_dir()) / f"du_00000000000000a5_2_{gone[1]}")
    ]
    out = io.StringIO()
    assert hygiene.clean(None, False, out) == 0
    removed = Path(local_dir()) / f"du_00000000000000a5_1_{gone[0]}"
    assert f"removed {removed} (104 B, owner pid {gone[0]} has exited)" in out.getvalue(), out.getvalue()
    assert "removed 1 payload file(s) on local disk (104 B), kept 1 of live processes" in out.getvalue()
    names = [p.name for p in Path(local_dir()).iterdir()]
    assert names == [f"du_00000000000000a6_0_{os.getpid()}"], "only the live process's file is left"
    live.release(taken=False)


def test_an_interrupted_sender_removes_its_file(disk: Path) -> None:
    """SIGTERM to a process (its interrupts installed, as a rank's are) that published to the local disk
    and waits: it removes its file before it exits (the carrier registered its undo before the file)."""
    script = (
        "import sys, torch\n"
        "from distribute_utils import interrupts, wire\n"
        "from distribute_utils.transports import carriers\n"
        "from distribute_utils.transports.local_disk import LocalDiskCarrier\n"
        "interrupts.install()\n"
        "carriers.publish(LocalDiskCarrier(), '00000000000000a7', 1, wire.encode(torch.ones(10)))\n"
        "print('published', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        ["python", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "published\n"
    assert [p.name for p in Path(local_dir()).iterdir()] == [f"du_00000000000000a7_1_{proc.pid}"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert list(Path(local_dir()).iterdir()) == [], "the interrupted sender removed its file"


def test_the_router_places_carriers_by_their_medium_and_a_full_one_passes_the_payload_on(
    disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The host route is the router's chain of declared carriers: cheapest medium first, the local disk
    (a carrier that leaves shared memory) only where the request allows, and a carrier with no room
    passes the payload to the next one, said in a warning."""
    import errno
    import logging

    from distribute_utils import SpaceError
    from distribute_utils.processes import this_process
    from distribute_utils.transports import router

    media = [c.medium for c in router.HOST_CARRIERS]
    assert media == sorted(media, key=router.HOST_MEDIA.index)
    assert (
        {c.kind for c in router.HOST_CARRIERS}
        == {kind for kind, c in carriers.KINDS.items() if c.medium in router.HOST_MEDIA}
        >= {"inline", "shm", "local_disk", "workspace"}
    )

    def no_room(point: str, rank: int, carrier: object, value: object) -> None:
        if point == "published" and getattr(carrier, "kind", "") == "shm":
            raise SpaceError(errno.ENOSPC, "no room (the test)")

    value = torch.arange(2**18, dtype=torch.float32)  # 1 MiB: past the inline bound
    me = this_process()
    kept = carriers.inject(no_room)
    try:
        routes = {
            name: router.host_route(
                router.REQUESTS[name], me, pool=True, cuda=False, workspace=None, what="t"
            )
            for name in ("auto", "shm")
        }
        with caplog.at_level(logging.INFO):
            sent = routes["auto"].publish("00000000000000b1", 1, wire.encode(value))
        assert sent.receipt[0] == LocalDiskCarrier.kind
        assert "/dev/shm cannot hold rank 1's payload" in caplog.text and local_dir() in caplog.text
        assert torch.equal(wire.decode(_fetch("00000000000000b1", 1, sent.data)), value)
        sent.release(taken=True)
        small = routes["auto"].publish("00000000000000b2", 1, wire.encode(torch.ones(4)))
        assert small.receipt[0] == "inline", "the cheapest medium that takes it"
        with pytest.raises(SpaceError, match=r"no room \(the test\)$"):  # shm only: no other carrier
            routes["shm"].publish("00000000000000b3", 1, wire.encode(value))
    finally:
        carriers.inject(kept)
    assert list(Path(local_dir()).iterdir()) == []
