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
from .errors import GatherError, PayloadError, TransportUnavailableError
from .mesh import ProcessGroupMesh
from .transports import SharedMemoryTransport, Transport

__all__ = [
    "TRANSPORTS",
    "gather_configs",
    "gather_tensors",
    "get_configs_parallel",
    "get_tensors_parallel",
]

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm")
_OK = "ok"


@dataclass(frozen=True)
class _Intent:
    """What one rank brings to the agreement of a round."""

    ranks: list[int] | None
    digest: str
    error: tuple[str, str] | None  # (exception type name, message)
    nonce: int
    transport: str

    def pack(self) -> bytes:
        shown = self.ranks if self.ranks is not None and len(self.ranks) <= 64 else None
        return msgpack.packb(
            [shown, self.digest, list(self.error) if self.error else None, self.nonce, self.transport]
        )

    @classmethod
    def unpack(cls, data: bytes) -> _Intent:
        shown, digest, error, nonce, transport = msgpack.unpackb(data)
        return cls(shown, digest, tuple(error) if error else None, nonce, transport)


_RAISABLE: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}


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


def _choose_transport(requested: str, ranks: list[int], group: sync.GroupSync, timeout: float) -> Transport:
    peers = dict(zip(group.ranks, group.peers(timeout)))
    domains = {peers[r].shm_domain for r in ranks}
    if len(domains) == 1:
        return SharedMemoryTransport({r: peers[r].pid for r in ranks})
    hosts = sorted({peers[r].hostname for r in ranks})
    if requested == "shm":
        raise TransportUnavailableError(
            f"transport='shm' needs every participant on one host with one /dev/shm, but ranks {ranks} "
            f"span {len(domains)} shared-memory domains (hosts {hosts}); use transport='auto'"
        )
    raise TransportUnavailableError(
        f"ranks {ranks} span {len(domains)} shared-memory domains (hosts {hosts}); no transport "
        "available here can cross hosts yet"
    )


@contextmanager
def _gather(
    value: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | Sequence[int] | None,
    *,
    transport: str,
    timeout: float | timedelta | None,
    device: str | torch.device | None,
    root: str,
) -> Iterator[list[Any]]:
    seconds = sync.resolve_timeout(timeout)
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid: {list(TRANSPORTS)}")
    companion = sync.companion(group)
    members, me = companion.ranks, companion.rank

    error: tuple[str, str] | None = None
    checked: list[int] | None = None
    payload: wire.EncodedPayload | None = None
    try:
        checked = _check_ranks(ranks, members)
        if me in checked[1:]:
            payload = wire.encode(value, root=root)
    except (TypeError, ValueError) as exc:
        error = (type(exc).__name__, str(exc))
    intent = _Intent(checked, _digest(checked), error, secrets.randbits(63), transport)

    round_ = companion.new_round()
    round_.post("agree", intent.pack())
    intents = [_Intent.unpack(v) for v in round_.wait("agree", members, seconds, "agreeing on a gather")]
    _agree(intents, members, me)
    token = f"{intents[0].nonce:016x}"
    first, senders = checked[0], checked[1:]  # type: ignore[index]  # _agree raised otherwise
    carrier = _choose_transport(transport, checked, companion, seconds)  # type: ignore[arg-type]
    what = f"gather to rank {first} over {carrier.name}"

    if me == first:
        results = _receive(value, round_, carrier, token, senders, seconds, device, what)
        yield results
    elif payload is not None:
        try:
            carrier.publish(token, me, payload)
        except Exception as exc:
            round_.post("pub", _status(exc))
            raise
        del payload
        round_.post("pub", _OK.encode())
        try:
            with _leaving(round_, first, seconds, what):
                yield []
        finally:
            carrier.release(token, me)
    else:
        with _leaving(round_, first, seconds, what):
            yield []


@contextmanager
def _leaving(round_: sync.Round, first: int, seconds: float, what: str) -> Iterator[None]:
    """Run the caller's block, then wait for the first rank's "done" (never masking an error)."""
    try:
        yield
    except BaseException:
        try:
            round_.wait("done", [first], seconds, what)
        except Exception:
            logger.warning("%s: the first rank did not finish either", what, exc_info=True)
        raise
    _expect_ok(round_.wait("done", [first], seconds, what)[0], f"the first rank ({first})")


def _receive(
    own: Any,
    round_: sync.Round,
    carrier: Transport,
    token: str,
    senders: list[int],
    seconds: float,
    device: str | torch.device | None,
    what: str,
) -> list[Any]:
    """First rank: wait for the senders, fetch and decode their payloads, post "done"."""
    try:
        if senders:
            statuses = round_.wait("pub", senders, seconds, what)
            for rank, status in zip(senders, statuses):
                _expect_ok(status, f"rank {rank}")
        target = torch.device(device) if device is not None else None
        results = [own.to(target) if target is not None and isinstance(own, torch.Tensor) else own]
        for rank in senders:
            try:
                results.append(wire.decode(carrier.fetch(token, rank), device=target))
            except PayloadError as exc:
                raise PayloadError(f"payload of rank {rank} is unusable: {exc}") from None
    except BaseException as exc:
        round_.post("done", _status(exc))
        raise
    round_.post("done", _OK.encode())
    return results


def _status(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}: {exc}".encode()[:4096] or b"error"


def _expect_ok(status: bytes, who: str) -> None:
    if status != _OK.encode():
        raise GatherError(f"{who} failed: {status.decode(errors='replace')}")


# -- public API ----------------------------------------------------------------------------------
def _check_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"get_tensors_parallel gathers a torch.Tensor; got {type(tensor).__name__}")


@contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    workspace_path: str | PathLike[str] | None = None,
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
        workspace_path: shared directory for ranks on different hosts (multi-node).
        transport: ``"auto"`` or ``"shm"``.
        timeout: bound on every wait, in seconds or a timedelta (default
            ``$DISTRIBUTE_UTILS_TIMEOUT`` or 600 s).
        device: where the first rank wants the results (default: CPU; its own tensor as is).

    Yields:
        On ``ranks[0]``: one tensor per entry of ``ranks``, its own first; valid after the
        block (they are views of private mappings). Elsewhere: ``[]``.

    Raises:
        ValueError: bad or disagreeing ``ranks``, unknown transport (on every rank).
        PeerLostError: a rank did not arrive within ``timeout`` (named).
        SpaceError: ``/dev/shm`` too small for a payload.
    """
    _check_tensor(tensor)
    del workspace_path  # used by the multi-node transports
    with _gather(
        tensor, ranks, group, transport=transport, timeout=timeout, device=device, root="tensor"
    ) as out:
        yield out


@contextmanager
def get_configs_parallel(
    config: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    workspace_path: str | PathLike[str] | None = None,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[Any]]:
    """Gather ``config`` (a tree of plain values, dataclasses and tensors) to ``ranks[0]``.

    Same contract as :func:`get_tensors_parallel`. Unlike ModelOpt, a rank that passes
    ``None`` yields ``None`` at its position, so positions always match ``ranks``.

    Raises:
        TypeError: a value that cannot travel, named by its path (``config.layers[3].act])``),
            before any rank writes anything.
    """
    del workspace_path
    with _gather(
        config, ranks, group, transport=transport, timeout=timeout, device=device, root="config"
    ) as out:
        yield out


@contextmanager
def gather_tensors(
    tensor: torch.Tensor,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gather ``tensor`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group; groups along the axis proceed independently.
    """
    _check_tensor(tensor)
    ranks = mesh.ranks_along_axis(axis)
    with _gather(
        tensor, ranks, ranks, transport=transport, timeout=timeout, device=device, root="tensor"
    ) as out:
        yield out


@contextmanager
def gather_configs(
    config: Any,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> Iterator[list[Any]]:
    """Gather ``config`` to the first rank of this rank's group along ``axis`` of ``mesh``."""
    ranks = mesh.ranks_along_axis(axis)
    with _gather(
        config, ranks, ranks, transport=transport, timeout=timeout, device=device, root="config"
    ) as out:
        yield out
