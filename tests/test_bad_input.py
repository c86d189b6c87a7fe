"""Bad input, tabled: what a user gets for each mistake, and the security properties.

:data:`TABLE` is the table of ``docs/reliability.md``: one row per input, what the user gets,
and the tests that show it. Rows already covered by other test files reference them (a test
here checks that every reference exists and that the doc lists every row); the rest are
tested here, on the shared pool of 4 real ranks where a gather is involved. Agreement errors
must reach every rank quickly (nobody waits for a timeout) and before anything is written.

Security: segments and workspace files are readable by their owner only (checked while they
exist, from inside a real gather, under umask 0), names carry a fresh unguessable token per
round, nothing in ``distribute_utils/`` unpickles data it reads, a pickle planted where a
payload is expected is refused without running, and paths inside payloads never reach
``open``.

The last test prints the summary table; set ``DU_RELIABILITY_TABLE=path`` to also write it.
"""

from __future__ import annotations

import ast
import collections
import itertools
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, get_tensors_parallel, modelopt, sync, wire
from distribute_utils.transports import namespace as wsns
from distribute_utils.transports import shm
from distribute_utils.transports import workspace as ws

from harness import RankPool

ROOT = Path(__file__).resolve().parents[1]
FAST_S = 5.0  # an agreement error must reach every rank well before any timeout (30 s here)

# (input, what the user gets, tests showing it). Test references are "file::function".
TABLE: list[tuple[str, str, list[str]]] = [
    (
        "`ranks=[]`",
        "`ValueError: ranks is empty; list the participating global ranks, the receiver first`, on every rank",
        ["tests/test_gather.py::test_bad_ranks_raise_value_error_on_every_rank"],
    ),
    (
        "duplicated ranks `[0, 1, 1, 3]`",
        "`ValueError: ranks [0, 1, 1, 3] lists [1] more than once`, on every rank",
        ["tests/test_gather.py::test_bad_ranks_raise_value_error_on_every_rank"],
    ),
    (
        "out-of-range rank `[0, 1, 9]`",
        "`ValueError: ranks [9] are outside the world (valid: 0..3)`, on every rank",
        ["tests/test_gather.py::test_bad_ranks_raise_value_error_on_every_rank"],
    ),
    (
        "ranks that are not ints `[0, '1']`",
        "`ValueError: ranks must be ints; got ['1']`, on every rank",
        ["tests/test_gather.py::test_bad_ranks_raise_value_error_on_every_rank"],
    ),
    (
        "a rank outside `group`",
        "`ValueError: ranks [3] are not in the group [0, 1, 2]; list members only`, on every member",
        ["tests/test_bad_input.py::test_bad_call_fails_fast_everywhere"],
    ),
    (
        "callers passing different `ranks` lists",
        "`ValueError: ranks disagree on a gather: rank 0 passed ranks=[...], but rank 1, which it names, passed ranks=[...]`, on every rank",
        ["tests/test_gather.py::test_bad_ranks_raise_value_error_on_every_rank"],
    ),
    (
        "callers passing different transports",
        "`ValueError: ranks asked for different transports [...]`, on every rank",
        ["tests/test_bad_input.py::test_bad_call_fails_fast_everywhere"],
    ),
    (
        "unknown transport (on one rank or all)",
        "`ValueError: unknown transport 'x'; valid: [...]`; the other ranks get `rank N cannot take part in the gather: ...`",
        [
            "tests/test_gather.py::test_unknown_transport",
            "tests/test_bad_input.py::test_bad_call_fails_fast_everywhere",
        ],
    ),
    (
        "`transport='workspace'` without `workspace_path`",
        "`ValueError: transport='workspace' needs a workspace_path`, on every rank",
        ["tests/test_gather.py::test_workspace_transport_without_path_is_refused_everywhere"],
    ),
    (
        "a bad timeout (`-1`, or `$DISTRIBUTE_UTILS_TIMEOUT=soon`) on one rank",
        "`ValueError: timeout must be a positive number of seconds ...` naming the source, on every rank",
        [
            "tests/test_bad_input.py::test_bad_call_fails_fast_everywhere",
            "tests/test_bad_input.py::test_timeout_precedence_and_validation",
        ],
    ),
    (
        "not a tensor passed to `get_tensors_parallel` (one rank)",
        "`TypeError: get_tensors_parallel gathers a torch.Tensor; got list`, on every rank",
        ["tests/test_bad_input.py::test_bad_call_fails_fast_everywhere"],
    ),
    (
        "a config tensor from a device the first rank does not have (`cuda:7` where it has none)",
        "`DeviceUnavailableError: rank 2's config['layers'][1]['w'] is on cuda:7 at its sender, a device this "
        "process does not have (...)`, on every rank, before anything is yielded (`device=` places it elsewhere)",
        [
            "tests/test_devices.py::test_a_sender_device_the_first_rank_lacks_fails_every_rank_naming_path_and_device",
            "tests/test_wire.py::test_a_device_this_process_lacks_is_named_with_the_tensors_path",
        ],
    ),
    (
        "`device=` the first rank does not have (`'cuda'` without CUDA)",
        "`ValueError: device='cuda' is not usable on the first rank (...)`, on every rank, before anything is written",
        ["tests/test_bad_input.py::test_bad_call_fails_fast_everywhere"],
    ),
    (
        "unsupported config values (a lambda, a set, an open file...)",
        "`TypeError` naming the value's path, e.g. `config['layers'][3]['act_fn']`, on every rank, before anything is written",
        [
            "tests/test_gather.py::test_unsupported_value_named_by_path_on_every_rank_before_writes",
            "tests/test_wire.py::test_type_errors_name_the_path",
        ],
    ),
    (
        "a config nested deeper than 200 containers (dict, list, tuple, dataclass, OrderedDict; on any rank, the first included)",
        "`TypeError: config['k']['k']...(190 more)...['k']: containers nested deeper than 200 levels: this dict is at level 201, past the limit of 200 (wire.MAX_DEPTH) ...`, on every rank, before anything is written; the next gather works",
        ["tests/test_bad_input.py::test_too_deep_config_refused_on_every_rank"],
    ),
    (
        "a dataclass whose module the first rank has not imported (never imported on decode)",
        "first rank: `PayloadError` naming the rank and the class; senders: `PayloadError` quoting it",
        ["tests/test_gather.py::test_reader_failure_is_reported_to_every_rank"],
    ),
    (
        "a truncated payload",
        "`PayloadError: truncated: payload says N bytes, got M`; a short workspace file is re-read until the timeout, then named with both lengths",
        [
            "tests/test_wire.py::test_truncation",
            "tests/test_workspace.py::test_truncated_file_is_waited_for_then_named",
            "tests/test_workspace.py::test_longer_file_fails_at_once",
        ],
    ),
    (
        "a corrupted payload (one byte flipped between publish and fetch)",
        "first rank: `PayloadError: payload of rank 2 is unusable: checksum mismatch ...`; senders: `PayloadError` quoting it",
        [
            "tests/test_wire.py::test_flipped_byte_with_checksum",
            "tests/test_workspace.py::test_checksum_corruption_is_detected",
            "tests/test_bad_input.py::test_bad_call_fails_fast_everywhere",
        ],
    ),
    (
        "an oversized header (header length 2**40)",
        "`PayloadError: header length ... exceeds the limit of 67108864 bytes`, nothing allocated",
        ["tests/test_wire.py::test_prefix_errors", "tests/test_wire.py::test_crafted_header_structure"],
    ),
    (
        "a malformed header (bad magic, version, flags, lengths, msgpack, tensor table, ext types)",
        "`PayloadError` saying which field is wrong and what was expected",
        [
            "tests/test_wire.py::test_prefix_errors",
            "tests/test_wire.py::test_crafted_payloads",
            "tests/test_wire.py::test_crafted_header_structure",
        ],
    ),
    (
        "a crafted header nesting arrays 1,000+ deep, or a huge tensor table (200,000 empty tensors)",
        "`PayloadError` saying what is wrong (`containers nested deeper than msgpack's limit of 1024 levels`, `more than N empty tensors in a payload of M bytes`), never a `RecursionError`; refused while the table is read, holding at most 8 bytes per payload byte + 2 MiB",
        [
            "tests/test_wire.py::test_crafted_deep_headers_are_refused_clearly",
            "tests/test_wire.py::test_crafted_table_costs_a_small_multiple_of_its_size",
        ],
    ),
    (
        "a workspace weights file crafted to run code when unpickled (`NFSWorkspace`)",
        "`PayloadError: refusing to load weights ...: they are not a plain state dict` (`torch.load(weights_only=True)`); the code never runs",
        ["tests/test_workspace.py::test_nfs_workspace_refuses_code_in_weights"],
    ),
    (
        "a pickle planted where a gather payload is expected",
        "first rank: `PayloadError: ... bad magic ...: this is not a distribute_utils payload`; the code never runs (the gather path never unpickles)",
        [
            "tests/test_bad_input.py::test_bad_call_fails_fast_everywhere",
            "tests/test_bad_input.py::test_no_unpickling_anywhere_in_the_package",
        ],
    ),
    (
        "a workspace path that is a file",
        "senders: `WorkspaceError: workspace PATH is not a directory`; first rank: `WorkspaceError: rank 1 cannot take part in the gather: ...` quoting it",
        [
            "tests/test_workspace.py::test_bad_workspace_paths_give_clear_errors",
            "tests/test_bad_input.py::test_bad_call_fails_fast_everywhere",
        ],
    ),
    (
        "a workspace path that is missing (parent missing too)",
        "`WorkspaceError: workspace PATH does not exist and neither does its parent ...`; nothing is created",
        ["tests/test_workspace.py::test_bad_workspace_paths_give_clear_errors"],
    ),
    (
        "a workspace that is not writable (read-only mount)",
        "senders: `WorkspaceError: cannot write ... to workspace PATH: Read-only file system ...`; first rank: `WorkspaceError` quoting it",
        [
            "tests/test_workspace.py::test_full_and_read_only_workspace",
            "tests/test_faults.py::test_full_and_read_only_workspace_in_a_gather",
        ],
    ),
    (
        "a full workspace (disk or quota)",
        "`SpaceError: workspace PATH (N bytes free now) has no room for the M bytes of rank r's payload`; no file left",
        [
            "tests/test_workspace.py::test_full_and_read_only_workspace",
            "tests/test_faults.py::test_full_and_read_only_workspace_in_a_gather",
        ],
    ),
    (
        "a job or round token with path characters (`../escape`)",
        "`ValueError: job token '../escape' is not usable in a file name ...`",
        [
            "tests/test_workspace.py::test_bad_workspace_paths_give_clear_errors",
            "tests/test_workspace.py::test_job_token_without_distributed",
        ],
    ),
    (
        "mesh shapes that disagree across ranks",
        "`ValueError: ranks disagree on the mesh ...: rank 2 differs`, on every rank (detected, not a hang)",
        ["tests/test_mesh.py::test_mesh_shapes_that_disagree_raise_everywhere"],
    ),
]


# -- the summary ------------------------------------------------------------------------------
@dataclass
class Row:
    """One bad input tried here: passed, and whether anything was written or left behind."""

    case: str
    passed: bool = False
    leaked: bool | None = None  # a segment or workspace file appeared or stayed
    detail: str = ""


ROWS: list[Row] = []


@pytest.fixture
def row(request: pytest.FixtureRequest) -> Iterator[Row]:
    entry = Row(case=request.node.name.removeprefix("test_"))
    yield entry
    ROWS.append(entry)


# -- helpers that run on the ranks ------------------------------------------------------------
def _pool_pids() -> set[int]:
    return {p.pid for p in sync.companion(None).peers(30)}


class _Watch:
    """Records every segment of ``pids`` that appears in /dev/shm while it runs."""

    def __init__(self, pids: set[int]) -> None:
        self.pids, self.seen = pids, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name in os.listdir("/dev/shm"):
                tail = name.rsplit("_", 1)[-1]
                if name.startswith("du_") and tail.isdigit() and int(tail) in self.pids:
                    self.seen.add(name)
            time.sleep(0.001)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Evil:
    """Runs a command when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _patched(cls: type, name: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``cls.name`` by ``make(original)``; returns the undo function."""
    original = getattr(cls, name)
    setattr(cls, name, make(original))
    return lambda: setattr(cls, name, original)


def _bad_call(case: str, tmp: str) -> dict[str, Any]:
    """One gather with a bad input on some rank(s); what this rank saw."""
    rank = dist.get_rank()
    pids = _pool_pids()  # collective on the world: before any rank leaves
    value: Any = torch.full((1000,), float(rank))
    ranks: list[int] = [0, 1, 2, 3]
    kwargs: dict[str, Any] = {"timeout": 30}
    group = None
    undo: list[Callable[[], None]] = []
    if case == "not_in_group":
        group = dist.new_group([0, 1, 2])  # collective on the world
        ranks = [0, 3]
    elif case == "different_transports":
        kwargs["transport"] = "collective" if rank == 1 else "auto"
    elif case == "unknown_transport_one_rank":
        kwargs["transport"] = "pigeon" if rank == 2 else "auto"
    elif case == "bad_timeout_one_rank":
        kwargs["timeout"] = -1 if rank == 2 else 30
    elif case == "bad_env_timeout_one_rank":
        if rank == 3:
            os.environ[sync.TIMEOUT_ENV] = "soon"
            undo.append(lambda: os.environ.pop(sync.TIMEOUT_ENV))
            del kwargs["timeout"]
    elif case == "not_a_tensor_one_rank":
        value = [1, 2] if rank == 1 else value
    elif case == "device_unusable":
        kwargs["device"] = "cuda"
    elif case == "workspace_is_a_file":
        kwargs.update(transport="workspace", workspace_path=os.path.join(tmp, "a_file"))
    elif case in ("corrupt_workspace_file", "pickle_as_payload_file"):
        kwargs.update(transport="workspace", workspace_path=os.path.join(tmp, "ws"))
        if rank == 2:

            def make(publish: Any) -> Any:
                def tampered(self: ws.WorkspaceTransport, token: str, r: int, payload: Any) -> None:
                    publish(self, token, r, payload)
                    path = self.path(token, r)
                    if case == "corrupt_workspace_file":
                        with open(path, "r+b") as f:  # flip one byte of the tensor data
                            f.seek(payload.chunks[0][0] + 7)
                            byte = f.read(1)
                            f.seek(payload.chunks[0][0] + 7)
                            f.write(bytes([byte[0] ^ 0x40]))
                    else:
                        torch.save({"w": _Evil(os.path.join(tmp, "pwned"))}, path)

                return tampered

            undo.append(_patched(ws.WorkspaceTransport, "publish", make))
    else:
        raise ValueError(case)
    out: dict[str, Any] = {}
    if case == "not_in_group" and rank == 3:  # not a member: takes no part
        dist.barrier()
        dist.barrier()
        return {"skipped": True}
    start = time.monotonic()
    try:
        with _Watch(pids) as watch:
            try:
                with get_tensors_parallel(value, ranks, group, **kwargs) as got:
                    out["received"] = len(got)
                out["error_type"] = None
            except Exception as exc:
                out["error_type"], out["message"] = type(exc).__name__, str(exc)
    finally:
        for fn in undo:
            fn()
    out["elapsed"] = time.monotonic() - start
    out["seen"] = sorted(watch.seen)
    dist.barrier()
    wsns.close_namespaces()
    dist.barrier()
    return out


# (case, expected substring on every rank, message on the first rank, on others, nothing written)
BAD_CALLS: list[tuple[str, str, str | None, str | None, bool]] = [
    ("not_in_group", "ArgumentError", "ranks [3] are not in the group [0, 1, 2]", None, True),
    ("different_transports", "ArgumentError", "ranks asked for different transports", None, True),
    (
        "unknown_transport_one_rank",
        "ArgumentError",
        "rank 2 cannot take part in the gather: unknown transport 'pigeon'",
        None,
        True,
    ),
    (
        "bad_timeout_one_rank",
        "ArgumentError",
        "rank 2 cannot take part in the gather: timeout must be a positive number",
        None,
        True,
    ),
    (
        "bad_env_timeout_one_rank",
        "ArgumentError",
        "rank 3 cannot take part in the gather: $DISTRIBUTE_UTILS_TIMEOUT='soon' is not a number",
        None,
        True,
    ),
    (
        "not_a_tensor_one_rank",
        "UnsupportedTypeError",
        "rank 1 cannot take part in the gather: get_tensors_parallel gathers a torch.Tensor; got list",
        None,
        True,
    ),
    ("device_unusable", "ArgumentError", "device='cuda' is not usable on the first rank", None, True),
    (
        "workspace_is_a_file",
        "",
        "rank 1 cannot take part in the gather: [Errno 20] workspace {tmp}/a_file is not a directory",
        "workspace {tmp}/a_file is not a directory",
        True,
    ),
    (
        "corrupt_workspace_file",
        "",
        "payload of rank 2 is unusable: checksum mismatch",
        "the first rank (0) failed: payload of rank 2 is unusable: checksum mismatch",
        False,
    ),
    (
        "pickle_as_payload_file",
        "",
        "payload of rank 2",
        "the first rank (0) failed: payload of rank 2",
        False,
    ),
]


@pytest.mark.parametrize(
    ("case", "kind", "first", "others", "unwritten"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_call_fails_fast_everywhere(
    ranks4: RankPool,
    tmp_path: Path,
    row: Row,
    case: str,
    kind: str,
    first: str,
    others: str | None,
    unwritten: bool,
) -> None:
    (tmp_path / "a_file").write_text("not a directory")
    results = ranks4.run(_bad_call, case, str(tmp_path), timeout=90)
    first, others = first.format(tmp=tmp_path), (others or first).format(tmp=tmp_path)
    ran = [r for r in results if not r.get("skipped")]
    seen = sorted({name for r in ran for name in r["seen"]})
    ws = tmp_path / "ws"
    ws_left = [str(p.relative_to(ws)) for p in ws.rglob("*")] if ws.exists() else []
    ws_left = [n for n in ws_left if not n.startswith(".du-")]  # this user's lock directory
    row.leaked = bool(ws_left) or (unwritten and bool(seen))
    for rank, r in enumerate(ran):
        assert r["error_type"] is not None, f"rank {rank} raised nothing: {r}"
        if kind:
            assert r["error_type"] == kind, r
        expected = first if rank == 0 else others
        if rank != 0 and case not in (
            "workspace_is_a_file",
            "corrupt_workspace_file",
            "pickle_as_payload_file",
        ):
            expected = expected.split("cannot take part in the gather: ")[-1]
        assert expected in r["message"], (rank, r["message"])
        assert r["elapsed"] < FAST_S, f"rank {rank} waited {r['elapsed']:.1f} s: {r['message']}"
    if unwritten:
        assert seen == [], f"segments were written before the error: {seen}"
    if case == "corrupt_workspace_file":
        assert ran[0]["error_type"] == ran[1]["error_type"] == "PayloadError"  # (one type on every rank)
    if case == "pickle_as_payload_file":
        assert "bad magic" in ran[0]["message"] and "not a distribute_utils payload" in ran[0]["message"]
        assert not (tmp_path / "pwned").exists(), "the planted pickle ran"
    assert not ws_left, f"left in the workspace: {ws_left}"
    row.detail = f"rank 0: {ran[0]['error_type']}: {ran[0]['message'][:90]}"
    row.passed = True


@dataclass
class Link:
    """A dataclass that nests (at module level, where the reading rank looks it up)."""

    child: Any


NESTINGS = ("dict", "list", "tuple", "dataclass", "odict")


def _nested(kind: str, levels: int, leaf: Any) -> Any:
    """``leaf`` inside ``levels`` containers of ``kind`` ("mixed": each kind in turn)."""
    value = leaf
    for i in range(levels):
        k = NESTINGS[i % len(NESTINGS)] if kind == "mixed" else kind
        if k == "dict":
            value = {"k": value}
        elif k == "list":
            value = [value]
        elif k == "tuple":
            value = (value,)
        elif k == "dataclass":
            value = Link(value)
        else:
            value = collections.OrderedDict(k=value)
    return value


def _too_deep_rounds(cases: list[tuple[str, int, str]]) -> dict[str, Any]:
    """One gather per case ``(kind, who, entry)``: rank ``who`` passes a config 10,000 containers deep,
    the others a small one; what each rank got. Then configs at the limit, then an exact gather."""
    rank = dist.get_rank()
    pids = _pool_pids()
    seen: list[dict[str, Any]] = []
    for kind, who, entry in cases:
        value: Any = {"rank": rank, "w": torch.ones(100)}
        if rank == who and kind == "cycle":
            value["loop"] = [value]
        elif rank == who:
            value = _nested(kind, 10_000, torch.ones(2))
        gather = modelopt.get_configs_parallel if entry == "modelopt" else get_configs_parallel
        out: dict[str, Any] = {"case": (kind, who, entry), "error_type": None}
        start = time.monotonic()
        with _Watch(pids) as watch:
            try:
                with gather(value, [0, 1, 2, 3], None):
                    pass
            except Exception as exc:
                out["error_type"], out["message"] = type(exc).__name__, str(exc)
        out["elapsed"], out["seen"] = time.monotonic() - start, sorted(watch.seen)
        seen.append(out)
    # The group works afterwards: configs exactly at the limit travel from every rank, and data is exact.
    # (inside ``mine`` and its list: MAX_DEPTH containers in all)
    at_limit = [_nested(kind, wire.MAX_DEPTH - 2, rank) for kind in (*NESTINGS, "mixed")]
    mine = {"rank": rank, "deep": at_limit, "w": torch.arange(5000, dtype=torch.float64) * (rank + 1)}
    exact = None
    with get_configs_parallel(mine, [0, 1, 2, 3], timeout=30) as got:
        if rank == 0:
            exact = all(
                c["rank"] == r
                and c["deep"] == [_nested(kind, wire.MAX_DEPTH - 2, r) for kind in (*NESTINGS, "mixed")]
                and torch.equal(c["w"], torch.arange(5000, dtype=torch.float64) * (r + 1))
                for r, c in enumerate(got)
            )
    return {"rounds": seen, "exact": exact}


def test_too_deep_config_refused_on_every_rank(ranks4: RankPool, row: Row) -> None:
    """A config 10,000 containers deep, of each kind, on a sender or on the first rank (whose own value is
    never encoded), through our entry point and ModelOpt's: every rank raises the same TypeError naming
    the level and the limit, fast, with nothing written (a reference cycle: naming the cycle); the next
    gathers are exact."""
    cases = [(kind, who, "ours") for kind in (*NESTINGS, "mixed") for who in (0, 2)]
    cases += [
        ("dict", 0, "modelopt"),
        ("dataclass", 3, "modelopt"),
        ("cycle", 0, "ours"),
        ("cycle", 1, "ours"),
    ]
    results = ranks4.run(_too_deep_rounds, cases, timeout=300)
    limit = f"containers nested deeper than {wire.MAX_DEPTH} levels"
    row.leaked = any(r["seen"] for res in results for r in res["rounds"])
    for rank, res in enumerate(results):
        for r in res["rounds"]:
            kind, who, entry = r["case"]
            what = f"rank {rank}, {kind} on rank {who} ({entry})"
            assert r["error_type"] == "UnsupportedTypeError", (what, r)
            message = r["message"]
            if kind == "cycle":  # (infinitely deep: named as the cycle it is)
                assert "config['loop'][0]: reference cycle: this dict is the object at config" in message, (
                    what
                )
            else:
                assert limit in message, (what, message)
                assert f"is at level {wire.MAX_DEPTH + 1}, past the limit of {wire.MAX_DEPTH}" in message, (
                    what
                )
                assert "(190 more)" in message and len(message) < 600, (what, message)  # the path, shortened
            if rank != who:
                origin = "the first rank (0) failed: " if who == 0 else f"rank {who} cannot take part"
                assert origin in message, (what, message)
            assert r["elapsed"] < FAST_S, (what, r["elapsed"])
            assert r["seen"] == [], f"{what}: segments written before the error: {r['seen']}"
    assert results[0]["exact"] is True
    row.detail = f"rank 0: TypeError: {results[0]['rounds'][0]['message'][:90]}"
    row.passed = True


def test_timeout_precedence_and_validation(monkeypatch: pytest.MonkeyPatch, row: Row) -> None:
    from datetime import timedelta

    monkeypatch.delenv(sync.TIMEOUT_ENV, raising=False)
    assert sync.resolve_timeout(None) == sync.DEFAULT_TIMEOUT_S == 600.0
    monkeypatch.setenv(sync.TIMEOUT_ENV, "2.5")
    assert sync.resolve_timeout(None) == 2.5
    assert sync.resolve_timeout(7) == 7.0, "the argument wins over the environment"
    assert sync.resolve_timeout(timedelta(minutes=1)) == 60.0
    with monkeypatch.context() as plain:
        plain.delenv(sync.TIMEOUT_ENV)
        assert sync.resolve_timeout(None) == 600.0
    monkeypatch.setenv(sync.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$DISTRIBUTE_UTILS_TIMEOUT='soon' is not a number of seconds"):
        sync.resolve_timeout(None)
    for bad in (0, -1, True, "5", float("nan")):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            sync.resolve_timeout(bad)  # type: ignore[arg-type]
    row.leaked, row.detail = False, "600 s default; argument > $DISTRIBUTE_UTILS_TIMEOUT > default"
    row.passed = True


def test_every_table_row_has_a_test_that_exists(row: Row) -> None:
    for name, outcome, tests in TABLE:
        assert tests and outcome, name
        for ref in tests:
            path, _, function = ref.partition("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(function)}\(", source, re.M), (
                f"{ref} (row {name!r}) does not exist"
            )
    doc = (ROOT / "docs" / "reliability.md").read_text()
    missing = [name for name, _, _ in TABLE if name not in doc]
    assert not missing, f"rows missing from docs/reliability.md: {missing}"
    row.leaked, row.detail = False, f"{len(TABLE)} rows, each with at least one test"
    row.passed = True


# -- security ---------------------------------------------------------------------------------
SEGMENT_RE = re.compile(r"du_(?P<token>[0-9a-f]{16})_(?P<rank>\d+)_(?P<pid>\d+)")


def _segment_modes(rounds: int) -> dict[str, Any]:
    """Gather ``rounds`` times under umask 0; senders record their segment while it exists."""
    rank = dist.get_rank()
    recorded: list[tuple[str, int, int]] = []

    def make(publish: Any) -> Any:
        def spy(self: shm.SharedMemoryTransport, token: str, r: int, payload: Any) -> str:
            receipt = publish(self, token, r, payload)
            path = shm.segment_path(token, r, os.getpid())
            st = os.stat(path)  # the first rank cannot take it before this rank posts its claim
            recorded.append((os.path.basename(path), stat.S_IMODE(st.st_mode), st.st_uid))
            return receipt

        return spy

    old_umask = os.umask(0)
    undo = _patched(shm.SharedMemoryTransport, "publish", make)
    shm.SharedMemoryTransport.pooling = False
    try:
        for i in range(rounds):  # above the inline and attached limits: each sender makes a named segment
            with get_tensors_parallel(torch.full((80_000 + i,), float(rank)), [0, 1, 2, 3], timeout=30):
                pass
    finally:
        shm.SharedMemoryTransport.pooling = True
        undo()
        os.umask(old_umask)
    return {"rank": rank, "pid": os.getpid(), "recorded": recorded}


def test_segments_private_with_fresh_unguessable_names(ranks4: RankPool, row: Row) -> None:
    rounds = 12
    results = ranks4.run(_segment_modes, rounds)
    tokens_by_round: list[set[str]] = [set() for _ in range(rounds)]
    for r in results[1:]:
        assert len(r["recorded"]) == rounds
        for i, (name, mode, uid) in enumerate(r["recorded"]):
            m = SEGMENT_RE.fullmatch(name)
            assert m, name
            assert int(m["rank"]) == r["rank"] and int(m["pid"]) == r["pid"], name
            assert mode == 0o600, f"{name} has mode {mode:o} under umask 0"
            assert uid == os.getuid()
            tokens_by_round[i].add(m["token"])
    assert all(len(t) == 3 for t in tokens_by_round), "each sender picks its own token in each round"
    tokens = [t for round_tokens in tokens_by_round for t in sorted(round_tokens)]
    assert len(set(tokens)) == 3 * rounds, "a fresh token for every sender in every round"
    values = [int(t, 16) for t in tokens]
    assert sorted(values) != values or len({b - a for a, b in itertools.pairwise(values)}) > 1, (
        "not a counter"
    )
    source = (ROOT / "distribute_utils" / "roles" / "sender.py").read_text()
    assert "secrets.token_hex(8)" in source, "tokens come from the secrets module"
    row.leaked, row.detail = False, f"{rounds * 3} segments, all 0600, {rounds * 3} distinct 64-bit tokens"
    row.passed = True


def _workspace_modes(workspace: str) -> dict[str, Any]:
    rank = dist.get_rank()
    recorded: dict[str, int] = {}

    def make(publish: Any) -> Any:
        def spy(self: ws.WorkspaceTransport, token: str, r: int, payload: Any) -> None:
            publish(self, token, r, payload)
            mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
            recorded["file"] = mode(self.path(token, r))
            recorded["namespace"] = mode(self.namespace)
            recorded["workspace"] = mode(workspace)
            for name in os.listdir(self.namespace):
                if name.startswith("owner-"):
                    recorded["owner"] = mode(os.path.join(self.namespace, name))
            recorded["names"] = len(os.path.basename(self.namespace)) - len(wsns.NAMESPACE_PREFIX)

        return spy

    old_umask = os.umask(0)
    undo = _patched(ws.WorkspaceTransport, "publish", make)
    try:
        with get_tensors_parallel(
            torch.ones(10), [0, 1, 2, 3], transport="workspace", workspace_path=workspace, timeout=30
        ):
            pass
    finally:
        undo()
        os.umask(old_umask)
    dist.barrier()
    wsns.close_namespaces()
    return {"rank": rank, **recorded}


def test_workspace_files_private(ranks4: RankPool, tmp_path: Path, row: Row) -> None:
    workspace = tmp_path / "ws"  # created by the gather, under umask 0
    results = ranks4.run(_workspace_modes, str(workspace))
    for r in results[1:]:
        assert r["file"] == 0o600 and r["owner"] == 0o600, r
        assert r["namespace"] == 0o700 and r["workspace"] == 0o700, r
        assert r["names"] == 32, "the job token is 128 random bits (32 hex digits)"
    left = [p.name for p in workspace.iterdir() if not p.name.startswith(".du-")]
    row.leaked = bool(left)
    assert not left, left
    row.detail = "payload files and owner records 0600, namespace and workspace 0700 (umask 0)"
    row.passed = True


_CALLS_THAT_UNPICKLE = {("pickle", "load"), ("pickle", "loads"), ("marshal", "load"), ("marshal", "loads")}
# launch.py reads results its own spawned children send over a private pipe (what
# multiprocessing itself does); no data from a segment, a workspace or another job.
_ALLOWED = {("distribute_utils/launch.py", "pickle", "loads")}


def test_no_unpickling_anywhere_in_the_package(row: Row) -> None:
    found = []
    for path in sorted((ROOT / "distribute_utils").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else None
            call = (name, node.func.attr)
            if call in _CALLS_THAT_UNPICKLE and (rel, *call) not in _ALLOWED:
                found.append(f"{rel}:{node.lineno}: {name}.{node.func.attr}")
            if node.func.attr == "read_metadata":  # DCP's FileSystemReader: a plain pickle.load of .metadata
                found.append(f"{rel}:{node.lineno}: read_metadata (read_dcp_metadata reads it safely)")
            if call == ("torch", "load"):
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    found.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("Unpickler",):
                found.append(f"{rel}:{node.lineno}: {node.func.attr}")
    assert not found, found
    row.leaked, row.detail = False, "AST scan: no pickle/marshal load, every torch.load has weights_only=True"
    row.passed = True


_opened: list[str] = []
_AUDITING = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if _AUDITING.is_set() and event in ("open", "os.open") and args and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one is idle unless _AUDITING is set


@dataclass
class Named:
    path: str
    other: str


def test_paths_inside_payloads_never_reach_open(tmp_path: Path, row: Row) -> None:
    bait = str(tmp_path / "bait")
    config = {
        "path": bait,
        "file": "../../etc/passwd",
        "nested": [bait, {"p": Path(bait).as_uri()}],
        "dc": Named(bait, "/etc/shadow"),
        "t": torch.arange(4),
    }
    tr = ws.WorkspaceTransport(tmp_path / "ws", "auditjob", 5.0)
    token = "r0und"
    tr.publish(token, 1, wire.encode(config, checksum=True))
    _opened.clear()
    _AUDITING.set()
    try:
        buf = tr.fetch(token, 1)
        out = wire.decode(buf)
    finally:
        _AUDITING.clear()
    tr.close()
    assert out["path"] == bait and out["dc"] == Named(bait, "/etc/shadow")
    assert _opened == [tr.path(token, 1)], f"files opened while fetching and decoding: {_opened}"
    row.leaked, row.detail = False, "fetch + decode open only the transport's own file name"
    row.passed = True


def test_zz_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Print the bad-input table and what ran here; fail if anything failed or leaked."""
    lines = ["| input | what the user gets | tests |", "|---|---|---|"]
    for name, outcome, tests in TABLE:
        refs = ", ".join(f"`{t.removeprefix('tests/')}`" for t in tests)
        lines.append(f"| {name} | {outcome} | {refs} |")
    ran = ["", "| case run here | passed | leaked anything | first rank saw |", "|---|---|---|---|"]
    for r in ROWS:
        leaked = "-" if r.leaked is None else "yes" if r.leaked else "no"
        ran.append(f"| {r.case} | {'yes' if r.passed else 'NO'} | {leaked} | {r.detail.replace('|', '/')} |")
    bad_inputs = sum(r.case.startswith("bad_call") for r in ROWS)
    ran.append("")
    ran.append(
        f"{len(TABLE)} bad inputs tabled, {bad_inputs} tried here on 4 real ranks; "
        f"{sum(r.passed for r in ROWS)}/{len(ROWS)} passed, {sum(bool(r.leaked) for r in ROWS)} leaked anything"
    )
    text = "\n".join(lines + ran)
    with capsys.disabled():
        print("\n\nBad input summary\n" + text)
    target = os.environ.get("DU_RELIABILITY_TABLE")
    if target:
        with open(target, "a") as f:
            f.write("### Bad input\n\n" + "\n".join(ran).strip() + "\n\n")
    bad = [r.case for r in ROWS if not r.passed or r.leaked]
    assert not bad, f"cases that failed or leaked: {bad}"
