"""The Dagster definitions load, and the launchpad's config is the request: typed, with the spec's defaults."""

import os
import subprocess
import sys
from datetime import UTC, datetime

import dagster as dg
import pytest

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.console_logger import console_logger
from batch_pipeline.pipeline.definitions import batch_completions_job, defs
from batch_pipeline.pipeline.partial_results import partial_results_run_request
from batch_pipeline.store.records import JobRecord

REQUEST = {
    "output_data_path": "/tmp/out.json",
    "model_config": {"model": "smollm2-135m-instruct", "max_model_len": 2048},
    "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0.5},
    "cpus": "2",
    "memory": 8,
    "gpu_type": "nvidia-ampere-a10",
    "labels": {"team": "ml"},
}


def test_every_definition_loads():
    repository = defs.get_repository_def()
    # Less Dagster's implicit asset job (`__ASSET_JOB`, which the UI hides), made for the outputs asset's spec.
    assert sorted(job.name for job in repository.get_all_jobs() if not job.name.startswith("__")) == [
        "batch_completions",
        "cleanup",
        "keep_partial_results",
    ]
    job = batch_completions_job()
    assert {"shard_launcher", "job_storage", "job_store", "shard_planning"} <= set(job.resource_defs)
    assert {"job_storage", "job_store"} <= set(defs.get_job_def("keep_partial_results").resource_defs)


def test_a_request_is_a_valid_run_config_and_gets_the_spec_defaults():
    request = CreateBatchCompletionsV2Request.model_validate(REQUEST)
    validated = dg.validate_run_config(batch_completions_job(), run_config_for(request))
    config = validated["ops"]["validate_input"]["config"]
    assert config["data_parallelism"] == 1
    assert config["max_runtime_sec"] == 86400
    assert config["model_config"]["max_model_len"] == 2048
    assert config["model_config"]["trust_remote_code"] is False
    assert CreateBatchCompletionsV2Request.model_validate(config).gpu_type == "nvidia-ampere-a10"
    # Its runs log through the job's console logger (a cancel's events in one line each), at every level as
    # Dagster's own default.
    assert validated["loggers"]["console"]["config"]["log_level"] == "DEBUG"
    assert batch_completions_job().loggers["console"] is console_logger


@pytest.mark.parametrize("held_event", [None, "event-1"])
def test_the_run_that_keeps_partial_results_has_a_valid_run_config(held_event):
    now = datetime.now(UTC)
    record = JobRecord(
        job_id="batch-1",
        owner="alice",
        request_json="{}",
        priority=None,
        labels={},
        created_at=now,
        expires_at=now,
        run_id="run-1",
        cancelled_at=None,
        idempotency_key=None,
        requests_total=3,
    )
    run_request = partial_results_run_request(record, "run-1", "cancelled", "stopped", held_event)
    assert run_request is not None
    validated = dg.validate_run_config(defs.get_job_def("keep_partial_results"), run_request.run_config)
    assert validated["ops"]["merge_finished_results"]["config"] == {
        "job_id": "batch-1",
        "run_id": "run-1",
        "code": "cancelled",
        "reason": "stopped",
        "held_event": held_event,
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c.pop("output_data_path"), "output_data_path"),
        (lambda c: c.update(data_parallelizm=2), "data_parallelizm"),
        (lambda c: c["model_config"].update(max_model_len="long"), "max_model_len"),
        (lambda c: c.update(gpu_type="nvidia-rtx-4090"), "gpu_type"),
    ],
)
def test_the_launchpad_refuses_bad_config_naming_the_field(change, named):
    config = CreateBatchCompletionsV2Request.model_validate(REQUEST).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    change(config)
    with pytest.raises(dg.DagsterInvalidConfigError, match=named):
        dg.validate_run_config(batch_completions_job(), {"ops": {"validate_input": {"config": config}}})


def test_launchpad_fields_carry_the_spec_descriptions():
    schema = batch_completions_job().get_config_schema_snapshot()
    descriptions = {
        field.description
        for config_type in schema.all_config_snaps_by_key.values()
        for field in (config_type.fields or [])
        if field.description
    }
    assert "Maximum runtime of the batch inference in seconds. Default to one day." in descriptions
    assert "Random seed for the model." in descriptions


@pytest.mark.parametrize(
    ("resource", "field", "value"),
    [
        # What an anonymous launchRun used to set: the worker's environment and executable (a shell as the
        # service's user), another work dir, another job store.
        ("shard_launcher", "env", {"PYTHONSTARTUP": "/tmp/evil.py"}),
        ("shard_launcher", "python_executable", "/bin/sh"),
        ("job_storage", "work_dir_base", "/tmp/elsewhere"),
        ("job_store", "url", "sqlite:////tmp/other.db"),
        # a job that plans itself into more shards than the deployment runs, each too small for its engine
        ("shard_planning", "min_shard_tokens", 0),
        # a cleanup reading teams of the launcher's own making: a retention of a day for another team's jobs
        ("tenancy", "tenants_file", "/tmp/my-own-teams.yaml"),
        # a run that admits its own paths: another team's data roots, or a model's own code
        ("admission", "allow_remote_code", True),
    ],
)
@pytest.mark.parametrize("job_name", ["batch_completions", "keep_partial_results", "cleanup"])
def test_no_run_config_reconfigures_a_resource(job_name, resource, field, value):
    job = defs.get_job_def(job_name)
    if resource not in job.resource_defs:
        pytest.skip(f"{job_name} has no {resource}")
    config = {"resources": {resource: {"config": {field: value}}}}
    if job_name == "batch_completions":
        request = CreateBatchCompletionsV2Request.model_validate(REQUEST)
        config |= run_config_for(request)
    with pytest.raises(dg.DagsterInvalidConfigError, match=rf'unexpected config entry "{field}".*resources:{resource}'):
        dg.validate_run_config(job, config)


def test_resources_are_the_deployments():
    """The launchpad shows no resource config to edit, and the job's resources are what the settings built."""
    job = batch_completions_job()
    for name in ("shard_launcher", "job_storage", "job_store", "shard_planning", "tenancy", "admission"):
        assert job.resource_defs[name].config_schema.as_field().config_type.fields == {}, name


def test_the_job_stores_password_is_nowhere_in_what_the_dagster_ui_reads_of_the_code_location(tmp_path):
    """The UI (and anyone who reaches it) reads the code location's snapshot: jobs, their config schemas,
    resources and their config. A Postgres URL's password must not be in it."""
    secret = "hunter2-not-in-the-ui"
    probe = (
        "from dagster._core.remote_representation.external_data import RepositorySnap\n"
        "from dagster._serdes import serialize_value\n"
        "from batch_pipeline.pipeline.definitions import defs\n"
        "print(serialize_value(RepositorySnap.from_def(defs.get_repository_def())))\n"
    )
    environment = os.environ | {
        "DAGSTER_HOME": str(tmp_path),
        "BATCH_PIPELINE_JOBS_DB": f"postgresql://batch:{secret}@127.0.0.1:1/jobs",
    }
    snapshot = subprocess.run(
        [sys.executable, "-c", probe], env=environment, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert '"batch_completions"' in snapshot and '"job_store"' in snapshot  # the snapshot, with its resources
    assert secret not in snapshot


def test_the_sensors_tick_as_often_as_the_deployment_says(tmp_path):
    """BATCH_PIPELINE_SENSOR_INTERVAL_S reaches every sensor the code location loads, as the daemon reads them."""
    probe = (
        "from batch_pipeline.pipeline.definitions import defs\n"
        "print(sorted((s.name, s.minimum_interval_seconds) for s in defs.get_repository_def().sensor_defs))\n"
    )
    environment = os.environ | {"DAGSTER_HOME": str(tmp_path), "BATCH_PIPELINE_SENSOR_INTERVAL_S": "7"}
    loaded = subprocess.run(
        [sys.executable, "-c", probe], env=environment, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert loaded.strip() == str(
        [
            ("batch_jobs_sensor", 7),
            ("record_failed_runs", 7),
            ("record_stopped_runs", 7),
            ("record_succeeded_runs", 7),
        ]
    )


def test_the_launchpad_opens_with_a_sample_request_this_deployment_runs_and_a_given_one_is_taken_whole(tmp_path):
    """Issue 46: the launchpad had no template; a newcomer wrote the request's YAML from the docs."""
    from batch_pipeline.admission.policy import AdmissionPolicy
    from batch_pipeline.admission.submission import check_servable
    from batch_pipeline.core.settings import Settings, settings
    from batch_pipeline.pipeline.config_schema import launchpad_template
    from batch_pipeline.pipeline.job import DAGSTER_OWNER

    job = batch_completions_job()
    assert job.run_config == launchpad_template(settings())  # what the launchpad is filled with
    # A run given nothing runs the template, which the deployment's checks admit as it is.
    sample = dg.validate_run_config(job, {})["ops"]["validate_input"]["config"]
    request = CreateBatchCompletionsV2Request.model_validate(sample)
    assert request.content is not None and request.model_cfg.model == "smollm2-135m-instruct"
    check_servable(request, DAGSTER_OWNER, AdmissionPolicy.of_deployment(settings()))
    # Under data roots its output lies in the first.
    rooted = Settings.model_validate({"BATCH_PIPELINE_DATA_ROOTS": f"{tmp_path}/a{os.pathsep}{tmp_path}/b"})
    output = launchpad_template(rooted)["ops"]["validate_input"]["config"]["output_data_path"]
    assert output.startswith(f"{tmp_path}/a/")

    # A run's own request is taken whole: nothing of the template is merged into it.
    given = dg.validate_run_config(job, run_config_for(CreateBatchCompletionsV2Request.model_validate(REQUEST)))
    config = given["ops"]["validate_input"]["config"]
    assert config["labels"] == {"team": "ml"} and config["output_data_path"] == "/tmp/out.json"
    assert config["content"]["prompts"] == ["hi"]


def test_the_outputs_asset_has_a_definition_that_says_what_it_is():
    """Issue 46: the Catalog called `batch_completions/outputs` "External ... no software definition"."""
    from batch_pipeline.pipeline.job import OUTPUTS_ASSET

    node = defs.resolve_asset_graph().get(OUTPUTS_ASSET)
    assert "write_job_metadata" in (node.description or "") and "job id" in (node.description or "")
    assert not node.is_materializable  # made by a job's run, not from the catalog
