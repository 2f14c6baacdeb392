"""Paths (local or any fsspec URL such as s3://), atomic writes, and streaming reads of request files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec
import ijson
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol

# A malformed file is re-read whole to find the exact line and column; past this size only the element
# index is reported, so an error never costs more memory than this.
_EXACT_ERROR_LOCATION_MAX_BYTES = 256 * 1024 * 1024


class InputFileError(ValueError):
    """The input file cannot be read as requests; the message names the file and the place."""


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    # url_to_fs, unlike get_fs_token_paths, never expands `*`, `?` or `[`: a path names one file.
    fs, resolved = url_to_fs(path)
    return fs, str(resolved)


def is_local(path: str) -> bool:
    """Judged from the URL alone: no filesystem (or its driver, e.g. s3fs) is needed to answer."""
    return get_protocol(path) in LocalFileSystem.protocol


def exists(path: str) -> bool:
    fs, resolved = filesystem(path)
    return bool(fs.exists(resolved))


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def size(path: str) -> int:
    fs, resolved = filesystem(path)
    return int(fs.size(resolved))


def remove(path: str) -> None:
    """Remove a file if it is there."""
    fs, resolved = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(resolved)


def remove_tree(path: str) -> None:
    """Remove a directory and everything in it, if it is there."""
    fs, resolved = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(resolved, recursive=True)


def makedirs(path: str) -> None:
    fs, resolved = filesystem(path)
    fs.makedirs(resolved, exist_ok=True)


def tail(path: str, limit: int = 3000) -> str:
    """The end of a local file (a worker's log), at most `limit` bytes of it, as text."""
    with open(path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - limit))
        return handle.read().decode("utf-8", "replace")


def open_file(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    handle: IO[Any] = fsspec.open(path, mode, **kwargs).open()
    return handle


def check_writable(path: str) -> None:
    """Raise OSError unless a file can be written where `path` will be (its directory is made if needed).

    A probe file is created and removed beside the target (on an object store: a probe object, which
    also proves the bucket exists and the credentials may write there).
    """
    fs, resolved = filesystem(path)
    if not isinstance(fs, LocalFileSystem):
        probe = f"{resolved.rsplit('/', 1)[0]}/.write-probe-{uuid.uuid4().hex}"
        with fs.open(probe, "wb") as handle:
            handle.write(b"")
        fs.rm(probe)
        return
    if os.path.isdir(resolved):
        raise IsADirectoryError(f"{path} is a directory")
    directory = os.path.dirname(os.path.abspath(resolved))
    os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on a local lock file (made if missing) for the block: processes of this
    machine that share a file (a model conversion, a database migration) take turns."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w") -> Iterator[IO[Any]]:
    """Write `path` so that readers see the old file or the whole new one, never a part.

    Locally: a temporary file in the same directory, renamed over the target. Object stores publish an
    object only when its upload completes, so there the file is written in place.
    """
    fs, resolved = filesystem(path)
    if not isinstance(fs, LocalFileSystem):
        with fs.open(resolved, mode) as handle:
            yield handle
        return
    directory = os.path.dirname(os.path.abspath(resolved))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(resolved)}.", suffix=".partial")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, resolved)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --- files beneath a root, no symlink followed -----------------------------------------------------------
# A path checked when a job is submitted is opened minutes later; a directory on the way may have been
# swapped for a symlink since. These open `root/relative` by walking down from the root's descriptor, one
# component at a time with O_NOFOLLOW, so the file opened is the one beneath the root or none at all.
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SymlinkRefused(OSError):
    """A component beneath a data root is a symlink (or not a directory where one is needed)."""


def _components(relative: str) -> list[str]:
    parts = [part for part in relative.split("/") if part]
    if not parts or any(part in (".", "..") for part in parts):
        raise ValueError(f"not a plain relative path: {relative!r}")
    return parts


def _directory_beneath(root: str, parts: list[str], make: bool) -> int:
    """A descriptor of the directory `root/parts...`, made (0700) where missing when `make`."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself: the operator's
    try:
        for part in parts:
            try:
                child = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
                child = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SymlinkRefused(exc.errno, f"{part}: a symlink or not a directory, beneath {root}") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(root: str, relative: str, mode: str = "rb") -> IO[Any]:
    """`root/relative` opened for reading, with no symlink followed beneath `root`."""
    *directories, name = _components(relative)
    directory = _directory_beneath(root, directories, make=False)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefused(exc.errno, f"{name}: a symlink, beneath {root}") from None
        raise
    finally:
        os.close(directory)
    return os.fdopen(fd, mode)


def exists_beneath(root: str, relative: str) -> bool:
    try:
        open_beneath(root, relative).close()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    return True


@contextlib.contextmanager
def atomic_write_beneath(root: str, relative: str, mode: str = "w") -> Iterator[IO[Any]]:
    """`atomic_write` of `root/relative`, its directories made where missing, no symlink followed beneath
    `root`: the temporary file is created exclusively in the directory's descriptor and renamed over the
    name there (a symlink at the name is replaced, not written through)."""
    *directories, name = _components(relative)
    directory = _directory_beneath(root, directories, make=True)
    tmp = f".{name}.{uuid.uuid4().hex}.partial"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory)
        try:
            with os.fdopen(fd, mode) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def check_writable_beneath(root: str, relative: str) -> None:
    """`check_writable` of `root/relative`, no symlink followed beneath `root`."""
    *directories, name = _components(relative)
    directory = _directory_beneath(root, directories, make=True)
    try:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                raise IsADirectoryError(f"{name} is a directory")
        probe = f".write-probe-{uuid.uuid4().hex}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory))
        os.unlink(probe, dir_fd=directory)
    finally:
        os.close(directory)


Opener = Callable[..., IO[Any]]


def iter_json_records(path: str, opener: Opener = open_file) -> Iterator[tuple[str, Any]]:
    """Yield `(where, record)` for each request in a JSON or JSONL file, streaming.

    Accepted shapes: a JSON array of records, a single JSON object, or JSONL (one record per line).
    `where` says where the record stands ("element 3", "line 4") for error messages. `opener(path, "rb")`
    opens the file (a job's opens it beneath its data root).
    """
    with opener(path, "rb") as handle:
        first = _first_significant_byte(handle)
        if first == b"[":
            yield from _iter_array(path, handle, opener)
        elif first == b"{":
            first_line = handle.readline()
            handle.seek(0)
            try:
                json.loads(first_line)
            except json.JSONDecodeError:
                yield from _iter_concatenated(path, handle, opener)
            else:
                yield from _iter_lines(path, handle)
        elif first == b"":
            raise InputFileError(f"{path}: the file is empty; expected a JSON array, object or JSONL records")
        else:
            raise InputFileError(
                f"{path}: expected a JSON array, a JSON object or JSONL records, found {first!r} at the start"
            )


def _first_significant_byte(handle: IO[bytes]) -> bytes:
    """The first non-whitespace byte of the file (b"" when there is none); leaves the handle at the start."""
    try:
        while chunk := handle.read(65536):
            if stripped := chunk.lstrip():
                return stripped[:1]
        return b""
    finally:
        handle.seek(0)


def _iter_array(path: str, handle: IO[bytes], opener: Opener) -> Iterator[tuple[str, Any]]:
    position = 0
    try:
        for position, record in enumerate(ijson.items(handle, "item", use_float=True)):
            yield f"element {position}", record
    except (ijson.JSONError, UnicodeDecodeError) as exc:
        raise InputFileError(_locate_malformed(path, f"element {position}", exc, opener)) from None


def _iter_concatenated(path: str, handle: IO[bytes], opener: Opener) -> Iterator[tuple[str, Any]]:
    position = 0
    try:
        for position, record in enumerate(ijson.items(handle, "", multiple_values=True, use_float=True)):
            yield f"object {position}", record
    except (ijson.JSONError, UnicodeDecodeError) as exc:
        raise InputFileError(_locate_malformed(path, f"object {position}", exc, opener)) from None


def _iter_lines(path: str, handle: IO[bytes]) -> Iterator[tuple[str, Any]]:
    for number, raw in enumerate(handle, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except UnicodeDecodeError as exc:
            raise InputFileError(f"{path}: line {number} is not valid UTF-8 (byte {exc.start} of the line)") from None
        except json.JSONDecodeError as exc:
            raise InputFileError(f"{path}: line {number}, column {exc.colno}: malformed JSON: {exc.msg}") from None
        yield f"line {number}", record


def _locate_malformed(path: str, where: str, exc: Exception, opener: Opener) -> str:
    """The best description of where a file stops being JSON: line and column when affordable."""
    with opener(path, "rb") as handle:
        raw = handle.read(_EXACT_ERROR_LOCATION_MAX_BYTES + 1)
    if len(raw) <= _EXACT_ERROR_LOCATION_MAX_BYTES:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as decode_error:
            line = raw.count(b"\n", 0, decode_error.start) + 1
            return f"{path}: not valid UTF-8 at byte {decode_error.start} (line {line})"
        try:
            json.loads(text)
        except json.JSONDecodeError as decode_error:
            return (
                f"{path}: malformed JSON at line {decode_error.lineno}, column {decode_error.colno} "
                f"(byte {decode_error.pos}, in {where}): {decode_error.msg}"
            )
    return f"{path}: malformed JSON in {where}: {exc}"


def make_private_directory(path: str) -> None:
    """A local directory only its owner may enter (0700, whatever the umask), made if missing. The files
    in it are written 0600 as well: the code_evaluator sandbox's uids and other local users read nothing."""
    local = filesystem(path)[1]
    os.makedirs(local, mode=0o700, exist_ok=True)
    os.chmod(local, 0o700)
