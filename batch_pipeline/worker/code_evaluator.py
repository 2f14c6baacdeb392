"""The code_evaluator tool loop over v1 prompts (`tool_config.name == "code_evaluator"`).

A generation that closes a Python block and writes `>>>` on the next line stops there; the last
```` ```python ```` block (of the prompt and the generation so far) runs in the sandbox; what it printed
(or its error) is appended after `>>>` and the prompt continues from the extended text, for at most
`max_iterations` executions and within the prompt's `max_new_tokens` (the tool's text counts against it).
Prompts do not wait for each other: while one prompt's code runs, the others keep generating in the same
engine, and executions run side by side up to the sandbox's slots. A prompt that itself ends with a block
and `>>>` (a transcript handed back) has that block run before anything is generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from batch_pipeline.contract import (
    CompletionOutput,
    CreateBatchCompletionsV1RequestContent,
    TokenOutput,
    ToolConfig,
)
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.protocol import ShardStats
from batch_pipeline.worker.handlers import is_request_error
from batch_pipeline.worker.sandbox import Execution, Sandbox
from batch_pipeline.worker.v1_requests import v1_output, v1_sampling_params

# The closing fence of a python block, then `>>>` on its own line: the model asks for the block to run.
TOOL_CALL = "```\n>>>\n"
CODE_FENCE = "```python"
# What a shard's stats say of its tool_config: the loop serves v1 content (prompts, as Scale's batch server
# does); a list of requests runs as it would without tool_config.
TOOL_APPLIED = "applied"
TOOL_NOT_APPLIED = (
    "not applied: the code_evaluator loop serves v1 content (prompts); these chat/completion "
    "requests ran without it (chat requests can declare functions in `tools`)"
)


@dataclass
class ToolLoop:
    """One prompt's transcript so far: generated text and tool output, in order."""

    item: WorkItem
    content: CreateBatchCompletionsV1RequestContent
    text: str = ""
    prompt_tokens: int | None = None
    generated_tokens: int = 0
    tool_tokens: int = 0
    executions: int = 0
    tokens: list[TokenOutput] = field(default_factory=list)
    called_tool: bool = False

    @property
    def remaining_tokens(self) -> int:
        return self.content.max_new_tokens - self.generated_tokens - self.tool_tokens

    @property
    def with_logprobs(self) -> bool:
        return bool(self.content.return_token_log_probs)

    def code(self) -> str | None:
        """The last python block before the tool call, or None when there is none. The block may open
        in the prompt (a prompt ending in ```` ```python ```` and code leaves the model to close it)."""
        transcript = self.item.request["prompt"] + self.text
        end = len(transcript) - len(TOOL_CALL)
        start = transcript.rfind(CODE_FENCE, 0, end)
        if start < 0:
            return None
        return transcript[start + len(CODE_FENCE) : end].removeprefix("\n")


def last_round(result: Any) -> tuple[str, bool]:
    """A round's text, and whether it ended by asking for the tool."""
    completion = result.outputs[0]
    if completion.stop_reason == TOOL_CALL:
        return completion.text + TOOL_CALL, True
    return completion.text, False


class CodeEvaluatorRequests:
    """v1 requests run through the tool loop: a multi-round handler (see handlers.MultiRoundHandler) whose
    prompts wait outside the engine while their code runs."""

    def __init__(self, v1: Any, tool_config: ToolConfig, tokenizer: Any, sandbox: Sandbox) -> None:
        self.v1 = v1
        self.max_iterations = tool_config.max_iterations if tool_config.max_iterations is not None else 10
        self.timeout_s = tool_config.execution_timeout_seconds or 60
        self.retry_on_error = tool_config.should_retry_on_error is not False
        self.tokenizer = tokenizer
        self.sandbox = sandbox
        self._pool = ThreadPoolExecutor(sandbox.slots, thread_name_prefix="code-evaluator")
        self._loops: dict[int, ToolLoop] = {}
        self._running: dict[Future[Execution], ToolLoop] = {}
        self.executions = self.failed_executions = self.timed_out_executions = 0

    @property
    def waiting(self) -> int:
        """Prompts whose code is running (not in the engine, not finished)."""
        return len(self._running)

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        """The item's first engine request; none when the prompt itself ends asking for its block to run
        (a transcript handed back mid-loop): that code runs first and the prompt comes back through `resume`."""
        loop = ToolLoop(item, content=self.v1.content(item))
        prompt = item.request["prompt"]
        if prompt.endswith(TOOL_CALL) and self.max_iterations > 0:
            loop.prompt_tokens = len(self.tokenizer.encode(prompt, add_special_tokens=False))
            self._loops[item.index] = loop
            self._start_execution(loop)
            return []
        request_id = self._add_round(engine, loop)  # may refuse the prompt (too long): then nothing to keep
        self._loops[item.index] = loop
        return [request_id]

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any] | None:
        """The item's output once its loop ends; None while its code runs."""
        loop = self._loops[item.index]
        result = results[0]
        round_output = v1_output(result, loop.with_logprobs)
        text, loop.called_tool = last_round(result)
        loop.text += text
        loop.generated_tokens += round_output.num_completion_tokens
        loop.tokens.extend(round_output.tokens or [])
        if loop.prompt_tokens is None:
            loop.prompt_tokens = round_output.num_prompt_tokens
        if loop.called_tool and loop.executions < self.max_iterations and loop.remaining_tokens > 0:
            self._start_execution(loop)
            return None
        return self._finish(loop)

    def resume(self, engine: Any, wait_s: float) -> Iterator[tuple[WorkItem, list[str] | dict[str, Any]]]:
        """Prompts whose code has run: each with its next round's engine ids, or its output when the loop
        ends there. Waits up to `wait_s` for one when none has finished yet."""
        finished = [future for future in self._running if future.done()]
        if not finished and wait_s > 0 and self._running:
            finished = list(wait(self._running, timeout=wait_s, return_when=FIRST_COMPLETED).done)
        for future in finished:
            loop = self._running.pop(future)
            execution = future.result()
            self.executions += 1
            self.failed_executions += not execution.ok
            self.timed_out_executions += execution.timed_out
            feedback = execution.feedback()
            loop.text += feedback
            loop.tool_tokens += len(self.tokenizer.encode(feedback, add_special_tokens=False))
            if (not execution.ok and not self.retry_on_error) or loop.remaining_tokens <= 0:
                yield loop.item, self._finish(loop)
                continue
            try:
                request_id = self._add_round(engine, loop)
            except Exception as exc:
                if not is_request_error(exc):
                    raise  # the worker's failure: it fails the shard, rather than cutting outputs short
                # The engine refused the longer prompt (past the context): the text ends here, kept.
                yield loop.item, self._finish(loop)
                continue
            yield loop.item, [request_id]

    def close(self, stats: ShardStats) -> None:
        # Code still running is stopped, not waited for: the shard stops at once (at its deadline, say),
        # and no execution outlives it.
        self.sandbox.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        stats.tool_executions = self.executions
        stats.tool_failed_executions = self.failed_executions
        stats.tool_timed_out_executions = self.timed_out_executions

    def _start_execution(self, loop: ToolLoop) -> None:
        loop.executions += 1
        self._running[self._pool.submit(self._execute, loop.code())] = loop

    def _execute(self, code: str | None) -> Execution:
        if code is None:
            return Execution(output="", error=f"no {CODE_FENCE} block before >>>")
        return self.sandbox.run(code, self.timeout_s)

    def _add_round(self, engine: Any, loop: ToolLoop) -> str:
        params = v1_sampling_params(loop.content, max_tokens=loop.remaining_tokens, extra_stop=(TOOL_CALL,))
        request_id = f"{loop.item.index}" if loop.prompt_tokens is None else f"{loop.item.index}.{loop.executions}"
        engine.add_request(request_id, loop.item.request["prompt"] + loop.text, params)
        return request_id

    def _finish(self, loop: ToolLoop) -> dict[str, Any]:
        del self._loops[loop.item.index]
        return CompletionOutput(
            text=loop.text,
            num_prompt_tokens=loop.prompt_tokens or 0,
            num_completion_tokens=loop.generated_tokens,
            tokens=loop.tokens if loop.with_logprobs else None,
        ).model_dump()
