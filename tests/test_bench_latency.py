"""Smoke runs of ``scripts/bench_latency.py``'s measuring modes (not timed: they must run and report).

The latency targets live in the benchmark and ``docs/performance.md``; these tests only keep its
modes working: ``--against`` (this checkout and an older revision in the same ranks), ``--cpu``
(every method back to back, the store-free ``direct`` one included), ``--steps --cold`` (one call's
CPU split into steps, caches evicted before each call), ``--timeline`` (where a cold call's wall time
goes), ``--first`` (gathers that need new segments) and the sweep's paired ratios and spread.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import SCRIPTS, load_script


def _bench(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_latency.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _printed_ratio_fits(ratio: float, num: float, den: float, places: int) -> bool:
    """Whether a printed ratio (2 decimals) can be ``num / den`` for values printed with ``places``
    decimals: the bench divides the unrounded values, so only the rounding interval can be asserted."""
    half = 0.5 * 10.0**-places
    assert den > half, f"denominator {den} printed as zero"
    return (num - half) / (den + half) - 0.005 <= ratio <= (num + half) / (den - half) + 0.005


def test_against_a_revision_runs_both_versions_in_the_same_ranks() -> None:
    out = _bench("--against", "HEAD", "--sizes", "4K", "--reps", "3")
    row = next(line for line in out.splitlines() if line.strip().startswith("4K"))
    wall_ours, wall_then, wall_ratio, all_ours, all_then, all_ratio, cpu_ours, cpu_then, cpu_ratio = map(
        float, row.split()[1:]
    )
    assert wall_ours > 0 and wall_then > 0 and cpu_ours > 0 and cpu_then > 0, row
    assert all_ours >= wall_ours and all_then >= wall_then, "every rank's return includes rank 0's"
    assert _printed_ratio_fits(wall_ratio, wall_ours, wall_then, 3), row
    assert _printed_ratio_fits(all_ratio, all_ours, all_then, 3), row
    assert _printed_ratio_fits(cpu_ratio, cpu_ours, cpu_then, 0), row


def test_against_an_unknown_revision_says_so() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_latency.py"), "--against", "no-such-revision", "--sizes", "4K"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "--against no-such-revision: git archive failed" in done.stderr, (
        done.stderr
    )


def test_a_copy_that_imports_itself_by_name_is_refused(tmp_path: Path) -> None:
    bench = load_script("bench_latency")
    by_name = tmp_path / "a.py"
    by_name.write_text(
        '"""from distribute_utils import gather (in a docstring)"""\nfrom distribute_utils.wire import encode\n'
    )
    relative = tmp_path / "b.py"
    relative.write_text('"""import distribute_utils"""\nfrom .wire import encode\nimport os\n')
    assert bench._imports_itself(by_name)
    assert not bench._imports_itself(relative)


def test_cpu_mode_measures_every_method_including_the_store_free_round() -> None:
    out = _bench("--cpu", "--sizes", "4K", "--rounds", "30")
    methods = {m.group(1) for m in re.finditer(r"^\s+4K\s+(\S+)\s", out, re.MULTILINE)}
    assert methods >= {"ours", "limit", "gloo", "bare", "bare+wire", "direct"}, out
    # The store server's CPU (the launching process): the store round costs it, the direct one not.
    server = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^\s+4K\s+(\S+)\s.*store server\s+(\d+)", out, re.M)
    }
    assert server.keys() == methods and server["bare"] > server["direct"], out


def test_steps_mode_splits_a_cold_call_into_steps() -> None:
    """``--steps --cold``: every rank evicts its caches before each call; a call's steps add up to it."""
    out = _bench("--steps", "--cold", "--sizes", "4K", "--rounds", "20")
    assert "caches evicted before each call" in out, out
    header = next(line for line in out.splitlines() if line.strip().startswith("size")).split()
    for rank in ("0", "1"):
        row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["4K", rank])
        spent = dict(zip(header[2:], map(float, row[2:]), strict=True))
        assert spent["python"] > 0 and spent["wire"] > 0 and spent["call"] > 0, out
        # Medians of parts need not add up exactly; each part is within the call.
        assert max(spent[s] for s in ("python", "wire", "publish", "fetch")) <= spent["call"], out


def test_timeline_mode_follows_cold_calls_on_the_shared_clock() -> None:
    """``--timeline``: every span of a call is reported for each size, the parts within their whole."""
    out = _bench("--timeline", "--sizes", "4K", "--rounds", "20")
    assert "where a cold call's wall time goes" in out, out
    spans = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^ +(\w+(?: \w+)?) +(-?[\d.]+) \(", out, flags=re.MULTILINE)
    }
    assert set(spans) == {"spread", "after", "sender", "on way", "rank 0", "cpu s", "cpu 0"}, out
    assert spans["after"] > 0 and spans["sender"] > 0 and spans["rank 0"] > 0, out
    assert spans["cpu s"] > 0 and spans["cpu 0"] > 0, out
    assert spans["rank 0"] <= spans["after"], out


def test_timeline_spans_are_worked_out_from_each_ranks_marks() -> None:
    """The spans of one call, from made-up marks (ns): which rank started last, whose claim went last."""
    bench = load_script("bench_latency")
    rank0 = {"start": 1_000, "start cpu": 0, "taken": 9_000, "end": 12_000, "end cpu": 7_000}
    early = {"start": 2_000, "start cpu": 100, "sent": 8_000, "sent cpu": 3_100}  # starts first, sends last
    late = {"start": 4_000, "start cpu": 500, "sent": 6_000, "sent cpu": 2_000}
    rows = bench._timeline_rows([[rank0], [early], [late]])
    assert rows["spread"] == [3.0]  # 1 000 to 4 000 ns
    assert rows["after"] == [8.0]  # from the last start (4 000) to rank 0's end (12 000)
    assert rows["sender"] == [2.0]  # the last to start: 4 000 to its claim at 6 000
    assert rows["on way"] == [1.0]  # the last claim to go (8 000) to rank 0 taking it (9 000)
    assert rows["rank 0"] == [3.0] and rows["cpu 0"] == [7.0]
    assert rows["cpu s"] == [3.0, 1.5]  # each sender's


def test_cold_without_steps_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_latency.py"), "--cold", "--sizes", "4K"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--cold goes with --steps" in done.stderr, done.stderr


def test_the_sweep_reports_paired_ratios_beside_the_ratios_of_medians() -> None:
    out = _bench("--sizes", "4K", "--reps", "3")
    row = next(line for line in out.splitlines() if line.strip().startswith("4K"))
    assert float(row.split()[-3]) > 0, row  # ours/limit of the medians
    paired = re.search(r"paired .*: 4K ([0-9.]+) / ([0-9.]+)", out)
    assert paired is not None and float(paired[1]) > 0 and float(paired[2]) > 0, out
    # The spread: the 10th, 50th and 90th percentile of ours and of the limit, in order.
    spread = re.search(
        r"spread .*: 4K ours ([0-9.]+)/([0-9.]+)/([0-9.]+) · limit ([0-9.]+)/([0-9.]+)/([0-9.]+)", out
    )
    assert spread is not None, out
    ours, limit = [float(x) for x in spread.groups()[:3]], [float(x) for x in spread.groups()[3:]]
    assert ours == sorted(ours) and limit == sorted(limit) and ours[0] > 0, out


def test_first_mode_times_gathers_that_need_new_segments() -> None:
    out = _bench("--first", "--sizes", "1M", "--reps", "3")
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("1M"))
    ours, fresh, ratio = map(float, row[1:])
    assert ours > 0 and _printed_ratio_fits(ratio, ours, fresh, 2), out


def test_a_failed_run_leaves_none_of_its_limit_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that fail never close their limits: the launching process removes this run's segments (and
    only this run's) however the run ends."""
    monkeypatch.delenv("DU_BENCH_RUN", raising=False)
    bench = load_script("bench_latency")
    other = Path("/dev/shm/du-bench-limit-otherrun-copy-1")
    other.write_bytes(b"x")
    try:
        with pytest.raises(RuntimeError, match="a rank failed"), bench._limits_removed_at_end():
            mine = Path(f"{bench._limit_prefix()}copy-{os.getpid()}")
            mine.write_bytes(b"x")
            raise RuntimeError("a rank failed")
        assert not mine.exists(), "this run's segment is removed"
        assert other.exists(), "another run's is not"
    finally:
        other.unlink(missing_ok=True)
