"""Host transport: payloads between ranks of one host, each the cheapest way it fits.

- **inline**: a payload of at most :data:`INLINE_MAX_BYTES` travels inside the sender's claim
  in the store, of at most :data:`DIRECT_INLINE_MAX_BYTES` inside the claim of a direct round (a
  datagram, :mod:`distribute_utils.mailbox`). No file: creating, sizing, mapping and removing a
  segment costs more than sending the bytes; the sizes were measured, see ``docs/performance.md``;
- **shm**: larger ones go through a shared-memory segment (:class:`.shm.SharedMemoryTransport`),
  pooled when the receiver can open the sender's descriptors;
- **workspace**: when ``/dev/shm`` has no room and a workspace was given, a file there (logged as
  a warning).

Receipts are ``["inline", bytes]``, ``["shm", <shm receipt>]`` or ``["workspace", <receipt>]``;
only this module reads them. The pool of warm segments needs one report back from the receiver
(which segments it no longer maps): :meth:`HostTransport.notes` makes it, the gather carries it
in its verdict, :meth:`HostTransport.heed` acts on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._host import ProcessInfo
from ..errors import PayloadError, SpaceError
from ..wire import EncodedPayload
from .base import Transport
from .shm import (
    SharedMemoryTransport,
    freed_pending,
    keep_freed,
    note_payload,
    remove_segments_of,
    segments_freed,
    take_freed,
)

__all__ = ["DIRECT_INLINE_MAX_BYTES", "INLINE_MAX_BYTES", "HostTransport"]

logger = logging.getLogger(__name__)

INLINE_MAX_BYTES = 64 * 2**10
"""Payloads up to this size travel inside the sender's claim in the store, not through a file."""
DIRECT_INLINE_MAX_BYTES = 128 * 2**10
"""Payloads up to this size travel inside the sender's claim of a direct round, not through a file."""


class HostTransport:
    """Moves payloads between ranks of one host (see module doc); implements :class:`.base.Transport`.

    Args:
        receiver: the receiving process (senders only): pooled segments are used when it shares
            this process's pid namespace, and given back if it dies holding one.
        workspace: makes the workspace transport when ``/dev/shm`` cannot hold a payload (None:
            raise :class:`SpaceError` instead).
        workspace_path: the workspace's directory, named in the warning when a payload goes there.
        what: names the gather in log messages.
        pin: the receiving side copies what it fetches to a GPU (see :class:`.shm.SharedMemoryTransport`).

    A payload may hold tensors on a GPU (encoded with ``keep_device``): a segment takes them straight from
    there; inline and workspace payloads are copied to the CPU first.
    """

    name = "host"

    def __init__(
        self,
        receiver: ProcessInfo | None = None,
        *,
        pool: bool = False,
        workspace: Callable[[], Transport] | None = None,
        workspace_path: str = "",
        what: str = "gather",
        inline_max: int = INLINE_MAX_BYTES,
        pin: bool = False,
    ) -> None:
        self._shm = SharedMemoryTransport(pool=pool, receiver=receiver, pin=pin)
        self._inline_max = inline_max
        self._workspace = workspace
        self._workspace_path = workspace_path
        self._what = what

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> list[Any]:
        note_payload(payload.nbytes)
        if payload.nbytes <= self._inline_max:
            return ["inline", payload.to_cpu().to_bytes()]
        try:
            return ["shm", self._shm.publish(token, rank, payload)]
        except SpaceError:
            if self._workspace is None:
                raise
        logger.warning(
            "%s: /dev/shm cannot hold rank %d's payload of %d bytes; it goes through the workspace %s",
            self._what,
            rank,
            payload.nbytes,
            self._workspace_path,
        )
        return ["workspace", self._workspace().publish(token, rank, payload.to_cpu().with_checksum())]

    def fetch(self, token: str, rank: int, receipt: list[Any]) -> Any:
        where = _where(receipt, rank)
        if where == "inline":
            return bytearray(receipt[1])  # writable, so that tensors decode writable
        if where == "shm":
            return self._shm.fetch(token, rank, receipt[1])
        return self._ws().fetch(token, rank, receipt[1])

    def discard(self, token: str, rank: int, receipt: list[Any]) -> None:
        where = _where(receipt, rank)
        if where == "shm":
            self._shm.discard(token, rank, receipt[1])
        elif where == "workspace":
            self._ws().discard(token, rank, receipt[1])

    def release(self, token: str, rank: int, receipt: list[Any], *, taken: bool = True) -> None:
        where = _where(receipt, rank)
        if where == "shm":
            self._shm.release(token, rank, receipt[1], taken=taken)
        elif where == "workspace":
            self._ws().release(token, rank, receipt[1], taken=taken)

    def _ws(self) -> Transport:
        if self._workspace is None:
            raise PayloadError(
                "a payload was published in the workspace, but this gather has no workspace_path"
            )
        return self._workspace()

    # -- what the receiver tells its senders -----------------------------------------------------
    @staticmethod
    def has_notes() -> bool:
        """Whether :meth:`notes` may find anything (cheap; ask before looking up the senders)."""
        return freed_pending()

    @staticmethod
    def notes(senders: Mapping[int, int]) -> list[list[Any]]:
        """The receiver, when done: the pooled segments of ``senders`` (their pid -> their rank now, for
        processes of this pid namespace) it no longer maps, as ``[rank, segment, pid]``. Each report is
        handed out once: deliver it, or give it back with :meth:`keep`."""
        return [[senders[pid], ident, pid] for pid, ident in take_freed(senders)]

    @staticmethod
    def keep(notes: list[list[Any]]) -> None:
        """Take back :meth:`notes` that were not delivered (for a later gather)."""
        keep_freed([(pid, ident) for _, ident, pid in notes])

    @staticmethod
    def heed(rank: int, notes: Sequence[Any]) -> None:
        """A sender, given its receiver's :meth:`notes`: its segments named there may be written again."""
        if notes:
            segments_freed({n[1] for n in notes if type(n) is list and len(n) == 3 and n[0] == rank})

    @staticmethod
    def remove_left_by(rank: int, pid: int) -> list[str]:
        """Remove what sender ``rank`` (process ``pid``, dead) left half-published; the paths removed."""
        return remove_segments_of(rank, pid)


def _where(receipt: Any, rank: int) -> str:
    if (
        type(receipt) is list
        and len(receipt) == 2
        and receipt[0] in ("inline", "shm", "workspace")
        and (receipt[0] != "inline" or type(receipt[1]) is bytes)
    ):
        return receipt[0]
    raise PayloadError(f"rank {rank} published its payload with an unknown receipt {receipt!r:.80}")
