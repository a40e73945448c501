"""Many nodes, one order: a `{node}` tier path gives each node its own L2, and a real gloo job of
4 ranks as 2 nodes reads every sample exactly once per epoch, each node fetching only its share.

Each node reaches S3 through its own proxy (its own client, as a node is in a cluster), so the
bytes each proxy counts are that node's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.loader.topology import WorldPosition, node_index
from tierflow.storage.remote import upload_dataset
from tierflow.testing import LoopbackProxy
from tierflow.tiers import TierConfig

BATCH = 16
PARTITIONS = 4


def test_node_placeholder_becomes_the_node_index(tmp_path):
    config = TierConfig.parse(f"L2={tmp_path}/tf-{{node}}:1GB:auto:at_rest")
    assert config.for_node(3).path == f"{tmp_path}/tf-3"
    assert config.build(node=1).root == Path(f"{tmp_path}/tf-1")
    with pytest.raises(ValueError, match="no node index"):
        config.build()
    plain = TierConfig("L2", str(tmp_path / "l2"), 1 << 20)
    assert plain.for_node(None) is plain


def test_node_index_from_the_launchers_variables():
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2"}
    assert node_index(torchrun) == 2 == WorldPosition.from_env(torchrun).node
    assert node_index({"NODE_RANK": "7"}) == 7  # a per-node tool outside the job's group
    assert node_index({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == 1
    with pytest.raises(ValueError, match="NODE_RANK=0 disagrees"):
        WorldPosition.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0"})


RANK_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
import tierflow


def main():
    url, endpoint, tier, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo")
    loader = tierflow.open_loader(url, batch_size=BATCH, partitions=PARTITIONS, tiers=[tier], endpoint_url=endpoint)
    ids, epochs = [], []
    for step, _ in enumerate(loader):
        ids.append(loader.last_meta.sample_ids.tolist())
        epochs.append(loader.last_meta.epochs.tolist())
        if step + 1 == steps:
            break
    loader.close()
    local = torch.tensor([ids, epochs], dtype=torch.int64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump([g.tolist() for g in gathered], f)


if __name__ == "__main__":
    main()
'''.replace("BATCH", str(BATCH)).replace("PARTITIONS", str(PARTITIONS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_read_once_each_node_its_share_cold(tmp_path, s3_server, s3_bucket):
    rng = np.random.default_rng(11)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(12000):
            n = int(rng.integers(20, 200))
            f.write(json.dumps({"id": i, "text": "".join(chr(97 + c) for c in rng.integers(0, 26, n))}) + "\n")
    local = tmp_path / "ds"
    tierflow.pack([tmp_path / "docs.jsonl"], local, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(local, url, endpoint_url=s3_server.endpoint_url)
    manifest = tierflow.open_dataset(local).manifest
    n, dataset_bytes = manifest.num_samples, sum(s.bytes for s in manifest.shards)
    nodes, per_node = 2, 2
    steps = 3 * n // (2 * BATCH * nodes * per_node)  # into epoch 1: every partition finished epoch 0
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out.json"
    tier = f"L2={tmp_path}/nvme-{{node}}/tf:1GB:auto:at_rest"
    env = {**os.environ, **s3_server.endpoint.env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(nodes * per_node), "LOCAL_WORLD_SIZE": str(per_node), "OMP_NUM_THREADS": "1"}
    env.pop("AWS_ENDPOINT_URL", None)
    with LoopbackProxy(s3_server.endpoint_url) as proxy0, LoopbackProxy(s3_server.endpoint_url) as proxy1:
        proxies = [proxy0, proxy1]
        procs = []
        for rank in range(nodes * per_node):
            node = rank // per_node
            procs.append(subprocess.Popen(
                [sys.executable, str(script), url, proxies[node].url, tier, str(out), str(steps)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "GROUP_RANK": str(node)}))
        try:
            for p in procs:
                assert p.wait(timeout=240) == 0
        finally:
            for p in procs:
                p.kill()
        traffic = [p.traffic() for p in proxies]
    gathered = json.loads(out.read_text())
    pairs = [(i, e) for rank in gathered for ids, eps in zip(rank[0], rank[1]) for i, e in zip(ids, eps)]
    assert len(pairs) == len(set(pairs))  # never a sample twice in an epoch, across the job
    assert sorted(i for i, e in pairs if e == 0) == list(range(n))  # epoch 0: every sample once
    for node in range(nodes):
        fetched = {s.name for s in manifest.shards if traffic[node].response_bytes("GET", key=s.name)}
        for info in manifest.shards:  # at most one fetch of a shard per node, whichever rank or stager asked
            assert traffic[node].response_bytes("GET", key=info.name) <= info.bytes, (node, info.name)
        got = sum(traffic[node].response_bytes("GET", key=s.name) for s in manifest.shards)
        print(f"node {node}: {len(fetched)}/{len(manifest.shards)} shards, {got:,} B of {dataset_bytes:,} B "
              f"({got / (dataset_bytes / nodes):.2f} x dataset/N)")
        assert got <= 1.25 * dataset_bytes / nodes, (node, got, dataset_bytes)  # cold: its share, not all
        assert fetched, f"node {node} fetched nothing"
        assert any((tmp_path / f"nvme-{node}" / "tf").rglob("*")), f"node {node}'s own L2 is empty"
    assert not (tmp_path / "nvme-{node}").exists()
    shards0 = {s.name for s in manifest.shards if traffic[0].response_bytes("GET", key=s.name)}
    shards1 = {s.name for s in manifest.shards if traffic[1].response_bytes("GET", key=s.name)}
    assert not shards0 & shards1 and shards0 | shards1 == {s.name for s in manifest.shards}  # whole partitions
