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


@needs_root
def test_small_dev_shm_gives_clear_error_not_sigbus(tmp_path: Path) -> None:
    script = (
        "mount --make-rprivate / && mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "
        f"exec {shlex.join(torchrun_argv(4, str(JOBS / 'small_shm_job.py')))}"
    )
    env = dict(os.environ, DU_RESULTS=str(tmp_path), DU_PER_RANK_MIB="32", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        ["unshare", "--mount", "--ipc", "--fork", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "SIGBUS" not in proc.stderr and "Bus error" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
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
