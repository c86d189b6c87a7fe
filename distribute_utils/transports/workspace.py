"""Internal. Workspace transport: payloads as files in a directory every rank can reach (NFS, Lustre, ...).

Ranks on different hosts cannot share memory, so they meet in the job's namespace of a shared directory
(:mod:`.namespace`).

- ``publish`` writes the payload to ``<token>_<rank>.du`` atomically (:func:`.files.atomic_write`).
- ``fetch`` reads it back (:func:`.files.read_payload_file`: retries while a network filesystem's
  caches hide or shorten it, up to ``timeout``), unlinks it and returns it;
  :func:`distribute_utils.wire.decode` then verifies the checksum.
- ``release`` removes whatever the sender left (idempotent).

Names are never rewritten: every round has a fresh token, so a client's cached attributes of
an old file can never be mistaken for a new one (NFS/FUSE clients cache sizes per name).
See ``docs/multinode.md``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Literal

from ..errors import ArgumentError, PayloadError, TransportUnavailableError
from ..wire import FLAG_CHECKSUM, EncodedPayload, read_prefix
from .base import Carrier, Context, Destination
from .files import LOCAL_FS, atomic_write, read_payload_file, unlink
from .namespace import (
    FILE_SUFFIX,
    Namespace,
    check_token,
    close_namespace,
    open_namespace,
    sweep_once,
)

__all__ = [
    "WorkspaceTransport",
]

logger = logging.getLogger(__name__)


# -- the transport -----------------------------------------------------------------------------
ReadMode = Literal["auto", "read", "mmap"]


class WorkspaceTransport:
    """The workspace carrier: moves payloads through files in a shared directory (see module doc);
    implements :class:`.base.Carrier` (kind ``"workspace"``).

    Args:
        workspace_path: a directory every participating rank reaches (an NFS mount...); created
            when missing if its parent exists.
        job_token: the job's namespace token, the same on every rank (:func:`job_token`).
        timeout: how long ``fetch`` waits for a file to appear whole, in seconds.
        fsync: ``fsync`` each file before renaming it into place.
        read_mode: ``"mmap"`` maps files privately (zero-copy; local filesystems only),
            ``"read"`` copies them into memory, ``"auto"`` maps on local filesystems and reads
            on network ones.
        sweep_stale: once per process and workspace, remove the namespaces of dead jobs
            (:func:`sweep_stale_namespaces`; failures are logged, not raised). The gather
            functions and :class:`NFSWorkspace` do this when they open a job's namespace.
        lock: take this user's workspace lock to create the namespace (False: a private
            probe namespace no other process knows, as ``doctor`` uses; nothing is left).

    Raises:
        WorkspaceError: the workspace is missing (parent too), not a directory, not writable.
    """

    kind = "workspace"
    done_when_answered = False
    scope = "any"
    medium = "shared_fs"
    max_bytes: int | None = None
    devices = "to_cpu"
    needs_go = False
    checksums = True  # (a network filesystem may serve stale or torn bytes)
    settings: tuple[str, ...] = ("workspace_path", "DISTRIBUTE_UTILS_JOB_TOKEN")

    def __init__(
        self,
        workspace_path: str | os.PathLike[str],
        job_token: str,
        timeout: float,
        *,
        fsync: bool = True,
        read_mode: ReadMode = "auto",
        sweep_stale: bool = False,
        lock: bool = True,
    ) -> None:
        if read_mode not in ("auto", "read", "mmap"):
            raise ArgumentError(f"read_mode must be 'auto', 'read' or 'mmap'; got {read_mode!r}")
        self._ns = open_namespace(workspace_path, job_token, timeout, lock)
        if sweep_stale:
            sweep_once(self._ns.workspace, timeout)
        self._timeout = float(timeout)
        self._fsync = fsync
        self._mmap = read_mode == "mmap" or (read_mode == "auto" and self._ns.fs_type in LOCAL_FS)
        self._temps: dict[tuple[str, int], set[str]] = {}

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> Carrier:
        """The round's workspace carrier (its ``workspace_path``): the one every rank of the job shares."""
        if context.workspace is None:
            raise PayloadError(
                "a payload was published in the workspace, but this gather has no workspace_path"
            )
        return context.workspace()

    @classmethod
    def sending(cls, destination: Destination) -> Carrier:
        """The job's workspace carrier, when the gather has a workspace_path."""
        if destination.workspace is None:
            raise TransportUnavailableError("no workspace_path was given")
        return destination.workspace()

    @property
    def label(self) -> str:
        return f"the workspace {self._ns.workspace}"

    def _open(self) -> Namespace:
        """The namespace, joined again if this process left it meanwhile (``close``)."""
        if self._ns.closed or self._ns.pid != os.getpid():
            self._ns = open_namespace(self._ns.workspace, self._ns.token, self._timeout)
        return self._ns

    @property
    def maps_files(self) -> bool:
        """Whether ``fetch`` maps payload files (zero-copy) rather than reading them into memory."""
        return self._mmap

    @property
    def namespace(self) -> str:
        """The job's namespace directory."""
        return self._ns.path

    def path(self, token: str, rank: int) -> str:
        """Final path of the payload ``rank`` publishes in round ``token``."""
        check_token(token, "round token")
        return os.path.join(self._ns.path, f"{token}_{int(rank)}{FILE_SUFFIX}")

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> None:
        """Write ``payload`` to its file (atomically); the receipt is None: names follow from the token."""
        if not read_prefix(payload.head).flags & FLAG_CHECKSUM:
            raise ArgumentError(
                "the workspace transport needs payloads encoded with checksum=True "
                "(a network filesystem may serve stale or partial bytes)"
            )
        final = self.path(token, rank)
        temps = self._temps.setdefault((token, rank), set())
        atomic_write(
            self._open().path,
            os.path.basename(final),
            payload.write_to_fd,
            nbytes=payload.nbytes,
            what=f"rank {rank}'s payload",
            fsync=self._fsync,
            temps=temps,
        )
        if not temps:
            del self._temps[(token, rank)]

    def fetch(self, token: str, rank: int, receipt: None = None) -> Any:
        """Read (or map) ``rank``'s payload file and remove its name."""
        path = self.path(token, rank)
        buf = read_payload_file(
            path,
            deadline=time.monotonic() + self._timeout,
            use_mmap=self._mmap,
            wait_missing=True,
            what=f"payload of rank {rank}",
            timeout=self._timeout,
        )
        unlink(path)
        return buf

    def discard(self, token: str, rank: int, receipt: None = None) -> None:
        """The receiver, after a failure: remove ``rank``'s file if it is still there."""
        unlink(self.path(token, rank))

    def release(self, token: str, rank: int, receipt: None = None, *, taken: bool = True) -> None:
        """The sender: remove its file and temporaries if anything is left (idempotent)."""
        unlink(self.path(token, rank))
        for tmp in self._temps.pop((token, rank), ()):
            unlink(tmp)

    def close(self) -> None:
        """Leave the namespace: remove this process's owner record, and the directory if empty.

        Call once on every rank after the job's last gather (it also runs at exit).
        """
        close_namespace(self._ns, self._timeout)

    def __enter__(self) -> WorkspaceTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
