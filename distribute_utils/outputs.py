"""Output directories of the command line: never mix two checkpoints, never delete what a command did not write.

:func:`prepare_output` is called before anything is written: the output's parent must exist (a typo is
not silently created), and a directory that already holds files is refused unless the user passes
``--overwrite``. With ``--overwrite`` the new files replace same-named old ones atomically when complete
(the writers rename into place), and :meth:`OutputTarget.finish` then removes the *checkpoint* files of
the previous run that the new one did not rewrite (a stale ``model.safetensors`` beside new
``model-0000k-of-0000N`` files is what Hugging Face loaders would pick); other files are left alone.
:meth:`OutputTarget.abandon` removes the directory after a failure only if the command created it and it
is still empty.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DistributeError

__all__ = ["CHECKPOINT_PATTERNS", "OutputError", "OutputTarget", "prepare_output"]

#: Names of the files a consolidation writes (what ``--overwrite`` may replace).
CHECKPOINT_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
)
_FILE_SUFFIXES = (".safetensors", ".bin")


class OutputError(DistributeError, ValueError):
    """The output path cannot be used as asked (missing parent, not empty, not a directory)."""


@dataclass
class OutputTarget:
    """Where a command writes, and what was there before.

    Attributes:
        directory: the output directory.
        created: whether the command creates it (it did not exist).
        previous: checkpoint files found there before (``--overwrite`` only).
    """

    directory: Path
    created: bool
    previous: list[Path] = field(default_factory=list)
    started_ns: int = field(default_factory=time.time_ns)

    def written_since(self) -> bool:
        """Whether checkpoint files were published in the directory since :func:`prepare_output`."""
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return False
        return any(_is_checkpoint_file(p) and p.stat().st_mtime_ns >= self.started_ns for p in entries)

    def finish(self, written: Iterable[str | os.PathLike[str]]) -> list[Path]:
        """After a complete run: removes the previous checkpoint files that were not rewritten; returns them."""
        keep = {Path(p).resolve() for p in written}
        stale = [p for p in self.previous if p.resolve() not in keep and p.exists()]
        for p in stale:
            p.unlink()
        return stale

    def abandon(self) -> None:
        """After a failed run: removes the directory if this command created it and it is empty."""
        if self.created:
            with contextlib.suppress(OSError):  # not empty (someone else's files) or already gone
                self.directory.rmdir()


def _is_checkpoint_file(path: Path) -> bool:
    return path.is_file() and any(fnmatch.fnmatch(path.name, pat) for pat in CHECKPOINT_PATTERNS)


def prepare_output(path: str | os.PathLike[str], overwrite: bool = False) -> OutputTarget:
    """Checks an output path before anything is written (see the module docstring).

    Args:
        path: an output directory, or a file path ending in ``.safetensors`` / ``.bin``.
        overwrite: allow a directory that already holds files (its checkpoint files are replaced).

    Raises:
        OutputError: the parent does not exist, the path is not a directory, or it is not empty and
            ``overwrite`` is false (the message names what is there and how to proceed).
    """
    target = Path(path)
    directory = target.parent if target.suffix in _FILE_SUFFIXES else target
    if not directory.parent.is_dir():
        raise OutputError(
            f"the parent of output '{directory}' ('{directory.parent}') does not exist; create it first "
            "(it is not created for you, in case of a typo)"
        )
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"output '{directory}' exists and is not a directory")
    existing = sorted(directory.iterdir()) if directory.exists() else []
    clash = [target] if directory is not target and target.exists() else existing
    if clash and not overwrite:
        names = ", ".join(p.name for p in clash[:3]) + (", ..." if len(clash) > 3 else "")
        raise OutputError(
            f"output '{target}' is not empty ({len(clash)} entr{'y' if len(clash) == 1 else 'ies'}: {names}); "
            "give a new or empty directory, or --overwrite to replace the checkpoint files in it"
        )
    previous = [p for p in existing if _is_checkpoint_file(p)] if overwrite else []
    return OutputTarget(directory, not directory.exists(), previous)
