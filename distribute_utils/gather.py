"""Gather configs and tensors to the first rank of a group: the toolkit's public heart.

``get_tensors_parallel`` / ``get_configs_parallel`` keep the names and call shapes of
NVIDIA ModelOpt's helpers (``modelopt.torch.export.distribute``), so switching is a change of
import; ``gather_tensors`` / ``gather_configs`` take a :class:`ProcessGroupMesh` and an axis.

Contract (ModelOpt's): every rank of ``group`` (the world when None) enters the call; ``group``
only says who synchronises, ``ranks`` says where *this rank's* value goes. Different ranks may
pass different lists as long as lists are identical or disjoint: every rank named in a list
passes that same list. Each list is its own gather to its own ``ranks[0]``, and all of them
proceed at once. A rank its list does not name only checks in and returns ``[]``.

Here: the public functions, the checks of their options (a bad list, transport, value or device is
raised on every rank of the gather: a local mistake travels in this rank's claim), and
:func:`gather_on`, which makes this rank's part in the call once, as the role it has: a sender, the
first rank, or a rank that only checks in. The round itself (one hop each way, the direct and the
store round, the plan) is :mod:`distribute_utils.roles`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from os import PathLike
from typing import Any

import torch
import torch.distributed as dist

from . import sync, wire
from .caches import Recent
from .errors import ArgumentError, UnsupportedTypeError
from .mesh import ProcessGroupMesh
from .roles import (
    ATTACHED_MAX_BYTES,
    CheckIn,
    FirstRank,
    RankList,
    Round,
    Sender,
    error_of,
    raise_from,
    repeat,
)
from .transports.inline import INLINE_MAX_BYTES
from .transports.router import REQUESTS, Request, request

__all__ = [
    "ATTACHED_MAX_BYTES",
    "INLINE_MAX_BYTES",
    "TRANSPORTS",
    "gather_configs",
    "gather_on",
    "gather_tensors",
    "gather_to_first",
    "get_configs_parallel",
    "get_tensors_parallel",
]

logger = logging.getLogger(__name__)

TRANSPORTS = tuple(REQUESTS)


def _checked(ranks: Sequence[int], companion: sync.GroupSync, world: int | None) -> RankList:
    """``ranks`` checked against the world (``world`` ranks; None: the default group's) and the members
    of ``companion``'s group (raises ValueError).

    The same lists come back call after call: a list checked once is kept (by value, with its group's
    members: a list of members is in the world).
    """
    if (type(ranks) is list or type(ranks) is tuple) and set(map(type, ranks)) == {int}:
        key = (tuple(ranks), companion.ranks)
        found = _LISTS.get(key)
        if found is None:
            checked = _check_ranks_now(ranks, companion.ranks, world or dist.get_world_size())
            found = _LISTS.put(key, RankList(checked, companion.digest(checked)))
        return found
    checked = _check_ranks_now(ranks, companion.ranks, world or dist.get_world_size())
    return RankList(checked, companion.digest(checked))


_LISTS: Recent[tuple[tuple[int, ...], tuple[int, ...]], RankList] = Recent(256)


def _check_ranks_now(ranks: Sequence[int], members: tuple[int, ...], world: int) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ArgumentError(f"ranks must be a list of global ranks; got {type(ranks).__name__}")
    ranks = list(ranks)
    if not ranks:
        raise ArgumentError("ranks is empty; list the participating global ranks, the receiver first")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise ArgumentError(f"ranks must be ints; got {bad!r} in {ranks}")
    if len(set(ranks)) != len(ranks):
        duplicates = sorted(r for r, n in collections.Counter(ranks).items() if n > 1)
        raise ArgumentError(f"ranks {ranks} lists {duplicates} more than once; each rank may appear once")
    outside_world = [r for r in ranks if not 0 <= r < world]
    if outside_world:
        raise ArgumentError(f"ranks {outside_world} are outside the world (valid: 0..{world - 1})")
    member_set = set(members) if len(members) != world else None
    outside_group = [] if member_set is None else [r for r in ranks if r not in member_set]
    if outside_group:
        raise ArgumentError(
            f"ranks {outside_group} are not in the group {_short(members)}; list members only"
        )
    return ranks


def _short(ranks: Sequence[int]) -> str:
    return sync.short(ranks)


def _is_cuda(device: str | torch.device) -> bool:
    """Whether ``device`` names a CUDA device (False for anything that is not a device)."""
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError, ValueError):
        return False


class _RunsWhenEntered:
    """What :func:`gather_to_first` returns: the gather, run when entered (it yields the list); nothing
    to undo on exit."""

    __slots__ = ("_call",)

    def __init__(self, call: tuple[Any, ...]) -> None:
        self._call = call  # gather_to_first's arguments, in its order

    def __enter__(self) -> list[Any]:
        value, ranks, group, transport, workspace_path, timeout, device, root, received_on = self._call
        seconds, error = _resolved(timeout)
        return _run(
            sync.companion(group, seconds),
            value,
            ranks,
            None,
            group,
            transport,
            workspace_path,
            seconds if error is None else timeout,  # (a bad one: gather_on raises it on every rank)
            device,
            root,
            received_on,
        )

    def __exit__(self, *exc: object) -> None:
        return None


def gather_to_first(
    value: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | Sequence[int] | None,
    *,
    transport: str,
    workspace_path: str | PathLike[str] | None,
    timeout: float | timedelta | None,
    device: str | torch.device | None,
    root: str,
    received_on: str | None = None,
) -> AbstractContextManager[list[Any]]:
    """The one gather under the public functions (and :mod:`distribute_utils.modelopt`): ``value`` of every
    rank in ``ranks`` to ``ranks[0]``, synchronised over ``group``; yields the list there, ``[]`` elsewhere.

    ``root`` says which public call this is (``"tensor"`` or ``"config"``, for checks and messages).
    Where the tensors go on the first rank (ModelOpt's rule; ``docs/api.md``, "Devices"):

    - ``device`` given: every tensor, its own value's included, on ``device``;
    - else ``root="tensor"``: every tensor on the CPU (ModelOpt's ``tensor.cpu()``);
    - else (configs): its own config as passed (the same object), each received tensor on the device its
      sender had it on (``torch.load``'s restore); ``received_on="cpu"`` puts those on the CPU instead
      (ModelOpt's workspace path, ``map_location="cpu"``). A device the first rank lacks raises
      :class:`~distribute_utils.errors.DeviceUnavailableError` on every rank, before anything is yielded.

    Every rank of ``group`` must enter it (see ``docs/api.md``, "The contract: ``group`` synchronises,
    ``ranks`` routes"); the gather runs when it is entered.
    """
    return _RunsWhenEntered(
        (value, ranks, group, transport, workspace_path, timeout, device, root, received_on)
    )


def gather_on(
    companion: sync.GroupSync,
    value: Any,
    ranks: Sequence[int],
    *,
    world_size: int | None = None,
    group: dist.ProcessGroup | Sequence[int] | None = None,
    transport: str = "auto",
    workspace_path: str | PathLike[str] | None = None,
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
    root: str = "config",
    received_on: str | None = None,
) -> list[Any]:
    """One gather call over ``companion``'s ranks, run now: the round under :func:`gather_to_first`, for a
    caller that holds its companion (a :class:`~distribute_utils.sync.GroupSync` made with a peer
    directory). Returns the list on ``ranks[0]``, ``[]`` elsewhere.

    This is the seam ``scripts/bench_sync_scale.py`` drives the real round through: simulated ranks
    (threads, each with its own companion on one ``TCPStore``) without a process group. ``world_size``
    bounds the ranks (None: the default group's); ``group`` matters only to the collective transport.
    Every rank of ``companion.ranks`` must call it, in the same order as its other operations.
    """
    return _run(
        companion,
        value,
        ranks,
        world_size,
        group,
        transport,
        workspace_path,
        timeout,
        device,
        root,
        received_on,
    )


def _run(
    companion: sync.GroupSync,
    value: Any,
    ranks: Sequence[int],
    world_size: int | None,
    group: dist.ProcessGroup | Sequence[int] | None,
    transport: str,
    workspace_path: str | PathLike[str] | None,
    timeout: float | timedelta | None,
    device: str | torch.device | None,
    root: str,
    received_on: str | None,
) -> list[Any]:
    """:func:`gather_on`, its arguments by position (the public gathers' call: no keyword binding per call)."""
    # A local mistake is posted in this rank's claim: its gather partners raise it too, none waits.
    # (gather_to_first's timeout comes resolved, a positive float: no second call to resolve it.)
    seconds, error = (timeout, None) if type(timeout) is float and timeout > 0 else _resolved(timeout)
    with companion.gathering:
        call = companion.new_call(seconds)
        if companion.disagreement is not None:  # an earlier call's partner named this rank in another list
            said = companion.take_disagreement()
            if said is not None:
                error = error or error_of(ArgumentError(said))
        try:
            asked = REQUESTS[transport]
        except (KeyError, TypeError):
            try:
                asked = request(transport)  # (raises, naming the valid ones)
            except ArgumentError as exc:  # (posted: its partners raise it too)
                asked, error = Request(str(transport)), error or error_of(exc)
        this_call: Round = (companion, call, asked, workspace_path, seconds, group, root)
        try:
            listed = _checked(ranks, companion, world_size)
        except ValueError as exc:
            # No list to route by: check in, so that nobody waits for this rank, and raise.
            CheckIn(this_call, RankList([companion.rank], companion.digest([companion.rank]))).check_in(
                error_of(exc)
            )
            raise
        if error is None and root == "tensor" and not isinstance(value, torch.Tensor):
            error = error_of(
                UnsupportedTypeError(
                    f"get_tensors_parallel gathers a torch.Tensor; got {type(value).__name__}"
                )
            )
        checked, me = listed.ranks, companion.rank
        if me not in checked:
            CheckIn(this_call, listed).check_in(error)
            if error is not None:
                raise_from(error, "")
            return []
        # A call like an earlier one of the same list and options that went well: its repeat (roles.repeat).
        kept: Any = None
        call_key: Hashable | None = None
        if error is None:
            call_key = repeat.key(this_call, listed, device, received_on, world_size)
            try:
                kept = companion.repeats.get(call_key)
            except TypeError:  # (an option that cannot be a key: no repeat)
                call_key = None
        if me == checked[0]:
            if kept is not None:
                found = kept.receive(this_call, value)
                if found is not None:
                    return found  # type: ignore[no-any-return]
            first = FirstRank(this_call, listed, received_on=received_on)
            error = first.decide(error)
            if error is None and device is not None:
                try:
                    _check_device(device)
                except ValueError as exc:
                    error = error_of(exc)
            values = first.receive(value, device, error)
            if kept is None and call_key is not None and error is None:
                repeat.first_repeat(first, device, companion.repeats, call_key)
            return values
        if kept is not None and kept.send(this_call, value):
            return []
        # A sender's guess, from its own arguments (the first rank's are what count), whether its first
        # rank wants received tensors on a GPU: ``device`` a CUDA device, or a config gather restoring
        # senders' devices. A wrong guess costs speed only: a GPU buffer bound for the CPU is moved there
        # in ``decode``. (device=None, nearly every gather's, is answered without a call.)
        cuda_wanted = asked.free and (
            root == "config" and received_on is None if device is None else _is_cuda(device)
        )
        sender = Sender(this_call, listed, cuda_wanted=cuda_wanted)
        sender.send(value, sender.decide(error))
        if call_key is not None and error is None:
            repeat.sender_repeat(sender, companion.repeats, call_key, kept)
        return []


def _resolved(timeout: float | timedelta | None) -> tuple[float, tuple[Any, ...] | None]:
    """Seconds to wait, and the error of a bad ``timeout`` (then the default is waited)."""
    try:
        return sync.resolve_timeout(timeout), None
    except ValueError as exc:
        return sync.DEFAULT_TIMEOUT_S, error_of(exc)


def _check_device(device: str | torch.device | None) -> None:
    """Raise ValueError when the first rank cannot place results on ``device``."""
    if device is None:
        return
    try:
        why = wire.unusable_device(device)
    except TypeError as exc:  # (not hashable: not a device either)
        why = str(exc)
    if why is not None:
        raise ArgumentError(
            f"device={device!r} is not usable on the first rank ({why}); pass a device it has, "
            "or None for the CPU"
        )


# -- public API ----------------------------------------------------------------------------------
Workspace = str | PathLike[str] | None


def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[torch.Tensor]]:
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
        device: where the first rank wants every yielded tensor, its own included (default:
            the CPU, as ModelOpt's ``tensor.cpu()``; a CPU tensor of its own is yielded as passed).

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
    return _RunsWhenEntered(
        (tensor, ranks, group, transport, workspace_path, timeout, device, "tensor", None)
    )


def get_configs_parallel(
    config: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    workspace_path: Workspace = None,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[Any]]:
    """Gather ``config`` (a tree of plain values, dataclasses and tensors) to ``ranks[0]``.

    Same contract as :func:`get_tensors_parallel`. Devices, as ModelOpt's (``docs/api.md``, "Devices"):
    with ``device=None`` the first rank's own config is yielded as passed (the same object) and each
    received tensor is on the device its sender had it on, as ``torch.load`` restores it (``cuda:N``
    of the sender, the CPU for a CPU tensor); with ``device`` given, every tensor, its own config's
    included, is on ``device``. A meta tensor stays meta. Unlike ModelOpt, a rank that passes ``None``
    yields ``None`` at its position, so positions always match ``ranks`` (:mod:`distribute_utils.modelopt`
    has ModelOpt's behaviour, for its callers).

    Raises:
        TypeError: a value that cannot travel, named by its path (``config['layers'][3]``),
            on every rank before any rank writes anything.
        DeviceUnavailableError: with ``device=None``, a received tensor's device does not exist on
            the first rank (sender, path and device named), on every rank, before anything is yielded.
    """
    return _RunsWhenEntered(
        (config, ranks, group, transport, workspace_path, timeout, device, "config", None)
    )


def gather_tensors(
    tensor: torch.Tensor,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[torch.Tensor]]:
    """Gather ``tensor`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group; groups along the axis proceed independently.
    Options as in :func:`get_tensors_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    return _RunsWhenEntered(
        (tensor, ranks, group, transport, workspace_path, timeout, device, "tensor", None)
    )


def gather_configs(
    config: Any,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[Any]]:
    """Gather ``config`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group. Options and devices as in :func:`get_configs_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    return _RunsWhenEntered(
        (config, ranks, group, transport, workspace_path, timeout, device, "config", None)
    )
