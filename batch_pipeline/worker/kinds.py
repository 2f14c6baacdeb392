"""The worker's side of the request kinds (the registry is `contract/kinds`): for each kind, the handler that
runs its work items on the engine, built from the engine's `LLM` (its tokenizer, its model config) and the
job's model config. The run loop and the dry run ask here; neither names a kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.kinds import CHAT, COMPLETION, EMBEDDING, KINDS, V1
from batch_pipeline.worker.handlers import RequestHandler

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


HANDLERS: dict[str, HandlerFactory] = {
    V1.name: _v1,
    COMPLETION.name: _completion,
    CHAT.name: _chat,
    EMBEDDING.name: _embedding,
}


def kind_handlers(llm: Any, model_config: BatchCompletionsModelConfig) -> dict[str, RequestHandler]:
    """A handler for every kind of the registry, by kind name."""
    return {kind.name: HANDLERS[kind.name](llm, model_config) for kind in KINDS}
