"""Internal. Reading a DCP directory's metadata without running any of it: ``.metadata`` (:func:`read_dcp_metadata`)
and, for Megatron's torch_dist, ``metadata.json`` and the ``args`` in ``common.pt``."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path, PosixPath
from typing import Any

import torch

from ..errors import LayoutError, UnsupportedTypeError
from .safe_load import safe_pickle_load, safe_torch_load

__all__ = ["DCP_METADATA", "is_megatron_dcp", "megatron_args", "read_dcp_metadata"]

#: The metadata file of a DCP directory.
DCP_METADATA = ".metadata"


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` file names, as ``pickletools`` shows in the files that
    ``torch.distributed.checkpoint.save`` and megatron-core's torch_dist writer (torch 2.13, megatron-core
    0.16) write: DCP's metadata dataclasses and enums, ``torch.Size``, dtypes, layouts (pickled through
    ``torch.serialization._get_layout``, here a plain name lookup), ``pathlib.PosixPath`` (``checkpoint_id``)
    and, from megatron-core, the save plans it keeps for reuse (``all_local_plans``). Each builds plain data
    and runs nothing of the file's choosing."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: dict[tuple[str, str], Any] = {}
    for module, names in (
        (
            metadata,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ),
        ),
        (filesystem, ("_StorageInfo", "_StoragePrefix")),
        (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
    ):
        for name in names:
            allowed[(module.__name__, name)] = getattr(module, name)
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    allowed.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = layouts.__getitem__
    allowed[("collections", "OrderedDict")] = OrderedDict
    allowed[("pathlib", "PosixPath")] = PosixPath
    return allowed


def read_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, unpickled without running any of it.

    What ``FileSystemReader.read_metadata`` returns (less the ``load_id`` it stamps on), but only DCP's own
    classes are built (:func:`_metadata_globals`); anything else is refused before it is looked up.

    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError: the file names another global (a crafted file: the message names the file and
            the global; nothing was run).
        UnsupportedTypeError: (a ``TypeError``) the pickle holds something other than a ``Metadata``.
        Exception: what ``pickle`` raises on a damaged file (:class:`~.dcp.DcpCheckpoint` describes it).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    md = safe_pickle_load(
        path,
        _metadata_globals(),
        "A torch.distributed.checkpoint metadata file holds only DCP's own records; this one was not written "
        "by a DCP writer, and nothing in it was run: do not load it with torch either (it would run)",
    )
    if not isinstance(md, Metadata):
        raise UnsupportedTypeError(f"the pickle holds {type(md).__name__}, not DCP Metadata")
    return md


def is_megatron_dcp(root: Path) -> bool:
    """Whether a DCP directory is Megatron's torch_dist (its ``metadata.json`` says so)."""
    meta = root / "metadata.json"
    if not meta.is_file():
        return False
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{meta}: not valid JSON ({exc})") from None
    return isinstance(data, dict) and data.get("sharded_backend") == "torch_dist"


def megatron_args(root: Path) -> Any:
    """The ``args`` (a ``Namespace``) in a torch_dist directory's ``common.pt``, or ``None``."""
    common = root / "common.pt"
    if not common.is_file():
        return None
    obj = safe_torch_load(common)
    return obj.get("args") if isinstance(obj, Mapping) else None
