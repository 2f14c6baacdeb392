"""The worker's side of the request kinds (the registry is `contract/kinds`): for each kind, the handler that
runs its work items on the engine, built from the engine's `LLM` (its tokenizer, its model config) and the
job's model config. The run loop and the dry run ask here; neither names a kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.kinds import CHAT, COMPLETION, EMBEDDING, KINDS, RESPONSES, V1, RequestKind
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.worker.handlers import RequestHandler, RequestRefused

# (llm, model_config) -> the kind's handler; the dry run passes a stand-in with the tokenizer and model
# config an `LLM` would have (dry_run/counting.py).
HandlerFactory = Callable[[Any, BatchCompletionsModelConfig], RequestHandler]


def _v1(llm: Any, model_config: BatchCompletionsModelConfig) -> RequestHandler:
    from batch_pipeline.worker.v1_requests import V1Requests

    return V1Requests()


def _completion(llm: Any, model_config: BatchCompletionsModelConfig) -> RequestHandler:
    from batch_pipeline.worker.openai_requests import CompletionRequests

    return CompletionRequests(llm, model_config)


def _chat(llm: Any, model_config: BatchCompletionsModelConfig) -> RequestHandler:
    from batch_pipeline.worker.openai_requests import ChatRequests

    return ChatRequests(llm, model_config)


def _embedding(llm: Any, model_config: BatchCompletionsModelConfig) -> RequestHandler:
    from batch_pipeline.worker.embedding_requests import EmbeddingRequests

    return EmbeddingRequests(llm, model_config)


def _responses(llm: Any, model_config: BatchCompletionsModelConfig) -> RequestHandler:
    from batch_pipeline.worker.responses_requests import ResponsesRequests

    return ResponsesRequests(llm, model_config)


HANDLERS: dict[str, HandlerFactory] = {
    V1.name: _v1,
    COMPLETION.name: _completion,
    CHAT.name: _chat,
    EMBEDDING.name: _embedding,
    RESPONSES.name: _responses,
}


class WrongRunner:
    """The handler of a kind the engine's model cannot run (text generation asked of an embedding model,
    embeddings of a generating one): each of its items is refused alone, naming the model. An OpenAI batch
    is refused before it runs (openai_batch/jobs.py); v2 content and input files meet this here."""

    _DOES = {"pooling": "computes embeddings", "generate": "generates text"}

    def __init__(self, kind: RequestKind, model_name: str, runner: str) -> None:
        self.why = (
            f"{model_name!r} {self._DOES.get(runner, runner)}; {kind.described} requests need a model that "
            f"{self._DOES.get(kind.runner, kind.runner)}"
        )

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        raise RequestRefused("model_not_supported", "model", self.why)

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any] | None:
        raise AssertionError("no item of this kind reaches the engine")


def kind_handlers(llm: Any, model_config: BatchCompletionsModelConfig) -> dict[str, RequestHandler]:
    """A handler for every kind of the registry, by kind name: the kind's own where the engine runs its
    model as the kind needs (`RequestKind.runner`), else one refusing its items."""
    runner = getattr(llm.llm_engine.model_config, "runner_type", "generate")
    model_name = model_config.served_model_name or model_config.model
    handlers: dict[str, RequestHandler] = {}
    for kind in KINDS:
        runs = kind.runner == runner
        handlers[kind.name] = HANDLERS[kind.name](llm, model_config) if runs else WrongRunner(kind, model_name, runner)
    return handlers
