"""Internal. The carrier protocol: how the payload of one sender travels to the first rank of a gather round.

A carrier only moves bytes. The round (:mod:`distribute_utils.roles`) owns the rest: it
checks agreement, plans the route, signals through the CPU companion of the group
(:mod:`distribute_utils.sync`) and decodes what arrives. As torch DCP's storage layer hands its
planner opaque ``storage_data``, a carrier hands the round an opaque *receipt*: a msgpack-able value
that travels to the receiver in the sender's claim and comes back, unread, to a carrier of the same
kind. The round never looks inside a receipt: :mod:`.carriers` tags each with its carrier's
:attr:`Carrier.kind` and finds the carrier that fetches it (:func:`.carriers.carrier_of`).

Call order of one round, for one sender ``rank`` and its ``token`` (fresh and unguessable, chosen
by the sender and carried in its claim). The round calls these through :mod:`.carriers`, never
directly (that is where receipts are tagged and the fault hook runs):

1. sender: ``data = publish(token, rank, payload)`` (:func:`.carriers.publish`, directly or through a
   :class:`Route` that picks the carrier); the round posts the tagged receipt (or the error) in its claim.
2. receiver, once the claim is there: ``carrier = type(...).receiving(context, rank, data)`` makes the
   receiving side's carrier from what the round knows (:class:`Context`; once per round where the
   class sets ``one_per_round``: see :class:`Carrier`), then
   ``buffer = fetch(token, rank, data)``, which the round decodes. If the round fails before it
   fetched: ``discard(token, rank, data)`` (a dead sender cannot clean up; idempotent).
3. the receiver posts its verdict; the sender waits for it.
4. sender: ``release(token, rank, data, taken=...)``, also when anything above failed
   (``taken=False``: no verdict came, or a failed one, and the receiver may still hold the buffer;
   a carrier with :attr:`Carrier.done_when_answered` gets ``taken=True`` for any verdict). It
   removes whatever ``publish`` left and must be idempotent.

``fetch`` returns a buffer that owns its memory (decoded tensors are views of it and keep it
alive); nothing the carrier made may stay visible to other processes once ``fetch`` has returned or
``release`` has run.

Before step 1, a sender on its first rank's host gets its carrier from its host route
(:func:`.router.host_route`): the router lists every carrier whose ``medium`` a host route takes, cheapest
medium first (:data:`.router.HOST_MEDIA`), drops those the request or the destination rules out
(``devices``, ``medium``), and for each payload the route tries them in that order: one whose
``max_bytes`` or ``takes`` refuses the payload is passed over; the first used is made by
``sending(destination)`` (once per route); a ``SpaceError``, ``TransportUnavailableError`` or other
``OSError`` from ``sending`` or ``publish`` passes the payload to the next.

Adding a carrier: write one class with the attributes and methods of :class:`Carrier` (``kind``, a
name no other carrier has; what it can do: ``scope``, ``medium``, ``max_bytes``, ``devices``,
``needs_go``, ``checksums``, ``settings``, ``label``, and how its leftovers are found; ``publish`` /
``fetch`` / ``discard`` / ``release``; the classmethods ``receiving`` and, for a host route's medium,
``sending``) and list it in :data:`.carriers.KINDS`: the router places it by its medium (the local-disk
carrier, :mod:`.local_disk`, was added so). Test it with one test that publishes through it and
fetches with :meth:`.carriers.Receiving.fetch`; :func:`.carriers.inject` lets that test kill a rank
or corrupt a buffer at the carriers' fault points (``"published"``, ``"fetching"``, ``"fetched"``)
without patching private code.

Carriers today: inline (in the store claim) and attached (in a direct round's claim datagram),
:mod:`.inline`; named and pooled shared-memory segments, registered with CUDA when copied to a GPU,
:mod:`.shm`; workspace files, :mod:`.workspace`; point-to-point collectives, :mod:`.collective`;
CUDA IPC, :mod:`.cuda_ipc`; files on this host's disk when ``/dev/shm`` has no room, :mod:`.local_disk`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .. import interrupts
from ..owners import process_owned
from ..processes import ProcessInfo
from ..wire import EncodedPayload

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["Carrier", "Context", "Destination", "Route", "Sent", "Transport", "removed_on_interrupt"]


@dataclass
class Context:
    """What the receiving side of one round knows, for the carriers it fetches through (made by the
    round on its first fetch; see :meth:`Carrier.receiving`)."""

    first: int  # the global rank that receives
    seconds: float  # the round's timeout
    group: dist.ProcessGroup | None = None  # the round's group (collective messages)
    workspace: Callable[[], Carrier] | None = None  # the job's workspace carrier (None: no workspace_path)
    pin: bool = False  # what it fetches is copied to a GPU (shared memory: register maps with CUDA)
    device: torch.device | None = None  # the GPU it decodes to (CUDA IPC copies there)
    arrived: dict[int, Any] = field(default_factory=dict)  # payloads that came inside claims, by sender


class Destination(NamedTuple):
    """What a sender knows of the rank its host route leads to, for the carriers it publishes through
    (made by the router; see :meth:`Carrier.sending`). (A tuple: one is made per gather past the
    attached sizes.)"""

    receiver: ProcessInfo | None  # the receiving process
    pool: bool = False  # it can open this process's descriptors (pooled segments, CUDA IPC, local disk)
    workspace: Callable[[], Carrier] | None = None  # the job's workspace carrier (None: no workspace_path)


class Carrier(Protocol):
    """Moves one payload per sender to the first rank of a round (see module doc)."""

    kind: str
    """The tag of its receipts: unique among :data:`.carriers.KINDS`."""
    done_when_answered: bool
    """True when a receiver that sent any verdict no longer reads what was published (``release``
    then gets ``taken=True``); False when only a successful one says so."""
    scope: str
    """Where its receiver may run: ``"host"`` (this host: a segment, a file on local disk, a datagram,
    CUDA IPC) or ``"any"`` (any host: the store's claim, the workspace, a collective)."""
    medium: str
    """Where the bytes lie on the way, which places it in a host route (:data:`.router.HOST_MEDIA`,
    cheapest first): ``"claim"`` (inside the sender's claim in the store), ``"gpu"`` (the sender's device
    memory, opened by the receiver), ``"memory"`` (a shared-memory segment), ``"disk"`` (a file on this
    host's disk), ``"shared_fs"`` (the workspace). Carriers of other media are never in a host route:
    ``"datagram"`` (a direct round's claim message), ``"network"`` (the collective)."""
    max_bytes: int | None
    """The largest payload it takes in a host route (None: no bound of its own)."""
    devices: str
    """What it does with a payload's GPU tensors: ``"keeps_gpu"`` (they arrive in device memory: CUDA
    IPC, NCCL) or ``"to_cpu"`` (they travel through host memory and are copied to a GPU after)."""
    needs_go: bool
    """Whether the sender may send only once its first rank said "go" (what is sent cannot be taken
    back: the collective)."""
    checksums: bool
    """Whether its payloads carry a checksum, checked on fetch (where bytes may be stale or torn)."""
    settings: tuple[str, ...]
    """The options and environment variables it reads (``workspace_path``, ``$DISTRIBUTE_UTILS_...``)."""
    # Leftovers: a carrier whose publication can outlive a process killed outright (a file with a name)
    # says how to find and remove it, as static methods and a label read with getattr (absent: nothing
    # to leave): ``remove_left_by(rank, pid)`` removes what sender ``rank`` (any: None) of dead process
    # ``pid`` left, returning the paths (the first rank that sees a sender die, a launcher after killing
    # a rank, an interrupted process its own: :func:`.carriers.remove_left_by`); ``files_on_host(shm_dir)``
    # lists every file it names on this host as :class:`.named_files.HostFile` (path, size, owner pid,
    # alive), and ``files_label`` says what they are: ``distribute-utils doctor`` lists them, ``clean``
    # removes those whose owner is gone (``shm_dir``: the host's shared-memory directory, for a carrier
    # that keeps its files there). The workspace's leftovers are whole namespaces, found by their owner
    # records (:mod:`.namespace`), in the workspace ``doctor`` and ``clean`` are given.
    # Optional (read with getattr, False when absent): ``one_per_round = True`` says that what
    # ``receiving`` returns depends on the round's context only, not on the sender or its receipt, so
    # that :class:`.carriers.Receiving` makes it once per round and fetches every receipt of its kind
    # through it (no object made per fetch: a small gather's payloads are inline or attached).
    # Optional too (read with getattr; absent: every publication does): ``names_token(data) -> bool``, static,
    # says whether what ``publish`` made for the receipt ``data`` has a name made from the token, which
    # other users may see (a named segment in /dev/shm). A sender may publish again under a token of
    # which no name was made (:func:`.carriers.names_token`); one that named something is never used again.

    @property
    def label(self) -> str:
        """How messages name it ("/dev/shm", "the local disk (DIR)"): a class attribute, or a property
        of an instance that says where."""
        ...

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> Any:
        """Make ``payload`` of ``rank`` available to the first rank; returns the receipt. Senders only.
        Raises :class:`~distribute_utils.errors.SpaceError` or
        :class:`~distribute_utils.errors.TransportUnavailableError` when a route may try another carrier."""
        ...

    def fetch(self, token: str, rank: int, receipt: Any) -> Any:
        """The payload ``rank`` published, as a buffer. First rank only, once it has the receipt."""
        ...

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """Remove what ``rank`` published and the first rank will not fetch. First rank only; idempotent."""
        ...

    def release(self, token: str, rank: int, receipt: Any, *, taken: bool = True) -> None:
        """Remove what ``publish`` made, if anything is left. Senders only; idempotent."""
        ...

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> Carrier:
        """The carrier that fetches ``receipt`` (of sender ``rank``) on the receiving side of a round described by ``context``."""
        ...

    # A carrier of a host route's medium also has the classmethod ``sending(destination)``: the carrier
    # a sender publishes through toward :class:`Destination` (once per route, when first needed), raising
    # :class:`~distribute_utils.errors.TransportUnavailableError` when it cannot reach it (why); and it
    # may have the static method ``takes(payload) -> bool`` (read with getattr): False passes the payload
    # to the next carrier unasked (CUDA IPC: only payloads all on one GPU).


Transport = Carrier
"""The former name of :class:`Carrier`."""


class Sent:
    """A sender's publication, until it releases it: ``data`` is what ``carrier``'s publish returned;
    :attr:`receipt`, what travels in the claim (the data tagged with its carrier's kind)."""

    __slots__ = ("carrier", "data", "rank", "receipt", "token")

    def __init__(self, carrier: Carrier, token: str, data: Any, rank: int) -> None:
        self.carrier, self.token, self.data, self.rank = carrier, token, data, rank
        self.receipt: list[Any] = [carrier.kind, data]

    def release(self, taken: bool, answered: bool = False) -> None:
        """Remove what was published, once the receiver is done (``taken``) or gave up; ``answered``: a
        verdict came, failed or not (enough for a carrier :attr:`Carrier.done_when_answered`)."""
        done = taken or (answered and self.carrier.done_when_answered)
        self.carrier.release(self.token, self.rank, self.data, taken=done)


class Route(ABC):
    """A sender's choice among carriers for each payload (e.g. inline when small, else a segment, else
    the workspace). Subclasses implement :meth:`publish`; the round calls it for a sender that publishes
    through a route (a carrier it publishes through by :func:`.carriers.publish`)."""

    @abstractmethod
    def publish(self, token: str, rank: int, payload: EncodedPayload) -> Sent:
        """Publish ``payload`` through the carrier this route picks for it (each through
        :func:`.carriers.publish`)."""


class _RemovedOnInterrupt:
    """The carrier classes whose leftovers an interrupt of this process removes (process-wide; the undo
    runs with the pid of the process interrupted, a forked child's included)."""

    def __init__(self) -> None:
        self.classes: set[type] = set()


def removed_on_interrupt(carrier: type[Carrier]) -> None:
    """A carrier calls it before it first makes something a process interrupted mid-publish would leave
    (a named file): from then on an interrupt of this process removes what it published that nobody
    took, through the carrier's ``remove_left_by(None, pid)`` (see :class:`Carrier`). Once per class."""
    registered = process_owned(_RemovedOnInterrupt).classes
    if carrier not in registered:
        registered.add(carrier)
        remove = carrier.remove_left_by  # type: ignore[attr-defined]  # (a carrier that leaves files has it)
        interrupts.on_interrupt(lambda: remove(None, os.getpid()))
