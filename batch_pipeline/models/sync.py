"""A checkpoint on an object store copied into the local model cache: the weights a shard worker loads, or
the configs and tokenizer a dry run reads; every object key checked before anything is written."""

from __future__ import annotations

import hashlib
from pathlib import Path

from batch_pipeline.core import io
from batch_pipeline.models.catalog import cache_dir

# What a remote checkpoint contributes to the local copy: weights, configs and tokenizer files; Python files
# (custom model code) only when the request trusts remote code; pickled `.bin` weights never.
CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".tiktoken", ".jinja")


TOKENIZER_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")


def sync_remote_checkpoint(url: str, trust_remote_code: bool = False) -> Path:
    """A checkpoint on an object store (`s3://bucket/prefix`) as a local directory in the cache; files already
    there with the same size are reused, so the next shard on this machine downloads nothing."""
    suffixes = CHECKPOINT_SUFFIXES + ((".py",) if trust_remote_code else ())
    return _sync(url, "remote", suffixes, "model_config.checkpoint_path: ")


def sync_tokenizer_files(url: str) -> Path:
    """The configs and tokenizer of an object-store checkpoint (the files at its top, where they are), for the
    dry run, which loads no weights."""
    return _sync(url, "tokenizers", TOKENIZER_SUFFIXES, "", maxdepth=1)


def _sync(url: str, cache: str, suffixes: tuple[str, ...], field: str, maxdepth: int | None = None) -> Path:
    fs, root = io.filesystem(url)
    root = root.rstrip("/")
    target = cache_dir() / cache / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    target.mkdir(parents=True, exist_ok=True)
    with io.file_lock(target.parent / f".{target.name}.lock"):
        found = fs.find(root, maxdepth=maxdepth, detail=True)  # maxdepth=1: a prefix of many files, one listing
        if not found:
            raise FileNotFoundError(f"{field}nothing at {url}")
        # Every key is checked before anything is written, so a hostile one leaves no partial copy behind.
        wanted = {_relative_checkpoint_file(url, root, path, target): (path, info) for path, info in found.items()}
        for relative, (path, info) in wanted.items():
            if not relative.endswith(suffixes):
                continue
            local = target / relative
            if local.exists() and local.stat().st_size == info["size"]:
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            partial = local.with_name(f".{local.name}.partial")
            fs.get_file(path, str(partial))
            partial.rename(local)
    return target


def _relative_checkpoint_file(url: str, root: str, path: str, target: Path) -> str:
    """Where an object of the checkpoint goes under `target`: its key below the checkpoint's prefix, refused
    (naming the key) unless every part is a plain name, since object keys may hold `..`, `.` or empty parts
    that the local filesystem would follow out of the cache (zip-slip)."""
    relative = path[len(root) + 1 :] if path.startswith(root + "/") else ""
    parts = relative.split("/")
    if not relative or any(part in ("", ".", "..") for part in parts):
        raise ValueError(
            f"model_config.checkpoint_path: the object {path!r} of {url} is not a plain file "
            "path under the checkpoint; refusing to sync it"
        )
    if not (target / relative).resolve().is_relative_to(target.resolve()):  # a symlink planted in the cache
        raise ValueError(f"model_config.checkpoint_path: the object {path!r} of {url} leads out of the model cache")
    return relative
