"""Jobs through their whole life over the API: the real daemon launches runs, real vLLM generates."""

import json
import shutil
import time
from datetime import datetime
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.pipeline.tags import DEADLINE_TAG, JOB_ID_TAG, LABEL_TAG_PREFIX, MODEL_TAG, RUN_MONITORING_GRACE_S
from tests.api_fixtures import USER_KEY
from tests.conftest import MODEL, worker_pids

pytestmark = pytest.mark.slow
ALICE = {"x-api-key": USER_KEY}


def _submit_staggered(api, tmp_path, name: str, groups: int, step: int, **fields) -> tuple[str, Path]:
    """A job from an input file of `groups` x 16 prompts whose lengths differ by `step` tokens per group,
    so some requests finish long before others. Returns the job id and the output path."""
    contents = [
        {
            "prompts": [f"{name} {k}.{i}: once upon a time" for i in range(16)],
            "max_new_tokens": 4 + step * k,
            "temperature": 0.0,
        }
        for k in range(groups)
    ]
    input_path = tmp_path / "input.json"
    input_path.write_text(json.dumps(contents))
    output = tmp_path / "output.json"
    body = {"input_data_path": str(input_path), "output_data_path": str(output), "model_config": {"model": MODEL}}
    job_id = api.client.post("/v2/batch-completions", json={**body, **fields}, headers=ALICE).json()["job_id"]
    return job_id, output


def _wait_for_file(path: Path, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.5)
    return json.loads(path.read_text())


def test_v1_and_v2_jobs_run_to_completed_with_their_results(deployment_factory, tmp_path):
    api = deployment_factory(max_concurrent_runs=2)
    api.start_daemon()
    content = {"prompts": ["The capital of France is", "1, 2, 3, 4,"], "max_new_tokens": 8, "temperature": 0.0}
    v1_out, v2_out = tmp_path / "v1.json", tmp_path / "v2.json"
    v1_id = api.client.post(
        "/v1/llm/batch-completions",
        json={
            "output_data_path": str(v1_out),
            "model_config": {"model": MODEL},
            "content": content,
            "labels": {"team": "search"},
            "priority": "high",
        },
        headers=ALICE,
    ).json()["job_id"]
    v2_id = api.client.post(
        "/v2/batch-completions",
        json={"output_data_path": str(v2_out), "model_config": {"model": MODEL}, "content": content},
        headers=ALICE,
    ).json()["job_id"]

    for job_id, output in ((v1_id, v1_out), (v2_id, v2_out)):
        job = api.wait_for(job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), timeout=400)
        assert job["status"] == "completed", job
        assert job["completed_at"] and job["completed_at"] >= job["created_at"]
        metadata = job["metadata"]
        assert metadata["requests_done"] == metadata["requests_total"] == metadata["num_requests"] == "2"
        assert int(metadata["completion_tokens"]) > 0 and metadata["num_errors"] == "0"
        assert all(isinstance(value, str) for value in metadata.values())
        outputs = json.loads(output.read_text())
        assert [o["num_completion_tokens"] > 0 for o in outputs] == [True, True]

    # Status is data in the job's row: with the job's files gone, a read still says what the job did.
    before = api.job(v1_id)
    Path(str(v1_out) + ".metadata.json").unlink()
    shutil.rmtree(api.home / "work" / v1_id)
    assert api.job(v1_id) == before

    run = api.instance.get_run_by_id(api.job(v1_id)["metadata"]["dagster_run_id"])
    assert run.tags[JOB_ID_TAG] == v1_id
    assert run.tags[MODEL_TAG] == MODEL
    assert run.tags[LABEL_TAG_PREFIX + "team"] == "search"
    assert run.tags["dagster/priority"] == "10"
    # Every run of the job stops at its expires_at; run monitoring's limit, set when the run starts, ends there too.
    expires_at = datetime.fromisoformat(api.job(v1_id)["expires_at"]).timestamp()
    assert float(run.tags[DEADLINE_TAG]) == expires_at
    started = api.instance.get_run_record_by_id(run.run_id).start_time
    assert abs(started + int(run.tags["dagster/max_runtime"]) - RUN_MONITORING_GRACE_S - expires_at) <= 1.5
    # A finished job can no longer be reprioritised or cancelled.
    update = api.client.post(f"/v2/batch-completions/{v1_id}", json={"job_id": v1_id, "priority": "low"}, headers=ALICE)
    assert update.json()["success"] is False
    ended = api.client.post(f"/v2/batch-completions/{v1_id}/actions/cancel", headers=ALICE).json()
    assert ended == {
        "success": False,
        "reason": "the job has ended (completed): there is nothing to cancel; its output is final",
    }


def test_cancelling_a_running_job_stops_its_workers_and_keeps_finished_results(deployment_factory, tmp_path):
    api = deployment_factory(max_concurrent_runs=1)
    api.start_daemon()
    job_id, output = _submit_staggered(api, tmp_path, "Story", groups=3, step=120)

    running = api.wait_for(job_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= 8, timeout=400)
    assert running["status"] == "running"
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE).json() == {"success": True}
    cancelled = api.wait_for(job_id, lambda j: j["status"] == "cancelled" and j["completed_at"], timeout=120)
    assert cancelled["status"] == "cancelled"

    outputs = _wait_for_file(output)
    assert len(outputs) == 48
    finished = [o for o in outputs if "text" in o]
    unfinished = [o for o in outputs if "error" in o]
    assert len(finished) >= 8 and unfinished
    assert {o["error"]["code"] for o in unfinished} == {"cancelled"}
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert metadata["status"] == "cancelled" and metadata["num_finished"] == len(finished)
    # Merged by a run of keep_partial_results (visible in the UI), whose counts the job reads.
    kept = api.wait_for(job_id, lambda j: "num_finished" in j["metadata"], timeout=60)["metadata"]
    assert (kept["num_finished"], kept["num_requests"]) == (str(len(finished)), "48")
    (merge_run,) = api.instance.get_runs(filters=dg.RunsFilter(job_name="keep_partial_results"))
    assert api.finished_run(merge_run.run_id).status == dg.DagsterRunStatus.SUCCESS
    deadline = time.monotonic() + 60
    while worker_pids():
        assert time.monotonic() < deadline, "shard workers still running after cancel"
        time.sleep(0.5)


def test_a_job_past_max_runtime_sec_stops_fails_with_the_reason_and_keeps_finished_results(
    deployment_factory, tmp_path
):
    api = deployment_factory(max_concurrent_runs=1)
    api.start_daemon()
    # 16 requests done in a few tokens, 16 that would need ~50k tokens (minutes here): the deadline falls
    # between them however slow the engine start is.
    short = [{"prompt": f"Short {i}:", "max_tokens": 2, "temperature": 0.0} for i in range(16)]
    long = [{"prompt": f"Long {i}:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0.0} for i in range(16)]
    output = tmp_path / "output.json"
    job_id = api.client.post(
        "/v2/batch-completions",
        json={
            "content": short + long,
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "max_runtime_sec": 75,
        },
        headers=ALICE,
    ).json()["job_id"]

    job = api.wait_for(job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), timeout=300)
    assert job["status"] == "failed"
    reason = job["metadata"]["failure_reason"]
    assert "max_runtime_sec exceeded" in reason or "maximum runtime" in reason, reason
    outputs = _wait_for_file(output)
    assert len(outputs) == 32
    assert all("choices" in o for o in outputs[:16])  # finished before the deadline: kept
    assert {o["error"]["code"] for o in outputs[16:]} == {"job_failed"}
    assert not worker_pids()


def test_raising_a_queued_jobs_priority_lets_it_start_first(deployment_factory, tmp_path):
    api = deployment_factory(max_concurrent_runs=1)
    api.start_daemon()

    def submit(name, priority=None, max_new_tokens=4):
        body = {
            "output_data_path": str(tmp_path / f"{name}.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": [f"{name}: once upon a time"], "max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        if priority:
            body["priority"] = priority
        return api.client.post("/v2/batch-completions", json=body, headers=ALICE).json()["job_id"]

    blocker = submit("blocker", max_new_tokens=64)
    api.wait_for(blocker, lambda j: j["status"] == "running", timeout=120)
    late_but_urgent = submit("late", priority="low")
    default = submit("default")
    for job_id in (late_but_urgent, default):  # both have queued runs behind the blocker
        api.wait_for(job_id, lambda j: "dagster_run_id" in j["metadata"] and j["status"] == "queued", timeout=60)

    response = api.client.post(
        f"/v2/batch-completions/{late_but_urgent}", json={"job_id": late_but_urgent, "priority": "high"}, headers=ALICE
    )
    assert response.json()["success"] is True
    api.wait_for(late_but_urgent, lambda j: j["status"] in ("running", "completed"), timeout=300)
    assert api.job(default)["status"] == "queued"
    for job_id in (blocker, late_but_urgent, default):
        api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE)
