"""A model's identity as its files are now: a digest of every file of its directory (weights, config,
tokenizer and chat template), what the result cache keys results by, so that changed weights never answer
from results of the old ones.

Hashing a model's files reads all of them (0.3 s for SmolLM2-135M, minutes for a large model): the digest
is memoized by the files' names, sizes, mtimes, inodes and ctimes (`Memo`), and computed again only when one
changes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batch_pipeline.models.catalog import CATALOG, catalog_location


@dataclass(frozen=True)
class Memo:
    """Where digests are remembered: `get(path, stat)` the digest recorded for the files at `path` when
    their listing had the digest `stat` (None: none), `put(path, stat, digest)` records one."""

    get: Callable[[str, str], str | None]
    put: Callable[[str, str, str], None]


def model_directory(model: str, checkpoint_path: str | None = None) -> Path | None:
    """The local directory (or single file) holding a model's files: a catalog model's prepared directory,
    or a local path. None where the files are not on this machine (a hub id, an object-store checkpoint):
    their identity cannot be checked here."""
    if checkpoint_path is not None:
        location = Path(checkpoint_path) if os.path.isabs(checkpoint_path) else None
    elif (entry := CATALOG.get(model.lower())) is not None:
        location = catalog_location(entry)
    else:
        location = Path(model) if os.path.isabs(model) else None
    return location if location is not None and location.exists() else None


def weights_digest(location: Path, memo: Memo | None = None) -> str:
    """A SHA-256 over every regular file under `location` (its relative name and its bytes), in name order;
    from `memo` while no file's name, size, mtime, inode or ctime changed."""
    files = _files(location)
    listing = hashlib.sha256()
    for name, path in files:
        stat = path.stat()
        # The inode and ctime too: a copy that keeps sizes and mtimes (cp -p, rsync -a, tar) changes them.
        listing.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0{stat.st_ctime_ns}\n".encode())
    stat_digest = listing.hexdigest()
    key = str(location.resolve())
    if memo is not None and (known := memo.get(key, stat_digest)) is not None:
        return known
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        digest.update(b"\0")
    value = digest.hexdigest()
    if memo is not None:
        memo.put(key, stat_digest, value)
    return value


def _files(location: Path) -> list[tuple[str, Path]]:
    if location.is_file():
        return [(location.name, location)]
    found = [
        (path.relative_to(location).as_posix(), path)
        for path in location.rglob("*")
        if path.is_file() and not path.name.startswith(".")
    ]
    return sorted(found)
