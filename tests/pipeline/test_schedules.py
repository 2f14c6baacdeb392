"""Scheduled recurring batches: the schedules file is checked at load (file, line and field named), each
tick stores one job through the job store and asks for one run, and a schedule fires under the real
daemon into a job that completes."""

import json
import textwrap
from datetime import UTC, datetime

import dagster as dg
import pytest

from batch_pipeline.admission.paths import PathPolicy
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource
from batch_pipeline.pipeline.schedules import ScheduleFileError, load_schedule_specs, schedule_for
from batch_pipeline.pipeline.sensors import batch_jobs_sensor
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LABEL_TAG_PREFIX
from batch_pipeline.store.jobs import JobStore
from tests.api_fixtures import ADMIN_KEY, sensor_resources
from tests.conftest import MODEL

VALID = (
    """\
schedules:
  - name: nightly
    cron: "0 2 * * *"
    timezone: Europe/Paris
    request:
      output_data_path: {out}/{{date}}/out.json
      model_config: {{model: %s}}
      content: {{prompts: ["The capital of France is"], max_new_tokens: 4, temperature: 0.0}}
"""
    % MODEL
)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "schedules.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize(
    ("replace", "by", "line", "message"),
    [
        ('"0 2 * * *"', '"0 25 * * *"', 3, "schedules.0.cron: Value error, not a valid cron string"),
        ("Europe/Paris", "Mars/Olympus", 4, "schedules.0.timezone: Value error, unknown timezone 'Mars/Olympus'"),
        ("{date}/out.json", "{week}/out.json", 6, "schedules.0.request.output_data_path: unknown placeholder {week}"),
        ("output_data_path: ", "input_data_path: ", 6, "schedules.0.request.output_data_path: Field required"),
        ("max_new_tokens: 4", "max_new_tokens: -4", 8, "schedules.0.request.content"),
        ("name: nightly", "name: nightly run", 2, "schedules.0.name: String should match pattern"),
        ('cron: "0 2 * * *"', 'cron: "0 2 * * *"\n  bad: [', 4, "not valid YAML"),
    ],
)
def test_an_invalid_schedules_file_fails_at_load_naming_the_line_and_field(tmp_path, replace, by, line, message):
    path = _write(tmp_path, VALID.format(out=tmp_path).replace(replace, by))
    with pytest.raises(ScheduleFileError) as error:
        load_schedule_specs(path)
    assert str(error.value).startswith(f"{path}:{line}: {message}"), str(error.value)


def test_a_name_used_twice_is_refused(tmp_path):
    text = VALID.format(out=tmp_path)
    path = _write(tmp_path, text + text.split("\n", 1)[1])
    with pytest.raises(ScheduleFileError, match=r":9: schedules.1.name: 'nightly' is used twice"):
        load_schedule_specs(path)


def test_each_tick_stores_one_job_and_asks_for_one_run_which_the_jobs_sensor_leaves_to_it(tmp_path):
    (spec,) = load_schedule_specs(_write(tmp_path, VALID.format(out=tmp_path)))
    schedule = schedule_for(spec)
    url = f"sqlite:///{tmp_path}/jobs.db"
    tick = datetime(2026, 11, 28, 1, 0, tzinfo=UTC)  # 02:00 in Paris

    with dg.instance_for_test() as instance:

        def evaluate(at: datetime) -> dg.RunRequest:
            context = dg.build_schedule_context(
                instance=instance,
                scheduled_execution_time=at,
                resources={
                    "job_store": JobStoreResource(url=url),
                    "job_storage": JobStorage(work_dir_base=str(tmp_path / "work")),
                    "admission": AdmissionPolicy(
                        paths=PathPolicy(frozenset({"file"}), ()),
                        tenants_file="",
                        allow_remote_code=False,
                        hardware_maxima={},
                        engine_maxima={},
                    ),
                },
            )
            (request,) = schedule.evaluate_tick(context).run_requests
            return request

        first, again = evaluate(tick), evaluate(tick)
        next_night = evaluate(datetime(2026, 11, 29, 1, 0, tzinfo=UTC))
        sensor_context = dg.build_sensor_context(instance=instance, resources=sensor_resources(url))
        sensor_requests = batch_jobs_sensor(interval_s=1).evaluate_tick(sensor_context).run_requests

    assert first.run_key == again.run_key != next_night.run_key
    jobs = JobStore(url).list().jobs
    assert sorted(job.job_id for job in jobs) == sorted({first.run_key, next_night.run_key})
    job = JobStore(url).get(first.run_key)
    assert job.request["output_data_path"] == f"{tmp_path}/2026-11-28/out.json"
    assert job.labels == {"schedule": "nightly"}
    assert first.tags[JOB_ID_TAG] == job.job_id and first.tags[LABEL_TAG_PREFIX + "schedule"] == "nightly"
    assert first.run_config["ops"]["validate_input"]["config"]["output_data_path"] == job.request["output_data_path"]
    assert sensor_requests == []


@pytest.mark.slow
def test_a_schedule_fires_under_the_real_daemon_into_a_job_that_completes(deployment_factory, tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        VALID.format(out=tmp_path)
        .replace('"0 2 * * *"', '"* * * * *"')
        .replace("timezone: Europe/Paris", "timezone: UTC\n    status: running"),
    )
    monkeypatch.setenv("BATCH_PIPELINE_SCHEDULES", path)
    api = deployment_factory()
    api.start_daemon()
    admin = {"x-api-key": ADMIN_KEY}
    deadline = datetime.now(UTC).timestamp() + 150  # the next minute, then the run
    jobs = []
    while not jobs:
        assert datetime.now(UTC).timestamp() < deadline, (api.home / "daemon.log").read_text()[-3000:]
        jobs = api.client.get("/v2/batch-completions", params={"label": "schedule:nightly"}, headers=admin).json()[
            "jobs"
        ]
    job = api.wait_for(jobs[0]["job_id"], lambda j: j["status"] in ("completed", "failed"), timeout=300, key=ADMIN_KEY)
    assert job["status"] == "completed", job
    day = datetime.fromisoformat(job["created_at"]).strftime("%Y-%m-%d")
    assert job["output_data_path"] == f"{tmp_path}/{day}/out.json"
    assert len(json.loads(open(job["output_data_path"]).read())) == 1
