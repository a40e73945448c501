"""Many nodes, one order: a `{node}` tier path gives each node its own L2, and a real gloo job of
4 ranks as 2 nodes reads every sample exactly once per epoch, each node fetching only its share.

Each node reaches S3 through its own proxy (its own client, as a node is in a cluster), so the
bytes each proxy counts are that node's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.loader.topology import WorldPosition, assign_nodes, job_identity, node_index, placed_by_cache
from tierflow.errors import TopologyError
from tierflow.storage.remote import upload_dataset
from tierflow.testing import LoopbackProxy
from tierflow.tiers import TierConfig
from tierflow.testing.distributed import free_port

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


def test_nodes_take_the_partitions_their_caches_hold_and_cold_caches_keep_the_launchers_order():
    owned = [{0, 1}, {2, 3}, {4, 5}]  # logical node l's shards
    sizes = [10, 10, 10, 10, 10, 10]
    assert assign_nodes([(), (), ()], owned, sizes) == [0, 1, 2]  # cold: as launched
    assert assign_nodes([{4, 5}, {2}, {0, 1, 3}], owned, sizes) == [2, 1, 0]  # a restart in another order
    assert assign_nodes([{4}, {4, 5}, ()], owned, sizes) == [0, 2, 1]  # the larger overlap wins; the rest in order
    assert assign_nodes([{0}, {0}, ()], owned, sizes) == [0, 1, 2]  # a tie goes to the lower node
    assert assign_nodes([{1}, {0, 2}], [{0, 1}, {2, 3}], [1, 1, 5, 5]) == [0, 1]  # by bytes, not by count


def test_every_rank_of_the_job_computes_the_same_placement_from_the_gathered_inventories():
    owned = [{0, 1}, {2, 3}]
    ranks = [WorldPosition(node=r // 2, num_nodes=2, local_rank=r % 2, ranks_per_node=2) for r in range(4)]
    held = [{2, 3}, None, {0}, None]  # one rank of each node gives its node's inventory
    sent = [(w.node, None if h is None else sorted(h)) for w, h in zip(ranks, held)]
    placed = [placed_by_cache(w, h, owned, [1] * 4, lambda _: sent) for w, h in zip(ranks, held)]
    assert [p.node for p in placed] == [1, 1, 0, 0]
    assert [(p.local_rank, p.num_nodes, p.ranks_per_node) for p in placed] == [(r % 2, 2, 2) for r in range(4)]
    assert sorted(p.rank for p in placed) == [0, 1, 2, 3]  # a permutation of the ranks: exactness unchanged


def test_a_jobs_name_is_its_launchers_run_id_and_rendezvous():
    assert job_identity({}) is None
    assert job_identity({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "/10.0.0.1/29500"
    assert job_identity({"TORCHELASTIC_RUN_ID": "r7", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "r7/h/1"


RANK_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
import tierflow
from tierflow.testing.distributed import gathered_stream


def main():
    url, endpoint, tier, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo")
    loader = tierflow.open_loader(url, batch_size=BATCH, partitions=PARTITIONS, tiers=[tier], endpoint_url=endpoint,
                                  endless=True,  # steps past the epoch edge
                                  node_affinity=os.environ.get("AFFINITY", "1") == "1")
    gathered = gathered_stream(loader, steps)
    loader.close()
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


if __name__ == "__main__":
    main()
""".replace("BATCH", str(BATCH)).replace("PARTITIONS", str(PARTITIONS))


NODES, PER_NODE = 2, 2


@pytest.fixture
def lake_on_s3(tmp_path, s3_server, s3_bucket, request):
    rng = np.random.default_rng(11)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(getattr(request, "param", 12000)):
            n = int(rng.integers(20, 200))
            text = (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()  # n random letters
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    local = tmp_path / "ds"
    tierflow.pack([tmp_path / "docs.jsonl"], local, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(local, url, endpoint_url=s3_server.endpoint_url)
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    return tierflow.open_dataset(local).manifest, url


def run_job(
    tmp_path: Path, s3_server, url: str, tier: str, steps: int, reverse: bool = False, affinity: bool = True
) -> tuple[list, list]:
    """One job of NODES x PER_NODE gloo ranks, machine k's ranks reaching S3 through proxy k:
    (every rank's (ids, epochs) per step, each machine's traffic). Machine k is node k of the job,
    or with `reverse` node NODES - 1 - k (a restart onto the nodes in another order), its tier
    directory still its own (the `{node}` of the tier path is the machine's)."""
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        **s3_server.endpoint.env(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(NODES * PER_NODE),
        "LOCAL_WORLD_SIZE": str(PER_NODE),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("AWS_ENDPOINT_URL", None)
    with LoopbackProxy(s3_server.endpoint_url) as proxy0, LoopbackProxy(s3_server.endpoint_url) as proxy1:
        proxies = [proxy0, proxy1]
        procs = []
        for rank in range(NODES * PER_NODE):
            node = rank // PER_NODE
            machine = NODES - 1 - node if reverse else node
            own = tier.replace("{node}", str(machine)) if reverse else tier
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(tmp_path / "rank.py"), url, proxies[machine].url, own, str(out), str(steps)],
                    env={
                        **env,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(rank % PER_NODE),
                        "GROUP_RANK": str(node),
                        "AFFINITY": "1" if affinity else "0",
                    },
                )
            )
        try:
            for p in procs:
                assert p.wait(timeout=240) == 0
        finally:
            for p in procs:
                p.kill()
        traffic = [p.traffic() for p in proxies]
    return json.loads(out.read_text()), traffic


def node_bytes(traffic, manifest) -> list[int]:
    return [sum(t.response_bytes("GET", key=s.name) for s in manifest.shards) for t in traffic]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_read_once_each_node_its_share_cold(tmp_path, s3_server, lake_on_s3):
    manifest, url = lake_on_s3
    n, dataset_bytes = manifest.num_samples, sum(s.bytes for s in manifest.shards)
    steps = 3 * n // (2 * BATCH * NODES * PER_NODE)  # into epoch 1: every partition finished epoch 0
    gathered, traffic = run_job(tmp_path, s3_server, url, f"L2={tmp_path}/nvme-{{node}}/tf:1GB:auto:at_rest", steps)
    pairs = [(i, e) for rank in gathered for ids, eps in zip(rank[0], rank[1]) for i, e in zip(ids, eps)]
    assert len(pairs) == len(set(pairs))  # never a sample twice in an epoch, across the job
    assert sorted(i for i, e in pairs if e == 0) == list(range(n))  # epoch 0: every sample once
    fetched = []
    for node, got in enumerate(node_bytes(traffic, manifest)):
        fetched.append({s.name for s in manifest.shards if traffic[node].response_bytes("GET", key=s.name)})
        for info in manifest.shards:  # at most one fetch of a shard per node, whichever rank or stager asked
            assert traffic[node].response_bytes("GET", key=info.name) <= info.bytes, (node, info.name)
        print(
            f"node {node}: {len(fetched[-1])}/{len(manifest.shards)} shards, {got:,} B of {dataset_bytes:,} B "
            f"({got / (dataset_bytes / NODES):.2f} x dataset/N)"
        )
        assert got <= 1.25 * dataset_bytes / NODES, (node, got, dataset_bytes)  # cold: its share, not all
        assert any((tmp_path / f"nvme-{node}" / "tf").rglob("*")), f"node {node}'s own L2 is empty"
    assert not (tmp_path / "nvme-{node}").exists()
    # whole partitions: the nodes' shards are disjoint and together the dataset
    assert not fetched[0] & fetched[1] and fetched[0] | fetched[1] == {s.name for s in manifest.shards}


@pytest.mark.slow
@pytest.mark.parametrize("lake_on_s3", [48000], indirect=True)  # ~22 shards a node: room for its windows
def test_a_second_job_on_warm_node_caches_fetches_what_they_do_not_hold(tmp_path, s3_server, lake_on_s3):
    manifest, url = lake_on_s3
    n, dataset_bytes = manifest.num_samples, sum(s.bytes for s in manifest.shards)
    fraction = 0.5  # each node's L2 holds half of its share
    capacity = int(fraction * dataset_bytes / NODES)
    tier = f"L2={tmp_path}/nvme-{{node}}/tf:{capacity}:auto:at_rest"
    epoch = n // (BATCH * NODES * PER_NODE)
    run_job(tmp_path, s3_server, url, tier, epoch)  # the first job warms the caches
    gathered, traffic = run_job(tmp_path, s3_server, url, tier, epoch)
    pairs = [(i, e) for rank in gathered for ids, eps in zip(rank[0], rank[1]) for i, e in zip(ids, eps)]
    assert len(pairs) == len(set(pairs))
    for node, got in enumerate(node_bytes(traffic, manifest)):
        per_shard = [traffic[node].response_bytes("GET", key=s.name) / s.bytes for s in manifest.shards]
        print(
            f"warm node {node}: shards fetched 0/1/2+ times: {sum(x == 0 for x in per_shard)}/"
            f"{sum(0 < x <= 1 for x in per_shard)}/{sum(x > 1 for x in per_shard)}"
        )
        print(f"warm node {node}: {got:,} B, {got / (dataset_bytes / NODES):.2f} x dataset/N at f={fraction}")
        assert got <= 1.25 * dataset_bytes / NODES * (1 - fraction), (node, got, dataset_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("lake_on_s3", [48000], indirect=True)
def test_a_restart_onto_the_nodes_in_reverse_order_reads_on_each_what_its_cache_holds(tmp_path, s3_server, lake_on_s3):
    manifest, url = lake_on_s3
    dataset_bytes = sum(s.bytes for s in manifest.shards)
    share = dataset_bytes / NODES
    fraction = 0.5
    tier = f"L2={tmp_path}/nvme-{{node}}/tf:{int(fraction * share)}:auto:at_rest"
    epoch = manifest.num_samples // (BATCH * NODES * PER_NODE)
    run_job(tmp_path, s3_server, url, tier, epoch)  # the first job warms the caches
    _, warm = run_job(tmp_path, s3_server, url, tier, epoch)  # an uninterrupted run's warm epoch
    gathered, placed = run_job(tmp_path, s3_server, url, tier, epoch, reverse=True)
    _, unplaced = run_job(tmp_path, s3_server, url, tier, epoch, reverse=True, affinity=False)
    pairs = [(i, e) for rank in gathered for ids, eps in zip(rank[0], rank[1]) for i, e in zip(ids, eps)]
    assert len(pairs) == len(set(pairs))  # exactness unchanged: never a sample twice in an epoch
    figures = [node_bytes(t, manifest) for t in (warm, placed, unplaced)]
    for machine in range(NODES):
        w, p, u = (f[machine] / share for f in figures)
        print(f"machine {machine}: warm {w:.2f}, restarted reversed {p:.2f} (without affinity {u:.2f}) x dataset/N")
        assert p <= 1.1 * w, (machine, w, p)  # within 10% of the uninterrupted run's warm epoch
        assert u >= 1.5 * w, (machine, w, u)  # the node order reversed, without affinity: its cache is no use


def test_rank_from_lightnings_launcher_variables_and_errors_that_name_what_is_missing():
    lightning = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}  # no RANK, no LOCAL_WORLD_SIZE
    assert WorldPosition.from_env(lightning) == WorldPosition(node=0, num_nodes=1, local_rank=1, ranks_per_node=2)
    two_nodes = {"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert WorldPosition.from_env(two_nodes).rank == 3
    with pytest.raises(TopologyError, match="without LOCAL_WORLD_SIZE"):
        WorldPosition.from_env({"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"})
    with pytest.raises(TopologyError, match="nothing says which rank"):
        WorldPosition.from_env({"WORLD_SIZE": "2"})
    # torch.distributed's group wins where the environment says nothing, and must agree where it does
    assert WorldPosition.from_env({}, process_group=(1, 2)).rank == 1
    with pytest.raises(TopologyError, match="RANK=0 disagrees with torch.distributed's 1"):
        WorldPosition.from_env({"RANK": "0", "WORLD_SIZE": "2"}, process_group=(1, 2))
