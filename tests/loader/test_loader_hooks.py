"""Users' own batch assembly (`collate=`), and misuse that gets a message saying what to do."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

import tierflow
from tierflow.errors import CursorMismatchError, LoaderMisuseError, TierflowError
from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec

PARTITIONS = 4


def longest_first(samples: list[dict]) -> dict:
    """A user's collate: ids padded to the longest sample, longest first, plus the lengths."""
    samples = sorted(samples, key=lambda s: -len(s["tokens"]))
    width = len(samples[0]["tokens"])
    ids = np.zeros((len(samples), width), dtype=np.int64)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["tokens"])] = sample["tokens"]
    return {"ids": ids, "lengths": np.array([len(s["tokens"]) for s in samples]), "n": len(samples)}


def drop_short(sample: dict) -> bool:
    return len(sample["tokens"]) >= 8


def test_collate_assembles_each_batch_from_the_filtered_samples_in_workers(long_tailed_docs):
    def make():
        return TieredDataset(
            long_tailed_docs,
            BatchSpec(batch_size=8, columns=["tokens"], filter=drop_short, collate=longest_first),
            OrderSpec(partitions=PARTITIONS),
            max_batches=6,
        )

    plain = TieredDataset(
        long_tailed_docs,
        BatchSpec(batch_size=8, columns=["tokens"], filter=drop_short),
        OrderSpec(partitions=PARTITIONS),
        max_batches=6,
    )
    expected = [b.data for b in plain]
    with Loader(make(), num_workers=2, return_meta=True) as loader:
        got = list(loader)
    assert len(got) == 6
    for want, (batch, meta) in zip(expected, got):
        assert set(batch) == {"ids", "lengths", "n", "mask"}  # the user's keys, and the mask beside them
        lengths = sorted((len(t) for t in want["tokens"]), reverse=True)
        assert batch["lengths"].tolist() == lengths and batch["n"] == len(lengths) == meta.sample_ids.size
        assert batch["ids"].shape == (len(lengths), lengths[0]) and min(lengths) >= 8


def test_collate_must_return_a_dict(long_tailed_docs):
    ds = TieredDataset(
        long_tailed_docs, BatchSpec(batch_size=4, columns=["tokens"], collate=len), OrderSpec(partitions=PARTITIONS)
    )
    with pytest.raises(TypeError, match="must return the batch as a dict"):
        next(iter(ds))
    with pytest.raises(ValueError, match="collate"):
        TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=32, collate=longest_first))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_with_a_batch_size_is_told_to_use_loader(long_tailed_docs, workers):
    ds = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=32), OrderSpec(partitions=PARTITIONS))
    for dataloader in (DataLoader(ds, batch_size=8, num_workers=workers), DataLoader(ds, num_workers=workers)):
        with pytest.raises(LoaderMisuseError, match=r"Loader\(ds.*batch_size=None"):
            next(iter(dataloader))
    item = next(iter(DataLoader(ds, batch_size=None, num_workers=workers)))  # the documented recipe
    assert item.data["input_ids"].shape == (4, 32)


def test_a_cursor_from_another_dataset_names_both(long_tailed_docs, tmp_path):
    (tmp_path / "other.jsonl").write_text("".join(f'{{"text": "other document {i} " }}\n' for i in range(300)))
    other = tmp_path / "other"
    tierflow.pack([tmp_path / "other.jsonl"], other, tokenizer="bytes", workers=1)
    loader = Loader(TieredDataset(other, BatchSpec(batch_size=4, seq_len=16), OrderSpec(partitions=1)))
    next(iter(loader))
    saved = loader.state_dict()
    ours = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=16), OrderSpec(partitions=1))
    with pytest.raises(CursorMismatchError) as error:
        ours.load_state_dict(saved)
    message = str(error.value)
    ours_id, theirs = ours.manifest.dataset_id, saved["cursor"]["order"]["config"]["dataset_id"].split("/")[0]
    assert ours_id != theirs and ours_id in message and theirs in message
    assert "resume=None" in message and isinstance(error.value, TierflowError)
