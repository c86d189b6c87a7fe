"""Gathers across simulated hosts: private /dev/shm per node, workspace over a real network FS.

2 nodes x 2 ranks (``scripts/simulate_nodes.py``: unshare namespaces + torchrun), 100 rounds
of tensors and configs of varying sizes and dtypes, every rank receiving in turn; zero wrong
results, nothing left in any /dev/shm or in the workspace. Needs root (CI runs as root).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "multinode_gather_job.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_nodes", ROOT / "scripts" / "simulate_nodes.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("simulate_nodes") or importlib.util.module_from_spec(spec)
    if "simulate_nodes" not in sys.modules:
        sys.modules["simulate_nodes"] = module
        spec.loader.exec_module(module)
    return module


sn = _load()
pytestmark = pytest.mark.root


def _run(tmp_path: Path, workspace: str, args: list[str], timeout: float = 240) -> tuple[list[dict], Path]:
    """The job on 2 simulated nodes x 2 ranks with ``args``: every rank's report, and the workspace's
    backing directory."""
    reason = sn.require_simulation_support(workspace)
    if reason is not None:
        pytest.skip(f"simulated nodes unavailable: {reason}")
    results = tmp_path / "results"
    results.mkdir()
    backing = tmp_path / "backing"
    backing.mkdir()
    outcome = sn.run_simulated(
        JOB,
        args,
        nodes=2,
        nproc_per_node=2,
        workspace=workspace,
        timeout=timeout,
        backing_dir=backing,
        env={"DU_RESULTS": str(results)},
    )
    assert outcome.returncode == 0, outcome.format_outputs()[-6000:]
    reports = [json.loads((results / f"rank{r}.json").read_text()) for r in range(4)]
    return reports, backing


def _check_clean(reports: list[dict], backing: Path) -> None:
    assert all(r["wrong"] == [] for r in reports), [r["wrong"][:5] for r in reports]
    assert all(r["shm_left"] == [] for r in reports)
    # Every pooled segment was reported back once its receiver (or its host's leader) let it go.
    assert [r["pooled_after_release"] for r in reports] == [[0, 0]] * 4, reports
    left = sorted(str(p.relative_to(backing)) for p in backing.rglob("*"))
    assert left == [] or all(name.startswith(".du-") for name in left), left


@pytest.mark.parametrize("workspace", [pytest.param("dir", marks=pytest.mark.slow), "sshfs"])
def test_hierarchical_gather_over_workspace(tmp_path: Path, workspace: str) -> None:
    reports, backing = _run(tmp_path, workspace, ["--rounds", "100", "--mode", "auto"])
    _check_clean(reports, backing)
    routes: dict[str, int] = {}
    for r in reports:
        for route, n in r["routes"].items():
            routes[route] = routes.get(route, 0) + n
    # All four ranks: shm inside each node, one bundle per remote host over the workspace.
    # Each gather's first rank logs its route (the others never need to know it all).
    # 100 rounds x (tensor + config), then 6 gathers of the pooled-segment check.
    assert routes["shm within hosts + workspace across 1 remote host(s)"] == 206
    assert routes["shm"] == 2  # the pairs inside one node
    assert routes["workspace"] == 1  # the cross-node pair: one file, no shm hop
    # shm forced across hosts for ranks [0, 2]: both raise; ranks 1 and 3, which that list does
    # not name, only check in.
    for r in reports:
        if r["rank"] in (0, 2):
            assert r["forced_shm"].startswith("TransportUnavailableError: "), r["forced_shm"]
            assert "span 2 shared-memory domains" in r["forced_shm"]
        else:
            assert r["forced_shm"] == "no error", r["forced_shm"]


def test_collective_fallback_without_workspace(tmp_path: Path) -> None:
    reports, backing = _run(tmp_path, "none", ["--rounds", "30", "--mode", "collective"])
    _check_clean(reports, backing)
    routes = {k for r in reports for k in r["routes"]}
    assert "shm within hosts + collective across 1 remote host(s)" in routes
    assert "collective" in routes


def test_forced_workspace_transport_is_flat(tmp_path: Path) -> None:
    reports, backing = _run(tmp_path, "sshfs", ["--rounds", "30", "--mode", "workspace"])
    _check_clean(reports, backing)
    routes = {k for r in reports for k in r["routes"]}
    assert routes == {"workspace"}


def _matrix(tmp_path: Path, every: int) -> None:
    """The two-host combinations of tests/test_route_matrix.py (every ``every``-th), checked there."""
    import test_route_matrix as matrix

    reports, backing = _run(tmp_path, "sshfs", ["--mode", "matrix", "--every", str(every)], timeout=400)
    chosen = [tuple(c) for c in reports[0]["combos"]]
    assert chosen == matrix.combos("two hosts")[::every]
    failures = matrix.check("two hosts", chosen, reports)
    assert failures == [], "\n".join(map(str, failures[:10])) + f"\n({len(failures)} failures)"
    assert reports[0]["claim_keys"] <= matrix.claim_keys_bound(4), reports[0]["claim_keys"]
    # A bundle short of a part: refused on the first rank before any verdict, named; then all is well.
    refused, again = reports[0]["short_bundle"]
    assert refused.startswith("PayloadError: the bundle of rank 2's host holds ranks [2] with 1 parts"), (
        refused
    )
    assert "the plan sends ranks [2, 3]" in refused, refused
    assert again == "got [0.0, 1.0, 2.0, 3.0]", again
    for r in reports[1:]:
        assert "rank 2's host holds ranks [2]" in r["short_bundle"][0], r["short_bundle"]
        assert r["short_bundle"][1] == "got []", r["short_bundle"]
    assert all(r["shm_left"] == [] for r in reports), [r["shm_left"] for r in reports]
    left = sorted(str(p.relative_to(backing)) for p in backing.rglob("*"))
    assert left == [] or all(name.startswith(".du-") for name in left), left


def test_the_two_host_matrix_sampled(tmp_path: Path) -> None:
    """Every fifth two-host combination of the route matrix (the whole of it is slow-marked): a remote
    host's bundle over the workspace and over the collective, flat workspace and collective; CPU and meta
    senders; nothing, the CPU or another device asked for (meta: a bundle decoded there part by part)."""
    _matrix(tmp_path, 5)


@pytest.mark.slow
def test_the_two_host_matrix(tmp_path: Path) -> None:
    _matrix(tmp_path, 1)
