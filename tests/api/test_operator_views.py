"""What an operator sees of a run started outside the API (the launchpad, `batch-pipeline run`): it is a job
the API lists and reports, its run carries the job's tags, and its outputs are an asset in the catalog."""

import json

import pytest
from fastapi.testclient import TestClient

from batch_pipeline.api.app import create_app
from batch_pipeline.api.auth import ApiKeys
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.job import OUTPUTS_ASSET
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LABEL_TAG_PREFIX, MODEL_TAG
from batch_pipeline.store.jobs import JobStore
from tests.conftest import MODEL

pytestmark = pytest.mark.slow


def test_a_run_launched_outside_the_api_is_a_job_the_api_reports_with_its_outputs_as_an_asset(
    run_job, dagster_home, tmp_path
):
    output = tmp_path / "out.json"
    content = {"prompts": ["The capital of France is", "Water boils at"], "max_new_tokens": 6, "temperature": 0.0}
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "content": content,
            "labels": {"team": "ops"},
        }
    )
    assert result.success
    run = dagster_home.get_run_by_id(result.run_id)
    job_id = run.tags[JOB_ID_TAG]
    assert run.tags[MODEL_TAG] == MODEL and run.tags[LABEL_TAG_PREFIX + "team"] == "ops"

    service = BatchJobService.of_deployment(settings(), JobStore(settings().job_store_url), dagster_home)
    with TestClient(create_app(service, ApiKeys([]))) as client:
        listed = client.get("/v2/batch-completions").json()["jobs"]
        job = client.get(f"/v2/batch-completions/{job_id}").json()["job"]
    assert [j["job_id"] for j in listed] == [job_id]
    assert job["status"] == "completed" and job["output_data_path"] == str(output)
    assert job["metadata"]["dagster_run_id"] == result.run_id
    assert job["metadata"]["num_requests"] == "2"
    # the workers' running token count agrees with the finished job's
    assert job["metadata"]["completion_tokens_generated"] == job["metadata"]["completion_tokens"]

    materialization = dagster_home.get_latest_materialization_event(OUTPUTS_ASSET).asset_materialization
    assert materialization.partition == job_id
    assert materialization.metadata["output_data_path"].value == str(output)
    written = json.loads(output.read_text())
    assert materialization.metadata["completion_tokens"].value == sum(o["num_completion_tokens"] for o in written)
