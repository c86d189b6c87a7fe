"""The documentation's commands run as written.

Every line of every ```bash block in ``docs/*.md`` and ``README.md`` (continuations joined, ``&&`` chains
split) is either run here, in a temporary directory holding the example checkpoint ``ckpt/`` and the rules
file ``my.rules`` of ``docs/consolidation.md`` (made from those very blocks), or matched by one entry of
:data:`EXCLUDED`, which says why. A benchmark command is not run (minutes each), but every option it uses
must be one its script's ``--help`` lists. The README's Python example runs under torchrun with 4 ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness import free_port, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

#: Commands not run here: (pattern searched in the command, why).
EXCLUDED: list[tuple[str, str]] = [
    (r"^pip install", "installs packages; this environment has them"),
    (r"^bash \.ci/system-deps\.sh", "installs system packages (apt)"),
    (r"\bpytest\b", "runs test files of this suite, which the suite runs anyway"),
    (r"^torchrun --nnodes 2", "two hosts (node0, node1) with a shared NFS directory"),
    (r"scripts/simulate_nodes\.py", "root, network namespaces and sshfs: tests/test_simulate_nodes.py"),
    (
        r"^(mkdir -p /mnt/shared|mount |findmnt |touch /mnt/shared|ls /mnt/shared)",
        "an NFS server and its mount",
    ),
    (r"scripts/bench_\w+\.py", "a benchmark (minutes on 2 cores); its options are checked against --help"),
    (
        r"scripts/gpu_check\.sh",
        "the GPU machine's one-call check: tests/test_bench_gpu.py runs it here, without a GPU",
    ),
]

#: Placeholders in commands, and what stands for them here (and MEGATRON_CKPT: a real megatron-core
#: save of a Llama-style model, legacy, TP2 x PP2).
PLACEHOLDERS = {"CKPT_DIR": "ckpt", "OUT_DIR": "out-readme", "/nfs/ws": "nfs-ws"}


def _blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of each ```<lang> block of a Markdown file."""
    text = path.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)
    ]


def _commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every command of every bash block, each distinct command once."""
    found: dict[str, str] = {}
    for path in DOCS:
        for start, block in _blocks(path, "bash"):
            lines = block.replace("\\\n", " ").split("\n")
            for offset, line in enumerate(lines):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                line = re.sub(r"\s+# .*$", "", line)  # a trailing comment
                for command in line.split(" && "):
                    found.setdefault(" ".join(command.split()), f"{path.name}:{start + offset}")
    return [(where, command) for command, where in found.items()]


def _excluded(command: str) -> str | None:
    return next((why for pattern, why in EXCLUDED if re.search(pattern, command)), None)


COMMANDS = _commands()
RUN = [(w, c) for w, c in COMMANDS if _excluded(c) is None]
BENCH = [(w, c) for w, c in COMMANDS if re.search(r"scripts/bench_\w+\.py", c)]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PET_MASTER_PORT"] = str(free_port())  # torchrun's --master-port, as the commands leave it out
    env["TMPDIR"] = str(tmp)
    return env


def _block_after(path: Path, lang: str, marker: str) -> str:
    return next(block for _, block in _blocks(path, lang) if marker in block)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with consolidation.md's example checkpoint ``ckpt/`` and rules file ``my.rules``."""
    work = tmp_path_factory.mktemp("docs")
    doc = ROOT / "docs" / "consolidation.md"
    make = _block_after(doc, "python", "write_own_layout(")
    subprocess.run([sys.executable, "-c", make], cwd=work, env=_env(work), check=True)
    rules = re.search(r"^```\n(# my\.rules\n.*?)^```", doc.read_text(), re.S | re.M)
    assert rules, "the rules file example of consolidation.md"
    (work / "my.rules").write_text(rules.group(1))
    (work / "nfs-ws").mkdir()
    return work


def test_every_command_is_run_or_excluded_with_a_reason() -> None:
    assert COMMANDS and RUN
    assert any("consolidate ckpt/ out-rules/ --rules my.rules" in c for _, c in RUN)
    used = {pattern for pattern, _ in EXCLUDED if any(re.search(pattern, c) for _, c in COMMANDS)}
    assert used == {p for p, _ in EXCLUDED}, f"exclusions that match no command: {set(dict(EXCLUDED)) - used}"


#: Commands that other tests run too: run here only with ``-m slow``. ``--nproc`` and torchrun: test_cli.py;
#: the legacy GQA save to Hugging Face (then loaded by ``transformers``), and the README's ``--to hf`` line:
#: test_hf_export.py's command-line case; the demo with its defaults: test_cli.py's ``test_python_m_demo``
#: (the console script's demo runs here with ``--keep``, quickstart.md's).
SLOW = (
    r"--nproc \d",
    r"^torchrun ",
    r"--to hf --hf-config vocab_size=100 ",
    r" --to hf$",
    r"from_pretrained\('hf-out'\)",
    r"^distribute-utils demo$",
)


def _marked(where: str, command: str) -> Any:
    slow = any(re.search(pattern, command) for pattern in SLOW)
    return pytest.param(where, command, id=where, marks=pytest.mark.slow) if slow else (where, command)


@pytest.mark.parametrize(("where", "command"), [_marked(w, c) for w, c in RUN], ids=[w for w, _ in RUN])
def test_command_runs_as_written(
    workdir: Path, where: str, command: str, request: pytest.FixtureRequest
) -> None:
    for placeholder, here in PLACEHOLDERS.items():
        command = command.replace(placeholder, here)
    if "MEGATRON_CKPT" in command:  # a real megatron-core save (the session's, shared with its tests)
        save = request.getfixturevalue("megatron_save")("swiglu")
        command = command.replace("MEGATRON_CKPT", str(save / "legacy"))
    # (tools and the repository's scripts run from its root, as their docs say; they write nothing there)
    cwd = ROOT if command.startswith(("ruff ", "mypy ", "python scripts/")) else workdir
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=_env(workdir), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{where}: {command}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "script", sorted({b for _, c in BENCH for b in re.findall(r"scripts/bench_\w+\.py", c)})
)
def test_benchmark_options_exist(script: str) -> None:
    shown = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        env=_env(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for where, command in BENCH:
        if script in command:
            options = set(re.findall(r"(?<![\w-])--[\w-]+", command))
            missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}\b", shown))
            assert not missing, f"{where}: {command}: options {missing} are not in {script} --help"


@pytest.mark.slow  # (test_exit.py runs the same example in the default suite)
def test_readme_example_runs_under_torchrun(tmp_path: Path) -> None:
    """As its first line says: 4 ranks under torchrun; rank 0 prints the layers of every rank."""
    example = _block_after(ROOT / "README.md", "python", "get_configs_parallel(config")
    assert "torchrun --nproc-per-node 4" in example
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run(
        torchrun_argv(4, str(script)),
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[0, 1, 2, 3]" in done.stdout, done.stdout


def _doc_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in DOCS}


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is an importable module's attribute path (the longest module that imports)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_import_and_dotted_name_in_the_docs_exists() -> None:
    """What the docs tell a reader to import, and every `distribute_utils.x.y` they name, is there."""
    import importlib

    missing = []
    for doc, text in _doc_texts().items():
        for line in re.findall(r"^\s*(from distribute_utils[\w.]* import [\w, ]+)", text, re.M):
            module, names = line.removeprefix("from ").split(" import ")
            for name in (n.strip() for n in names.split(",")):
                if not hasattr(importlib.import_module(module), name):
                    missing.append(f"{doc}: {line}")
        missing += [
            f"{doc}: {d}" for d in re.findall(r"`(distribute_utils(?:\.\w+)+)", text) if not _resolves(d)
        ]
    assert missing == [], missing


def test_api_md_gives_modelopts_signatures_as_they_are() -> None:
    import inspect

    from distribute_utils import modelopt

    api = _doc_texts()["api.md"]
    for fn in (modelopt.get_tensors_parallel, modelopt.get_configs_parallel):
        params = ", ".join(
            p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
            for p in inspect.signature(fn).parameters.values()
        )
        assert f"`{fn.__name__}({params})`" in api, f"{fn.__name__}({params})"
