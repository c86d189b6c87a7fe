"""Every exception class of the package lives in ``distribute_utils.errors``, derives from
``DistributeError`` and from the built-in it resembles, and survives pickling (errors cross process
boundaries: a spawned rank's error is re-raised in its parent)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import distribute_utils
from distribute_utils import errors, interrupts
from distribute_utils.caches import Recent

BUILTINS = (ValueError, TypeError, OSError, TimeoutError, RuntimeError, KeyError, IndexError)


def _package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in the package (by its defining module), every module imported."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(distribute_utils.__path__, "distribute_utils."):
        if info.name.endswith(".__main__"):  # (runs the command line)
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("distribute_utils")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_public_exception_is_defined_in_errors_and_derives_from_a_builtin() -> None:
    found = _package_exceptions()
    assert errors.DistributeError in found.values()
    # Private classes (a leading underscore) are control flow caught inside their module; Interrupted is a
    # BaseException on purpose, like KeyboardInterrupt (``except Exception`` must not swallow a signal).
    public = {
        name: cls
        for name, cls in found.items()
        if not cls.__name__.startswith("_") and cls is not interrupts.Interrupted
    }
    elsewhere = sorted(name for name, cls in public.items() if cls.__module__ != "distribute_utils.errors")
    assert not elsewhere, f"exception classes defined outside distribute_utils/errors.py: {elsewhere}"
    assert not issubclass(interrupts.Interrupted, Exception)
    for name, cls in public.items():
        if cls is errors.DistributeError:
            continue
        assert issubclass(cls, errors.DistributeError), name
        assert issubclass(cls, BUILTINS), f"{name} derives from no built-in a caller would catch"
    assert set(errors.__all__) >= {cls.__name__ for cls in public.values()}


def _sample(cls: type[BaseException]) -> BaseException:
    if cls is errors.PeerLostError:
        return cls("ranks [2] did not arrive", [2])
    if cls is errors.ConsolidationError:
        return cls("shapes differ", 3, "MergeError")
    return cls(f"a {cls.__name__}")


@pytest.mark.parametrize(
    "cls", [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, BaseException)]
)
def test_each_error_survives_pickling(cls: type[BaseException]) -> None:
    error = _sample(cls)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and str(again) == str(error) and again.args == error.args
    if isinstance(error, errors.PeerLostError):
        assert isinstance(again, errors.PeerLostError) and again.missing == (2,)
    if isinstance(error, errors.ConsolidationError):
        assert isinstance(again, errors.ConsolidationError) and (again.rank, again.kind) == (3, "MergeError")


def test_old_module_names_still_import() -> None:
    """Code and docs import errors from the modules that raise them: those names are the same classes."""
    from distribute_utils.consolidate.failures import ConsolidationError
    from distribute_utils.consolidate.layouts import LayoutError
    from distribute_utils.consolidate.rules import MergeError, RuleSyntaxError
    from distribute_utils.consolidate.safe_load import UnsafeCheckpointError
    from distribute_utils.consolidate.writers import CheckpointFormatError
    from distribute_utils.mailbox import MailboxError
    from distribute_utils.outputs import OutputError

    assert (ConsolidationError, LayoutError, MergeError, RuleSyntaxError) == (
        errors.ConsolidationError,
        errors.LayoutError,
        errors.MergeError,
        errors.RuleSyntaxError,
    )
    assert (UnsafeCheckpointError, CheckpointFormatError, MailboxError, OutputError) == (
        errors.UnsafeCheckpointError,
        errors.CheckpointFormatError,
        errors.MailboxError,
        errors.OutputError,
    )
    assert issubclass(MailboxError, OSError) and issubclass(MailboxError, errors.DistributeError)


def test_bad_input_errors_keep_their_builtin() -> None:
    """Callers' ``except ValueError`` / ``except TypeError`` keep catching what plain built-ins were."""
    from distribute_utils import sync, wire

    with pytest.raises(ValueError, match="timeout must be a positive number") as bad:
        sync.resolve_timeout(-1)
    assert isinstance(bad.value, errors.ArgumentError)
    with pytest.raises(TypeError, match="cannot encode a value of type") as unsupported:
        wire.encode({"f": object()})
    assert isinstance(unsupported.value, errors.UnsupportedTypeError)
    from distribute_utils.consolidate.writers import parse_size
    from distribute_utils.mesh_layout import MeshLayout

    with pytest.raises(KeyError) as unknown:
        MeshLayout((2, 2), axis_names=("dp", "tp")).axis_index("ep")
    assert isinstance(unknown.value, errors.UnknownNameError)
    assert str(unknown.value) == "unknown axis name 'ep'; valid names: ['dp', 'tp']", (
        "not KeyError's quoted repr"
    )
    with pytest.raises(ValueError, match="unknown unit 'XB'; valid units") as size:
        parse_size("5XB")
    assert isinstance(size.value, errors.ArgumentError)


def test_recent_is_bounded() -> None:
    cache: Recent[int, int] = Recent(3)
    for i in range(10):
        assert cache.make(i, lambda i=i: i * i) == i * i
        assert len(cache) <= 3
    assert cache.make(9, lambda: -1) == 81, "a kept value is not made again"


# A built-in raised as itself would escape ``except DistributeError``. The only ones left are these
# (path under distribute_utils/, enclosing function, class), each for its reason:
_PLAIN_RAISES_ALLOWED = {
    # Re-raise of a failed write with the tensor named: OSError(errno, ...) builds the errno's own subclass
    # (PermissionError, ...) and keeps the errno, as the OSError it replaces had them.
    ("consolidate/job.py", "write_item", "OSError"),
    # fallocate(2) failed: OSError(errno, strerror) is the errno's own subclass, as the libc call's would be.
    ("transports/files.py", "reserve_space", "OSError"),
    # The Mapping protocol: __getitem__ of a missing key raises KeyError itself.
    ("sync.py", "_Every.__getitem__", "KeyError"),
}
_PLAIN = ("ValueError", "TypeError", "RuntimeError", "OSError", "TimeoutError", "KeyError", "IndexError")


def _plain_raises() -> set[tuple[str, str, str]]:
    """``(path, function, class)`` of every ``raise ValueError(...)`` (or another built-in of ``_PLAIN``)."""
    root = Path(distribute_utils.__file__).parent
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, path: str, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, path, (*scope, child.name))
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in _PLAIN:
                    found.add((path, ".".join(scope) or "<module>", exc.id))
            visit(child, path, scope)

    for file in sorted(root.rglob("*.py")):
        visit(ast.parse(file.read_text(), str(file)), file.relative_to(root).as_posix(), ())
    return found


def test_no_plain_builtin_is_raised_on_purpose() -> None:
    """Every error raised on purpose is a ``DistributeError`` (and the built-in it resembles)."""
    found = _plain_raises()
    allowed = _PLAIN_RAISES_ALLOWED
    plain = sorted(found - allowed)
    assert not plain, f"raise an errors.py class (derived from the same built-in) instead: {plain}"
    stale = sorted(allowed - found)
    assert not stale, f"rows of the allow-lists whose raise is gone: delete them: {stale}"


# -- every error of ours, raised on one rank of a gather, is raised as the same type on the others ----
OURS = sorted(
    (c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.DistributeError)),
    key=lambda c: c.__name__,
)


def _each_error_raised_on_rank_2(names: list[str]) -> dict[str, tuple[str, str]]:
    """For each error class named, one gather of the world in which rank 2 raises it (a fault at the
    carriers' "published" point, once its payload is out): what each rank raised."""
    import torch
    import torch.distributed as dist

    from distribute_utils import get_tensors_parallel
    from distribute_utils.transports import carriers

    rank = dist.get_rank()
    raised: dict[str, tuple[str, str]] = {}
    for name in names:
        cls = getattr(errors, name)

        def planted(point: str, sender: int, carrier: object, receipt: object, cls: type = cls) -> None:
            if point == "published":
                raise _sample(cls)

        # Back to back, no barrier: rank 2 fails at once in each call, and runs ahead of the others until
        # its partners' queues make it wait (before, its claims were dropped: the first rank then took the
        # live rank 2 for exited, or, when it had gone past its records, the lists for disagreeing).
        kept = carriers.inject(planted if rank == 2 else None)
        try:
            with get_tensors_parallel(torch.full((64,), float(rank)), [0, 1, 2, 3], timeout=60):
                raised[name] = ("no error", "")
        except Exception as exc:
            raised[name] = (type(exc).__name__, str(exc))
        finally:
            carriers.inject(kept)
    return raised


@pytest.fixture(scope="module")
def raised_by_rank(pools: Any) -> list[dict[str, tuple[str, str]]]:
    return pools.get(4).run(_each_error_raised_on_rank_2, [c.__name__ for c in OURS], timeout=240)


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_an_error_raised_on_one_rank_is_raised_as_its_type_on_the_others(
    raised_by_rank: list[dict[str, tuple[str, str]]], cls: type[errors.DistributeError]
) -> None:
    """Rank 2 raises ``cls`` while it sends: the first rank raises ``cls`` naming rank 2, the other
    senders ``cls`` naming the first rank, so one ``except`` serves every rank (before, 7 types were
    rebuilt and the rest came as GatherError: a sender's SpaceError reached the first rank as that)."""
    name, message = cls.__name__, str(_sample(cls))
    assert raised_by_rank[2][name] == (name, message), raised_by_rank[2][name]
    kind, text = raised_by_rank[0][name]
    assert kind == name and text.startswith("rank 2 cannot take part in the gather: ") and message in text
    for rank in (1, 3):
        kind, text = raised_by_rank[rank][name]
        assert kind == name and text.startswith("the first rank (0) failed: ") and message in text, (
            rank,
            text,
        )
