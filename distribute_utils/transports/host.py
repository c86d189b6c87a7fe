"""Internal. Host route: a sender's payload to a rank of its own host, through the cheapest carrier it fits.

The router (:func:`.router.host_route`) gives the route its carriers, cheapest medium first
(:data:`.router.HOST_MEDIA`), with what the request and the destination allow. Today that is:

- **inline** (:class:`.inline.InlineCarrier`): a payload of at most :data:`.inline.INLINE_MAX_BYTES`
  travels inside the sender's claim in the store (a direct round's claim takes more:
  :class:`.inline.AttachedCarrier`, the round's own). No file: creating, sizing, mapping and removing a
  segment costs more than sending the bytes; the sizes were measured, see ``docs/performance.md``;
- **CUDA IPC** (:class:`.cuda_ipc.CudaIpcTransport`), when the first rank likely wants the tensors on a
  GPU, the payload is all on one GPU and the receiver runs in this pid namespace; when it refuses, the
  next carrier;
- **segment** (:class:`.shm.SharedMemoryTransport`): larger ones, pooled when the receiver can open the
  sender's descriptors;
- **local disk** (:class:`.local_disk.LocalDiskCarrier`): when ``/dev/shm`` has no room for a payload
  (a container's small one) and the route may leave shared memory, a file on this host's disk (logged
  as a warning);
- **workspace**: when neither has room and a workspace was given, a file there (logged as a warning).

Each payload's receipt is tagged by the carrier that took it (:mod:`.carriers`), so the receiving side
needs no route: it fetches from whichever carrier the receipt names.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import SpaceError, TransportUnavailableError
from ..owners import owned
from ..wire import EncodedPayload
from . import carriers
from .base import Carrier, Destination, Route
from .inline import INLINE_MAX_BYTES
from .segment_pool import SegmentPool

__all__ = ["HostRoute", "Step", "step"]

logger = logging.getLogger(__name__)


class Step(NamedTuple):
    """One carrier class of a route, with the declarations the route reads per payload (read once, by
    :func:`step`)."""

    cls: type[Carrier]
    max_bytes: int | None
    takes: Callable[[EncodedPayload], bool] | None


def step(cls: type[Carrier]) -> Step:
    """``cls`` as a route's :class:`Step`."""
    return Step(cls, cls.max_bytes, getattr(cls, "takes", None))


class HostRoute(Route):
    """A sender's route toward ``destination`` on its host, through ``chain`` in order (see module doc;
    made by :func:`.router.host_route`).

    Args:
        destination: the receiving rank's process, as the carriers need it (:meth:`.base.Carrier.sending`).
        chain: the carrier classes to try, cheapest first: a payload goes to the first that takes it
            (``max_bytes``, ``takes``) and can (no ``SpaceError``, ``TransportUnavailableError`` or
            other ``OSError`` from ``sending`` or ``publish``).
        what: names the gather in log messages.

    A payload may hold tensors on a GPU (encoded with ``keep_device``): a segment takes them straight from
    there; other carriers copy them to the CPU first. A carrier that ``checksums`` gets the payload
    with its checksum.
    """

    def __init__(self, destination: Destination, chain: Sequence[Step], *, what: str = "gather") -> None:
        self._destination = destination
        self._steps = chain
        self._made: dict[type[Carrier], Carrier] = {}  # (each carrier made once, when first used)
        self._what = what

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> carriers.Sent:
        nbytes = payload.nbytes
        # (the pool sizes itself by every payload, pooled or not)
        owned(SegmentPool).note_payload(nbytes, pooled=nbytes > INLINE_MAX_BYTES)
        refused: list[tuple[str, BaseException]] = []
        for cls, max_bytes, takes in self._steps:
            if (max_bytes is not None and nbytes > max_bytes) or (takes is not None and not takes(payload)):
                continue
            carrier = self._made.get(cls)
            try:
                if carrier is None:
                    carrier = self._made[cls] = cls.sending(self._destination)  # type: ignore[attr-defined]
                sent = carriers.publish(
                    carrier, token, rank, payload.to_cpu().with_checksum() if carrier.checksums else payload
                )
            except (OSError, TransportUnavailableError) as exc:  # (SpaceError is an OSError)
                label = _label(carrier if carrier is not None else cls)
                logger.debug("%s: rank %d's payload: %s refused it: %s", self._what, rank, label, exc)
                refused.append((label, exc))
                continue
            if refused:
                self._said(rank, nbytes, refused, carrier.label)
            return sent
        raise self._none_took(refused)

    def _said(self, rank: int, nbytes: int, refused: list[tuple[str, BaseException]], taker: str) -> None:
        """The warning that a payload left the carrier it would have taken (no room, or an error; a
        carrier that does not carry such payloads, as CUDA IPC a payload on the CPU, is only logged)."""
        failed = [(label, exc) for label, exc in refused if isinstance(exc, OSError)]
        if not failed:
            return
        label, exc = failed[0]
        for other, why in failed[1:]:
            logger.info(
                "%s: rank %d's payload: %s cannot take it either: %s", self._what, rank, other, _why(why)
            )
        said = "cannot hold" if isinstance(exc, SpaceError) else f"failed ({_why(exc)}) on"
        logger.warning(
            "%s: %s %s rank %d's payload of %d bytes; it goes through %s",
            self._what,
            label,
            said,
            rank,
            nbytes,
            taker,
        )

    @staticmethod
    def _none_took(refused: list[tuple[str, BaseException]]) -> BaseException:
        """What a route raises when no carrier took a payload: the first ``SpaceError`` with every later
        carrier's reason (no room anywhere), else the first refusal as it was."""
        spaces = [i for i, (_, exc) in enumerate(refused) if isinstance(exc, SpaceError)]
        if not spaces:
            return (
                refused[0][1]
                if refused
                else TransportUnavailableError("no carrier of this route takes the payload")
            )
        first = refused[spaces[0]][1]
        assert isinstance(first, SpaceError)
        others = "".join(
            f"; {exc}"
            if isinstance(exc, TransportUnavailableError)
            else f"; {label} cannot take it either: {_why(exc)}"
            for label, exc in refused[spaces[0] + 1 :]
        )
        return SpaceError(errno.ENOSPC, f"{first.strerror}{others}")


def _label(carrier: Carrier | type[Carrier]) -> str:
    """How messages name a carrier (a class whose instances' label says where: its kind)."""
    label = carrier.label
    return label if isinstance(label, str) else carrier.kind


def _why(exc: BaseException) -> Any:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
