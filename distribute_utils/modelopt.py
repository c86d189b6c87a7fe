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
ModelOpt, so that a caller's result does not change:

- ``get_configs_parallel`` drops the ``None`` configs of other ranks (ModelOpt's callers read
  ``configs[-1]`` as "the last rank that had one"); the first rank's own config is yielded as
  passed, ``None`` included. Our :func:`distribute_utils.get_configs_parallel` keeps every
  position instead.
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
    """ModelOpt's ``get_configs_parallel``: on ``ranks[0]``, its own config, then every other
    rank's config that is not ``None``. Must be entered on every rank of ``group``."""
    options: dict[str, Any] = {"transport": "auto", "timeout": None, "device": None, "place_own": False}
    with gather.gather_to_first(
        config, ranks, group, workspace_path=workspace_path, root="config", **options
    ) as configs:
        if configs:
            configs = [configs[0], *(c for c in configs[1:] if c is not None)]
        yield configs
