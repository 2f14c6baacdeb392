"""End to end: real requests through the real Dagster job, with real vLLM and the real model."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

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
    free, stopped = outputs[: len(prompts)], outputs[len(prompts):]

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
        {"prompts": [f"Item {k}-{i}: " + STORY_PROMPTS[i] for i in range(8)], "max_new_tokens": 4 + 12 * k,
         "temperature": 0.0}
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
