"""Jobs sharing one node's tiers: on the same dataset they share entries by content id (one fetch
per shard per node for both); on different datasets each keeps a fair share of the room, so a job
arriving on a node another job filled is not starved (policies/fairshare.py).

The fast test drives one tier directly with two datasets; the slow ones run independent jobs as
separate processes (tierflow.testing.nodejobs) through the node's proxy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tierflow
from tierflow.format._checksum import xxh3_128_hex
from tierflow.storage.remote import upload_dataset
from tierflow.testing.nodejobs import JobSpec, pack_letters, run_jobs
from tierflow.tiers.tier import Tier

ENTRY = 1000


def fill(tier: Tier, dataset: str, names: list[str]) -> list[bool]:
    """Read entries of `dataset` through the tier as a reader does; whether each was cached."""
    cached = []
    for name in names:
        data = (dataset + name).encode().ljust(ENTRY, b".")
        pin = tier.ensure(
            xxh3_128_hex(data), ENTRY, xxh3_128_hex(data), lambda p, data=data: p.write_bytes(data), dataset=dataset
        )
        cached.append(pin is not None)
        if pin is not None:
            pin.release()
    return cached


def resident(tier: Tier) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in tier.index.entries():
        out[row.dataset] = out.get(row.dataset, 0) + 1
    return out


JOB_A = """
import sys, time
from tierflow.tiers.tier import Tier
from test_shared_node_cache import ENTRY, fill
assert all(fill(Tier(sys.argv[1], 8 * ENTRY, policy="nochurn", form="at_rest"), "a", [f"a{i}" for i in range(8)]))
print("filled", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_dataset_arriving_on_a_full_tier_claims_its_fair_share_and_no_more(tmp_path):
    job_a = subprocess.Popen(
        [sys.executable, "-c", JOB_A, str(tmp_path / "l2")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert job_a.stdout.readline().strip() == "filled"  # job a, alive, filled the tier
        tier = Tier(tmp_path / "l2", 8 * ENTRY, policy="nochurn", form="at_rest")  # job b, this process
        assert resident(tier) == {"a": 8}
        cached = fill(tier, "b", [f"b{i}" for i in range(8)])
        assert resident(tier) == {"a": 4, "b": 4}, resident(tier)  # nochurn alone would keep a's 8 and cache no b
        assert cached == [True] * 4 + [False] * 4  # beyond its share, b's own policy decides (nochurn: keep)
    finally:
        job_a.kill()
        job_a.wait()
    assert fill(tier, "b", [f"b{i}" for i in range(4, 6)]) == [True, True]  # no live reader of a: no share for a
    assert resident(tier) == {"a": 2, "b": 6}


@pytest.fixture
def two_datasets(tmp_path, s3_server, s3_bucket):
    """Two datasets of ~26 shards on S3: (their URLs, their manifests)."""
    urls, manifests = [], []
    for name, seed in (("a", 1), ("b", 2)):
        local = pack_letters(tmp_path, name, 20000, seed)
        urls.append(f"s3://{s3_bucket}/{name}")
        upload_dataset(local, urls[-1], endpoint_url=s3_server.endpoint_url)
        manifests.append(tierflow.open_dataset(local).manifest)
    return urls, manifests


@pytest.mark.slow
def test_two_jobs_on_the_same_dataset_share_l1_and_l2_entries_one_fetch_per_shard(tmp_path, two_datasets, s3_proxy):
    (url, _), (manifest, _) = two_datasets
    tiers = [f"L1={tmp_path}/shm/tf:1GB:auto", f"L2={tmp_path}/nvme/tf:1GB:auto:at_rest"]
    s3_proxy.reset_counters()
    jobs = run_jobs([JobSpec(url, seed=1, epochs=2), JobSpec(url, seed=2, epochs=2)], s3_proxy.url, tiers, tmp_path)
    traffic = s3_proxy.traffic()
    for info in manifest.shards:  # one fetch of each shard on the node, for both jobs and both epochs
        assert traffic.response_bytes("GET", key=info.name) == info.bytes, info.name
    keys = {s.key for s in manifest.shards}
    for tier in ("shm", "nvme"):  # one entry per content id, whichever job read it first
        entries = {p.stem for p in (tmp_path / tier / "tf" / "entries").iterdir()}
        assert entries == keys, tier
    assert sum(sum(job["fetched"]) for job in jobs) == sum(s.bytes for s in manifest.shards)


@pytest.mark.slow
@pytest.mark.parametrize("warm_first", [False, True], ids=["both-cold", "one-finds-the-node-full-of-the-others"])
def test_two_jobs_on_different_datasets_share_one_l2_without_one_starving(tmp_path, two_datasets, s3_proxy, warm_first):
    urls, manifests = two_datasets
    capacity = sum(s.bytes for s in manifests[0].shards)  # room for one dataset of the two
    tiers = [f"L2={tmp_path}/nvme/tf:{capacity}:auto:at_rest"]
    if warm_first:  # job a alone first: the L2 holds all of a when a and b start together
        run_jobs([JobSpec(urls[0], seed=1, epochs=1)], s3_proxy.url, tiers, tmp_path)
    figures = run_jobs(
        [JobSpec(urls[0], seed=1, epochs=3), JobSpec(urls[1], seed=2, epochs=3)], s3_proxy.url, tiers, tmp_path
    )
    for job, fig in enumerate(figures):
        share = fig["resident"][-1]["L2"] / capacity
        warm = fig["fetched"][-1] / fig["dataset_bytes"]
        print(
            f"job {job}: L2 share {share:.2f}, fetched per epoch "
            f"{[round(f / fig['dataset_bytes'], 2) for f in fig['fetched']]}"
        )
        assert 0.4 <= share <= 0.6, (job, share)  # each about half the room
        assert warm <= 0.75, (job, warm)  # and hits with it (with no share: ~1.1, more than no cache)


def test_a_dataset_at_its_share_evicts_its_own_entries_not_another_datasets_within_its_share(tmp_path):
    """LRU's victim is the least recently used entry, here the other dataset's: that dataset is
    within its share, so the victim is passed over and the reader's own oldest entry goes."""
    tier = Tier(tmp_path / "l2", 4 * ENTRY, policy="lru", form="at_rest")
    assert all(fill(tier, "a", ["a0", "a1"]))  # a first: the least recently used
    assert all(fill(tier, "b", ["b0", "b1", "b2"]))  # b over its share (2 of 4) took nothing of a's
    assert resident(tier) == {"a": 2, "b": 2}
    keys = {row.key: row for row in tier.index.entries()}
    assert all(fill(tier, "b", ["b3"]))
    assert resident(tier) == {"a": 2, "b": 2} and tier.m_evictions.value == 2
    assert {k for k in keys if keys[k].dataset == "a"} <= tier.index.keys()
