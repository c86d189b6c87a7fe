"""The package's shape: its modules import each other without a circle, and tests and scripts use only
its public API and the seams docs/seams.md lists.

Every import counts: at the top of a module, inside a function (deferred) and under ``TYPE_CHECKING``
(a type-only circle is still a circle a reader has to hold in mind). The graph is read from the source
(``ast``), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import distribute_utils

PACKAGE = Path(distribute_utils.__file__).parent
ROOT = PACKAGE.parent
PUBLIC_MODULES = (
    "distribute_utils",
    "distribute_utils.consolidate",
    "distribute_utils.consolidate.synthetic",
    "distribute_utils.errors",
    "distribute_utils.gather",
    "distribute_utils.mesh",
    "distribute_utils.mesh_layout",
    "distribute_utils.modelopt",
    "distribute_utils.wire",
    "distribute_utils.cli",
)
"""The modules users import (docs/api.md, "The public API"); every other says "Internal." first."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports, anywhere in its source."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = node.module or ""
                where = (f"{base}.{module}" if module else base) if node.level else module
                for alias in node.names:  # (``from . import x``: x may be a module)
                    targets.add(f"{where}.{alias.name}" if f"{where}.{alias.name}" in modules else where)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_without_a_circle() -> None:
    graph = import_graph()
    assert "distribute_utils.transports.base" in graph and graph["distribute_utils.roles.sender"], (
        "graph read"
    )
    assert circles(graph) == []


def public_names() -> set[str]:
    """``module.name`` for every name in a public module's ``__all__``."""
    names = set()
    for module in PUBLIC_MODULES:
        imported = importlib.import_module(module)
        names.update(f"{module}.{name}" for name in getattr(imported, "__all__", ()))
    return names


def uses_of_the_package() -> dict[str, set[str]]:
    """``module.name`` -> the files of tests/ and scripts/ that use it: names imported from a module of
    the package, and attributes read off a module of it (the first name after the module's path)."""
    modules = set(_modules())
    found: dict[str, set[str]] = {}
    for path in sorted([*ROOT.joinpath("tests").rglob("*.py"), *ROOT.joinpath("scripts").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        used: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "distribute_utils":
                        aliases[alias.asname or "distribute_utils"] = (
                            alias.name if alias.asname else "distribute_utils"
                        )
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").split(".")[0] == "distribute_utils"
            ):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    else:
                        used.add(full)
        for node in ast.walk(tree):
            if (  # setattr(module, "name", ...) and monkeypatch.setattr(module, "name", ...): a patch of it
                isinstance(node, ast.Call)
                and (
                    getattr(node.func, "attr", None) == "setattr"
                    or getattr(node.func, "id", None) == "setattr"
                )
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                chain, base = [], node.args[0]
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    module = aliases[base.id]
                    for step in reversed(chain):
                        module = f"{module}.{step}"
                    if module in modules:
                        used.add(f"{module}.{node.args[1].value}")
            if isinstance(node, ast.Attribute):
                chain, base = [], node
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    module, steps = aliases[base.id], chain[::-1]
                    while steps and f"{module}.{steps[0]}" in modules:
                        module = f"{module}.{steps.pop(0)}"
                    if steps:
                        used.add(f"{module}.{steps[0]}")
        for name in used:
            module, _, attribute = name.rpartition(".")
            # (a dunder is Python's; a name the module lacks is a local variable that shadows an alias)
            if not attribute.startswith("__") and hasattr(importlib.import_module(module), attribute):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented_seams() -> set[str]:
    """The seams docs/seams.md lists: a line ``- `module`: `name`, `name`, ... — what for``."""
    seams = set()
    for line in ROOT.joinpath("docs", "seams.md").read_text().splitlines():
        found = re.match(r"- `(distribute_utils[\w.]*)`: (.+?) — ", line)
        if found:
            seams.update(f"{found[1]}.{name}" for name in re.findall(r"`(\w+)`", found[2]))
    return seams


def test_every_internal_module_says_so_first() -> None:
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if name in PUBLIC_MODULES or name == "distribute_utils.__main__":
            assert not doc.startswith("Internal."), f"{name} is public (docs/api.md)"
        else:
            assert doc.startswith("Internal."), f"{name}: an internal module's docstring starts 'Internal.'"


def test_tests_and_scripts_use_only_the_public_api_and_the_documented_seams() -> None:
    uses, public, seams = uses_of_the_package(), public_names(), documented_seams()
    assert (
        "distribute_utils.get_tensors_parallel" in uses
        and "distribute_utils.transports.carriers.inject" in uses
    )
    undocumented = {name: sorted(files) for name, files in uses.items() if name not in public | seams}
    assert undocumented == {}, (
        f"used by tests or scripts, neither public nor in docs/seams.md: {undocumented}"
    )
    unused = sorted(seams - set(uses))
    assert unused == [], f"docs/seams.md lists seams nothing uses (remove them): {unused}"
