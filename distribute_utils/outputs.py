"""Internal. Outputs of the command line: never mix two checkpoints, never delete what a command did not write.

A command that writes files calls :func:`prepare_output` before anything is written, with the exact
paths it will write (for a consolidation: :func:`~.consolidate.writers.output_paths`) and the naming
scheme they belong to. The output's parent must exist (a typo is not silently created). Then:

* a file of those paths that already exists is refused, named, unless the user passes ``--overwrite``:
  then the new file replaces it, atomically, once complete (the writers rename into place); nothing else
  is ever removed, whatever its name;
* a file of the same naming scheme that the command would *not* write (``model-00001-of-00003.safetensors``
  of an earlier split beside a new ``model.safetensors``) is always refused, named: loaders would read it
  with (or instead of) the new files, and it is not the command's to delete;
* files of other names (``llama.safetensors``, ``config.json``, notes) are left alone and do not matter.

:attr:`OutputTarget.replaced` lists the files that will be replaced (the report names them);
:meth:`OutputTarget.abandon` removes the directory after a failure only if the command created it and it
is still empty.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OutputError

__all__ = ["OutputError", "OutputTarget", "check_output_place", "prepare_output"]


@dataclass
class OutputTarget:
    """Where a command writes, and what was there before.

    Attributes:
        directory: the output directory.
        created: whether the command creates it (it did not exist).
        files: the paths the command writes.
        replaced: those of ``files`` that existed before (``--overwrite``), replaced when the run completes.
    """

    directory: Path
    created: bool
    files: list[Path] = field(default_factory=list)
    replaced: list[Path] = field(default_factory=list)
    started_ns: int = field(default_factory=time.time_ns)

    def written_since(self) -> bool:
        """Whether any of :attr:`files` was published since :func:`prepare_output`."""
        for p in self.files:
            with contextlib.suppress(OSError):
                if p.stat().st_mtime_ns >= self.started_ns:
                    return True
        return False

    def abandon(self) -> None:
        """After a failed run: removes the directory if this command created it and it is empty."""
        if self.created:
            with contextlib.suppress(OSError):  # not empty (someone else's files) or already gone
                self.directory.rmdir()


def _names(paths: Sequence[Path]) -> str:
    return ", ".join(p.name for p in paths)


def check_output_place(
    directory: str | os.PathLike[str], inside: str | os.PathLike[str] | None = None
) -> None:
    """Whether files can be written in output ``directory``, by looking only (no torch, nothing made):
    its parent exists and is a directory, the directory (or, while it does not exist, its parent) is a
    writable directory on a filesystem that holds files, and it is not inside ``inside`` (the input).

    Raises:
        OutputError: naming the path and what is wrong with it."""
    directory = Path(directory)
    parent = directory.absolute().parent
    if not parent.exists():
        raise OutputError(
            f"the parent of output '{directory}' ('{parent}') does not exist; create it first "
            "(it is not created for you, in case of a typo)"
        )
    if not parent.is_dir():
        raise OutputError(f"the parent of output '{directory}' ('{parent}') is a file, not a directory")
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"output '{directory}' exists and is not a directory")
    if inside is not None:
        source = Path(inside).resolve()
        if directory.resolve() == source or source in directory.resolve().parents:
            raise OutputError(
                f"output '{directory}' is inside the input checkpoint '{inside}': write it elsewhere "
                "(files added among the shards change the checkpoint for every tool that reads it)"
            )
    where = directory if directory.exists() else parent
    try:
        st = os.statvfs(where)
    except OSError as exc:
        raise OutputError(f"output '{directory}': cannot look at '{where}': {exc.strerror or exc}") from None
    if st.f_flag & os.ST_RDONLY:
        raise OutputError(f"output '{directory}': '{where}' is on a read-only filesystem")
    if st.f_blocks == 0:
        raise OutputError(
            f"output '{directory}': '{where}' is on a filesystem that holds no files (such as /proc or /sys)"
        )
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"output '{directory}': '{where}' is not writable for this user")


def prepare_output(
    path: str | os.PathLike[str],
    overwrite: bool,
    files: Sequence[str | os.PathLike[str]],
    scheme: str | None = None,
    inside: str | os.PathLike[str] | None = None,
) -> OutputTarget:
    """Checks an output before anything is written (see the module docstring); creates nothing.

    Args:
        path: the output as the user gave it (a directory, or a file path), for the messages.
        overwrite: replace those of ``files`` that exist.
        files: every path the command will write, all in one directory.
        scheme: a regular expression (full match) for names of the same checkpoint naming scheme, under any
            split; existing files it matches that are not in ``files`` are refused. ``None``: none.
        inside: the input, which the output must not be inside (see :func:`check_output_place`).

    Raises:
        OutputError: the place cannot take files (:func:`check_output_place`), files of the scheme would
            be left beside the new ones, or ``files`` exist and ``overwrite`` is false (each named).
    """
    paths = [Path(f) for f in files]
    directory = paths[0].parent if paths else Path(path)
    if any(p.parent != directory for p in paths):
        raise OutputError(f"prepare_output: the files must be in one directory, got {_names(paths)}")
    check_output_place(directory, inside)
    existing = sorted(directory.iterdir()) if directory.exists() else []
    ours = set(paths)
    in_the_way = [p for p in existing if p in ours and not p.is_file()]
    if in_the_way:
        raise OutputError(f"output '{path}': {_names(in_the_way)} exists and is not a file")
    pattern = re.compile(scheme) if scheme else None
    stale = [p for p in existing if p not in ours and pattern is not None and pattern.fullmatch(p.name)]
    if stale:
        raise OutputError(
            f"output '{directory}' holds {_names(stale)}: files of the same naming scheme that this run would "
            f"not replace (it writes {_names(paths)}); loaders would read them with or instead of the new "
            "files, and they are not deleted for you: remove them yourself, or choose another output"
        )
    clash = [p for p in existing if p in ours]
    if clash and not overwrite:
        raise OutputError(
            f"output '{path}' already has {_names(clash)}, which this run would replace; pass --overwrite to "
            "replace exactly these (nothing else is removed), or choose another output"
        )
    return OutputTarget(directory, not directory.exists(), paths, clash)
