"""What every request handler of the shard worker shares: the protocol the run loop drives, the error a
handler raises for a request it cannot serve, and the error entries the output holds in its place.

A handler (v1 prompts in `v1_requests`, completion and chat requests in `openai_requests`, the
code_evaluator loop in `code_evaluator`) turns a work item into engine requests and their results into the
item's output; the loop in `runner` knows nothing of any endpoint. A multi-round handler (the tool loop)
also holds items between rounds, doing work outside the engine, and hands them back through `resume`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from batch_pipeline.contract import ErrorDetail, ErrorOutput
from batch_pipeline.contract.kinds import find_kind
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.protocol import ShardStats


class RequestHandler(Protocol):
    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        """Add the item's engine requests (`engine.add_request`); their ids, in the order `output` takes
        their results. Raises RequestRefused for an item that cannot be served as asked."""
        ...

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any] | None:
        """The item's output (its wire shape as a dict) from its engine requests' results; None where the
        item is not finished with them (a tool loop's code runs: the output comes later)."""
        ...


@runtime_checkable
class MultiRoundHandler(RequestHandler, Protocol):
    """A handler whose items may leave the engine between rounds (`submit` may return no ids, `output` may
    return None): the loop asks it for them back, and ends only when it holds none."""

    @property
    def waiting(self) -> int:
        """Items it holds outside the engine (neither in it nor finished)."""
        ...

    def resume(self, engine: Any, wait_s: float) -> Iterator[tuple[WorkItem, list[str] | dict[str, Any]]]:
        """Items ready to go on: each with its next round's engine ids, or its output when it ends there.
        Waits up to `wait_s` for one when none is ready."""
        ...

    def close(self, stats: ShardStats) -> None:
        """Stop what it runs outside the engine; add its figures to the shard's stats."""
        ...


class RequestRefused(ValueError):
    """A request of the batch that cannot be served as asked: `param` is the request field to blame (None
    where none is), and the message starts with it."""

    def __init__(self, code: str, param: str | None, why: str) -> None:
        super().__init__(f"{param}: {why}" if param else why)
        self.code = code
        self.param = param


def error_output(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An error entry in OpenAI's shape; its `type` follows from the code (see ErrorDetail)."""
    return ErrorOutput(error=ErrorDetail(code=code, message=message, param=param)).model_dump()


def refused_output(exc: RequestRefused) -> dict[str, Any]:
    return error_output(exc.code, str(exc), exc.param)


def is_request_error(exc: Exception) -> bool:
    """Whether the engine refused a request as invalid (past the context, a value out of range), rather
    than failed."""
    from batch_pipeline.worker.vllm_api import VLLMClientError

    return isinstance(exc, (VLLMClientError, ValueError, TypeError))


def engine_error_output(exc: Exception, kind: str) -> dict[str, Any]:
    """The error entry of a request the engine refused or failed on: a request vLLM judges invalid (past
    the context, a value out of range) is the request's error, naming the field where vLLM names one;
    anything else is the engine's."""
    if not is_request_error(exc):
        return error_output("engine_error", f"{type(exc).__name__}: {exc}")
    message = str(exc)
    if "maximum context length" in message or "maximum model length" in message:
        known = find_kind(kind)  # the field holding the prompt is what a prompt past the context blames
        return error_output("prompt_too_long", message, known.prompt_field if known is not None else None)
    return error_output("invalid_request", message, getattr(exc, "parameter", None))
