"""Internal. A lone tensor's payload head, kept for the next payloads: what a repeated ``get_tensors_parallel``
sends.

A gather of one tensor, call after call, sends payloads that differ only in the tensor's bytes: the head
(prefix, header and padding up to the tensor, which ends the payload) is the same for every tensor of one
dtype and shape. A :class:`LoneHead` keeps those bytes:

- a sender makes one with :meth:`LoneHead.of_payload` from a payload :func:`.encode` made of one plain
  tensor; :meth:`LoneHead.bytes_of` then gives the bytes that follow the head in another such tensor's
  payload, without encoding it again: the head and these are the bytes :func:`.encode` would give (None
  for any other value: encode it); :meth:`LoneHead.payload` gives that payload as an object, for a
  carrier;
- a receiver makes one with :meth:`LoneHead.of_decoded` from a payload :func:`.decode` took (its head
  checked); :meth:`LoneHead.view` then decodes a payload of the same head bytes and length as
  :func:`.decode` would, into a view of its bytes (None for any other: decode it). Every check
  :func:`.decode` makes of a head is a function of its bytes; the length is checked every time.

Neither keeps a tensor or a buffer: a head is bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from .decoding import checked_lone_slot
from .format import FLAG_CHECKSUM, PREFIX_STRUCT, bytes_view
from .payload import EncodedPayload, tensor_bytes

__all__ = ["LoneHead"]


class LoneHead:
    """The head of the payload of one plain CPU tensor of a dtype and shape (see the module doc)."""

    __slots__ = ("count", "dtype", "head", "nbytes", "shape")

    def __init__(self, head: bytes, dtype: torch.dtype, shape: torch.Size) -> None:
        self.head, self.dtype, self.shape = head, dtype, shape
        self.count = shape.numel()
        self.nbytes = len(head) + self.count * dtype.itemsize  # (the tensor's bytes end the payload)

    @classmethod
    def of_payload(cls, value: Any, payload: EncodedPayload) -> LoneHead | None:
        """The head of ``payload``, which :func:`.encode` made of ``value``, when ``value`` is one plain
        contiguous CPU tensor with bytes and ``payload`` carries no checksum; else None."""
        if not _plain(value) or len(payload.chunks) != 1 or payload.chunks[0][1] is not value:
            return None
        if PREFIX_STRUCT.unpack_from(payload.head)[2] & FLAG_CHECKSUM:
            return None  # (a checksum differs payload to payload)
        head = cls(payload.head, value.dtype, value.shape)
        return head if head.nbytes == payload.nbytes else None

    @classmethod
    def of_decoded(cls, buffer: Any, value: Any) -> LoneHead | None:
        """The head of the payload in ``buffer``, when :func:`.decode` took it (its head checked) and its tree
        is one tensor with bytes, on the CPU, that ends it; ``value``, what ``decode`` gave for it, must be
        that tensor on the CPU (its dtype and shape are compared with the head's). Else None."""
        if type(value) is not torch.Tensor or not value.is_cpu:
            return None
        found = checked_lone_slot(buffer)
        if found is None:
            return None
        total, slot = found
        if slot.dtype is not value.dtype or list(value.shape) != list(slot.shape):
            return None
        head = cls(bytes(bytes_view(buffer)[: slot.offset]), value.dtype, value.shape)
        return head if head.nbytes == total else None

    def bytes_of(self, value: Any) -> memoryview | None:
        """The bytes that follow this head in ``value``'s payload, when ``value`` is a plain contiguous CPU tensor
        of this head's dtype and shape (its payload is then the head, then these bytes); else None. No
        payload object is made: what a repeated sender sends."""
        if not _plain(value) or value.dtype is not self.dtype or value.shape != self.shape:
            return None
        return tensor_bytes(value)

    def payload(self, value: torch.Tensor) -> EncodedPayload:
        """The payload :func:`.encode` makes of ``value``, a tensor for which :meth:`bytes_of` gave bytes:
        this head, then the tensor (what a carrier writes, past the sizes a claim message holds)."""
        return EncodedPayload(self.nbytes, self.head, ((len(self.head), value),))

    def view(self, buffer: Any) -> torch.Tensor | None:
        """The tensor of the payload in ``buffer`` (bytes-like) when it is writable, exactly the payload's
        length and its head is this one: a view of its bytes, as :func:`.decode` gives it; else None (a
        read-only buffer too: :func:`.decode` says what it does with those)."""
        mv = bytes_view(buffer)
        head = self.head
        if mv.nbytes != self.nbytes or mv.readonly or mv[: len(head)] != head:
            return None
        tensor = torch.frombuffer(mv, dtype=self.dtype, count=self.count, offset=len(head))
        return tensor if len(self.shape) == 1 else tensor.view(self.shape)


def _plain(value: Any) -> bool:
    """Whether ``value`` is a tensor :func:`.encode` puts in its payload as it is: a plain, strided,
    contiguous CPU tensor with bytes, outside autograd, neither conjugated nor negated lazily."""
    return (
        type(value) is torch.Tensor
        and value.is_cpu
        and value.layout is torch.strided
        and value.is_contiguous()
        and not value.is_conj()
        and not value.is_neg()
        and not value.requires_grad
        and value.nbytes > 0
    )
