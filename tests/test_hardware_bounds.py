"""The hardware a request may ask for, checked when it is submitted: each quantity a Kubernetes quantity
(a number is cores or GiB), positive, and within the maxima the operator set."""

import pytest

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.hardware import hardware_maxima, hardware_refusals

MAXIMA = (
    "BATCH_PIPELINE_MAX_GPUS",
    "BATCH_PIPELINE_MAX_CPUS",
    "BATCH_PIPELINE_MAX_MEMORY",
    "BATCH_PIPELINE_MAX_STORAGE",
)


@pytest.fixture(autouse=True)
def no_maxima(monkeypatch):
    for name in MAXIMA:
        monkeypatch.delenv(name, raising=False)


def _request(**hardware):
    return CreateBatchCompletionsV2Request.model_validate(
        {
            "output_data_path": "/tmp/out.json",
            "model_config": {"model": "m"},
            "content": {"prompts": ["x"], "max_new_tokens": 4, "temperature": 0.0},
            **hardware,
        }
    )


@pytest.mark.parametrize(
    "hardware",
    [
        {},
        {"cpus": 8},
        {"cpus": "500m"},
        {"cpus": 0.5},
        {"memory": "40Gi"},
        {"memory": 16},
        {"memory": "1.5Gi"},
        {"memory": "64G"},
        {"storage": 100},
        {"storage": "1Ti"},
        {"gpus": 0},
        {"gpus": 8},
        {"cpus": "1e3"},
    ],
)
def test_quantities_kubernetes_accepts_are_accepted(hardware):
    assert hardware_refusals(_request(**hardware)) == []


@pytest.mark.parametrize(
    ("hardware", "field"),
    [
        ({"cpus": "lots"}, "cpus"),
        ({"cpus": -2}, "cpus"),
        ({"cpus": 0}, "cpus"),
        ({"cpus": "0m"}, "cpus"),
        ({"memory": "16 Gi"}, "memory"),
        ({"memory": "16gb"}, "memory"),
        ({"memory": "NaN"}, "memory"),
        ({"memory": "Infinity"}, "memory"),
        ({"memory": "1_000Gi"}, "memory"),
        ({"memory": "-1Gi"}, "memory"),
        ({"storage": "0"}, "storage"),
        ({"storage": "1ki"}, "storage"),
        ({"storage": ""}, "storage"),
        ({"memory": 1e-300}, "memory"),
        ({"gpus": -1}, "gpus"),
        ({"cpus": "\uff18"}, "cpus"),  # a fullwidth 8
    ],
)
def test_a_quantity_no_pod_can_carry_is_refused_naming_the_field(hardware, field):
    ((named, why),) = hardware_refusals(_request(**hardware))
    assert named == field and repr(hardware[field]) in why, why


def test_every_bad_field_is_named_at_once():
    refused = hardware_refusals(_request(cpus="lots", memory="-1", storage="x", gpus=-3))
    assert [field for field, _ in refused] == ["gpus", "cpus", "memory", "storage"]


def test_the_operators_maxima_bound_each_field_in_the_units_kubernetes_compares(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_GPUS", "8")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_CPUS", "64")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "512Gi")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_STORAGE", "2Ti")
    at_the_maxima = {"gpus": 8, "cpus": "64000m", "memory": 512, "storage": "2048Gi"}
    assert hardware_refusals(_request(**at_the_maxima)) == []
    over = hardware_refusals(_request(gpus=9, cpus=65, memory="513Gi", storage="2.1Ti"))
    assert [field for field, _ in over] == ["gpus", "cpus", "memory", "storage"]
    assert dict(over)["memory"] == "513Gi is more than this deployment's maximum of 512Gi"
    assert "550G" in dict(hardware_refusals(_request(memory="550G")))["memory"]  # decimal units compared exactly


def test_no_maxima_set_means_any_valid_size():
    assert hardware_refusals(_request(gpus=1024, cpus=10_000, memory="100Ti", storage="1Pi")) == []


def test_a_maximum_the_operator_mistyped_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "lots")
    with pytest.raises(ValueError, match="BATCH_PIPELINE_MAX_MEMORY"):
        hardware_maxima()


def test_the_api_refuses_hardware_no_pod_can_carry_naming_the_field_and_stores_nothing(deployment_factory, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_GPUS", "8")
    api = deployment_factory()
    headers = {"x-api-key": "key-alice"}
    body = {
        "output_data_path": "/tmp/hardware-bounds/out.json",
        "model_config": {"model": "smollm2-135m-instruct"},
        "content": {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0},
    }
    for field, value in [("cpus", "lots"), ("memory", "NaN"), ("storage", "0"), ("gpus", 9)]:
        response = api.client.post("/v2/batch-completions", json={**body, field: value}, headers=headers)
        assert response.status_code == 422, (field, value, response.text)
        assert response.json()["detail"][0]["loc"] == ["body", field]
    assert api.client.get("/v2/batch-completions", headers=headers).json()["jobs"] == []
    assert (
        api.client.post(
            "/v2/batch-completions", json={**body, "gpus": 8, "memory": "16Gi"}, headers=headers
        ).status_code
        == 200
    )


def test_a_mistyped_maximum_stops_the_api_at_start_naming_the_variable(monkeypatch):
    from batch_pipeline.api.app import create_app

    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "lots")
    with pytest.raises(ValueError, match="BATCH_PIPELINE_MAX_MEMORY"):
        create_app(service=object())
