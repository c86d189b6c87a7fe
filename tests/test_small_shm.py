"""A /dev/shm too small for the gather: a clear error on every rank, no SIGBUS, no leftovers.

Runs a real ``torchrun`` job of 4 ranks in a private mount namespace whose /dev/shm is a
64 MiB tmpfs while the ranks gather 128 MiB (root only: ``unshare --mount --ipc``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import torchrun_argv

JOBS = Path(__file__).parent / "jobs"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare to mount a private small tmpfs on /dev/shm",
)


def _small_shm_job(tmp_path: Path, transport: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """The job of 4 ranks, 32 MiB each, in a private mount namespace whose /dev/shm is 64 MiB."""
    script = (
        "mount --make-rprivate / && mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "
        f"exec {shlex.join(torchrun_argv(4, str(JOBS / 'small_shm_job.py')))}"
    )
    results = tmp_path / "results"
    results.mkdir()
    env = dict(
        os.environ,
        DU_RESULTS=str(results),
        DU_PER_RANK_MIB="32",
        DU_TRANSPORT=transport,
        GLOO_SOCKET_IFNAME="lo",
        DISTRIBUTE_UTILS_LOCAL_DIR=str(tmp_path / "disk"),
    )
    (tmp_path / "disk").mkdir()
    proc = subprocess.run(
        ["unshare", "--mount", "--ipc", "--fork", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "SIGBUS" not in proc.stderr and "Bus error" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads((results / f"rank{r}.json").read_text()) for r in range(4)]


@needs_root
def test_small_dev_shm_goes_through_the_local_disk_exactly(tmp_path: Path) -> None:
    """With ``transport="auto"``, what /dev/shm cannot hold goes through files on the local disk (the
    local-disk carrier), exactly, with a warning; nothing is left in /dev/shm or on the disk."""
    proc, reports = _small_shm_job(tmp_path, "auto")
    assert reports[0].get("exact") is True and reports[0]["received"] == 4, reports[0]
    assert all("error" not in r for r in reports), reports
    assert "it goes through the local disk" in proc.stderr, proc.stderr[-3000:]
    assert all(r["shm_left"] == [] and r["local_left"] == [] for r in reports), reports


@needs_root
def test_small_dev_shm_gives_clear_error_not_sigbus(tmp_path: Path) -> None:
    """With ``transport="shm"`` (shared memory only), the same job fails loudly on every rank."""
    _, reports = _small_shm_job(tmp_path, "shm")
    errors = [r.get("error", "") for r in reports]
    assert all(errors), f"every rank must fail loudly: {reports}"
    space = [e for e in errors if e.startswith("SpaceError")]
    assert space, errors
    assert "/dev/shm (size 67,108,864 bytes" in space[0], space[0]
    payload = re.search(r"cannot hold the ([\d,]+) bytes", space[0])
    assert payload, space[0]
    # 32 MiB of tensor bytes and the header (its exact size is the wire format's business)
    assert 32 * 2**20 < int(payload[1].replace(",", "")) < 32 * 2**20 + 4096, space[0]
    assert "SpaceError" in errors[0], "the first rank names the cause"
    assert all(r["shm_left"] == [] for r in reports), reports
