"""One small adapter per system: its own writer, its own loader, its own state and resume.

Each adapter uses the system the way its documentation shows, with its defaults, except what
the benchmark fixes for everyone: the shard size, the batch size, shuffle on with a fixed seed,
zstd at rest where the issue names it (Streaming's MDSWriter), the local cache limit where one
is measured, and the number of DataLoader workers.

- tierflow: `tierflow.pack(..., tokenizer="bytes")`; `TieredDataset(..., seq_len=2048)` over a
  tier stack (`build_stack` + an L2 `TierConfig`, decoded form) with `Loader` and a `Stager`.
- MosaicML Streaming: `MDSWriter(columns=..., compression="zstd", size_limit=...)`;
  `StreamingDataset(local=..., remote=..., shuffle=True, shuffle_seed=..., batch_size=...,
  cache_limit=...)` with `StreamingDataLoader`; resume through `state_dict(num_samples, ...)`.
- LitData: `litdata.optimize(fn, inputs, output_dir, chunk_bytes=..., num_workers=2,
  item_loader=TokensLoader())` (its recipe for LLM pretraining data) and
  `StreamingDataset(input_dir, item_loader=TokensLoader(block_size=2048), shuffle=True, seed=...,
  max_cache_size=..., cache_dir=...)` with `StreamingDataLoader`.

A loader here is anything iterable over batches for one epoch; `Reader.epoch()` makes a fresh
iterator over the next epoch.

The raw path (`System.raw_loader`, measures.raw) reads local data at each system's defaults, one
epoch of 8-sample batches, tokens or text, in the main process or with 2 DataLoader workers:

- tierflow: `tierflow.open_loader(local_dir, batch_size=8, seq_len=2048)` (tokens) or
  `open_loader(local_dir, batch_size=8)` (the documents); a local dir with no tiers is read
  directly; `num_workers=2` for the worker rows.
- Streaming and LitData: their StreamingDataset over the local dir + StreamingDataLoader (LitData's
  documents without TokensLoader: one `{"text": ...}` item each).
- WebDataset: tar shards written by `wds.ShardWriter(maxsize=shard bytes)` (`tokens.npy` /
  `txt` members), read as its docs show (shardshuffle=True is 100 in 1.0): `wds.WebDataset(urls, shardshuffle=100, seed=...)
  .shuffle(1000).decode().to_tuple(...).batched(8)` through `wds.WebLoader(..., batch_size=None)`.
- the in-RAM list (the bound): the same samples preloaded in a Python list (numpy arrays / str),
  a seeded permutation batched by 8 through `default_collate` in the main process, a plain
  `DataLoader(list, batch_size=8, shuffle=True)` with 2 workers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np

from compat import guard_torchvision
from corpus import SEQ_LEN, byte_tokens, token_samples

TORCHVISION = guard_torchvision()

BATCH = 8  # token batches: 8 x 2048 tokens for every system
INT_BATCH = 256  # the resume datasets of 8-byte samples


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {}
    for dist in (
        "tierflow",
        "mosaicml-streaming",
        "litdata",
        "webdataset",
        "torch",
        "numpy",
        "pyarrow",
        "boto3",
        "obstore",
        "moto",
    ):
        try:
            out[dist] = version(dist)
        except Exception:
            out[dist] = "-"
    out["torchvision"] = TORCHVISION
    return out


class System:
    name = ""
    remote_scheme = "s3"

    # -- conversion ----------------------------------------------------------------------
    def convert_tokens(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        raise NotImplementedError

    def convert_docs(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        raise NotImplementedError

    def convert_ints(self, samples: int, out: Path, shard_bytes: int) -> None:
        raise NotImplementedError

    # -- reading -------------------------------------------------------------------------
    def preload(self) -> None:
        """Import what the reader needs (torch included), so a timed start-up excludes imports."""
        import torch  # noqa: F401

    def reader(
        self,
        data: str,
        cache: Path,
        *,
        kind: str = "tokens",
        workers: int = 0,
        seed: int = 17,
        cache_limit: int | None = None,
        endpoint: str | None = None,
        resume: Any = None,
        stager: bool = True,
    ) -> Reader:
        raise NotImplementedError

    # -- the raw path: local data, the system's defaults, one epoch --------------------------
    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        """An iterable over one epoch of BATCH-sample batches of `kind` ("tokens" or "text")."""
        raise NotImplementedError

    def raw_count(self, batch: Any) -> int:
        """The samples in one of raw_loader's batches."""
        raise NotImplementedError


class Reader:
    """An open dataset + loader of one system."""

    def epoch(self) -> Iterator[Any]:
        raise NotImplementedError

    def state_at(self, samples: int) -> Any:
        """The state this system's loader saves after `samples` samples of the first epoch (JSON-able)."""
        raise NotImplementedError

    def epoch_samples(self) -> int:
        raise NotImplementedError

    def shard_uses(self, epochs: int) -> list[tuple[str, int]] | None:
        """(shard key, cached bytes) in the order the shards are used over `epochs` epochs, when known."""
        return None

    def close(self) -> None:
        pass


# ============================================================================ tierflow
class Tierflow(System):
    name = "tierflow"

    def preload(self) -> None:
        import torch  # noqa: F401

        import tierflow.tiers.stager
        import tierflow.tiers  # noqa: F401
        from tierflow.loader import Loader, TieredDataset  # noqa: F401

    def convert_tokens(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        import tierflow

        tierflow.pack(
            [files[0].parent],
            out,
            tokenizer="bytes",
            target_shard_bytes=shard_bytes,
            compression="zstd",
            workers=2,
            overwrite=True,
        )

    def convert_docs(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        import tierflow

        tierflow.pack(
            [files[0].parent], out, target_shard_bytes=shard_bytes, compression="zstd", workers=2, overwrite=True
        )

    def convert_ints(self, samples: int, out: Path, shard_bytes: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        import tierflow

        out.mkdir(parents=True, exist_ok=True)
        source = out.parent / f"{out.name}.parquet"
        pq.write_table(pa.table({"x": np.arange(samples, dtype=np.int64)}), source, compression="none")
        tierflow.pack([source], out, target_shard_bytes=shard_bytes, compression="zstd", workers=2, overwrite=True)
        source.unlink()

    def reader(
        self,
        data: str,
        cache: Path,
        *,
        kind: str = "tokens",
        workers: int = 0,
        seed: int = 17,
        cache_limit: int | None = None,
        endpoint: str | None = None,
        resume: Any = None,
        stager: bool = True,
    ) -> Reader:
        return TierflowReader(data, cache, kind, workers, seed, cache_limit, endpoint, resume, stager)

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        import tierflow

        shape = {"seq_len": SEQ_LEN} if kind == "tokens" else {}
        return tierflow.open_loader(data, batch_size=BATCH, num_workers=workers, seed=seed, **shape)

    def raw_count(self, batch: Any) -> int:
        return int(batch["mask"].sum())  # False on the padding of a partition's last batch


class TierflowReader(Reader):
    def __init__(
        self,
        data: str,
        cache: Path,
        kind: str,
        workers: int,
        seed: int,
        cache_limit: int | None,
        endpoint: str | None,
        resume: Any,
        stager: bool,
    ) -> None:
        from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
        from tierflow.tiers.stager import Stager
        from tierflow.tiers import TierConfig, build_stack

        self.kind = kind
        capacity = cache_limit if cache_limit is not None else 1.0
        # defaults: the order sizes its working set to the cache
        self.stack = build_stack(data, [TierConfig("L2", str(cache), capacity)], endpoint_url=endpoint)
        if kind == "tokens":
            self.ds = TieredDataset(
                self.stack.dataset(), BatchSpec(batch_size=BATCH, seq_len=SEQ_LEN), OrderSpec(seed=seed), resume=resume
            )
        else:
            self.ds = TieredDataset(
                self.stack.dataset(),
                BatchSpec(batch_size=INT_BATCH, columns=["x"]),
                OrderSpec(seed=seed),
                resume=resume,
            )
        self.batch = self.ds.batch_size
        self.loader = Loader(
            self.ds, num_workers=workers, stager=Stager(self.ds, self.stack) if stager else None, endless=True
        )
        if stager:
            self.loader.start_prefetch()
        self._per_epoch = self.ds.num_order_samples // self.batch
        self._iterator: Iterator[Any] | None = None

    def warm(self) -> None:
        for info in self.stack.manifest().shards:
            self.stack.ensure(info).release()

    def epoch(self) -> Iterator[Any]:
        # the endless stream (epochs follow each other, workers kept); an epoch is its share of batches
        if self._iterator is None:
            self._iterator = iter(self.loader)
        for _ in range(self._per_epoch):
            yield next(self._iterator)

    def epoch_samples(self) -> int:
        return self._per_epoch * self.batch

    def state_at(self, samples: int) -> Any:
        return self.ds.stream().cursor(samples // self.batch - 1).to_dict()

    def shard_uses(self, epochs: int) -> list[tuple[str, int]]:
        shards = self.stack.manifest().shards
        uses = self.ds.future_shard_uses(None, horizon_batches=epochs * self._per_epoch)
        return [(shards[u.shard].name, shards[u.shard].decoded_bytes) for u in uses]

    def close(self) -> None:
        self.loader.close()
        self.stack.close()


# ============================================================================ MosaicML Streaming
class Streaming(System):
    name = "streaming"

    def preload(self) -> None:
        from streaming import StreamingDataLoader, StreamingDataset  # noqa: F401

    def convert_tokens(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        from streaming import MDSWriter

        with MDSWriter(
            out=str(out),
            columns={"tokens": f"ndarray:uint16:{SEQ_LEN}"},
            compression="zstd",
            size_limit=shard_bytes,
            progress_bar=False,
        ) as writer:
            for sample in token_samples(files):
                writer.write({"tokens": sample})

    def convert_docs(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        from streaming import MDSWriter

        with MDSWriter(
            out=str(out), columns={"text": "str"}, compression="zstd", size_limit=shard_bytes, progress_bar=False
        ) as writer:
            for path in files:
                writer.write({"text": path.read_text()})

    def convert_ints(self, samples: int, out: Path, shard_bytes: int) -> None:
        from streaming import MDSWriter

        with MDSWriter(
            out=str(out), columns={"x": "int64"}, compression="zstd", size_limit=shard_bytes, progress_bar=False
        ) as writer:
            for i in range(samples):
                writer.write({"x": i})

    def reader(
        self,
        data: str,
        cache: Path,
        *,
        kind: str = "tokens",
        workers: int = 0,
        seed: int = 17,
        cache_limit: int | None = None,
        endpoint: str | None = None,
        resume: Any = None,
        stager: bool = True,
    ) -> Reader:
        return StreamingReader(data, cache, kind, workers, seed, cache_limit, endpoint, resume)

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = StreamingDataset(local=data, shuffle=True, shuffle_seed=seed, batch_size=BATCH)
        for shard in range(ds.num_shards):  # warm: every zstd shard decompressed in place (kept after the first run)
            ds.prepare_shard(shard)
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)

    def raw_count(self, batch: Any) -> int:
        return len(batch["tokens"] if "tokens" in batch else batch["text"])


class StreamingReader(Reader):
    def __init__(
        self,
        data: str,
        cache: Path,
        kind: str,
        workers: int,
        seed: int,
        cache_limit: int | None,
        endpoint: str | None,
        resume: Any,
    ) -> None:
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        if endpoint:
            os.environ["S3_ENDPOINT_URL"] = endpoint
        self.batch = BATCH if kind == "tokens" else INT_BATCH
        remote = data if "://" in data else None
        local = str(cache) if remote else data
        self.ds = StreamingDataset(
            local=local, remote=remote, shuffle=True, shuffle_seed=seed, batch_size=self.batch, cache_limit=cache_limit
        )
        self.loader = StreamingDataLoader(self.ds, batch_size=self.batch, num_workers=workers)
        if resume is not None:
            self.loader.load_state_dict(resume)

    def warm(self) -> None:
        for shard in range(self.ds.num_shards):
            self.ds.prepare_shard(shard)

    def epoch(self) -> Iterator[Any]:
        return iter(self.loader)

    def epoch_samples(self) -> int:
        return self.ds.num_samples // self.batch * self.batch

    def state_at(self, samples: int) -> Any:
        # what StreamingDataLoader.state_dict() saves after `samples` samples: it calls
        # dataset.state_dict(num_samples_yielded * world_size, from_beginning=False); the epoch must have begun
        iterator = iter(self.loader)
        next(iterator)
        state = self.ds.state_dict(samples, from_beginning=True)
        del iterator
        return state

    def shard_uses(self, epochs: int) -> list[tuple[str, int]] | None:
        """Shards in the order the sample ids of each epoch reach them (one node, this worker layout)."""
        uses: list[tuple[str, int]] = []
        world = self.ds._unique_rank_world if hasattr(self.ds, "_unique_rank_world") else None
        try:
            from streaming.base.world import World

            world = world or World.detect()
            for epoch in range(epochs):
                ids = np.asarray(self.ds._get_work(epoch, 0)).flatten()  # (nodes, ranks, workers, batches, batch)
                ids = ids[ids >= 0]
                ends = np.cumsum(self.ds.samples_per_shard)
                shards = np.searchsorted(ends, ids, side="right")
                change = np.flatnonzero(np.diff(shards)) + 1
                for s in shards[np.r_[0, change]]:
                    uses.append((f"shard.{int(s):05d}", int(self.ds.shards[int(s)].get_raw_size())))
        except Exception as e:
            print(f"streaming shard order unavailable: {e}")
            return None
        return uses

    def close(self) -> None:
        del self.loader


# ============================================================================ LitData
def _litdata_tokens(path: str):
    import torch

    yield torch.from_numpy(byte_tokens(Path(path).read_bytes()))


def _litdata_doc(path: str) -> dict:
    return {"text": Path(path).read_text()}


def _litdata_ints(span: tuple[int, int]):
    for i in range(*span):
        yield {"x": i}


class LitData(System):
    name = "litdata"

    def preload(self) -> None:
        from litdata import StreamingDataLoader, StreamingDataset  # noqa: F401

    def convert_tokens(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        from litdata import TokensLoader, optimize

        optimize(
            fn=_litdata_tokens,
            inputs=[str(f) for f in files],
            output_dir=str(out),
            chunk_bytes=shard_bytes,
            item_loader=TokensLoader(),
            num_workers=2,
            verbose=False,
            mode="overwrite",
        )

    def convert_docs(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        from litdata import optimize

        optimize(
            fn=_litdata_doc,
            inputs=[str(f) for f in files],
            output_dir=str(out),
            chunk_bytes=shard_bytes,
            num_workers=2,
            verbose=False,
            mode="overwrite",
        )

    def convert_ints(self, samples: int, out: Path, shard_bytes: int) -> None:
        from litdata import optimize

        step = max(1, samples // 64)
        spans = [(a, min(samples, a + step)) for a in range(0, samples, step)]
        optimize(
            fn=_litdata_ints,
            inputs=spans,
            output_dir=str(out),
            chunk_bytes=shard_bytes,
            num_workers=2,
            verbose=False,
            mode="overwrite",
        )

    def reader(
        self,
        data: str,
        cache: Path,
        *,
        kind: str = "tokens",
        workers: int = 0,
        seed: int = 17,
        cache_limit: int | None = None,
        endpoint: str | None = None,
        resume: Any = None,
        stager: bool = True,
    ) -> Reader:
        return LitDataReader(data, cache, kind, workers, seed, cache_limit, endpoint, resume)

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        options: dict[str, Any] = {"item_loader": TokensLoader(block_size=SEQ_LEN)} if kind == "tokens" else {}
        ds = StreamingDataset(data, shuffle=True, seed=seed, **options)
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)

    def raw_count(self, batch: Any) -> int:
        return len(batch["text"]) if isinstance(batch, dict) else len(batch)


class LitDataReader(Reader):
    def __init__(
        self,
        data: str,
        cache: Path,
        kind: str,
        workers: int,
        seed: int,
        cache_limit: int | None,
        endpoint: str | None,
        resume: Any,
    ) -> None:
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        self.batch = BATCH if kind == "tokens" else INT_BATCH
        options: dict[str, Any] = dict(shuffle=True, seed=seed)
        if kind == "tokens":
            options["item_loader"] = TokensLoader(block_size=SEQ_LEN)
        if "://" in data:
            if endpoint and endpoint.startswith("http://"):
                # the loopback S3 speaks plain http; LitData's obstore client options do not allow it
                # (real S3 is https). Allow it, keeping LitData's own fast path (obstore) in use.
                from litdata.streaming import downloader

                downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
            options["cache_dir"] = str(cache)
            options["storage_options"] = {"endpoint_url": endpoint} if endpoint else {}
        if cache_limit is not None:
            options["max_cache_size"] = int(cache_limit)
        self.ds = StreamingDataset(data, **options)
        self.loader = StreamingDataLoader(self.ds, batch_size=self.batch, num_workers=workers)
        self.workers = workers
        if resume is not None:
            self.loader.load_state_dict(resume)

    def warm(self) -> None:
        pass  # a local input_dir is read in place, uncompressed: warm once the page cache is

    def epoch(self) -> Iterator[Any]:
        return iter(self.loader)

    def epoch_samples(self) -> int:
        return len(self.ds) // self.batch * self.batch

    def state_at(self, samples: int) -> Any:
        # what StreamingDataLoader.state_dict() saves after `samples` samples
        iterator = iter(self.loader)
        next(iterator)
        state = self.loader.state_dict()
        state["num_samples_yielded"] = samples
        state["dataset"] = self.ds.state_dict(samples, self.workers, self.batch)
        state["dataset"]["num_samples_yielded"] = samples
        del iterator
        return state

    def close(self) -> None:
        del self.loader


# ============================================================================ WebDataset (raw path only)
class WebDataset(System):
    """Tar shards by `wds.ShardWriter`, read by `wds.WebDataset` as its README shows. Only the raw
    path measures it: it has no local cache limit, resume state or S3 adapter here."""

    name = "webdataset"
    KEYS = {"tokens": "tokens.npy", "text": "txt"}

    def preload(self) -> None:
        import webdataset  # noqa: F401

    def _write(self, out: Path, shard_bytes: int, key: str, values: Any) -> None:
        import webdataset as wds

        out.mkdir(parents=True, exist_ok=True)
        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=shard_bytes, verbose=0) as sink:
            for i, value in enumerate(values):
                sink.write({"__key__": f"{i:09d}", key: value})

    def convert_tokens(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        self._write(out, shard_bytes, self.KEYS["tokens"], token_samples(files))

    def convert_docs(self, files: list[Path], out: Path, shard_bytes: int) -> None:
        self._write(out, shard_bytes, self.KEYS["text"], (path.read_text() for path in files))

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        import webdataset as wds

        urls = sorted(str(p) for p in Path(data).glob("*.tar"))
        dataset = (
            wds.WebDataset(urls, shardshuffle=100, seed=seed)
            .shuffle(1000, seed=seed)
            .decode()
            .to_tuple(self.KEYS[kind])
            .batched(BATCH)
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    def raw_count(self, batch: Any) -> int:
        return len(batch[0])


# ============================================================================ the in-RAM list (the bound)
class InRam(System):
    """The same samples preloaded in a Python list: the bound a loader reading storage can approach.
    `data` is the corpus root (the documents as str, or token_samples as numpy arrays)."""

    name = "inram"

    def samples(self, data: str, kind: str) -> list[Any]:
        from corpus import MANIFEST
        import json

        meta = json.loads((Path(data) / MANIFEST).read_text())
        files = [Path(data) / "docs" / name for name in meta["files"]]
        if kind == "tokens":
            return [row.copy() for row in token_samples(files)]
        return [path.read_text() for path in files]

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        import torch
        from torch.utils.data import DataLoader, default_collate

        samples = self.samples(data, kind)
        if workers:
            return DataLoader(
                samples,
                batch_size=BATCH,
                shuffle=True,
                num_workers=workers,
                generator=torch.Generator().manual_seed(seed),
            )

        class Direct:
            def __iter__(self) -> Iterator[Any]:
                order = np.random.default_rng(seed).permutation(len(samples))
                for i in range(0, len(order), BATCH):
                    yield default_collate([samples[j] for j in order[i : i + BATCH]])

        return Direct()

    def raw_count(self, batch: Any) -> int:
        return len(batch)


# ============================================================================ the hand-written loader
class Handmade(System):
    """What a user writes by hand (nanoGPT's reader): the same samples in one flat file, a numpy memmap
    behind torch's DataLoader (batch_size=8, shuffle with the seed, its default collate). Tokens: the
    corpus's SEQ_LEN-token samples as uint16, each sample widened to int64 in `__getitem__`; text:
    the documents' UTF-8 bytes and their offsets, each decoded to `str`. `data` is the corpus root;
    the flat files are written beside it once (temporary name, then renamed)."""

    name = "handmade"

    @staticmethod
    def _flat(root: Path, kind: str) -> tuple[Path, Path | None]:
        from corpus import MANIFEST
        import json

        tokens, text, offsets = root / "handmade-tokens.u16", root / "handmade-text.bin", root / "handmade-text.off"
        if kind == "tokens" and tokens.exists():
            return tokens, None
        if kind == "text" and offsets.exists():
            return text, offsets
        meta = json.loads((root / MANIFEST).read_text())
        files = [root / "docs" / name for name in meta["files"]]
        pid = os.getpid()
        if kind == "tokens":
            part = tokens.with_suffix(f".{pid}")
            with open(part, "wb") as sink:
                for sample in token_samples(files):
                    sink.write(np.ascontiguousarray(sample, dtype=np.uint16).tobytes())
            part.rename(tokens)
            return tokens, None
        ends, done = [0], 0
        part = text.with_suffix(f".{pid}")
        with open(part, "wb") as sink:
            for path in files:
                body = path.read_text().encode()
                sink.write(body)
                done += len(body)
                ends.append(done)
        part.rename(text)
        np.asarray(ends, dtype=np.int64).tofile(offsets.with_suffix(f".{pid}"))
        offsets.with_suffix(f".{pid}").rename(offsets)
        return text, offsets

    def raw_loader(self, data: str, kind: str, workers: int, seed: int) -> Any:
        import torch
        from torch.utils.data import DataLoader, Dataset

        path, offsets = self._flat(Path(data), kind)

        class Tokens(Dataset):
            def __init__(self) -> None:
                self.tokens = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, SEQ_LEN)

            def __len__(self) -> int:
                return len(self.tokens)

            def __getitem__(self, i: int) -> Any:
                return torch.from_numpy(self.tokens[i].astype(np.int64))

        class Text(Dataset):
            def __init__(self) -> None:
                self.body = np.memmap(path, dtype=np.uint8, mode="r")
                self.ends = np.fromfile(offsets, dtype=np.int64)

            def __len__(self) -> int:
                return len(self.ends) - 1

            def __getitem__(self, i: int) -> Any:
                return self.body[self.ends[i] : self.ends[i + 1]].tobytes().decode()

        return DataLoader(
            Tokens() if kind == "tokens" else Text(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(seed),
        )

    def raw_count(self, batch: Any) -> int:
        return len(batch)


SYSTEMS: dict[str, System] = {
    s.name: s for s in (Tierflow(), Streaming(), LitData(), WebDataset(), InRam(), Handmade())
}
RAW_ORDER = (
    "inram",
    "handmade",
    "litdata",
    "webdataset",
    "streaming",
    "tierflow",
)  # the raw path's table, left to right
RAW_PEERS = ("litdata", "webdataset", "streaming")


def prepare_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
