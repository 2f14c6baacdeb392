"""OpenAI embedding requests (`input`: a string, strings, token ids, or arrays of token ids), the lines of
`/v1/embeddings` batches. The worker runs them on vLLM's pooling runner with `worker/embedding_requests.py`;
the output is OpenAI's embedding response (`{"object": "list", "data": [...], "usage": ...}`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds.base import RequestKind, WorkRequest, estimated_tokens

# OpenAI's bound of one request's inputs; a line past it is refused at validation, naming `input`.
MAX_INPUTS = 2048
# The most token ids an input may hold: OpenAI's bound (8192 tokens an input). A model whose context is
# shorter refuses the longer ones per line, as the engine's prompt_too_long.
MAX_INPUT_TOKENS = 8192
# OpenAI's bound of the tokens one request holds, all its inputs together (2048 arrays of 8192 ids would be
# 16.7 million).
MAX_REQUEST_TOKENS = 300_000
# An output's bytes, as json.dumps writes them: a float32 widened to a Python float prints 17-19 significant
# digits (`-0.034259151667356491`, or `1.2345678901234567e-05`), with its ", " ~22 bytes (measured on
# normalized vectors of 384 to 1024 dimensions: 21.9 to 22.2).
FLOAT_JSON_BYTES = 22
# Around each vector (`{"object": "embedding", "index": N, "embedding": ...}`), and around a request's
# vectors (its `id`, `object`, `model`, `usage`, and the OpenAI output line's `custom_id` and `response`).
VECTOR_ENTRY_BYTES = 56
OUTPUT_ENTRY_BYTES = 512
# A token id is a vocabulary index: never negative. Ids past the model's vocabulary are refused per line by
# the worker, which knows the vocabulary.
# Strict: OpenAI refuses `["5", 6]`, `[true]` or `[1.0]` as input, naming it; coerced, they would embed
# other tokens than the caller wrote.
TokenId = Annotated[int, Field(ge=0, strict=True)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_INPUT_TOKENS)]
Text = Annotated[str, Field(min_length=1, strict=True)]


class EmbeddingRequest(WireModel):
    """The body of OpenAI's `POST /v1/embeddings`."""

    text_fields = frozenset({"input"})

    model: str | None = Field(None, description="The embedding model; a batch's lines all name the same one")
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    ) = Field(
        description=f"What to embed: a string, an array of strings, an array of token ids, or an array of "
        f"token-id arrays; at most {MAX_INPUTS} inputs, none empty, and {MAX_REQUEST_TOKENS} token ids in all"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`float`: arrays of numbers; `base64`: each vector's float32 little-endian bytes"
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        description="Fewer dimensions, for a model trained for them (Matryoshka); a per-line error elsewhere",
    )
    user: str | None = Field(None, max_length=256, description="The end user, as OpenAI takes it; not used")

    @field_validator("input")
    @classmethod
    def _at_most_the_request_tokens(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], list):
            if (ids := sum(len(one) for one in value)) > MAX_REQUEST_TOKENS:
                raise ValueError(
                    f"the inputs hold {ids} token ids; a request holds at most {MAX_REQUEST_TOKENS}, all its "
                    "inputs together (OpenAI's bound)"
                )
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a string, or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]  # one array of token ids
        return list(value)  # type: ignore[arg-type]


class EmbeddingKind(RequestKind):
    name = "embeddings"
    wire_model = EmbeddingRequest
    prompt_field = "input"
    described = "`input` (embeddings)"
    openai_url = "/v1/embeddings"
    output_limit_fields = ()
    runner = "pooling"
    # Its token ids and their arrays, and room for the other fields.
    max_values = MAX_REQUEST_TOKENS + MAX_INPUTS + 64

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        yield WorkRequest(
            record.model_dump(exclude_none=True, by_alias=True),
            [estimated_tokens(one) if isinstance(one, str) else len(one) for one in record.inputs()],
        )

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        return 0  # a vector, no tokens

    def shared_context(self, request: dict[str, Any]) -> str:
        return ""  # no prefix cache for an encoder: nothing to put side by side

    def deterministic(self, request: dict[str, Any]) -> bool:
        return True  # the same input embeds to the same vector: repeated lines are computed once

    def output_bytes(self, request: dict[str, Any], model_dimensions: int | None) -> int | None:
        """A vector per input, as the worker writes it: JSON numbers, or base64 of its float32 bytes. Its size
        is the request's `dimensions` where it asks for fewer than the model's (more: an error entry), else
        the model's."""
        asked = request.get("dimensions")
        dimensions = min(asked, model_dimensions) if asked and model_dimensions else asked or model_dimensions
        if not dimensions:
            return None
        if request.get("encoding_format") == "base64":
            vector = 4 * -(-4 * dimensions // 3) + 2  # base64 of 4 bytes a dimension, quoted
        else:
            vector = FLOAT_JSON_BYTES * dimensions
        return OUTPUT_ENTRY_BYTES + input_count(request.get("input")) * (VECTOR_ENTRY_BYTES + vector)


def input_count(value: Any) -> int:
    """How many inputs an `input` holds: a string or one array of token ids is one."""
    if isinstance(value, list):
        return 1 if value and isinstance(value[0], int) else len(value)
    return 1


EMBEDDING = EmbeddingKind()
