"""The README's example as a real torchrun job: it runs, and every rank exits cleanly.

A job that never calls ``destroy_process_group`` must still exit with code 0: the library's
background threads (key deletion, watchdog) are stopped at interpreter exit, so none is left
inside a store call while the interpreter tears down (which aborts the process with
"terminate called without an active exception").
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness import torchrun_argv

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_under_torchrun_and_exits_cleanly(tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "the README has no Python example"
    script = tmp_path / "readme_example.py"
    # More barriers than the example has, so background key deletions are still running at exit.
    script.write_text(code.group(1) + "\nfor _ in range(20):\n    mesh.barrier(timeout=60)\n")
    for attempt in range(2):  # the race it guards against needs a couple of tries to show
        proc = subprocess.run(
            torchrun_argv(4, str(script)),
            capture_output=True,
            text=True,
            timeout=180,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"attempt {attempt}: {output[-3000:]}"
        assert "terminate called" not in output, output[-3000:]
        assert "[0, 1, 2, 3]" in proc.stdout
