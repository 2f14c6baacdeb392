"""`priority` is the spec's free string: every string a store can keep is accepted, read as a run priority
that never ranks above `highest`, and the job says how it was read."""

import pytest

from batch_pipeline.contract.priority import MAX_PRIORITY_CHARS, InvalidPriority, read_priority
from batch_pipeline.store.schema import jobs
from tests.api.test_api import _sensor_run_requests
from tests.api_fixtures import USER_KEY
from tests.conftest import MODEL

ALICE = {"x-api-key": USER_KEY}


def _body(tmp_path, **fields) -> dict:
    return {
        "output_data_path": str(tmp_path / "out" / "output.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0},
        **fields,
    }


@pytest.mark.parametrize(
    "given, level, reading",
    [
        (None, 0, "0 (normal: no priority given)"),
        ("  ", 0, "0 (normal: no priority given)"),
        ("HIGH", 10, "10 (high)"),
        ("urgent", 20, "20 (urgent)"),
        (" 7 ", 7, "7 (an integer, as given)"),
        ("-20", -20, "-20 (an integer, as given)"),
        ("21", 20, "20 (21 is above the highest priority, 20)"),
        ("9" * MAX_PRIORITY_CHARS, 20, f"20 ({'9' * MAX_PRIORITY_CHARS} is above the highest priority, 20)"),
        ("-1000", -20, "-20 (-1000 is below the lowest priority, -20)"),
        ("1_000", 0, None),  # not an integer a client writes: a free string
        ("whenever", 0, None),
    ],
)
def test_a_priority_is_read_as_a_bounded_level_and_says_how(given, level, reading):
    read = read_priority(given)
    assert read.level == level
    if reading is not None:
        assert read.reading == reading
    else:
        assert read.reading.startswith(f"0 (normal: {given.strip()!a} is not a known priority; known are integers")


def test_only_a_priority_longer_than_the_store_keeps_is_refused():
    assert jobs.c.priority.type.length == MAX_PRIORITY_CHARS
    read_priority("x" * MAX_PRIORITY_CHARS)
    with pytest.raises(InvalidPriority, match=f"at most {MAX_PRIORITY_CHARS} characters"):
        read_priority("x" * (MAX_PRIORITY_CHARS + 1))


def test_a_free_string_priority_is_accepted_runs_at_normal_and_the_job_says_how_it_was_read(
    deployment_factory, tmp_path
):
    api = deployment_factory()
    free = api.client.post("/v2/batch-completions", json=_body(tmp_path, priority="whenever"), headers=ALICE)
    assert free.status_code == 200, free.text
    job = free.json()
    assert job["priority"] == "whenever"  # kept as sent
    assert job["metadata"]["priority_read_as"] == (
        "0 (normal: 'whenever' is not a known priority; known are integers -20..20 and lowest, low, normal, "
        "medium, default, high, highest, urgent, critical)"
    )
    huge = api.client.post("/v1/llm/batch-completions", json=_body(tmp_path, priority="1" + "0" * 40), headers=ALICE)
    assert huge.status_code == 200, huge.text
    assert (
        api.job(huge.json()["job_id"])["metadata"]["priority_read_as"]
        == f"20 ({'1' + '0' * 40} is above the highest priority, 20)"
    )
    plain = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()
    assert "priority_read_as" not in plain["metadata"]

    tags = {request.run_key: request.tags["dagster/priority"] for request in _sensor_run_requests(api)}
    assert tags == {job["job_id"]: "0", huge.json()["job_id"]: "20", plain["job_id"]: "0"}


def test_a_priority_too_long_to_store_is_a_422_naming_priority_on_create_and_update(deployment_factory, tmp_path):
    api = deployment_factory()
    too_long = "x" * (MAX_PRIORITY_CHARS + 1)
    for route in ("/v1/llm/batch-completions", "/v2/batch-completions"):
        response = api.client.post(route, json=_body(tmp_path, priority=too_long), headers=ALICE)
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == ["body", "priority"] and "at most 64 characters" in error["msg"]
        assert too_long not in response.text  # a 422 never echoes the input
    assert api.store.list().jobs == []

    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path, priority="low"), headers=ALICE).json()[
        "job_id"
    ]
    refused = api.client.post(
        f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": too_long}, headers=ALICE
    )
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "priority"]
    assert api.store.get(job_id).priority == "low"


def test_the_update_route_reads_a_priority_the_same_way(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path, priority="high"), headers=ALICE).json()[
        "job_id"
    ]
    updated = api.client.post(
        f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": "asap please"}, headers=ALICE
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["success"] is True and updated.json()["priority"] == "asap please"
    assert updated.json()["metadata"]["priority_read_as"].startswith("0 (normal: 'asap please' is not a known priority")
    (run_request,) = _sensor_run_requests(api)
    assert run_request.tags["dagster/priority"] == "0"
