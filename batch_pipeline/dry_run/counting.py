"""A request's records read as its job's plan_shards reads them, each through the shard worker's own request
handlers with a recorder standing where the engine stands, and its prompts counted with the model's
tokenizer against its context: what a dry run's checking process (`dry_run.child`) runs."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from batch_pipeline.admission.paths import DataFiles
from batch_pipeline.admission.submission import UnservableRequest
from batch_pipeline.contract import BatchCompletionsModelConfig, CreateBatchCompletionsV2Request
from batch_pipeline.contract.estimate import RequestProblem
from batch_pipeline.contract.kinds import kind_named
from batch_pipeline.contract.requests import BatchContent
from batch_pipeline.core import io
from batch_pipeline.models.sync import sync_tokenizer_files
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.records import expected_output_tokens, work_items

# Problems listed per kind (all are counted): a million-prompt job's answer stays small.
MAX_LISTED = 100
_CONTENT = TypeAdapter(BatchContent)


def source_field(request: CreateBatchCompletionsV2Request) -> str:
    """The field the request's records come from."""
    return "content" if request.content is not None else "input_data_path"


def records(request: CreateBatchCompletionsV2Request, files: DataFiles) -> Iterator[tuple[str, Any]]:
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
        raise UnservableRequest([("input_data_path", f"cannot read {path}: {short(exc)}")]) from None


@dataclass
class Counts:
    requests: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Of the prompt tokens, those of kinds that generate nothing (embeddings): their work is reading them.
    pooled_tokens: int = 0
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


def count(
    request: CreateBatchCompletionsV2Request, model: Model, records: Iterator[tuple[str, Any]], source: str
) -> Counts:
    # The worker's handlers import vLLM: in the dry run's child (its forkserver), never in the API process.
    from batch_pipeline.worker.handlers import RequestRefused
    from batch_pipeline.worker.kinds import kind_handlers

    handlers = kind_handlers(model, request.model_cfg)
    counts = Counts()
    items = work_items(records)
    while True:
        try:
            entry = next(items, None)
        except Exception as exc:  # malformed, unreadable: the whole job would fail on it
            raise UnservableRequest([(source, short(exc))]) from None
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
            counts.refuse(item.index, "invalid_request", short(exc))
            continue
        _measure(item, recorder.added, model, counts)


def _measure(item: WorkItem, added: list[tuple[Any, Any, dict[str, Any]]], model: Model, counts: Counts) -> None:
    """One request's prompts against the context, as vLLM checks them when they are added."""
    context = model.context_length
    generates = kind_named(item.kind).generates
    room = 1 if generates else 0  # a generated token at least; an embedding needs none
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
        if length + room > context:
            counts.refuse(
                item.index,
                "prompt_too_long",
                f"{which}the prompt is {length} tokens; the model's context of {context} must hold it"
                + (" and at least one generated token" if room else ""),
            )
            return
        lengths.append(length)
    params = added[0][1]  # one request's prompts share their sampling parameters
    n = getattr(params, "n", None) or 1
    # None: the engine fills the context (the job's planning assumes a bound), or it generates nothing
    limit = getattr(params, "max_tokens", None)
    per_candidate = limit if limit is not None else expected_output_tokens(item.kind, item.request) // n
    for length in lengths:
        counts.prompts += 1
        counts.prompt_tokens += length
        counts.pooled_tokens += 0 if generates else length
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
class Model:
    """What the worker's request handlers read of their vLLM `LLM` (`get_tokenizer()`,
    `llm_engine.model_config`), built by vLLM from the engine arguments the worker would pass."""

    model_config: Any  # vLLM's ModelConfig: the context, the model's generation defaults
    tokenizer: Any

    @property
    def llm_engine(self) -> Model:
        return self

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def context_length(self) -> int:
        return self.model_config.max_model_len


def model_of(model_config: BatchCompletionsModelConfig) -> Model:
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
        raise UnservableRequest([(failing, f"the model cannot be read here: {short(exc)}")]) from None
    return Model(engine_config, tokenizer)


@functools.lru_cache(maxsize=32)  # per process; vLLM caches the tokenizers itself
def _engine_model_config(arguments_json: str) -> Any:
    from batch_pipeline.worker.vllm_api import EngineArgs

    return EngineArgs(**json.loads(arguments_json)).create_model_config()


def short(exc: BaseException, limit: int = 500) -> str:
    if isinstance(exc, ValidationError):  # vLLM's configs: the messages, never the input they echo
        text = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors(include_url=False))
    else:
        text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."
