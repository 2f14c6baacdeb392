"""GET /v2/usage, the team-labelled /metrics figures and the OpenAI batch's `usage`: a team's key sees its own
team's usage per UTC day, an admin key every team's; the figures are the jobs' own."""

import hashlib
import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_pipeline.core.settings import settings
from batch_pipeline.launch.k8s import K8sShardLauncher
from batch_pipeline.launch.local import LocalShardLauncher
from batch_pipeline.pipeline.run_slots import _units_per_shard, team_shares
from batch_pipeline.shards.format import ShardSpec
from batch_pipeline.shards.protocol import ShardTask
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.sharing import SharingStore, SlotUse
from batch_pipeline.tenancy.fair_share import declared_units, shard_units
from batch_pipeline.tenancy.tenants import tenants_at
from tests.api_fixtures import ADMIN_KEY as DEPLOYMENT_ADMIN_KEY
from tests.api_fixtures import USER_KEY
from tests.conftest import MODEL, step_failure_messages
from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

A_KEY, B_KEY, ADMIN_KEY = "key-of-team-a", "key-of-team-b", "key-of-the-admins"


USER = {"x-api-key": USER_KEY}  # a key of the deployment without a tenants file


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def teams(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("team-a", "team-b")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        + "".join(
            f"  {name}:\n    api_keys_sha256: [{_digest(key)}]\n    data_roots: [{roots[name]}]\n"
            for name, key in (("team-a", A_KEY), ("team-b", B_KEY))
        )
        + f"admins:\n  api_keys_sha256: [{_digest(ADMIN_KEY)}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _headers(key: str) -> dict[str, str]:
    return {"x-api-key": key}


def _body(output, prompts=("hi",)) -> dict:
    return {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": list(prompts), "max_new_tokens": 4, "temperature": 0},
    }


def _submit(api, key: str, output, prompts=("hi",)) -> str:
    response = api.post("/v2/batch-completions", json=_body(output, prompts), headers=_headers(key))
    assert response.status_code == 200, response.text
    return response.json()["job_id"]


def _usage(api, key: str, **params) -> dict:
    response = api.get("/v2/usage", params=params, headers=_headers(key))
    assert response.status_code == 200, response.text
    return response.json()


def _ran(store: JobStore, job_id: str, shards: dict[int, dict[str, int]], started: datetime, ended: datetime):
    """What a run records of a job: its start, its shards' figures, its end."""
    store.mark_started(job_id, f"run-{job_id}", started)
    ShardProgressStore(engine=store.engine).record_shards(
        job_id, {index: figures["requests_done"] for index, figures in shards.items()}
    )
    for index, figures in shards.items():
        ShardProgressStore(engine=store.engine).record_shard_progress(job_id, index, figures)
    store.mark_run_ended(job_id, f"run-{job_id}", JobStatus.COMPLETED, ended)


def _summed(jobs: list[dict]) -> dict[str, int]:
    return {
        "requests": sum(int(job["metadata"]["requests_done"]) for job in jobs),
        "completion_tokens": sum(int(job["metadata"]["completion_tokens_generated"]) for job in jobs),
    }


def test_a_team_sees_its_own_usage_per_day_and_an_admin_every_teams(api, teams):
    store = JobStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    now = datetime.now(UTC)
    ended = now - timedelta(minutes=5)
    started = ended - timedelta(seconds=90)
    a_jobs = [_submit(api, A_KEY, teams["team-a"] / f"{i}.json", prompts=["hi"] * (i + 1)) for i in range(2)]
    b_job = _submit(api, B_KEY, teams["team-b"] / "0.json")
    _ran(store, a_jobs[0], {0: {"requests_done": 1, "prompt_tokens": 5, "completion_tokens": 4}}, started, ended)
    _ran(
        store,
        a_jobs[1],
        {
            0: {"requests_done": 1, "prompt_tokens": 6, "completion_tokens": 3},
            1: {"requests_done": 1, "prompt_tokens": 6, "completion_tokens": 2},
        },
        started,
        ended,
    )
    _ran(store, b_job, {0: {"requests_done": 1, "prompt_tokens": 7, "completion_tokens": 1}}, started, ended)
    uploaded = _upload(api, _jsonl([_line("1")]), key=B_KEY)
    assert uploaded.status_code == 200, uploaded.text
    b_file_bytes = uploaded.json()["bytes"]
    a_content = sum(store.get(job_id).content_bytes for job_id in a_jobs)
    assert a_content > 0

    mine = _usage(api, A_KEY)
    assert {row["team"] for row in mine["days"]} == {"team-a"}
    assert [team["team"] for team in mine["teams"]] == ["team-a"]
    total = mine["teams"][0]
    jobs = [api.get(f"/v2/batch-completions/{job_id}", headers=_headers(A_KEY)).json()["job"] for job_id in a_jobs]
    assert (
        {key: total[key] for key in ("requests", "completion_tokens")}
        == _summed(jobs)
        == {
            "requests": 3,
            "completion_tokens": 9,
        }
    )
    assert total["prompt_tokens"] == 17
    assert total["jobs"] == 2
    # 90 s of one shard, and 90 s of two: fair share's slot-seconds (one slot a shard on CPU without `cpus`).
    assert total["gpu_seconds"] == pytest.approx(90 * 1 + 90 * 2, abs=0.01)
    assert total["stored_bytes"] == total["stored_bytes_now"] == a_content
    work_day = ended.date().isoformat()
    assert sum(row["requests"] for row in mine["days"] if row["day"] == work_day) == 3

    everyone = _usage(api, ADMIN_KEY)
    by_team = {team["team"]: team for team in everyone["teams"]}
    assert set(by_team) == {"team-a", "team-b", "admins"}
    assert by_team["team-a"] == total
    assert by_team["team-b"]["requests"] == 1 and by_team["team-b"]["prompt_tokens"] == 7
    assert by_team["team-b"]["stored_bytes_now"] == b_file_bytes + store.get(b_job).content_bytes
    assert by_team["admins"]["jobs"] == 0
    assert {row["team"] for row in everyone["days"]} == {"team-a", "team-b"}
    assert [team["team"] for team in _usage(api, ADMIN_KEY, team="team-b")["teams"]] == ["team-b"]

    # The team's key names another team: refused, and nothing of it said.
    refused = api.get("/v2/usage", params={"team": "team-b"}, headers=_headers(A_KEY))
    assert refused.status_code == 403
    assert "team-b" not in refused.text
    assert [team["team"] for team in _usage(api, A_KEY, team="team-a")["teams"]] == ["team-a"]

    # A range that ends before the work: none of it.
    before = ended - timedelta(days=2)
    earlier = _usage(
        api, A_KEY, since=(before - timedelta(days=10)).date().isoformat(), until=before.date().isoformat()
    )
    assert earlier["days"] == [] and earlier["teams"][0]["requests"] == 0
    assert earlier["teams"][0]["stored_bytes_now"] == a_content  # what it stores now, whatever the range

    # /metrics: the same figures, labelled by team.
    scraped = api.get("/metrics", headers=_headers(ADMIN_KEY))
    assert scraped.status_code == 200
    families = {family.name: family.samples for family in text_string_to_metric_families(scraped.text)}
    tokens = {s.labels["team"]: s.value for s in families["batch_pipeline_team_completion_tokens"]}
    assert tokens == {"team-a": 9, "team-b": 1, "admins": 0, "other": 0}
    requests = {s.labels["team"]: s.value for s in families["batch_pipeline_team_requests_generated"]}
    assert requests["team-a"] == 3
    assert {s.labels["team"]: s.value for s in families["batch_pipeline_team_prompt_tokens"]}["team-a"] == 17
    team_jobs = {(s.labels["team"], s.labels["status"]): s.value for s in families["batch_pipeline_team_jobs"]}
    assert team_jobs == {("team-a", "completed"): 2, ("team-b", "completed"): 1}
    # The figures by model are still there, as before.
    assert {s.labels["model"]: s.value for s in families["batch_pipeline_completion_tokens"]} == {MODEL: 10}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2025-13-01"}, "until"),
        ({"since": "2025-01-01T00:00:00+99:00"}, "since"),
        ({"since": "2025-02-01", "until": "2025-01-01"}, "until"),
        ({"since": "2024-01-01", "until": "2025-01-02"}, "since"),  # 367 days
        # Dates at the ends of the calendar: a day more, or the default's 30 days less, overflowed (500).
        ({"until": "0001-01-01"}, "until"),
        ({"since": "0001-01-01T00:00:00+01:00"}, "since"),
        ({"since": "9999-12-30", "until": "9999-12-31T23:59:59-01:00"}, "until"),
    ],
)
def test_a_bad_range_is_a_422_naming_the_field(api, params, field):
    response = api.get("/v2/usage", params=params, headers=_headers(A_KEY))
    assert response.status_code == 422, response.text
    assert [error["loc"] for error in response.json()["detail"]] == [["query", field]]


def test_dates_and_datetimes_bound_the_range_in_utc(api):
    whole = _usage(api, A_KEY, since="2024-01-01", until="2024-12-31")  # 366 days, both days included
    assert (whole["since"], whole["until"]) == ("2024-01-01T00:00:00Z", "2025-01-01T00:00:00Z")
    instants = _usage(api, A_KEY, since="2024-06-01T12:00:00+02:00", until="2024-06-02T00:00:00Z")
    assert (instants["since"], instants["until"]) == ("2024-06-01T10:00:00Z", "2024-06-02T00:00:00Z")
    default = _usage(api, A_KEY)
    since, until = (datetime.fromisoformat(default[name]) for name in ("since", "until"))
    assert since.time().isoformat() == "00:00:00" and timedelta(days=29) < until - since <= timedelta(days=30)
    assert api.get("/v2/usage").status_code == 401


@pytest.mark.parametrize(
    ("gpus", "cpus"),
    [(None, None), (2, None), (0, 4), (None, "500m"), (None, 1.5), (None, "2"), (None, "x"), (None, "1e400")],
)
def test_a_shard_no_launcher_charged_is_charged_its_request_at_least_one_slot(gpus, cpus):
    request = {name: value for name, value in (("gpus", gpus), ("cpus", cpus)) if value is not None}
    use = SlotUse("team:a", datetime.now(UTC), None, 1, json.dumps(request))
    assert declared_units(gpus, cpus) == _units_per_shard(use) == max(1.0, shard_units(gpus, cpus))
    # As Postgres reads them: text.
    assert declared_units(*(None if value is None else str(value) for value in (gpus, cpus))) == _units_per_shard(use)


def _shard_task(shard_count: int, **hardware) -> ShardTask:
    shard = ShardSpec(shard_index=0, directory="/tmp/work/shards/000", item_count=1, prompt_count=1)
    return ShardTask(shard=shard, model_config={"model": "m"}, shard_count=shard_count, hardware=hardware)


def test_a_local_worker_is_charged_the_cores_it_ran_on_never_the_fraction_its_request_declared():
    """Found by an attacker's pass (issue 44): a job declaring `cpus: "1m"` ran as the same job without it,
    on the same cores, and was charged a thousandth of it, so its team won every free slot."""
    launcher = LocalShardLauncher()
    machine = os.cpu_count() or 1
    alone, declared = _shard_task(1), _shard_task(1, cpus="1m")
    assert launcher.shard_charge(declared) == launcher.shard_charge(alone) == machine  # the whole machine
    assert launcher._cpu_share(declared) == launcher._cpu_share(alone) == {}
    # Beside its job's other shards each worker gets its share of the cores, and is charged it.
    side_by_side = _shard_task(machine, cpus="1m")
    assert launcher.shard_charge(side_by_side) == 1
    if machine > 1:
        assert launcher._cpu_share(side_by_side)["OMP_NUM_THREADS"] == "1"
    # More than its share, it gets the whole cores it asks for; more than the machine has, it is refused.
    assert launcher.shard_charge(_shard_task(machine, cpus=machine)) == machine
    assert launcher.shard_charge(_shard_task(machine, cpus=f"{max(1, machine - 1)}500m")) == machine
    with pytest.raises(dg.Failure, match=rf"^cpus: {machine + 1} is more than the {machine} cores"):
        launcher.shard_charge(_shard_task(1, cpus=machine + 1))


def test_a_local_deployment_refuses_more_cpus_than_its_machine_has_naming_the_field(deployment_factory):
    """The local launcher cannot give a worker more cores than the machine has: such a request is a 422 at
    submission, not a job that fails at its launch."""
    api = deployment_factory()
    machine = os.cpu_count() or 1
    body = {
        "output_data_path": "/tmp/local-cores/out.json",
        "model_config": {"model": MODEL},
        "content": {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0},
    }
    refused = api.client.post("/v2/batch-completions", json={**body, "cpus": machine + 1}, headers=USER)
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert error["loc"] == ["body", "cpus"] and f"maximum of {machine}, the cores of the machine" in error["msg"]
    assert api.client.get("/v2/batch-completions", headers=USER).json()["jobs"] == []
    accepted = api.client.post("/v2/batch-completions", json={**body, "cpus": machine}, headers=USER)
    assert accepted.status_code == 200, accepted.text


@pytest.mark.slow
def test_through_the_pipeline_a_job_declaring_a_thousandth_of_a_cpu_is_charged_as_the_same_job_without(
    deployment_factory, tmp_path
):
    """The real job twice (vLLM on this machine's cores), once with `cpus: "1m"`: /v2/usage charges each
    second of each the cores its worker ran on."""
    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.pipeline.execute import execute_request

    api = deployment_factory()
    per_second = {}
    for name, hardware in (("without", {}), ("declared", {"cpus": "1m"})):
        body = {
            "output_data_path": str(tmp_path / name / "out.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": ["hi"], "max_new_tokens": 2, "temperature": 0.0},
            **hardware,
        }
        since = datetime.now(UTC)
        result = execute_request(CreateBatchCompletionsV2Request.model_validate(body), api.instance)
        assert result.success, step_failure_messages(result)
        until = datetime.now(UTC) + timedelta(seconds=1)
        job = api.store.list().jobs[0]  # newest first
        assert job.request.get("cpus") == hardware.get("cpus") and job.status == "completed"
        usage = api.client.get(
            "/v2/usage",
            params={"since": since.isoformat(), "until": until.isoformat()},
            headers={"x-api-key": DEPLOYMENT_ADMIN_KEY},
        ).json()
        charged = sum(team["gpu_seconds"] for team in usage["teams"])
        per_second[name] = charged / (job.completed_at - job.started_at).total_seconds()
    assert per_second["declared"] == pytest.approx(per_second["without"], rel=0.01)
    assert per_second["without"] == pytest.approx(os.cpu_count() or 1, rel=0.01)  # one shard: the whole machine


@pytest.mark.parametrize(
    ("hardware", "charged"),
    [
        ({"gpus": 2}, 2.0),
        ({}, 1.0),
        ({"gpus": 0, "cpus": "500m"}, 0.5),
        ({"gpus": 0, "cpus": 4}, 4.0),
        ({"gpus": 0}, 8.0),  # BATCH_PIPELINE_K8S_DEFAULT_CPUS, the limit its pod gets
    ],
)
def test_a_pod_is_charged_by_its_limits(hardware, charged):
    launcher = K8sShardLauncher(image="i", max_hardware={}, tenants_file="", default_gpus=1)
    task = _shard_task(4, **hardware)
    assert launcher.shard_charge(task) == charged
    limits = launcher.pod_overrides(task)[1]["containers"][0]["resources"]["limits"]
    assert float(limits.get("nvidia.com/gpu", 0)) == (charged if hardware.get("gpus", 1) else 0)


def test_a_resumed_job_is_charged_for_its_runs_not_the_time_it_sat_cancelled(api, teams):
    """Found by a newcomer (issue 46): /v2/usage billed a job resumed 575 s after its cancel for those 575 s
    too (it kept its first start), and fair share counted the same. Both count each run from its start to
    its end; fair share's usage row, counted as the sensor counts it, agrees at every step."""
    store = JobStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    registry = tenants_at(os.environ["BATCH_PIPELINE_TENANTS"])
    job_id = _submit(api, A_KEY, teams["team-a"] / "out.json")
    owner = store.get(job_id).owner
    half_life_s = 1e9  # usage that does not decay in this test: the figures are the seconds themselves

    def fair_share(now: datetime) -> float:
        counted = team_shares(SharingStore(engine=store.engine), registry, now, half_life_s, count=True)[
            owner
        ].usage  # the sensor's tick
        assert team_shares(SharingStore(engine=store.engine), registry, now, half_life_s)[owner].usage == pytest.approx(
            counted, abs=0.01
        )
        return counted

    first = datetime.now(UTC) - timedelta(hours=2)
    store.mark_started(job_id, "run-1", first)
    ShardProgressStore(engine=store.engine).record_shards(job_id, {0: 1})
    store.mark_cancelled(job_id)
    store.mark_run_ended(job_id, "run-1", JobStatus.CANCELLED, first + timedelta(seconds=30))
    assert fair_share(first + timedelta(seconds=40)) == pytest.approx(30, abs=0.01)
    assert store.resume(store.get(job_id), "cancelled", None, 3600)
    second = first + timedelta(seconds=30 + 575)
    assert store.mark_started(job_id, "run-2", second)
    assert store.mark_started(job_id, "run-2", second)  # the same run's start, marked again: nothing changes
    ShardProgressStore(engine=store.engine).record_shards(job_id, {0: 1})
    assert fair_share(second + timedelta(seconds=10)) == pytest.approx(30 + 10, abs=0.01)  # running
    store.mark_run_ended(job_id, "run-2", JobStatus.COMPLETED, second + timedelta(seconds=37))
    assert fair_share(second + timedelta(seconds=60)) == pytest.approx(30 + 37, abs=0.01)

    (total,) = _usage(api, A_KEY)["teams"]
    assert total["gpu_seconds"] == pytest.approx(30 + 37, abs=0.01)  # one shard, one slot: its runs' seconds
    assert store.get(job_id).started_at == first  # the job still says when it first started


def test_a_batch_has_usage_once_its_job_has_tokens(api):
    store = JobStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    uploaded = _upload(api, _jsonl([_line("1"), _line("2")]), key=A_KEY)
    created = _create(api, uploaded.json()["id"], key=A_KEY)
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["usage"] is None
    now = datetime.now(UTC)
    _ran(
        store,
        batch["id"],
        {0: {"requests_done": 2, "prompt_tokens": 11, "completion_tokens": 8}},
        now - timedelta(seconds=3),
        now,
    )
    read = api.get(f"/v1/batches/{batch['id']}", headers={"authorization": f"Bearer {A_KEY}"}).json()
    assert read["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 8,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 19,
    }
    openai = pytest.importorskip("openai")
    parsed = openai.types.Batch.model_validate(read)
    assert parsed.usage is not None and parsed.usage.total_tokens == 19


@pytest.mark.slow
def test_through_serve_usage_equals_the_jobs_own_figures(teams, tmp_path, monkeypatch):
    """Two teams' real jobs (one an OpenAI batch): GET /v2/usage, the batch's `usage` and /metrics' team
    figures are the jobs' own metadata."""
    import httpx

    from tests.entrypoints.test_serve import Served

    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
    served = Served(tmp_path, env={"BATCH_PIPELINE_TENANTS": os.environ["BATCH_PIPELINE_TENANTS"]})
    try:
        served.wait_until_up()
        client = httpx.Client(base_url=served.api, timeout=60)
        created = client.post(
            "/v2/batch-completions", json=_body(teams["team-a"] / "out.json", ["hi", "hello"]), headers=_headers(A_KEY)
        )
        assert created.status_code == 200, created.text
        a_job = created.json()["job_id"]
        bearer = {"authorization": f"Bearer {B_KEY}"}
        uploaded = client.post(
            "/v1/files",
            headers=bearer,
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", _jsonl([_line("1"), _line("2")]), "application/jsonl")},
        )
        assert uploaded.status_code == 200, uploaded.text
        batch = client.post(
            "/v1/batches",
            headers=bearer,
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()

        deadline = time.monotonic() + 600
        while (a := client.get(f"/v2/batch-completions/{a_job}", headers=_headers(A_KEY)).json()["job"])["status"] in (
            "queued",
            "running",
        ):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(1)
        assert a["status"] == "completed", a
        while (b := client.get(f"/v1/batches/{batch['id']}", headers=bearer).json())["status"] not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(1)
        assert b["status"] == "completed", b
        b_job = client.get(f"/v2/batch-completions/{batch['id']}", headers=_headers(B_KEY)).json()["job"]

        for job, key, team in ((a, A_KEY, "team-a"), (b_job, B_KEY, "team-b")):
            metadata = job["metadata"]
            usage = client.get("/v2/usage", headers=_headers(key)).json()
            (total,) = usage["teams"]
            assert total["team"] == team
            assert total["requests"] == int(metadata["requests_done"]) == 2
            assert total["prompt_tokens"] == int(metadata["prompt_tokens"]) > 0
            assert total["completion_tokens"] == int(metadata["completion_tokens_generated"]) > 0
            assert total["jobs"] == 1 and total["gpu_seconds"] > 0
            assert [row["day"] for row in usage["days"]] == [job["completed_at"][:10]]
        assert b["usage"]["input_tokens"] == int(b_job["metadata"]["prompt_tokens"])
        assert b["usage"]["output_tokens"] == int(b_job["metadata"]["completion_tokens_generated"])
        assert b["usage"]["total_tokens"] == b["usage"]["input_tokens"] + b["usage"]["output_tokens"]

        everyone = {team["team"]: team for team in client.get("/v2/usage", headers=_headers(ADMIN_KEY)).json()["teams"]}
        scraped = client.get("/metrics", headers=_headers(ADMIN_KEY)).text
        families = {family.name: family.samples for family in text_string_to_metric_families(scraped)}
        for family, figure in (
            ("batch_pipeline_team_requests_generated", "requests"),
            ("batch_pipeline_team_prompt_tokens", "prompt_tokens"),
            ("batch_pipeline_team_completion_tokens", "completion_tokens"),
        ):
            values = {s.labels["team"]: s.value for s in families[family]}
            assert {team: values[team] for team in ("team-a", "team-b")} == {
                team: everyone[team][figure] for team in ("team-a", "team-b")
            }, family
    finally:
        served.kill()


@pytest.mark.slow  # a whole run of the job: step processes and its shard worker's process
def test_a_jobs_checkpoints_count_in_its_teams_stored_bytes_until_retention_deletes_them(api, teams, monkeypatch):
    """Found by review (issue 28): only a job's inline content counted in its team's stored bytes; the
    checkpoints in its work dir, as large as its output, counted nothing in usage or against
    max_stored_bytes, until retention deleted them."""
    import logging

    import dagster as dg

    from batch_pipeline.admission.submission import StoredRequest
    from batch_pipeline.pipeline.cleanup import clean_up
    from batch_pipeline.pipeline.execute import execute_request
    from batch_pipeline.pipeline.resources import JobStorage

    monkeypatch.setenv("BATCH_PIPELINE_RESULT_CACHE", "1")  # the deployment's default (tests/conftest.py: off)
    store = JobStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    job_id = _submit(api, A_KEY, teams["team-a"] / "out.json", prompts=["one", "two", "three"])
    shard = Path(JobStorage(work_dir_base=settings().work_dir_base).work_dir(job_id)) / "shards" / "000"
    shard.mkdir(parents=True)
    # What the job's first worker left when it was killed after its last result: every result checkpointed.
    results = [{"text": f"result {i}", "num_prompt_tokens": 1, "num_completion_tokens": 4} for i in range(3)]
    (shard / "results.tsv").write_text("".join(f"{i}\t{json.dumps(result)}\n" for i, result in enumerate(results)))
    with dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"]) as instance:
        run = execute_request(StoredRequest.model_validate(store.get(job_id).request), instance, job_id=job_id)
    assert run.success
    record = store.get(job_id)
    held = (shard / "results.tsv").stat().st_size + (shard / "output.tsv").stat().st_size
    assert record.status == JobStatus.COMPLETED and record.checkpoint_bytes == held

    # The job's greedy results are kept in the team's result cache (issue 49): stored bytes too.
    cache = api.get("/v2/result-cache", headers=_headers(A_KEY)).json()
    assert cache["entries"] == 3 and cache["stored_bytes"] > 0
    (team,) = _usage(api, A_KEY)["teams"]
    assert team["stored_bytes"] == record.content_bytes + held
    assert team["stored_bytes_now"] == record.content_bytes + held + cache["stored_bytes"]
    # max_stored_bytes counts them too: the team at its quota now, any more inline content is refused.
    tenants_file = Path(os.environ["BATCH_PIPELINE_TENANTS"])
    quota = record.content_bytes + held + cache["stored_bytes"]
    tenants_file.write_text(
        tenants_file.read_text().replace(
            f"data_roots: [{teams['team-a']}]\n", f"data_roots: [{teams['team-a']}]\n    max_stored_bytes: {quota}\n"
        )
    )
    refused = api.post("/v2/batch-completions", json=_body(teams["team-a"] / "2.json"), headers=_headers(A_KEY))
    assert refused.status_code == 429, refused.text
    assert refused.json()["detail"].startswith(f"max_stored_bytes: your team stores {quota} bytes")

    # Retention deletes the work dir: nothing of it is stored, nothing counts.
    later = datetime.now(UTC) + timedelta(days=31)
    report = clean_up(
        store,
        JobStorage(work_dir_base=settings().work_dir_base, retention_days=30),
        tenants_at(os.environ["BATCH_PIPELINE_TENANTS"]),
        later,
        logging.getLogger(__name__),
    )
    assert report.work_dirs_deleted == [job_id] and not shard.exists()
    assert report.cache_entries_deleted == 3  # past the same retention
    assert store.get(job_id).checkpoint_bytes == 0
    (team,) = _usage(api, A_KEY)["teams"]
    assert team["stored_bytes"] == team["stored_bytes_now"] == 0
