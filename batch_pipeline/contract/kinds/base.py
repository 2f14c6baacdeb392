"""What a request kind says about itself on the wire (see the registry in `contract/kinds/__init__.py`): the
shape every kind module fills in, and the token estimate they share."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from batch_pipeline.contract.base import WireModel

# Estimating a request's cost without its tokenizer: characters per token of English text.
CHARS_PER_TOKEN = 4


def estimated_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


@dataclass(frozen=True)
class WorkRequest:
    """One work item's request made from a record, and what the plan weighs it by, without a tokenizer."""

    request: dict[str, Any]  # as the shard's input.jsonl holds it
    prompt_tokens: list[int]  # each of its prompts' tokens, estimated
    candidates: int = 1  # outputs generated per prompt (`n`)


class RequestKind:
    """One kind of request: everything the layers that are not the worker's engine need to know of it.
    The worker's side (the handler that runs it on the engine) is in `worker/kinds.py`."""

    name: ClassVar[str]  # as work items carry it (`WorkItem.kind`)
    # A record of this kind, as an input file's line or inline content's element holds it.
    wire_model: ClassVar[type[WireModel]]
    # The field that holds its prompts: what tells a raw record of this kind, and what a prompt past the
    # model's context is blamed on.
    prompt_field: ClassVar[str]
    described: ClassVar[str]  # the kind as the error of an unrecognized record names it
    # The OpenAI Batch API endpoint whose lines are of this kind; None: not a batch endpoint.
    openai_url: ClassVar[str | None] = None
    # The kind's form as v2 inline `content` (the wire model, or a list of it); None: never inline.
    inline_content: ClassVar[Any] = None
    # Whether a job's `tool_config` applies to it (the code_evaluator loop); elsewhere it is accepted and
    # not applied.
    takes_tool_config: ClassVar[bool] = False
    # The request fields that cap its output, the one a limit is written to last; none for a kind that
    # generates no tokens.
    output_limit_fields: ClassVar[tuple[str, ...]]
    # The most JSON values (numbers, strings, arrays, objects) a request of this kind may hold on the wire: a
    # batch line past it is refused naming the field that holds the most, counted before it is parsed, since
    # a parse builds every value before any bound is checked (~250 bytes each: 2 MB of token-id arrays were
    # 210 MB in the API). Past any context a model here has.
    max_values: ClassVar[int] = 500_000
    # What vLLM must run the model as to serve it (its `runner`): text generation, or pooling (embeddings).
    # A batch of this kind on a model of the other is refused, naming the line.
    runner: ClassVar[str] = "generate"
    # The names of the prompt and generated tokens in its output's `usage` (an OpenAI object's; v1 outputs
    # have none and count `num_prompt_tokens`): the worker's and the merge's token counts read them.
    usage_names: ClassVar[tuple[str, str]] = ("prompt_tokens", "completion_tokens")

    def recognizes(self, record: dict[str, Any]) -> bool:
        """Whether a raw record (a JSON object) is of this kind: it holds the kind's prompt field."""
        return self.prompt_field in record

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        """The work items' requests of one parsed record (`wire_model`)."""
        raise NotImplementedError

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        """The most tokens one prompt of a work item's request may generate, all its candidates together; an
        estimate where the request sets no limit."""
        raise NotImplementedError

    def shared_context(self, request: dict[str, Any]) -> str:
        """What requests of a batch usually share (a system prompt, a few-shot template): the work order
        puts requests sharing it side by side, for vLLM's prefix cache."""
        raise NotImplementedError

    def output_bytes(self, request: dict[str, Any], model_dimensions: int | None) -> int | None:
        """The bytes a work item's output entry is estimated to take, for a kind whose output its tokens do not
        bound (one that generates none: an embedding's vectors), on a model whose vectors have
        `model_dimensions` (None: not known); None for a kind whose tokens bound its output (the team's
        max_tokens_per_day holds those), or where the size cannot be told."""
        return None

    def deterministic(self, request: dict[str, Any]) -> bool:
        """Whether the request's output is fixed by the request (greedy, or sampled with a seed): repeated
        requests are then answered by one computation."""
        return request.get("temperature") == 0 or request.get("seed") is not None

    @property
    def generates(self) -> bool:
        """Whether it generates tokens: a prompt must then leave room for one in the context."""
        return self.runner == "generate"

    def is_inline_list(self) -> bool:
        return getattr(self.inline_content, "__origin__", None) is list

    def __repr__(self) -> str:
        return f"<request kind {self.name}>"
