"""Each team's own bounds from the tenants file: a queue quota answered 429 with nothing stored, and a
priority cap read as the cap, on the API and on the runs the jobs become."""

import hashlib
import json

import pytest

from batch_pipeline.jobs_store import JobStore
from batch_pipeline.pipeline.tags import run_tags
from batch_pipeline.tenants import Tenants, TenantsFileError
from tests.conftest import MODEL
from tests.test_openai_batch import _create, _jsonl, _line, _upload

BOUNDED, FREE = "key-of-the-bounded-team", "key-of-the-free-team"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def teams(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("bounded", "free")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  bounded:\n"
        f"    api_keys_sha256: [{_digest(BOUNDED)}]\n"
        f"    data_roots: [{roots['bounded']}]\n"
        "    max_queued_jobs: 2\n"
        "    max_priority: high\n"
        "    weight: 2\n"
        "  free:\n"
        f"    api_keys_sha256: [{_digest(FREE)}]\n"
        f"    data_roots: [{roots['free']}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _submit(api, key: str, output, **fields):
    body = {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        **fields,
    }
    return api.post("/v2/batch-completions", json=body, headers={"x-api-key": key, **fields.pop("headers", {})})


def _listed(api, key: str) -> list[str]:
    return [job["job_id"] for job in api.get("/v2/batch-completions", headers={"x-api-key": key}).json()["jobs"]]


def test_a_team_past_its_queue_quota_gets_429_and_nothing_is_stored(api, teams, tmp_path):
    first = _submit(api, BOUNDED, teams["bounded"] / "1.json")
    second = api.post(
        "/v2/batch-completions",
        json={
            "output_data_path": str(teams["bounded"] / "2.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        },
        headers={"x-api-key": BOUNDED, "Idempotency-Key": "second"},
    )
    assert first.status_code == second.status_code == 200
    work = tmp_path / "dagster_home" / "work"
    stored = sorted(path.name for path in work.iterdir())

    refused = _submit(api, BOUNDED, teams["bounded"] / "3.json")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"
    detail = refused.json()["detail"]
    assert detail.startswith("max_queued_jobs:") and "2 jobs waiting to start" in detail and "quota of 2" in detail
    assert sorted(_listed(api, BOUNDED)) == sorted([first.json()["job_id"], second.json()["job_id"]])
    assert sorted(path.name for path in work.iterdir()) == stored  # no content file for the refused job

    # A retry of a submission that made its job is answered with that job, not refused.
    retried = api.post(
        "/v2/batch-completions",
        json={
            "output_data_path": str(teams["bounded"] / "2.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        },
        headers={"x-api-key": BOUNDED, "Idempotency-Key": "second"},
    )
    assert retried.status_code == 200 and retried.json()["job_id"] == second.json()["job_id"]
    # Another team's queue is its own.
    assert _submit(api, FREE, teams["free"] / "1.json").status_code == 200
    # Once a job of the team starts, the team may queue one more.
    JobStore().mark_started(first.json()["job_id"], "run-1", None)
    assert _submit(api, BOUNDED, teams["bounded"] / "3.json").status_code == 200


def test_an_openai_batch_past_the_queue_quota_gets_openais_429_and_no_batch(api, teams):
    bearer = {"Authorization": f"Bearer {BOUNDED}"}
    for name in ("1.json", "2.json"):
        assert _submit(api, BOUNDED, teams["bounded"] / name).status_code == 200
    uploaded = _upload(api, _jsonl([_line("a")]), key=BOUNDED)
    assert uploaded.status_code == 200, uploaded.text
    refused = _create(api, uploaded.json()["id"], key=BOUNDED)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"].startswith("max_queued_jobs:")
    assert refused.headers["retry-after"] == "30"
    assert api.get("/v1/batches", headers=bearer).json()["data"] == []
    assert len(_listed(api, BOUNDED)) == 2


def test_a_priority_above_the_teams_cap_is_read_as_the_cap_and_says_so(api, teams):
    asked = _submit(api, BOUNDED, teams["bounded"] / "1.json", priority="highest").json()
    job = api.get(f"/v2/batch-completions/{asked['job_id']}", headers={"x-api-key": BOUNDED}).json()["job"]
    assert job["metadata"]["priority_read_as"] == "10 (your team's max_priority; asked 20 (highest))"
    record = JobStore().get(asked["job_id"])
    assert run_tags(record)["dagster/priority"] == "10"  # the run the jobs sensor makes of it
    # Within the cap, and for a team without one, the priority is as asked.
    within = _submit(api, BOUNDED, teams["bounded"] / "2.json", priority="low").json()
    assert run_tags(JobStore().get(within["job_id"]))["dagster/priority"] == "-10"
    free = _submit(api, FREE, teams["free"] / "1.json", priority="highest").json()
    assert run_tags(JobStore().get(free["job_id"]))["dagster/priority"] == "20"
    # Raising a queued job's priority is capped the same way.
    raised = api.post(
        f"/v2/batch-completions/{within['job_id']}",
        json={"job_id": within["job_id"], "priority": "99"},
        headers={"x-api-key": BOUNDED},
    ).json()
    assert raised["success"] is True
    assert raised["metadata"]["priority_read_as"].startswith("10 (your team's max_priority")


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("weight: 0", "line 3: tenants.t.weight"),
        ("max_priority: superhigh", "line 3: tenants.t.max_priority"),
        ("max_queued_jobs: -1", "line 3: tenants.t.max_queued_jobs"),
        ("max_running_jobs: 0", "line 3: tenants.t.max_running_jobs"),
        ("max_tokens_per_dai: 5", "line 3: tenants.t.max_tokens_per_dai"),
    ],
)
def test_a_teams_bound_that_cannot_be_is_named_with_its_line(tmp_path, setting, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  t:\n    {setting}\n")
    with pytest.raises(TenantsFileError, match=f"^{path}:{named}"):
        Tenants.load(str(path))


def test_every_bound_of_a_team_is_read(tmp_path):
    path = tmp_path / "tenants.yaml"
    bounds = {
        "weight": 2.5,
        "max_running_jobs": 3,
        "max_queued_jobs": 10,
        "max_priority": 5,
        "max_stored_bytes": 2**30,
        "max_tokens_per_day": 10**7,
    }
    path.write_text(json.dumps({"tenants": {"t": bounds}}))  # JSON is YAML too
    config = Tenants.load(str(path)).teams["t"].config
    assert {name: getattr(config, name) for name in bounds} == bounds
    assert config.priority_cap == 5
