"""A run launched from the launchpad (or `batch-pipeline run`) or by a schedule is owned by the team its config
names, and checked as that team's API submission is; no tag makes a run another team's job. Real Dagster runs
of the real `batch_completions` job, under a tenants file with two teams; every run here stops before a shard
starts an engine (a refusal, or an input without prompts)."""

import json
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import StoredRequest, submit
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.execute import execute_request
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource
from batch_pipeline.pipeline.runs import find_run
from batch_pipeline.pipeline.schedules import ScheduleFileError, load_schedule_specs, schedule_for
from batch_pipeline.pipeline.sensors import batch_jobs_sensor, record_run_end
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LAUNCH_TAG, TEAM_TAG
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.schema import JobStatus
from tests.api_fixtures import sensor_resources
from tests.conftest import MODEL


@pytest.fixture
def teams(tmp_path, monkeypatch, dagster_home):
    """Two teams, each with a data root of its own, in the tenants file the deployment reads."""
    roots = {name: tmp_path / name for name in ("team-a", "team-b")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n" + "".join(f"  {name}:\n    data_roots: [{root}]\n" for name, root in roots.items())
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)  # the store in the test's DAGSTER_HOME
    return roots


def step_failure_messages(result: dg.JobExecutionResult) -> list[str]:
    """Why each failed step failed, as the run's failure reason reads it (the dg.Failure's description)."""
    return [
        event.step_failure_data.user_failure_data.description
        for event in result.all_events
        if event.is_step_failure and event.step_failure_data.user_failure_data
    ]


def _request(input_path: Path, output_path: Path) -> StoredRequest:
    return StoredRequest.model_validate(
        {"input_data_path": str(input_path), "output_data_path": str(output_path), "model_config": {"model": MODEL}}
    )


def _no_prompts(path: Path) -> Path:
    """An input file that holds no prompts: a run that gets past validate_input fails at planning."""
    path.write_text("[]")
    return path


def _prompts(path: Path) -> Path:
    path.write_text(json.dumps([{"prompt": "team B's secret prompt", "max_tokens": 4}]))
    return path


def test_a_launchpad_run_naming_team_a_cannot_read_team_bs_file(teams, dagster_home):
    _prompts(teams["team-b"] / "prompts.json")
    request = _request(teams["team-b"] / "prompts.json", teams["team-a"] / "stolen.json")

    result = execute_request(request, dagster_home, team="team-a")

    assert not result.success
    (message,) = step_failure_messages(result)
    # It names team-a's own root, where the file must lie, and nothing of team-b's.
    own = teams["team-a"].resolve()
    assert message == f"input_data_path: outside your team's data roots (after .. and symlinks); yours are {own}"
    assert JobStore(settings().job_store_url).list().jobs == []  # refused before any job was made
    assert not (teams["team-a"] / "stolen.json").exists()


def test_a_launchpad_run_naming_no_team_fails_naming_team_and_an_unknown_team_likewise(teams, dagster_home):
    request = _request(_no_prompts(teams["team-a"] / "in.json"), teams["team-a"] / "out.json")

    unnamed = execute_request(request, dagster_home)
    unknown = execute_request(request, dagster_home, team="team-c")

    assert not unnamed.success and not unknown.success
    assert step_failure_messages(unnamed)[0].startswith("team: name the team that owns this run")
    assert step_failure_messages(unknown)[0] == "team: no team 'team-c' in the tenants file"
    assert JobStore(settings().job_store_url).list().jobs == []


def test_a_launchpad_run_is_its_teams_job_and_carries_the_team_on_its_tags(teams, dagster_home):
    request = _request(_no_prompts(teams["team-a"] / "in.json"), teams["team-a"] / "out.json")

    result = execute_request(request, dagster_home, team="team-a")

    # Past validate_input (registered as team-a's job), then planning finds no prompts.
    assert step_failure_messages(result) == ["the request holds no prompts: nothing to generate"]
    run = dagster_home.get_run_by_id(result.run_id)
    (job,) = JobStore(settings().job_store_url).list().jobs
    assert job.owner == "team:team-a" and run.tags[JOB_ID_TAG] == job.job_id
    assert run.tags[TEAM_TAG] == "team-a"
    # A re-execution of the run (a retry, or the UI's) is the same job's run.
    again = dg.execute_job(
        dg.reconstructable(_batch_completions_job),
        instance=dagster_home,
        reexecution_options=dg.ReexecutionOptions(parent_run_id=result.run_id),
        raise_on_error=False,
    )
    assert step_failure_messages(again) == ["the request holds no prompts: nothing to generate"]
    assert JobStore(settings().job_store_url).get(job.job_id).run_id == again.run_id


def _batch_completions_job() -> dg.JobDefinition:
    from batch_pipeline.pipeline.definitions import batch_completions_job

    return batch_completions_job()


def test_a_run_tagged_with_team_bs_waiting_job_is_refused_and_leaves_the_job_untouched(teams, dagster_home):
    store = JobStore(settings().job_store_url)
    policy = AdmissionPolicy.of_deployment(settings())
    work_dir = JobStorage(work_dir_base=settings().work_dir_base).work_dir
    b_request = _request(_prompts(teams["team-b"] / "prompts.json"), teams["team-b"] / "out.json")
    b_job, _ = submit(store, work_dir, "team:team-b", b_request, policy)
    # Anyone who can launch a run can tag it: B's job id on a run reading B's prompts into A's root.
    stolen = _request(teams["team-b"] / "prompts.json", teams["team-a"] / "stolen.json")
    config = run_config_for(stolen)
    config["ops"]["validate_input"]["config"]["team"] = "team-a"

    result = dg.execute_job(
        dg.reconstructable(_batch_completions_job),
        instance=dagster_home,
        run_config=config,
        tags={JOB_ID_TAG: b_job.job_id},
        raise_on_error=False,
    )
    # The run-status sensors see a run tagged with B's job end.
    record_run_end(dagster_home, store, dagster_home.get_run_by_id(result.run_id))

    (message,) = step_failure_messages(result)
    assert message.startswith(f"this run is not the run of job {b_job.job_id}"), message
    after = store.get(b_job.job_id)
    assert after.status == JobStatus.QUEUED and after.run_id is None and after.started_at is None
    assert after.failure_reason is None
    assert not Path(work_dir(b_job.job_id)).exists()  # B's request names a file: its job has no work dir yet
    assert not (teams["team-a"] / "stolen.json").exists()
    assert find_run(dagster_home, b_job.job_id) is None  # B's cancel would not stop that run instead of its own
    # The jobs sensor does not take that run for B's job either: it launches B's job's own run.
    context = dg.build_sensor_context(instance=dagster_home, resources=sensor_resources(str(store.engine.url)))
    (launch,) = batch_jobs_sensor(interval_s=1).evaluate_tick(context).run_requests
    assert launch.tags[JOB_ID_TAG] == b_job.job_id and launch.tags[TEAM_TAG] == "team-b"
    assert launch.tags[LAUNCH_TAG]


SCHEDULE = (
    """\
schedules:
  - name: nightly
    cron: "0 2 * * *"
    team: {team}
    request:
      input_data_path: {input}
      output_data_path: {output}/{{date}}.json
      model_config: {{model: %s}}
"""
    % MODEL
)


def _schedules(tmp_path: Path, text: str) -> str:
    path = tmp_path / "schedules.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _tick(spec, store_url: str, instance: dg.DagsterInstance, work: Path):
    context = dg.build_schedule_context(
        instance=instance,
        scheduled_execution_time=datetime(2026, 11, 28, 2, 0, tzinfo=UTC),
        resources={
            "job_store": JobStoreResource(url=store_url),
            "job_storage": JobStorage(work_dir_base=str(work)),
            "admission": AdmissionPolicy.of_deployment(settings()),
        },
    )
    return schedule_for(spec).evaluate_tick(context)


def test_a_schedule_of_team_a_writing_into_team_bs_root_is_refused(teams, tmp_path, dagster_home):
    from batch_pipeline.tenancy.tenants import tenants_at

    registry = tenants_at(str(tmp_path / "tenants.yaml"))
    text = SCHEDULE.format(team="team-a", input=_prompts(teams["team-a"] / "in.json"), output=teams["team-b"])
    (spec,) = load_schedule_specs(_schedules(tmp_path, text), registry)
    url = f"sqlite:///{tmp_path}/jobs.db"

    tick = _tick(spec, url, dagster_home, tmp_path / "work")

    assert tick.run_requests == []
    assert tick.skip_message.endswith(
        "was refused: output_data_path: outside your team's data roots (after .. and symlinks); "
        f"yours are {teams['team-a'].resolve()}"
    )
    assert JobStore(url).list().jobs == []


def test_a_schedules_tick_is_its_teams_job_which_the_jobs_sensor_launches_under_the_teams_name(
    teams, tmp_path, dagster_home
):
    from batch_pipeline.tenancy.tenants import tenants_at

    registry = tenants_at(str(tmp_path / "tenants.yaml"))
    text = SCHEDULE.format(team="team-a", input=_prompts(teams["team-a"] / "in.json"), output=teams["team-a"])
    (spec,) = load_schedule_specs(_schedules(tmp_path, text), registry)
    url = f"sqlite:///{tmp_path}/jobs.db"

    first = _tick(spec, url, dagster_home, tmp_path / "work")
    again = _tick(spec, url, dagster_home, tmp_path / "work")  # a tick evaluated twice makes one job

    (job,) = JobStore(url).list().jobs
    assert job.owner == "team:team-a" and job.request["output_data_path"] == f"{teams['team-a']}/2026-11-28.json"
    assert first.run_requests == again.run_requests == []
    assert job.job_id in first.skip_message and "jobs sensor" in first.skip_message
    context = dg.build_sensor_context(instance=dagster_home, resources=sensor_resources(url))
    (launch,) = batch_jobs_sensor(interval_s=1).evaluate_tick(context).run_requests
    assert launch.run_key == job.job_id and launch.tags[TEAM_TAG] == "team-a"


@pytest.mark.parametrize(
    ("team_line", "message"),
    [
        ("", ":2: schedules.0.team: name the team whose jobs the schedule makes"),
        ("    team: team-c\n", ":4: schedules.0.team: no team 'team-c' in the tenants file"),
    ],
)
def test_with_a_tenants_file_a_schedule_naming_no_known_team_fails_to_load(teams, tmp_path, team_line, message):
    from batch_pipeline.tenancy.tenants import tenants_at

    text = SCHEDULE.format(team="X", input=teams["team-a"] / "in.json", output=teams["team-a"])
    path = _schedules(tmp_path, text.replace("    team: X\n", team_line))
    with pytest.raises(ScheduleFileError) as error:
        load_schedule_specs(path, tenants_at(str(tmp_path / "tenants.yaml")))
    assert str(error.value).startswith(path + message), str(error.value)
    assert load_schedule_specs(path)  # without a tenants file, the same file loads


def test_the_example_schedules_file_works_under_a_tenants_file(tmp_path, monkeypatch, dagster_home):
    """Its output path is the team's data root's (`{data_root}`), not a relative path every team refuses."""
    from batch_pipeline.tenancy.tenants import tenants_at

    demo = tmp_path / "demo"
    demo.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(f"tenants:\n  demo:\n    data_roots: [{demo}]\n")
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    example = str(Path(__file__).resolve().parents[2] / "examples" / "schedules.yaml")
    (spec,) = load_schedule_specs(example, tenants_at(str(tenants_file)))
    url = f"sqlite:///{tmp_path}/jobs.db"

    tick = _tick(spec, url, dagster_home, tmp_path / "work")

    (job,) = JobStore(url).list().jobs
    assert job.job_id in tick.skip_message and job.owner == "team:demo"
    assert job.request["output_data_path"] == f"{demo}/outputs/nightly_sample/2026-11-28.json"
    assert load_schedule_specs(example)  # and without a tenants file (`make serve`)
