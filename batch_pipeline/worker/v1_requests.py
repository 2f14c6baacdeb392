"""v1 content: its prompts as vLLM requests with the content's shared sampling parameters (Scale's v1
mapping), and vLLM's results as `CompletionOutput`s."""

from __future__ import annotations

import json
from typing import Any

from batch_pipeline.contract import CompletionOutput, CreateBatchCompletionsV1RequestContent, TokenOutput
from batch_pipeline.shards.format import WorkItem


def v1_sampling_params(
    content: CreateBatchCompletionsV1RequestContent, max_tokens: int | None = None, extra_stop: tuple[str, ...] = ()
):
    """The mapping of Scale's v1 content to vLLM, as its reference batch runner does it; a tool loop's
    round passes its remaining budget and the tool's own stop string."""
    from batch_pipeline.worker.vllm_api import RequestOutputKind, SamplingParams

    return SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY,
        max_tokens=content.max_new_tokens if max_tokens is None else max_tokens,
        temperature=content.temperature,
        stop=[*(content.stop_sequences or []), *extra_stop] or None,
        # 0 = the sampled token's own log-probability, nothing more.
        logprobs=0 if content.return_token_log_probs else None,
        presence_penalty=content.presence_penalty or 0.0,
        frequency_penalty=content.frequency_penalty or 0.0,
        top_k=content.top_k if content.top_k is not None else -1,
        top_p=content.top_p if content.top_p is not None else 1.0,
        skip_special_tokens=True if content.skip_special_tokens is None else content.skip_special_tokens,
    )


def v1_output(result: Any, with_logprobs: bool) -> CompletionOutput:
    completion = result.outputs[0]
    tokens = None
    if with_logprobs:
        tokens = [
            TokenOutput(token=position[token_id].decoded_token or "", log_prob=position[token_id].logprob)
            for token_id, position in zip(completion.token_ids, completion.logprobs or [])
        ]
    return CompletionOutput(
        text=completion.text,
        num_prompt_tokens=len(result.prompt_token_ids or []),
        num_completion_tokens=len(completion.token_ids),
        tokens=tokens,
    )


class V1Requests:
    """v1 content: one prompt per item, sampling parameters shared by the prompts of one content."""

    def __init__(self) -> None:
        self._contents: dict[str, CreateBatchCompletionsV1RequestContent] = {}
        self._params: dict[str, Any] = {}

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        request_id = str(item.index)
        engine.add_request(request_id, item.request["prompt"], self._sampling(item))
        return [request_id]

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any]:
        return v1_output(results[0], bool(self.content(item).return_token_log_probs)).model_dump()

    def content(self, item: WorkItem) -> CreateBatchCompletionsV1RequestContent:
        """The item's content (its shared parameters, no prompts), parsed once per distinct content."""
        key = _shared_key(item)
        if key not in self._contents:
            shared = {name: value for name, value in item.request.items() if name != "prompt"}
            self._contents[key] = CreateBatchCompletionsV1RequestContent(prompts=[], **shared)
        return self._contents[key]

    def _sampling(self, item: WorkItem) -> Any:
        key = _shared_key(item)
        if key not in self._params:
            self._params[key] = v1_sampling_params(self.content(item))
        return self._params[key]


def _shared_key(item: WorkItem) -> str:
    return json.dumps({name: value for name, value in item.request.items() if name != "prompt"}, sort_keys=True)
