"""Each team's own bounds from the tenants file (a queue quota answered 429 with nothing stored, a priority
cap read as the cap), and run slots shared out by fair share between teams."""

import hashlib
import json
import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from batch_pipeline.pipeline.tags import run_tags
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.tenancy.fair_share import TeamShare, WaitingJob, admit, decayed_slot_seconds
from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError
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


def _body(output, **fields) -> dict:
    return {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        **fields,
    }


def _submit(api, key: str, output, idempotency_key: str | None = None, **fields):
    headers = {"x-api-key": key} | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    return api.post("/v2/batch-completions", json=_body(output, **fields), headers=headers)


def _listed(api, key: str) -> list[str]:
    return [job["job_id"] for job in api.get("/v2/batch-completions", headers={"x-api-key": key}).json()["jobs"]]


def test_a_team_past_its_queue_quota_gets_429_and_nothing_is_stored(api, teams, tmp_path):
    first = _submit(api, BOUNDED, teams["bounded"] / "1.json")
    second = _submit(api, BOUNDED, teams["bounded"] / "2.json", idempotency_key="second")
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
    retried = _submit(api, BOUNDED, teams["bounded"] / "2.json", idempotency_key="second")
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


# --- admission by fair share -------------------------------------------------------------------------


def _waiting(owner: str, count: int, priority: int = 0, start: int = 0) -> list[WaitingJob]:
    base = datetime(2026, 12, 1, tzinfo=UTC)
    return [WaitingJob(f"{owner}-{i}", owner, priority, base + timedelta(seconds=start + i)) for i in range(count)]


def test_a_team_below_its_share_takes_the_next_slot_however_many_highest_jobs_another_queued():
    waiting = _waiting("a", 6, priority=20) + _waiting("b", 1, start=100)
    teams = {"a": TeamShare(usage=120.0, running=2), "b": TeamShare()}
    assert [chosen.job.job_id for chosen in admit(waiting, teams, slots=1)] == ["b-0"]


def test_a_lone_team_fills_every_slot_in_its_priority_order_then_age():
    waiting = _waiting("a", 3) + [WaitingJob("a-urgent", "a", 20, datetime(2026, 12, 2, tzinfo=UTC))]
    chosen = [chosen.job.job_id for chosen in admit(waiting, {"a": TeamShare(usage=1e9)}, slots=3)]
    assert chosen == ["a-urgent", "a-0", "a-1"]
    assert len(admit(waiting, {}, slots=None)) == 4  # no slot limit: every job at once


def test_free_slots_alternate_between_teams_of_equal_standing_and_weights_tilt_the_usage():
    waiting = _waiting("a", 4) + _waiting("b", 4, start=10)
    assert [c.job.owner for c in admit(waiting, {}, slots=4)] == ["a", "b", "a", "b"]
    # b has used twice a's slot-seconds, with twice the weight: they stand level, so running jobs decide.
    teams = {"a": TeamShare(usage=100.0, weight=1), "b": TeamShare(usage=200.0, weight=2, running=1)}
    assert [c.job.owner for c in admit(waiting, teams, slots=3)] == ["a", "b", "a"]


def test_a_team_at_its_max_running_jobs_waits_and_leaves_the_slot_to_others():
    waiting = _waiting("a", 3) + _waiting("b", 1, start=10)
    teams = {"a": TeamShare(max_running_jobs=1, running=1), "b": TeamShare(usage=5e6)}
    assert [c.job.job_id for c in admit(waiting, teams, slots=3)] == ["b-0"]


def test_usage_decays_with_the_half_life():
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    hour = timedelta(hours=1)
    recent = decayed_slot_seconds(now - timedelta(seconds=10), now, units=2, now=now, half_life_s=3600)
    assert recent == pytest.approx(20, rel=0.01)  # 10 s on 2 GPUs, all but new
    old = decayed_slot_seconds(now - hour - timedelta(seconds=10), now - hour, units=2, now=now, half_life_s=3600)
    assert old == pytest.approx(10, rel=0.01)  # the same an hour ago: half
    running = decayed_slot_seconds(now - timedelta(seconds=10), None, units=1, now=now, half_life_s=3600)
    assert running == pytest.approx(10, rel=0.01)  # a running job counts up to now


@pytest.mark.slow
def test_through_serve_a_second_teams_job_starts_at_the_first_free_slot_and_a_lone_team_fills_both(
    teams, tmp_path, monkeypatch
):
    """Two run slots. Team bounded queues four jobs at `highest` (read as its cap, high) and fills both
    slots alone; team free's one job, sent after them, starts at the first slots that free, before the
    bounded team's last job."""
    import httpx

    from tests.test_serve import Served

    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
    served = Served(
        tmp_path,
        env={"BATCH_PIPELINE_TENANTS": os.environ["BATCH_PIPELINE_TENANTS"]},
        max_concurrent_runs=2,
    )
    try:
        served.wait_until_up()

        def submit(key: str, output, **fields) -> str:
            response = httpx.post(
                f"{served.api}/v2/batch-completions",
                json=_body(output, **fields),
                headers={"x-api-key": key},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            return response.json()["job_id"]

        def job(key: str, job_id: str) -> dict:
            url = f"{served.api}/v2/batch-completions/{job_id}"
            return httpx.get(url, headers={"x-api-key": key}, timeout=30).json()["job"]

        store = JobStore(f"sqlite:///{served.home}/batch_jobs.db")  # when each job started: not on the wire
        # max_queued_jobs is 2 for the bounded team: two now, two more once those have started.
        bounded = [submit(BOUNDED, teams["bounded"] / f"{i}.json", priority="highest") for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(job(BOUNDED, job_id)["status"] != "queued" for job_id in bounded):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(0.5)
        bounded += [submit(BOUNDED, teams["bounded"] / f"{i}.json", priority="highest") for i in range(2, 4)]
        waiting = job(BOUNDED, bounded[2])
        assert waiting["status"] == "queued" and "fair share" in waiting["metadata"]["waiting_for"]
        other = submit(FREE, teams["free"] / "0.json")

        def finished(key: str, job_id: str) -> dict:
            while (found := job(key, job_id))["status"] in ("queued", "running"):
                assert time.monotonic() < deadline + 300, served.log.read_text()[-3000:]
                time.sleep(0.5)
            assert found["status"] == "completed", found
            return found

        for job_id in bounded:
            finished(BOUNDED, job_id)
        finished(FREE, other)
        rows = {job_id: store.get(job_id) for job_id in [*bounded, other]}
        started = sorted(rows, key=lambda job_id: rows[job_id].started_at)
        assert set(started[:2]) == set(bounded[:2])  # the lone team took both slots
        a, b = (rows[job_id] for job_id in bounded[:2])
        assert a.started_at < b.completed_at and b.started_at < a.completed_at  # at once
        # The other team's job takes one of the first slots to free, ahead of the bounded team's last job; by
        # priority alone it would run last. (When both slots free in one tick, both get runs at once, and
        # Dagster's queue starts the higher priority a moment first: so third or fourth.)
        assert started.index(other) in (2, 3) and started.index(other) < started.index(bounded[3]), started
    finally:
        served.kill()
