"""Render docs/performance.md's latency tables from committed raw results, or check that they are.

    python scripts/results/render.py docs/results/<commit>/latency-run*.json            # print the block
    python scripts/results/render.py docs/results/<commit>/latency-run*.json --write docs/performance.md
    python scripts/results/render.py --check docs/performance.md                        # exit 1 if stale

The block sits between ``<!-- results -->`` and ``<!-- /results -->``; its first line names the raw files it
comes from (``Raw results: `docs/results/...json`, ...``), so ``--check`` renders them again and compares.
Each raw file is one full run of ``scripts/bench_latency.py --json`` on a clean tree (its ``run`` facts:
commit, cores, load before and after, torch). Each cell is the median over the runs of each run's median
(min-max over the runs); each ratio is a run's ratio of its own medians, median (min-max) over the runs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- results -->", "<!-- /results -->"
SIZES = ("4K", "64K", "1M", "16M", "64M", "256M")
_NAMES = {"4K": "4 KiB", "64K": "64 KiB", "1M": "1 MiB", "16M": "16 MiB", "64M": "64 MiB", "256M": "256 MiB"}
_SOURCES = re.compile(r"Raw results: (`docs/results/[^`]+\.json`(?:, `docs/results/[^`]+\.json`)*)")


def _fmt(x: float) -> str:
    """Three significant figures, trailing zeros kept (``9.00``, ``0.700``); one decimal from 100 up."""
    return f"{x:#.3g}".rstrip(".") if abs(x) < 100 else f"{x:.1f}"


def _cell(values: Sequence[float]) -> str:
    """``median (min-max)`` of one figure over the runs (the bare figure for one run)."""
    if len(values) == 1:
        return _fmt(values[0])
    return f"{_fmt(statistics.median(values))} ({_fmt(min(values))}-{_fmt(max(values))})"


def _median(run: dict[str, Any], size: str, method: str, what: str) -> float:
    return float(run["summary"][size][method][what][1])  # [p10, median, p90]


def _row(
    runs: Sequence[dict[str, Any]], size: str, what: str, figures: Sequence[tuple[str, str | None]]
) -> list[str]:
    """One table row's cells: a method's median (``(method, None)``) or a ratio of two methods' medians
    (``(over, under)``), each over the runs; ``-`` where a run has no such method at this size."""
    cells = []
    for top, bottom in figures:
        if any(m not in r["summary"][size] for r in runs for m in (top, bottom) if m is not None):
            cells.append("-")
        elif bottom is None:
            cells.append(_cell([_median(r, size, top, what) for r in runs]))
        else:
            cells.append(_cell([_median(r, size, top, what) / _median(r, size, bottom, what) for r in runs]))
    return cells


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _hm(stamp: str) -> str:
    return stamp[11:16]


def render(paths: Sequence[str]) -> str:
    """The results block (without its markers) for the raw files ``paths`` (relative to the repository)."""
    runs = [json.loads((ROOT / p).read_text()) for p in paths]
    facts = [r["run"] for r in runs]
    commits = {f["commit"] for f in facts}
    if len(commits) != 1 or any(f["dirty"] for f in facts):
        raise SystemExit(
            f"raw results of one clean commit are needed; got {commits}, dirty {[f['dirty'] for f in facts]}"
        )
    sizes = [s for s in SIZES if all(s in r["summary"] for r in runs)]
    ones = [f["load_before"][0] for f in facts] + [f["load_after"][0] for f in facts]
    reps = (
        ", ".join(f"{runs[0]['reps'][s]} at {_NAMES[s]}" for s in sizes) + f", {runs[0]['reps']['tiny']} tiny"
    )
    lines = [
        f"**Figures of the current code**: commit {commits.pop()}, `{facts[0]['command']}`, **{len(runs)} full "
        f"run{'s' if len(runs) > 1 else ''}** one after the other, {_hm(facts[0]['started_utc'])}-"
        f"{_hm(facts[-1]['ended_utc'])} UTC, {facts[0]['cores']} cores, torch {facts[0]['torch']}, load average "
        f"(1 minute) {min(ones):.1f}-{max(ones):.1f} before and after the runs; {reps} rounds per method and run. "
        "Each cell: the median over the runs of each run's median (min-max over the runs); each ratio is a "
        "run's ratio of its own medians, median (min-max) over the runs. Milliseconds.",
        "",
        "Raw results: " + ", ".join(f"`{p}`" for p in paths) + ".",
        "",
        "All done (what the job waits for):",
        "",
    ]
    # The floor with its answer and the bare round (runs since they were added to the bench; older raw files
    # render without them; bare runs only at sizes whose payload fits in one datagram).
    answered = all("answered" in r["summary"][s] for r in runs for s in sizes)
    done: list[tuple[str, str | None]] = [
        ("ours", None),
        ("floor", None),
        ("gloo", None),
        ("modelopt", None),
        ("ours", "floor"),
        ("gloo", "ours"),
        ("modelopt", "ours"),
    ]
    done_header = [
        "size",
        "ours",
        "floor",
        "gloo",
        "ModelOpt",
        "ours/floor (target <= 1.5)",
        "gloo/ours (target >= 1; >= 6 at 64 MiB)",
        "ModelOpt/ours (target >= 10 at 64 MiB)",
    ]
    per_rank: list[tuple[str, str | None]] = [
        ("ours", None),
        ("ours", "floor"),
        ("gloo", "ours"),
        ("modelopt", "ours"),
    ]
    per_rank_header = ["ours/floor", "gloo/ours", "ModelOpt/ours"]
    if answered:
        done += [
            ("answered", None),
            ("bare", None),
            ("ours", "answered"),
            ("answered", "floor"),
            ("ours", "bare"),
            ("bare", "floor"),
        ]
        done_header += ["answered", "bare", "ours/answered", "answered/floor", "ours/bare", "bare/floor"]
        per_rank += [("ours", "bare"), ("bare", "floor"), ("answered", "floor")]
        per_rank_header += ["ours/bare", "bare/floor", "answered/floor"]
    lines += _table(done_header, [[_NAMES[s], *_row(runs, s, "all done", done)] for s in sizes])
    lines += ["", "Rank 0's own wall time, and the CPU of all ranks per round:", ""]
    lines += _table(
        ["size", "rank 0: ours ms", *per_rank_header, "CPU: ours ms", *per_rank_header],
        [[_NAMES[s], *_row(runs, s, "rank 0", per_rank), *_row(runs, s, "cpu", per_rank)] for s in sizes],
    )
    lines += ["", "The tiny round trip:", ""]
    tiny = [
        ("ours", None),
        ("gather_object", None),
        ("ping", None),
        ("ours", "ping"),
        ("gather_object", "ours"),
    ]
    lines += _table(
        ['tiny `{"a": 1}`', "ours ms", "`gather_object` ms", "ping ms", "ours/ping", "gather_object/ours"],
        [
            [label, *_row(runs, "tiny", what, tiny)]
            for label, what in (("all done", "all done"), ("rank 0", "rank 0"), ("CPU of all ranks", "cpu"))
        ],
    )
    return "\n".join(lines)


def block_of(doc: str) -> str:
    """The text between the markers of ``doc``."""
    start, end = doc.index(START) + len(START), doc.index(END)
    return doc[start:end].strip("\n")


def sources_of(block: str) -> list[str]:
    """The raw files a block names."""
    m = _SOURCES.search(block)
    if m is None:
        raise SystemExit("the results block names no raw files (a line 'Raw results: `docs/results/...`')")
    return re.findall(r"`([^`]+)`", m.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="*", help="raw result files (docs/results/...json)")
    parser.add_argument("--write", metavar="DOC", help="replace the block of DOC with the rendering")
    parser.add_argument(
        "--check", metavar="DOC", help="render DOC's block from the files it names; exit 1 if it differs"
    )
    args = parser.parse_args(argv)
    if args.check:
        doc = Path(args.check).read_text()
        block = block_of(doc)
        fresh = render(sources_of(block))
        if fresh != block:
            print(f"{args.check}: the results block is not what its raw files render to", file=sys.stderr)
            return 1
        print(f"{args.check}: the results block is what {len(sources_of(block))} raw files render to")
        return 0
    paths = [str(Path(p).resolve().relative_to(ROOT)) for p in args.results]
    text = render(paths)
    if args.write:
        doc = Path(args.write).read_text()
        start, end = doc.index(START) + len(START), doc.index(END)
        Path(args.write).write_text(doc[:start] + "\n" + text + "\n" + doc[end:])
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
