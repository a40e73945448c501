"""Tokenisation at pack time: ids in the smallest unsigned type, one EOS after every document.

Tokenizers are created lazily inside each worker process (Hugging Face tokenizers are not
fork-safe and loading them in the parent would be wasted work).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash
from tierflow.errors import PackInputError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "[SEP]")


class ByteTokenizer:
    """Byte-level ids 0..255 plus EOS = 256: needs no files, useful for tests and demos."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def identity(self) -> dict:
        return {
            "name": self.name,
            "hash": xxhash.xxh3_64_hexdigest(b"tierflow-bytes-v1"),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }

    def encode_arrow(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, ids) of every document with EOS appended, vectorised over the UTF-8 buffer."""
        texts = texts.cast(pa.large_binary()) if not pa.types.is_large_binary(texts.type) else texts
        texts = texts.fill_null(b"")
        bufs = texts.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int64)[texts.offset : texts.offset + len(texts) + 1]
        data = (
            np.frombuffer(bufs[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
            if bufs[2] is not None
            else np.zeros(0, np.uint8)
        )
        n = len(texts)
        new_offsets = (offsets - offsets[0]) + np.arange(n + 1, dtype=np.int64)
        ids = np.empty(int(new_offsets[-1]), dtype=np.uint16)
        eos_at = new_offsets[1:] - 1
        is_data = np.ones(len(ids), dtype=bool)
        is_data[eos_at] = False
        ids[is_data] = data
        ids[eos_at] = self.eos_id  # a scatter of one id per document, not a second masked pass
        return new_offsets, ids


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, identified by its file's hash."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        self.path = str(path)
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise PackInputError(f"tokenizer {path}: cannot read ({e})") from None
        self._hash = xxhash.xxh3_64_hexdigest(raw)
        self.eos_token = eos_token
        tok = self._tokenizer()
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [tok.token_to_id(c) for c in candidates if c]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise PackInputError(f"tokenizer {path}: no end-of-document token among {candidates}; pass --eos-token")
        self.eos_id = ids[0]
        self.name = f"hf:{Path(path).name}"

    def _tokenizer(self):
        return _load_hf(self.path, self._hash)

    def identity(self) -> dict:
        return {"name": self.name, "hash": self._hash, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def encode_arrow(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        strings = [t if isinstance(t, str) else (t or b"").decode("utf-8", "replace") for t in texts.to_pylist()]
        encodings = self._tokenizer().encode_batch(strings, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.empty(int(offsets[-1]), dtype=np.uint32)
        for i, e in enumerate(encodings):
            ids[offsets[i] : offsets[i + 1] - 1] = e.ids
            ids[offsets[i + 1] - 1] = self.eos_id
        return offsets, ids


@lru_cache(maxsize=4)
def _load_hf(path: str, _hash: str):
    from tokenizers import Tokenizer  # optional dependency: tierflow[tokenizers]

    return Tokenizer.from_file(path)


def make_tokenizer(spec: str | None, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer | None:
    if spec is None:
        return None
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json"):
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise PackInputError(
                "--tokenizer PATH.json needs the `tokenizers` package: pip install 'tierflow[tokenizers]'"
            ) from None
        return HFTokenizer(spec, eos_token)
    raise PackInputError(f"unknown tokenizer {spec!r}: use 'bytes' or a path to a tokenizer.json")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
