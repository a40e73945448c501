"""The one corpus every system converts: real text as variable-length documents.

Documents are the standard library's own source files (`*.py`, site-/dist-packages excluded,
the same tree `tierflow demo` packs) followed by the text under /usr/share/doc where present
(gzip'd files decompressed; binary and non-UTF-8 files skipped), in a sorted, deterministic
order. They are written once as one UTF-8 `.txt` file per document under `<work>/corpus/docs/`,
so every writer reads the very same files from the same disk.

The token variant is byte tokens: a document's UTF-8 bytes as token ids 0-255 followed by an
end-of-document token 256 (uint16), the documents concatenated and cut into samples of
`SEQ_LEN` = 2048 tokens. tierflow's `tokenizer="bytes"` is exactly this (its token windows of
2048 are the samples); the peers' writers get the same stream from `byte_tokens`.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierflow.commands.demo import STDLIB_EXCLUDE, stdlib_dir

SEQ_LEN = 2048
EOS = 256
TOKEN_DTYPE = np.uint16
DOC_ROOT = Path("/usr/share/doc")
MANIFEST = "corpus.json"


@dataclass
class Corpus:
    root: Path  # <work>/corpus
    files: list[Path]  # one document each, in order
    text_bytes: int  # UTF-8 bytes of all documents
    stdlib_files: int
    doc_files: int
    repeats: int

    @property
    def docs_dir(self) -> Path:
        return self.root / "docs"

    @property
    def tokens(self) -> int:
        return self.text_bytes + len(self.files)  # one EOS per document

    @property
    def samples(self) -> int:
        return self.tokens // SEQ_LEN

    def describe(self) -> str:
        rep = f", repeated x{self.repeats}" if self.repeats > 1 else ""
        return (
            f"{len(self.files):,} documents ({self.stdlib_files:,} stdlib .py, {self.doc_files:,} from "
            f"{DOC_ROOT}{rep}), {self.text_bytes / 1e6:.1f} MB of text; {self.tokens / 1e6:.1f} M byte "
            f"tokens = {self.samples:,} samples of {SEQ_LEN}"
        )


def _stdlib_documents() -> list[tuple[str, bytes | Path]]:
    from tierflow.pack.units import SourceOptions
    from tierflow.pack._tree import walk_files

    root = stdlib_dir()
    options = SourceOptions(include=("*.py",), exclude=STDLIB_EXCLUDE)
    return [(f"stdlib/{rel}", root / rel) for rel in walk_files(str(root), options)]


def _doc_documents() -> list[tuple[str, bytes | Path]]:
    found: list[tuple[str, bytes | Path]] = []
    if not DOC_ROOT.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(DOC_ROOT):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            found.append((f"doc/{path.relative_to(DOC_ROOT)}", path))
    return found


def _text_of(source: bytes | Path) -> bytes | None:
    try:
        raw = source.read_bytes() if isinstance(source, Path) else source
        if isinstance(source, Path) and source.suffix == ".gz":
            raw = gzip.decompress(raw)
        if not raw or b"\0" in raw[:8192]:
            return None
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return raw


def build_corpus(work: Path, max_mb: float | None = None, min_mb: float = 0.0) -> Corpus:
    """Write the corpus under `work/corpus` (reused when the same parameters built it before).

    `max_mb` keeps the first documents up to that many MB of text (all of the stdlib first);
    `min_mb` repeats the whole list until it holds that much (said in the results).
    """
    root = work / "corpus"
    key = {"max_mb": max_mb, "min_mb": min_mb, "version": 1}
    meta_path = root / MANIFEST
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            files = [root / "docs" / name for name in meta["files"]]
            return Corpus(root, files, meta["text_bytes"], meta["stdlib_files"], meta["doc_files"], meta["repeats"])
    shutil.rmtree(root, ignore_errors=True)
    (root / "docs").mkdir(parents=True)
    limit = None if max_mb is None else int(max_mb * 1e6)
    names: list[str] = []
    total = stdlib = docs = 0
    sources = _stdlib_documents() + _doc_documents()
    kept: list[tuple[str, bytes]] = []
    for label, source in sources:
        text = _text_of(source)
        if text is None:
            continue
        if limit is not None and total + len(text) > limit:
            if total >= limit * 0.98:
                break
            continue  # a smaller document may still fit
        kept.append((label, text))
        total += len(text)
        if label.startswith("stdlib/"):
            stdlib += 1
        else:
            docs += 1
    repeats = 1
    while min_mb and total * repeats < min_mb * 1e6:
        repeats += 1
    for _ in range(repeats):
        for _label, text in kept:
            name = f"{len(names):06d}.txt"
            (root / "docs" / name).write_bytes(text)
            names.append(name)
    meta = {
        "key": key,
        "files": names,
        "text_bytes": total * repeats,
        "stdlib_files": stdlib * repeats,
        "doc_files": docs * repeats,
        "repeats": repeats,
    }
    meta_path.write_text(json.dumps(meta))
    return Corpus(root, [root / "docs" / n for n in names], total * repeats, stdlib * repeats, docs * repeats, repeats)


def byte_tokens(text: bytes) -> np.ndarray:
    """One document's byte tokens plus EOS, as tierflow's `tokenizer="bytes"` makes them."""
    out = np.empty(len(text) + 1, TOKEN_DTYPE)
    out[:-1] = np.frombuffer(text, np.uint8)
    out[-1] = EOS
    return out


def token_samples(files: list[Path]):
    """The concatenated byte-token stream of `files` cut into SEQ_LEN-token samples (the tail dropped)."""
    pending: list[np.ndarray] = []
    held = 0
    for path in files:
        pending.append(byte_tokens(path.read_bytes()))
        held += len(pending[-1])
        if held >= SEQ_LEN:
            stream = np.concatenate(pending)
            whole = len(stream) // SEQ_LEN * SEQ_LEN
            yield from stream[:whole].reshape(-1, SEQ_LEN)
            pending = [stream[whole:]]
            held = len(pending[0])
