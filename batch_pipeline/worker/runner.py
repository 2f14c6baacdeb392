"""Running one shard: every pending request through one vLLM engine, results appended as they finish.

The results file is the checkpoint: a worker started again on the same shard skips what is already there,
so a killed shard loses at most the requests that were in flight.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from batch_pipeline import io
from batch_pipeline.contract import BatchCompletionsModelConfig, ToolConfig
from batch_pipeline.shards import (
    ShardTask,
    WorkItem,
    expected_output_tokens,
    format_result,
    iter_result_lines,
    read_copies,
    read_work_items,
)
from batch_pipeline.worker.code_evaluator import CodeEvaluatorRequests
from batch_pipeline.worker.handlers import RequestHandler, RequestRefused, engine_error_output, refused_output
from batch_pipeline.worker.sandbox import Sandbox, SandboxLimits
from batch_pipeline.worker.v1_requests import V1Requests

logger = logging.getLogger(__name__)

# A job's content is v1 prompts or a list of requests, never both; the tool loop serves the prompts (as
# Scale's batch server does), and a list of requests runs as it would without tool_config.
TOOL_APPLIED = "applied"
TOOL_NOT_APPLIED = (
    "not applied: the code_evaluator loop serves v1 content (prompts); these chat/completion "
    "requests ran without it (chat requests can declare functions in `tools`)"
)

# Requests handed to the engine ahead of the scheduler: enough to keep every batch slot busy, few enough
# that a shard of a million prompts does not hold them all in memory.
DEFAULT_MAX_IN_FLIGHT = 1024
PROGRESS_INTERVAL_S = 5.0
CHECKPOINT_UPLOAD_S = float(os.environ.get("BATCH_PIPELINE_CHECKPOINT_UPLOAD_S", "30"))
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


class DeadlineExceeded(RuntimeError):
    pass


@dataclass
class ShardStats:
    shard_index: int
    items: int
    resumed: int = 0
    generated: int = 0
    deduplicated: int = 0  # requests answered by an identical deterministic request's output
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    wall_s: float = 0.0
    unsupported_engine_args: list[str] = field(default_factory=list)
    dtype: str | None = None  # what the engine computed in, and why (the request's, the model's, or the CPU's)
    dtype_reason: str | None = None
    # code_evaluator runs: executions, how many failed or ran out of time, and the sandbox's isolation
    tool_executions: int = 0
    tool_failed_executions: int = 0
    tool_timed_out_executions: int = 0
    sandbox: dict[str, str] | None = None
    tool_config: str | None = None  # with a tool_config: TOOL_APPLIED, or TOOL_NOT_APPLIED and why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class InFlight:
    """Items in the engine, each made of one or more engine requests (one per prompt of a request)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[WorkItem, list[str], dict[str, Any]]] = {}
        self._owner: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, item: WorkItem, engine_ids: list[str]) -> None:
        if not engine_ids:  # a tool loop runs the item's code before it enters the engine
            return
        self._items[item.index] = (item, engine_ids, {})
        for engine_id in engine_ids:
            self._owner[engine_id] = item.index

    def finish(self, result: Any) -> tuple[WorkItem, list[Any]] | None:
        """Record a finished engine request; the item and its results, in submission order, once all are in."""
        index = self._owner.pop(result.request_id)
        item, engine_ids, results = self._items[index]
        results[result.request_id] = result
        if len(results) < len(engine_ids):
            return None
        del self._items[index]
        return item, [results[engine_id] for engine_id in engine_ids]

    def engine_ids(self) -> list[str]:
        return list(self._owner)


def token_counts(output: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens of one output: v1 CompletionOutput counts, or an OpenAI object's usage."""
    if "usage" in output:
        return output["usage"]["prompt_tokens"], output["usage"]["completion_tokens"]
    return output.get("num_prompt_tokens", 0), output.get("num_completion_tokens", 0)


def engine_order(items: Iterator[WorkItem], window: int) -> Iterator[WorkItem]:
    """Each window of items, the longest possible outputs first, and among equals those sharing a prompt
    prefix side by side. Outputs go back to their index, so the order of work is free.

    A long generation started last finishes alone, long after the rest (the engine runs at most
    `max_num_seqs` at once): started first, it runs beside the short ones. Batch inputs often repeat a long
    prefix (few-shot templates, system prompts) far apart; submitted together, the later requests find the
    prefix in vLLM's cache instead of computing it again.
    """
    while chunk := list(itertools.islice(items, window)):
        yield from sorted(chunk, key=lambda item: (-expected_output_tokens(item.kind, item.request), _prompt_key(item)))


def _prompt_key(item: WorkItem) -> str:
    request = item.request
    prompt = request.get("messages", request.get("prompt"))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def copy_lines(output: dict[str, Any], copies: Sequence[int]) -> str:
    """Checkpoint lines of the requests that repeat the one answered by `output`: its output, under an id
    of each one's own (an OpenAI object's id ends with its request's index, see openai_requests)."""
    if "id" not in output:
        return "".join(format_result(index, output) for index in copies)
    prefix = output["id"].rpartition("-")[0]
    return "".join(format_result(index, {**output, "id": f"{prefix}-{index}"}) for index in copies)


class ShardRunner:
    def __init__(
        self,
        task: ShardTask,
        report: Callable[[str], None] = logger.info,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        report_progress: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.task = task
        self.shard = task.shard
        self.report = report
        self.report_progress = report_progress or (lambda figures: None)
        self.max_in_flight = max_in_flight
        self.handlers: dict[str, RequestHandler] = {"v1": V1Requests()}
        self.tool_loop: CodeEvaluatorRequests | None = None  # v1 prompts under tool_config; set with the engine
        self.stats = ShardStats(shard_index=self.shard.shard_index, items=self.shard.item_count)
        self.copies: dict[int, list[int]] = {}  # source index -> indices answered by its output
        self._copies_written = 0

    def run(self) -> ShardStats:
        started = time.monotonic()
        self.checkpoint = Checkpoint(self.shard.results_path)
        try:
            done = recover_checkpoint(self.checkpoint.local)
            self.stats.resumed = len(done)
            if done:
                self.report(f"resuming: {len(done)} of {self.shard.item_count} requests already done")
            self.report_progress({"requests_done": len(done)})
            self.copies = read_copies(self.shard.copies_path)
            unfilled = {
                source: owed
                for source, indices in self.copies.items()
                if source in done
                if (owed := [index for index in indices if index not in done])
            }
            items = read_work_items(self.shard.input_path)
            head = next(items, None)
            if self.task.tool_config is not None and head is not None:  # said also when resumed with nothing left
                self.stats.tool_config = TOOL_APPLIED if head.kind == "v1" else TOOL_NOT_APPLIED
                self.report(f"tool_config: {self.stats.tool_config}")
            pending = (item for item in itertools.chain([head] if head else [], items) if item.index not in done)
            first = next(pending, None)
            if first is not None or unfilled:
                try:
                    with open(self.checkpoint.local, "a", encoding="utf-8", opener=_private) as results:
                        if unfilled:  # a worker stopped between writing a source's output and its copies'
                            self._fill_copies(unfilled, results)
                        if first is not None:
                            self._check_deadline()  # a retry past the deadline must not start an engine
                            work = engine_order(itertools.chain([first], pending), self.max_in_flight)
                            self._generate(work, results, already_done=len(done))
                except OSError as exc:
                    if exc.filename is None and exc.errno in _WRITE_ERRORS:  # name the file a full disk stopped
                        raise OSError(exc.errno, exc.strerror, self.checkpoint.local) from None
                    raise
        finally:
            self.checkpoint.upload()  # whatever happened, what finished is kept where the next attempt looks
        self._finalize()
        self.checkpoint.discard_local_copy()
        self.stats.wall_s = round(time.monotonic() - started, 3)
        return self.stats

    def _generate(self, pending: Iterator[WorkItem], results: IO[str], already_done: int) -> None:
        from batch_pipeline.worker.engine import build_llm

        model_config = BatchCompletionsModelConfig.model_validate(self.task.model_config)
        tool_config = sandbox = None
        if self.stats.tool_config == TOOL_APPLIED:  # before the engine: a sandbox that cannot hold fails the shard now
            tool_config = ToolConfig.model_validate(self.task.tool_config)
            sandbox = Sandbox(SandboxLimits(timeout_s=tool_config.execution_timeout_seconds or 60))
        t0 = time.monotonic()
        built = build_llm(model_config)
        llm = built.llm
        self.stats.unsupported_engine_args = built.unsupported
        self.stats.dtype, self.stats.dtype_reason = built.dtype, built.dtype_reason
        self.stats.engine_start_s = round(time.monotonic() - t0, 3)
        self.report(
            f"engine ready in {self.stats.engine_start_s:.1f}s, computing in {built.dtype}: {built.dtype_reason}"
        )
        engine = llm.llm_engine

        self._add_engine_handlers(llm, model_config, tool_config, sandbox)
        tool_loop = self.tool_loop
        in_flight = InFlight()
        t0 = last_report = time.monotonic()
        try:
            while True:
                waiting = tool_loop.waiting if tool_loop else 0
                while len(in_flight) + waiting < self.max_in_flight and (item := next(pending, None)) is not None:
                    self._submit(engine, item, in_flight, results)
                if tool_loop is not None:  # prompts whose code has run go back into the engine, or finish
                    for item, step in tool_loop.resume(engine, block=not in_flight):
                        if isinstance(step, dict):
                            self._write(results, item.index, step)
                        else:
                            in_flight.add(item, step)
                if not in_flight:
                    if tool_loop is not None and tool_loop.waiting:
                        continue
                    break
                self._check_deadline(engine, in_flight)
                for result in engine.step():
                    if result.finished and (done := in_flight.finish(result)) is not None:
                        item, item_results = done
                        output = self.handlers[item.kind].output(item, item_results)
                        if output is not None:  # None: its code is running; it comes back through resume
                            self._write(results, item.index, output)
                self.checkpoint.upload_if_due()
                now = time.monotonic()
                if now - last_report >= PROGRESS_INTERVAL_S:
                    last_report = now
                    self._report_progress(already_done, now - t0)
        finally:
            if tool_loop is not None:
                tool_loop.close()
                self.stats.tool_executions = tool_loop.executions
                self.stats.tool_failed_executions = tool_loop.failed_executions
                self.stats.tool_timed_out_executions = tool_loop.timed_out_executions
        results.flush()
        os.fsync(results.fileno())
        self.stats.generate_s = round(time.monotonic() - t0, 3)
        self._report_progress(already_done, self.stats.generate_s)

    def _submit(self, engine: Any, item: WorkItem, in_flight: InFlight, results: IO[str]) -> None:
        try:
            in_flight.add(item, self.handlers[item.kind].submit(engine, item))
        except RequestRefused as exc:
            self._write(results, item.index, refused_output(exc))
        except Exception as exc:  # vLLM refuses the single request (e.g. prompt too long)
            self._write(results, item.index, engine_error_output(exc, item.kind))

    def _write(self, results: IO[str], index: int, output: dict[str, Any]) -> None:
        # One write and a flush per result and its copies: a killed worker leaves whole lines, plus at most
        # one torn one.
        copies = self.copies.get(index, ())
        results.write(format_result(index, output) + copy_lines(output, copies))
        results.flush()
        self._copies_written += len(copies)
        self.stats.generated += 1
        self.stats.errors += "error" in output
        prompt_tokens, completion_tokens = token_counts(output)
        self.stats.prompt_tokens += prompt_tokens  # running figures for progress; _finalize counts them all
        self.stats.completion_tokens += completion_tokens

    def _fill_copies(self, unfilled: dict[int, list[int]], results: IO[str]) -> None:
        with open(self.checkpoint.local, encoding="utf-8") as finished:
            sources = [(index, payload) for index, payload in iter_result_lines(finished) if index in unfilled]
        for source, payload in sources:
            results.write(copy_lines(json.loads(payload), unfilled[source]))
            self._copies_written += len(unfilled[source])
        results.flush()

    def _report_progress(self, already_done: int, elapsed: float) -> None:
        finished = already_done + self.stats.generated + self._copies_written
        rate = self.stats.completion_tokens / elapsed if elapsed > 0 else 0.0
        # Counts of this attempt's requests, plus those a resumed shard found done (their tokens are
        # counted when the shard completes).
        self.report_progress(
            {
                "requests_done": finished,
                "errors": self.stats.errors,
                "prompt_tokens": self.stats.prompt_tokens,
                "completion_tokens": self.stats.completion_tokens,
            }
        )
        self.report(
            f"progress {finished}/{self.shard.item_count} requests, "
            f"{self.stats.completion_tokens} tokens generated, {rate:.0f} tokens/s"
        )

    def _add_engine_handlers(
        self,
        llm: Any,
        model_config: BatchCompletionsModelConfig,
        tool_config: ToolConfig | None,
        sandbox: Sandbox | None,
    ) -> None:
        from batch_pipeline.worker.openai_requests import ChatRequests, CompletionRequests

        self.handlers["completion"] = CompletionRequests(llm, model_config)
        self.handlers["chat"] = ChatRequests(llm, model_config)
        if tool_config is not None and sandbox is not None:
            self.stats.sandbox = sandbox.isolation.to_dict()
            self.report(f"code_evaluator sandbox: {self.stats.sandbox}")
            self.tool_loop = CodeEvaluatorRequests(self.handlers["v1"], tool_config, llm.get_tokenizer(), sandbox)
            self.handlers["v1"] = self.tool_loop

    def _check_deadline(self, engine: Any | None = None, in_flight: InFlight | None = None) -> None:
        if self.task.deadline is not None and time.time() > self.task.deadline:
            in_flight = in_flight or InFlight()
            if engine is not None:
                engine.abort_request(in_flight.engine_ids())
            raise DeadlineExceeded(
                f"max_runtime_sec exceeded: shard {self.shard.shard_index} stopped with "
                f"{len(in_flight)} requests in flight; finished results are kept"
            )

    def _finalize(self) -> None:
        """Write output.tsv: every result, sorted by index, and total the tokens and errors."""
        offsets: dict[int, tuple[int, int]] = {}
        prompt_tokens = completion_tokens = errors = 0
        with open(self.checkpoint.local, "rb") as results:
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
            missing = self.shard.item_count - len(offsets)
            if missing:
                raise RuntimeError(f"shard {self.shard.shard_index}: {missing} requests have no result")
            with io.atomic_write(self.shard.output_path, "wb") as output_file:
                for index in sorted(offsets):
                    start, length = offsets[index]
                    results.seek(start)
                    output_file.write(results.read(length))
        self.stats.prompt_tokens, self.stats.completion_tokens, self.stats.errors = (
            prompt_tokens,
            completion_tokens,
            errors,
        )
        self.stats.deduplicated = self.shard.copy_count


class Checkpoint:
    """The shard's results file. Appends and flushes to a local file are what make a shard resumable; when
    the shard's directory is on an object store (shards in pods on different nodes), that local file
    starts as the stored copy and is uploaded whole every CHECKPOINT_UPLOAD_S and when the worker stops,
    so a retry elsewhere loses at most that much work."""

    def __init__(self, results_path: str) -> None:
        self.remote = None if io.is_local(results_path) else results_path
        self.local = results_path
        self._last_upload = time.monotonic()
        if self.remote is not None:
            self.local = os.path.join(tempfile.mkdtemp(prefix="batch-pipeline-shard-"), "results.tsv")
            fs, path = io.filesystem(self.remote)
            if fs.exists(path):
                fs.get_file(path, self.local)

    def upload_if_due(self) -> None:
        if self.remote is not None and time.monotonic() - self._last_upload >= CHECKPOINT_UPLOAD_S:
            self.upload()

    def discard_local_copy(self) -> None:
        if self.remote is not None:
            shutil.rmtree(os.path.dirname(self.local), ignore_errors=True)

    def upload(self) -> None:
        if self.remote is not None and os.path.exists(self.local):
            fs, path = io.filesystem(self.remote)
            fs.put_file(self.local, path)
            self._last_upload = time.monotonic()


def _private(path: str, flags: int) -> int:
    """Open as a file only the worker's user may read (0600): another job's results are not for others."""
    return os.open(path, flags, 0o600)


def recover_checkpoint(results_path: str) -> set[int]:
    """Indices already finished; a torn last line left by a killed worker is cut off so appends stay whole."""
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
