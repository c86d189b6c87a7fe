"""Case 5 of ``scripts/bench_gather.py``: gathers through a shared workspace (rank side), the workspace steps of one process, and the parent's side (local and simulated-node workspaces, files and bytes per round)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import secrets
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, get_tensors_parallel
from gatherbench.common import (
    LAYER_TENSORS,
    MIB,
    RankContext,
    Row,
    Settings,
    bulk_tensor,
    cost_row,
    dict_touch,
    layer_config,
    loads_text,
    same_bits,
    touch,
)
from gatherbench.file_events import WS_MARK_PREFIX, FileEvents

# ---------------------------------------------------------------------------------- workspace

WS_BASELINE_DIR = "bench-baseline"
"""Subdirectory of the workspace for the torch.save files (and the case markers)."""
WS_METHODS = {
    "ours": 'ours, transport="workspace" (flat)',
    "ours_auto": 'ours, transport="auto" (hierarchical)',
    "save_load": "torch.save -> torch.load",
    "save_load_mmap": "torch.save -> torch.load(mmap=True)",
}
_IO_FIELDS = ("write_bytes", "read_bytes", "cancelled_write_bytes", "wchar", "rchar")


@dataclasses.dataclass(frozen=True)
class WorkspaceSetup:
    """Where and how one rank runs the workspace cases."""

    where: str  # label of the filesystem/topology, part of the case names
    workspace: str  # the workspace_path every rank passes (the same directory everywhere)
    methods: tuple[str, ...]  # keys of WS_METHODS, "ours" first
    read_every_byte: bool  # rank 0 reads every byte (network filesystems) or touches one element

    @property
    def baseline_dir(self) -> str:
        return os.path.join(self.workspace, WS_BASELINE_DIR)


def read_io() -> dict[str, int]:
    """This process's I/O counters from ``/proc/self/io``.

    ``write_bytes`` counts the bytes of file pages this task dirtied (page granularity) on
    filesystems with writeback: ext4, xfs, NFS and FUSE (sshfs) count, tmpfs (``/dev/shm``)
    and sockets do not; ``wchar`` counts every byte passed to a write system call.
    """
    found = dict.fromkeys(_IO_FIELDS, 0)
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in found:
                found[key] = int(value)
    return found


def read_every_byte(tensors: Sequence[torch.Tensor]) -> int:
    """Read every byte of any tensors (4-byte words where the size allows)."""
    total = 0
    for t in tensors:
        if not t.numel():
            continue
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
            total += int(flat.view(torch.int32).max())
        else:
            total += int(flat.max())
    return total


def _config_tensors(configs: Sequence[Any]) -> list[torch.Tensor]:
    return [v for c in configs for v in c.values() if isinstance(v, torch.Tensor)]


def _ws_runner(
    ctx: RankContext, setup: WorkspaceSetup, key: str, values: Sequence[Any], names: Iterator[int]
) -> Callable[[Callable[[list[Any], int], None]], None]:
    """One repetition of method ``key``: every value of ``values`` gathered to rank 0 in turn.

    The returned function takes ``consume(got, index)``, called on rank 0 with the gathered
    list of value ``index``. ``names`` numbers the torch.save files (the same on every rank).
    """
    ranks, rank, first = ctx.ranks, ctx.rank, ctx.ranks[0]
    if key.startswith("ours"):
        transport = "auto" if key == "ours_auto" else "workspace"

        def ours(consume: Callable[[list[Any], int], None]) -> None:
            for i, value in enumerate(values):
                if isinstance(value, torch.Tensor):
                    gather = get_tensors_parallel(
                        value, ranks, workspace_path=setup.workspace, transport=transport
                    )
                else:
                    gather = get_configs_parallel(value, ranks, None, setup.workspace, transport=transport)
                with gather as got:
                    if got:
                        consume(got, i)

        return ours

    use_mmap = key == "save_load_mmap"

    def save_load(consume: Callable[[list[Any], int], None]) -> None:
        # ModelOpt's NFS path: every sender torch.saves into the shared directory, barrier, the
        # first rank torch.loads each file. Fresh names per round (ModelOpt rewrites one name per
        # rank, which a network client's attribute cache can serve stale); the reader unlinks.
        for i, value in enumerate(values):
            n = next(names)

            def path(r: int, n: int = n) -> str:
                return os.path.join(setup.baseline_dir, f"{key}-{n}-r{r}.pth")

            if rank != first:
                torch.save(value, path(rank))
            dist.barrier()
            if rank == first:
                got = [value]
                for r in ranks[1:]:
                    got.append(torch.load(path(r), map_location="cpu", weights_only=True, mmap=use_mmap))
                    os.unlink(path(r))
                consume(got, i)

    return save_load


class _Marks:
    """Rank 0 creates an empty marker file before and after each method's timed repetitions.

    The parent watches the directory with inotify and attributes the files created between a
    start marker and the next marker to that method (see :class:`FileEvents`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.made: dict[str, str | None] = {}  # marker name -> "case|key" (None: an end marker)

    def mark(self, label: str | None) -> None:
        name = f"{WS_MARK_PREFIX}{len(self.made):04d}"
        fd = os.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        self.made[name] = label

    def remove(self) -> None:
        for name in self.made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))


def bench_workspace(ctx: RankContext, setup: WorkspaceSetup) -> None:
    """Case 5: the workspace transport against torch.save + torch.load through the same directory.

    Two cases, as 1 and 2: a bulk tensor per rank, and ``workspace_layers`` layer configs in a
    row (time per layer). Every method first runs ``warmup`` untimed repetitions (the first
    checks rank 0's results bit for bit). The timed repetitions are interleaved: repetition
    ``k`` runs every method once, in an order rotated by ``k``, so that all methods see the
    same background load (the machine is shared). Each is timed barrier to barrier on rank 0.
    Around each timed repetition every rank reads its ``/proc/self/io`` counters (bytes written
    into the workspace) and rank 0 drops markers for the parent's file counter.
    """
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    if ctx.first:
        os.makedirs(setup.baseline_dir, exist_ok=True)
    dist.barrier()
    marks = _Marks(setup.baseline_dir) if ctx.first else None
    names = iter(range(10**9))
    consume_tensors = read_every_byte if setup.read_every_byte else touch
    bulk = [bulk_tensor(rank, s.bulk_bytes)]
    layers = [layer_config(rank, i) for i in range(s.workspace_layers)]
    cases = [
        (f"workspace, {setup.where}: bulk {ctx.world}x{s.bulk_bytes // MIB}MiB", bulk),
        (f"workspace, {setup.where}: layer config, per layer", layers),
    ]
    io_report = ctx.report.setdefault("workspace_io", {})
    verified = ctx.report.setdefault("workspace_verified", {})
    for case, values in cases:
        is_tensor = isinstance(values[0], torch.Tensor)
        wrong: list[str] = []

        def check(got: list[Any], i: int, is_tensor: bool = is_tensor, wrong: list[str] = wrong) -> None:
            for r, value in zip(ranks, got):
                if is_tensor:
                    if not same_bits(value, bulk_tensor(r, s.bulk_bytes)):
                        wrong.append(f"rank {r}")
                    continue
                want = layer_config(r, i)
                same = list(value) == list(want) and all(
                    same_bits(value[k], v) if isinstance(v, torch.Tensor) else value[k] == v
                    for k, v in want.items()
                )
                if not same:
                    wrong.append(f"rank {r} layer {i}")

        def consume(got: list[Any], i: int, is_tensor: bool = is_tensor) -> None:
            if is_tensor:
                consume_tensors(got)
            elif setup.read_every_byte:
                read_every_byte(_config_tensors(got))
            else:
                dict_touch(got, LAYER_TENSORS)

        runners = {key: _ws_runner(ctx, setup, key, values, names) for key in setup.methods}
        for key, run in runners.items():
            del wrong[:]
            for i in range(s.warmup):
                dist.barrier()
                run(check if i == 0 else consume)
            if ctx.first:
                verified[f"{case}|{key}"] = list(wrong) or True
        times: dict[str, list[float]] = {key: [] for key in runners}
        written = {key: dict.fromkeys(_IO_FIELDS, 0) for key in runners}
        order = list(runners)
        for k in range(s.workspace_repeats):
            for key in order[k % len(order) :] + order[: k % len(order)]:
                if marks is not None:
                    marks.mark(f"{case}|{key}")
                before = read_io()
                dist.barrier()
                start = time.perf_counter()
                runners[key](consume)
                times[key].append((time.perf_counter() - start) / len(values))
                after = read_io()
                if marks is not None:
                    marks.mark(None)
                for name in _IO_FIELDS:
                    written[key][name] += after[name] - before[name]
        per_rank: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(written, per_rank, dst=ranks[0])
        for key in runners:
            ctx.add(Row(case, key, WS_METHODS[key], times[key], None if key == "ours" else "ours"))
            if per_rank is not None:
                io_report[f"{case}|{key}"] = {
                    "per_rank": [counters[key] for counters in per_rank],
                    "rounds": s.workspace_repeats * len(values),
                }
        del runners
        gc.collect()
    dist.barrier()
    if marks is not None:
        ctx.report.setdefault("workspace_marks", {}).update(marks.made)
        marks.remove()
        with contextlib.suppress(OSError):
            os.rmdir(setup.baseline_dir)


# ---------------------------------------------------------------------------------- workspace costs


def workspace_costs(writer_dir: str, reader_dir: str, nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """One process alone: each step of moving ``nbytes`` through a workspace directory.

    The sender's steps of ours (encode with and without the CRC-32; create; ``fallocate``;
    ``pwritev``; ``fsync``; close + rename), then ours end to end (``WorkspaceTransport.publish``
    with and without ``fsync``, ``fetch`` through ``reader_dir``, ``wire.decode`` with the
    checksum verified), against ``torch.save`` and ``torch.load`` (plain, ``mmap=True``) of the
    same tensor. ``writer_dir`` and ``reader_dir`` name the same directory (two mounts of one
    share, or twice the same path). Median and minimum of ``repeats``; files removed as it goes.
    """
    from distribute_utils import wire
    from distribute_utils.transports import files as wsfiles
    from distribute_utils.transports import workspace as ws

    tensor = bulk_tensor(0, nbytes)
    results: list[dict[str, Any]] = []
    counter = iter(range(10**9))

    def record(name: str, times: list[float]) -> None:
        results.append(cost_row(name, times, nbytes))

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    record(
        "encode, CRC-32 computed",
        [timed(lambda: wire.encode(tensor, root="tensor", checksum=True)) for _ in range(repeats)],
    )
    record(
        "encode, no CRC",
        [timed(lambda: wire.encode(tensor, root="tensor", checksum=False)) for _ in range(repeats)],
    )
    payload = wire.encode(tensor, root="tensor", checksum=True)
    steps: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        tmp = os.path.join(writer_dir, f".costs-{os.getpid()}-{next(counter)}.tmp")
        final = tmp.removesuffix(".tmp") + ".du"
        start = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        t1 = time.perf_counter()
        reserved = wsfiles.reserve_space(fd, payload.nbytes)
        t2 = time.perf_counter()
        payload.write_to_fd(fd)
        t3 = time.perf_counter()
        os.fsync(fd)
        t4 = time.perf_counter()
        os.close(fd)
        os.rename(tmp, final)
        t5 = time.perf_counter()
        os.unlink(final)
        steps["sender: create (O_EXCL)"].append(t1 - start)
        steps[f"sender: fallocate ({'reserved' if reserved else 'not supported: skipped'})"].append(t2 - t1)
        steps["sender: pwritev"].append(t3 - t2)
        steps["sender: fsync"].append(t4 - t3)
        steps["sender: close + rename"].append(t5 - t4)
    for name, times in steps.items():
        record(name, times)

    token = f"costs{secrets.token_hex(6)}"
    totals: dict[str, list[float]] = defaultdict(list)
    for fsync in (True, False):
        writer = ws.WorkspaceTransport(writer_dir, token, 120.0, fsync=fsync)
        reader = ws.WorkspaceTransport(reader_dir, token, 120.0)
        mode = "mmap" if reader.maps_files else "read"
        try:
            for _ in range(repeats):
                round_token = f"r{next(counter)}"
                encode = timed(lambda: wire.encode(tensor, root="tensor", checksum=True))
                publish = timed(lambda rt=round_token, w=writer: w.publish(rt, 1, payload))
                start = time.perf_counter()
                buf = reader.fetch(round_token, 1)
                fetch = time.perf_counter() - start
                start = time.perf_counter()
                view = wire.decode(buf)
                read_every_byte([view])
                decode = time.perf_counter() - start
                del view, buf
                writer.release(round_token, 1)
                totals[f"ours: publish, fsync {'on' if fsync else 'off'}"].append(publish)
                if fsync:
                    totals[f"ours: fetch ({mode}, length check, unlink)"].append(fetch)
                    totals["ours: decode, CRC verified, + read every byte"].append(decode)
                totals[
                    f"ours total, fsync {'on' if fsync else 'off'} (encode+publish+fetch+decode+read)"
                ].append(encode + publish + fetch + decode)
        finally:
            writer.close()
            reader.close()
    for use_mmap in (False, True):
        label = "torch.load(mmap=True)" if use_mmap else "torch.load"
        for _ in range(repeats):
            name = f"costs-{os.getpid()}-{next(counter)}.pth"
            save = timed(lambda name=name: torch.save(tensor, os.path.join(writer_dir, name)))
            start = time.perf_counter()
            loaded = torch.load(os.path.join(reader_dir, name), weights_only=True, mmap=use_mmap)
            os.unlink(os.path.join(reader_dir, name))
            read_every_byte([loaded])
            load = time.perf_counter() - start
            del loaded
            if not use_mmap:
                totals["torch.save"].append(save)
            totals[f"{label}, unlink, + read every byte"].append(load)
            totals[f"torch.save + {label} total"].append(save + load)
    for name, times in totals.items():
        record(name, times)
    return results


@contextlib.contextmanager
def costs_directories(where: str, parent: str | None) -> Iterator[tuple[str, str, str]]:
    """(writer dir, reader dir, description) for ``--workspace-costs``: local disk or two sshfs mounts."""
    with tempfile.TemporaryDirectory(
        prefix="bench_gather_costs_", dir=parent or tempfile.gettempdir()
    ) as tmp:
        if where == "local":
            yield tmp, tmp, f"{filesystem_of(tmp)} ({tmp})"
            return
        sn = _load_simulate_nodes()
        reason = sn.require_simulation_support("sshfs")
        if reason is not None:
            raise RuntimeError(f"cannot mount sshfs here: {reason}")
        export = os.path.join(tmp, "export")
        os.mkdir(export)
        with (
            sn.sshfs_server(export, workdir=tmp) as endpoint,
            sn.sshfs_mount(endpoint, os.path.join(tmp, "a")) as mount_a,
            sn.sshfs_mount(endpoint, os.path.join(tmp, "b")) as mount_b,
        ):
            yield (
                mount_a,
                mount_b,
                f"two sshfs mounts of one export on {filesystem_of(export)}: write through one, read through the other",
            )


# ---------------------------------------------------------------------------------- workspace (parent)

SCRIPTS = Path(__file__).resolve().parents[1]
"""The scripts folder (the simulated-node launcher and the multi-node job live there)."""
MULTINODE_JOB = SCRIPTS / "bench_multinode_job.py"
MULTINODE_WHERE = {"dir": "shared dir 2x2", "sshfs": "sshfs 2x2"}
"""Labels of the simulated-node setups (2 nodes x 2 ranks) in the case names."""


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """The filesystem type holding ``path`` (the library's own mountinfo reader)."""
    from distribute_utils.transports.files import filesystem_type

    return filesystem_type(path)


def _watched_workspace(backing: Path, token: str) -> tuple[Path, Path]:
    """Create the job's namespace directory and the baseline directory ahead of the ranks."""
    from distribute_utils.transports.namespace import namespace_path

    namespace = Path(namespace_path(backing, token))
    namespace.mkdir(mode=0o700)
    baseline = backing / WS_BASELINE_DIR
    baseline.mkdir()
    return namespace, baseline


def _workspace_leftovers(backing: Path) -> list[str]:
    """What the ranks left in the workspace, except the workspace lock file (kept by design)."""
    return sorted(
        str(p.relative_to(backing)) for p in backing.rglob("*") if not p.name.startswith(".du-sweep-")
    )


@contextlib.contextmanager
def local_workspace(settings: Settings) -> Iterator[tuple[Settings, dict[str, Any]]]:
    """A fresh workspace on local disk for the local ranks; counts files; removed afterwards."""
    from distribute_utils.transports.namespace import JOB_TOKEN_ENV

    info: dict[str, Any] = {}
    if "workspace" not in settings.groups:
        yield settings, info
        return
    parent = settings.workspace_dir or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="bench_gather_ws_", dir=parent) as tmp:
        backing = Path(tmp)
        info.update(path=str(backing), filesystem=filesystem_of(backing))
        token = f"bench{secrets.token_hex(8)}"
        _namespace, baseline = _watched_workspace(backing, token)
        previous = os.environ.get(JOB_TOKEN_ENV)
        os.environ[JOB_TOKEN_ENV] = token  # inherited by the spawned ranks: a known namespace
        try:
            with FileEvents([_namespace, baseline]) as events:
                yield dataclasses.replace(settings, workspace_dir=str(backing)), info
        finally:
            if previous is None:
                os.environ.pop(JOB_TOKEN_ENV, None)
            else:
                os.environ[JOB_TOKEN_ENV] = previous
        info["events"] = events
        info["baseline_dir"] = str(baseline)
        info["overflowed"] = events.overflowed
        info["leftovers"] = _workspace_leftovers(backing)


def _load_simulate_nodes() -> Any:
    import importlib.util

    if "simulate_nodes" in sys.modules:
        return sys.modules["simulate_nodes"]
    spec = importlib.util.spec_from_file_location("simulate_nodes", SCRIPTS / "simulate_nodes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_nodes"] = module
    spec.loader.exec_module(module)
    return module


def run_multinode(settings: Settings, mode: str) -> dict[str, Any]:
    """Case 5 on 2 simulated nodes x 2 ranks over workspace ``mode`` (``dir`` or ``sshfs``).

    Runs ``scripts/bench_multinode_job.py`` under ``simulate_nodes.run_simulated``; the
    workspace's backing directory is a temporary one on the host, watched with inotify.
    Returns rank 0's report plus the file counts, or ``{"skipped": why}``.
    """
    from distribute_utils.transports.namespace import JOB_TOKEN_ENV

    sn = _load_simulate_nodes()
    reason = sn.require_simulation_support(mode)
    if reason is not None:
        return {"mode": mode, "skipped": reason}
    where = MULTINODE_WHERE[mode]
    job_settings = dataclasses.replace(
        settings, nproc=4, groups=("workspace",), workspace_dir=None, multinode=()
    )
    token = f"bench{secrets.token_hex(8)}"
    outcome: dict[str, Any] = {"mode": mode, "where": where, "load_average_before": os.getloadavg()}
    parent = settings.workspace_dir or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="bench_gather_nodes_", dir=parent) as tmp:
        backing, results = Path(tmp) / "backing", Path(tmp) / "results"
        backing.mkdir()
        results.mkdir()
        outcome["backing_filesystem"] = filesystem_of(backing)
        namespace, baseline = _watched_workspace(backing, token)
        env = {
            "DU_RESULTS": str(results),
            "DU_BENCH_SETTINGS": json.dumps(dataclasses.asdict(job_settings)),
            "DU_BENCH_WHERE": where,
            JOB_TOKEN_ENV: token,
        }
        with FileEvents([namespace, baseline]) as events:
            result = sn.run_simulated(
                MULTINODE_JOB,
                [],
                nodes=2,
                nproc_per_node=2,
                workspace=mode,
                shm_size="1g",
                timeout=settings.timeout_s,
                backing_dir=backing,
                env=env,
            )
        outcome["load_average_after"] = os.getloadavg()
        outcome["duration_s"] = result.duration
        outcome["mounts_left"] = sn.find_mounts_anywhere(str(result.run_dir))
        outcome["processes_left"] = [pid for pid in result.pids if sn.pid_alive(pid)]
        outcome["leftovers"] = _workspace_leftovers(backing)
        if result.returncode != 0 or not (results / "rank0.json").exists():
            outcome["error"] = f"exit code {result.returncode}:\n{result.format_outputs()[-4000:]}"
            return outcome
        job = json.loads((results / "rank0.json").read_text())
        outcome.update(job)
        outcome["workspace_files"] = events.count(str(baseline), job["report"].get("workspace_marks", {}))
        outcome["inotify_overflowed"] = events.overflowed
    return outcome


def add_workspace_columns(rows: list[dict[str, Any]], io: dict[str, Any], files: dict[str, Any]) -> None:
    """Files created and bytes written in the workspace per round, on the workspace rows."""
    for row in rows:
        label = f"{row['case']}|{row['key']}"
        if label not in io:
            continue
        rounds = io[label]["rounds"]
        per_rank = io[label]["per_rank"]
        row["rounds_counted"] = rounds
        row["written_bytes_per_round"] = sum(d["write_bytes"] for d in per_rank) / rounds
        row["write_bytes_per_rank"] = [d["write_bytes"] for d in per_rank]
        counted = files.get(label)
        row["files_per_round"] = counted["created"] / rounds if counted is not None else 0.0
        row["file_events"] = counted


def format_workspace(report: dict[str, Any]) -> list[str]:
    """The workspace table (with files and bytes) and the hierarchical-vs-flat summary."""
    rows = [row for row in report["rows"] if row["case"].startswith("workspace")]
    if not rows and not report.get("multinode"):
        return []
    lines = [
        "",
        "workspace: ours vs torch.save + torch.load through the same directory "
        "(vs ours = its median / ours = ours' speed / its speed)",
    ]
    header = (
        f"{'case':<48} {'method':<50} {'median ms':>10} {'vs ours':>8} {'files/round':>11} "
        f"{'MiB written/round':>17} {'n':>3}"
    )
    lines += [header, "-" * len(header)]
    for row in rows:
        ratio = f"{row['ratio_vs_ours']:.2f}x" if row.get("ratio_vs_ours") is not None else "-"
        files = f"{row['files_per_round']:.2f}" if "files_per_round" in row else "-"
        written = f"{row['written_bytes_per_round'] / MIB:.2f}" if "written_bytes_per_round" in row else "-"
        lines.append(
            f"{row['case']:<48} {row['method']:<50} {row['median_ms']:>10.2f} {ratio:>8} {files:>11} "
            f"{written:>17} {row['n']:>3}"
        )
    by = {(row["case"], row["key"]): row for row in rows}
    summary = []
    for row in rows:
        hier = by.get((row["case"], "ours_auto"))
        if row["key"] != "ours" or hier is None:
            continue
        summary.append(
            f"  {row['case']}: flat {row['median_ms']:.2f} ms, hierarchical {hier['median_ms']:.2f} ms "
            f"(flat / hierarchical {row['median_ms'] / hier['median_ms']:.2f}x); files/round "
            f"{row.get('files_per_round', 0):.2f} -> {hier.get('files_per_round', 0):.2f}; MiB written/round "
            f"{row.get('written_bytes_per_round', 0) / MIB:.2f} -> {hier.get('written_bytes_per_round', 0) / MIB:.2f}"
        )
    if summary:
        lines += [
            "",
            "hierarchical (transport='auto': one bundle per remote host) vs flat (transport='workspace'):",
        ]
        lines += summary
    verified = dict(report.get("workspace_verified", {}))
    for run in report.get("multinode", []):
        verified.update(run.get("report", {}).get("workspace_verified", {}))
    wrong = {label: v for label, v in verified.items() if v is not True}
    lines.append(
        f"  results checked bit for bit on rank 0 (first warm-up of every method): "
        f"{'all exact' if not wrong else f'WRONG: {wrong}'} ({len(verified)} methods)"
    )
    for run in report.get("multinode", []):
        state = run.get("skipped") or ("FAILED" if "error" in run else "ran")
        lines.append(
            f"  simulated nodes over {run['mode']}: {state}; load average before {loads_text(run.get('load_average_before'))}, "
            f"after {loads_text(run.get('load_average_after'))}; {run.get('duration_s', 0):.0f} s; leftovers "
            f"{run.get('leftovers', [])}; mounts left {run.get('mounts_left', [])}"
        )
        if "error" in run:
            lines.append(run["error"])
    return lines
