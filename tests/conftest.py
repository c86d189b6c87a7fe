"""Shared fixtures: long-lived pools of real ranks, and a leak check on /dev/shm."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from distribute_utils import host_dir

from harness import RankPool, shm_entries


class PoolCache:
    """One live :class:`RankPool` per world size; broken pools are replaced on demand."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}
        self.pids: set[int] = set()

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size)
            self.pids.update(pool.pids)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolCache]:
    cache = PoolCache()
    yield cache
    cache.close()
    # Ranks the tests killed outright (fault injection, a fresh job's teardown) leave their socket files,
    # as any process killed so does: removed as `distribute-utils clean` would (only sockets nothing
    # listens on), so that the suite leaves nothing in /dev/shm.
    host_dir.remove_dead_sockets()


@pytest.fixture
def ranks4(pools: PoolCache) -> RankPool:
    """Four live ranks in one gloo group (shared across tests)."""
    return pools.get(4)


@pytest.fixture
def fresh_job() -> Iterator[Callable[[int], RankPool]]:
    """Start dedicated ranks for one test (fault injection); always reaped afterwards."""
    started: list[RankPool] = []

    def start(world_size: int, env: dict[str, str] | None = None) -> RankPool:
        pool = RankPool(world_size, env)
        started.append(pool)
        return pool

    yield start
    for pool in started:
        pool.close(kill=True)


@pytest.fixture
def no_shm_leak(pools: PoolCache) -> Iterator[None]:
    """Fail the test if the session's ranks leave segments in /dev/shm.

    Only segments of this session's rank processes count: other jobs on the machine may have
    live segments of their own.
    """
    yield
    left = shm_entries(pools.pids)
    assert not left, f"segments left in /dev/shm: {sorted(left)}"
