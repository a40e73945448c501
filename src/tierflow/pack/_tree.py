"""What a directory of inputs holds: every file with its role, and the kind the tree packs as.

The kind is decided from every name in the tree (a walk of names is cheap), never from a
sample of it. A tree whose kinds do not pack together is refused, naming the kinds with
their counts and an example of each, rather than packed with some of its files dropped.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

from tierflow.pack.tokenize import PackInputError

if TYPE_CHECKING:
    from tierflow.pack.units import SourceOptions

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
SIDECAR_SUFFIXES = (".txt", ".json")
"""An image's caption files: its name with one of these suffixes instead of its own."""

#: the roles a file can have, in the order a refusal lists them, with their (singular, plural) names
ROLE_NAMES = {
    "image": ("image", "images"),
    "sidecar": ("caption sidecar", "caption sidecars"),
    "jsonl": ("JSONL/JSON file", "JSONL/JSON files"),
    "parquet": ("Parquet file", "Parquet files"),
    "tar": ("WebDataset tar", "WebDataset tars"),
    "other": ("other file", "other files"),
}
#: the kinds a tree packs as, and the roles each one reads (a directory's other files are skipped)
KIND_ROLES = {
    "records": {"jsonl", "parquet"},
    "jsonl": {"jsonl"},
    "parquet": {"parquet"},
    "images": {"image"},
    "webdataset": {"tar"},
    "files": set(ROLE_NAMES) - {"sidecar"},
}
SKIP_REASONS = {
    "jsonl": "not JSONL",
    "parquet": "not Parquet",
    "images": "not an image",
    "webdataset": "not a tar",
    "records": "not JSONL/JSON or Parquet",
}


def base_suffix(path: str) -> str:
    """The suffix under any compression suffix: 'a.jsonl.gz' -> '.jsonl'."""
    p = Path(path)
    if p.suffix.lower() in COMPRESSED_SUFFIXES:
        p = p.with_suffix("")
    return p.suffix.lower()


def file_role(name: str) -> str:
    """image, jsonl, parquet, tar or other, from the file's name alone."""
    if name.lower().endswith(IMAGE_SUFFIXES):
        return "image"
    suffix = base_suffix(name)
    if suffix == ".tar" or name.lower().endswith(".tgz"):
        return "tar"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    return "parquet" if suffix == ".parquet" else "other"


@dataclass(frozen=True)
class TreeFile:
    """One input file: where it is, what its name says it is, and (an image) its caption files."""

    root: str
    rel: str
    role: str
    entry: os.DirEntry | None = None
    is_sidecar: bool = False
    sidecars: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.rel)

    @property
    def size(self) -> int:
        return self.entry.stat().st_size if self.entry is not None else os.path.getsize(self.path)

    @property
    def census_role(self) -> str:
        return "sidecar" if self.is_sidecar else self.role


def classify_tree(root: str, options: SourceOptions) -> Iterator[TreeFile]:
    """Every file of `walk_file_entries`, in its order, with its role.

    A .txt or .json file next to an image of the same stem is that image's sidecar; the
    image lists it, so a sidecar that --exclude leaves out is not read either.
    """
    for directory, group in itertools.groupby(
        walk_file_entries(root, options), key=lambda item: os.path.dirname(item[0])
    ):
        entries = list(group)
        names = {entry.name for _, entry in entries}
        stems = {os.path.splitext(entry.name)[0] for _, entry in entries if file_role(entry.name) == "image"}
        for rel, entry in entries:
            role = file_role(entry.name)
            stem, suffix = os.path.splitext(entry.name)
            sidecars = (
                tuple(os.path.join(directory, stem + s) for s in SIDECAR_SUFFIXES if stem + s in names)
                if role == "image"
                else ()
            )
            yield TreeFile(
                root, rel, role, entry, role != "image" and suffix in SIDECAR_SUFFIXES and stem in stems, sidecars
            )


def tree_kind(root: str, options: SourceOptions) -> str:
    """What `--kind auto` packs a directory as: images, records or files; refuses a mix."""
    counts: dict[str, int] = {}
    examples: dict[str, str] = {}
    for f in classify_tree(root, options):
        counts[f.census_role] = counts.get(f.census_role, 0) + 1
        examples.setdefault(f.census_role, f.rel)
    roles = set(counts) - {"sidecar"}
    if roles == {"image"}:
        return "images"
    if roles == {"tar"}:
        return "webdataset"
    if roles and roles <= KIND_ROLES["records"]:
        return "records"
    if roles <= {"other"}:
        return "files"
    raise PackInputError(mixed_tree_message(root, counts, examples))


def mixed_tree_message(root: str, counts: dict[str, int], examples: dict[str, str]) -> str:
    found = ", ".join(
        f"{counts[r]:,} {ROLE_NAMES[r][counts[r] != 1]} (e.g. {examples[r]})" for r in ROLE_NAMES if r in counts
    )
    fewest = min((r for r in counts if r != "sidecar"), key=lambda r: counts[r])
    suffix = os.path.splitext(examples[fewest])[1]
    return (
        f"{root}: holds files of kinds that do not pack together: {found}. Choose what to pack with "
        f"--kind images|jsonl|parquet (that kind; every other file is counted as skipped) or --kind files "
        f"(every file as raw text or bytes), or leave files out with --exclude (e.g. --exclude '*{suffix}')"
    )


def single_file(path: str, kind: str) -> TreeFile:
    """A file named as a source: its suffix says what it is, unless --kind says otherwise."""
    forced = {"jsonl": "jsonl", "parquet": "parquet", "images": "image", "webdataset": "tar", "files": "other"}
    root, name = os.path.split(path)
    return TreeFile(root, name, forced.get(kind) or file_role(name))


def file_kind(f: TreeFile) -> str:
    """What `--kind auto` packs a single named file as."""
    if f.role == "image":
        return "images"
    if f.role == "tar":
        return "webdataset"
    if f.role in KIND_ROLES["records"]:
        return "records"
    raise PackInputError(
        f"{f.path}: unknown source type (expected .jsonl/.ndjson/.json[.gz|.zst], .parquet, "
        f"an image or a directory; --kind files packs it as raw text)"
    )


# ---------------------------------------------------------------- walking


def walk_files(root: str, options: SourceOptions) -> Iterator[str]:
    """Relative paths of regular files under root, in a sorted, deterministic order."""
    return (rel for rel, _ in walk_file_entries(root, options))


def walk_file_entries(root: str, options: SourceOptions) -> Iterator[tuple[str, os.DirEntry]]:
    """(relative path, directory entry) of regular files under root, in walk_files' order.

    A directory's files come before its subdirectories, each sorted by name; symlinked
    directories are not entered. Entries carry their type and cache their stat, so a tree
    of many small files costs one listing per directory and one stat per file.
    """
    include = _matcher(tuple(options.include)) if options.include else None
    exclude = _matcher(tuple(options.exclude)) if options.exclude else None

    def excluded(rel: str, name: str) -> bool:
        return exclude is not None and bool(exclude(rel) or exclude(name))

    def visit(directory: str, rel_dir: str) -> Iterator[tuple[str, os.DirEntry]]:
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError as e:
            _raise_walk_error(e)
        files: list[os.DirEntry[str]] = []
        dirs: list[os.DirEntry[str]] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(entry)
        for entry in sorted(files, key=lambda e: e.name):
            rel = os.path.join(rel_dir, entry.name)
            if excluded(rel, entry.name):
                continue
            if include is not None and not (include(entry.name) or include(rel)):
                continue
            if entry.is_file():
                yield rel, entry
        for entry in sorted(dirs, key=lambda e: e.name):
            rel = os.path.join(rel_dir, entry.name)
            if excluded(rel, entry.name) or entry.is_symlink():
                continue
            yield from visit(entry.path, rel)

    return visit(root, "")


@lru_cache(maxsize=32)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], Any]:
    """One compiled regex for a set of glob patterns (fnmatch per name per pattern is slow)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in patterns)).match


def _raise_walk_error(e: OSError) -> None:
    raise PackInputError(f"{e.filename}: cannot list ({e.strerror})")
