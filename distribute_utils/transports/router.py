"""Internal. The router: which carriers a gather may use, decided in one place from the caller's
``transport=`` (parsed once, at the API's edge, into a :class:`Request`) and what each carrier declares
(:class:`.base.Carrier`: ``scope``, ``devices``, ``needs_go``, ``checksums``).

The roles (:mod:`distribute_utils.roles`) ask the request and the carrier between hosts, never a
transport's name:

- :attr:`Request.direct`: ranks of one host may take the direct round (claims and verdicts through the
  mailboxes), and payloads go through this host's carriers;
- :attr:`Request.flat`: every sender sends straight to the first rank through :attr:`Request.forced`
  (no shared-memory hop, no plan to wait for);
- :attr:`Request.spill` / :attr:`Request.free`: a host's route may leave shared memory (the local disk,
  the workspace) / may choose any carrier it likes (CUDA IPC);
- :func:`host_route`: a sender's route to a rank of its host (:class:`.host.HostRoute`): every carrier
  whose medium a host route takes, cheapest medium first (:data:`HOST_MEDIA`: inline, CUDA IPC, a
  segment, the local disk, the workspace), less what the request or the destination rule out by what
  the carriers declare;
- :func:`across`: the carrier between hosts for a plan (the forced one, else the workspace when given,
  else the collective), and :func:`cross_carrier` the class a plan names; its ``needs_go``,
  ``checksums`` and ``devices`` say what the roles do around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ArgumentError
from ..processes import ProcessInfo
from .base import Carrier, Destination
from .carriers import KINDS
from .collective import CollectiveTransport
from .host import HostRoute, Step, step
from .workspace import WorkspaceTransport

__all__ = [
    "HOST_CARRIERS",
    "HOST_MEDIA",
    "REQUESTS",
    "Request",
    "across",
    "cross_carrier",
    "host_route",
    "request",
]


@dataclass(frozen=True)
class Request:
    """A gather's ``transport=``, as every rank of it must ask (its :attr:`name` travels in claims).
    What the roles read of it are plain fields, derived once (a gather reads several per call)."""

    name: str
    forced: type[Carrier] | None = None
    """The one carrier every sender uses (``"workspace"``, ``"collective"``), or None: the router chooses."""
    host_only: bool = False
    """Shared memory only (``"shm"``): across hosts it is an error; within a host, no other carrier."""
    flat: bool = field(init=False)
    """Every sender its own leader: straight to the first rank through :attr:`forced`."""
    direct: bool = field(init=False)
    """Ranks of one host may take the direct round and this host's carriers."""
    spill: bool = field(init=False)
    """A host's route may leave shared memory when it is full (the local disk, the workspace)."""
    free: bool = field(init=False)
    """The router chooses among every carrier (CUDA IPC first for a GPU payload bound for a GPU)."""
    needs_go: bool = field(init=False)
    """Its senders wait for the first rank's "go" whatever the plan (a forced collective)."""

    def __post_init__(self) -> None:
        forced = self.forced
        for name, value in (
            ("flat", forced is not None),
            ("direct", forced is None),
            ("spill", not self.host_only),
            ("free", forced is None and not self.host_only),
            ("needs_go", forced is not None and forced.needs_go),
        ):
            object.__setattr__(self, name, value)


REQUESTS = {
    "auto": Request("auto"),
    "shm": Request("shm", host_only=True),
    "workspace": Request("workspace", forced=WorkspaceTransport),
    "collective": Request("collective", forced=CollectiveTransport),
}
"""Every ``transport=`` a caller may pass."""


def request(transport: str) -> Request:
    """The request ``transport`` names.

    Raises:
        ArgumentError: an unknown name (the valid ones listed).
    """
    found = REQUESTS.get(transport) if isinstance(transport, str) else None
    if found is None:
        raise ArgumentError(f"unknown transport {transport!r}; valid: {list(REQUESTS)}")
    return found


def across(asked: Request, has_workspace: bool) -> type[Carrier]:
    """The carrier between hosts: the forced one, else the workspace when one is given, else the
    collective.

    Raises:
        ArgumentError: the workspace forced without a workspace_path.
    """
    if asked.forced is WorkspaceTransport and not has_workspace:
        raise ArgumentError("transport='workspace' needs a workspace_path (a directory every rank can reach)")
    if asked.forced is not None:
        return asked.forced
    return WorkspaceTransport if has_workspace else CollectiveTransport


_CROSS: dict[str | None, type[Carrier] | None] = {
    None: None,
    WorkspaceTransport.kind: WorkspaceTransport,
    CollectiveTransport.kind: CollectiveTransport,
}


def cross_carrier(kind: str | None) -> type[Carrier] | None:
    """The carrier class a plan names between hosts (None: everyone on one host)."""
    return _CROSS[kind]


HOST_MEDIA = ("claim", "gpu", "memory", "disk", "shared_fs")
"""The media a host route takes, cheapest first (:attr:`.base.Carrier.medium`): a payload goes through
the first carrier that takes it and has room."""

_LEAVES_SHARED_MEMORY = ("disk", "shared_fs")

HOST_CARRIERS: tuple[type[Carrier], ...] = tuple(
    sorted((c for c in KINDS.values() if c.medium in HOST_MEDIA), key=lambda c: HOST_MEDIA.index(c.medium))
)
"""Every carrier a host route may use, in the order it tries them."""

_CHAINS: dict[tuple[str, bool], tuple[Step, ...]] = {}  # (a route's carriers by request and GPU guess)


def host_route(
    asked: Request,
    receiver: ProcessInfo,
    *,
    pool: bool,
    cuda: bool,
    workspace: Callable[[], Carrier] | None,
    what: str,
) -> HostRoute:
    """A sender's route to ``receiver``, a rank of its host: :data:`HOST_CARRIERS` in order, less those the
    request or the destination rule out by what they declare: a carrier that keeps tensors on the GPU
    only when ``cuda`` (its first rank likely wants a GPU) and the router may choose freely; one that
    leaves shared memory (the local disk, the workspace) only when the request allows it. ``pool``: the
    receiver can open this process's descriptors; ``workspace``: the job's workspace carrier (a factory;
    None: no workspace_path)."""
    key = (asked.name, cuda)
    chain = _CHAINS.get(key)
    if chain is None:
        chain = _CHAINS[key] = tuple(
            step(c)
            for c in HOST_CARRIERS
            if (c.devices != "keeps_gpu" or (cuda and asked.free))
            and (c.medium not in _LEAVES_SHARED_MEMORY or asked.spill)
        )
    return HostRoute(Destination(receiver, pool, workspace), chain, what=what)
