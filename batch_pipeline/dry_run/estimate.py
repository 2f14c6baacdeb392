"""A dry run: a request read, checked and tokenized as its job would be, and what it would cost here,
with nothing launched, stored or written.

The records are read as `plan_shards` reads them (inline content, or the input file streamed), and each
request goes through the shard worker's own request handlers, with a recorder standing where the engine
stands: so a field the worker refuses, a chat template that does not render, and the prompt the engine
would get (chat through the template) are exactly the worker's. The prompts are counted with the model's
tokenizer against its context. The time is estimated from the throughput this deployment measured on its
latest completed jobs of the model.

The reading, rendering and tokenizing run in a child process of their own, bounded in memory and time: a
chat template is the request's own program (Jinja), free to loop for hours or build strings of gigabytes,
and the API process serves every tenant.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import resource
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pydantic import TypeAdapter, ValidationError

from batch_pipeline.admission.hardware import kubernetes_quantity
from batch_pipeline.admission.paths import DataFiles
from batch_pipeline.admission.submission import UnservableRequest
from batch_pipeline.contract import BatchCompletionsModelConfig, CreateBatchCompletionsV2Request
from batch_pipeline.contract.estimate import BatchCompletionsEstimate, RequestProblem, RuntimeEstimate
from batch_pipeline.contract.requests import BatchContent
from batch_pipeline.core import io
from batch_pipeline.core.settings import SlotsBusy, TeamSlots, settings
from batch_pipeline.models.sync import sync_tokenizer_files
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.planning import PlanningSettings
from batch_pipeline.shards.records import expected_output_tokens, work_items

# Problems listed per kind (all are counted): a million-prompt job's answer stays small.
MAX_LISTED = 100
# Completed jobs of the model whose throughput the estimate takes the median of.
HISTORY_JOBS = 20
_CONTENT = TypeAdapter(BatchContent)
# What a dry run needs of an object-store checkpoint: its configs and tokenizer, never its weights.

# What the checking child needs, imported once by the forkserver it forks from rather than by each child.
_CHILD_PRELOAD = [
    "batch_pipeline.dry_run.estimate",
    "batch_pipeline.worker.openai_requests",
    "batch_pipeline.worker.v1_requests",
]


class DryRunsBusy(SlotsBusy):
    """As many dry runs as this process takes at once, or as the caller's team may hold, are in progress."""


# Dry runs at once in this process: each holds a thread (and a child process) for as long as its input
# takes; a team at most its share, so that two slow chat templates of one team leave the others a slot.
_slots = TeamSlots(
    "dry runs",
    lambda configured: configured.max_concurrent_dry_runs,
    lambda configured: configured.max_dry_runs_per_team,
    "BATCH_PIPELINE_MAX_DRY_RUNS_PER_TEAM",
    busy=DryRunsBusy,
)


def estimate(
    request: CreateBatchCompletionsV2Request, history: list[dict[str, Any]], files: DataFiles, team: str | None
) -> BatchCompletionsEstimate:
    """The dry run of a request whose paths and fields `check_servable` accepted, its input opened as its
    job would open it (`files`: beneath the requester's data roots), in one of the slots `team`
    (`Caller.owner`) may hold. `history` is the model's completed jobs' figures, newest first
    (`JobStore.completed_figures`). Raises UnservableRequest naming the field for what makes the whole job
    fail (an unreadable input, a model with no tokenizer here), and DryRunsBusy when the process runs as
    many dry runs as it takes, or the team holds its share."""
    with _slots.hold(team):
        counts, context_length = _counted_apart(request, files)
    return BatchCompletionsEstimate(
        model=request.model_cfg.model,
        context_length=context_length,
        num_requests=counts.requests,
        num_prompts=counts.prompts,
        prompt_tokens=counts.prompt_tokens,
        max_output_tokens=counts.output_tokens,
        num_cannot_run=counts.cannot_run,
        cannot_run=counts.cannot_run_listed,
        num_cut_at_context=counts.cut,
        cut_at_context=counts.cut_listed,
        **_runtime(request, counts, history),
    )


def _counted_apart(request: CreateBatchCompletionsV2Request, files: DataFiles) -> tuple[_Counts, int]:
    """The request's counts and the model's context, from a child process that may add at most
    BATCH_PIPELINE_DRY_RUN_MEMORY_MB to what it starts with and is stopped after
    BATCH_PIPELINE_DRY_RUN_TIMEOUT_S."""
    configured = settings()
    source = _source_field(request)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_CHILD_PRELOAD)  # no effect once this process's forkserver runs
    receiving, sending = context.Pipe(duplex=False)
    memory_bytes = configured.dry_run_memory_mb * 2**20
    child = context.Process(
        target=_count_in_child,
        args=(request, files, sending, memory_bytes, configured.dry_run_timeout_s, dict(os.environ), os.getcwd()),
        daemon=True,
    )
    child.start()
    sending.close()  # the child's end: an EOF here then means the child is gone
    try:
        if not receiving.poll(configured.dry_run_timeout_s):
            raise UnservableRequest(
                [
                    (
                        source,
                        f"the dry run was stopped after {configured.dry_run_timeout_s:g} s (a chat template that "
                        "does not end?); the job's shards would spend their time on the same requests",
                    )
                ]
            )
        try:
            outcome = receiving.recv()
        except EOFError:
            raise UnservableRequest(
                [
                    (
                        source,
                        f"the dry run's checking process ended without an answer (exit code {child.exitcode}); "
                        f"it may hold at most {configured.dry_run_memory_mb} MiB",
                    )
                ]
            ) from None
    finally:
        child.kill()
        child.join()
        receiving.close()
    kind, *answer = outcome
    if kind == "unservable":
        raise UnservableRequest(answer[0])
    if kind == "failed":
        raise RuntimeError(f"the dry run failed: {answer[0]}")
    counts, context_length = answer
    return counts, context_length


def _count_in_child(
    request: CreateBatchCompletionsV2Request,
    files: DataFiles,
    answer: Connection,
    memory_bytes: int,
    timeout_s: float,
    environment: dict[str, str],
    cwd: str,
) -> None:
    """The child's side: limits first, then the dry run's reading, rendering and counting; one message back."""
    # Forked from the forkserver, it has that server's environment and directory: it reads the request's
    # paths and the settings as the API process would now.
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes,) * 2)
    cpu_s = int(timeout_s) + 5  # the parent stops it first; this holds should the parent be gone
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    source = _source_field(request)
    try:
        model = _model_of(request.model_cfg)
        records = _records(request, files)
        outcome: tuple[Any, ...] = ("counted", _count(request, model, records, source), model.context_length)
    except UnservableRequest as exc:
        outcome = ("unservable", exc.refused)
    except MemoryError:
        outcome = ("unservable", [(source, f"checking the requests took more than {memory_bytes // 2**20} MiB")])
    except Exception as exc:
        outcome = ("failed", f"{type(exc).__name__}: {_short(exc)}")
    answer.send(outcome)
    answer.close()


def _address_space() -> int:
    """This process's virtual memory now, in bytes: the child's limit counts from what it starts with."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


# --- reading the requests --------------------------------------------------------------------------------


def _source_field(request: CreateBatchCompletionsV2Request) -> str:
    """The field the request's records come from."""
    return "content" if request.content is not None else "input_data_path"


def _records(request: CreateBatchCompletionsV2Request, files: DataFiles) -> Iterator[tuple[str, Any]]:
    """The raw records as the job's plan_shards step reads them."""
    if request.content is None:
        path = request.input_data_path
        assert path is not None  # the request's validator requires content or input_data_path
        if not _exists(path, files):
            raise UnservableRequest([("input_data_path", f"no file at {path}")])
        return io.iter_json_records(path, files.open)
    # As written to content.json at submission and read back from there.
    content = _CONTENT.dump_python(request.content, mode="json", by_alias=True, exclude_none=True)
    if isinstance(content, dict):
        return iter([("content", content)])
    return ((f"content.{position}", record) for position, record in enumerate(content))


def _exists(path: str, files: DataFiles) -> bool:
    try:
        return files.exists(path)
    except Exception as exc:  # an object store's errors are not all OSErrors
        raise UnservableRequest([("input_data_path", f"cannot read {path}: {_short(exc)}")]) from None


@dataclass
class _Counts:
    requests: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cannot_run: int = 0
    cannot_run_listed: list[RequestProblem] = field(default_factory=list)
    cut: int = 0
    cut_listed: list[RequestProblem] = field(default_factory=list)

    def refuse(self, index: int, code: str, message: str) -> None:
        self.cannot_run += 1
        if len(self.cannot_run_listed) < MAX_LISTED:
            self.cannot_run_listed.append(RequestProblem(index=index, code=code, message=message))

    def cut_short(self, index: int, message: str) -> None:
        self.cut += 1
        if len(self.cut_listed) < MAX_LISTED:
            self.cut_listed.append(RequestProblem(index=index, code="output_past_context", message=message))


class _Recorder:
    """Stands where the engine stands for the worker's request handlers: keeps what they would give it."""

    def __init__(self) -> None:
        self.added: list[tuple[Any, Any, dict[str, Any]]] = []

    def add_request(self, request_id: str, prompt: Any, params: Any, tokenization_kwargs: dict | None = None) -> None:
        self.added.append((prompt, params, tokenization_kwargs or {}))

    def abort_request(self, request_ids: list[str]) -> None:
        pass


def _count(
    request: CreateBatchCompletionsV2Request, model: _Model, records: Iterator[tuple[str, Any]], source: str
) -> _Counts:
    # The worker's handlers import vLLM: in the dry run's child (its forkserver), never in the API process.
    from batch_pipeline.worker.handlers import RequestHandler, RequestRefused
    from batch_pipeline.worker.openai_requests import ChatRequests, CompletionRequests
    from batch_pipeline.worker.v1_requests import V1Requests

    handlers: dict[str, RequestHandler] = {
        "v1": V1Requests(),
        "completion": CompletionRequests(model, request.model_cfg),
        "chat": ChatRequests(model, request.model_cfg),
    }
    counts = _Counts()
    items = work_items(records)
    while True:
        try:
            entry = next(items, None)
        except Exception as exc:  # malformed, unreadable: the whole job would fail on it
            raise UnservableRequest([(source, _short(exc))]) from None
        if entry is None:
            return counts
        item, _ = entry
        counts.requests += 1
        recorder = _Recorder()
        try:
            handlers[item.kind].submit(recorder, item)
        except RequestRefused as exc:
            counts.refuse(item.index, exc.code, str(exc))
            continue
        except Exception as exc:  # as the worker: this request is an error entry, the rest run
            counts.refuse(item.index, "invalid_request", _short(exc))
            continue
        _measure(item, recorder.added, model, counts)


def _measure(item: WorkItem, added: list[tuple[Any, Any, dict[str, Any]]], model: _Model, counts: _Counts) -> None:
    """One request's prompts against the context, as vLLM checks them when they are added."""
    context = model.context_length
    if not added:
        return
    lengths = []
    for position, (prompt, _, tokenization) in enumerate(added):
        length = (
            len(prompt["prompt_token_ids"])
            if isinstance(prompt, dict)
            else len(model.tokenizer.encode(prompt, add_special_tokens=tokenization.get("add_special_tokens", True)))
        )
        which = f"prompt {position}: " if len(added) > 1 else ""
        if length == 0:
            counts.refuse(item.index, "invalid_request", f"{which}the prompt is empty")
            return
        if length >= context:  # vLLM needs room for one generated token at least
            counts.refuse(
                item.index,
                "prompt_too_long",
                f"{which}the prompt is {length} tokens; the model's context of {context} must hold it "
                "and at least one generated token",
            )
            return
        lengths.append(length)
    params = added[0][1]  # one request's prompts share their sampling parameters
    n = getattr(params, "n", None) or 1
    limit = params.max_tokens  # None: the engine fills the context; the job's planning assumes a bound
    per_candidate = limit if limit is not None else expected_output_tokens(item.kind, item.request) // n
    for length in lengths:
        counts.prompts += 1
        counts.prompt_tokens += length
        counts.output_tokens += min(per_candidate, context - length) * n
    longest = max(lengths)
    if limit is not None and longest + limit > context:
        counts.cut_short(
            item.index,
            f"the prompt ({longest} tokens) and max tokens ({limit}) exceed the context "
            f"of {context}: generation stops after {context - longest} tokens",
        )


# --- the model: tokenizer and context --------------------------------------------------------------------


@dataclass
class _Model:
    """What the worker's request handlers read of their vLLM `LLM` (`get_tokenizer()`,
    `llm_engine.model_config`), built by vLLM from the engine arguments the worker would pass."""

    model_config: Any  # vLLM's ModelConfig: the context, the model's generation defaults
    tokenizer: Any

    @property
    def llm_engine(self) -> _Model:
        return self

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def context_length(self) -> int:
        return self.model_config.max_model_len


def _model_of(model_config: BatchCompletionsModelConfig) -> _Model:
    """The model as a shard worker builds it (worker/engine.py), short of loading weights. Never with the
    model's own code: the API process holds every tenant's keys and jobs, whatever the operator lets
    shard workers run."""
    from batch_pipeline.worker.engine import engine_arguments
    from batch_pipeline.worker.vllm_api import cached_tokenizer_from_config

    config = model_config.model_copy(update={"trust_remote_code": False})
    weights = "model_config.checkpoint_path" if model_config.checkpoint_path else "model_config.model"
    failing = weights
    try:
        for name in ("checkpoint_path", "tokenizer"):  # an object store's: its configs and tokenizer only
            value = getattr(config, name)
            if value and not io.is_local(value):
                failing = f"model_config.{name}"
                config = config.model_copy(update={name: str(sync_tokenizer_files(value))})
        failing = weights
        arguments, _ = engine_arguments(config)
        engine_config = _engine_model_config(json.dumps(arguments, sort_keys=True, default=str))
        failing = "model_config.tokenizer" if model_config.tokenizer else weights
        tokenizer = cached_tokenizer_from_config(engine_config)
    except Exception as exc:  # whatever stops it here stops the job's engine too
        if "max_model_len" in str(exc) and (model_config.max_model_len or model_config.max_context_length):
            failing = "model_config.max_model_len" if model_config.max_model_len else "model_config.max_context_length"
        raise UnservableRequest([(failing, f"the model cannot be read here: {_short(exc)}")]) from None
    return _Model(engine_config, tokenizer)


@functools.lru_cache(maxsize=32)  # per process; vLLM caches the tokenizers itself
def _engine_model_config(arguments_json: str) -> Any:
    from batch_pipeline.worker.vllm_api import EngineArgs

    return EngineArgs(**json.loads(arguments_json)).create_model_config()


# --- time and cost -----------------------------------------------------------------------------------------


def _runtime(request: CreateBatchCompletionsV2Request, counts: _Counts, history: list[dict[str, Any]]) -> dict:
    rates = [
        figures["completion_tokens_per_s"] / max(1, figures.get("shards") or 1)
        for figures in history
        if (figures.get("completion_tokens_per_s") or 0) > 0
    ]
    if not rates:
        model = request.model_cfg.model
        why = (
            f"no history: no job of {model!a} has completed on this deployment yet"
            if not history
            else f"no history: no completed job of {model!a} here generated any tokens"
        )
        return {"no_history": why + ", so there is no throughput to estimate from"}
    rate = statistics.median(rates)
    workers = _workers(request, counts.prompt_tokens + counts.output_tokens)
    wall_s = counts.output_tokens / (rate * workers)
    worker_hours = wall_s * workers / 3600
    cpus = float(kubernetes_quantity("cpus", request.cpus)[1]) if request.cpus is not None else None
    return {
        "estimate": RuntimeEstimate(
            completion_tokens_per_s=round(rate, 2),
            from_jobs=len(rates),
            workers=workers,
            wall_s=round(wall_s, 1),
            worker_hours=round(worker_hours, 4),
            gpu_hours=round(worker_hours * request.gpus, 4) if request.gpus else None,
            cpu_hours=round(worker_hours * cpus, 4) if cpus else None,
        )
    }


def _workers(request: CreateBatchCompletionsV2Request, tokens: int) -> int:
    """Shard workers the job would run in, as plan_shards decides it, with the settings it reads (the
    launcher's own limit on workers at once is not known here)."""
    return PlanningSettings.from_environment(slots=None).shards_for(request.data_parallelism or 1, tokens)[0]


def _short(exc: BaseException, limit: int = 500) -> str:
    if isinstance(exc, ValidationError):  # vLLM's configs: the messages, never the input they echo
        text = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors(include_url=False))
    else:
        text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."
