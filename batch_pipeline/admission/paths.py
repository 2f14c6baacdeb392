"""The one path policy: which paths a request may name, judged the way they will be opened.

Data paths (input, output, the output's metadata file) are opened by fsspec, so they are parsed with
fsspec's own functions: a chain of filesystems (`simplecache::file://...`) is refused, the protocol must be
one the operator allows (`BATCH_PIPELINE_ALLOWED_PROTOCOLS`, comma-separated; default `file,s3`), and a
local path, once fsspec has stripped its `file:`/`local:` prefix, must lie inside the data roots
(`BATCH_PIPELINE_DATA_ROOTS`) after `..` and symlinks are resolved.

Model paths (`model`, `tokenizer`, `checkpoint_path`) are opened by vLLM and transformers as plain OS paths
unless they are URLs. Such a value is a catalog name, a Hugging Face id (`name` or `org/name` in the hub's
grammar, and no directory of that name here), a URL (held to the protocols above), or else a local path:
absolute, `./`, `../`, `~`, or anything else that is not an id.

With a tenants file (`batch_pipeline/tenancy/tenants.py`) the roots are the requesting team's: its local
directories and its bucket prefixes, and nothing else; an admin's (or an operator's launchpad run's) are
every team's and the data roots above.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.core import split_protocol
from fsspec.implementations.local import LocalFileSystem

from batch_pipeline.core import io
from batch_pipeline.core.settings import Settings
from batch_pipeline.models.catalog import CATALOG
from batch_pipeline.tenancy.tenants import DataRoots

# fsspec's names for the local filesystem ("file", "local"): allowing one allows both.
LOCAL_PROTOCOLS = LocalFileSystem.protocol
S3_PROTOCOLS = ("s3", "s3a")


def metadata_path(output_data_path: str) -> str:
    """Where the job writes the output's counts and timings (held to the policy like the output)."""
    return output_data_path + ".metadata.json"


# The roots a refusal names at most.
MAX_ROOTS_SAID = 8


@dataclass(frozen=True)
class PathPolicy:
    protocols: frozenset[str]
    # Empty: any local path (a single-user machine, unless `confined`); else local paths lie inside one.
    roots: tuple[Path, ...]
    # (protocol, `bucket/prefix/`) a remote path must lie under; None: any bucket of an allowed protocol.
    remote_roots: tuple[tuple[str, str], ...] | None = None
    # A team's policy: no roots means no paths at all.
    confined: bool = False
    # Whether a model, tokenizer or checkpoint may be a local directory (not for a team: see model_refusal).
    local_models: bool = True

    @classmethod
    def of_deployment(cls, configured: Settings) -> PathPolicy:
        """The deployment's own policy, before any team's roots apply (see AdmissionPolicy.paths_for)."""
        protocols = {name.strip() for name in configured.allowed_protocols.split(",") if name.strip()}
        if protocols & set(LOCAL_PROTOCOLS):
            protocols |= set(LOCAL_PROTOCOLS)
        roots = tuple(Path(root).resolve() for root in configured.data_roots.split(os.pathsep) if root)
        return cls(frozenset(protocols), roots)

    def data_path_refusal(self, path: str) -> str | None:
        """Why fsspec must not open `path` for this request, or None."""
        if why := _unreadable(path) or self._url_refusal(path):
            return why
        if not io.is_local(path):
            return self._remote_refusal(path)
        if not self.roots and not self.confined:
            return None
        # The relative or ~ form is judged before fsspec makes it absolute against this process's directory,
        # which need not be the directory of the step process that opens it.
        return self._local_refusal(written=_without_local_prefix(path), resolved=LocalFileSystem._strip_protocol(path))

    def model_refusal(self, name: str) -> str | None:
        """Why a `model`, `tokenizer` or `checkpoint_path` value must not be loaded, or None."""
        if why := _unreadable(name):
            return why
        if name.lower() in CATALOG:
            return None
        if "::" in name or split_protocol(name)[0] is not None:
            # vLLM opens no URL but its object stores; a local URL would be an odd relative path to it.
            if why := self._url_refusal(name):
                return why
            if not io.is_local(name):
                return self._remote_refusal(name)  # a checkpoint is held to the team's prefixes too
        elif _is_hub_id(name) and not os.path.isdir(name):
            return None
        if "file" not in self.protocols:
            return "local paths are not served here"
        if not self.local_models:
            # vLLM opens a directory by its path, following symlinks, long after this check: a team could
            # swap it for a link to another team's model in between.
            return (
                "a team's model is a catalog name, a Hugging Face id or an object-store checkpoint under its "
                "data roots, not a local directory"
            )
        if not self.roots and not self.confined:
            return None
        return self._local_refusal(written=name, resolved=name)

    def _remote_refusal(self, path: str) -> str | None:
        bucket, key = _bucket_and_key(path)
        if not key.strip("/"):
            return "a remote path names a file (s3://bucket/key)"
        if any(segment in ("", ".", "..") for segment in key.split("/")):
            # An object store takes a key as written: `s3://b//team-a/x` is the key `/team-a/x`, outside
            # `team-a/`, however a path's rules would read it.
            return "a remote path's key holds no empty, `.` or `..` segment (`//`, `/./`, `/../`)"
        if self.remote_roots is None:
            return None
        if not DataRoots((), self.remote_roots).holds_remote(_protocol(path), f"{bucket}/{key}"):
            return f"outside the bucket prefixes of your team's data roots; {self._roots_said()}"
        return None

    def _url_refusal(self, path: str) -> str | None:
        if "::" in path:
            return "chained URLs (`::`) are not accepted: name the file itself"
        protocol = _protocol(path)
        if protocol not in self.protocols:
            allowed = ", ".join(sorted(self.protocols)) or "none"
            return f"the protocol {protocol!r} is not served here (allowed: {allowed})"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError):
            return f"the protocol {protocol!r} has no filesystem installed here"
        if protocol in S3_PROTOCOLS:
            return _s3_bucket_refusal(path)
        return None

    def _local_refusal(self, written: str, resolved: str) -> str | None:
        if not os.path.isabs(written):
            return (
                "a relative path (or one starting with ~) may mean another file to the processes that open "
                "it: give an absolute path inside the data roots"
            )
        real = Path(resolved).resolve()
        if not any(real.is_relative_to(root) for root in self.roots):
            whose = "your team's data roots" if self.confined else "the data roots this server may read and write"
            return f"outside {whose} (after .. and symlinks); {self._roots_said()}"
        return None

    def _roots_said(self) -> str:
        """The roots a refused path may lie under, for its refusal: this policy's, which are the caller's own
        (its team's; an admin's or a single-user server's, all of them), never another team's."""
        roots = [str(root) for root in self.roots]
        roots += [f"{protocol}://{prefix}" for protocol, prefix in self.remote_roots or ()]
        if not roots:
            return "there are none: ask the operator for a data root in the tenants file"
        shown = ", ".join(roots[:MAX_ROOTS_SAID])
        more = f" and {len(roots) - MAX_ROOTS_SAID} more" if len(roots) > MAX_ROOTS_SAID else ""
        return f"{'yours are' if self.confined else 'they are'} {shown}{more}"


class DataFiles:
    """The files a job's request names, opened as its owner's policy allows, when they are used.

    A local path under a data root is opened beneath that root with no symlink followed (io's `*_beneath`):
    what the policy checked at submission is what is opened, and a directory swapped for a symlink since is
    refused rather than written through. Other paths (object stores, the job's own work dir, a policy with
    no roots) are opened as they are.
    """

    def __init__(self, policy: PathPolicy, own_dir: str | None = None) -> None:
        self.policy = policy
        self.own_dir = own_dir

    def beneath(self, path: str) -> tuple[str, str] | None:
        """(resolved root, path relative to it) for a local path under a root, or None to open it as it is.
        Raises PermissionError for a local path under none of the roots, whatever it now resolves to."""
        if not io.is_local(path) or _inside(path, self.own_dir) or not (self.policy.roots or self.policy.confined):
            return None
        written = os.path.normpath(_without_local_prefix(path))
        # The first prefix that is a root (or resolves to one: a root reached through a link of the
        # operator's); everything below it is walked with no symlink followed.
        parts = written.split("/")
        for cut in range(1, len(parts)):
            prefix = "/".join(parts[:cut]) or "/"
            real = Path(prefix).resolve()
            if real in self.policy.roots:
                return str(real), "/".join(parts[cut:])
        raise PermissionError(f"{path}: outside the data roots")

    def open(self, path: str, mode: str = "rb") -> IO[Any]:
        if (found := self.beneath(path)) is None:
            return io.open_file(path, mode)
        return io.open_beneath(*found, mode=mode)

    def exists(self, path: str) -> bool:
        if (found := self.beneath(path)) is None:
            return io.exists(path)
        return io.exists_beneath(*found)

    def check_writable(self, path: str) -> None:
        if (found := self.beneath(path)) is None:
            return io.check_writable(path)
        return io.check_writable_beneath(*found)

    def atomic_write(self, path: str, mode: str = "w") -> AbstractContextManager[IO[Any]]:
        if (found := self.beneath(path)) is None:
            return io.atomic_write(path, mode)
        return io.atomic_write_beneath(*found, mode=mode)


def request_path_refusals(request, policy: PathPolicy, own_dir: str | None = None) -> list[tuple[str, str]]:
    """`(field, why)` for each path a request names that `policy` (its owner's) refuses. `own_dir` is the
    job's own work dir: the service may place a job's files there (an OpenAI batch's output), outside the
    data roots, and no requester can name it (a job's id is made after its request is sent)."""
    found = []
    data_paths = [("input_data_path", request.input_data_path), ("output_data_path", request.output_data_path)]
    for field, path in data_paths:
        if path is not None and not _inside(path, own_dir) and (why := policy.data_path_refusal(path)):
            found.append((field, why))
    output = request.output_data_path
    if not any(field == "output_data_path" for field, _ in found) and not _inside(output, own_dir):
        if why := policy.data_path_refusal(metadata_path(output)):
            found.append(("output_data_path", f"its metadata file: {why}"))
    model_config = request.model_cfg
    for field in ("model", "tokenizer", "checkpoint_path"):
        value = getattr(model_config, field)
        if value is not None and (why := policy.model_refusal(value)):
            found.append((f"model_config.{field}", why))
    return found


def _inside(path: str, directory: str | None) -> bool:
    """Whether `path` names a file under `directory`, as written: no `..`, no other spelling of it."""
    if directory is None or _unreadable(path) or "::" in path:
        return False
    return path.startswith(directory.rstrip("/") + "/") and ".." not in path.split("/")


def _unreadable(path: str) -> str | None:
    """A string no filesystem can name: the OS would raise rather than refuse."""
    if "\x00" in path:
        return "a path cannot contain a NUL byte"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "a path must be valid Unicode text (it holds a lone surrogate)"
    return None


def _protocol(path: str) -> str:
    """The filesystem fsspec opens `path` with (as `fsspec.core.url_to_fs` decides it)."""
    return split_protocol(path)[0] or "file"


def _bucket_and_key(path: str) -> tuple[str, str]:
    """An object store URL's bucket and key (`s3://bucket/key`), as its filesystem strips the URL: the key
    as the store will take it, a leading `/` kept."""
    bucket, _, key = fsspec.get_filesystem_class(_protocol(path))._strip_protocol(path).partition("/")
    return bucket, key


def _s3_bucket_refusal(path: str) -> str | None:
    """botocore's own check of a bucket name, made here so that no later read of the path can fail on it."""
    from botocore.exceptions import ParamValidationError
    from botocore.handlers import validate_bucket_name

    bucket, _ = _bucket_and_key(path)
    try:
        validate_bucket_name({"Bucket": bucket})
    except ParamValidationError:
        return "not a valid bucket name"
    return None


def _without_local_prefix(path: str) -> str:
    """A local URL's path as written, before LocalFileSystem makes it absolute and expands `~`: it strips
    `file://`, `file:`, `local://` or `local:` exactly like this."""
    for protocol in LOCAL_PROTOCOLS:
        for separator in ("://", ":"):
            if path.startswith(protocol + separator):
                return path.removeprefix(protocol + separator)
    return path


def names_a_hub_model(name: str) -> bool:
    """Whether vLLM would look `name` up on the model hub: a valid repo id that is no local directory and
    no catalog name. (A path or checkpoint is the data roots' business, and the catalog's models ship here.)"""
    return name.lower() not in CATALOG and _is_hub_id(name) and not os.path.isdir(name)


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
