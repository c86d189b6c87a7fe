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
