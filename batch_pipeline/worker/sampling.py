"""Requests of the batch as vLLM sampling parameters, and vLLM results as the contract's outputs."""

from __future__ import annotations

from typing import Any

from batch_pipeline.contract import CompletionOutput, CreateBatchCompletionsV1RequestContent, TokenOutput


def v1_sampling_params(
    content: CreateBatchCompletionsV1RequestContent, max_tokens: int | None = None, extra_stop: tuple[str, ...] = ()
):
    """The mapping of Scale's v1 content to vLLM, as its reference batch runner does it; a tool loop's
    round passes its remaining budget and the tool's own stop string."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY,
        max_tokens=max_tokens or content.max_new_tokens,
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
