"""Would compiling the round make small gathers faster? The package as it is, against the same package
with its hot modules compiled by mypyc, in turn.

A repeated small gather's path (the public call's front, the group's companion, the direct round's
channel and mailbox, the repeat, the wire format, the caches: :data:`MODULES`) is compiled with mypyc
(mypy's compiler of type-annotated Python to C extensions) in a copy of the package at ``--rev`` made
with ``git archive`` (:func:`profile_round.tree_at`). The copy's one change:
:class:`~distribute_utils.mailbox.Mailbox` is made a non-native class, because mypyc's native classes
take no weak references and the package keeps its mailboxes in a ``WeakSet`` (closed in a forked child). The interpreted side is another copy of the same
revision. Then, ``--pairs`` times, each copy in turn (which goes first alternates):

- ``profile_round.py``'s measure (:func:`profile_round.profile_tree`, 4 KiB, ``--rounds``): Python calls
  per round on the first rank and on a sender (cProfile counts no call inside compiled code) and each
  one's thread CPU per round, unprofiled;
- ``bench_latency.py --sizes 4K 64K --reps REPS`` of that copy: the whole round (all done) and the CPU of
  all ranks per round, ours and the floor.

Prints compiled / interpreted per pair and their medians; ``--json`` keeps every raw result.

    python scripts/bench_compiled.py --pairs 3 --json out.json    # about 20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import profile_round  # noqa: E402
from results.facts import load_average, run_facts  # noqa: E402

MODULES = (
    "distribute_utils/caches.py",
    "distribute_utils/channel.py",
    "distribute_utils/gather.py",
    "distribute_utils/host_dir.py",
    "distribute_utils/mailbox.py",
    "distribute_utils/roles/repeat.py",
    "distribute_utils/sync.py",
    "distribute_utils/wire/decoding.py",
    "distribute_utils/wire/encoding.py",
    "distribute_utils/wire/format.py",
    "distribute_utils/wire/payload.py",
)
_MAILBOX = "class Mailbox:"


def compile_hot_path(tree: Path) -> None:
    """Compile :data:`MODULES` of ``tree`` in place with mypyc (the extensions land beside the sources)."""
    mailbox = tree / "distribute_utils" / "mailbox.py"
    text = mailbox.read_text()
    if text.count(_MAILBOX) != 1 or "from __future__ import annotations\n" not in text:
        raise SystemExit(
            f"{mailbox}: expected one {_MAILBOX!r} to mark non-native, after a __future__ import"
        )
    future = "from __future__ import annotations\n"
    mailbox.write_text(
        text.replace(future, future + "from mypy_extensions import mypyc_attr\n", 1).replace(
            _MAILBOX, "@mypyc_attr(native_class=False)\n" + _MAILBOX
        )
    )
    done = subprocess.run([sys.executable, "-m", "mypyc", *MODULES], cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mypyc failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    missing = [m for m in MODULES if not list((tree / m).parent.glob(Path(m).stem + ".*.so"))]
    if missing:
        raise SystemExit(f"mypyc built no extension for {missing}")


def latency(tree: Path, reps: int) -> dict[str, Any]:
    """``tree``'s own ``bench_latency.py`` at 4 and 64 KiB: its summary (medians)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        bench = str(tree / "scripts" / "bench_latency.py")
        subprocess.run(
            [sys.executable, bench, "--sizes", "4K", "64K", "--reps", str(reps), "--json", out.name],
            cwd=tree,
            capture_output=True,
            check=True,
        )
        return json.loads(Path(out.name).read_text())["summary"]  # type: ignore[no-any-return]


def check_loads(tree: Path, compiled: bool) -> None:
    """Raise SystemExit unless a script of ``tree`` (which puts ``tree`` first on its path, as
    ``bench_latency.py`` does) loads ``tree``'s mailbox, compiled or not as ``compiled`` says."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import distribute_utils.mailbox as m; print(m.__file__)"
    )
    found = Path(
        subprocess.run(
            [sys.executable, "-c", code, str(tree)], cwd=tree, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    if not found.resolve().is_relative_to(tree.resolve()) or (found.suffix == ".so") != compiled:
        raise SystemExit(
            f"{tree}'s scripts load {found}, not its {'compiled' if compiled else 'interpreted'} mailbox"
        )


def measure(tree: Path, rounds: int, reps: int) -> dict[str, Any]:
    first, sender = profile_round.profile_tree(tree, rounds, top=0)
    return {
        "calls": [first["calls_per_round"], sender["calls_per_round"]],
        "thread_cpu_us": [first["cpu_us"], sender["cpu_us"]],
        "latency": latency(tree, reps),
    }


def ratios(compiled: dict[str, Any], interpreted: dict[str, Any]) -> dict[str, float]:
    """compiled / interpreted of each figure of one pair."""
    out = {
        "calls, first rank": compiled["calls"][0] / interpreted["calls"][0],
        "calls, a sender": compiled["calls"][1] / interpreted["calls"][1],
        "thread CPU, first rank": compiled["thread_cpu_us"][0] / interpreted["thread_cpu_us"][0],
        "thread CPU, a sender": compiled["thread_cpu_us"][1] / interpreted["thread_cpu_us"][1],
    }
    for size in ("4K", "64K"):
        for what in ("all done", "cpu"):
            mine, theirs = (
                compiled["latency"][size]["ours"][what][1],
                interpreted["latency"][size]["ours"][what][1],
            )
            out[f"{size} {what}"] = mine / theirs
            floor = (
                compiled["latency"][size]["floor"][what][1],
                interpreted["latency"][size]["floor"][what][1],
            )
            out[f"{size} {what}, ours/floor compiled"] = mine / floor[0]
            out[f"{size} {what}, ours/floor interpreted"] = theirs / floor[1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", default="HEAD", help="the revision both copies are made of")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=400, help="profiled rounds per copy")
    parser.add_argument("--reps", type=int, default=150, help="bench_latency.py's repetitions per copy")
    parser.add_argument("--json", help="also write every raw result here")
    args = parser.parse_args(argv)
    started, load_before = time.time(), load_average()
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="du-compiled-") as tmp:
        interpreted_tree = profile_round.tree_at(args.rev, Path(tmp) / "interpreted")
        compiled_tree = profile_round.tree_at(args.rev, Path(tmp) / "compiled")
        compile_hot_path(compiled_tree)
        check_loads(compiled_tree, compiled=True)
        check_loads(interpreted_tree, compiled=False)
        for i in range(args.pairs):
            order = [("compiled", compiled_tree), ("interpreted", interpreted_tree)]
            pair = {
                label: measure(tree, args.rounds, args.reps) for label, tree in order[:: 1 if i % 2 else -1]
            }
            pair["ratios"] = ratios(pair["compiled"], pair["interpreted"])
            pairs.append(pair)
            print(
                f"pair {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in pair["ratios"].items()), flush=True
            )
    print("median of the pairs, compiled / interpreted:")
    for key in pairs[0]["ratios"]:
        values = [p["ratios"][key] for p in pairs]
        print(f"  {key:42} {statistics.median(values):.2f}  ({', '.join(f'{v:.2f}' for v in values)})")
    if args.json:
        facts = run_facts(sys.argv, started, load_before)
        facts["rev"] = subprocess.run(
            ["git", "rev-parse", "--short=7", args.rev], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        Path(args.json).write_text(json.dumps({"modules": MODULES, "pairs": pairs, "run": facts}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
