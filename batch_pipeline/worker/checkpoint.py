"""A shard's results file (`results.tsv`, see shards/format.py): the worker's checkpoint.

The worker appends a line per finished request and flushes it, so a killed worker leaves whole lines and at
most one torn one; a worker started again on the shard cuts the torn line off, skips what is there and
owes the rest. Once every request has a line, `write_sorted_output` writes `output.tsv` from it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from batch_pipeline.core import io
from batch_pipeline.shards.format import iter_result_lines, token_counts

# The errors of a full or failing disk: the worker's failure names the file they stopped.
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


class Checkpoint:
    """The shard's results file. Appends and flushes to a local file are what make a shard resumable; when
    the shard's directory is on an object store (shards in pods on different nodes), that local file
    starts as the stored copy and is uploaded whole every BATCH_PIPELINE_CHECKPOINT_UPLOAD_S and when the
    worker stops, so a retry elsewhere loses at most that much work."""

    def __init__(self, results_path: str, upload_every_s: float) -> None:
        self.remote = None if io.is_local(results_path) else results_path
        self.local = results_path
        self._upload_every_s = upload_every_s
        self._last_upload = time.monotonic()
        if self.remote is not None:
            self.local = os.path.join(tempfile.mkdtemp(prefix="batch-pipeline-shard-"), "results.tsv")
            fs, path = io.filesystem(self.remote)
            if fs.exists(path):
                fs.get_file(path, self.local)

    def recover(self) -> set[int]:
        """Indices already finished; a torn last line left by a killed worker is cut off so appends stay
        whole."""
        return recover_checkpoint(self.local)

    @contextmanager
    def appending(self) -> Iterator[IO[str]]:
        """The results file, open for appending as a file only the worker's user may read (0600): another
        job's results are not for others. A full disk's error names the file."""
        try:
            with open(self.local, "a", encoding="utf-8", opener=_private) as results:
                yield results
                results.flush()
                os.fsync(results.fileno())
        except OSError as exc:
            if exc.filename is None and exc.errno in _WRITE_ERRORS:
                raise OSError(exc.errno, exc.strerror, self.local) from None
            raise

    def finished_outputs(self, indices: set[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """The outputs of those of `indices` the file holds."""
        with open(self.local, encoding="utf-8") as finished:
            for index, payload in iter_result_lines(finished):
                if index in indices:
                    yield index, json.loads(payload)

    def upload_if_due(self) -> None:
        if self.remote is not None and time.monotonic() - self._last_upload >= self._upload_every_s:
            self.upload()

    def upload(self) -> None:
        if self.remote is not None and os.path.exists(self.local):
            fs, path = io.filesystem(self.remote)
            fs.put_file(self.local, path)
            self._last_upload = time.monotonic()

    def discard_local_copy(self) -> None:
        if self.remote is not None:
            shutil.rmtree(os.path.dirname(self.local), ignore_errors=True)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def recover_checkpoint(results_path: str) -> set[int]:
    """Indices already finished in a results file; a torn last line is cut off."""
    if not os.path.exists(results_path):
        return set()
    done: set[int] = set()
    whole_bytes = 0
    with open(results_path, "rb+") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break
            done.add(int(line.partition(b"\t")[0]))
            whole_bytes += len(line)
        handle.truncate(whole_bytes)
    return done


def copy_lines(output: dict[str, Any], copies: Sequence[int]) -> Iterator[str]:
    """The results lines of the requests that repeat the one answered by `output`, one at a time: its
    output, under an id of each one's own (an OpenAI object's id ends with its request's index, see
    openai_requests). Serialised once: an embeddings output of 2,048 vectors is ~16 MiB of JSON, and a line
    repeated a thousand times must not be a thousand serialisations, nor one string of them all."""
    if not copies:
        return
    if "id" not in output:
        body = json.dumps(output, ensure_ascii=False)
        for index in copies:
            yield f"{index}\t{body}\n"
        return
    prefix = output["id"].rpartition("-")[0]
    rest = json.dumps({name: value for name, value in output.items() if name != "id"}, ensure_ascii=False)
    rest = ", " + rest[1:] if rest != "{}" else "}"
    for index in copies:
        yield f'{index}\t{{"id": {json.dumps(f"{prefix}-{index}")}{rest}\n'


@dataclass(frozen=True)
class OutputTotals:
    prompt_tokens: int
    completion_tokens: int
    errors: int


def write_sorted_output(results_path: str, output_path: str, item_count: int, shard_index: int) -> OutputTotals:
    """Write output.tsv: every result, sorted by index; the shard's totals. Fails when a request has no
    result."""
    offsets: dict[int, tuple[int, int]] = {}
    prompt_tokens = completion_tokens = errors = 0
    with open(results_path, "rb") as results:
        position = 0
        for line in results:
            index_text, _, payload = line.partition(b"\t")
            offsets[int(index_text)] = (position, len(line))
            position += len(line)
            output = json.loads(payload)
            errors += "error" in output
            prompt, completion = token_counts(output)
            prompt_tokens += prompt
            completion_tokens += completion
        missing = item_count - len(offsets)
        if missing:
            raise RuntimeError(f"shard {shard_index}: {missing} requests have no result")
        with io.atomic_write(output_path, "wb") as output_file:
            for index in sorted(offsets):
                start, length = offsets[index]
                results.seek(start)
                output_file.write(results.read(length))
    return OutputTotals(prompt_tokens, completion_tokens, errors)
