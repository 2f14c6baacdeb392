"""Running one shard: every pending request through one vLLM engine, results appended as they finish.

The loop here knows no endpoint: request handlers (handlers.py) turn work items into engine requests and
engine results into outputs, and may hold items between rounds (the code_evaluator tool loop). The results
file is the checkpoint (checkpoint.py): a worker started again on the same shard skips what is already
there, so a killed shard loses at most the requests that were in flight.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

from batch_pipeline.contract import BatchCompletionsModelConfig, ToolConfig
from batch_pipeline.contract.kinds import kind_named
from batch_pipeline.shards.format import WorkItem, format_result, read_copies, read_work_items, token_counts
from batch_pipeline.shards.protocol import ENGINE_STARTING, WORKER_WINDOW, ShardStats, ShardTask
from batch_pipeline.shards.records import expected_output_tokens
from batch_pipeline.worker.checkpoint import Checkpoint, copy_lines, write_sorted_output
from batch_pipeline.worker.code_evaluator import TOOL_APPLIED, TOOL_NOT_APPLIED, CodeEvaluatorRequests
from batch_pipeline.worker.handlers import (
    MultiRoundHandler,
    RequestHandler,
    RequestRefused,
    engine_error_output,
    error_output,
    refused_output,
)
from batch_pipeline.worker.kinds import WrongRunner, kind_handlers
from batch_pipeline.worker.prefix_cache import SaltedEngine
from batch_pipeline.worker.sandbox import Sandbox, SandboxSettings, SandboxUnavailable
from batch_pipeline.worker.shared_generation import SharedGenerations, text_pieces

if TYPE_CHECKING:
    from batch_pipeline.worker.engine import Engine, KeptEngine

logger = logging.getLogger(__name__)

# Requests handed to the engine ahead of the scheduler: enough to keep every batch slot busy, few enough
# that a shard of a million prompts does not hold them all in memory.
DEFAULT_MAX_IN_FLIGHT = WORKER_WINDOW
PROGRESS_INTERVAL_S = 5.0
# With nothing in the engine, how long the loop waits for an item held outside it (its code running)
# before it checks the deadline again.
IDLE_WAIT_S = 1.0


class DeadlineExceeded(RuntimeError):
    pass


class InFlight:
    """Items in the engine, each made of one or more engine requests (one per prompt of a request)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[WorkItem, list[str], dict[str, Any]]] = {}
        self._owner: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, item: WorkItem, engine_ids: list[str]) -> None:
        if not engine_ids:  # a multi-round handler holds the item outside the engine for now
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


def engine_order(
    items: Iterator[WorkItem], window: int, combine: Callable[[list[WorkItem]], list[WorkItem]] = list
) -> Iterator[WorkItem]:
    """Each window of items (`combine`d: requests one generation answers, as one), the longest possible
    outputs first; among equals, those sharing a context (the conversation before its last message, the
    prompt before its last line) side by side where the first of them stood, and the rest in input order.
    Outputs go back to their index, so the order of work is free.

    A long generation started last finishes alone, long after the rest (the engine runs at most
    `max_num_seqs` at once): started first, it runs beside the short ones. Batch inputs often repeat a long
    prefix (few-shot templates, system prompts) far apart; submitted together, the later requests find the
    prefix in vLLM's cache instead of computing it again. Nothing else moves: in bfloat16 a greedy text
    depends on which requests share its batches, and raw vLLM, given the same list, batches it in input
    order (sorted by prompt text, 70 of 256 unique greedy texts differed from raw's; in input order, none).
    """
    while chunk := combine(list(itertools.islice(items, window))):
        group_at: dict[str, int] = {}
        groups = [group_at.setdefault(_shared_context(item), position) for position, item in enumerate(chunk)]
        order = sorted(
            range(len(chunk)),
            key=lambda position: (
                -expected_output_tokens(chunk[position].kind, chunk[position].request),
                groups[position],
            ),
        )
        yield from (chunk[position] for position in order)


def _shared_context(item: WorkItem) -> str:
    """What requests of a batch usually share, as the item's kind says (a chat's messages before its last, a
    prompt before its last line)."""
    return kind_named(item.kind).shared_context(item.request)


class ShardRunner:
    """One shard's pending requests through one engine: each item to its kind's handler, at most
    `max_in_flight` begun at once, each output appended to the checkpoint as it finishes, then the sorted
    output and the shard's stats."""

    def __init__(
        self,
        task: ShardTask,
        checkpoint_upload_s: float,
        report: Callable[[str], None] = logger.info,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        report_progress: Callable[[dict[str, int]], None] | None = None,
        imported_ahead_s: float = 0.0,
        sandbox_settings: SandboxSettings | None = None,
        kept_engine: KeptEngine | None = None,
    ) -> None:
        self.task = task
        # A pool worker's engine, kept between its shards; None: this shard builds its own.
        self.kept_engine = kept_engine
        self.sandbox_settings = sandbox_settings or SandboxSettings()
        # How often a checkpoint on an object store is uploaded (BATCH_PIPELINE_CHECKPOINT_UPLOAD_S).
        self.checkpoint_upload_s = checkpoint_upload_s
        self.shard = task.shard
        self.report = report
        self.report_progress = report_progress or (lambda figures: None)
        self.max_in_flight = max_in_flight
        self.handlers: dict[str, RequestHandler] = {}  # by kind name, built with the engine
        self.stats = ShardStats(
            shard_index=self.shard.shard_index, items=self.shard.item_count, imported_ahead_s=imported_ahead_s
        )
        self.copies: dict[int, list[int]] = {}  # source index -> indices answered by its output
        self._copies_written = 0
        self.shared: SharedGenerations | None = None  # built with the engine, whose tokenizer cuts outputs
        self._alone: collections.deque[WorkItem] = collections.deque()  # members to generate on their own
        # Kept as long as the runner: dropping an in-process vLLM engine runs its shutdown, which unfreezes
        # and collects the whole heap twice (~1.4 s on 2 cores), a cost the worker's process exit skips.
        self.engine: Engine | None = None

    def run(self) -> ShardStats:
        started = time.monotonic()
        self.checkpoint = Checkpoint(self.shard.results_path, self.checkpoint_upload_s)
        try:
            done = self.checkpoint.recover()
            # The plan puts the results its team's cache holds in the checkpoint: done, but not resumed.
            self.stats.resumed = max(0, len(done) - self.shard.cached_count)
            if self.stats.resumed:
                self.report(f"resuming: {len(done)} of {self.shard.item_count} requests already done")
            elif done:
                self.report(f"{len(done)} of {self.shard.item_count} requests answered from the result cache")
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
                self.stats.tool_config = TOOL_APPLIED if kind_named(head.kind).takes_tool_config else TOOL_NOT_APPLIED
                self.report(f"tool_config: {self.stats.tool_config}")
            pending = (item for item in itertools.chain([head] if head else [], items) if item.index not in done)
            first = next(pending, None)
            if first is not None or unfilled:
                with self.checkpoint.appending() as results:
                    if unfilled:  # a worker stopped between writing a source's output and its copies'
                        self._fill_copies(unfilled, results)
                    if first is not None:
                        self._check_deadline()  # a retry past the deadline must not start an engine
                        work = engine_order(itertools.chain([first], pending), self.max_in_flight, self._combine)
                        self._generate(work, results, already_done=len(done))
        finally:
            self.checkpoint.upload()  # whatever happened, what finished is kept where the next attempt looks
        self._finalize()
        self.checkpoint.discard_local_copy()
        self.stats.wall_s = round(time.monotonic() - started, 3)
        return self.stats

    def _generate(self, pending: Iterator[WorkItem], results: IO[str], already_done: int) -> None:
        from batch_pipeline.worker.engine import build_llm

        model_config = self.task.model_config
        tool_config = sandbox = None
        if self.stats.tool_config == TOOL_APPLIED and self.task.tool_config is not None:
            # before the engine: where the sandbox cannot hold, no engine starts and each request says why
            tool_config = self.task.tool_config
            limits = self.sandbox_settings.limits(tool_config.execution_timeout_seconds or 60)
            try:
                sandbox = Sandbox(limits, settings=self.sandbox_settings)
            except SandboxUnavailable as exc:
                self.stats.sandbox = {"refused": str(exc)}
                self.report(f"code_evaluator sandbox: {exc}")
                for unserved in pending:
                    self._write(results, unserved.index, error_output("tool_unavailable", str(exc), "tool_config"))
                return
        if self.kept_engine is None or not self.kept_engine.holds(model_config):
            self.report_progress({ENGINE_STARTING: 1})  # its job reads "starting engine" until the next report
        t0 = time.monotonic()
        if self.kept_engine is None:
            built = self.engine = build_llm(model_config)
        else:
            built, warm = self.kept_engine.engine_for(model_config)
            self._count_warm_start(warm)
        llm = built.llm
        self.stats.unsupported_engine_args = built.unsupported
        self.stats.dtype, self.stats.dtype_reason = built.dtype, built.dtype_reason
        self.stats.engine_start_s = round(time.monotonic() - t0 + self._imports_before(), 3)
        self.report(
            f"engine {'warm' if self.stats.engine_warm else 'ready'} in {self.stats.engine_start_s:.1f}s"
            + (f" (it served {self.stats.engine_shards_before} shards before)" if self.stats.engine_warm else "")
            + f", computing in {built.dtype}: {built.dtype_reason}"
        )
        self.report_progress({"requests_done": already_done})  # generating from now on
        engine = SaltedEngine(built.engine, self.task.owner_team)  # the team's own prefix cache

        self._add_engine_handlers(llm, model_config, tool_config, sandbox)
        multi_round = [handler for handler in self.handlers.values() if isinstance(handler, MultiRoundHandler)]
        pieces = text_pieces(llm.get_tokenizer()) if self.task.share_generations else None
        if pieces is not None:
            self.shared = SharedGenerations(
                # a tool loop's rounds run code between generations: each request keeps its own
                shareable=lambda item: not isinstance(self.handlers[item.kind], MultiRoundHandler),
                pieces=pieces,
            )
        in_flight = InFlight()

        def begun() -> int:  # items begun and not written: in the engine, or held outside it
            return len(in_flight) + sum(handler.waiting for handler in multi_round)

        def unfinished() -> int:  # and those owed again, on their own
            return begun() + len(self._alone)

        def next_item() -> WorkItem | None:
            return self._alone.popleft() if self._alone else next(pending, None)

        t0 = last_report = time.monotonic()
        try:
            while True:
                while begun() < self.max_in_flight and (item := next_item()) is not None:
                    self._submit(engine, item, in_flight, results)
                for handler in multi_round:  # items back from outside the engine: into it again, or finished
                    for item, step in handler.resume(engine, wait_s=0.0 if in_flight else IDLE_WAIT_S):
                        if isinstance(step, dict):
                            self._write(results, item.index, step)
                        else:
                            in_flight.add(item, step)
                if not unfinished():
                    break
                self._check_deadline(engine, in_flight, unfinished())
                if in_flight:
                    for result in engine.step():
                        if result.finished and (done := in_flight.finish(result)) is not None:
                            self._finished(*done, results)
                self.checkpoint.upload_if_due()
                now = time.monotonic()
                if now - last_report >= PROGRESS_INTERVAL_S:
                    last_report = now
                    self._report_progress(already_done, now - t0)
        finally:
            for handler in multi_round:
                handler.close(self.stats)
        self.stats.generate_s = round(time.monotonic() - t0, 3)
        self._report_progress(already_done, self.stats.generate_s)

    def _imports_before(self) -> float:
        """A cold pool worker's import of torch and vLLM, done before its shard's engine was built: part of
        the shard's engine start, as a launched worker's is."""
        kept = self.kept_engine
        return kept.imported_s if kept is not None and not self.stats.engine_warm else 0.0

    def _count_warm_start(self, warm: bool) -> None:
        kept = self.kept_engine
        assert kept is not None
        self.stats.engine_pooled = True
        if warm:
            self.stats.engine_warm = True
            self.stats.engine_shards_before = kept.shards_served
            self.stats.engine_start_saved_s = round(kept.built_s, 3)
        kept.shards_served += 1

    def _combine(self, window: list[WorkItem]) -> list[WorkItem]:
        return self.shared.combine(window) if self.shared is not None else window

    def _submit(self, engine: Any, item: WorkItem, in_flight: InFlight, results: IO[str]) -> None:
        try:
            in_flight.add(item, self.handlers[item.kind].submit(engine, item))
        except Exception as exc:
            if self.shared is not None and (members := self.shared.members(item.index)) is not None:
                # a refused shared generation: each of its requests asks on its own, for an entry of its own
                self._alone.extend(members)
            elif isinstance(exc, RequestRefused):
                self._write(results, item.index, refused_output(exc))
            else:  # vLLM refuses the single request (e.g. prompt too long)
                self._write(results, item.index, engine_error_output(exc, item.kind))

    def _finished(self, item: WorkItem, item_results: list[Any], results: IO[str]) -> None:
        handler = self.handlers[item.kind]
        shared = self.shared
        members = shared.members(item.index) if shared is not None else None
        if shared is None or members is None:
            answers: Iterator[tuple[WorkItem, list[Any] | None]] = iter([(item, item_results)])
        else:
            answers = shared.answers(members, item_results)
        answered = 0
        for member, member_results in answers:
            if member_results is None:  # the cut could differ from the engine's own answer
                self._alone.append(member)
                continue
            output = handler.output(member, member_results)
            if output is not None:  # None: the handler holds the item for another round
                self._write(results, member.index, output)
                answered += 1
        self.stats.cut_from_longer += max(answered - 1, 0)  # one of them is the generation's own request

    def _write(self, results: IO[str], index: int, output: dict[str, Any]) -> None:
        # The result, then its copies, a line at a time, then a flush: a killed worker leaves whole lines, plus
        # at most one torn one, and a result found without all its copies gets the rest when it resumes.
        copies = self.copies.get(index, ())
        results.write(format_result(index, output))
        results.writelines(copy_lines(output, copies))
        results.flush()
        self._copies_written += len(copies)
        self.stats.generated += 1
        self.stats.errors += "error" in output
        prompt_tokens, completion_tokens = token_counts(output)
        self.stats.prompt_tokens += prompt_tokens  # running figures for progress; _finalize counts them all
        self.stats.completion_tokens += completion_tokens

    def _fill_copies(self, unfilled: dict[int, list[int]], results: IO[str]) -> None:
        for source, output in list(self.checkpoint.finished_outputs(set(unfilled))):
            results.writelines(copy_lines(output, unfilled[source]))
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
        self.handlers = kind_handlers(llm, model_config)
        if tool_config is not None and sandbox is not None:
            self.stats.sandbox = sandbox.isolation.to_dict()
            self.report(f"code_evaluator sandbox: {self.stats.sandbox}")
            for name, handler in list(self.handlers.items()):  # the kinds the tool loop runs (v1 content)
                # never around a refusal: a kind this engine's model cannot run is refused per item as it is
                if kind_named(name).takes_tool_config and not isinstance(handler, WrongRunner):
                    self.handlers[name] = CodeEvaluatorRequests(handler, tool_config, llm.get_tokenizer(), sandbox)

    def _check_deadline(
        self, engine: Any | None = None, in_flight: InFlight | None = None, unfinished: int = 0
    ) -> None:
        """Past the job's deadline, abort what is in the engine and stop; what is unfinished is not written,
        so a retry in time (there is none past it) does it again."""
        if self.task.deadline is not None and time.time() > self.task.deadline:
            if engine is not None and in_flight is not None:
                engine.abort_request(in_flight.engine_ids())
            raise DeadlineExceeded(
                f"max_runtime_sec exceeded: shard {self.shard.shard_index} stopped with "
                f"{unfinished} requests in flight; finished results are kept"
            )

    def _finalize(self) -> None:
        """Write output.tsv and total the shard's tokens and errors, over every result (resumed ones too)."""
        totals = write_sorted_output(
            self.checkpoint.local, self.shard.output_path, self.shard.item_count, self.shard.shard_index
        )
        self.stats.prompt_tokens = totals.prompt_tokens
        self.stats.completion_tokens = totals.completion_tokens
        self.stats.errors = totals.errors
        self.stats.deduplicated = self.shard.copy_count
