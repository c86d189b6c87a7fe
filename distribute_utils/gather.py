"""Gather configs and tensors to the first rank of a group: the toolkit's public heart.

``get_tensors_parallel`` / ``get_configs_parallel`` keep the names and call shapes of
NVIDIA ModelOpt's helpers (``modelopt.torch.export.distribute``), so switching is a change of
import; ``gather_tensors`` / ``gather_configs`` take a :class:`ProcessGroupMesh` and an axis.

One round, on every rank of ``group`` (see :mod:`distribute_utils.transports.base` for what
the transport does at each step):

1. agree: every rank posts its ``ranks`` digest, whether its value encoded, and a nonce;
   any disagreement or local error raises on *every* rank, before anything is written;
2. senders publish their payload and post "published";
3. the first rank waits for the senders, fetches and decodes (zero-copy), posts "done";
4. senders and non-participants wait for "done" when they leave the ``with`` block, and
   senders release what they published.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from os import PathLike
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from . import sync, wire
from .errors import GatherError, PayloadError, SpaceError, TransportUnavailableError
from .mesh import ProcessGroupMesh
from .transports import CollectiveTransport, SharedMemoryTransport, Transport
from .transports.shm import segments_freed, take_freed

__all__ = [
    "TRANSPORTS",
    "gather_configs",
    "gather_tensors",
    "get_configs_parallel",
    "get_tensors_parallel",
]

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "workspace", "collective")
_OK = "ok"
_OK_WORKSPACE = "ok:workspace"  # published to the workspace instead: /dev/shm had no room
_OK_SEGMENT = "ok:segment:"  # published in a pooled segment; its id follows


@dataclass(frozen=True)
class _Intent:
    """What one rank brings to the agreement of a round."""

    ranks: list[int] | None
    digest: str
    error: tuple[str, str] | None  # (exception type name, message)
    nonce: int
    transport: str
    on_device: bool  # its payload's tensors all live on an accelerator (NCCL can send them)
    freed: list[list[Any]]  # [sender rank, segment id]: pooled segments this rank no longer maps

    def pack(self) -> bytes:
        shown = self.ranks if self.ranks is not None and len(self.ranks) <= 64 else None
        error = list(self.error) if self.error else None
        return msgpack.packb(
            [shown, self.digest, error, self.nonce, self.transport, self.on_device, self.freed]
        )

    @classmethod
    def unpack(cls, data: bytes) -> _Intent:
        shown, digest, error, nonce, transport, on_device, freed = msgpack.unpackb(data)
        return cls(shown, digest, tuple(error) if error else None, nonce, transport, on_device, freed)


_RAISABLE: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (TypeError, ValueError, TransportUnavailableError)
}


def _check_ranks(ranks: Sequence[int], members: tuple[int, ...]) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ValueError(f"ranks must be a list of global ranks; got {type(ranks).__name__}")
    ranks = list(ranks)
    if not ranks:
        raise ValueError("ranks is empty; list the participating global ranks, the receiver first")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise ValueError(f"ranks must be ints; got {bad!r} in {ranks}")
    duplicates = sorted({r for r in ranks if ranks.count(r) > 1})
    if duplicates:
        raise ValueError(f"ranks {ranks} lists {duplicates} more than once; each rank may appear once")
    world = dist.get_world_size()
    outside_world = [r for r in ranks if not 0 <= r < world]
    if outside_world:
        raise ValueError(f"ranks {outside_world} are outside the world (valid: 0..{world - 1})")
    outside_group = [r for r in ranks if r not in members]
    if outside_group:
        raise ValueError(f"ranks {outside_group} are not in the group {_short(members)}; list members only")
    return ranks


def _short(ranks: Sequence[int]) -> str:
    return sync._short(ranks)


def _digest(ranks: list[int] | None) -> str:
    return hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()


def _agree(intents: list[_Intent], members: tuple[int, ...], me: int) -> _Intent:
    """Raise the same kind of error on every rank when the intents disagree; else the first's."""
    for rank, intent in zip(members, intents):
        if intent.error is not None:
            kind, message = intent.error
            exc_type = _RAISABLE.get(kind, GatherError)
            if rank == me:
                raise exc_type(message)
            raise exc_type(f"rank {rank} cannot take part in the gather: {message}")
    first = intents[0]
    differing = [r for r, i in zip(members, intents) if i.digest != first.digest]
    if differing:
        shown = {r: i.ranks for r, i in zip(members, intents) if r in differing[:3]}
        raise ValueError(
            f"ranks passed different `ranks` lists: rank {members[0]} passed {first.ranks}, "
            f"rank(s) {differing} differ ({shown}); every rank of the group must pass the same list"
        )
    transports = {i.transport for i in intents}
    if len(transports) > 1:
        raise ValueError(
            f"ranks asked for different transports {sorted(transports)}; pass the same everywhere"
        )
    return first


@dataclass(frozen=True)
class _Plan:
    """Who sends to whom in one round; the same on every rank (derived from agreed inputs).

    Participants on the first rank's host send to it through shared memory. On every other
    host, the first participant leads: its host's other participants send to it through
    shared memory, and it forwards one bundle for the whole host over the cross-host
    transport. Forced ``workspace`` / ``collective`` transports make every sender its own
    leader (flat: no shared-memory hop).
    """

    ranks: tuple[int, ...]
    cross: str | None  # "workspace" | "collective" | None (everyone on one host)
    hosts: dict[int, list[int]]  # leader -> participants on its host, leader first

    @property
    def first(self) -> int:
        return self.ranks[0]

    @property
    def flat(self) -> bool:
        """Every participant sends on its own (no shared-memory hop to a host leader)."""
        return all(len(host) == 1 for leader, host in self.hosts.items() if leader != self.first) and (
            self.cross is None or len(self.hosts[self.first]) == 1
        )

    def leader_of(self, rank: int) -> int:
        return next(leader for leader, host in self.hosts.items() if rank in host)

    def describe(self) -> str:
        if self.cross is None:
            return "shm"
        remote = [h for leader, h in self.hosts.items() if leader != self.first]
        if all(len(h) == 1 for h in remote) and len(self.hosts[self.first]) == 1:
            return self.cross
        return f"shm within hosts + {self.cross} across {len(remote)} remote host(s)"


def _plan(requested: str, ranks: list[int], peers: dict[int, Any], has_workspace: bool) -> _Plan:
    """Choose the route of every payload (raises before anything is written)."""
    first, order = ranks[0], tuple(ranks)
    if requested in ("workspace", "collective"):
        if requested == "workspace" and not has_workspace:
            raise ValueError(
                "transport='workspace' needs a workspace_path (a directory every rank can reach)"
            )
        return _Plan(order, requested, {r: [r] for r in ranks})
    by_domain: dict[str, list[int]] = {}
    for r in ranks:
        by_domain.setdefault(peers[r].shm_domain, []).append(r)
    if len(by_domain) == 1:
        return _Plan(order, None, {first: list(ranks)})
    hosts_named = sorted({peers[r].hostname for r in ranks})
    if requested == "shm":
        raise TransportUnavailableError(
            f"transport='shm' needs every participant on one host with one /dev/shm, but ranks {ranks} "
            f"span {len(by_domain)} shared-memory domains (hosts {hosts_named}); use transport='auto'"
        )
    return _Plan(order, "workspace" if has_workspace else "collective", {h[0]: h for h in by_domain.values()})


@contextmanager
def _gather(
    value: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | Sequence[int] | None,
    *,
    transport: str,
    workspace_path: str | PathLike[str] | None,
    timeout: float | timedelta | None,
    device: str | torch.device | None,
    root: str,
) -> Iterator[list[Any]]:
    # Local mistakes are reported through the agreement, so every rank raises, none waits.
    local_error: ValueError | None = None
    try:
        seconds = sync.resolve_timeout(timeout)
    except ValueError as exc:
        seconds, local_error = sync.DEFAULT_TIMEOUT_S, exc
    if transport not in TRANSPORTS:
        local_error = ValueError(f"unknown transport {transport!r}; valid: {list(TRANSPORTS)}")
    companion = sync.companion(group)
    members, me = companion.ranks, companion.rank
    peers = dict(zip(members, companion.peers(seconds)))

    error: tuple[str, str] | None = None
    checked: list[int] | None = None
    plan: _Plan | None = None
    payload: wire.EncodedPayload | None = None
    try:
        if local_error is not None:
            raise local_error
        if root == "tensor":
            _check_tensor(value)  # a local mistake: every rank raises, none waits for it
        checked = _check_ranks(ranks, members)
        plan = _plan(transport, checked, peers, workspace_path is not None)
        if me == checked[0]:
            _check_device(device)
        if me in checked[1:]:
            direct = plan.hosts.get(me) == [me]
            payload = wire.encode(
                value,
                root=root,
                checksum=direct and plan.cross == "workspace",
                keep_device=direct
                and plan.cross == "collective"
                and _collective_route(group, True)[1].type != "cpu",
            )
    except (TypeError, ValueError) as exc:
        error = (type(exc).__name__, str(exc))
    on_device = payload is not None and payload.device_resident
    mode = f"{transport}:{workspace_path is not None}"
    freed = [list(item) for item in take_freed(members)]
    intent = _Intent(checked, _digest(checked), error, secrets.randbits(63), mode, on_device, freed)

    round_ = companion.new_round()
    round_.post("agree", intent.pack())
    intents = [_Intent.unpack(v) for v in round_.wait("agree", members, seconds, "agreeing on a gather")]
    segments_freed({ident for intent in intents for rank, ident in intent.freed if rank == me})
    _agree(intents, members, me)
    assert plan is not None and checked is not None  # _agree raised on every rank otherwise
    token = f"{intents[0].nonce:016x}"
    by_rank = dict(zip(members, intents))
    carrier: tuple[dist.ProcessGroup | None, torch.device] = (None, torch.device("cpu"))
    if plan.cross == "collective":
        carrier = _collective_route(group, plan.flat and all(by_rank[r].on_device for r in plan.ranks[1:]))
    if payload is not None and carrier[1].type == "cpu":
        payload = payload.to_cpu()
    # A forced "shm" never falls back to the workspace: /dev/shm too small is then an error.
    fallback = workspace_path if transport != "shm" else None
    route = _Route(plan, round_, token, seconds, companion, carrier, fallback, peers)
    logger.debug("round %s: %s", token, route.what)

    if me == plan.first:
        yield route.receive(value, device)
    elif payload is None:  # not a participant
        with route.leaving():
            yield []
    elif plan.leader_of(me) == me:
        with route.forwarding(payload):
            yield []
    else:
        with route.sending_to_leader(payload):
            yield []


class _Route:
    """Carries out one round's :class:`_Plan` on this rank (see the module doc for the steps)."""

    def __init__(
        self,
        plan: _Plan,
        round_: sync.Round,
        token: str,
        seconds: float,
        companion: sync.GroupSync,
        carrier: tuple[dist.ProcessGroup | None, torch.device],
        workspace_path: str | PathLike[str] | None,
        peers: dict[int, Any],
    ) -> None:
        self.plan, self.round, self.token, self.seconds = plan, round_, token, seconds
        self.me = companion.rank
        self.what = f"gather to rank {plan.first} over {plan.describe()}"
        self._companion, self._carrier, self._workspace_path = companion, carrier, workspace_path
        receiver = peers[plan.leader_of(self.me)] if self.me in plan.ranks else None
        me = peers[self.me]
        self._local = SharedMemoryTransport(
            {r: p.pid for r, p in peers.items()}, pool=receiver is not None and me.can_watch(receiver)
        )
        self._cross: Transport | None = None
        self._workspace: Transport | None = None
        self._in_workspace: set[int] = set()  # local senders that published to the workspace

    @property
    def workspace(self) -> Transport:
        """The workspace transport of the job (made on first use; sweeps dead jobs' leftovers)."""
        if self._workspace is None:
            from .transports.workspace import WorkspaceTransport, job_token

            self._workspace = WorkspaceTransport(
                self._workspace_path, job_token(), self.seconds, sweep_stale=True
            )
        return self._workspace

    @property
    def cross(self) -> Transport:
        """The transport between host leaders and the first rank (made on first use)."""
        if self._cross is None:
            if self.plan.cross == "workspace":
                self._cross = self.workspace
            else:
                group, device = self._carrier
                self._cross = CollectiveTransport(group, self.plan.first, self.seconds, device)
        return self._cross

    # -- senders -----------------------------------------------------------------------------------
    @contextmanager
    def sending_to_leader(self, payload: wire.EncodedPayload) -> Iterator[None]:
        """A participant that is not a leader: publish into shared memory for its leader."""
        try:
            where = self._publish_on_host(payload)
        except Exception as exc:
            self.round.post("pub", _status(exc))
            raise
        del payload
        self.round.post("pub", where.encode())
        try:
            with self.leaving():
                yield
        finally:
            if where == _OK_WORKSPACE:
                self.workspace.release(self.token, self.me)
            else:
                self._local.release(self.token, self.me)

    def _publish_on_host(self, payload: wire.EncodedPayload) -> str:
        """Publish into ``/dev/shm``, or into the workspace when one is given and shm has no room.

        Returns:
            The "pub" status to post: where the receiver finds the payload.
        """
        try:
            receipt = self._local.publish(self.token, self.me, payload)
            return f"{_OK_SEGMENT}{receipt}" if receipt else _OK
        except SpaceError:
            if self._workspace_path is None:
                raise
        logger.warning(
            "%s: /dev/shm cannot hold rank %d's payload of %d bytes; it goes through the workspace %s",
            self.what,
            self.me,
            payload.nbytes,
            self._workspace_path,
        )
        self.workspace.publish(self.token, self.me, payload.with_checksum())
        return _OK_WORKSPACE

    def _fetch_on_host(self, rank: int, status: bytes) -> Any:
        """The payload a sender of this host published, from where its status says."""
        where = _published(status, f"rank {rank}")
        if where == _OK_WORKSPACE:
            self._in_workspace.add(rank)  # so that a failure discards it there
            return self.workspace.fetch(self.token, rank)
        return self._local.fetch(self.token, rank, where.removeprefix(_OK_SEGMENT) if where != _OK else "")

    @contextmanager
    def forwarding(self, own: wire.EncodedPayload) -> Iterator[None]:
        """A remote host's leader: collect its host's payloads and send one bundle across."""
        host = self.plan.hosts[self.me]
        try:
            outgoing = own if len(host) == 1 else self._bundle(own, host[1:])
            self.cross.publish(self.token, self.me, outgoing)
        except Exception as exc:
            self.round.post("xpub", _status(exc))
            raise
        self.round.post("xpub", _OK.encode())
        try:
            with self.leaving():
                yield
        finally:
            self.cross.release(self.token, self.me)

    def _bundle(self, own: wire.EncodedPayload, others: list[int]) -> wire.EncodedPayload:
        """One payload holding the raw payloads of this host's participants (no decoding)."""
        try:
            statuses = self.round.wait("pub", others, self.seconds, self.what)
            for rank, status in zip(others, statuses):
                _published(status, f"rank {rank}")
            mine = bytearray(own.nbytes)
            own.write_into(mine)  # one copy (to_bytes and a bytearray of it would make two)
            parts = [torch.frombuffer(mine, dtype=torch.uint8)]
            for rank, status in zip(others, statuses):
                parts.append(torch.frombuffer(self._fetch_on_host(rank, status), dtype=torch.uint8))
        except BaseException:
            self._discard(others, [])
            raise
        bundle = {"ranks": [self.me, *others], "parts": parts}
        return wire.encode(bundle, root="bundle", checksum=self.plan.cross == "workspace")

    @contextmanager
    def leaving(self) -> Iterator[None]:
        """Run the caller's block, then wait for the first rank's "done" (never masking an error).

        The first rank's own waits are each bounded by the timeout, so its peers wait for its
        verdict a little longer (twice the timeout plus 5 s): when it gives up on a late
        payload, they hear its reason instead of timing out at the same moment.
        """
        first, seconds = self.plan.first, 2 * self.seconds + 5
        try:
            yield
        except BaseException:
            try:
                self.round.wait("done", [first], seconds, self.what)
            except Exception:
                logger.warning("%s: the first rank did not finish either", self.what, exc_info=True)
            raise
        _expect_ok(self.round.wait("done", [first], seconds, self.what)[0], f"the first rank ({first})")

    # -- the first rank ------------------------------------------------------------------------------
    def receive(self, own: Any, device: str | torch.device | None) -> list[Any]:
        """Wait for every payload, decode them in ``ranks`` order, post "done"."""
        plan = self.plan
        local = plan.hosts[plan.first][1:]
        leaders = [leader for leader in plan.hosts if leader != plan.first]
        found: dict[int, Any] = {}
        try:
            target = torch.device(device) if device is not None else None
            found[plan.first] = (
                own.to(target) if target is not None and isinstance(own, torch.Tensor) else own
            )
            statuses: dict[int, bytes] = {}
            if local:
                statuses.update(zip(local, self.round.wait("pub", local, self.seconds, self.what)))
                for rank in local:
                    _published(statuses[rank], f"rank {rank}")
            if leaders:
                for rank, status in zip(leaders, self.round.wait("xpub", leaders, self.seconds, self.what)):
                    _expect_ok(status, f"rank {rank}")
            for rank in local:
                found[rank] = self._decode(self._fetch_on_host(rank, statuses[rank]), rank, target)
            for leader in leaders:
                if len(plan.hosts[leader]) == 1:
                    found[leader] = self._decode(self.cross.fetch(self.token, leader), leader, target)
                    continue
                value = self._decode(self.cross.fetch(self.token, leader), leader, None)
                for rank, part in zip(value["ranks"], value["parts"]):
                    found[rank] = self._decode(wire.tensor_buffer(part), rank, target)
        except BaseException as exc:
            self.round.post("done", _status(exc))
            self._discard(local, leaders)
            raise
        self.round.post("done", _OK.encode())
        return [found[r] for r in plan.ranks]

    def _discard(self, local: list[int], leaders: list[int]) -> None:
        """After a failure, remove what peers published for us: a dead peer cannot.

        Best effort, never raises: the error being handled is the one to report (an unusable
        workspace, say, must not replace it).
        """
        try:
            for rank in local:
                self._local.release(self.token, rank)
                if rank in self._in_workspace:
                    self.workspace.release(self.token, rank)
            if self.plan.cross == "workspace":
                for rank in leaders:
                    self.cross.release(self.token, rank)
        except Exception as exc:
            logger.warning("%s: could not remove what peers published: %s", self.what, exc)

    @staticmethod
    def _decode(buffer: Any, rank: int, target: torch.device | None) -> Any:
        try:
            return wire.decode(buffer, device=target)
        except PayloadError as exc:
            raise PayloadError(f"payload of rank {rank} is unusable: {exc}") from None


def _collective_route(
    group: dist.ProcessGroup | Sequence[int] | None, on_device: bool
) -> tuple[dist.ProcessGroup | None, torch.device]:
    """The group and device the collective transport sends on; no group is ever created.

    Point-to-point messages need no other rank's help, so they travel over ``group`` itself
    (the world for a mesh's rank list). A backend with gloo carries CPU bytes; with NCCL
    only, or when every sender's tensors already live on the GPU, messages go through GPU
    memory (the GPU fallback).
    """
    pg = group if group is None or isinstance(group, dist.ProcessGroup) else None
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and (on_device or "gloo" not in backend):
        return pg, torch.device("cuda", torch.cuda.current_device())
    return pg, torch.device("cpu")


def _check_device(device: str | torch.device | None) -> None:
    """Raise ValueError when the first rank cannot place results on ``device``."""
    if device is None:
        return
    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, TypeError, AssertionError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"device={device!r} is not usable on the first rank ({first_line}); pass a device it has, "
            "or None for the CPU"
        ) from None


def _status(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}: {exc}".encode()[:4096] or b"error"


def _expect_ok(status: bytes, who: str) -> None:
    if status != _OK.encode():
        raise GatherError(f"{who} failed: {status.decode(errors='replace')}")


def _published(status: bytes, who: str) -> str:
    """Where a sender on this host published (shm, a pooled segment, the workspace), else raise."""
    text = status.decode(errors="replace")
    if text in (_OK, _OK_WORKSPACE) or text.startswith(_OK_SEGMENT):
        return text
    raise GatherError(f"{who} failed: {text}")


# -- public API ----------------------------------------------------------------------------------
Workspace = str | PathLike[str] | None


def _check_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"get_tensors_parallel gathers a torch.Tensor; got {type(tensor).__name__}")


@contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gather ``tensor`` of every rank in ``ranks`` to ``ranks[0]``.

    Must be entered on every rank of ``group`` (the world when None). Ranks of the group not
    in ``ranks`` take part in the synchronisation only.

    Args:
        tensor: this rank's tensor: any dtype, shape, strides or device.
        ranks: participating global ranks; ``ranks[0]`` receives. The same list everywhere.
        group: the group whose ranks synchronise (the world when None).
        workspace_path: a directory every rank can reach (NFS), used between hosts, and on
            one host for a payload that ``/dev/shm`` has no room for (logged as a warning).
        transport: ``"auto"`` (shared memory within a host; between hosts the workspace when
            given, else the collective), ``"shm"``, ``"workspace"`` or ``"collective"``.
        timeout: bound on every wait, in seconds or a timedelta (default
            ``$DISTRIBUTE_UTILS_TIMEOUT`` or 600 s).
        device: where the first rank wants the results (default: CPU; its own tensor as is).

    Yields:
        On ``ranks[0]``: one tensor per entry of ``ranks``, its own first; valid after the
        block. Elsewhere: ``[]``.

    Raises:
        ValueError: bad or disagreeing ``ranks``, unknown transport (on every rank).
        TransportUnavailableError: ``"shm"`` across hosts.
        PeerLostError: a rank did not arrive within ``timeout`` (named).
        SpaceError: no room for a payload in ``/dev/shm`` (and no workspace given) or in the
            workspace.
    """
    options = {"transport": transport, "workspace_path": workspace_path, "timeout": timeout, "device": device}
    with _gather(tensor, ranks, group, root="tensor", **options) as out:
        yield out


@contextmanager
def get_configs_parallel(
    config: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    workspace_path: Workspace = None,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[Any]]:
    """Gather ``config`` (a tree of plain values, dataclasses and tensors) to ``ranks[0]``.

    Same contract as :func:`get_tensors_parallel`. Unlike ModelOpt, a rank that passes
    ``None`` yields ``None`` at its position, so positions always match ``ranks``.

    Raises:
        TypeError: a value that cannot travel, named by its path (``config['layers'][3]``),
            on every rank before any rank writes anything.
    """
    options = {"transport": transport, "workspace_path": workspace_path, "timeout": timeout, "device": device}
    with _gather(config, ranks, group, root="config", **options) as out:
        yield out


@contextmanager
def gather_tensors(
    tensor: torch.Tensor,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gather ``tensor`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group; groups along the axis proceed independently.
    Options as in :func:`get_tensors_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    options = {"transport": transport, "workspace_path": workspace_path, "timeout": timeout, "device": device}
    with _gather(tensor, ranks, group, root="tensor", **options) as out:
        yield out


@contextmanager
def gather_configs(
    config: Any,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[Any]]:
    """Gather ``config`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group. Options as in :func:`get_configs_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    options = {"transport": transport, "workspace_path": workspace_path, "timeout": timeout, "device": device}
    with _gather(config, ranks, group, root="config", **options) as out:
        yield out
