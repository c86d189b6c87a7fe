"""Internal. The first rank's own value, placed where its received ones go (:meth:`FirstRank.placement`).

Received tensors are decoded straight to their device; the first rank's own value is never encoded,
so its tensors are moved here: :func:`place_own` copies containers only along the paths to tensors
that move, and raises as :func:`~distribute_utils.wire.encode` would on a value nested too deep or a
subclass of ``list``, ``tuple`` or ``dict`` other than ``OrderedDict`` (which no copy could rebuild
faithfully).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any

import torch

from .. import wire

__all__ = ["CPU", "place_own"]

_CONTAINERS = (list, tuple, dict, collections.OrderedDict)  # the containers the wire carries as they are

CPU = torch.device("cpu")
"""The CPU device :func:`place_own` compares by identity (a CPU tensor bound for it stays as it is)."""


def place_own(value: Any, target: torch.device | None, root: str) -> Any:
    """The first rank's own value with every tensor on ``target``, like every received one
    (ModelOpt's ``tensor.cpu()``); ``target=None`` moves nothing. Containers and dataclasses are copied
    only along the paths to tensors that move; a value with nothing to move comes back as the same object.
    A meta tensor has no data to move: it stays as it is (as a received one decodes).

    Raises:
        TypeError: as :func:`wire.encode` on a sender: containers nested deeper than
            :data:`wire.MAX_DEPTH` or in a reference cycle, or a subclass of ``list``, ``tuple`` (a
            namedtuple among them) or ``dict`` (``defaultdict``, ``Counter``; ``OrderedDict`` is carried),
            whether or not anything in it moves (the first rank's value is never encoded).
    """
    try:
        return _place(value, target, 0)
    except _Refused as refused:
        path = refused.path[::-1]
        if refused.unsupported:
            raise wire.unsupported_type_error(root, path, refused.containers[0]) from None
        raise wire.nesting_error(root, path, refused.containers[::-1]) from None


class _Refused(Exception):
    """Raised by :func:`_place` at a container past :data:`wire.MAX_DEPTH` or of a type the wire does not
    carry (``unsupported``); each container on the way back up adds its step (found only now: the walk
    itself keeps no path)."""

    def __init__(self, container: object, unsupported: bool = False) -> None:
        super().__init__()
        self.containers: list[object] = [container]  # the deepest first
        self.path: list[Any] = []  # as wire.nesting_error takes it, the deepest step first
        self.unsupported = unsupported

    def step_out(self, parent: object) -> None:
        child = self.containers[-1]
        if isinstance(parent, dict):
            step: Any = next(((k,) for k, v in parent.items() if v is child), ("?",))
        elif isinstance(parent, (list, tuple)):
            step = next((i for i, v in enumerate(parent) if v is child), "?")
        else:
            names = (f.name for f in dataclasses.fields(parent))  # type: ignore[arg-type]
            step = next((n for n in names if getattr(parent, n, None) is child), "?")
        self.path.append(step)
        self.containers.append(parent)


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _place(value: Any, target: torch.device | None, depth: int) -> Any:
    """:func:`place_own` below ``depth`` containers (raises :class:`_Refused` past the limit)."""
    if isinstance(value, torch.Tensor):
        if target is None or (target is CPU and value.is_cpu) or value.is_meta:
            return value
        return value.detach().to(target) if value.device != target else value
    sequence = isinstance(value, (list, tuple))
    if not (sequence or isinstance(value, dict) or _is_dataclass_instance(value)):
        return value
    if type(value) not in _CONTAINERS and not _is_dataclass_instance(value):
        raise _Refused(value, unsupported=True)  # (a subclass of one: no copy could keep its type)
    if depth >= wire.MAX_DEPTH:
        raise _Refused(value)
    depth += 1
    try:
        if sequence:
            items = [_place(v, target, depth) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items)
        if isinstance(value, dict):
            placed = {k: _place(v, target, depth) for k, v in value.items()}
            if all(placed[k] is v for k, v in value.items()):
                return value
            out = copy.copy(value)
            out.update(placed)
            return out
        changed = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name, None)
            new = _place(old, target, depth)
            if new is not old:
                changed[f.name] = new
        if not changed:
            return value
        out = copy.copy(value)
        for name, new in changed.items():
            object.__setattr__(out, name, new)
        return out
    except _Refused as refused:
        refused.step_out(value)
        raise
