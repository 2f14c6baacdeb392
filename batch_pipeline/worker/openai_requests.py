"""v2 content: OpenAI-style completion and chat requests, each with its own sampling parameters, served
by the shard's one engine; outputs are OpenAI completion / chat completion objects.

A field that cannot work for a request is refused for that request only (an error entry naming the
field); the rest of the batch runs.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from batch_pipeline.contract import (
    BatchCompletionsModelConfig,
    FilteredChatCompletionV2Request,
    FilteredCompletionV2Request,
)
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.worker.handlers import RequestRefused
from batch_pipeline.worker.tool_calls import ToolCalling, template_messages
from batch_pipeline.worker.vllm_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    VLLMValidationError,
    openai_sampling_defaults,
)

# Fields the OpenAI shapes carry that a batch engine cannot honour for any model here.
_COMPLETION_REFUSED = {
    "suffix": "insertion with a suffix is not supported",
    "stream": "batch jobs do not stream; leave stream unset or false",
    "stream_options": "batch jobs do not stream",
    "use_beam_search": "beam search is not supported by this worker",
    "early_stopping": "a beam search parameter; beam search is not supported by this worker",
    "guided_decoding_backend": "the engine's structured-output backend is used for every request",
    # vLLM takes the field but no backend of it reads the pattern; honouring it silently would be a lie.
    "guided_whitespace_pattern": "this vLLM's structured-output backends take no per-request whitespace pattern",
}
_CHAT_REFUSED = {
    **_COMPLETION_REFUSED,
    "audio": "audio output is not supported",
    "web_search_options": "web search is not available to a batch job",
    "prediction": "predicted outputs are not supported",
    "functions": "deprecated functions are not supported; use tools",
    "function_call": "deprecated function_call is not supported; use tool_choice",
}


class ServerDefaults:
    """Sampling values a request leaves unset, as `vllm serve` fills them (and Scale's batch server, which
    calls vLLM's serving classes): the model's generation config (`generation_config.json`, through vLLM's
    own reading of it, the one its OpenAI server uses), else vLLM's OpenAI defaults for the request type.
    One prompt then gets one answer here and there."""

    def __init__(
        self, engine_model_config: Any, request_type: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> None:
        self.model = engine_model_config.get_diff_sampling_param()
        self.fallbacks = openai_sampling_defaults(request_type)

    def sampling(self, request: Any) -> dict[str, Any]:
        return {
            name: value if (value := getattr(request, name)) is not None else self.model.get(name, fallback)
            for name, fallback in self.fallbacks.items()
        }

    def stop_token_ids(self, request: Any) -> list[int] | None:
        """The request's, and the model's where it names some (as vLLM's server merges them)."""
        merged = [*(request.stop_token_ids or []), *self.model.get("stop_token_ids", [])]
        return list(dict.fromkeys(merged)) or None

    @property
    def max_tokens(self) -> int | None:
        """The model's `max_new_tokens`; None leaves the engine to fill the context."""
        return self.model.get("max_tokens")


def _refuse_unsupported(request: Any, refused: dict[str, str]) -> None:
    for field, why in refused.items():
        value = getattr(request, field, None)
        if value not in (None, False):
            raise RequestRefused("unsupported_field", field, why)
    if request.length_penalty not in (None, 1.0):
        raise RequestRefused(
            "unsupported_field", "length_penalty", "a beam search parameter; beam search is not supported"
        )
    n, best_of = request.n or 1, request.best_of
    # best_of <= n asks for no candidate beyond the n returned (Scale's SDK always sends best_of: 1).
    if best_of is not None and best_of > n:
        raise RequestRefused(
            "unsupported_field",
            "best_of",
            f"this engine returns every candidate it samples; use n (best_of={best_of} > n={n})",
        )


def _structured_outputs(request: Any) -> StructuredOutputsParams | None:
    asked: list[tuple[str, str, Any]] = []  # (request field, vLLM's name, value)
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_schema":
        asked.append(("response_format", "json", response_format.json_schema.schema_ or {}))
    elif response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", "json_object", True))
    for source, target in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, source)
        if value is not None:
            asked.append((source, target, value))
    if not asked:
        return None
    if len(asked) > 1:
        (first, _, _), (second, _, _) = asked[:2]
        raise RequestRefused("invalid_request", second, f"only one structured output per request; {first} is set too")
    [(_, target, value)] = asked
    return StructuredOutputsParams(**{target: value})


def _sampling_params(
    request: Any,
    defaults: ServerDefaults,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    tool_outputs: StructuredOutputsParams | None = None,
):
    try:
        logit_bias = {int(token): bias for token, bias in (request.logit_bias or {}).items()}
    except ValueError:
        raise RequestRefused("invalid_request", "logit_bias", "keys must be token ids") from None
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    structured_outputs = _structured_outputs(request)
    if tool_outputs is not None:
        if structured_outputs is not None:
            raise RequestRefused(
                "invalid_request", "response_format", "cannot be combined with tool_choice 'required' or a named tool"
            )
        structured_outputs = tool_outputs
    try:
        return SamplingParams(
            n=request.n or 1,
            **defaults.sampling(request),
            seed=request.seed,
            stop=stop,
            stop_token_ids=defaults.stop_token_ids(request),
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
            ignore_eos=bool(request.ignore_eos),
            max_tokens=max_tokens,
            min_tokens=request.min_tokens or 0,
            logit_bias=logit_bias or None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=True if request.skip_special_tokens is None else request.skip_special_tokens,
            spaces_between_special_tokens=(
                True if request.spaces_between_special_tokens is None else request.spaces_between_special_tokens
            ),
            structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, VLLMValidationError) as exc:  # vLLM's own checks of the values
        param = getattr(exc, "parameter", None)  # vLLM names the field for most
        raise RequestRefused("invalid_request", param, exc.args[0] if param and exc.args else str(exc)) from None


def _add_all(engine: Any, item: WorkItem, prompts: list[Any], params: SamplingParams, tokenization: dict) -> list[str]:
    """One engine request per prompt; all or none."""
    added: list[str] = []
    try:
        for k, prompt in enumerate(prompts):
            engine_id = f"{item.index}-{k}"
            engine.add_request(engine_id, prompt, params, tokenization_kwargs=tokenization)
            added.append(engine_id)
    except Exception:
        if added:
            engine.abort_request(added)
        raise
    return added


def _usage(results: list[Any]) -> dict[str, int]:
    prompt_tokens = sum(len(result.prompt_token_ids or []) for result in results)
    completion_tokens = sum(len(choice.token_ids) for result in results for choice in result.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _OpenAIRequests:
    # vLLM's request type of the same shape, whose defaults this one takes
    request_type: type[ChatCompletionRequest] | type[CompletionRequest]

    def __init__(self, llm: Any, model_config: BatchCompletionsModelConfig) -> None:
        self.tokenizer = llm.get_tokenizer()
        self.model_config = model_config
        self.model_name = model_config.served_model_name or model_config.model
        self.defaults = ServerDefaults(llm.llm_engine.model_config, self.request_type)
        # Ids unique across batches, as OpenAI's are; the index stays last, as a copy's id is made from its
        # source's (worker/checkpoint.py).
        self.id_token = secrets.token_hex(6)

    def _decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _response(self, id_prefix: str, kind: str, item: WorkItem, choices: list, results: list[Any]) -> dict:
        return {
            "id": f"{id_prefix}-{self.id_token}-{item.index}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(results),
        }


class CompletionRequests(_OpenAIRequests):
    request_type = CompletionRequest

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        request = FilteredCompletionV2Request.model_validate(item.request)
        _refuse_unsupported(request, _COMPLETION_REFUSED)
        echo_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        # vLLM's completion request defaults max_tokens to 16, before the model's max_new_tokens could apply
        # (and Scale's server drops null fields, so an unset max_tokens is always 16 there).
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        params = _sampling_params(request, self.defaults, max_tokens, request.logprobs, echo_logprobs)
        tokenization = {
            "add_special_tokens": True if request.add_special_tokens is None else request.add_special_tokens
        }
        return _add_all(engine, item, _prompts(request.prompt), params, tokenization)

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any]:
        request = FilteredCompletionV2Request.model_validate(item.request)
        choices: list[dict[str, Any]] = []
        for result in results:
            for choice in result.outputs:
                text = (result.prompt or "") + choice.text if request.echo else choice.text
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": self._logprobs(result, choice, request) if request.logprobs is not None else None,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                )
        return self._response("cmpl", "text_completion", item, choices, results)

    def _logprobs(self, result: Any, choice: Any, request: FilteredCompletionV2Request) -> dict[str, Any]:
        """OpenAI's legacy shape: parallel lists of tokens, their log-probabilities, the top alternatives."""
        positions: list[tuple[int, Any]] = []
        if request.echo:
            prompt_logprobs = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
            positions += list(zip(result.prompt_token_ids, prompt_logprobs))
        positions += list(zip(choice.token_ids, choice.logprobs or []))
        assert request.logprobs is not None  # asked for only where the request wants log-probabilities
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        for token_id, alternatives in positions:
            token = self._decoded(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if alternatives is None:  # the first prompt token has no log-probability
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(alternatives[token_id].logprob)
            ranked = sorted(alternatives.items(), key=lambda pair: pair[1].logprob, reverse=True)
            top_logprobs.append({self._decoded(t): lp.logprob for t, lp in ranked[: max(request.logprobs, 1)]})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class ChatRequests(_OpenAIRequests):
    request_type = ChatCompletionRequest

    def __init__(self, llm: Any, model_config: BatchCompletionsModelConfig) -> None:
        super().__init__(llm, model_config)
        self.tool_calling = ToolCalling(self.tokenizer, model_config, self.model_name)

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        request = FilteredChatCompletionV2Request.model_validate(item.request)
        _refuse_unsupported(request, _CHAT_REFUSED)
        if request.modalities and set(request.modalities) != {"text"}:
            raise RequestRefused("unsupported_field", "modalities", "only text output is supported")
        tool_plan = self.tool_calling.plan(request)
        prompt = self.render(request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_tokens is None:  # the model's max_new_tokens, else the rest of the context (the engine's default)
            max_tokens = self.defaults.max_tokens
        params = _sampling_params(
            request,
            self.defaults,
            max_tokens,
            logprobs,
            tool_outputs=tool_plan.structured_outputs if tool_plan else None,
        )
        # The chat template writes the special tokens itself.
        tokenization = {"add_special_tokens": bool(request.add_special_tokens)}
        return _add_all(engine, item, [prompt], params, tokenization)

    def render(self, request: FilteredChatCompletionV2Request) -> str:
        """The conversation as the model's prompt, through its chat template (or the one asked for)."""
        messages = []
        for position, message in enumerate(request.messages):
            rendered = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                texts = []
                for part_position, part in enumerate(message.content):
                    kind = part.get("type") if isinstance(part, dict) else part.type
                    if kind != "text":
                        raise RequestRefused(
                            "unsupported_field",
                            f"messages.{position}.content.{part_position}",
                            f"only text parts are supported, got {kind!r}",
                        )
                    texts.append(part["text"] if isinstance(part, dict) else part.text)
                rendered["content"] = "\n".join(texts)
            messages.append(rendered)
        add_generation_prompt = True if request.add_generation_prompt is None else request.add_generation_prompt
        if request.continue_final_message and request.add_generation_prompt:
            raise RequestRefused(
                "invalid_request", "continue_final_message", "cannot be used with add_generation_prompt"
            )
        if request.continue_final_message:
            add_generation_prompt = False
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(request.continue_final_message),
                chat_template=request.chat_template or self.model_config.chat_template,
                documents=request.documents,
                tools=[tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template that does not render is this request's problem only
            raise RequestRefused("invalid_request", "chat_template", str(exc) or type(exc).__name__) from None

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any]:
        request = FilteredChatCompletionV2Request.model_validate(item.request)
        role = self.model_config.response_role or "assistant"
        (result,) = results
        echoed = ""
        if request.echo and request.messages[-1].role == role and isinstance(request.messages[-1].content, str):
            echoed = request.messages[-1].content
        tool_plan = self.tool_calling.plan(request)
        choices = []
        for position, choice in enumerate(result.outputs):
            content, tool_calls, finish_reason = echoed + choice.text, [], choice.finish_reason
            if tool_plan is not None:
                parsed = self.tool_calling.parse(tool_plan, request, choice)
                content, tool_calls, finish_reason = parsed.content, parsed.tool_calls, parsed.finish_reason
            choices.append(
                {
                    "index": position,
                    # OpenAI leaves tool_calls out of a message that calls none.
                    "message": {"role": role, "content": content} | ({"tool_calls": tool_calls} if tool_calls else {}),
                    "logprobs": {"content": self._logprobs(choice, request.top_logprobs or 0)}
                    if request.logprobs
                    else None,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        return self._response("chatcmpl", "chat.completion", item, choices, results)

    def _logprobs(self, choice: Any, top: int) -> list[dict[str, Any]]:
        content = []
        for token_id, alternatives in zip(choice.token_ids, choice.logprobs or []):
            token = self._decoded(token_id)
            ranked = sorted(alternatives.items(), key=lambda pair: pair[1].logprob, reverse=True)[:top]
            content.append(
                {
                    "token": token,
                    "logprob": alternatives[token_id].logprob,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": (t := self._decoded(tid)), "logprob": lp.logprob, "bytes": list(t.encode("utf-8"))}
                        for tid, lp in ranked
                    ],
                }
            )
        return content
