"""A job cancelled halfway, then resumed, through `serve` (the API, the Dagster daemon and webserver, real
vLLM): it completes with every result exactly once, in input order, generating only what it had not
finished."""

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from batch_pipeline.shards.protocol import POOL_IDLE
from tests.conftest import MODEL
from tests.entrypoints.test_serve import Served, _descendants

pytestmark = pytest.mark.slow
# 2,000 as the issue asks; fewer where the machine is too loaded to run that many in the test's time.
REQUESTS = int(os.environ.get("BATCH_PIPELINE_TEST_RESUME_REQUESTS", "2000"))


def _get(served: Served, job_id: str) -> dict:
    return httpx.get(f"{served.api}/v2/batch-completions/{job_id}", timeout=30).json()["job"]


def _wait_for(served: Served, job_id: str, predicate, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not predicate(job := _get(served, job_id)):
        assert time.monotonic() < deadline, f"timed out; last state {job}\n{served.log.read_text()[-3000:]}"
        time.sleep(0.5)
    return job


def _worker_pids(served: Served) -> list[int]:
    """This deployment's shard workers running a shard (others' tests may run workers on the same machine):
    a worker of the engine pool waiting for its next shard, with its engine, runs none."""
    found = []
    for pid in _descendants(served.process.pid):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"batch_pipeline.worker" in arguments:
            pool = arguments[arguments.index(b"--pool") + 1].decode() if b"--pool" in arguments else None
            if pool is None or not Path(pool, POOL_IDLE).exists():
                found.append(pid)
    return found


def _checkpointed(work_dir: Path) -> dict[int, dict]:
    """The results the job's shard checkpoints hold, by index (whole lines only)."""
    held = {}
    for results in sorted(work_dir.glob("shards/*/results.tsv")):
        for line in results.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                index, _, payload = line.partition("\t")
                held[int(index)] = json.loads(payload)
    return held


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One deployment for the module's jobs: each starts engines enough of its own."""
    server = Served(tmp_path_factory.mktemp("served"))
    try:
        server.wait_until_up()
        yield server
    finally:
        server.kill()


def _cancel_and_wait(served: Served, job_id: str) -> dict:
    """Cancel a running job; the job once its partial output is written and its workers are gone."""
    cancel = httpx.post(f"{served.api}/v2/batch-completions/{job_id}/actions/cancel", timeout=30)
    assert cancel.json() == {"success": True}
    cancelled = _wait_for(served, job_id, lambda j: "num_finished" in j["metadata"], 300)
    assert cancelled["status"] == "cancelled"
    deadline = time.monotonic() + 120
    while _worker_pids(served):
        assert time.monotonic() < deadline, "shard workers still running after cancel"
        time.sleep(0.5)
    return cancelled


def test_a_job_cancelled_halfway_then_resumed_completes_with_every_result_once_generating_only_the_rest(
    served, tmp_path
):
    output = tmp_path / "output.json"
    content = [
        {"prompt": f"Request {i}: the number after {i} is", "max_tokens": 6, "temperature": 0.0}
        for i in range(REQUESTS)
    ]
    body = {"output_data_path": str(output), "model_config": {"model": MODEL}, "content": content}
    job_id = httpx.post(f"{served.api}/v2/batch-completions", json=body, timeout=60).json()["job_id"]

    _wait_for(served, job_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= REQUESTS // 3, 2400)
    first_run = _cancel_and_wait(served, job_id)["metadata"]["dagster_run_id"]
    partial = json.loads(output.read_text())
    assert len(partial) == REQUESTS
    finished_before = {i for i, entry in enumerate(partial) if "error" not in entry}
    held = _checkpointed(served.home / "work" / job_id)
    assert finished_before <= set(held) and 0 < len(held) < REQUESTS, (len(finished_before), len(held))

    resumed = httpx.post(f"{served.api}/v2/batch-completions/{job_id}/actions/resume", timeout=30)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["job"]["status"] == "queued"
    done = _wait_for(served, job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), 1200)
    assert done["status"] == "completed", done

    # Every result exactly once, in input order (an OpenAI object's id ends with its request's index).
    outputs = json.loads(output.read_text())
    assert len(outputs) == REQUESTS
    assert [entry["id"].rpartition("-")[2] for entry in outputs] == [str(i) for i in range(REQUESTS)]
    assert all("error" not in entry and entry["choices"][0]["text"] for entry in outputs)
    # Those the checkpoints held are kept as they were (a generated one would be created anew).
    assert all(outputs[index] == result for index, result in held.items())
    assert all(outputs[index] == partial[index] for index in finished_before)

    metadata = done["metadata"]
    assert metadata["resumed_from"] == "cancelled" and metadata["resumed_from_run_id"] == first_run
    assert metadata["dagster_run_id"] != first_run
    unfinished = set(range(REQUESTS)) - set(held)
    tokens_of = {i: entry["usage"]["completion_tokens"] for i, entry in enumerate(outputs)}
    assert metadata["resume_requests_kept"] == str(len(held))
    assert metadata["resume_requests_generated"] == str(len(unfinished))
    assert metadata["resume_completion_tokens_kept"] == str(sum(tokens_of[i] for i in held))
    assert metadata["resume_completion_tokens_generated"] == str(sum(tokens_of[i] for i in unfinished))
    assert metadata["completion_tokens"] == str(sum(tokens_of.values()))
    # The workers' own counts agree: they generated the unfinished requests alone.
    written = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert sum(shard["generated"] for shard in written["shards"]) == len(unfinished)
    assert sum(shard["resumed"] for shard in written["shards"]) == len(held)
    assert written["resume_requests_generated"] == len(unfinished)

    again = httpx.post(f"{served.api}/v2/batch-completions/{job_id}/actions/resume", timeout=30)
    assert again.status_code == 409 and "the job is completed" in again.json()["detail"]


def _completion(prompt: str, tokens: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0}


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def _texts(entries: list[dict]) -> list[str]:
    return [entry["choices"][0]["text"] for entry in entries]


def test_a_job_resumed_after_its_input_file_changed_answers_each_request_as_the_file_reads_now(served, tmp_path):
    """Found by an attacker's pass (issue 44): a job resumed after its input file changed kept the old
    prompts' answers under the new prompts ("Paris." for "Two plus two equals"). Each answer now is its own
    request's: the changed ones generated again (as a fresh job answers them), the unchanged ones kept."""
    input_path, output = tmp_path / "prompts.jsonl", tmp_path / "output.json"
    # Five short requests (one a repeat, answered as a copy of its source) and one long enough to be
    # running still when the job is cancelled: it makes no result.
    long_one = {**_completion("Tell me a very long story about a robot.", 4000), "min_tokens": 4000}
    before = ["The capital of France is", "The capital of Italy is", "The capital of Italy is", "The largest ocean is"]
    before += ["Water is made of"]
    _write_jsonl(input_path, [_completion(prompt) for prompt in before] + [long_one])
    body = {"input_data_path": str(input_path), "output_data_path": str(output), "model_config": {"model": MODEL}}
    job_id = httpx.post(f"{served.api}/v2/batch-completions", json=body, timeout=60).json()["job_id"]
    _wait_for(served, job_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= len(before), 900)
    _cancel_and_wait(served, job_id)
    held = _checkpointed(served.home / "work" / job_id)
    assert set(held) == set(range(len(before))), sorted(held)

    # The file rewritten before the resume: 1 (the repeat's source) now asks something else, 3 repeats 0,
    # the long one is a short one, and one more is added. 0, 2 and 4 are as they were.
    after = ["The capital of France is", "Two plus two equals", "The capital of Italy is", "The capital of France is"]
    after += ["Water is made of", "The sun rises in the", "The color of the sky is"]
    _write_jsonl(input_path, [_completion(prompt) for prompt in after])
    resumed = httpx.post(f"{served.api}/v2/batch-completions/{job_id}/actions/resume", timeout=30)
    assert resumed.status_code == 200, resumed.text
    done = _wait_for(served, job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), 900)
    assert done["status"] == "completed", done
    outputs = json.loads(output.read_text())

    fresh_output = tmp_path / "fresh.json"
    fresh_body = {**body, "output_data_path": str(fresh_output)}
    fresh_id = httpx.post(f"{served.api}/v2/batch-completions", json=fresh_body, timeout=60).json()["job_id"]
    assert _wait_for(served, fresh_id, lambda j: j["status"] in ("completed", "failed"), 900)["status"] == "completed"
    fresh = json.loads(fresh_output.read_text())

    # Every entry answers the request at its index as the file reads now: the greedy answer a fresh job gives.
    assert len(outputs) == len(after) and _texts(outputs) == _texts(fresh)
    prompt_tokens = [[entry["usage"]["prompt_tokens"] for entry in entries] for entries in (outputs, fresh)]
    assert prompt_tokens[0] == prompt_tokens[1]
    # The unchanged ones are the results the checkpoints held, not generated again (a generated one is new).
    unchanged = [0, 2, 4]
    assert all(outputs[index] == held[index] for index in unchanged)
    assert all(outputs[index] != held[index] for index in (1, 3))
    metadata = done["metadata"]
    assert metadata["resume_requests_kept"] == str(len(unchanged))
    assert metadata["resume_requests_generated"] == str(len(after) - len(unchanged))
    written = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert sum(shard["resumed"] for shard in written["shards"]) == len(unchanged)
    # 1, 5 and 6 are generated; 3 takes 0's kept answer as a copy.
    assert sum(shard["generated"] for shard in written["shards"]) == 3
