"""Internal. Host route: a sender's payload to a rank of its own host, through the cheapest carrier it fits.

- **CUDA IPC** (:class:`.cuda_ipc.CudaIpcTransport`), past the inline size, when asked (``cuda``: the
  first rank likely wants the tensors on a GPU), the payload is all on one GPU and the receiver runs in
  this pid namespace; when it refuses, the next carrier;
- **inline** (:class:`.inline.InlineCarrier`): a payload of at most :data:`INLINE_MAX_BYTES` travels
  inside the sender's claim in the store (a direct round's claim takes more:
  :class:`.inline.AttachedCarrier`). No file: creating, sizing, mapping and removing a segment costs
  more than sending the bytes; the sizes were measured, see ``docs/performance.md``;
- **segment** (:class:`.shm.SharedMemoryTransport`): larger ones, pooled when the receiver can open the
  sender's descriptors;
- **local disk** (:class:`.local_disk.LocalDiskCarrier`): when ``/dev/shm`` has no room for a payload
  (a container's small one) and the route may leave shared memory (``spill``), a file on this host's
  disk (logged as a warning);
- **workspace**: when neither has room and a workspace was given, a file there (logged as a warning).

Each payload's receipt is tagged by the carrier that took it (:mod:`.carriers`), so the receiving side
needs no route: it fetches from whichever carrier the receipt names.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from ..errors import SpaceError, TransportUnavailableError
from ..owners import owned
from ..processes import ProcessInfo
from ..wire import EncodedPayload
from . import carriers
from .base import Carrier, Route
from .cuda_ipc import CudaIpcTransport
from .inline import INLINE
from .local_disk import LocalDiskCarrier
from .segment_pool import SegmentPool
from .shm import SharedMemoryTransport

__all__ = ["DIRECT_INLINE_MAX_BYTES", "INLINE_MAX_BYTES", "HostRoute"]

logger = logging.getLogger(__name__)

LOCAL_DISK = LocalDiskCarrier()

INLINE_MAX_BYTES = 64 * 2**10
"""Payloads up to this size travel inside the sender's claim in the store, not through a file."""
DIRECT_INLINE_MAX_BYTES = 128 * 2**10
"""Payloads up to this size travel inside the sender's claim of a direct round, not through a file."""


class HostRoute(Route):
    """A sender's route to ``receiver`` on its host (see module doc).

    Args:
        receiver: the receiving process: pooled segments (and CUDA IPC) are used when it shares this
            process's pid namespace (``pool``), and given back if it dies holding one.
        pool: the receiver can open this process's descriptors (``ProcessInfo.can_watch``).
        cuda: try CUDA IPC first for a payload all on one GPU (only with ``pool``).
        spill: a payload ``/dev/shm`` cannot hold may go through the local disk (False: shared memory
            only, as ``transport="shm"`` asks).
        workspace: makes the workspace carrier when neither ``/dev/shm`` nor the local disk can hold a
            payload (None: raise :class:`SpaceError` instead).
        workspace_path: the workspace's directory, named in the warning when a payload goes there.
        what: names the gather in log messages.

    A payload may hold tensors on a GPU (encoded with ``keep_device``): a segment takes them straight from
    there; inline and workspace payloads are copied to the CPU first.
    """

    def __init__(
        self,
        receiver: ProcessInfo | None = None,
        *,
        pool: bool = False,
        cuda: bool = False,
        spill: bool = False,
        workspace: Callable[[], Carrier] | None = None,
        workspace_path: str = "",
        what: str = "gather",
        inline_max: int = INLINE_MAX_BYTES,
    ) -> None:
        self._receiver = receiver
        self._segments = SharedMemoryTransport(pool=pool, receiver=receiver)
        self._cuda = cuda and pool
        self._spill = (
            spill and pool
        )  # (the local disk: only to a receiver in this pid namespace, see reaches)
        self._inline_max = inline_max
        self._workspace = workspace
        self._workspace_path = workspace_path
        self._what = what

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> carriers.Sent:
        if self._cuda and payload.nbytes > self._inline_max and CudaIpcTransport.can_carry(payload):
            try:
                return carriers.publish(CudaIpcTransport(self._receiver), token, rank, payload)
            except TransportUnavailableError as exc:
                logger.debug("%s: %s; through shared memory instead", self._what, exc)
        inline = payload.nbytes <= self._inline_max
        # (the pool sizes itself by every payload)
        owned(SegmentPool).note_payload(payload.nbytes, pooled=not inline)
        if inline:
            return carriers.publish(INLINE, token, rank, payload)
        try:
            return carriers.publish(self._segments, token, rank, payload)
        except SpaceError as full:
            disk = ""  # why the local disk did not take it either
            if self._spill and LocalDiskCarrier.reaches(self._receiver):
                try:
                    return self._spilled(token, rank, payload)
                except OSError as exc:  # (full, read-only, missing, another user's: the next carrier)
                    disk = f"; the local disk cannot take it either: {exc}"
            elif self._spill:
                disk = "; the local disk is not used: the receiving process does not see this one's directory"
            if self._workspace is None:
                raise SpaceError(errno.ENOSPC, f"{full.strerror}{disk}") from None
            if disk:
                logger.info("%s: rank %d's payload%s", self._what, rank, disk)
            workspace = self._workspace
        logger.warning(
            "%s: /dev/shm cannot hold rank %d's payload of %d bytes; it goes through the workspace %s",
            self._what,
            rank,
            payload.nbytes,
            self._workspace_path,
        )
        return carriers.publish(workspace(), token, rank, payload.to_cpu().with_checksum())

    def _spilled(self, token: str, rank: int, payload: EncodedPayload) -> carriers.Sent:
        """``payload`` through the local disk (``/dev/shm`` had no room), said in a warning."""
        sent = carriers.publish(LOCAL_DISK, token, rank, payload)
        logger.warning(
            "%s: /dev/shm cannot hold rank %d's payload of %d bytes; it goes through the local disk (%s)",
            self._what,
            rank,
            payload.nbytes,
            sent.data[0],
        )
        return sent
