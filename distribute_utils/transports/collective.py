"""Internal. Collective transport: point-to-point sends over a ``torch.distributed`` group.

The fallback when ranks share neither a host nor a workspace. Each sender sends its payload
to the first rank as a few messages, sizes first (so ragged payloads need no padding):

1. ``int64[3]``: total length, head length, number of chunks;
2. ``int64[2 * n]``: offset and length of every chunk;
3. the head bytes (prefix + header);
4. every chunk's bytes, straight from the tensor's memory (no staging copy).

The first rank receives into one buffer of the exact total length, so the payload decodes
zero-copy like any other. Sends are asynchronous (``isend``), so ``publish`` returns at once
and the gather module can post "published"; ``release`` waits for them to complete.

On a gloo group this moves CPU bytes. On an NCCL group the same messages travel as CUDA
tensors, straight from and into GPU memory (the GPU fallback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PayloadError
from ..wire import EncodedPayload, as_uint8
from .base import Context

__all__ = ["CollectiveTransport", "message_device"]

logger = logging.getLogger(__name__)


class CollectiveTransport:
    """The collective carrier: moves payloads to ``first`` with point-to-point messages over ``group``;
    implements :class:`.base.Carrier` (kind ``"collective"``; the receipt names the device).

    Args:
        group: a process group holding every participant (None: the world).
        first: global rank of the receiver.
        timeout: bound on waiting for sends to complete in ``release``.
        device: where messages travel from and to: the CPU (gloo) or a GPU (NCCL).
    """

    kind = "collective"
    done_when_answered = False
    scope = "any"
    medium = "network"  # (never in a host route: it needs the go)
    max_bytes: int | None = None
    label = "the collective"
    devices = "keeps_gpu"  # (NCCL from GPU memory)
    needs_go = True  # (a send cannot be taken back: it goes once the first rank says so)
    checksums = False
    settings: tuple[str, ...] = ()

    def __init__(
        self, group: dist.ProcessGroup | None, first: int, timeout: float, device: torch.device
    ) -> None:
        self._group = group
        self._first = first
        self._timeout = timeout
        self._device = device
        self._pending: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> CollectiveTransport:
        """Receives on the device the sender's receipt names (the CPU or a GPU)."""
        if type(receipt) is not str or not (receipt == "cpu" or receipt.startswith("cuda")):
            raise PayloadError(f"rank {rank} sent its payload on an unknown device {receipt!r:.40}")
        return cls(context.group, context.first, context.seconds, torch.device(receipt))

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> str:
        """Start sending ``payload`` (asynchronously); the receipt names the device it travels on."""
        del token  # messages are matched by sender and order within the group
        chunks = [(off, t) for off, t in payload.chunks if t.numel()]
        sizes = torch.tensor([payload.nbytes, len(payload.head), len(chunks)], dtype=torch.int64)
        layout = torch.tensor(
            [v for off, t in chunks for v in (off, t.numel() * t.element_size())], dtype=torch.int64
        )
        head = torch.frombuffer(bytearray(payload.head), dtype=torch.uint8)
        messages = [sizes, layout, head, *(as_uint8(t) for _, t in chunks)]
        messages = [m.to(self._device) for m in messages if m.numel()]
        works = [dist.isend(m, dst=self._first, group=self._group) for m in messages]
        self._pending[rank] = (works, messages)
        return str(self._device)

    def fetch(self, token: str, rank: int, receipt: str | None = None) -> Any:
        """Receive ``rank``'s payload into one buffer on this transport's device."""
        del token, receipt
        sizes = self._recv(torch.empty(3, dtype=torch.int64), rank)
        total, head_len, count = (int(v) for v in sizes)
        layout = self._recv(torch.empty(2 * count, dtype=torch.int64), rank) if count else sizes[:0]
        buffer = torch.empty(total, dtype=torch.uint8, device=self._device)
        self._recv(buffer[:head_len], rank)
        pairs = layout.view(-1, 2).tolist()
        for offset, length in pairs:
            self._recv(buffer[offset : offset + length], rank)
        return buffer  # wire.decode reads it in place, on the CPU or the GPU

    def _recv(self, into: torch.Tensor, rank: int) -> torch.Tensor:
        target = into if into.device == self._device else into.to(self._device)
        if target.numel():
            dist.recv(target, src=rank, group=self._group)
        return target.cpu() if target.dtype == torch.int64 else target

    def discard(self, token: str, rank: int, receipt: str | None = None) -> None:
        """Nothing to remove: a message that was sent cannot be taken back (senders wait for "go")."""

    def release(self, token: str, rank: int, receipt: str | None = None, *, taken: bool = True) -> None:
        """Wait for this sender's messages to complete (bounded by the timeout)."""
        del token, receipt, taken
        works, _messages = self._pending.pop(rank, ([], []))
        for work in works:
            try:
                work.wait(timedelta(seconds=self._timeout))
            except RuntimeError:
                logger.warning(
                    "a send of rank %d to rank %d did not complete", rank, self._first, exc_info=True
                )


def message_device(group: dist.ProcessGroup | Sequence[int] | None, on_device: bool) -> str:
    """Where a sender's collective messages travel (the receipt it publishes); no group is ever created.

    Point-to-point messages need no other rank's help, so they travel over ``group`` itself
    (the world for a mesh's rank list). A backend with gloo carries CPU bytes; with NCCL
    only, or when the payload's tensors already live on the GPU, messages go through GPU
    memory (the GPU fallback). Each sender's claim names its device, so the first rank
    receives each payload where it was sent from.
    """
    pg = group if group is None or isinstance(group, dist.ProcessGroup) else None
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and (on_device or "gloo" not in backend):
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
