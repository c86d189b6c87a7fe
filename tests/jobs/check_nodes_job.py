"""torchrun job for tests/test_simulate_nodes.py: checks what simulated nodes share and what not.

Every rank reports its hostname, the device/inode of /dev/shm and whether a marker file made in
/dev/shm by local rank 0 of node 0 is visible; ranks exchange files through ``DU_WORKSPACE``
(exact contents, distinct sizes). Rank 0 prints one ``SUMMARY {json}`` line. Exits 1 on any
mismatch, so the simulation's exit code alone tells whether the nodes behave like separate hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist


def _payload(token: str, rank: int) -> bytes:
    """What rank ``rank`` writes: different content and size per rank."""
    return (f"token={token} rank={rank}\n" * (rank + 1)).encode()


def _expected_errors(infos: list[dict[str, object]], nodes: int, nproc: int) -> list[str]:
    """Everything that differs from separate hosts sharing one workspace."""
    errors: list[str] = []
    if len(infos) != nodes * nproc:
        errors.append(f"world size {len(infos)} != {nodes} x {nproc}")
    by_node: dict[int, list[dict[str, object]]] = {}
    for info in infos:
        by_node.setdefault(int(info["node"]), []).append(info)  # type: ignore[call-overload]
        if info["sim_node"] != info["node"]:
            errors.append(f"rank {info['rank']}: DU_SIM_NODE {info['sim_node']} != GROUP_RANK {info['node']}")
        if info["host"] != f"simnode{info['node']}":
            errors.append(f"rank {info['rank']}: hostname {info['host']!r} on node {info['node']}")
        if info["marker_visible"] != (info["node"] == 0):
            errors.append(
                f"rank {info['rank']} on node {info['node']}: marker visible={info['marker_visible']}"
            )
        errors.extend(f"rank {info['rank']}: {e}" for e in info["workspace_errors"])  # type: ignore[attr-defined]
    for node, members in by_node.items():
        if len({m["host"] for m in members}) != 1:
            errors.append(f"node {node}: hostnames differ within the node")
        if len({(m["shm_dev"], m["shm_ino"]) for m in members}) != 1:
            errors.append(f"node {node}: /dev/shm differs within the node")
    firsts = [members[0] for members in by_node.values()]
    if len({m["host"] for m in firsts}) != len(firsts):
        errors.append("two nodes share a hostname")
    if len({m["shm_dev"] for m in firsts}) != len(firsts):
        errors.append("two nodes share a /dev/shm")
    return errors


def main(argv: list[str] | None = None) -> int:
    """Run the checks; returns the exit code."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--token", required=True, help="unique per run: names the marker and files")
    parser.add_argument("--expect-nodes", type=int, required=True)
    parser.add_argument("--expect-nproc", type=int, required=True)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    marker = Path(f"/dev/shm/du-sim-check-{args.token}")
    if node == 0 and local_rank == 0:
        marker.write_bytes(b"node0")
    workspace = os.environ.get("DU_WORKSPACE")
    mine = Path(workspace, f"{args.token}-rank{rank}.txt") if workspace else None
    if mine is not None:
        with open(mine, "wb") as fh:
            fh.write(_payload(args.token, rank))
            fh.flush()
            os.fsync(fh.fileno())
    dist.barrier()

    ws_errors: list[str] = []
    if workspace:
        for peer in range(world):
            path = Path(workspace, f"{args.token}-rank{peer}.txt")
            try:
                got = path.read_bytes()
            except OSError as exc:
                ws_errors.append(f"cannot read {path.name}: {exc}")
                continue
            if got != _payload(args.token, peer):
                ws_errors.append(f"{path.name}: {len(got)} bytes, not the expected contents")
    shm = os.stat("/dev/shm")
    info: dict[str, object] = {
        "rank": rank,
        "node": node,
        "local_rank": local_rank,
        "sim_node": int(os.environ.get("DU_SIM_NODE", "-1")),
        "host": socket.gethostname(),
        "shm_dev": shm.st_dev,
        "shm_ino": shm.st_ino,
        "marker_visible": marker.exists(),
        "workspace": workspace,
        "workspace_errors": ws_errors,
    }
    infos: list[dict[str, object]] = [{} for _ in range(world)]
    dist.all_gather_object(infos, info)
    errors = _expected_errors(infos, args.expect_nodes, args.expect_nproc)

    dist.barrier()  # everyone has read everything: clean up
    if mine is not None:
        mine.unlink()
    if node == 0 and local_rank == 0:
        marker.unlink()
    dist.barrier()
    if rank == 0:
        print("SUMMARY " + json.dumps({"world": world, "infos": infos, "errors": errors}), flush=True)
    for error in errors:
        print(f"rank {rank}: MISMATCH {error}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
