"""The workspace (NFS) transport and NFSWorkspace: real files in temporary directories.

Single-process tests cover the file discipline (lengths, checksums, waiting, names,
permissions, errors); a 4-rank test covers ModelOpt's NFSWorkspace semantics and the
transport between real processes; a root-only test mounts a full tmpfs and a read-only bind
in a private mount namespace.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pickle
import secrets
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import distribute_utils
from distribute_utils import PayloadError, wire
from distribute_utils.errors import WorkspaceError
from distribute_utils.processes import pid_start_time, this_process
from distribute_utils.transports import files as wsfiles
from distribute_utils.transports import namespace as wsns
from distribute_utils.transports.namespace import job_token, sweep_stale_namespaces
from distribute_utils.transports.nfs_workspace import NFSWorkspace
from distribute_utils.transports.workspace import WorkspaceTransport

from harness import RankPool


def _simulate_nodes() -> ModuleType | None:
    """scripts/simulate_nodes.py (sshfs server and mounts), or None where it is missing."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "simulate_nodes.py"
    spec = importlib.util.spec_from_file_location("simulate_nodes", script)
    if not script.exists() or spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("simulate_nodes", module)
    spec.loader.exec_module(module)
    return sys.modules["simulate_nodes"]


sn = _simulate_nodes()
SSHFS_REASON = (
    "scripts/simulate_nodes.py is missing" if sn is None else sn.require_simulation_support("sshfs")
)
needs_sshfs = pytest.mark.skipif(
    SSHFS_REASON is not None, reason=f"sshfs workspace unavailable: {SSHFS_REASON}"
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare to mount a full tmpfs and a read-only bind in a private mount namespace",
)


def _token() -> str:
    return secrets.token_hex(8)


def _config(rank: int) -> dict:
    return {
        "rank": rank,
        "name": f"layer{rank}",
        "scales": (0.5, None, True),
        "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1),
        "bias": torch.full((5,), rank, dtype=torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64)[::2],  # a strided view
        "empty": torch.empty(0, 3),
    }


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert b[key].dtype == value.dtype and torch.equal(b[key], value), key
        else:
            assert b[key] == value, key


def _entries(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("owner-"))


@pytest.fixture
def transport(tmp_path: Path) -> Iterator[WorkspaceTransport]:
    tr = WorkspaceTransport(tmp_path / "ws", _token(), timeout=0.5)
    yield tr
    tr.close()


# -- round trip, lengths, checksums, waiting -----------------------------------------------------
@pytest.mark.parametrize("read_mode", ["read", "mmap", "auto"])
def test_round_trip_tensors_and_config(tmp_path: Path, read_mode: str) -> None:
    with WorkspaceTransport(tmp_path / "ws", _token(), 5.0, read_mode=read_mode) as tr:
        token = _token()
        tr.publish(token, 3, wire.encode(_config(3), checksum=True))
        assert _entries(tr.namespace) == [f"{token}_3.du"]
        buf = tr.fetch(token, 3)
        assert _entries(tr.namespace) == [], "fetch unlinks the file"
        if read_mode == "read":
            assert isinstance(buf, bytearray)
        _same(_config(3), wire.decode(buf))
        tr.release(token, 3)  # idempotent after fetch
        namespace = tr.namespace
    assert not os.path.exists(namespace), "closing the last user removes the empty namespace"


def test_transport_rejoins_a_namespace_it_left(tmp_path: Path) -> None:
    tr = WorkspaceTransport(tmp_path, _token(), 1.0)
    tr.close()
    assert not os.path.exists(tr.namespace)
    token = _token()
    tr.publish(token, 1, wire.encode([1, 2], checksum=True))  # e.g. after close_namespaces()
    assert wire.decode(tr.fetch(token, 1)) == [1, 2]
    wsns.close_namespaces()
    assert not os.path.exists(tr.namespace)


def test_auto_read_mode_maps_only_local_filesystems(tmp_path: Path) -> None:
    kind = wsfiles.filesystem_type(tmp_path)
    assert kind != "unknown"
    with WorkspaceTransport(tmp_path, _token(), 1.0) as tr:
        assert tr.maps_files == (kind in wsfiles.LOCAL_FS)
    assert "nfs4" not in wsfiles.LOCAL_FS and not any(k.startswith("fuse") for k in wsfiles.LOCAL_FS)


def test_truncated_file_is_waited_for_then_named(transport: WorkspaceTransport) -> None:
    token = _token()
    payload = wire.encode(_config(1), checksum=True)
    transport.publish(token, 1, payload)
    path = transport.path(token, 1)
    os.truncate(path, payload.nbytes - 100)
    start = time.monotonic()
    with pytest.raises(PayloadError) as info:
        transport.fetch(token, 1)
    assert time.monotonic() - start >= 0.45, "a short file is retried until the timeout"
    message = str(info.value)
    assert path in message
    assert f"holds {payload.nbytes - 100} bytes but its payload says {payload.nbytes}" in message
    assert "still short after 0.5 s" in message


def test_longer_file_fails_at_once(tmp_path: Path) -> None:
    """A file longer than its payload is never retried (a short one is, until the timeout: 60 s here)."""
    with WorkspaceTransport(tmp_path / "ws", _token(), timeout=60.0) as transport:
        token = _token()
        payload = wire.encode(_config(1), checksum=True)
        transport.publish(token, 1, payload)
        with open(transport.path(token, 1), "ab") as f:
            f.write(b"junk")
        start = time.monotonic()
        with pytest.raises(PayloadError, match=f"holds {payload.nbytes + 4} bytes but its payload says"):
            transport.fetch(token, 1)
        assert time.monotonic() - start < 30


def test_checksum_corruption_is_detected(transport: WorkspaceTransport) -> None:
    token = _token()
    payload = wire.encode(_config(2), checksum=True)
    transport.publish(token, 2, payload)
    offset = payload.chunks[0][0] + 5  # inside the first tensor's bytes
    with open(transport.path(token, 2), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    buf = transport.fetch(token, 2)
    with pytest.raises(PayloadError, match="checksum mismatch"):
        wire.decode(buf)


def test_payload_without_checksum_is_refused(transport: WorkspaceTransport) -> None:
    with pytest.raises(ValueError, match="checksum=True"):
        transport.publish(_token(), 1, wire.encode(_config(1)))
    assert _entries(transport.namespace) == []


def test_late_file_is_waited_for(tmp_path: Path) -> None:
    with WorkspaceTransport(tmp_path, _token(), 60.0) as tr:
        token = _token()
        payload = wire.encode(_config(1), checksum=True)
        late = threading.Timer(0.5, tr.publish, (token, 1, payload))
        start = time.monotonic()
        late.start()
        try:
            buf = tr.fetch(token, 1)
        finally:
            late.join()
        assert 0.45 <= time.monotonic() - start < 30  # found once there, not at the timeout
        _same(_config(1), wire.decode(buf))


def test_missing_file_times_out_naming_the_path(transport: WorkspaceTransport) -> None:
    token = _token()
    with pytest.raises(PayloadError) as info:
        transport.fetch(token, 7)
    message = str(info.value)
    assert transport.path(token, 7) in message and "did not appear within 0.5 s" in message
    assert "same shared directory on every node" in message


# -- names, permissions, leftovers ---------------------------------------------------------------
def test_names_are_never_reused(transport: WorkspaceTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    finals: list[str] = []
    rename = os.rename

    def spy(src: str, dst: str) -> None:
        finals.append(dst)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", spy)
    for _ in range(5):
        token = _token()
        for rank in (1, 2):
            transport.publish(token, rank, wire.encode(rank, checksum=True))
        for rank in (1, 2):
            assert wire.decode(transport.fetch(token, rank)) == rank
    assert len(finals) == len(set(finals)) == 10
    token = _token()
    transport.publish(token, 1, wire.encode(1, checksum=True))
    with pytest.raises(FileExistsError, match="never rewritten"):
        transport.publish(token, 1, wire.encode(1, checksum=True))
    transport.release(token, 1)


def test_permissions_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tr = WorkspaceTransport(tmp_path / "ws", _token(), 1.0)
        modes: list[int] = []
        payload = wire.encode(_config(1), checksum=True)
        real_write = payload.write_to_fd

        def write(fd: int) -> None:  # the temporary file, while it is being written
            modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
            real_write(fd)

        object.__setattr__(payload, "write_to_fd", write)
        token = _token()
        tr.publish(token, 1, payload)
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        assert mode(tmp_path / "ws") == 0o700
        assert mode(tr.namespace) == 0o700
        assert modes == [0o600]
        assert mode(tr.path(token, 1)) == 0o600
        owners = [n for n in os.listdir(tr.namespace) if n.startswith("owner-")]
        assert len(owners) == 1 and mode(os.path.join(tr.namespace, owners[0])) == 0o600
        assert mode(wsns.lock_path(str(tmp_path / "ws"))) == 0o600
        record = json.loads(Path(tr.namespace, owners[0]).read_text())
        me = this_process()
        assert (record["pid"], record["boot_id"], record["start_time"]) == (me.pid, me.boot_id, me.start_time)
        tr.release(token, 1)
        tr.close()
    finally:
        os.umask(old)


def test_release_removes_leftovers(transport: WorkspaceTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    token = _token()
    transport.publish(token, 1, wire.encode(_config(1), checksum=True))
    transport.release(token, 1)
    transport.release(token, 1)
    assert _entries(transport.namespace) == []

    # A publish that fails midway removes its temporary file itself...
    payload = wire.encode(_config(1), checksum=True)

    def broken(fd: int) -> None:
        os.write(fd, b"partial")
        raise OSError(errno.EIO, "I/O error")

    object.__setattr__(payload, "write_to_fd", broken)
    with pytest.raises(OSError, match="I/O error"):
        transport.publish(token := _token(), 1, payload)
    assert _entries(transport.namespace) == []

    # ...and when even that unlink fails, release removes the temporary file.
    monkeypatch.setattr(wsfiles, "unlink", lambda path: False)
    with pytest.raises(OSError, match="I/O error"):
        transport.publish(token, 2, payload)
    monkeypatch.undo()
    assert len(_entries(transport.namespace)) == 1 and _entries(transport.namespace)[0].startswith(".")
    transport.release(token, 2)
    assert _entries(transport.namespace) == []


def test_bad_workspace_paths_give_clear_errors(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(WorkspaceError, match=f"workspace {a_file} is not a directory") as info:
        WorkspaceTransport(a_file, _token(), 1.0)
    assert info.value.errno == errno.ENOTDIR and isinstance(info.value, OSError)
    deep = tmp_path / "missing" / "ws"
    with pytest.raises(WorkspaceError, match=f"neither does its parent {tmp_path / 'missing'}") as info:
        WorkspaceTransport(deep, _token(), 1.0)
    assert info.value.errno == errno.ENOENT
    assert not (tmp_path / "missing").exists(), "parents are never created (an unmounted share)"
    with pytest.raises(ValueError, match="job token"):
        WorkspaceTransport(tmp_path, "../escape", 1.0)
    with pytest.raises(ValueError, match="round token"):
        WorkspaceTransport(tmp_path, _token(), 1.0).path("a/b", 1)
    err = pickle.loads(pickle.dumps(WorkspaceError(errno.EROFS, "read-only")))
    assert isinstance(err, WorkspaceError) and err.errno == errno.EROFS


# -- full and read-only filesystems (root: private mount namespace) ------------------------------
_SPACE_SCRIPT = textwrap.dedent(
    """
    import errno, json, os, sys
    import torch
    from distribute_utils import SpaceError, WorkspaceError, wire
    from distribute_utils.transports import files as wsfiles
    from distribute_utils.transports import nfs_workspace
    from distribute_utils.transports import workspace as ws

    full, ro = sys.argv[1], sys.argv[2]
    out = {}
    payload = wire.encode(torch.zeros(2**20), checksum=True)  # 4 MiB into a 1 MiB tmpfs
    tr = ws.WorkspaceTransport(full, "fulljob", 5.0)
    try:
        tr.publish("round1", 1, payload)
    except SpaceError as exc:
        out["reserve"] = [exc.errno, str(exc)]
    wsfiles.reserve_space = lambda fd, n: False  # a filesystem without fallocate: the write itself fails
    try:
        tr.publish("round2", 1, payload)
    except SpaceError as exc:
        out["write"] = [exc.errno, str(exc)]
    nfs = nfs_workspace.NFSWorkspace(full)
    try:
        nfs.write_configs_and_weights({"a": 1}, {"w": torch.zeros(2**20)})
    except SpaceError as exc:
        out["nfs"] = [exc.errno, str(exc)]
    out["left"] = sorted(n for n in os.listdir(tr.namespace) if not n.startswith("owner-"))
    out["left_nfs"] = sorted(n for n in os.listdir(nfs.namespace) if not n.startswith("owner-"))
    try:
        ws.WorkspaceTransport(ro, "rojob", 5.0)
    except WorkspaceError as exc:
        out["ro"] = [exc.errno, str(exc)]
    out["payload_bytes"] = payload.nbytes
    print(json.dumps(out))
    """
)


@needs_root
def test_full_and_read_only_workspace(tmp_path: Path) -> None:
    script = tmp_path / "space.py"
    script.write_text(_SPACE_SCRIPT)
    full, src, ro = tmp_path / "full", tmp_path / "src", tmp_path / "ro"
    for d in (full, src, ro):
        d.mkdir()
    shell = (
        f"mount --make-rprivate / && mount -t tmpfs -o size=1m,mode=0700 tmpfs {full} && "
        f"mount --bind {src} {ro} && mount -o remount,bind,ro {ro} && "
        f"exec {sys.executable} {script} {full} {ro}"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(distribute_utils.__file__).parents[1]))
    proc = subprocess.run(
        ["unshare", "--mount", "--fork", "sh", "-c", shell],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    nbytes = f"{out['payload_bytes']:,}"
    for key in ("reserve", "write"):
        code, message = out[key]
        assert code == errno.ENOSPC, out
        assert f"workspace {full}/du-job-fulljob" in message and f"the {nbytes} bytes" in message, message
        assert "free space or raise the quota" in message
    assert out["nfs"][0] == errno.ENOSPC and "rank 0's weights" in out["nfs"][1], out
    assert out["left"] == [] and out["left_nfs"] == [], "nothing half-written stays visible"
    code, message = out["ro"]
    assert code == errno.EROFS and str(ro) in message and "read-only" in message, out


# -- a real network filesystem: two sshfs mounts of one export, as two hosts would see it ---------
@needs_sshfs
def test_two_sshfs_mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert sn is not None
    export = tmp_path / "export"
    export.mkdir()
    with (
        sn.sshfs_server(export, workdir=tmp_path) as endpoint,
        sn.sshfs_mount(endpoint, tmp_path / "a") as mount_a,
        sn.sshfs_mount(endpoint, tmp_path / "b") as mount_b,
    ):
        job = _token()
        writer = WorkspaceTransport(Path(mount_a, "ws"), job, 10.0)
        reader = WorkspaceTransport(Path(mount_b, "ws"), job, 10.0)
        assert wsfiles.filesystem_type(reader.namespace).startswith("fuse") and not reader.maps_files
        for i in range(40):  # sizes change every round: a reused name would show a stale size
            token = _token()
            value = {"i": i, "t": torch.arange(1 + 97 * (i % 5), dtype=torch.float64)}
            writer.publish(token, 1, wire.encode(value, checksum=True))
            _same(value, wire.decode(reader.fetch(token, 1)))
            writer.release(token, 1)
        monkeypatch.setenv(wsns.JOB_TOKEN_ENV, job)
        wsns.forget_job_token()
        nfs_a, nfs_b = NFSWorkspace(Path(mount_a, "ws")), NFSWorkspace(Path(mount_b, "ws"))
        for k in range(3):
            nfs_a.write_configs_and_weights({"k": k}, {"w": torch.full((10 + k,), float(k))})
            config, weights = nfs_b.read_configs_and_weights_from_rank(0)
            assert config == {"k": k} and torch.equal(weights["w"], torch.full((10 + k,), float(k)))
        nfs_a.close()
        writer.close()
        reader.close()
        assert os.listdir(export / "ws") == [os.path.basename(wsns.user_dir(""))]


# -- NFSWorkspace: ModelOpt semantics ------------------------------------------------------------
def test_nfs_workspace_single_process(tmp_path: Path) -> None:
    assert not NFSWorkspace().is_initialized
    assert NFSWorkspace().path == Path("")  # ModelOpt's attribute, with its meaning
    with pytest.raises(ValueError, match="not initialized"):
        NFSWorkspace().write_configs_and_weights({}, {})
    nfs = NFSWorkspace(tmp_path / "ws")
    assert nfs.is_initialized and nfs.path == tmp_path / "ws" and nfs.namespace is not None
    assert nfs.read_configs_and_weights_from_rank(0) == (None, None)
    assert not nfs.state_path.exists()
    names: list[set[str]] = []
    for k in range(3):
        nfs.write_configs_and_weights({"k": k, "t": (1, 2)}, {"w": torch.full((3,), float(k))} if k else None)
        names.append(set(_entries(str(nfs.namespace))))
        assert nfs.state_path.exists()
        for _ in range(2):  # ModelOpt: reading twice returns the state twice
            config, weights = nfs.read_configs_and_weights_from_rank(0)
            assert config == {"k": k, "t": (1, 2)}
            assert (weights is None) if k == 0 else torch.equal(weights["w"], torch.full((3,), float(k)))
    assert names[0].isdisjoint(names[1]) and names[1].isdisjoint(names[2]), "fresh names for every write"
    assert all(stat.S_IMODE(os.stat(nfs.namespace / n).st_mode) == 0o600 for n in names[2])
    nfs.close()
    assert not nfs.namespace.exists()
    again = NFSWorkspace(tmp_path / "ws")  # a new one removes this rank's earlier state (ModelOpt)
    assert again.read_configs_and_weights_from_rank(0) == (None, None)
    again.write_configs_and_weights({"k": 3}, None)
    assert set(_entries(str(again.namespace))).isdisjoint(set().union(*names)), "no name reused"
    assert again.read_configs_and_weights_from_rank(0) == ({"k": 3}, None)
    again.close()
    nfs.write_configs_and_weights({"k": 4}, None)  # a closed workspace joins the namespace again
    assert nfs.read_configs_and_weights_from_rank(0) == ({"k": 4}, None)
    nfs.close()


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {os.environ['DU_TEST_MARKER']}",))


def test_nfs_workspace_refuses_code_in_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DU_TEST_MARKER", str(marker))
    nfs = NFSWorkspace(tmp_path / "ws")
    nfs.write_configs_and_weights({"a": 1}, {"w": torch.ones(2)})
    weights = [n for n in _entries(str(nfs.namespace)) if n.endswith(".pt")]
    assert len(weights) == 1
    torch.save({"w": _Evil()}, nfs.namespace / weights[0])  # a crafted file at the expected name
    with pytest.raises(PayloadError, match=r"refusing to load weights .* not a plain state dict"):
        nfs.read_configs_and_weights_from_rank(0)
    assert not marker.exists(), "the pickle's code ran"
    nfs.close()


def _nfs_modelopt(workspace: str) -> dict:
    """On 4 ranks: ModelOpt's write / barrier / read protocol, then the transport itself."""
    rank = dist.get_rank()
    nfs = NFSWorkspace(workspace)
    report: dict = {"token": job_token(), "namespace": str(nfs.namespace)}
    if rank != 3:  # rank 3 writes nothing in the first round
        nfs.write_configs_and_weights({"rank": rank, "round": 1}, {"w": torch.full((4,), float(rank))})
    distribute_utils.barrier()
    seen = []
    for r in range(4):  # every rank reads every rank, as ModelOpt's pipeline merge does
        config, weights = nfs.read_configs_and_weights_from_rank(r)
        seen.append(None if config is None else (config["round"], config["rank"], weights["w"].tolist()))
    report["round1"] = seen
    distribute_utils.barrier()
    nfs = NFSWorkspace(workspace)  # ModelOpt builds one per call: it removes this rank's round 1
    nfs.write_configs_and_weights({"rank": rank, "round": 2}, {})
    distribute_utils.barrier()
    if rank == 0:
        report["round2"] = [nfs.read_configs_and_weights_from_rank(r) for r in range(4)]
    distribute_utils.barrier()

    tr = WorkspaceTransport(workspace, job_token(), 10.0)
    token = f"{job_token()[:8]}r1"
    if rank:
        tr.publish(token, rank, wire.encode(_config(rank), checksum=True))
    distribute_utils.barrier()
    if rank == 0:
        got = [wire.decode(tr.fetch(token, r)) for r in (1, 2, 3)]
        for r, value in zip((1, 2, 3), got):
            _same(_config(r), value)
        report["fetched"] = len(got)
    distribute_utils.barrier()
    if rank:
        tr.release(token, rank)
    tr.close()  # leaves the namespace: this rank's owner record and last NFSWorkspace files
    distribute_utils.barrier()
    report["namespace_left"] = os.path.exists(nfs.namespace)
    return report


def test_nfs_workspace_on_four_ranks(ranks4: RankPool, tmp_path: Path) -> None:
    reports = ranks4.run(_nfs_modelopt, str(tmp_path / "ws"), timeout=60)
    assert len({r["token"] for r in reports}) == 1, "every rank agrees on the job token"
    assert len({r["namespace"] for r in reports}) == 1
    expected = [(1, r, [float(r)] * 4) for r in range(3)] + [None]
    assert all(r["round1"] == expected for r in reports), [r["round1"] for r in reports]
    assert reports[0]["round2"] == [({"rank": r, "round": 2}, {}) for r in range(4)]
    assert reports[0]["fetched"] == 3
    assert not any(r["namespace_left"] for r in reports)
    assert os.listdir(tmp_path / "ws") == [os.path.basename(wsns.user_dir(""))]


def test_latest_write_wins_and_a_reader_may_skip_writes(tmp_path: Path) -> None:
    nfs = NFSWorkspace(tmp_path)
    nfs.write_configs_and_weights({"k": 0}, None)
    nfs.write_configs_and_weights({"k": 1}, {"w": torch.ones(1)})  # the reader never read write 0
    config, weights = nfs.read_configs_and_weights_from_rank(0)
    assert config == {"k": 1} and torch.equal(weights["w"], torch.ones(1))
    assert len([n for n in _entries(str(nfs.namespace)) if n.startswith("ws-r0-")]) == 2, (
        "only the latest write"
    )
    nfs.close()


def test_job_token_without_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    wsns.forget_job_token()
    monkeypatch.setenv(wsns.JOB_TOKEN_ENV, "my-job-42")
    assert job_token() == "my-job-42"
    wsns.forget_job_token()
    monkeypatch.setenv(wsns.JOB_TOKEN_ENV, "bad/token")
    with pytest.raises(ValueError, match="DISTRIBUTE_UTILS_JOB_TOKEN"):
        job_token()
    wsns.forget_job_token()
    monkeypatch.delenv(wsns.JOB_TOKEN_ENV)
    first = job_token()
    assert first == job_token() and len(first) == 32


# -- sweeping ------------------------------------------------------------------------------------
def _fake_namespace(workspace: Path, name: str, owners: list[dict], age_s: float = 0.0) -> Path:
    path = workspace / f"{wsns.NAMESPACE_PREFIX}{name}"
    path.mkdir(mode=0o700)
    (path / "abc_1.du").write_bytes(b"x")
    for i, owner in enumerate(owners):
        (path / f"owner-h-{i}.json").write_text(json.dumps(owner))
    if age_s:
        then = time.time() - age_s
        for p in [*path.iterdir(), path]:
            os.utime(p, (then, then))
    return path


def _record(pid: int, start_time: int, boot_id: str | None = None) -> dict:
    me = this_process()
    info = me.__class__(me.hostname, boot_id or me.boot_id, -1, me.pid_namespace, pid, start_time)
    return json.loads(wsns.owner_record(info))


def test_sweep_removes_dead_local_jobs_and_keeps_live_ones(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    child_start = pid_start_time(child.pid)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    try:
        dead_pid = int(finished.stdout)
        me = this_process()
        dead = _fake_namespace(tmp_path, "dead", [_record(dead_pid, 12345)])
        reused = _fake_namespace(tmp_path, "reused", [_record(me.pid, me.start_time + 1)])  # pid reused
        live = _fake_namespace(tmp_path, "live", [_record(dead_pid, 1), _record(child.pid, child_start)])
        remote = _fake_namespace(tmp_path, "remote", [_record(dead_pid, 1, boot_id="other-boot")])
        old_remote = _fake_namespace(tmp_path, "oldremote", [_record(1, 1, "other-boot")], age_s=3 * 86400)
        orphan = _fake_namespace(tmp_path, "orphan", [])
        old_orphan = _fake_namespace(tmp_path, "oldorphan", [], age_s=3 * 86400)
        mine = WorkspaceTransport(tmp_path, _token(), 1.0)  # open in this process: never swept

        planned = sweep_stale_namespaces(tmp_path, dry_run=True)
        assert {p for p, _ in planned} == {str(dead), str(reused), str(old_remote), str(old_orphan)}
        assert dead.exists(), "dry run removes nothing"
        removed = dict(sweep_stale_namespaces(tmp_path))
        assert removed.keys() == {str(dead), str(reused), str(old_remote), str(old_orphan)}
        assert "has exited" in removed[str(dead)] and str(dead_pid) in removed[str(dead)]
        assert "untouched for 72.0 h" in removed[str(old_remote)]
        for kept in (live, remote, orphan, Path(mine.namespace)):
            assert kept.exists(), kept
        assert dict(sweep_stale_namespaces(tmp_path, max_age=0.0)).keys() == {str(remote), str(orphan)}
        assert live.exists() and Path(mine.namespace).exists(), "live owners win over any age"
        mine.close()
    finally:
        child.communicate(b"")
