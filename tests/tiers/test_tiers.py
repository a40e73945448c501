"""The tier stack against real parts: moto's S3 server behind the counting proxy, real
directories, several real processes sharing one node's tiers."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

import tierflow
from tierflow.format._checksum import xxh3_128_hex
from tierflow.pack.tokenize import PackInputError
from tierflow.format.manifest import Manifest
from tierflow.storage.remote import open_store, upload_dataset
from tierflow.policies.auto import Lifecycle
from tierflow.tiers._staging import staging_root, sweep_unused
from tierflow.tiers.stack import TierStack
from tierflow.testing.faults import tier_problems
from tierflow.tiers.tier import Tier

PROCESSES = mp.get_context("forkserver")  # obstore, used here first, does not survive a fork


def make_dataset(tmp_path: Path, n: int = 2400, seed: int = 0) -> Path:
    src = tmp_path / "raw.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} {seed} " + "lorem ipsum " * (i % 37), "i": i}) + "\n")
    out = tmp_path / "packed"
    tierflow.pack(
        [src], out, workers=1, target_shard_bytes=256 << 10, tokenizer="bytes", keep_text=True, block_bytes=64 << 10
    )  # several blocks a shard
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """`make_dataset`, packed once for the module: the tests below only read it (their S3 copy is their own)."""
    return make_dataset(tmp_path_factory.mktemp("tiers"))


@pytest.fixture
def s3_dataset(packed, s3_server, s3_bucket, s3_proxy):
    local = packed
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(local, url, endpoint_url=s3_server.endpoint_url)
    s3_proxy.reset_counters()
    return local, url, s3_proxy


def stack_for(
    url: str,
    proxy_url: str,
    root: Path,
    l2_capacity: float = 1 << 30,
    l1_capacity: float = 1 << 30,
    l2_policy: str = "lru",
    l1: bool = True,
    **tier_kw,
) -> TierStack:
    tiers = []
    if l1:
        tiers.append(Tier(root / "l1", l1_capacity, policy="lru", form="decoded", name="L1", **tier_kw))
    tiers.append(Tier(root / "l2", l2_capacity, policy=l2_policy, form="at_rest", name="L2", **tier_kw))
    return TierStack(open_store(url, endpoint_url=proxy_url), tiers)


def all_samples(ds) -> list[dict]:
    return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in s.items()} for s in ds]


def test_stage_from_s3_through_l2_and_l1_reads_back_equal(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    stack = stack_for(url, proxy.url, tmp_path / "node")
    ds = stack.dataset()
    expected = all_samples(tierflow.open_dataset(local))
    assert all_samples(ds) == expected
    m = ds.manifest
    assert proxy.traffic().response_bytes("GET") >= sum(s.bytes for s in m.shards)
    l1, l2 = stack.tiers
    assert len(l1.index.entries()) == len(l2.index.entries()) == len(m.shards)
    assert all(
        r.size == s.decoded_bytes
        for r, s in zip(sorted(l1.index.entries(), key=lambda r: r.key), sorted(m.shards, key=lambda s: s.key))
    )
    # a second pass is served from L1 without touching the network
    stack.close()
    proxy.reset_counters()
    fresh = stack_for(url, proxy.url, tmp_path / "node")
    assert all_samples(fresh.dataset()) == expected
    assert proxy.traffic().requests("GET", key="shard-") == 0


def _ensure_all(url: str, proxy_url: str, root: str, barrier, queue) -> None:
    stack = stack_for(url, proxy_url, Path(root))
    manifest = stack.manifest()
    barrier.wait()
    for info in manifest.shards:
        stack.ensure(info).release()
    queue.put(os.getpid())


@pytest.mark.slow
def test_four_processes_fetch_each_shard_exactly_once(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    manifest = tierflow.open_dataset(local).manifest
    barrier, queue = PROCESSES.Barrier(4), PROCESSES.Queue()
    procs = [
        PROCESSES.Process(target=_ensure_all, args=(url, proxy.url, str(tmp_path / "node"), barrier, queue))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    traffic = proxy.traffic()
    for info in manifest.shards:
        assert traffic.response_bytes("GET", key=info.name) == info.bytes, info.name


def _slow_fetch_then_hang(url: str, proxy_url: str, root: str, started) -> None:
    stack = stack_for(url, proxy_url, Path(root), l1=False)
    info = stack.manifest().shards[0]
    started.set()
    stack.ensure(info)


@pytest.mark.slow
def test_fetcher_killed_with_sigkill_others_take_over(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    info = tierflow.open_dataset(local).manifest.shards[0]
    proxy.set_bandwidth(20_000)  # the first fetch takes many seconds
    started = PROCESSES.Event()
    victim = PROCESSES.Process(target=_slow_fetch_then_hang, args=(url, proxy.url, str(tmp_path / "node"), started))
    victim.start()
    assert started.wait(30)
    tmp_dir = tmp_path / "node" / "l2" / "tmp"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list(tmp_dir.iterdir()):
        time.sleep(0.05)
    assert list(tmp_dir.iterdir()), "the victim never started its download"
    time.sleep(0.3)  # it now holds the entry's fetch lock, mid-download
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    proxy.set_bandwidth(None)
    t0 = time.monotonic()
    stack = stack_for(url, proxy.url, tmp_path / "node", l1=False, lock_timeout=30)
    handle = stack.ensure(info)
    assert time.monotonic() - t0 < 30
    assert (handle.tier, handle.served_by) == ("L2", "source")
    assert stack.tiers[0].index.occupancy()[1] == 0  # the dead fetcher's reservation was reclaimed
    assert stack.tiers[0].clean() >= 1  # its temporary file is a leftover of a dead job


def _hammer(url: str, proxy_url: str, root: str, capacity: int, seed: int, rounds: int) -> None:
    import random

    stack = stack_for(url, proxy_url, Path(root), l2_capacity=capacity, l1=False)
    shards = stack.manifest().shards
    rng = random.Random(seed)
    for _ in range(rounds):
        handle = stack.ensure(rng.choice(shards))
        time.sleep(rng.random() * 0.01)
        handle.release()


@pytest.mark.slow
def test_capacity_holds_and_pinned_entries_survive_a_multi_process_hammer(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    shards = tierflow.open_dataset(local).manifest.shards
    capacity = sum(sorted(s.bytes for s in shards)[-3:])  # room for about three shards
    stack = stack_for(url, proxy.url, tmp_path / "node", l2_capacity=capacity, l1=False)
    l2 = stack.tiers[0]
    held = stack.ensure(shards[0])  # pinned for the whole test
    inode = os.stat(held.path).st_ino
    procs = [
        PROCESSES.Process(target=_hammer, args=(url, proxy.url, str(tmp_path / "node"), capacity, seed, 40))
        for seed in range(3)
    ]
    for p in procs:
        p.start()
    worst = 0
    while any(p.is_alive() for p in procs):
        resident, reserved = l2.index.occupancy()
        worst = max(worst, resident + reserved)
        time.sleep(0.005)
    for p in procs:
        assert p.exitcode == 0
    assert worst <= capacity
    assert os.stat(held.path).st_ino == inode and l2.index.get(shards[0].key) is not None
    assert l2.registry.snapshot()  # metrics are readable
    held.release()


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupted_l1_and_l2_entries_are_refetched_and_counted(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    expected = all_samples(tierflow.open_dataset(local))
    stack = stack_for(url, proxy.url, tmp_path / "node")
    info = stack.manifest().shards[0]
    stack.ensure(info).release()
    l1, l2 = stack.tiers
    flip(l1.path_of(info.key))
    flip(l2.path_of(info.key))
    fresh = stack_for(url, proxy.url, tmp_path / "node")
    assert all_samples(fresh.dataset()) == expected
    c1 = fresh.tiers[0].m_corruptions.value
    c2 = fresh.tiers[1].m_corruptions.value
    assert (c1, c2) == (1, 1)
    assert len(list((tmp_path / "node" / "l1" / "quarantine").iterdir())) == 1


def _row_in_block(ds, shard: int, block: int) -> int:
    info = ds.manifest.shards[shard]
    return int(ds.sample_starts[shard]) + sum(b.rows for b in info.blocks[:block])


def test_a_new_process_reads_a_staged_entry_by_block_without_hashing_it_whole(tmp_path, s3_dataset, monkeypatch):
    import tierflow.tiers.stack as stack_module
    import tierflow.tiers.entries as entries_module

    local, url, proxy = s3_dataset
    stack = stack_for(url, proxy.url, tmp_path / "node")
    for info in stack.manifest().shards:
        stack.ensure(info).release()
    info = stack.manifest().shards[1]
    l1 = stack.tiers[0]
    assert (l1.root / "blocks" / f"{info.key}.json").exists()  # recorded at admission
    assert [b.rows for b in l1.blocks_of(info.key)] == [b.rows for b in info.blocks]
    stack.close()
    proxy.reset_counters()
    whole = []
    for module in (entries_module, stack_module):
        monkeypatch.setattr(module, "file_xxh3_128", lambda *a, **k: whole.append(a) or "")
    fresh = stack_for(url, proxy.url, tmp_path / "node")  # a new process's view: nothing in memory
    ds = fresh.dataset()
    i = _row_in_block(ds, 1, 2) + 3
    assert ds[i]["i"] == i
    table = fresh.open_shard(1, info)
    assert (table.blocks_loaded, table.blocks_verified) == (1, 1)
    assert not whole and proxy.traffic().requests("GET", key="shard-") == 0
    assert fresh.tiers[0].m_hits.value == 1 and fresh.tiers[1].m_hits.value == 0


def _redigested(listed: Path, change) -> None:
    """A block list edited by someone who recomputed its digest: only its content can refuse it."""
    from tierflow.format._checksum import xxh3_hex

    d = json.loads(listed.read_text())
    d.pop("digest")
    change(d)
    d["digest"] = xxh3_hex(json.dumps(d, sort_keys=True).encode())
    listed.write_text(json.dumps(d))


@pytest.mark.parametrize("damage", ["missing", "garbled", "tampered", "another-entry", "gapped", "past-the-end"])
def test_a_staged_entry_whose_block_list_is_unusable_is_verified_whole_and_gets_it_back(tmp_path, s3_dataset, damage):
    local, url, proxy = s3_dataset
    stack = stack_for(url, proxy.url, tmp_path / "node")
    info = stack.manifest().shards[0]
    stack.ensure(info).release()
    listed = stack.tiers[0].root / "blocks" / f"{info.key}.json"
    if damage == "missing":
        listed.unlink()
    elif damage == "garbled":
        listed.write_text("{not json")
    elif damage == "tampered":  # a block's checksum changed without its digest: refused, not trusted
        text = listed.read_text()
        assert '"checksum": ["' in text
        listed.write_text(text.replace('"checksum": ["', '"checksum": ["0', 1))
    elif damage == "another-entry":  # the list of an entry of another size
        _redigested(listed, lambda d: d.update(size=d["size"] + 1))
    elif damage == "gapped":  # a block that does not start where the one before it ends
        _redigested(listed, lambda d: d["blocks"]["offset"].__setitem__(1, d["blocks"]["offset"][1] + 1))
    else:  # blocks that run past the end of the file
        _redigested(listed, lambda d: d["blocks"]["length"].__setitem__(-1, d["blocks"]["length"][-1] + d["size"]))
    fresh = stack_for(url, proxy.url, tmp_path / "node")
    ds = fresh.dataset()
    assert [ds[i]["i"] for i in range(info.samples)] == list(range(info.samples))
    assert fresh.tiers[0].m_corruptions.value == 0 and fresh.tiers[0].m_hits.value == 1
    assert fresh.tiers[0].blocks_of(info.key) is not None
    assert stack_for(url, proxy.url, tmp_path / "node").tiers[0].blocks_of(info.key) is not None  # on disk again


@pytest.mark.parametrize("layout", ["L1 decoded over L2", "L2 at rest only"])
def test_a_corrupted_block_of_a_staged_entry_is_never_served(tmp_path, s3_dataset, layout):
    local, url, proxy = s3_dataset
    l1 = layout.startswith("L1")
    stack = stack_for(url, proxy.url, tmp_path / "node", l1=l1)
    info = stack.manifest().shards[1]
    stack.ensure(info).release()
    top = stack.tiers[0]
    blocks = top.blocks_of(info.key) if l1 else info.blocks
    bad = blocks[2]
    path = top.path_of(info.key)
    data = bytearray(path.read_bytes())
    data[bad.offset + bad.length - 3] ^= 0x20
    path.write_bytes(bytes(data))
    expected = tierflow.open_dataset(local)

    fresh = stack_for(url, proxy.url, tmp_path / "node", l1=l1)
    ds = fresh.dataset()
    first = _row_in_block(ds, 1, 0)
    assert [ds[first + r]["i"] for r in range(info.blocks[0].rows)] == list(range(first, first + info.blocks[0].rows))
    assert fresh.tiers[0].m_corruptions.value == 0  # the sound blocks read from the damaged entry
    for k in (2, 3, 1):
        first = _row_in_block(ds, 1, k)
        rows = range(first, first + info.blocks[k].rows)
        got = [ds[i] for i in rows]
        assert [g["i"] for g in got] == list(rows)
        assert [g["tokens"].tolist() for g in got] == [expected[i]["tokens"].tolist() for i in rows]
    assert fresh.tiers[0].m_corruptions.value == 1
    assert len(list((fresh.tiers[0].root / "quarantine").iterdir())) == 1
    assert fresh.tiers[0].path_of(info.key).read_bytes() != bytes(data)  # fetched again, sound


def test_a_block_corrupt_in_every_copy_raises_naming_shard_and_block(tmp_path):
    from tierflow.errors import ShardCorruptError

    local = make_dataset(tmp_path)
    tier = Tier(tmp_path / "node" / "l2", 1 << 30, policy="lru", form="at_rest", name="L2")
    stack = TierStack(open_store(str(local)), [tier])
    info = stack.manifest().shards[0]
    stack.ensure(info).release()
    bad = info.blocks[1]
    for path in (local / info.name, tier.path_of(info.key)):
        data = bytearray(path.read_bytes())
        data[bad.offset + 10] ^= 0x01
        path.write_bytes(bytes(data))
    fresh = TierStack(open_store(str(local)), [Tier(tmp_path / "node" / "l2", 1 << 30, name="L2", form="at_rest")])
    ds = fresh.dataset()
    assert ds[0]["i"] == 0
    with pytest.raises(ShardCorruptError, match=f"shard {info.name}: block 1 "):
        ds[_row_in_block(ds, 0, 1)]


def test_restarted_process_finds_l2_warm_with_its_statistics(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    stack = stack_for(url, proxy.url, tmp_path / "node", l1=False, l2_policy="hotscore")
    info = stack.manifest().shards[1]
    for _ in range(3):
        stack.ensure(info).release()
    before = stack.tiers[0].index.get(info.key)
    proxy.reset_counters()
    code = (
        "import sys, json; from pathlib import Path;"
        "from tierflow.tiers.tier import Tier;"
        "t = Tier(Path(sys.argv[1]), 1 << 30, policy='hotscore', form='at_rest');"
        "r = t.index.get(sys.argv[2]); print(json.dumps([r.hits, r.stats]))"
    )
    out = subprocess.run(
        [os.sys.executable, "-c", code, str(tmp_path / "node" / "l2"), info.key],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    hits, stats = json.loads(out)
    assert hits == before.hits == 3 and stats == before.stats and stats  # the demand fetch was the first use
    assert proxy.traffic().requests() == 0


def test_a_job_asking_for_other_capacity_gets_a_warning_not_a_second_cache(tmp_path, caplog):
    Tier(tmp_path / "l2", 10 << 20, policy="lru", form="at_rest")
    t = Tier(tmp_path / "l2", 20 << 20, policy="hotscore", form="at_rest")
    assert t.capacity == 10 << 20 and t.policy_name == "lru"
    assert "belong to the directory" in caplog.text


def test_a_look_at_a_tier_leaves_its_configuration_to_the_first_job(tmp_path, capsys, caplog):
    """`tierflow cache ls|clean|evict` on a directory no job has written (a fresh node, or one whose
    only job was killed before its first entry) configured it with the command's capacity (the CLI's
    default 50% of the disk), so the job that came next kept that instead of its own (kill loop)."""
    from tierflow.commands.cli import main

    for action in ("ls", "clean", "evict"):
        assert main(["cache", action, "--tier", f"L2={tmp_path / 'l2'}"]) == 0
    assert Tier(tmp_path / "l2", 10 << 20, policy="lru", form="at_rest").capacity == 10 << 20
    assert "belong to the directory" not in caplog.text
    assert main(["cache", "ls", "--tier", f"L2={tmp_path / 'l2'}:20MB:hotscore:decoded"]) == 0
    looked = Tier(tmp_path / "l2", 30 << 20, policy="hotscore", form="decoded", configure=False)
    assert (looked.capacity, looked.policy_name, looked.form.value) == (10 << 20, "lru", "at_rest")
    assert "belong to the directory" not in caplog.text  # a look asks for nothing, so it is not warned
    fresh = Tier(tmp_path / "fresh", 1 << 20, form="at_rest", configure=False)
    assert fresh.index.config() == {}
    assert tier_problems(tmp_path / "fresh", Manifest(pa.schema([]), [])) == []  # the kill loop's check is a look too
    assert fresh.index.config() == {}
    assert fresh.ensure("k", 5, xxh3_128_hex(b"hello"), lambda p: p.write_bytes(b"hello")) is not None
    assert fresh.index.config()["capacity"] == str(1 << 20)  # its first entry configures the directory


def test_a_form_is_given_as_a_string_kept_as_one_in_the_index_and_read_back_as_a_form(tmp_path):
    from tierflow.format.shard import Form
    from tierflow.format.verify import verify_shard
    from tierflow.tiers import TierConfig

    config = TierConfig("L2", str(tmp_path / "l2"), 10 << 20, form="at_rest")
    assert config.form is Form.AT_REST
    assert config.build().form is Form.AT_REST
    again = Tier(tmp_path / "l2", 10 << 20, policy="auto", form="decoded")  # the directory's form wins
    assert again.form is Form.AT_REST and again.index.set_config_if_absent({})["form"] == "at_rest"
    assert json.loads(json.dumps(again.snapshot()))["form"] == "at_rest"
    with pytest.raises(ValueError, match="tier L9: form 'zstd' is not one of at_rest, decoded"):
        TierConfig("L9", str(tmp_path / "l9"), 1, form="zstd")
    local = make_dataset(tmp_path, n=300)
    info = tierflow.Manifest.load(local).shards[0]
    assert verify_shard(local / info.name, info, Form.AT_REST) == []
    assert verify_shard(local / info.name, info, Form.DECODED)  # the at-rest file is not the decoded form
    assert (info.bytes_in(Form.DECODED), info.checksum_in("decoded")) == (info.decoded_bytes, info.decoded_checksum)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    return result.returncode == 0


def test_full_disk_falls_back_to_the_tier_below_without_a_partial_file(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, "600k"):
        if os.environ.get("CI") == "true":
            pytest.fail("cannot mount a tmpfs for the ENOSPC test, and CI must not skip it")
        pytest.skip("mounting a tmpfs is refused here (needs root)")
    try:
        expected = all_samples(tierflow.open_dataset(local))
        # L2 configured far larger than the disk really is: the disk fills before the accounting does
        tier = Tier(mount / "l2", 1 << 30, policy="lru", form="decoded", name="L2", ram=False)
        stack = TierStack(open_store(url, endpoint_url=proxy.url), [tier])
        assert all_samples(stack.dataset()) == expected
        assert tier.m_enospc.value >= 1
        assert not list((mount / "l2" / "tmp").iterdir())
        for row in tier.index.entries():
            assert tier.path_of(row.key).stat().st_size == row.size
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_pack_writes_to_s3_directly_and_the_stack_reads_it_back(tmp_path, s3_server, s3_bucket, s3_proxy):
    src = tmp_path / "raw.jsonl"
    with open(src, "w") as f:
        for i in range(1500):
            f.write(json.dumps({"text": f"remote {i} " * (i % 13), "i": i}) + "\n")
    url = f"s3://{s3_bucket}/packed"
    tierflow.pack([src], url, workers=2, target_shard_bytes=256 << 10, endpoint_url=s3_proxy.url)
    with pytest.raises(PackInputError, match="--overwrite"):
        tierflow.pack([src], url, workers=1, target_shard_bytes=256 << 10, endpoint_url=s3_proxy.url)
    stack = stack_for(url, s3_proxy.url, tmp_path / "node", l1=False)
    assert [s["i"] for s in stack.dataset()] == list(range(1500))
    assert [t["name"] for t in stack.snapshot()["tiers"]] == [t.name for t in stack.tiers]


def test_cache_warm_stages_every_shard_so_reading_costs_no_request(tmp_path, s3_dataset, capsys):
    from tierflow.commands.cli import main

    local, url, proxy = s3_dataset
    shards = tierflow.open_dataset(local).manifest.shards
    assert main(["cache", "warm", url, "--tier", f"L2={tmp_path / 'l2'}:{1 << 30}", "--endpoint-url", proxy.url]) == 0
    assert f"warmed {len(shards)} shards" in capsys.readouterr().out
    proxy.reset_counters()
    stack = TierStack(open_store(url, endpoint_url=proxy.url), [Tier(tmp_path / "l2", 1 << 30, name="L2")])
    assert all_samples(stack.dataset()) == all_samples(tierflow.open_dataset(local))
    assert proxy.traffic().response_bytes("GET") < 64 << 10  # the manifest, no shard


def _open_index(path, results) -> None:
    from tierflow.tiers._index import TierIndex

    try:
        TierIndex(path).occupancy()
        results.put("ok")
    except Exception as e:
        results.put(repr(e))


# a race: each trial is one chance to lose it; the full suite gives it four times the fast set's chances
@pytest.mark.parametrize("trials", [2, pytest.param(8, marks=pytest.mark.slow)], ids=lambda n: f"{n}-trials")
def test_processes_opening_a_new_tier_index_at_once_all_succeed(tmp_path, trials):
    import multiprocessing

    results = multiprocessing.Queue()
    for trial in range(trials):
        path = tmp_path / f"t{trial}" / "index.sqlite"
        path.parent.mkdir()
        procs = [multiprocessing.Process(target=_open_index, args=(path, results)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert [results.get() for _ in procs] == ["ok"] * 6  # not "database is locked"


# ---------------------------------------------------------------- the node's staging area


def _ensure_in_step(url: str, proxy_url: str, root: str, barrier, queue) -> None:
    stack = stack_for(url, proxy_url, Path(root), l2_capacity=16, l1=False)  # L2 takes no shard
    shards = stack.manifest().shards
    stack.declare(Lifecycle(pattern="reshuffle"), 2 * max(s.bytes for s in shards), 1, readers=2, job="a job")
    served = []
    for info in shards:
        barrier.wait()
        handle = stack.ensure(info, read=True)
        served.append((handle.tier, handle.served_by, str(handle.path.parent.parent)))
        barrier.wait()  # both read it before either moves on
        handle.release()
    queue.put(served)


@pytest.mark.slow
def test_a_nodes_ranks_fetch_a_shard_no_tier_keeps_once_through_their_staging_area(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    barrier, queue = PROCESSES.Barrier(2), PROCESSES.Queue()
    procs = [
        PROCESSES.Process(target=_ensure_in_step, args=(url, proxy.url, str(tmp_path / "node"), barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    served = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    manifest = tierflow.open_dataset(local).manifest
    traffic = proxy.traffic()
    for info in manifest.shards:  # one fetch for both
        assert traffic.response_bytes("GET", key=info.name) == info.bytes, info.name
    for a, b in zip(*served):
        assert a[0] == b[0] == "staging" and a[2] == b[2]  # one area
        assert sorted([a[1], b[1]]) == ["source", "staging"]  # one fetched it, the other read that copy
    sweep_unused(staging_root())
    assert not Path(served[0][0][2]).exists()  # unused once they exited: swept


class Lag:
    """A stand-in for the ranks' steps: this rank at 10, the slowest moving while `moving` is set."""

    def __init__(self) -> None:
        self.slowest = 5
        self.moving = True

    def lag(self) -> tuple[int, int]:
        if self.moving:
            self.slowest += 0.001
        return 10, self.slowest


def test_a_faster_rank_waits_for_room_while_the_slowest_moves_and_not_without_one_behind(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    stack = stack_for(url, proxy.url, tmp_path / "node", l2_capacity=16, l1=False)
    shards = stack.manifest().shards
    stack.declare(Lifecycle(pattern="reshuffle"), 2 * max(s.bytes for s in shards), 1, readers=2, job="a job")
    staging = stack.staging
    held = []
    for info in shards:  # fill the area with entries in use (pinned), as a slower rank's holds are
        handle = stack.ensure(info, prefetch=True)
        if handle is None:
            break
        held.append(handle)
    wanted = shards[len(held)]
    assert stack.ensure(wanted, prefetch=True) is None
    lag = stack.progress = Lag()
    stack.staging_wait_s = 0.3
    threading.Timer(0.5, held[0].release).start()  # the slowest passes one of them
    started = time.monotonic()
    handle = stack.ensure(wanted, read=True)
    assert (handle.tier, time.monotonic() - started >= 0.4) == ("staging", True)
    assert stack.m_staging_waits.value == 1
    held.append(handle)  # in use too: the area is full again
    lag.moving = False  # the slowest stopped: give up after staging_wait_s, read it into memory
    started = time.monotonic()
    assert stack.ensure(shards[0], read=True).tier == "memory"
    assert 0.3 <= time.monotonic() - started < 5
    lag.slowest = 10  # nobody behind: what holds the room is this rank's own, read it at once
    started = time.monotonic()
    assert stack.ensure(shards[0], read=True).tier == "memory"
    assert time.monotonic() - started < 0.25
    for h in held:
        h.release()
    assert staging is stack.staging


def _stage_slowly_then_hang(url: str, proxy_url: str, root: str, ready, go) -> None:
    stack = stack_for(url, proxy_url, Path(root), l2_capacity=16, l1=False)
    info = stack.manifest().shards[0]
    stack.declare(Lifecycle(pattern="reshuffle"), 2 * info.bytes, 1, readers=2, job="a killed job")
    stack.progress.publish(1, 0)
    ready.set()
    go.wait(30)
    stack.ensure(info, read=True)


@pytest.mark.slow
def test_a_rank_killed_fetching_into_the_nodes_staging_area_holds_no_other_rank_up(tmp_path, s3_dataset):
    local, url, proxy = s3_dataset
    info = tierflow.open_dataset(local).manifest.shards[0]
    ready, go = PROCESSES.Event(), PROCESSES.Event()
    victim = PROCESSES.Process(target=_stage_slowly_then_hang, args=(url, proxy.url, str(tmp_path / "node"), ready, go))
    victim.start()
    assert ready.wait(30)
    stack = stack_for(url, proxy.url, tmp_path / "node", l2_capacity=16, l1=False)
    stack.manifest()
    stack.declare(Lifecycle(pattern="reshuffle"), 2 * info.bytes, 1, readers=2, job="a killed job")
    stack.progress.publish(0, 5)
    staging = stack.staging
    proxy.set_bandwidth(1_000)  # the victim's fetch (10 kB) takes many seconds
    go.set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list((staging.root / "tmp").iterdir()):
        time.sleep(0.05)
    assert list((staging.root / "tmp").iterdir()), "the victim never started its download"
    assert stack.progress.lag() == (5, 0)
    time.sleep(0.3)  # it now holds the entry's lock in the node's area, mid-download
    assert victim.is_alive(), victim.exitcode
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    proxy.set_bandwidth(None)
    t0 = time.monotonic()
    handle = stack.ensure(info, read=True)  # the lock died with its holder: no wait for a timeout
    assert time.monotonic() - t0 < 10 < staging.lock_timeout
    assert (handle.tier, handle.served_by) == ("staging", "source")
    assert stack.progress.lag() == (5, None)  # the dead rank holds nobody back
    assert staging.index.occupancy()[1] == 0  # its reservation was reclaimed
    handle.release()
