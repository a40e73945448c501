"""Specification of the cache's central promise at default settings: every sample drawn at the same
rate, one `for` per epoch, exact elastic resume under lanes, and bytes from the object store per
epoch that never exceed the dataset and come close to the optimum with the same room."""

import json
import time

import numpy as np
import pytest

import tierflow
from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.loader.spec import specs_from
from tierflow.commands.plan import plan_cache
from tierflow.tiers.stager import Stager
from tierflow.order import RankStream, SampleOrder
from tierflow.order.working_set import choose_working_set, fitting_working_set, narrowing_advice
from tierflow.tiers import TierConfig, build_stack
from tierflow.storage.remote import upload_dataset

COUNTS = [int(c) for c in np.random.default_rng(21).integers(3, 60, size=37)]  # 37 shards, 8 partitions


@pytest.mark.parametrize("lanes", [None, 1, 3])
@pytest.mark.parametrize("remainder", ["carry", "pad"])
def test_every_sample_is_drawn_at_the_same_rate(lanes, remainder):
    order = SampleOrder(
        COUNTS, dataset_id="rate", seed=3, partitions=8, window_shards=2, lanes=lanes, remainder=remainder
    )
    stream = RankStream(order, order.start(), batch_size=7)
    total = sum(COUNTS)
    drawn = np.zeros(total, dtype=np.int64)
    batch = 0
    for m in range(1, 5):
        while drawn.sum() < m * total:
            b = stream.batch(batch)
            np.add.at(drawn, b.sample_ids[b.mask], 1)
            batch += 1
        assert drawn.min() >= m - 1 and drawn.max() <= m + 1, (m, drawn.min(), drawn.max())


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_all_lanes_of_a_node_end_an_epoch_before_any_starts_the_next(nodes):
    order = SampleOrder(COUNTS, dataset_id="edges", seed=9, partitions=8, window_shards=2, lanes=3)
    for node in range(nodes):
        stream = RankStream(order, order.start(), batch_size=5, node=node, num_nodes=nodes)
        newest_started = 0
        for index in range(3 * sum(COUNTS) // (5 * nodes)):
            epochs = stream.batch(index).epochs
            assert epochs.min() >= newest_started  # no sample of an epoch after a batch of the next
            newest_started = max(newest_started, int(epochs.min()))


def test_elastic_resume_4_to_2_to_8_nodes_reads_each_sample_once_per_epoch():
    order = SampleOrder(COUNTS, dataset_id="elastic", seed=4, partitions=8, window_shards=2, lanes=2)
    cursor, seen = order.start(), []
    for nodes, steps in ((4, 7), (2, 9), (8, None)):
        streams = [RankStream(order, cursor, batch_size=3, node=n, num_nodes=nodes) for n in range(nodes)]
        step = 0
        while steps is None or step < steps:
            batches = [s.batch(step) for s in streams]
            seen += [b.sample_ids[b.mask & (b.epochs == 0)] for b in batches]
            saved = batches[-1].cursor
            step += 1
            if steps is None and saved["epoch"] >= 1:
                break
        assert all(b.cursor == saved for b in batches)  # the same state on every node
        cursor = order.load(json.loads(json.dumps(saved)))
    ids = np.concatenate(seen)
    assert np.array_equal(np.sort(ids), np.arange(sum(COUNTS)))


def test_the_working_set_depends_on_the_dataset_alone_and_a_small_tier_is_told_how_to_narrow_it():
    sizes = [1000] * 400
    default = choose_working_set(sizes, 64)
    assert (default.lanes, default.window_shards) == (16, 4) and default.shards == 128  # the widest
    assert choose_working_set(sizes, 64) == default  # no tier, disk or memory to ask
    small = choose_working_set([1000] * 53, 32)  # at most a quarter of the node's shards read at once
    assert small.reading <= 53 // 4 and (small.lanes, small.window_shards) == (13, 1)
    huge = choose_working_set([256 << 20] * 4000, 64)  # at most WORKING_SET_BYTES at rest
    assert huge.bytes <= (8 << 30) + (256 << 20) and huge.reading == 15
    # the tier never narrows the order; a tier too small for it to pay is told the numbers and the option
    assert narrowing_advice(default, sizes, 64, 10_000_000) is None
    tiny, mid = narrowing_advice(default, sizes, 64, 20_000), narrowing_advice(default, sizes, 64, 200_000)
    assert "lanes=1, window_shards=1" in tiny and "working set of 128 shards (0.1 MB" in tiny
    fit = fitting_working_set(sizes, 64, 200_000 * 0.0625)
    assert f"lanes={fit.lanes}, window_shards={fit.window_shards}" in mid and fit.bytes <= 200_000 * 0.0625
    assert 1 < fit.reading < default.reading and fit.shards == fit.lanes * 2 * fit.window_shards


def _pack_tokens(root, docs):
    rng = np.random.default_rng(12)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(docs):
            n = int(rng.integers(30, 300))
            text = (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()  # n random letters
            f.write(json.dumps({"text": text}) + "\n")
    out = root / "ds"
    tierflow.pack([root / "docs.jsonl"], out, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """77 shards: what the cache-ratio figures below are measured on."""
    return _pack_tokens(tmp_path_factory.mktemp("cache-pays"), 60000)


@pytest.fixture(scope="module")
def few_tokens(tmp_path_factory):
    """13 shards (8 lanes at default settings): enough for the stream's promises, cheap to read 3 times."""
    return _pack_tokens(tmp_path_factory.mktemp("cache-pays-few"), 10000)


@pytest.mark.slow
def test_one_for_under_epoch_end_rank_finishes_its_epoch_exactly_once(few_tokens):
    """By the end of `for` number e every window of epoch e was read once; of epoch e + 1 at most the
    carried-over remainders (each lane's last batch of e runs on into e + 1) were read before."""
    ds = TieredDataset(str(few_tokens), BatchSpec(batch_size=16, seq_len=128))
    assert ds.working_set.lanes > 1  # lanes carry remainders over the epoch edge
    loader = Loader(ds, epoch_end="rank", background=False, return_meta=True)
    seen: dict[int, list[np.ndarray]] = {}
    for epoch in range(3):
        for batch, meta in loader:
            real = batch["mask"].numpy()
            ids, epochs = meta.sample_ids[real], meta.epochs[real]
            for e in np.unique(epochs).tolist():
                seen.setdefault(e, []).append(ids[epochs == e])
        assert np.array_equal(np.sort(np.concatenate(seen[epoch])), np.arange(ds.num_order_samples)), epoch
        ahead = sum(a.size for a in seen.get(epoch + 1, []))
        assert ahead <= ds.working_set.lanes * ds.batch_size
    loader.close()


@pytest.mark.slow
def test_token_windows_are_drawn_at_the_same_rate(few_tokens):
    ds = TieredDataset(str(few_tokens), BatchSpec(batch_size=16, seq_len=128), OrderSpec(partitions=4, lanes=2))
    drawn = np.zeros(ds.num_order_samples, dtype=np.int64)
    for batch in ds:
        np.add.at(drawn, batch.meta.sample_ids[batch.data["mask"]], 1)
        if drawn.sum() >= 3 * drawn.size:
            break
    assert drawn.min() >= 2 and drawn.max() <= 4


def _epochs_through_s3(url, proxy, l2, capacity, epochs=3, **order):
    """GET bytes per `for`; `capacity` as a user writes it ("30%": of the dataset at rest), default form."""
    stack = build_stack(url, [TierConfig("L2", str(l2), capacity)], endpoint_url=proxy.url)
    tier = stack.tiers[0]
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=512), OrderSpec(**order))
    loader = Loader(ds, stager=Stager(ds, stack), epoch_end="rank")
    fetched = []
    for _ in range(epochs):
        proxy.reset_counters()
        for _batch in loader:
            time.sleep(0.001)  # a (short) training step: the stager runs beside the loop, not in a race with it
        fetched.append(proxy.traffic().response_bytes(method="GET"))
    loader.close()
    stack.close()
    return fetched, ds, tier


@pytest.fixture
def tokens_on_s3(tokens, s3_server, s3_bucket, s3_proxy):
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(tokens, url, endpoint_url=s3_server.endpoint_url)
    manifest = tierflow.open_dataset(tokens).manifest
    return url, s3_proxy, sum(s.bytes for s in manifest.shards), sum(s.decoded_bytes for s in manifest.shards)


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.05, 0.10])
def test_a_small_cache_never_costs_more_than_no_cache(tmp_path, tokens_on_s3, share):
    url, proxy, at_rest, decoded = tokens_on_s3
    fetched, ds, _ = _epochs_through_s3(url, proxy, tmp_path / "l2", f"{share:.0%}")
    # a `for` also pays the stager's lookahead into the next epoch, and a race with the stager can
    # refetch a shard or two; over the run, never more than no cache would fetch
    working_set = ds.working_set.bytes / decoded * at_rest
    assert all(f <= at_rest + 2 * working_set for f in fetched), [f / at_rest for f in fetched]
    assert sum(fetched) <= len(fetched) * at_rest + working_set, [f / at_rest for f in fetched]


@pytest.mark.slow
@pytest.mark.parametrize("share,warm_target", [(0.30, 0.75), (0.60, 0.45)])
def test_warm_epochs_fetch_near_the_optimum_with_the_same_room(tmp_path, tokens_on_s3, share, warm_target):
    """An L2 of 30% / 60% of the bytes at rest (the user's yardstick), default form (at rest: it cannot
    hold the dataset decoded): warm epochs within 0.05 of the optimum for the L2 alone (Belady over
    whole shards at rest; the staging area in RAM lets a run do better), and as planned."""
    url, proxy, at_rest, decoded = tokens_on_s3
    fetched, ds, tier = _epochs_through_s3(url, proxy, tmp_path / "l2", f"{share:.0%}")
    assert tier.form == "at_rest" and tier.capacity == round(share * at_rest)
    plan = plan_cache(ds, tier.capacity, epochs=3, form=tier.form)
    live = [f / at_rest for f in fetched]
    predicted, best = [e.ratio for e in plan.predicted], [e.ratio for e in plan.tier_optimum]
    assert all(live[epoch] <= warm_target for epoch in (1, 2)), live
    assert sum(live[1:]) / 2 <= sum(best[1:]) / 2 + 0.05, (live, best)
    assert abs(sum(live) - sum(predicted)) <= 0.1 * sum(predicted), (live, predicted)


JOB = """
import sys
from tierflow.loader import BatchSpec, Loader, OrderSpec, TieredDataset
from tierflow.tiers.stager import Stager
from tierflow.tiers import TierConfig, build_stack
url, endpoint, l2, capacity, seed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
stack = build_stack(url, [TierConfig("L2", l2, capacity)], endpoint_url=endpoint)
ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=512), OrderSpec(seed=seed))
loader = Loader(ds, stager=Stager(ds, stack), epoch_end="rank")
for _ in range(2):
    for _batch in loader:
        pass
loader.close()
"""


@pytest.mark.slow
def test_two_jobs_sharing_one_l2_do_not_thrash_each_other(tmp_path, tokens_on_s3):
    import os
    import subprocess
    import sys

    from tierflow.testing import S3Endpoint

    url, proxy, at_rest, decoded = tokens_on_s3
    capacity = "30%"  # of the dataset at rest
    env = {**os.environ, **S3Endpoint(proxy.url).env()}

    def jobs(l2, seeds):
        proxy.reset_counters()
        running = [
            subprocess.Popen([sys.executable, "-c", JOB, url, proxy.url, str(l2), str(capacity), str(seed)], env=env)
            for seed in seeds
        ]
        assert all(p.wait(timeout=300) == 0 for p in running)
        return proxy.traffic().response_bytes(method="GET")

    alone = jobs(tmp_path / "alone", [1])
    together = jobs(tmp_path / "shared", [1, 2])
    print(f"two jobs: alone {alone / at_rest:.2f}x, together {together / at_rest:.2f}x the dataset over 2 epochs")
    assert together <= 1.1 * 2 * alone, (together / at_rest, alone / at_rest)


def _first_batches(data, batches=1000, **options):
    ds = TieredDataset(data, *specs_from({"batch_size": 16, "seq_len": 128, "seed": 11, **options}))
    ids = []
    for batch in ds:
        ids.append(batch.meta.sample_ids.copy())
        if len(ids) == batches:
            break
    return ds, np.concatenate(ids)


@pytest.mark.slow
def test_the_same_seed_gives_the_same_batches_with_no_tier_and_any_tier(tokens, tmp_path):
    """The order depends on the dataset, the seed and the options set, never on the cache (issue 37):
    the first 1,000 batches are the same read in place, through a stack with no tier, and through an L2
    of 5%, 30% and 120% of the bytes at rest or 20x the decoded dataset, in either form."""
    manifest = tierflow.open_dataset(tokens).manifest
    at_rest, decoded = sum(s.bytes for s in manifest.shards), sum(s.decoded_bytes for s in manifest.shards)
    reference, ids = _first_batches(str(tokens))
    assert reference.working_set.reading > 1
    _, bare = _first_batches(build_stack(str(tokens)).dataset())
    assert np.array_equal(bare, ids)
    for i, (capacity, form) in enumerate(
        [
            (0.05 * at_rest, "at_rest"),
            (0.30 * at_rest, "at_rest"),
            (1.20 * at_rest, "at_rest"),
            (0.30 * at_rest, "decoded"),
            (20 * decoded, "decoded"),
        ]
    ):
        stack = build_stack(str(tokens), [TierConfig("L2", str(tmp_path / f"l2-{i}"), int(capacity), form=form)])
        ds, got = _first_batches(stack.dataset())
        assert (ds.working_set.lanes, ds.working_set.window_shards) == (
            reference.working_set.lanes,
            reference.working_set.window_shards,
        )
        assert ds.order.config_hash == reference.order.config_hash, (capacity, form)
        assert np.array_equal(got, ids), (capacity, form)
        stack.close()
    # options the user sets are what changes the order, and a saved cursor resumes its own
    narrow, other = _first_batches(str(tokens), lanes=1, window_shards=1)
    assert not np.array_equal(other, ids)
    resumed = TieredDataset(
        str(tokens), BatchSpec(batch_size=16, seq_len=128), OrderSpec(seed=11), resume=next(iter(narrow)).meta.cursor
    )
    assert (resumed.working_set.lanes, resumed.working_set.window_shards) == (1, 1)


def test_the_staging_area_holds_the_working_set_at_rest_where_ram_is_short_and_the_order_stays(
    tokens, tmp_path, monkeypatch, caplog
):
    """The cache adapts to the order: with little memory headroom the staging area keeps the working
    set in its at-rest form (and says so) instead of the order narrowing; the batches are the same."""
    import tierflow.tiers.stack as stack_module

    _, ids = _first_batches(str(tokens), batches=32)
    manifest = tierflow.open_dataset(tokens).manifest
    at_rest = sum(s.bytes for s in manifest.shards)
    for headroom, form in ((None, "decoded"), (4 * at_rest, "at_rest")):
        monkeypatch.setattr(stack_module, "memory_headroom", lambda h=headroom: h)
        stack = build_stack(str(tokens), [TierConfig("L2", str(tmp_path / f"l2-{form}"), "5%")])
        assert stack.tiers[0].form == "at_rest" and stack.tiers[0].capacity == round(0.05 * at_rest)
        ds, got = _first_batches(stack.dataset(), batches=32)
        assert stack.staging_form == form and np.array_equal(got, ids)
        assert stack.staging_bytes >= ds.working_set.bytes  # the working set, in the form it stages
        stack.close()
    assert "holds it at rest instead" in caplog.text


def test_plan_states_sizes_against_the_bytes_at_rest_and_predicts_each_form(tokens, tmp_path, capsys, monkeypatch):
    from tierflow.commands.cli import main

    monkeypatch.setenv("COLUMNS", "250")  # rich wraps table headers to the terminal's width
    assert (
        main(
            [
                "plan",
                str(tokens),
                "--tier",
                f"L2={tmp_path / 'l2'}:30%",
                "--batch-size",
                "16",
                "--seq-len",
                "128",
                "--epochs",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "30% of the dataset at rest" in out and "form at_rest" in out
    assert "at_rest from below (this tier)" in out and "decoded from below" in out
    assert "of the dataset at rest" in out and "the same at any capacity" in out


@pytest.mark.slow
def test_the_stager_counts_its_fetches_in_the_epoch_they_serve(few_tokens, tmp_path):
    """The cold epoch's lookahead into the next is the next epoch's bytes (issue 37): counted by the
    epoch of the use each fetch was staged for, the cold epoch reads each shard at most once."""
    from tierflow.telemetry.tier_figures import STACK_SOURCE_BYTES

    at_rest = sum(s.bytes for s in tierflow.open_dataset(few_tokens).manifest.shards)
    stack = build_stack(str(few_tokens), [TierConfig("L2", str(tmp_path / "l2"), "30%")])
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=128))
    stager = Stager(ds, stack)
    loader = Loader(ds, stager=stager)
    source = stack.registry.counter(STACK_SOURCE_BYTES, {"tier": "source"})
    loader.start_prefetch()  # the stager's first fetch before the loop: on a loaded machine the loop
    waited = time.monotonic() + 60  # could otherwise read the whole epoch before the stager's thread ran
    while not stager.source_bytes_by_epoch and time.monotonic() < waited:
        time.sleep(0.01)
    windows, staged, mark = [], [], (0, 0)
    for _ in range(2):
        for _batch in loader:
            time.sleep(0.0005)
        now = (int(source.value), sum(stager.source_bytes_by_epoch.values()))
        windows.append(now[0] - mark[0])
        staged.append(now[1] - mark[1])
        mark = now
    loader.close()
    stack.close()
    assert set(stager.source_bytes_by_epoch) <= {0, 1, 2} and stager.source_bytes_by_epoch.get(0, 0) > 0
    served = [w - s + stager.source_bytes_by_epoch.get(e, 0) for e, (w, s) in enumerate(zip(windows, staged))]
    assert served[0] <= at_rest, (served[0] / at_rest, windows[0] / at_rest)  # each shard once, lookahead aside
    assert sum(served) <= sum(windows)  # what the last epoch staged for the next is not in either
