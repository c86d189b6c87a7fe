"""Internal. ModelOpt's ``NFSWorkspace``: the same shared directory, with ModelOpt's names and call shapes.

Files are written with ``torch.save`` and read with ``torch.load(weights_only=True)`` (nothing is
unpickled from a shared place), atomically (:func:`.files.atomic_write`), in the job's namespace
(:mod:`.namespace`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from ..errors import ArgumentError, PayloadError
from ..owners import process_owned
from ..wire import decode, encode
from .files import LOCAL_FS, atomic_write, read_payload_file, unlink
from .namespace import FILE_SUFFIX, close_namespace, job_token, on_namespace_close, open_namespace, sweep_once

__all__ = [
    "NFSWorkspace",
    "WorkspaceStates",
]

logger = logging.getLogger(__name__)

_ENVELOPE = "distribute_utils.nfs_workspace/1"


@dataclass
class _RankState:
    """One rank's writes in one namespace, shared by every NFSWorkspace of the process."""

    namespace: str
    rank: int
    writes: int = 0  # the number of this rank's next write (continues across NFSWorkspace objects)
    last: list[str] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)  # the latest write found, per rank read

    def remove_last(self) -> None:
        for path in self.last:
            unlink(path)
        self.last = []


class WorkspaceStates(dict[tuple[str, int], _RankState]):
    """Each rank's writes per namespace, (namespace, rank) -> its state; process-wide
    (``process_owned(WorkspaceStates)``), like the namespaces (:class:`.namespace.Namespaces`): a write
    counter continues for as long as the process, so that no name is ever reused in a namespace."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def _remove_last_files(path: str) -> None:
    """Leaving the namespace ``path``: each rank's last files there go (counters stay, so a reopened
    namespace never reuses a name)."""
    for key, state in list(process_owned(WorkspaceStates).items()):
        if key[0] == path:
            state.remove_last()


class _RecordingWriter:
    """A file object for ``torch.save`` that keeps the ``OSError`` torch turns into RuntimeError."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _save_weights(weights: Any, fd: int) -> None:
    with open(fd, "wb", closefd=False) as f:
        out = _RecordingWriter(f)
        try:
            torch.save(weights, out)  # type: ignore[arg-type]
            f.flush()
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise


def _storage_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage in ``obj`` (what ``torch.save`` writes)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes() + 1024
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total + 64 * 1024


class NFSWorkspace:
    """ModelOpt-compatible shared workspace: configs and weights per rank, as files.

    Drop-in for ``modelopt.torch.export.distribute.NFSWorkspace``, with its observable
    behaviour: making one removes this rank's earlier state; a read returns the target rank's
    latest write (``(None, None)`` when it has none), as often as it is asked; a new write
    replaces the rank's previous one. Reads and writes involve no collective and no barrier:
    the caller synchronises all ranks (write, barrier, read, barrier), as with ModelOpt.

    Kept from us, unlike ModelOpt's plain ``rank_<r>_state.pth``: every write goes to fresh
    names (a network filesystem's cached attributes of an old file can never be taken for a
    new one), appears atomically (temp + fsync + rename, the config last), carries a checksum,
    and is read without unpickling anything (the config as a wire payload, the weights with
    ``torch.load(weights_only=True)``), in the job's private namespace
    ``<workspace>/du-job-<token>/`` (:attr:`namespace`).

    Attributes:
        path: the workspace directory, as given (ModelOpt's meaning).
        namespace: the job's directory inside it, where the files are.
        rank: this process's global rank.

    Args:
        workspace_path: the shared directory; None leaves the workspace uninitialised.
    """

    def __init__(self, workspace_path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path("") if workspace_path is None else Path(workspace_path)
        self.namespace: Path | None = None
        self._state: _RankState | None = None
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if workspace_path is None:
            return
        from ..sync import resolve_timeout

        self._timeout = resolve_timeout(None)
        self._ns = open_namespace(workspace_path, job_token(), self._timeout)
        sweep_once(self._ns.workspace, self._timeout)
        self.namespace = Path(self._ns.path)
        self._mmap = self._ns.fs_type in LOCAL_FS
        key = (self._ns.path, self.rank)
        states = process_owned(WorkspaceStates)
        with states.lock:
            if not states:  # (registered once: the states are never emptied)
                on_namespace_close(_remove_last_files)
            self._state = states.setdefault(key, _RankState(self._ns.path, self.rank))
            self._state.last = []
            self._remove_own_files()  # ModelOpt's _clean_up() at construction

    @property
    def is_initialized(self) -> bool:
        """Whether a workspace path was given."""
        return self._state is not None

    @property
    def state_path(self) -> Path:
        """This rank's latest config file (a name that does not exist before its first write)."""
        state = self._require()
        latest = self._latest(self.rank)
        name = self._names(self.rank, latest)[0] if latest is not None else f"ws-r{self.rank}-unwritten"
        return Path(state.namespace, name)

    def _names(self, rank: int, write: int) -> tuple[str, str]:
        stem = f"ws-r{rank}-w{write}"
        return f"{stem}.config{FILE_SUFFIX}", f"{stem}.weights.pt"

    def _remove_own_files(self) -> None:
        """Remove this rank's state: earlier writes, and leftovers of an earlier process."""
        prefix = f"ws-r{self.rank}-w"
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self._ns.path):
                if name.startswith(prefix):
                    unlink(os.path.join(self._ns.path, name))

    def _require(self) -> _RankState:
        if self._state is None:
            raise ArgumentError("NFSWorkspace is not initialized: pass a workspace_path")
        if self._ns.closed or self._ns.pid != os.getpid():  # rejoin after close()
            self._ns = open_namespace(self._ns.workspace, self._ns.token, self._timeout)
        return self._state

    def write_configs_and_weights(self, config_json: Any, weights: dict[str, Any] | None) -> None:
        """Write this rank's config and weights; they replace its previous write.

        Args:
            config_json: the config: JSON-like values, tuples, dataclasses and tensors.
            weights: a state dict (tensors and plain containers), or None.

        Raises:
            TypeError: the config holds a value that cannot be encoded (the path is named).
            SpaceError: the workspace has no room; WorkspaceError: it is not writable.
        """
        state = self._require()
        k = state.writes
        config_name, weights_name = self._names(self.rank, k)
        kind = "none" if weights is None else "file"
        envelope = {
            "format": _ENVELOPE,
            "rank": self.rank,
            "write": k,
            "config": config_json,
            "weights": kind,
        }
        payload = encode(envelope, root="config_json", checksum=True)
        made: list[str] = []
        try:
            if kind == "file":
                made.append(
                    atomic_write(
                        self._ns.path,
                        weights_name,
                        lambda fd: _save_weights(weights, fd),
                        nbytes=None,
                        reserve=_storage_bytes(weights),
                        what=f"rank {self.rank}'s weights",
                    )
                )
            # The config goes last: once it exists, the write is complete.
            made.append(
                atomic_write(
                    self._ns.path,
                    config_name,
                    payload.write_to_fd,
                    nbytes=payload.nbytes,
                    what=f"rank {self.rank}'s config",
                )
            )
        except BaseException:
            for path in made:
                unlink(path)
            raise
        state.remove_last()
        state.last = made
        state.writes = k + 1

    def _exists(self, rank: int, write: int) -> bool:
        # A lookup of one name is revalidated by NFS / FUSE clients; a cached directory
        # listing may hide a new file for many seconds.
        return os.path.exists(os.path.join(self._ns.path, self._names(rank, write)[0]))

    def _listed(self, rank: int) -> int | None:
        pattern = re.compile(rf"ws-r{int(rank)}-w(\d+)\.config{re.escape(FILE_SUFFIX)}")
        try:
            names = os.listdir(self._ns.path)
        except FileNotFoundError:
            return None
        found = [int(m.group(1)) for n in names if (m := pattern.fullmatch(n))]
        return max(found) if found else None

    def _latest(self, rank: int) -> int | None:
        """The number of ``rank``'s latest complete write: from the last one this process found
        (or a listing, the first time), probing the next names one by one."""
        state = self._require()
        start = state.seen.get(rank)
        if start is None or not self._exists(rank, start):
            listed = self._listed(rank)
            start = max(start if start is not None else -1, listed if listed is not None else -1)
            if start < 0 and not self._exists(rank, 0):
                return None
            start = max(start, 0)
        k = start
        while self._exists(rank, k + 1):
            k += 1
        if not self._exists(rank, k):
            return None
        state.seen[rank] = k
        return k

    def read_configs_and_weights_from_rank(self, target_rank: int) -> tuple[Any, Any]:
        """Rank ``target_rank``'s latest write: ``(config, weights)``, or ``(None, None)``.

        Raises:
            PayloadError: a file is corrupt or truncated, or the weights are not a plain state
                dict (``torch.load(weights_only=True)`` refused them).
        """
        self._require()
        target = int(target_rank)
        deadline = time.monotonic() + self._timeout
        while True:
            k = self._latest(target)
            if k is None:
                return None, None
            config_name, weights_name = self._names(target, k)
            config_path = os.path.join(self._ns.path, config_name)
            buf = read_payload_file(
                config_path,
                deadline=deadline,
                use_mmap=False,
                wait_missing=False,
                what=f"config of rank {target}",
                timeout=self._timeout,
            )
            if buf is not None:
                try:
                    envelope = decode(buf)
                except PayloadError as exc:
                    raise PayloadError(f"config {config_path} of rank {target}: {exc}") from None
                if (
                    not isinstance(envelope, dict)
                    or envelope.get("format") != _ENVELOPE
                    or envelope.get("rank") != target
                    or envelope.get("write") != k
                ):
                    raise PayloadError(
                        f"config {config_path} is not write {k} of rank {target} in NFSWorkspace format"
                    )
                if envelope["weights"] != "file":
                    return envelope["config"], None
                weights = self._load_weights(
                    os.path.join(self._ns.path, weights_name), target, missing_ok=True
                )
                if weights is not None:
                    return envelope["config"], weights
            # Superseded by a newer write while we read: read that one.
            if time.monotonic() > deadline:
                raise PayloadError(
                    f"rank {target}'s write {k} disappeared while it was read, for {self._timeout:g} s; "
                    "synchronise writes and reads (barrier) as with ModelOpt's NFSWorkspace"
                )

    def _load_weights(self, path: str, target: int, missing_ok: bool = False) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=self._mmap)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise PayloadError(
                f"weights {path} of rank {target} are missing although its config exists"
            ) from None
        except pickle.UnpicklingError as exc:
            raise PayloadError(
                f"refusing to load weights {path} of rank {target}: they are not a plain state dict "
                f"of tensors and containers (torch.load with weights_only=True rejected them: "
                f"{str(exc).splitlines()[0]}); NFSWorkspace never unpickles arbitrary objects "
                "from a shared directory"
            ) from None
        except (RuntimeError, EOFError, ValueError) as exc:
            raise PayloadError(f"weights {path} of rank {target} are unreadable: {exc}") from None

    def close(self) -> None:
        """Remove this rank's last files and leave the namespace (after the last read, everywhere)."""
        if self._state is not None:
            close_namespace(self._ns, self._timeout)
