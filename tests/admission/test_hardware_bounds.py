"""The hardware a request may ask for, checked when it is submitted: each quantity a Kubernetes quantity
(a number is cores or GiB), positive, and within the maxima the operator set. The engine arguments that size
what a shard's engine allocates are bounded the same way, by maxima with safe defaults."""

import json
from pathlib import Path

import pytest

from batch_pipeline.admission.hardware import ENGINE_ARGUMENT_MAXIMA, hardware_refusals
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import ENV_PREFIX, Settings, settings

MAXIMA = (
    "BATCH_PIPELINE_MAX_GPUS",
    "BATCH_PIPELINE_MAX_CPUS",
    "BATCH_PIPELINE_MAX_MEMORY",
    "BATCH_PIPELINE_MAX_STORAGE",
    *{ENV_PREFIX + setting.upper() for setting in ENGINE_ARGUMENT_MAXIMA.values()},
)
SAMPLE_REQUEST = Path(__file__).resolve().parents[2] / "examples" / "sample_request.json"


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
    assert hardware_refusals(_request(**hardware), {}) == []


@pytest.mark.parametrize(
    ("hardware", "field"),
    [
        ({"cpus": "lots"}, "cpus"),
        ({"cpus": -2}, "cpus"),
        ({"cpus": 0}, "cpus"),
        ({"cpus": "0m"}, "cpus"),
        ({"cpus": "1e400"}, "cpus"),  # the grammar takes it; no pod and no float holds it
        ({"memory": "9000000E"}, "memory"),  # 9e24 bytes: past what Kubernetes keeps
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
    ((named, why),) = hardware_refusals(_request(**hardware), {})
    assert named == field and repr(hardware[field]) in why, why


def test_every_bad_field_is_named_at_once():
    refused = hardware_refusals(_request(cpus="lots", memory="-1", storage="x", gpus=-3), {})
    assert [field for field, _ in refused] == ["gpus", "cpus", "memory", "storage"]


def test_the_operators_maxima_bound_each_field_in_the_units_kubernetes_compares():
    configured = Settings(
        BATCH_PIPELINE_MAX_GPUS="8",
        BATCH_PIPELINE_MAX_CPUS="64",
        BATCH_PIPELINE_MAX_MEMORY="512Gi",
        BATCH_PIPELINE_MAX_STORAGE="2Ti",
    )  # the variables' values, as the deployment reads them
    maxima = AdmissionPolicy.of_deployment(configured).hardware_maxima
    at_the_maxima = {"gpus": 8, "cpus": "64000m", "memory": 512, "storage": "2048Gi"}
    assert hardware_refusals(_request(**at_the_maxima), maxima) == []
    over = hardware_refusals(_request(gpus=9, cpus=65, memory="513Gi", storage="2.1Ti"), maxima)
    assert [field for field, _ in over] == ["gpus", "cpus", "memory", "storage"]
    assert dict(over)["memory"] == "513Gi is more than this deployment's maximum of 512Gi"
    # decimal units compared exactly
    assert "550G" in dict(hardware_refusals(_request(memory="550G"), maxima))["memory"]


def test_no_maxima_set_means_any_valid_size():
    # On Kubernetes: a local deployment bounds cpus by its machine's cores (test_usage).
    configured = Settings(BATCH_PIPELINE_SHARD_LAUNCHER="k8s", BATCH_PIPELINE_WORKER_IMAGE="registry.example/worker:1")
    maxima = AdmissionPolicy.of_deployment(configured).hardware_maxima
    assert hardware_refusals(_request(gpus=1024, cpus=10_000, memory="100Ti", storage="1Pi"), maxima) == []


def test_a_maximum_the_operator_mistyped_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "lots")
    with pytest.raises(ValueError, match="BATCH_PIPELINE_MAX_MEMORY"):
        AdmissionPolicy.of_deployment(settings())


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


# Each engine argument just past its default maximum.
PAST_THE_DEFAULT_MAXIMA = {
    "max_model_len": 131073,
    "max_context_length": 131073,
    "max_num_seqs": 1025,
    "max_num_batched_tokens": 131073,
    "max_seq_len_to_capture": 131073,
    "block_size": 512,
    "num_gpu_blocks_override": 32769,
    "swap_space": 64.5,
    "gpu_memory_utilization": 0.96,
    "tensor_parallel_size": 9,
    "pipeline_parallel_size": 9,
}
# Values no engine takes, whatever the maxima: counts below one, a block size not a power of two, a fraction
# of memory outside (0, 1], negative swap.
NO_ENGINE_TAKES = [
    ("max_model_len", 0),
    ("max_model_len", -1),
    ("max_context_length", 0),
    ("max_num_seqs", 0),
    ("max_num_batched_tokens", -5),
    ("max_seq_len_to_capture", 0),
    ("block_size", 0),
    ("block_size", 24),
    ("num_gpu_blocks_override", 0),
    ("num_gpu_blocks_override", -(2**40)),
    ("swap_space", -1),
    ("gpu_memory_utilization", 0),
    ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", -0.1),
    ("tensor_parallel_size", 0),
    ("pipeline_parallel_size", -1),
]
V1_BODY = {
    "output_data_path": "/tmp/engine-bounds/out.json",
    "model_config": {"model": "smollm2-135m-instruct"},
    "content": {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0},
}
ROUTES = ("/v1/llm/batch-completions", "/v2/batch-completions")


def _with_engine_argument(field, value) -> dict:
    return {**V1_BODY, "model_config": {**V1_BODY["model_config"], field: value}}


def test_engine_arguments_past_the_maxima_or_that_no_engine_takes_get_422_naming_the_field(
    deployment_factory, tmp_path
):
    api = deployment_factory()
    headers = {"x-api-key": "key-alice"}
    assert set(PAST_THE_DEFAULT_MAXIMA) == set(ENGINE_ARGUMENT_MAXIMA)  # every bounded argument is tried
    for field, value in [*PAST_THE_DEFAULT_MAXIMA.items(), *NO_ENGINE_TAKES]:
        for route in ROUTES:
            response = api.client.post(route, json=_with_engine_argument(field, value), headers=headers)
            assert response.status_code == 422, (route, field, value, response.text)
            assert [error["loc"] for error in response.json()["detail"]] == [["body", "model_config", field]], (
                route,
                field,
                response.text,
            )
    assert api.client.get("/v2/batch-completions", headers=headers).json()["jobs"] == []
    # At the default maxima, each is admitted.
    at_the_maxima = {
        "max_model_len": 131072,
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 131072,
        "max_seq_len_to_capture": 131072,
        "block_size": 256,
        "num_gpu_blocks_override": 32768,
        "swap_space": 64,
        "gpu_memory_utilization": 0.95,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
    }
    body = {**V1_BODY, "model_config": {**V1_BODY["model_config"], **at_the_maxima}}
    # The default maxima admit the sample request.
    sample = {**json.loads(SAMPLE_REQUEST.read_text()), "output_data_path": str(tmp_path / "out.json")}
    for route in ROUTES:
        assert api.client.post(route, json=body, headers=headers).status_code == 200
        response = api.client.post(route, json=sample, headers=headers)
        assert response.status_code == 200, (route, response.text)


def test_the_operator_sets_each_engine_maximum(deployment_factory, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MODEL_LEN", "4096")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_GPU_MEMORY_UTILIZATION", "1")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_GPUS", "4")
    api = deployment_factory()
    headers = {"x-api-key": "key-alice"}

    def answer(**model_config) -> tuple[int, list]:
        body = {**V1_BODY, "model_config": {**V1_BODY["model_config"], **model_config}}
        response = api.client.post("/v2/batch-completions", json=body, headers=headers)
        return response.status_code, [error["loc"][-1] for error in response.json().get("detail", [])]

    assert answer(max_num_seqs=64, max_model_len=4096, gpu_memory_utilization=1.0)[0] == 200
    assert answer(max_num_seqs=65) == (422, ["max_num_seqs"])
    assert answer(max_model_len=4097) == (422, ["max_model_len"])
    assert answer(max_context_length=4097) == (422, ["max_context_length"])
    # One engine over 4 x 2 GPUs asks for more GPUs than a request may.
    assert answer(tensor_parallel_size=4, pipeline_parallel_size=2) == (422, ["tensor_parallel_size"])
    assert answer(tensor_parallel_size=2, pipeline_parallel_size=2)[0] == 200


def test_an_engine_maximum_the_operator_mistyped_is_an_error_naming_the_variable(monkeypatch):
    for variable, value in [
        ("BATCH_PIPELINE_MAX_BLOCK_SIZE", "0"),
        ("BATCH_PIPELINE_MAX_NUM_SEQS", "lots"),
        ("BATCH_PIPELINE_MAX_GPU_MEMORY_UTILIZATION", "1.5"),
    ]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=variable):
            settings()
        monkeypatch.delenv(variable)
