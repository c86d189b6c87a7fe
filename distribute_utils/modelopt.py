"""ModelOpt's distribute helpers, by their exact names and with their observable behaviour.

A ModelOpt user switches by changing one import::

    from modelopt.torch.export.distribute import get_configs_parallel, get_tensors_parallel
    from distribute_utils.modelopt import get_configs_parallel, get_tensors_parallel

or patches ModelOpt's export code in place (what the test suite does with ModelOpt's own
``postprocess_model_config``)::

    import modelopt.torch.export.postprocess as post
    from distribute_utils import modelopt as ours
    post.get_configs_parallel, post.get_tensors_parallel = ours.get_configs_parallel, ours.get_tensors_parallel

Where ModelOpt's behaviour differs from :mod:`distribute_utils`' own functions, these follow
ModelOpt, so that a caller's result does not change, on every device:

- ``get_configs_parallel`` drops the ``None`` configs of other ranks (ModelOpt's callers read
  ``configs[-1]`` as "the last rank that had one"); the first rank's own config is yielded as
  passed (the same object, its tensors where they are), ``None`` included. Every received tensor
  is on the device its sender had it on, as ModelOpt's ``torch.load`` restores it (``cuda:N`` of
  the sender; the CPU for a CPU tensor), except with a ``workspace_path``, where ModelOpt loads
  with ``map_location="cpu"``: then on the CPU. A sender's device that the first rank does not
  have (``cuda:3`` where it has one GPU or none) raises
  :class:`~distribute_utils.errors.DeviceUnavailableError` naming the tensor and the device, on
  every rank, before anything is yielded (where ``torch.load`` fails too). Our
  :func:`distribute_utils.get_configs_parallel` keeps every position instead.
- ``get_tensors_parallel`` yields every tensor on the CPU, the first rank's own included
  (ModelOpt's ``tensor.cpu()``).

Everything else is ours: no fixed segment names, no pickle, space reserved before writing,
one store hop each way, and the same contract (``group`` synchronises, ``ranks`` routes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from os import PathLike
from typing import Any

import torch
import torch.distributed as dist

from . import gather
from .transports.nfs_workspace import NFSWorkspace

__all__ = ["NFSWorkspace", "get_configs_parallel", "get_tensors_parallel"]


@contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor, ranks: list[int], group: dist.ProcessGroup | None = None
) -> Iterator[list[torch.Tensor]]:
    """ModelOpt's ``get_tensors_parallel``: every rank's tensor, on the CPU, on ``ranks[0]``.

    Must be entered on every rank of ``group`` (the world when None).
    """
    with gather.get_tensors_parallel(tensor, ranks, group) as tensors:
        yield tensors


@contextmanager
def get_configs_parallel(
    config: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    workspace_path: str | PathLike[str] | None = None,
) -> Iterator[list[Any]]:
    """ModelOpt's ``get_configs_parallel``: on ``ranks[0]``, its own config as passed, then every other
    rank's config that is not ``None``, its tensors on their senders' devices (on the CPU with a
    ``workspace_path``). Must be entered on every rank of ``group``."""
    options: dict[str, Any] = {"transport": "auto", "timeout": None, "device": None}
    received_on = None if workspace_path is None else "cpu"  # ModelOpt: torch.load / map_location="cpu"
    with gather.gather_to_first(
        config, ranks, group, workspace_path=workspace_path, root="config", received_on=received_on, **options
    ) as configs:
        if configs:
            configs = [configs[0], *(c for c in configs[1:] if c is not None)]
        yield configs
