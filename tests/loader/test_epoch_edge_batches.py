"""One `for` per epoch under every batcher (issue 39): counted per `for`, the batches whose samples
belong to another epoch are at most one, the `for`'s last, and only under remainder="carry";
`len()` and `epoch_lengths` count each `for` exactly, and a resume in the middle of a sorted group
that straddles the edge continues the same batches with the same lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierflow.loader import (
    AspectBuckets,
    BatchSpec,
    LengthBuckets,
    Loader,
    OrderSpec,
    TieredDataset,
    WorldPosition,
)

from corpora import pack_pictures

EPOCHS = 3


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    """300 small JPEGs in a few shards: the image set of the issue (its edge groups straddle epochs)."""
    return pack_pictures(tmp_path_factory.mktemp("edge_pictures"), count=300, target_shard_bytes=256 << 10)


def spec(kind: str) -> BatchSpec:
    """The batchers of the issue; sizes chosen so that no epoch ends on a batch or group edge."""
    if kind == "windows":
        return BatchSpec(batch_size=7, seq_len=64)
    if kind == "budget":
        return BatchSpec(batch_size=8, max_tokens=1024)
    if kind == "buckets":
        return BatchSpec(batch_size=6, batcher=LengthBuckets(max_length=1024, group=4, column="tokens"))
    return BatchSpec(batch_size=16, batcher=AspectBuckets(group=4, select=["caption"]))


def path_of(kind: str, docs: str, pictures: Path) -> str:
    return str(pictures) if kind == "aspect" else docs


def fors(loader: Loader, count: int = EPOCHS) -> list[tuple[int | None, list]]:
    """(len() before the `for`, None for a token budget; its batches' metas) of `count` fors."""
    out = []
    for _ in range(count):
        try:
            expected: int | None = len(loader)
        except TypeError:
            expected = None
        out.append((expected, [meta for _, meta in loader]))
    return out


def foreign(metas: list, epoch: int) -> list[int]:
    """Positions in a `for` over `epoch` of the batches holding samples of another epoch."""
    return [k for k, meta in enumerate(metas) if (np.asarray(meta.epochs) != epoch).any()]


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("kind", ["windows", "budget", "buckets", "aspect"])
def test_each_for_holds_its_epoch_and_at_most_its_last_batch_mixes_the_next(long_tailed_docs, pictures, kind, lanes):
    """Before: a sorted group straddling the edge went whole to the older epoch's `for` (up to
    group - 1 batches of the next epoch's samples in it, counted by len()), and a token budget's
    first-fit made two batches of two epochs at some edges."""
    path = path_of(kind, long_tailed_docs, pictures)
    loader = Loader(TieredDataset(path, spec(kind), OrderSpec(lanes=lanes)), return_meta=True)
    lengths = loader.epoch_lengths(EPOCHS) if kind != "budget" else None
    seen: dict[int, list[int]] = {}
    ran = fors(loader)
    for epoch, (expected, metas) in enumerate(ran):
        others = foreign(metas, epoch)
        assert others in ([], [len(metas) - 1]), f"for {epoch}: batches {others} of {len(metas)} hold other epochs"
        if others:  # the edge batch: this epoch's last samples, completed by the next one's first
            assert set(np.asarray(metas[-1].epochs).tolist()) == {epoch, epoch + 1}
        assert expected is None or expected == len(metas)
        assert {m.epoch for m in metas} == {epoch}
        for meta in metas:
            for e, i in zip(np.asarray(meta.epochs).tolist(), np.asarray(meta.sample_ids).tolist()):
                seen.setdefault(e, []).append(i)
    assert lengths is None or lengths == [len(metas) for _, metas in ran]
    total = loader.dataset.num_order_samples
    for epoch in range(EPOCHS):
        assert sorted(seen[epoch]) == list(range(total))  # each epoch whole, nothing repeated


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize("kind", ["budget", "buckets"])
def test_without_carry_no_batch_holds_another_epoch(long_tailed_docs, pictures, kind, remainder):
    loader = Loader(
        TieredDataset(long_tailed_docs, spec(kind), OrderSpec(lanes=4, remainder=remainder)), return_meta=True
    )
    for epoch, (expected, metas) in enumerate(fors(loader, 2)):
        assert foreign(metas, epoch) == []
        assert expected is None or expected == len(metas)


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("kind", ["buckets", "aspect"])
def test_a_resume_inside_the_edge_group_continues_the_same_batches_and_lengths(long_tailed_docs, pictures, kind, lanes):
    """Stopped at each batch of the group that straddles the first edge (its older parts, then its
    newer ones: the next `for`'s first), saved and resumed: len(), epoch_lengths and the batches of
    the rest of both fors are those of the run that did not stop."""
    path = path_of(kind, long_tailed_docs, pictures)

    def make() -> Loader:
        return Loader(TieredDataset(path, spec(kind), OrderSpec(lanes=lanes)), return_meta=True)

    reference = fors(make(), 2)
    first, second = len(reference[0][1]), len(reference[1][1])
    group = spec(kind).batcher.group  # type: ignore[union-attr]
    assert reference[1][1][0].epoch == 1
    for stop in range(first - group + 1, first + group):
        loader = make()
        consumed = 0
        for _ in range(2):
            for _ in loader:
                consumed += 1
                if consumed == stop:
                    break
            if consumed == stop:
                break
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        in_second = stop >= first
        assert len(resumed) == (second if in_second else first)
        assert resumed.epoch_lengths(1 if in_second else 2) == ([second] if in_second else [first, second])
        rest = fors(resumed, 1 if in_second else 2)
        for epoch, (_, metas) in enumerate(rest, start=1 if in_second else 0):
            assert foreign(metas, epoch) in ([], [len(metas) - 1])
        want = reference[1][1][stop - first :] if in_second else reference[0][1][stop:] + reference[1][1]
        got = [m for _, metas in rest for m in metas]
        assert [m.sample_ids.tolist() for m in got] == [m.sample_ids.tolist() for m in want], stop
        assert [m.epoch for m in got] == [m.epoch for m in want]


@pytest.mark.parametrize("kind", ["buckets", "aspect"])
def test_ranks_count_the_edge_groups_parts_alike(long_tailed_docs, pictures, kind):
    """Three ranks of a node: with epoch_end="rank" each rank's `for` holds its own epoch's parts and
    len() says how many; with "agree" every rank stops at the same step (a rank's parts of an epoch past the
    fewest open its next `for`, as for any batcher)."""
    path = path_of(kind, long_tailed_docs, pictures)
    for agree in (False, True):
        ranks = [
            Loader(
                TieredDataset(path, spec(kind), OrderSpec(lanes=4), world=WorldPosition(0, 1, r, 3)),
                return_meta=True,
                epoch_end="agree" if agree else "rank",
            )
            for r in range(3)
        ]
        counted = []
        for loader in ranks:
            lengths = loader.epoch_lengths(EPOCHS)
            ran = fors(loader)
            assert lengths == [len(metas) for _, metas in ran] == [expected for expected, _ in ran]
            counted.append(lengths)
            for epoch, (_, metas) in enumerate(ran):
                assert agree or foreign(metas, epoch) in ([], [len(metas) - 1])
        assert not agree or len({tuple(c) for c in counted}) == 1


@pytest.mark.parametrize("kind", ["budget", "buckets"])
def test_dataloader_workers_end_each_for_where_the_main_process_does(long_tailed_docs, kind):
    """Two workers plan the same edges: the same batches per `for`, each labelled its epoch, and
    at most the `for`'s last batch holds another epoch."""

    def run(workers: int) -> list[list]:
        loader = Loader(
            TieredDataset(long_tailed_docs, spec(kind), OrderSpec(lanes=4)), num_workers=workers, return_meta=True
        )
        return [metas for _, metas in fors(loader, 2)]

    with_workers, alone = run(2), run(0)
    for epoch, metas in enumerate(with_workers):
        assert foreign(metas, epoch) in ([], [len(metas) - 1])
    assert [[(m.epoch, m.sample_ids.tolist()) for m in metas] for metas in with_workers] == [
        [(m.epoch, m.sample_ids.tolist()) for m in metas] for metas in alone
    ]
