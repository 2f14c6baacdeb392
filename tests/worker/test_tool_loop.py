"""The mechanics of the shard worker's loop and of the code_evaluator tool loop, without a model, an
engine or Dagster.

The real `ShardRunner` runs real shards on disk (checkpoint, resume, finalize), the real
`CodeEvaluatorRequests` drives the tool loop with real `SamplingParams` (vLLM is imported, for ~10 s, not
run), and the real sandbox runs the code. What stands in for the model is a scripted engine: each
prompt's rounds are written out here, so every assertion is exact, whatever a model would write. The
end-to-end tests (test_code_evaluator_e2e.py) run the same loop with real vLLM.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.shards.format import ShardSpec, format_result
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.protocol import ShardTask
from batch_pipeline.shards.records import work_items
from batch_pipeline.worker import engine as engine_module
from batch_pipeline.worker import runner as runner_module
from batch_pipeline.worker.code_evaluator import TOOL_CALL
from batch_pipeline.worker.engine import Engine
from batch_pipeline.worker.runner import DeadlineExceeded, ShardRunner, ShardStats
from tests.conftest import sandbox_processes

# The sandbox runs code only in a root worker (see test_sandbox.py); elsewhere it refuses to start.
needs_sandbox = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs code only in a root worker")


def block(code: str) -> str:
    """A generation that writes a python block and asks for it to run."""
    return f"```python\n{code}\n{TOOL_CALL}"


# --- Test doubles -------------------------------------------------------------------------------------


def char_pieces(prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> list[str]:
    """Test double: the text the char tokenizer's stream writes for each token (see text_pieces)."""
    return [chr(token) for token in token_ids]


class CharTokenizer:  # test double: stands for the model's tokenizer; one token per character
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) for char in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


@dataclass
class Logprob:
    logprob: float
    decoded_token: str


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    stop_reason: str | None
    finish_reason: str
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool = True


@dataclass
class Request:
    """What the engine was asked: one round of one prompt."""

    request_id: str
    prompt: str
    max_tokens: int
    stop: list[str]
    output: RequestOutput
    scripted_prompt: str  # the prompt of the script it belongs to
    last: bool  # its script's last round


class EngineModelConfig:  # test double: the part of vLLM's ModelConfig the completion/chat handlers read
    def get_diff_sampling_param(self) -> dict[str, Any]:
        return {}


class ScriptedEngine:  # test double: stands for vLLM's LLMEngine, which cannot be scripted
    """Each prompt's rounds, as the model would write them: `replies[prompt]` is what it writes in each
    round, in order, whatever the round's request (the prompt plus the transcript so far: tests check it).
    Like vLLM, a round stops at the first stop string (cut from the text, its tokens counted, named as the
    `stop_reason`) or after `max_tokens` tokens; the end of a reply stands for an end-of-sequence token
    (not counted). Each `step` finishes the oldest request; a prompt longer than `max_model_len` tokens is
    refused as vLLM refuses it. A round the script does not have, or a request id used twice at once, is a fault:
    recorded in `faults` (run_shard fails on any) as well as raised, since the loop may catch it."""

    def __init__(self, replies: dict[str, list[str]], max_model_len: int = 100_000) -> None:
        self.replies = {prompt: list(rounds) for prompt, rounds in replies.items()}
        self.max_model_len = max_model_len
        self.model_config = EngineModelConfig()
        self.requests: list[Request] = []  # every request added, in order
        self.pending: dict[str, Request] = {}  # in the order added
        self.aborted: list[str] = []
        self.steps = 0
        self.begun: set[str] = set()  # prompts begun and not ended: in the engine, or with their code running
        self.most_begun = 0
        self.most_pending = 0  # requests in the engine at once
        self.finished_at: dict[str, float] = {}  # request id -> time.monotonic() when its step returned it
        self.faults: list[str] = []
        self.cache_salts: list[str | None] = []  # each request's, in the order added

    def add_request(self, request_id: str, prompt: Any, params: Any, tokenization_kwargs: Any = None) -> None:
        if isinstance(prompt, dict):  # a prompt with its team's cache_salt, as the shard runner adds it
            self.cache_salts.append(prompt.get("cache_salt"))
            prompt = prompt["prompt"]
        else:
            self.cache_salts.append(None)
        if request_id in self.pending:  # vLLM refuses an id in use; a finished one may come again
            self._fault(f"request id {request_id} used twice at once")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length of "
                f"{self.max_model_len}."
            )
        original = max((key for key in self.replies if prompt.startswith(key)), key=len, default=None)
        if original is None or not self.replies[original]:
            self._fault(f"a round that is not scripted: {prompt!r}")
        reply = self.replies[original].pop(0)
        stop = list(params.stop or [])
        text, token_ids, stop_reason = self._generate(reply, stop, params.max_tokens)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{token: Logprob(-1.0, chr(token))} for token in token_ids]
        finish_reason = "length" if stop_reason is None and len(token_ids) == params.max_tokens else "stop"
        completion = Completion(text, token_ids, logprobs, stop_reason, finish_reason)
        output = RequestOutput(request_id, [ord(char) for char in prompt], [completion])
        last = not self.replies[original]
        request = Request(request_id, prompt, params.max_tokens, stop, output, original, last)
        self.requests.append(request)
        self.pending[request_id] = request
        self.most_pending = max(self.most_pending, len(self.pending))
        self.begun.add(original)
        self.most_begun = max(self.most_begun, len(self.begun))

    @staticmethod
    def _generate(reply: str, stop: list[str], max_tokens: int) -> tuple[str, list[int], str | None]:
        generated = ""
        for char in reply:
            generated += char
            hit = next((string for string in stop if string in generated), None)
            if hit is not None:
                return generated[: generated.index(hit)], [ord(char) for char in generated], hit
            if len(generated) == max_tokens:
                break
        return generated, [ord(char) for char in generated], None

    def _fault(self, fault: str) -> None:
        self.faults.append(fault)
        raise AssertionError(fault)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        finished = [self.pending.pop(request_id) for request_id in list(self.pending)[:1]]
        for request in finished:
            self.finished_at[request.request_id] = time.monotonic()
            if request.last:
                self.begun.discard(request.scripted_prompt)
        return [request.output for request in finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    def rounds(self, prompt: str) -> list[Request]:
        """The requests of one prompt, in order."""
        return [request for request in self.requests if request.scripted_prompt == prompt]


class ScriptedLLM:  # test double: stands for vLLM's LLM, holding the scripted engine
    def __init__(self, engine: ScriptedEngine) -> None:
        self.llm_engine = engine

    def get_tokenizer(self) -> CharTokenizer:
        return CharTokenizer()


class Clock:  # test double: the runner's clock, moved on at will instead of waited for
    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        self.offset += seconds


# --- Shards ---------------------------------------------------------------------------------------------


def make_shard(tmp_path: Path, prompts: list[str], max_new_tokens: int = 200, **content: Any) -> ShardSpec:
    content = {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": 0.0, **content}
    return make_shard_of(tmp_path, [content])


def make_shard_of(tmp_path: Path, contents: list[dict[str, Any]]) -> ShardSpec:
    """One shard of v1 contents, each its own record."""
    (shard,) = write_shards(work_items(("content", content) for content in contents), 1, str(tmp_path / "job"))
    return shard


def run_shard(
    monkeypatch: pytest.MonkeyPatch,
    shard: ShardSpec,
    engine: ScriptedEngine | None,
    tool_config: dict[str, Any] | None = None,
    deadline: float | None = None,
    max_in_flight: int = 1024,
    share_generations: bool = True,
    pieces: Any = char_pieces,
    owner_team: str | None = None,
) -> ShardStats:
    """The real ShardRunner on the shard, its engine the scripted one (None: no engine may be built), the
    text its tokenizer's stream writes `pieces`."""

    def build_llm(model_config: Any) -> Engine:
        assert engine is not None, "an engine was built"
        return Engine(ScriptedLLM(engine), engine, unsupported=[], dtype="float32", dtype_reason="a scripted engine")

    monkeypatch.setattr(engine_module, "build_llm", build_llm)
    monkeypatch.setattr(runner_module, "text_pieces", lambda tokenizer: pieces)
    task = ShardTask(
        shard=shard,
        model_config={"model": "scripted"},
        tool_config=tool_config,
        deadline=deadline,
        share_generations=share_generations,
        owner_team=owner_team,
    )
    try:
        return ShardRunner(task, checkpoint_upload_s=60, max_in_flight=max_in_flight).run()
    finally:
        assert engine is None or not engine.faults, engine.faults


def code_evaluator(**settings: Any) -> dict[str, Any]:
    return {"name": "code_evaluator", "execution_timeout_seconds": 5, **settings}


def written(shard: ShardSpec) -> list[int]:
    """The indices of the checkpoint's lines, in the order they were written."""
    return [int(line.split("\t", 1)[0]) for line in Path(shard.results_path).read_text().splitlines()]


def outputs(shard: ShardSpec) -> list[dict[str, Any]]:
    """The shard's output, in index order (checked)."""
    lines = [line.split("\t", 1) for line in Path(shard.output_path).read_text().splitlines()]
    assert [int(index) for index, _ in lines] == list(range(shard.item_count))
    return [json.loads(payload) for _, payload in lines]


# --- Tests ----------------------------------------------------------------------------------------------


@needs_sandbox
def test_the_rounds_of_a_prompt_map_back_to_its_item_and_each_item_is_written_once(monkeypatch, tmp_path):
    """Five prompts of zero, one and two tool calls, at most two in flight (a prompt whose code runs
    counts): every round goes back to its own prompt, each output is written once, at its index."""
    prompts = [f"Q{n}: go\n" for n in range(5)]
    replies = {
        prompts[0]: ["A0"],
        prompts[1]: [block("print(1)"), "A1"],
        prompts[2]: [block("print(2)"), block("print(2 * 2)"), "A2"],
        prompts[3]: ["A3"],
        prompts[4]: [block("print(4)"), "A4"],
    }
    expected = [
        "A0",
        block("print(1)") + "1\nA1",
        block("print(2)") + "2\n" + block("print(2 * 2)") + "4\nA2",
        "A3",
        block("print(4)") + "4\nA4",
    ]
    shard = make_shard(tmp_path, prompts)
    engine = ScriptedEngine(replies)

    stats = run_shard(monkeypatch, shard, engine, code_evaluator(), max_in_flight=2)

    assert [output["text"] for output in outputs(shard)] == expected
    assert sorted(written(shard)) == [0, 1, 2, 3, 4]  # one line per item: no round wrote an output of its own
    assert engine.most_begun == 2  # never more prompts begun at once than max_in_flight
    # Each round is a request of its own, asked for the prompt and the transcript so far: round k (from 0)
    # after k tool calls and their outputs.
    for index, prompt in enumerate(prompts):
        rounds = engine.rounds(prompt)
        assert [request.request_id for request in rounds] == [str(index), f"{index}.1", f"{index}.2"][: len(rounds)]
        for k, request in enumerate(rounds):
            transcript = request.prompt.removeprefix(prompt)
            assert (prompt + expected[index]).startswith(request.prompt) and transcript.count(TOOL_CALL) == k
            assert k == 0 or transcript.endswith("\n") and not transcript.endswith(TOOL_CALL)
    assert (stats.generated, stats.tool_executions, stats.tool_failed_executions) == (5, 4, 0)


@needs_sandbox
def test_the_tool_output_follows_the_call_and_generation_resumes_from_the_extended_text(monkeypatch, tmp_path):
    prompt = "Q: what is 6 * 7?\n"
    shard = make_shard(tmp_path, [prompt], max_new_tokens=100)
    engine = ScriptedEngine({prompt: [block("print(6 * 7)"), "A: 42"]})

    stats = run_shard(monkeypatch, shard, engine, code_evaluator())

    (output,) = outputs(shard)
    assert output["text"] == block("print(6 * 7)") + "42\nA: 42"
    first, second = engine.rounds(prompt)
    assert TOOL_CALL in first.stop  # the loop's own stop string
    assert second.prompt == prompt + block("print(6 * 7)") + "42\n"
    # Generated tokens only: the round's, its stop string included; not the tool's "42\n".
    assert output["num_completion_tokens"] == len(block("print(6 * 7)")) + len("A: 42")
    assert output["num_prompt_tokens"] == len(prompt)
    assert output["tokens"] is None
    assert (stats.tool_executions, stats.tool_failed_executions, stats.tool_timed_out_executions) == (1, 0, 0)


@needs_sandbox
def test_the_budget_shrinks_by_each_rounds_tokens_and_the_tools_output(monkeypatch, tmp_path):
    """`max_new_tokens` bounds the whole transcript after the prompt: each round gets what is left after
    the earlier rounds' tokens and the tool's output; a round that reaches it is cut there; a tool output
    that uses it up ends the loop right after that output."""
    ask = block("print(6 * 7)")
    cut, flooded = "Q: cut\n", "Q: flood\n"
    budget = len(ask) + len("42\n") + 5  # five tokens left for the round after the tool
    shard = make_shard(tmp_path, [cut, flooded], max_new_tokens=budget)
    engine = ScriptedEngine({cut: [ask, "A: 42, since 6 * 7 = 42"], flooded: [block("print('x' * 100)")]})

    run_shard(monkeypatch, shard, engine, code_evaluator())

    cut_output, flooded_output = outputs(shard)
    first, second = engine.rounds(cut)
    assert (first.max_tokens, second.max_tokens) == (budget, 5)
    assert cut_output["text"] == ask + "42\nA: 42"
    assert cut_output["num_completion_tokens"] == len(ask) + 5
    # The tool printed more than the budget had left: no round after it.
    assert flooded_output["text"] == block("print('x' * 100)") + "x" * 100 + "\n"
    assert len(engine.rounds(flooded)) == 1
    assert flooded_output["num_completion_tokens"] == len(block("print('x' * 100)"))


@needs_sandbox
def test_max_iterations_bounds_the_executions_and_a_call_past_it_stays_in_the_text(monkeypatch, tmp_path):
    prompt = "Q: count\n"
    shard = make_shard(tmp_path, [prompt])
    # A third call is scripted, a fourth round is not: asking for one is a fault.
    engine = ScriptedEngine({prompt: [block("print(1)"), block("print(2)"), block("print(3)")]})

    stats = run_shard(monkeypatch, shard, engine, code_evaluator(max_iterations=2))

    (output,) = outputs(shard)
    assert output["text"] == block("print(1)") + "1\n" + block("print(2)") + "2\n" + block("print(3)")
    assert stats.tool_executions == 2 and len(engine.rounds(prompt)) == 3


@needs_sandbox
def test_an_error_is_fed_back_and_the_next_round_reads_it(monkeypatch, tmp_path):
    prompt = "Q: print the total\n"
    error = "NameError: name 'total' is not defined\n"
    shard = make_shard(tmp_path, [prompt])
    engine = ScriptedEngine({prompt: [block("print(total)"), block("total = 3\nprint(total)"), "A: 3"]})

    stats = run_shard(monkeypatch, shard, engine, code_evaluator())

    (output,) = outputs(shard)
    assert output["text"] == block("print(total)") + error + block("total = 3\nprint(total)") + "3\nA: 3"
    assert engine.rounds(prompt)[1].prompt == prompt + block("print(total)") + error
    assert (stats.tool_executions, stats.tool_failed_executions) == (2, 1)


@needs_sandbox
def test_without_retry_an_error_ends_the_text_right_after_it(monkeypatch, tmp_path):
    prompt = "Q: print the total\n"
    shard = make_shard(tmp_path, [prompt])
    engine = ScriptedEngine({prompt: [block("print(total)")]})  # a second round is not scripted

    stats = run_shard(monkeypatch, shard, engine, code_evaluator(should_retry_on_error=False))

    (output,) = outputs(shard)
    assert output["text"] == block("print(total)") + "NameError: name 'total' is not defined\n"
    assert output["num_completion_tokens"] == len(block("print(total)"))
    assert (stats.tool_executions, stats.tool_failed_executions) == (1, 1)


@needs_sandbox
def test_a_transcript_handed_back_runs_its_block_before_anything_is_generated(monkeypatch, tmp_path):
    handed_back = "Q: run it\n" + block("print(123 * 456)")
    opened = "Q: close it\n```python\nprint(2 + 2)\n"  # the model closes the block the prompt opened
    no_block = "Q: nothing to run\n"
    shard = make_shard(tmp_path, [handed_back, opened, no_block])
    engine = ScriptedEngine({handed_back: ["A: 56088"], opened: [TOOL_CALL, "A: 4"], no_block: [TOOL_CALL, "A: ?"]})

    stats = run_shard(monkeypatch, shard, engine, code_evaluator())

    handed_back_output, opened_output, no_block_output = outputs(shard)
    (request,) = engine.rounds(handed_back)
    assert request.prompt == handed_back + "56088\n" and request.request_id == "0.1"
    assert handed_back_output["text"] == "56088\nA: 56088"
    assert handed_back_output["num_completion_tokens"] == len("A: 56088")
    assert handed_back_output["num_prompt_tokens"] == len(handed_back)  # counted by the tokenizer, not the engine
    assert opened_output["text"] == TOOL_CALL + "4\nA: 4"
    assert no_block_output["text"] == TOOL_CALL + "no ```python block before >>>\nA: ?"
    assert (stats.tool_executions, stats.tool_failed_executions) == (3, 1)


@needs_sandbox
def test_code_past_its_time_is_stopped_and_the_timeout_fed_back(monkeypatch, tmp_path):
    prompt = "Q: loop\n"
    timeout = "TimeoutError: the code ran longer than 1 s and was stopped\n"
    shard = make_shard(tmp_path, [prompt])
    engine = ScriptedEngine({prompt: [block("while True: pass"), "A: stopped"]})

    stats = run_shard(monkeypatch, shard, engine, code_evaluator(execution_timeout_seconds=1))

    (output,) = outputs(shard)
    assert output["text"] == block("while True: pass") + timeout + "A: stopped"
    assert (stats.tool_executions, stats.tool_failed_executions, stats.tool_timed_out_executions) == (1, 1, 1)


@needs_sandbox
def test_log_probabilities_cover_the_generated_tokens_of_every_round_and_none_of_the_tools(monkeypatch, tmp_path):
    prompt = "Q: 6 * 7\n"
    shard = make_shard(tmp_path, [prompt], return_token_log_probs=True)
    engine = ScriptedEngine({prompt: [block("print(6 * 7)"), "A: 42"]})

    run_shard(monkeypatch, shard, engine, code_evaluator())

    (output,) = outputs(shard)
    assert "".join(token["token"] for token in output["tokens"]) == block("print(6 * 7)") + "A: 42"
    assert len(output["tokens"]) == output["num_completion_tokens"]


@needs_sandbox
def test_a_prompt_the_engine_refuses_is_an_error_entry_and_a_transcript_it_refuses_ends_there(monkeypatch, tmp_path):
    """The model's context is 60 tokens here: a prompt past it is that prompt's error; a transcript that
    grows past it with the tool's output is the prompt's output as it stands."""
    too_long, grows = "Q: " + "long " * 20 + "\n", "Q: grow\n"
    shard = make_shard(tmp_path, [too_long, grows])
    engine = ScriptedEngine({too_long: [], grows: [block("print('y' * 40)")]}, max_model_len=60)

    stats = run_shard(monkeypatch, shard, engine, code_evaluator())

    refused, grown = outputs(shard)
    assert refused["error"]["code"] == "prompt_too_long" and refused["error"]["param"] == "prompts"
    assert grown["text"] == block("print('y' * 40)") + "y" * 40 + "\n"
    assert len(engine.rounds(grows)) == 1 and stats.tool_executions == 1 and stats.errors == 1


class FailingEngine(ScriptedEngine):  # test double: an engine that fails (not refuses) a prompt's second round
    def add_request(self, request_id: str, prompt: str, params: Any, tokenization_kwargs: Any = None) -> None:
        if "." in request_id:  # a round after the first
            raise RuntimeError("the engine's worker died")
        super().add_request(request_id, prompt, params)


@needs_sandbox
def test_an_engine_failure_on_a_later_round_fails_the_shard_rather_than_cutting_the_output_short(monkeypatch, tmp_path):
    shard = make_shard(tmp_path, ["Q: run\n"])
    engine = FailingEngine({"Q: run\n": [block("print(1)"), "done"]})
    with pytest.raises(RuntimeError, match="the engine's worker died"):
        run_shard(monkeypatch, shard, engine, code_evaluator())
    assert written(shard) == []  # nothing written in its place: a retry of the shard does the prompt again


@needs_sandbox
def test_while_a_prompts_code_runs_the_other_prompts_keep_generating(monkeypatch, tmp_path):
    slow, other = "Q: a slow one\n", "Q: b quick\n"
    shard = make_shard(tmp_path, [slow, other])
    engine = ScriptedEngine({slow: [block("import time; time.sleep(2); print('slept')"), "A: done"], other: ["A: b"]})

    run_shard(monkeypatch, shard, engine, code_evaluator())

    assert written(shard) == [1, 0]
    slow_asked = engine.finished_at[engine.rounds(slow)[0].request_id]
    assert engine.finished_at[engine.rounds(other)[0].request_id] - slow_asked < 1.0  # not after the 2 s of code
    assert outputs(shard)[0]["text"].endswith("slept\nA: done")


@needs_sandbox
def test_at_the_deadline_prompts_in_flight_are_aborted_unwritten_and_a_retry_redoes_them(monkeypatch, tmp_path):
    plain, looping = "Q: plain\n", "Q: tool\n"
    replies = {plain: ["A: plain"], looping: [block("print(6 * 7)"), "A: 42"]}
    shard = make_shard(tmp_path, [plain, looping])
    clock = Clock()
    monkeypatch.setattr(runner_module, "time", clock)

    class StallingEngine(ScriptedEngine):  # test double: its third step ends an hour later, having finished nothing
        def step(self) -> list[RequestOutput]:
            if self.steps == 2:
                self.steps += 1
                clock.advance(3600)
                return []
            return super().step()

    # Step 1 and 2 finish the plain prompt and the looping one's first round (in either order); its code
    # runs; its second round is in the engine when the deadline passes.
    first = StallingEngine(replies)
    with pytest.raises(DeadlineExceeded, match="1 requests in flight"):
        run_shard(monkeypatch, shard, first, code_evaluator(), deadline=clock.time() + 60)
    assert first.aborted == ["1.1"]
    assert written(shard) == [0]  # the finished prompt is kept; the one in flight is not written

    # A retry past the deadline builds no engine.
    with pytest.raises(DeadlineExceeded, match="0 requests in flight"):
        run_shard(monkeypatch, shard, None, code_evaluator(), deadline=clock.time() - 1)

    # A retry in time redoes the aborted prompt from its start, and only that one.
    retry = ScriptedEngine(replies)
    stats = run_shard(monkeypatch, shard, retry, code_evaluator(), deadline=clock.time() + 60)
    assert [request.request_id for request in retry.requests] == ["1", "1.1"]
    assert retry.rounds(looping)[0].prompt == looping
    assert [output["text"] for output in outputs(shard)] == ["A: plain", block("print(6 * 7)") + "42\nA: 42"]
    assert written(shard) == [0, 1]
    assert (stats.resumed, stats.generated, stats.tool_executions) == (1, 1, 1)


@needs_sandbox
def test_at_the_deadline_a_prompt_waiting_on_its_code_stops_the_shard_and_its_code(monkeypatch, tmp_path):
    """With nothing in the engine and every prompt's code running, the deadline still stops the shard, and
    the code with it: not after the code's own timeout, and no sandbox process is left."""
    looping = "Q: sleeps\n"
    shard = make_shard(tmp_path, [looping])
    engine = ScriptedEngine({looping: [block("import time; time.sleep(20)"), "A: woke"]})

    with pytest.raises(DeadlineExceeded, match="1 requests in flight"):
        run_shard(monkeypatch, shard, engine, code_evaluator(execution_timeout_seconds=30), deadline=time.time() + 2)

    assert len(engine.rounds(looping)) == 1  # its code never finished, so no second round was asked for
    assert not sandbox_processes()
    assert written(shard) == []


def test_a_resumed_shard_skips_finished_items_and_redoes_a_torn_one(monkeypatch, tmp_path):
    """A killed worker leaves whole lines and at most one torn line: the whole ones are kept as they are,
    the torn one is cut off and its item generated again, with the items never started."""
    prompts = ["Q0\n", "Q1\n", "Q2\n"]
    shard = make_shard(tmp_path, prompts)
    kept = {"text": "from the checkpoint", "num_prompt_tokens": 3, "num_completion_tokens": 7, "tokens": None}
    torn = format_result(1, {"text": "torn"})[:-5]
    Path(shard.results_path).write_text(format_result(0, kept) + torn)
    engine = ScriptedEngine({"Q1\n": ["A1"], "Q2\n": ["A2"]})  # asking for Q0 is a fault

    stats = run_shard(monkeypatch, shard, engine)

    assert outputs(shard) == [
        kept,
        {"text": "A1", "num_prompt_tokens": 3, "num_completion_tokens": 2, "tokens": None},
        {"text": "A2", "num_prompt_tokens": 3, "num_completion_tokens": 2, "tokens": None},
    ]
    assert sorted(request.prompt for request in engine.requests) == ["Q1\n", "Q2\n"]
    assert (stats.resumed, stats.generated, stats.completion_tokens) == (1, 2, 11)


# --- Shared generation: greedy requests that differ only in their limit -----------------------------------


def greedy(prompt: str, limit: int, **content: Any) -> dict[str, Any]:
    return {"prompts": [prompt], "max_new_tokens": limit, "temperature": 0.0, "return_token_log_probs": True, **content}


def test_greedy_requests_differing_only_in_their_limit_share_one_generation_cut_to_each(monkeypatch, tmp_path):
    """The engine runs the largest limit once; each request gets that generation's first tokens, with its own
    counts and log-probabilities. A sampled request at the same prompt, or a greedy one asking for something
    else (a stop string), is generated on its own."""
    reply = "abcdefghijkl"
    contents = [
        greedy("Q", 3),
        greedy("Q", 10),
        {**greedy("Q", 4), "temperature": 0.5},
        greedy("Q", 6),
        greedy("Q", 30),  # past the reply's end: the whole reply, as its own generation would stop
        greedy("Q", 5, stop_sequences=["x"]),
    ]
    shard = make_shard_of(tmp_path, contents)
    engine = ScriptedEngine({"Q": [reply] * 3})  # a fourth request for Q is a fault

    stats = run_shard(monkeypatch, shard, engine)

    assert sorted(request.max_tokens for request in engine.requests) == [4, 5, 30]
    texts = [reply[:3], reply[:10], reply[:4], reply[:6], reply, reply[:5]]
    assert [output["text"] for output in outputs(shard)] == texts
    assert [output["num_completion_tokens"] for output in outputs(shard)] == [len(text) for text in texts]
    assert [[token["token"] for token in output["tokens"]] for output in outputs(shard)] == [list(t) for t in texts]
    assert (stats.generated, stats.cut_from_longer) == (6, 3)


def test_with_sharing_off_each_limit_is_generated_on_its_own(monkeypatch, tmp_path):
    shard = make_shard_of(tmp_path, [greedy("Q", 3), greedy("Q", 6)])
    engine = ScriptedEngine({"Q": ["abcdefgh"] * 2})

    stats = run_shard(monkeypatch, shard, engine, share_generations=False)

    assert sorted(request.max_tokens for request in engine.requests) == [3, 6]
    assert [output["text"] for output in outputs(shard)] == ["abc", "abcdef"]
    assert stats.cut_from_longer == 0


def test_a_cut_whose_text_the_detokenizer_would_write_otherwise_is_generated_on_its_own(monkeypatch, tmp_path):
    """Where the tokenizer's stream does not write the engine's own text for the longer generation (vLLM
    wrote it another way), a cut of it is not trusted: the shorter request is generated again, alone."""
    shard = make_shard_of(tmp_path, [greedy("Q", 3), greedy("Q", 6)])
    engine = ScriptedEngine({"Q": ["abcdefgh", "abcdefgh"]})

    def disagreeing(prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        return [chr(token).upper() for token in token_ids]

    stats = run_shard(monkeypatch, shard, engine, pieces=disagreeing)

    assert [request.max_tokens for request in engine.requests] == [6, 3]
    assert [output["text"] for output in outputs(shard)] == ["abc", "abcdef"]
    assert stats.cut_from_longer == 0


def test_a_completion_the_tokenizers_stream_cannot_decode_is_generated_again_alone(monkeypatch, tmp_path):
    """Found by review: a byte-fallback tokenizer's stream raises on some invalid UTF-8 sequences (vLLM's
    detokenizer recovers in a way of its own). That failed the shard, and every retry of it the same way."""
    shard = make_shard_of(tmp_path, [greedy("Q", 3), greedy("Q", 6)])
    engine = ScriptedEngine({"Q": ["abcdefgh", "abcdefgh"]})

    def failing(prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        raise Exception("Invalid prefix encountered while decoding stream")

    stats = run_shard(monkeypatch, shard, engine, pieces=failing)

    assert [request.max_tokens for request in engine.requests] == [6, 3]
    assert [output["text"] for output in outputs(shard)] == ["abc", "abcdef"]
    assert stats.cut_from_longer == 0


def test_a_shared_generation_the_engine_refuses_leaves_each_request_its_own_error(monkeypatch, tmp_path):
    """Every request of a group the engine refuses gets its error entry, not only the one that led it."""
    long_prompt = "Q" * 50
    shard = make_shard_of(tmp_path, [greedy(long_prompt, 3), greedy(long_prompt, 6), greedy(long_prompt, 9)])
    engine = ScriptedEngine({long_prompt: []}, max_model_len=20)

    run_shard(monkeypatch, shard, engine)

    errors = [output["error"]["code"] for output in outputs(shard)]
    assert errors == ["prompt_too_long"] * 3


def test_a_limit_of_zero_is_refused_on_its_own_not_answered_from_another_generation(monkeypatch, tmp_path):
    """Found by review: the engine refuses `max_tokens: 0`; grouped, such a request got an empty answer."""
    records = [("content", {"prompt": "Q", "max_tokens": limit, "temperature": 0}) for limit in (0, 4)]
    (shard,) = write_shards(work_items(records), 1, str(tmp_path / "job"))
    engine = ScriptedEngine({"Q": ["abcdefgh"]})

    run_shard(monkeypatch, shard, engine)

    first, second = outputs(shard)
    assert first["error"]["code"] == "invalid_request" and second["choices"][0]["text"] == "abcd"


def test_requests_owed_again_wait_for_room_in_flight(monkeypatch, tmp_path):
    """Found by review: the requests of a refused or untrusted shared generation went into the engine at
    once, past max_in_flight."""
    prompts = [f"Q{i}" for i in range(3)]
    shard = make_shard_of(tmp_path, [greedy(prompt, limit) for prompt in prompts for limit in (2, 4, 6)])
    engine = ScriptedEngine({prompt: ["abcdefgh"] * 3 for prompt in prompts})

    def disagreeing(prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        return [chr(token).upper() for token in token_ids]

    run_shard(monkeypatch, shard, engine, max_in_flight=2, pieces=disagreeing)

    assert engine.most_pending <= 2
    assert [output["text"] for output in outputs(shard)] == ["ab", "abcd", "abcdef"] * 3


@pytest.mark.parametrize("team", ["team-a", None])
def test_every_request_a_shard_adds_carries_its_teams_cache_salt(monkeypatch, tmp_path, team):
    """Rounds, shared generations and requests generated again alone alike: one team's prompts never meet
    another's in the engine's prefix cache. A job of no team has a salt too, one no team has."""
    from batch_pipeline.worker.prefix_cache import team_cache_salt

    shard = make_shard_of(
        tmp_path,
        [
            {"prompts": ["Q: one\n", "Q: two\n"], "max_new_tokens": 4, "temperature": 0.0},
            {"prompts": ["Q: one\n"], "max_new_tokens": 2, "temperature": 0.0},  # shares one generation
        ],
    )
    engine = ScriptedEngine({"Q: one\n": ["1111"], "Q: two\n": ["2222"]})
    run_shard(monkeypatch, shard, engine, owner_team=team)

    assert outputs(shard)[2]["text"] == "11"
    salt = team_cache_salt(team)
    assert engine.cache_salts == [salt, salt]
    assert len(salt) == 64 and team_cache_salt("team-b") != salt and (team is None or team not in salt)
    assert team_cache_salt(None) == team_cache_salt("") != team_cache_salt("team-a")
