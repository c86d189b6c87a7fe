"""MeshLayout: golden vectors from the reference projects and property checks."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distribute_utils import MeshLayout


def test_colossalai_golden_1_2_2() -> None:
    # ColossalAI mesh (1, 2, 2): TP along axis 2, PP along axis 1.
    layout = MeshLayout((1, 2, 2))
    assert layout.groups_along(2) == [[0, 1], [2, 3]]
    assert layout.groups_along(1) == [[0, 2], [1, 3]]
    assert layout.coordinate(2) == (0, 1, 0)


def test_device_mesh_golden_2_4() -> None:
    layout = MeshLayout((2, 4), ("dp", "tp"))
    assert layout.groups_along("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.group_of(1, "dp") == [1, 5]
    assert layout.groups_along("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_order_golden() -> None:
    layout = MeshLayout.from_order("tp-cp-dp", tp=2, cp=2, dp=2)
    assert layout.groups_along("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups_along("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups_along("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.shape == (2, 2, 2) and layout.axis_names == ("dp", "cp", "tp")


def _megatron_rank_groups(order: list[str], sizes: dict[str, int], token: str) -> list[list[int]]:
    """Independent re-derivation of Megatron's RankGenerator: first name varies fastest."""
    shape = [sizes[n] for n in order]
    world = math.prod(shape)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        rest, coord = rank, []
        for n in shape:
            rest, c = divmod(rest, n)
            coord.append(c)
        key = tuple(c for c, name in zip(coord, order) if name not in token.split("-"))
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


@pytest.mark.parametrize("token", ["tp", "cp", "pp", "dp", "tp-pp", "cp-dp", "tp-cp-pp"])
def test_from_order_matches_megatron_rank_generator(token: str) -> None:
    sizes = {"tp": 2, "cp": 3, "pp": 4, "dp": 5}
    layout = MeshLayout.from_order("tp-cp-pp-dp", **sizes)
    assert sorted(layout.groups_along(token.split("-"))) == _megatron_rank_groups(
        ["tp", "cp", "pp", "dp"], sizes, token
    )


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 5), st.data())
def test_groups_partition_ranks_and_match_coordinates(
    shape: list[int], offset: int, data: st.DataObject
) -> None:
    layout = MeshLayout(shape, rank_offset=offset)
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True))
    groups = layout.groups_along(axes)
    assert sorted(r for g in groups for r in g) == list(layout.ranks)
    for group in groups:
        assert group == sorted(group)
        coords = [layout.coordinate(r) for r in group]
        fixed = [i for i in range(len(shape)) if i not in axes]
        assert len({tuple(c[i] for i in fixed) for c in coords}) == 1
        for r in group:
            assert layout.group_of(r, axes) == group
    for rank in layout.ranks:
        assert layout.rank(layout.coordinate(rank)) == rank


@settings(max_examples=60, deadline=None)
@given(shapes, st.data())
def test_ravel_unravel_match_itertools(shape: list[int], data: st.DataObject) -> None:
    for index, coord in enumerate(itertools.product(*[range(n) for n in shape])):
        assert MeshLayout.ravel(coord, shape) == index
        assert MeshLayout.unravel(index, shape) == coord
    coord = data.draw(st.tuples(*[st.integers(-10, 10) for _ in shape]))
    wrapped = tuple(c % n for c, n in zip(coord, shape))
    clipped = tuple(min(max(c, 0), n - 1) for c, n in zip(coord, shape))
    assert MeshLayout.ravel(coord, shape, "wrap") == MeshLayout.ravel(wrapped, shape)
    assert MeshLayout.ravel(coord, shape, "clip") == MeshLayout.ravel(clipped, shape)
    assert all(isinstance(c, int) for c in MeshLayout.unravel(0, shape))


def test_indices_at_axis_like_colossalai() -> None:
    layout = MeshLayout((2, 4), ("pp", "tp"))
    assert layout.groups_along("tp", indices_at_axis=[0, 2]) == [[0, 2], [4, 6]]
    assert layout.groups_along(["pp", "tp"], indices_at_axis=[[1], [1, 3]]) == [[5, 7]]
    assert layout.group_of(6, "tp", [0, 2]) == [4, 6]
    with pytest.raises(ValueError, match="not among indices_at_axis"):
        layout.group_of(5, "tp", [0, 2])
    with pytest.raises(ValueError, match=r"in 0\.\.3"):
        layout.groups_along("tp", indices_at_axis=[0, 4])


def test_errors_say_what_is_valid() -> None:
    with pytest.raises(KeyError, match=r"unknown axis name 'ep'; valid names: \['dp', 'tp'\]"):
        MeshLayout((2, 2), ("dp", "tp")).groups_along("ep")
    with pytest.raises(ValueError, match="duplicate axis names"):
        MeshLayout((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="one name per axis"):
        MeshLayout((2, 2), ("dp",))
    with pytest.raises(ValueError, match="positive ints"):
        MeshLayout((2, 0))
    with pytest.raises(ValueError, match=r"out of range on axis 1: 5 not in 0\.\.1"):
        MeshLayout.ravel((0, 5), (2, 2))
    with pytest.raises(ValueError, match="unknown ravel mode"):
        MeshLayout.ravel((0, 0), (2, 2), mode="bounce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank 9 is not in .*valid ranks: 4\.\.7"):
        MeshLayout((2, 2), rank_offset=4).coordinate(9)
    with pytest.raises(ValueError, match="out of range for a 2-axis mesh"):
        MeshLayout((2, 2)).groups_along(2)
    with pytest.raises(ValueError, match="no size for"):
        MeshLayout.from_order("tp-pp", tp=2)
    with pytest.raises(ValueError, match="same axis twice"):
        MeshLayout((2, 2)).groups_along([0, -2])


def test_rank_offset_applies_to_groups() -> None:
    layout = MeshLayout((2, 2), rank_offset=4)
    assert layout.groups_along(1) == [[4, 5], [6, 7]]
    assert layout.rank((1, 0)) == 6


def test_layout_is_immutable_value() -> None:
    a, b = MeshLayout((2, 3), ("x", "y")), MeshLayout([2, 3], ["x", "y"])
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.foo = 1  # type: ignore[attr-defined]
