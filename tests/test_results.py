"""Published figures come from committed raw results: docs/performance.md's latency tables are what their
raw files render to, and every figure the README quotes from them is in those tables, of the commit it names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RENDER = ROOT / "scripts" / "results" / "render.py"
README_SPAN = re.compile(r"<!-- latency figures: docs/results/(\w+) -->(.*?)<!-- /latency figures -->", re.S)
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)x?(?![\w.])")  # (a ratio's "x" is part of the figure)


def _block() -> str:
    doc = (ROOT / "docs" / "performance.md").read_text()
    return doc[doc.index("<!-- results -->") : doc.index("<!-- /results -->")]


def test_the_latency_tables_are_what_their_committed_raw_results_render_to() -> None:
    done = subprocess.run(
        [sys.executable, str(RENDER), "--check", "docs/performance.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for path in re.findall(r"`(docs/results/[^`]+\.json)`", _block()):
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=ROOT, capture_output=True)
        assert tracked.returncode == 0, f"{path} is not committed"


def test_every_latency_figure_the_readme_quotes_is_in_the_tables_of_the_commit_it_names() -> None:
    spans = README_SPAN.findall((ROOT / "README.md").read_text())
    assert spans, "the README's latency figures are marked (<!-- latency figures: docs/results/COMMIT -->)"
    block = _block()
    commit = re.search(r"commit (\w+)", block)
    assert commit is not None
    tables = set(NUMBER.findall(block))
    for named, text in spans:
        assert named == commit.group(1), f"the README names {named}, the tables are of {commit.group(1)}"
        assert f"commit {named}" in text, "the README's span names its commit in words too"
        quoted = NUMBER.findall(text)
        assert quoted, text
        missing = [n for n in quoted if n not in tables]
        assert missing == [], f"README figures not in the rendered tables: {missing}"


CONSOLIDATION_SPAN = re.compile(
    r"<!-- consolidation figures: docs/results/(\w+) -->(.*?)<!-- /consolidation figures -->", re.S
)


def test_every_consolidation_figure_the_readme_quotes_is_a_ratio_of_the_raw_results_it_names() -> None:
    """The README's consolidation ratios are the committed runs' (``bench_consolidate.py`` and its
    ``--to-hf``), rounded as quoted, and the span names that commit."""
    import json

    spans = CONSOLIDATION_SPAN.findall((ROOT / "README.md").read_text())
    assert len(spans) == 1, "the README's consolidation figures are marked"
    ((named, text),) = spans
    assert f"commit {named}" in text
    ratios: set[str] = set()
    for name in ("bench_consolidate.json", "bench_consolidate-to-hf.json"):
        path = ROOT / "docs" / "results" / named / name
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True
        )
        assert tracked.returncode == 0, f"{path} is not committed"
        result = json.loads(path.read_text())
        ratios |= {
            f"{result[f][k]:.2f}" for f in ("legacy", "torch_dist") for k in ("time_ratio", "memory_ratio")
        }
    figures = re.sub(r"\(targets [^)]*\)", "", text).replace("1.15 GiB", "")  # (not figures: targets, size)
    quoted = NUMBER.findall(figures)
    assert len(quoted) == 8 and set(quoted) <= ratios, (quoted, sorted(ratios))


BARRIER_SPAN = re.compile(r"<!-- barrier figures: docs/results/(\w+) -->(.*?)<!-- /barrier figures -->", re.S)


def test_the_barrier_figures_the_readme_quotes_are_the_medians_of_the_committed_runs() -> None:
    """Our barrier over torch's store barrier, per N: the median over the committed full runs of
    ``bench_sync_scale.py`` (at least 5), as the README quotes them, and the span names that commit."""
    import json
    import statistics

    spans = BARRIER_SPAN.findall((ROOT / "README.md").read_text())
    assert len(spans) == 1, "the README's barrier figures are marked"
    ((named, text),) = spans
    assert f"commit {named}" in text
    runs = sorted((ROOT / "docs" / "results" / named).glob("sync-scale-run*.json"))
    assert len(runs) >= 5, runs
    ratios: dict[str, list[float]] = {}
    for path in runs:
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True
        )
        assert tracked.returncode == 0, f"{path} is not committed"
        for n, row in json.loads(path.read_text())["report"].items():
            mine, torch = row["our_barrier/steady"]["seconds"], row["torch_barrier/steady"]["seconds"]
            ratios.setdefault(n, []).append(mine / torch)
    medians = {f"{statistics.median(v):.2f}" for v in ratios.values()}
    figures = re.search(r"\(([^)]*)\)", text)  # (the first parenthesis: the medians, by N)
    assert figures is not None
    quoted = NUMBER.findall(figures.group(1))
    assert len(quoted) == len(ratios) and set(quoted) <= medians, (quoted, sorted(medians))


AGAINST_SPAN = re.compile(r"<!-- against figures: docs/results/(\w+) -->(.*?)<!-- /against figures -->", re.S)


def test_the_against_figures_the_readme_quotes_are_ratios_of_the_committed_runs() -> None:
    """The README's figures of the code against an older revision (``bench_latency.py --against``) are
    ours / then of the committed runs' medians, rounded as quoted."""
    import json

    spans = AGAINST_SPAN.findall((ROOT / "README.md").read_text())
    assert len(spans) == 1, "the README's against figures are marked"
    ((named, text),) = spans
    assert f"commit {named}" in text
    ratios: set[str] = set()
    for path in sorted((ROOT / "docs" / "results" / named).glob("latency-against-*.json")):
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True
        )
        assert tracked.returncode == 0, f"{path} is not committed"
        for methods in json.loads(path.read_text())["summary"].values():
            for metric, (_, ours, _) in methods["ours"].items():
                ratios.add(f"{ours / methods['then'][metric][1]:.2f}")
    quoted = NUMBER.findall(text)
    assert len(quoted) >= 12 and set(quoted) <= ratios, (quoted, sorted(ratios))
