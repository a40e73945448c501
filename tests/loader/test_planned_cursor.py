"""Cursors of planned batches are computed only when asked, and are the cursors they stand for.

A plan yields `Selection`s whose `planned` is a `PlannedCursor`: resolving it (in any order, any
number of times) gives exactly the `LoaderCursor` the stream computes eagerly; pickled it travels
resolved, or, from a `compact` stream, as a few integers that the main process resolves against
its own stream from the same start (`TieredDataset.resolve_cursor`).
"""

from __future__ import annotations

import itertools
import pickle

import pytest
from torch.utils.data import DataLoader

from tierflow.errors import CursorError
from tierflow.loader import LengthBuckets, LoaderCursor, TieredDataset, BatchSpec, OrderSpec
from tierflow.loader.plan import PlannedCursor

PARTITIONS = 4


@pytest.fixture
def packed(long_tailed_docs) -> str:
    return long_tailed_docs


def eager_cursors(ds: TieredDataset, selections) -> list[dict]:
    """What plan_groups used to attach to each batch: the stream's cursor, computed at once."""
    stream = ds.stream()
    group = ds.batcher.batches_per_group
    skip = ds.cursor.skip if ds.cursor is not None else 0
    out = []
    for s in selections:
        g, part = divmod(skip + s.index, group)
        cursor = stream.cursor(g) if part + 1 == group else stream.cursor(g - 1, skip=part + 1)
        out.append(cursor.to_dict())
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda p: TieredDataset(p, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS)),
        lambda p: TieredDataset(
            p, BatchSpec(batch_size=4, batcher=LengthBuckets(max_length=512, group=3)), OrderSpec(partitions=PARTITIONS)
        ),
        lambda p: TieredDataset(p, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS), eval=True),
    ],
)
def test_planned_cursors_resolve_to_the_eager_ones_in_any_order(packed, make):
    ds = make(packed)
    ctx = ds._open()
    selections = list(itertools.islice(ds.batcher.plan(ctx, ds.stream(), ds.cursor), 40))
    assert all(isinstance(s.planned, PlannedCursor) and not s.planned.resolved for s in selections)
    want = eager_cursors(ds, selections)
    order = list(range(len(selections)))[::-3] + list(range(len(selections)))  # backwards, then forwards again
    for k in order:
        assert selections[k].cursor.to_dict() == want[k]
    assert all(s.planned.resolved for s in selections)
    # and from a cursor inside the run: the plan resumed there resolves to the same cursors
    resumed = make(packed)
    resumed.load_state_dict(selections[16].cursor)
    again = list(itertools.islice(resumed.batcher.plan(resumed._open(), resumed.stream(), resumed.cursor), 20))
    assert [s.cursor.to_dict() for s in again] == want[17:37]


def test_a_pickled_planned_cursor_travels_resolved_unless_its_stream_is_compact(packed):
    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS))
    plain = list(itertools.islice(ds.batcher.plan(ds._open(), ds.stream(), None), 5))
    copy = pickle.loads(pickle.dumps(plain[3].planned))
    assert copy.resolved and copy.resolve().to_dict() == plain[3].cursor.to_dict()

    stream = ds.stream()
    stream.compact = True
    compact = list(itertools.islice(ds.batcher.plan(ds._open(), stream, None), 5))
    data = pickle.dumps(compact[3].planned)
    assert len(data) < 200 and not compact[3].planned.resolved  # a few integers, the stream stays home
    travelled = pickle.loads(data)
    assert not travelled.resolved
    with pytest.raises(CursorError, match="resolve"):
        travelled.resolve()
    assert ds.resolve_cursor(travelled).to_dict() == plain[3].cursor.to_dict()
    elsewhere = TieredDataset(
        packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS), resume=plain[1].cursor
    )
    with pytest.raises(CursorError, match="another start"):
        elsewhere.resolve_cursor(pickle.loads(data))


@pytest.mark.parametrize("compact", [False, True])
def test_cursors_from_dataloader_workers_are_the_in_process_ones(packed, compact):
    def dataset():
        return TieredDataset(
            packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS), max_batches=12
        )

    want = [b.meta.cursor.to_dict() for b in dataset()]
    ds = dataset()
    ds.compact_cursors = compact
    got = []
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        planned = batch.meta.planned
        assert planned.resolved is not compact
        cursor = ds.resolve_cursor(planned)
        assert isinstance(cursor, LoaderCursor)
        got.append(cursor.to_dict())
    assert got == want
