"""What a raw result records about the run it came from: the code, the machine, its load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def run_facts(argv: list[str], started: float, load_before: list[float]) -> dict[str, Any]:
    """The facts of a run that began at ``started`` (``time.time()``) with ``load_before``: the commit (and
    whether the tree had changes: a result of a dirty tree belongs to no commit), the command, the
    machine's cores, torch and Python, and the load before and after."""
    import torch

    return {
        "commit": _git("rev-parse", "--short=7", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": " ".join(["python", *argv]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "ended_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "executable": sys.executable,
    }
