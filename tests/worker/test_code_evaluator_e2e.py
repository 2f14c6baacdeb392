"""The code_evaluator tool loop end to end: real vLLM, the real sandbox, the real Dagster job.

No assertion reads what the model writes. Each prompt is a transcript handed back: it ends with a python
block and `>>>`, so that block runs before anything is generated, and what it prints (or its error) is the
start of the output, exactly; the counts of executions follow from the tool config (`max_iterations: 1`:
the model's own calls stay in the text, unrun). What the model writes after that is checked only through
bounds that hold whatever it writes. The loop's mechanics round by round, with every round scripted, are
in test_tool_loop.py.
"""

import json
import socket
import threading
from pathlib import Path

import pytest

from batch_pipeline.worker.code_evaluator import TOOL_CALL
from tests.conftest import MODEL, sandbox_processes

pytestmark = pytest.mark.slow

# Examples of the format, so that the model goes on in it; nothing below depends on whether it does.
FEW_SHOT = "".join(
    f"Q: run `{code}`\n```python\n{code}\n```\n>>>\n{out}\nA: {out}\n\n"
    for code, out in [
        ("print(3 + 4)", "7"),
        ("import math; print(math.sqrt(16))", "4.0"),
        ("x = 5; print(x * 2)", "10"),
        ("print(sorted([3, 1, 2]))", "[1, 2, 3]"),
    ]
)


def ask_to_run(code: str) -> str:
    """A prompt that itself ends asking for its block to run: the code runs whatever the model would write."""
    return f"{FEW_SHOT}Q: run `{code}`\n```python\n{code}\n{TOOL_CALL}"


# No dtype: no assertion depends on the model's numerics.
MODEL_CONFIG = {"model": MODEL}


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
    (shard,) = metadata["shards"]
    return json.loads(output.read_text()), shard


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def test_a_handed_back_block_runs_first_and_generation_goes_on_from_its_output(run_job, tmp_path, tokenizer):
    compute, name_error, flood = (
        ask_to_run(code) for code in ("print(123 * 456)", "print(count)", "print('word ' * 200)")
    )
    budget = 48
    (computed, failed, flooded), shard = run_tool_job(
        run_job, tmp_path, [compute, name_error, flood], max_new_tokens=budget, max_iterations=1
    )

    # The tool's output (or its error) starts the text, right after the prompt's `>>>`.
    assert computed["text"].startswith("56088\n"), computed["text"]
    error = first_line(failed["text"]) + "\n"
    assert error.startswith("NameError: name 'count' is not defined"), failed["text"]
    # Then the model went on (a round generates at least one token), the error fed back as the output is:
    # only generated tokens count as completion tokens, and the tool's text counts against the budget.
    assert 1 <= computed["num_completion_tokens"] <= budget - tokens(tokenizer, "56088\n")
    assert 1 <= failed["num_completion_tokens"] <= budget - tokens(tokenizer, error)
    # An output longer than the budget ends the text right after it: nothing is generated.
    assert flooded["text"] == "word " * 200 + "\n" and flooded["num_completion_tokens"] == 0
    for output, prompt in ((computed, compute), (failed, name_error), (flooded, flood)):
        assert output["num_prompt_tokens"] == tokens(tokenizer, prompt)
        # max_iterations 1: a call the model wrote after the output stays in the text, unrun, and ends it.
        assert TOOL_CALL not in output["text"].removesuffix(TOOL_CALL), output["text"]

    assert shard["tool_config"] == "applied"
    assert (shard["tool_executions"], shard["tool_failed_executions"], shard["tool_timed_out_executions"]) == (3, 1, 0)
    assert shard["sandbox"]["network"].startswith("no network")
    assert shard["sandbox"]["user"].startswith("uids 61000") and "together" in shard["sandbox"]["memory"]


def test_without_retry_an_error_ends_the_text_right_after_it(run_job, tmp_path):
    (failed, computed), shard = run_tool_job(
        run_job,
        tmp_path,
        [ask_to_run("print(count)"), ask_to_run("print(123 * 456)")],
        max_iterations=1,
        should_retry_on_error=False,
    )
    # The error, and nothing after it: not a token generated.
    assert failed["text"].startswith("NameError: name 'count' is not defined"), failed["text"]
    assert failed["text"].count("\n") == 1 and failed["text"].endswith("\n"), failed["text"]
    assert failed["num_completion_tokens"] == 0
    # A block that runs still goes on.
    assert computed["text"].startswith("56088\n") and computed["num_completion_tokens"] >= 1
    assert (shard["tool_executions"], shard["tool_failed_executions"]) == (2, 1)


def test_max_iterations_bounds_the_executions_of_a_prompt(run_job, tmp_path):
    """After the handed-back block, whether the model writes more blocks is its own affair: whatever it
    writes, at most max_iterations of them run, and a call past the bound stays in the text, ending it."""
    (answer,), shard = run_tool_job(
        run_job, tmp_path, [ask_to_run("print(6 * 7)")], max_new_tokens=200, max_iterations=2
    )
    text, executions = answer["text"], shard["tool_executions"]
    assert text.startswith("42\n"), text
    assert 1 <= executions <= 2 and shard["tool_failed_executions"] <= executions - 1
    # Every call the model wrote ran, but for a last one left unrun at the end of the text.
    calls = text.count(TOOL_CALL)
    assert calls == executions - 1 or (calls == executions and text.endswith(TOOL_CALL)), text


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
    prompts = [ask_to_run("print(123 * 456)"), *(ask_to_run(code) for code in hostile.values())]
    try:
        outputs, shard = run_tool_job(
            run_job, tmp_path, prompts, max_new_tokens=48, max_iterations=1, execution_timeout_seconds=3
        )
    finally:
        stop.set()
    # Each text starts with what its block printed, or its error: the sandbox's doing, not the model's.
    texts = dict(zip(["compute", *hostile], (output["text"] for output in outputs)))
    assert texts["compute"].startswith("56088\n"), texts["compute"]
    assert texts["loop"].startswith("TimeoutError: the code ran longer than 3 s"), texts["loop"]
    # The bomb hits the process limit (fork fails) or the time limit, whichever comes first.
    assert first_line(texts["fork_bomb"]).startswith(("BlockingIOError", "TimeoutError")), texts["fork_bomb"]
    assert texts["allocation"].startswith("MemoryError"), texts["allocation"]
    assert texts["output"].startswith("x" * 8192 + "\n[output truncated to 8192 characters]\n")
    assert len(texts["output"]) < 20_000
    assert texts["write"].startswith("PermissionError") and victim.read_text() == "the job's own data"
    printed = first_line(texts["environment"])
    assert printed.startswith("{") and "'PATH': " in printed, texts["environment"]
    assert "BATCH_PIPELINE" not in printed and "s3cr3t-value" not in texts["environment"]
    assert not texts["socket"].startswith("connected") and not accepted
    assert (shard["tool_executions"], shard["tool_failed_executions"]) == (8, 6)  # all but compute, environment
    assert 1 <= shard["tool_timed_out_executions"] <= 2  # the loop, and the bomb if time stopped it
    assert outputs[0]["num_completion_tokens"] >= 1  # generation went on after the run
    assert not sandbox_processes()


def test_with_a_list_of_requests_the_tool_is_not_applied_and_the_job_says_so(run_job, tmp_path):
    """Scale's server accepts tool_config with chat and completion requests; the loop serves v1 prompts
    only, so the requests run as they would without it, and the shard's stats (in the job's metadata) say so."""
    # min_tokens = max_tokens: exactly 8 tokens each, whatever the model would have ended with.
    length = {"max_tokens": 8, "min_tokens": 8, "temperature": 0}
    requests = [
        {"prompt": ask_to_run("print(123 * 456)"), **length},
        {"messages": [{"role": "user", "content": ask_to_run("print(123 * 456)")}], **length},
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
    # Generated as asked and no more: no tool text was added to either.
    assert completion["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 8
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert metadata["tool_config"].startswith("not applied: the code_evaluator loop serves v1 content")
    (shard,) = metadata["shards"]
    assert shard["tool_config"] == metadata["tool_config"]
    assert shard["tool_executions"] == 0 and shard["sandbox"] is None  # no code ran, no sandbox was made
