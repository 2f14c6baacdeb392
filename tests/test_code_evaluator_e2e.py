"""The code_evaluator tool loop end to end: real vLLM writes the code, the sandbox runs it, generation goes
on from the output. The model is small, so each prompt shows it the format first (few-shot), and the
code it is asked to run is spelled out in the question for it to copy."""

import json
import re
import socket
import threading
from pathlib import Path

import pytest

from tests.conftest import MODEL, sandbox_processes

pytestmark = pytest.mark.slow


def few_shot(examples: list[tuple[str, str]]) -> str:
    return "".join(f"Q: run `{code}`\n```python\n{code}\n```\n>>>\n{out}\nA: {out}\n\n" for code, out in examples)


FEW_SHOT = few_shot(
    [("print(3 + 4)", "7"), ("print(10 * 12)", "120"), ("print(2 ** 5)", "32"), ("print(81 // 9)", "9")]
)
# Statements too, for prompts that open the block themselves and leave the model to close it.
STATEMENTS_FEW_SHOT = few_shot(
    [
        ("print(3 + 4)", "7"),
        ("import math; print(math.sqrt(16))", "4.0"),
        ("x = 5; print(x * 2)", "10"),
        ("print(sorted([3, 1, 2]))", "[1, 2, 3]"),
        ("import time; time.sleep(0); print('done')", "done"),
    ]
)


def ask(code: str) -> str:
    return f"{FEW_SHOT}Q: run `{code}`\n"


def ask_to_close(code: str) -> str:
    return f"{STATEMENTS_FEW_SHOT}Q: run `{code}`\n```python\n{code}\n"


def ask_to_run(code: str) -> str:
    """A prompt that itself ends asking for its block to run: the code runs whatever the model would write."""
    return f"{ask_to_close(code)}```\n>>>\n"


# What the model writes is asserted: float32 on every machine, since greedy text follows the dtype's
# numerics, and unset the dtype would be bfloat16 on some CPUs and float32 on others.
MODEL_CONFIG = {"model": MODEL, "dtype": "float32"}


def run_tool_job(run_job, tmp_path: Path, prompts: list[str], max_new_tokens: int = 48, **tool_config) -> tuple:
    output = tmp_path / "output.json"
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": MODEL_CONFIG,
            "content": {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": 0.0},
            "tool_config": {"name": "code_evaluator", "execution_timeout_seconds": 5, **tool_config},
        }
    )
    assert result.success
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    return json.loads(output.read_text()), metadata


def test_a_model_written_computation_comes_back_and_generation_continues(run_job, tmp_path, tokenizer):
    (answer,), metadata = run_tool_job(run_job, tmp_path, [ask("print(123 * 456)")])
    text = answer["text"]
    assert text.startswith("```python\nprint(123 * 456)\n```\n>>>\n56088\n"), text
    assert "A: 56088" in text  # the model read the output and went on from it
    # Only generated tokens count; the tool's "56088\n" does not.
    assert answer["num_completion_tokens"] < len(tokenizer.encode(text, add_special_tokens=False))
    (shard,) = metadata["shards"]
    assert shard["tool_config"] == "applied"
    assert shard["tool_executions"] >= 1 and shard["tool_failed_executions"] == 0
    assert shard["sandbox"]["network"].startswith("no network")
    assert shard["sandbox"]["user"].startswith("uids 61000") and "together" in shard["sandbox"]["memory"]


FIX_EXAMPLES = [("total", "7"), ("width", "12")]
FIX_FEW_SHOT = "".join(
    f"Q: print `{name}`, defining it if needed\n```python\nprint({name})\n```\n>>>\n"
    f"NameError: name '{name}' is not defined\n```python\n{name} = {value}\nprint({name})\n```\n>>>\n"
    f"{value}\nA: {value}\n\n"
    for name, value in FIX_EXAMPLES
)
FIX_PROMPT = FIX_FEW_SHOT + "Q: print `count`, defining it if needed\n"


def test_a_name_error_is_fed_back_and_generation_goes_on_when_retry_is_on(run_job, tmp_path):
    (answer,), metadata = run_tool_job(run_job, tmp_path, [FIX_PROMPT], max_new_tokens=64)
    text = answer["text"]
    first_error = "```python\nprint(count)\n```\n>>>\nNameError: name 'count' is not defined"
    assert text.startswith(first_error), text
    # The model read the error and wrote another block, which ran too. Whether its second try defines
    # `count` depends on the CPU's numerics (on some it repeats the first block): the loop is what is tested.
    assert metadata["shards"][0]["tool_executions"] >= 2
    assert metadata["shards"][0]["tool_failed_executions"] >= 1
    after_error = text.split("\n", 5)[5]
    assert after_error.startswith("```python\n") and "```\n>>>\n" in after_error, text
    if fixed := re.search(r"```python\ncount = (\d+)\nprint\(count\)\n```\n>>>\n(\d+)\n", text):
        assert fixed[1] == fixed[2], text  # a corrected block ran and printed its value


def test_without_retry_an_error_ends_the_loop(run_job, tmp_path):
    (answer,), metadata = run_tool_job(run_job, tmp_path, [FIX_PROMPT], should_retry_on_error=False)
    assert re.fullmatch(
        r"```python\nprint\(count\)\n```\n>>>\nNameError: name 'count' is not defined[^\n]*\n", answer["text"]
    ), answer["text"]
    assert metadata["shards"][0]["tool_executions"] == 1


def test_max_iterations_bounds_the_executions_of_a_prompt(run_job, tmp_path):
    (answer,), metadata = run_tool_job(run_job, tmp_path, [ask("print(6 * 7)")], max_new_tokens=200, max_iterations=2)
    assert metadata["shards"][0]["tool_executions"] == 2
    # The model asked a third time; that block is in the text, not run.
    assert answer["text"].count("```\n>>>\n") == 3 and answer["text"].endswith("```\n>>>\n"), answer["text"]


def test_hostile_code_is_contained_and_the_rest_of_the_batch_completes(run_job, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_TEST_SECRET", "s3cr3t-value")  # in the worker's environment
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    victim = tmp_path / "job-file.txt"
    victim.write_text("the job's own data")
    hostile = {
        "loop": "while True: pass",
        "fork_bomb": "import os; [os.fork() for _ in iter(int, 1)]",
        "allocation": "x = bytearray(10 * 2**30); print(len(x))",
        "output": "import sys; [sys.stdout.write('x' * 2**20) for _ in range(1024)]",
        "write": f"open('{victim}', 'w').write('overwritten')",
        "environment": "import os; print(dict(os.environ))",
        "socket": f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')",
    }
    # Each prompt ends asking for its block to run, so what runs does not depend on the model's numerics;
    # the model then goes on from the output.
    prompts = [ask_to_run("print(123 * 456)"), *(ask_to_run(code) for code in hostile.values())]
    try:
        outputs, metadata = run_tool_job(
            run_job, tmp_path, prompts, max_new_tokens=48, max_iterations=1, execution_timeout_seconds=3
        )
    finally:
        stop.set()
    texts = dict(zip(["compute", *hostile], (output["text"] for output in outputs)))
    assert texts["compute"].startswith("56088\n"), texts["compute"]
    assert "TimeoutError" in texts["loop"]
    # The bomb hits the process limit (fork fails) or the time limit, whichever comes first.
    assert "BlockingIOError" in texts["fork_bomb"] or "TimeoutError" in texts["fork_bomb"]
    assert "MemoryError" in texts["allocation"]
    assert "[output truncated to 8192 characters]" in texts["output"] and len(texts["output"]) < 20_000
    assert "PermissionError" in texts["write"] and victim.read_text() == "the job's own data"
    assert "s3cr3t-value" not in texts["environment"] and "BATCH_PIPELINE" not in texts["environment"]
    assert not texts["socket"].startswith("connected") and not accepted
    (shard,) = metadata["shards"]
    assert shard["tool_executions"] == 8 and shard["tool_failed_executions"] == 6  # all but compute, environment
    assert outputs[0]["num_completion_tokens"] > 0  # generation went on after the run
    assert not sandbox_processes()


def test_with_a_list_of_requests_the_tool_is_not_applied_and_the_job_says_so(run_job, tmp_path):
    """Scale's server accepts tool_config with chat and completion requests; the loop serves v1 prompts
    only, so the requests run as they would without it, and the shard's stats (in the job's metadata) say so."""
    requests = [
        {"prompt": ask_to_run("print(123 * 456)"), "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "user", "content": ask_to_run("print(123 * 456)")}], "max_tokens": 8, "temperature": 0},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(request) + "\n" for request in requests))
    output = tmp_path / "output.json"
    result = run_job(
        {
            "input_data_path": str(tmp_path / "requests.jsonl"),
            "output_data_path": str(output),
            "model_config": MODEL_CONFIG,
            "tool_config": {"name": "code_evaluator", "execution_timeout_seconds": 5},
        }
    )
    assert result.success
    completion, chat = json.loads(output.read_text())
    assert completion["object"] == "text_completion" and chat["object"] == "chat.completion"
    assert completion["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 8
    assert not completion["choices"][0]["text"].startswith("56088")  # no code ran for it
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert metadata["tool_config"].startswith("not applied: the code_evaluator loop serves v1 content")
    (shard,) = metadata["shards"]
    assert shard["tool_config"] == metadata["tool_config"]
    assert shard["tool_executions"] == 0 and shard["sandbox"] is None
