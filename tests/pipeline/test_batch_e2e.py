"""End to end: real requests through the real Dagster job, with real vLLM and the real model."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from batch_pipeline.core.settings import settings
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.schema import job_shards
from tests.conftest import MODEL, worker_pids

pytestmark = pytest.mark.slow

# Strictly growing prompt lengths, so each output's prompt token count says which prompt it answers.
STORY_PROMPTS = [("Please continue the story. " * (i + 1)) + "Once upon a time, a robot" for i in range(8)]
TOO_LONG = "word " * 9000  # past the model's 8192-token context


def _read_output(path) -> list[dict]:
    return json.loads(Path(path).read_text())


def test_two_shards_keep_input_order_logprobs_stops_and_isolate_a_bad_prompt(run_job, tokenizer, tmp_path):
    prompts = STORY_PROMPTS[:5] + [TOO_LONG] + STORY_PROMPTS[5:]
    contents = [
        {"prompts": prompts, "max_new_tokens": 24, "temperature": 0.0, "return_token_log_probs": True},
        {"prompts": STORY_PROMPTS, "max_new_tokens": 24, "temperature": 0.0, "stop_sequences": ["\n", ","]},
    ]
    input_path = tmp_path / "input.json"
    input_path.write_text(json.dumps(contents))
    output_path = tmp_path / "out" / "output.json"

    result = run_job(
        {
            "input_data_path": str(input_path),
            "output_data_path": str(output_path),
            "model_config": {"model": MODEL},
            "data_parallelism": 2,
        }
    )

    assert result.success
    outputs = _read_output(output_path)
    assert len(outputs) == len(prompts) + len(STORY_PROMPTS)
    free, stopped = outputs[: len(prompts)], outputs[len(prompts) :]

    # Order: output i answers prompt i, across both shards.
    for prompt, output in zip(prompts, free):
        if prompt is TOO_LONG:
            assert output["error"]["code"] == "prompt_too_long"
            assert "8192" in output["error"]["message"]
            continue
        assert output["num_prompt_tokens"] == len(tokenizer(prompt).input_ids)
        assert 0 < output["num_completion_tokens"] <= 24
        tokens = output["tokens"]
        assert len(tokens) == output["num_completion_tokens"]
        assert all(token["log_prob"] <= 0.0 for token in tokens)
        assert "".join(token["token"] for token in tokens).startswith(output["text"][:10])
    for prompt, output in zip(STORY_PROMPTS, stopped):
        assert output["num_prompt_tokens"] == len(tokenizer(prompt).input_ids)
        assert "\n" not in output["text"] and "," not in output["text"]
        assert output["tokens"] is None
    # The stop sequences cut generation short where the free run went past them.
    free_by_prompt = dict(zip(prompts, free))
    cut = [o for p, o in zip(STORY_PROMPTS, stopped) if "," in free_by_prompt[p]["text"]]
    assert cut and all(o["num_completion_tokens"] < 24 for o in cut)

    metadata = json.loads(Path(str(output_path) + ".metadata.json").read_text())
    assert metadata["num_requests"] == len(outputs)
    assert metadata["num_errors"] == 1
    assert len(metadata["shards"]) == 2
    assert metadata["completion_tokens"] == sum(o.get("num_completion_tokens", 0) for o in outputs)

    # Each shard's worker said it was starting its engine, and reported generation after it: the job's phase
    # in its status read went from "starting engine" to "generating" (issue 46).
    with JobStore(settings().job_store_url).engine.connect() as connection:
        assert connection.execute(sa.select(job_shards.c.phase)).scalars().all() == ["generating", "generating"]


def test_inline_and_jsonl_inputs_with_one_seed_give_the_same_samples(run_job, tmp_path):
    content = {"prompts": STORY_PROMPTS[:4], "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95}
    model_config = {"model": MODEL, "seed": 1234}
    inline_out = tmp_path / "inline.json"
    assert run_job({"content": content, "output_data_path": str(inline_out), "model_config": model_config}).success

    jsonl = tmp_path / "input.jsonl"
    jsonl.write_text(json.dumps(content) + "\n")
    file_out = tmp_path / "file.json"
    assert run_job(
        {"input_data_path": str(jsonl), "output_data_path": str(file_out), "model_config": model_config}
    ).success

    other_seed_out = tmp_path / "other_seed.json"
    assert run_job(
        {"content": content, "output_data_path": str(other_seed_out), "model_config": {"model": MODEL, "seed": 99}}
    ).success

    inline_texts = [o["text"] for o in _read_output(inline_out)]
    assert inline_texts == [o["text"] for o in _read_output(file_out)]
    assert inline_texts != [o["text"] for o in _read_output(other_seed_out)]


def test_a_killed_shard_worker_is_retried_and_resumes_without_loss_or_duplicates(run_job, dagster_home, tmp_path):
    # Different lengths finish at different times, so the worker is killed with results on disk and
    # requests still in flight.
    contents = [
        {
            "prompts": [f"Item {k}-{i}: " + STORY_PROMPTS[i] for i in range(8)],
            "max_new_tokens": 4 + 12 * k,
            "temperature": 0.0,
        }
        for k in range(6)
    ]
    input_path = tmp_path / "input.json"
    input_path.write_text(json.dumps(contents))
    output_path = tmp_path / "output.json"
    results_path = Path(os.environ["DAGSTER_HOME"]) / "work" / "kill-test" / "shards" / "000" / "results.tsv"
    killed = []

    def kill_when_results_appear():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if results_path.exists() and results_path.read_text().count("\n") >= 10:
                for pid in worker_pids():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_results_appear, daemon=True)
    killer.start()
    result = run_job(
        {"input_data_path": str(input_path), "output_data_path": str(output_path), "model_config": {"model": MODEL}},
        job_id="kill-test",
    )
    killer.join(timeout=1)

    assert killed, "the worker finished before it could be killed"
    assert result.success
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1
    outputs = _read_output(output_path)
    assert len(outputs) == 48 and all("text" in o for o in outputs)
    lines = results_path.read_text().splitlines()
    assert sorted(int(line.split("\t")[0]) for line in lines) == list(range(48))
    shard_stats = json.loads(Path(str(output_path) + ".metadata.json").read_text())["shards"][0]
    assert shard_stats["resumed"] >= 10
    assert shard_stats["resumed"] + shard_stats["generated"] == 48


def test_a_10_mb_prompt_fails_alone_and_the_rest_complete(run_job, tmp_path):
    huge = "lorem ipsum " * (10 * 1024 * 1024 // 12)
    input_path = tmp_path / "input.jsonl"
    content = {"prompts": ["The capital of France is", huge, "Water boils at"], "max_new_tokens": 4, "temperature": 0.0}
    input_path.write_text(json.dumps(content) + "\n")
    assert input_path.stat().st_size > 10 * 1000 * 1000
    output_path = tmp_path / "output.json"
    result = run_job(
        {"input_data_path": str(input_path), "output_data_path": str(output_path), "model_config": {"model": MODEL}}
    )
    assert result.success
    first, too_big, last = _read_output(output_path)
    assert first["text"] and last["text"]
    assert too_big["error"]["code"] == "prompt_too_long", too_big
    assert (too_big["error"]["type"], too_big["error"]["param"]) == ("invalid_request_error", "prompts")


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


RUN_WORKER = """
import sys
import dagster as dg
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.pipeline.execute import execute_request
request = CreateBatchCompletionsV2Request.model_validate_json(open(sys.argv[1]).read())
execute_request(request, dg.DagsterInstance.get(), job_id="run-worker-kill")
"""


def test_a_killed_run_worker_is_re_executed_from_failure_without_redoing_finished_shards(dagster_home, tmp_path):
    import subprocess
    import sys

    import dagster as dg

    from batch_pipeline.pipeline.definitions import batch_completions_job

    request = {
        "output_data_path": str(tmp_path / "output.json"),
        "model_config": {"model": MODEL},
        "data_parallelism": 2,
        "content": {
            "prompts": [f"Item {i}: " + STORY_PROMPTS[i] for i in range(8)],
            "max_new_tokens": 24,
            "temperature": 0.0,
        },
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    # The run's own process (the executor and every step and worker under it), one shard at a time.
    run_worker = subprocess.Popen(
        [sys.executable, "-c", RUN_WORKER, str(tmp_path / "request.json")],
        env={**os.environ, "BATCH_PIPELINE_LOCAL_SHARD_CONCURRENCY": "1", "BATCH_PIPELINE_MAX_SHARDS_PER_JOB": "2"},
        stdout=open(tmp_path / "run.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    # Killed once one shard has finished and the other has results on disk and more in flight.
    second_shard = Path(os.environ["DAGSTER_HOME"]) / "work" / "run-worker-kill" / "shards" / "001" / "results.tsv"
    deadline = time.monotonic() + 400

    def succeeded_steps() -> set[str]:
        runs = dagster_home.get_runs()
        events = dagster_home.all_logs(runs[0].run_id, of_type=dg.DagsterEventType.STEP_SUCCESS) if runs else []
        return {record.step_key for record in events}

    # The first shard's step succeeds seconds before the second shard (one at a time) has a result: the
    # event log is read until then; the second shard's file is then watched closely, since its last
    # results follow its first within a second or two (reading the event log each time missed them in CI).
    while "run_shard[shard_000]" not in succeeded_steps():
        assert run_worker.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no shard finished"
        time.sleep(0.2)
    while not (second_shard.exists() and second_shard.read_text().count("\n") >= 1):
        assert run_worker.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the second shard wrote no result"
        time.sleep(0.01)
    os.killpg(run_worker.pid, signal.SIGKILL)
    run_worker.wait()
    succeeded = succeeded_steps()  # of the killed run, before its re-execution is the newest
    time.sleep(1)
    assert [pid for pid in worker_pids() if _session_of(pid) == run_worker.pid] == []
    (first_run,) = dagster_home.get_runs()
    assert not (tmp_path / "output.json").exists()
    # What run monitoring does for a run whose process is gone; then the UI's "re-execute from failure".
    dagster_home.report_run_failed(first_run)
    result = dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=dagster_home,
        reexecution_options=dg.ReexecutionOptions.from_failure(first_run.run_id, dagster_home),
    )
    executed = {event.step_key for event in result.all_events if event.event_type_value == "STEP_START"}
    assert result.success
    finished_before = {key for key in succeeded if key.startswith("run_shard")}
    assert finished_before and not (executed & finished_before)  # finished shards were not redone
    assert {"run_shard[shard_001]", "merge_outputs", "write_job_metadata"} <= executed
    outputs = _read_output(tmp_path / "output.json")
    assert len(outputs) == 8 and all("text" in output for output in outputs)
    assert [output["num_prompt_tokens"] for output in outputs] == sorted(o["num_prompt_tokens"] for o in outputs)
    metadata = json.loads(Path(str(tmp_path / "output.json") + ".metadata.json").read_text())
    assert metadata["job_id"] == "run-worker-kill" and metadata["shards"][1]["resumed"] >= 1


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB filesystem (tmpfs), to fill mid-shard; remounted larger when 'space returns'."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "small_disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_the_shard_clearly_and_a_re_execution_after_space_returns_completes(
    run_job, dagster_home, small_disk, tmp_path, monkeypatch
):
    import subprocess

    import dagster as dg

    from batch_pipeline.pipeline.definitions import batch_completions_job

    monkeypatch.setenv("BATCH_PIPELINE_WORK_DIR", str(small_disk))  # shard inputs and checkpoints live here
    content = {
        "prompts": [f"Item {i}: " + STORY_PROMPTS[i % 8] for i in range(24)],
        "max_new_tokens": 48,
        "temperature": 0.0,
        "return_token_log_probs": True,
    }
    output_path = tmp_path / "output.json"
    result = run_job({"output_data_path": str(output_path), "model_config": {"model": MODEL}, "content": content})
    assert not result.success
    # the reason the API and the UI show for the failed step
    (failure,) = [e.step_failure_data.user_failure_data.description for e in result.all_events if e.is_step_failure]
    assert failure.startswith("shard 0: the worker failed: OSError: [Errno 28] No space left on device: "), failure
    assert str(small_disk) in failure
    assert not output_path.exists()

    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    again = dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=dagster_home,
        reexecution_options=dg.ReexecutionOptions.from_failure(result.run_id, dagster_home),
    )
    assert again.success
    outputs = _read_output(output_path)
    assert len(outputs) == 24 and all(len(o["tokens"]) == o["num_completion_tokens"] for o in outputs)
    shard = json.loads(Path(str(output_path) + ".metadata.json").read_text())["shards"][0]
    assert shard["resumed"] > 0 and shard["resumed"] + shard["generated"] == 24
