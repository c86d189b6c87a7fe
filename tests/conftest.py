"""Shared fixtures: long-lived pools of real ranks, and a leak check on /dev/shm."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distribute_utils import host_dir

from harness import MEGATRON_SAVES, SCRIPTS, RankPool, shm_entries


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


@pytest.fixture(scope="session")
def megatron_save(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``megatron_save(name)``: the directory of the real megatron-core save ``name`` of
    :data:`harness.MEGATRON_SAVES` (``legacy``, ``torch_dist``, ``truth.safetensors``, ``logits.pt``), written
    on first use and shared by every test of the session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            flags = [f"--{k}={v}" for k, v in MEGATRON_SAVES[name].items()]
            proc = subprocess.run(
                [sys.executable, str(SCRIPTS / "megatron_checkpoints.py"), str(out), *flags],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[name] = out
        return cache[name]

    return get
