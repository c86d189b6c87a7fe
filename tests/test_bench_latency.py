"""Smoke runs of ``scripts/bench_latency.py`` (not timed: its modes must run, read what they gather and
print ratios that are the ratios of the figures they print).

The latency targets live in ``docs/performance.md``; these tests keep the sweep (with ``--busy`` and
``--json``) and ``--against`` working, and check the parts the figures rest on: the checksum reads
every byte, the whole-round figures are worked out from every rank's stamps, and the script uses no
private name of the package.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import SCRIPTS, load_script

Table = dict[str, dict[str, float]]


def _bench(*args: str, script: str = "bench_latency.py", timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _tables(out: str) -> dict[str, Table]:
    """Every printed table by its title's first word(s) before ':' or ' (': a row per label, a value per
    column (methods, then ratios ``a/b``)."""
    lines = out.splitlines()
    tables: dict[str, Table] = {}
    for i, line in enumerate(lines):
        if i + 1 >= len(lines) or not lines[i + 1].startswith(" ") or not lines[i + 1].split():
            continue
        header = lines[i + 1].split()
        if "/" not in header[-1] or line.startswith(" "):
            continue
        title = line.split(":")[0].split(" (")[0]
        rows: Table = {}
        for row in lines[i + 2 :]:
            cells = row.split()
            if not row.startswith(" ") or len(cells) <= len(header):
                break
            label = " ".join(cells[: len(cells) - len(header)])
            values = zip(header, cells[-len(header) :], strict=True)
            rows[label] = {column: float(cell) for column, cell in values if cell != "-"}  # (-: not run)
        tables[title] = rows
    return tables


def _printed_ratio_fits(ratio: float, num: float, den: float, places: int) -> bool:
    """Whether a printed ratio (2 decimals) can be ``num / den`` for values printed with ``places``
    decimals: the bench divides the unrounded values, so only the rounding interval can be asserted."""
    half = 0.5 * 10.0**-places
    assert den > half, f"denominator {den} printed as zero"
    return (num - half) / (den + half) - 0.005 <= ratio <= (num + half) / (den - half) + 0.005


def _assert_consistent(table: Table, out: str) -> None:
    for label, row in table.items():
        for column, value in row.items():
            if "/" in column:
                num, den = column.split("/")
                assert _printed_ratio_fits(value, row[num], row[den], 3), (label, column, out)
            else:
                assert value > 0, (label, column, out)


def test_the_sweep_times_whole_rounds_and_prints_ratios_of_its_figures(tmp_path: Path) -> None:
    out = _bench("--sizes", "4K", "1M", "--reps", "3", "--busy", "1", "--json", str(tmp_path / "r.json"))
    tables = _tables(out)
    assert set(tables) == {"all done", "rank 0", "cpu", "tiny round trip"}, out
    for table in tables.values():
        _assert_consistent(table, out)
    done, rank0 = tables["all done"]["4K"], tables["rank 0"]["4K"]
    for method in ("ours", "floor", "answered", "bare", "gloo", "modelopt"):
        assert done[method] > 0 and done[method] >= rank0[method], (method, out)
    assert {"ours/floor", "gloo/ours", "modelopt/ours", "ours/answered", "answered/floor"} <= set(done), out
    assert {"ours/bare", "bare/floor"} <= set(done), out
    big = tables["all done"]["1M"]  # (a payload past one datagram: no bare round, its cells "-")
    assert "bare" not in big and "ours/bare" not in big and {"ours", "floor", "answered"} <= set(big), out
    tiny = tables["tiny round trip"]
    assert set(tiny) == {"all done", "rank 0", "cpu"}, out
    assert {"ours", "gather_object", "ping", "ours/ping", "gather_object/ours"} == set(tiny["all done"]), out
    assert "1 spinning processes beside the ranks" in out, out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["reps"] == {"4K": 3, "1M": 3, "tiny": 3}, saved
    assert "bare" in saved["summary"]["4K"] and "bare" not in saved["summary"]["1M"], saved
    assert round(saved["summary"]["4K"]["ours"]["all done"][1], 3) == done["ours"], saved


def test_against_a_revision_runs_both_versions_in_the_same_rounds() -> None:
    out = _bench("--against", "HEAD", "--sizes", "4K", "--reps", "2")
    tables = _tables(out)
    for table in tables.values():
        _assert_consistent(table, out)
    assert {"ours", "then", "floor", "ours/then", "ours/floor", "then/floor"} == set(tables["all done"]["4K"])
    assert {"ours", "then", "ping", "ours/then", "ours/ping"} == set(tables["tiny round trip"]["cpu"])


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
    assert bench.imports_itself(by_name)
    assert not bench.imports_itself(relative)


def test_the_checksum_reads_every_byte() -> None:
    """A change of any one byte, of a tensor of any size, changes the checksum."""
    bench = load_script("bench_latency")
    for nbytes in (4096, 4100, 7):
        base = torch.zeros(nbytes, dtype=torch.uint8)
        want = bench.sum_of_bytes([base, base])
        for at in range(nbytes):
            changed = base.clone()
            changed[at] = 1
            assert bench.sum_of_bytes([base, changed]) != want, (nbytes, at)


def test_whole_round_figures_come_from_every_ranks_stamps() -> None:
    """Made-up stamps (ns): all done from the earliest entry to the latest return, rank 0's own span, and
    the CPU of all ranks."""
    bench = load_script("bench_latency")
    rank0 = {"m": [(1_000_000, 3_000_000, 500_000), (0, 1_000_000, 100_000)]}
    early = {"m": [(500_000, 1_500_000, 200_000), (0, 4_000_000, 300_000)]}  # enters first / returns last
    late = {"m": [(2_000_000, 6_000_000, 300_000), (100_000, 200_000, 100_000)]}
    got = bench.summarise([rank0, early, late])["m"]
    low, median, high = got["all done"]
    assert 4.0 <= low <= median == 4.75 <= high <= 5.5 and got["rank 0"][1] == 1.5 and got["cpu"][1] == 0.75


def test_the_script_uses_no_private_name_of_the_package() -> None:
    """No ``_name`` imported from the package, nor read off anything imported from it."""
    tree = ast.parse((SCRIPTS / "bench_latency.py").read_text())
    imported = {"du_against", "against"}  # the package at --against's revision
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distribute_utils"):
            assert not any(p.startswith("_") for p in (node.module or "").split(".")), node.module
            assert not any(a.name.startswith("_") for a in node.names), ast.dump(node)
            imported |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            assert not node.attr.startswith("_"), f"{node.value.id}.{node.attr} (line {node.lineno})"


def test_a_failed_run_leaves_none_of_its_floor_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that fail never close their floors: the launching process removes this run's segments (and
    only this run's) however the run ends."""
    monkeypatch.delenv("DU_BENCH_RUN", raising=False)
    bench = load_script("bench_latency")
    other = Path("/dev/shm/du-bench-floor-otherrun-4096-1")
    other.write_bytes(b"x")
    try:
        with pytest.raises(RuntimeError, match="a rank failed"), bench.segments_removed_at_end():
            mine = Path(f"{bench.run_prefix()}4096-{os.getpid()}")
            mine.write_bytes(b"x")
            raise RuntimeError("a rank failed")
        assert not mine.exists(), "this run's segment is removed"
        assert other.exists(), "another run's is not"
    finally:
        other.unlink(missing_ok=True)


@pytest.mark.slow  # (mypyc compiles 11 modules: about 2 minutes on 2 cores)
def test_bench_compiled_runs_the_compiled_package_and_writes_every_pair(tmp_path: Path) -> None:
    """``scripts/bench_compiled.py`` compiles the hot modules of a copy of HEAD and measures both copies:
    the compiled one really runs compiled code (a small part of the interpreted one's Python calls per
    round), and each pair's ratios are those of its raw figures."""
    out = tmp_path / "compiled.json"
    args = ["--pairs", "1", "--rounds", "30", "--reps", "3", "--json", str(out)]
    printed = _bench(*args, script="bench_compiled.py", timeout=900)
    (pair,) = json.loads(out.read_text())["pairs"]
    compiled, interpreted = pair["compiled"], pair["interpreted"]
    assert compiled["calls"][0] < 0.5 * interpreted["calls"][0], (compiled["calls"], interpreted["calls"])
    assert compiled["calls"][1] < 0.5 * interpreted["calls"][1], (compiled["calls"], interpreted["calls"])
    cpu = pair["ratios"]["thread CPU, first rank"]
    assert cpu == compiled["thread_cpu_us"][0] / interpreted["thread_cpu_us"][0]
    assert "median of the pairs" in printed
