"""Internal. What is wrong with a checkpoint file a reader failed on, judged from its bytes (empty, truncated, not
the format expected, corrupt), for errors that name the file and the fault."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import CheckpointFormatError, one_line

__all__ = ["describe_unreadable", "short_cause", "unreadable_file"]

_ZIP_START = b"PK\x03\x04"  # torch.save (1.6+) writes a zip archive
_ZIP_END = b"PK\x05\x06"  # its end-of-central-directory record, within the last 64 KiB + 22 bytes
_ZIP_TAIL = 65536 + 22
_SAFETENSORS_HEADER_MAX = 100 << 20  # what safetensors itself accepts


def short_cause(exc: BaseException | str) -> str:
    """The informative part of a reader's message (torch's advice about ``weights_only`` left out), one
    line of at most 160 characters, to quote in an error about the file."""
    text = exc if isinstance(exc, str) else str(exc) or type(exc).__name__
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n", 1)[0]
    elif isinstance(exc, BaseException) and not isinstance(exc, (OSError, RuntimeError, ValueError)):
        text = f"{type(exc).__name__}: {text}"  # KeyError: 101, EOFError from a pickle reader
    text = one_line(text).split(". ", 1)[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _safetensors_end(head: bytes) -> int:
    """The file size a safetensors header describes (8 + header + data), or 0 when it cannot tell."""
    (n,) = struct.unpack("<Q", head[:8])
    if n > _SAFETENSORS_HEADER_MAX:
        return 0
    if len(head) < 8 + n:
        return 8 + n  # the header itself is cut
    try:
        header = json.loads(head[8 : 8 + n])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return 0
    return 8 + n + max(ends, default=0) if all(isinstance(e, int) for e in ends) else 0


def describe_unreadable(
    path: str | os.PathLike[str], cause: BaseException | str, what: str = "torch.save file"
) -> str:
    """What is wrong with a checkpoint file a reader failed on, judged from its bytes: ``"is empty (0
    bytes)"``, ``"is truncated (...)"``, ``"is not a torch.save file (it begins with ...)"``, ...

    ``cause`` is the reader's exception (a short form of it is quoted where the bytes do not explain it);
    ``what`` names the format expected. Never advises loading with ``weights_only=False``.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(16)
            f.seek(max(0, size - _ZIP_TAIL))
            tail = f.read()
            if what == "safetensors file" and size >= 8:  # the header, to compare the size it describes
                f.seek(0)
                head = f.read(8 + min(struct.unpack("<Q", head[:8])[0], _SAFETENSORS_HEADER_MAX))
    except OSError as exc:
        return f"cannot be read: {one_line(exc)}"
    if size == 0:
        problem = "is empty (0 bytes)"
    elif head.startswith(_ZIP_START) and _ZIP_END not in tail:
        problem = f"is truncated ({size} bytes: a zip archive without its end record)"
    elif head.startswith(_ZIP_START):
        problem = f"is corrupt (a zip archive of {size} bytes that cannot be read: {short_cause(cause)})"
    elif size < 22 and _ZIP_START.startswith(head):
        problem = f"is truncated ({size} byte{'' if size == 1 else 's'})"
    elif what == "safetensors file" and size < 8:
        problem = (
            f"is not a valid safetensors file: {size} bytes, truncated or corrupt ({short_cause(cause)})"
        )
    elif what == "safetensors file" and _safetensors_end(head) > size:
        problem = (
            f"is not a valid safetensors file: truncated ({size} of the {_safetensors_end(head)} bytes its "
            f"header describes; {short_cause(cause)})"
        )
    elif what == "safetensors file":
        problem = f"is not a valid safetensors file: corrupt ({short_cause(cause)})"
    elif head.startswith(b"\x80"):  # a pickle: torch.save's pre-1.6 format, or DCP's .metadata
        kind = "a pre-1.6 torch.save file" if what == "torch.save file" else f"a {what}"
        problem = f"is truncated or corrupt ({kind} that cannot be read: {short_cause(cause)})"
    else:
        problem = f"is not a {what} (it begins with {head!r})"
    return problem


def unreadable_file(
    path: str | os.PathLike[str], cause: BaseException | str, what: str = "torch.save file"
) -> CheckpointFormatError:
    """The error for a checkpoint file a reader failed on: names it and says what is wrong with it (see
    :func:`describe_unreadable`)."""
    return CheckpointFormatError(
        f"checkpoint file '{path}' {describe_unreadable(path, cause, what)}; copy or save it again "
        "(it cannot be consolidated as it is)"
    )
