"""Every route fuzzed from our own OpenAPI document (schemathesis, property-based): no input makes the
server fail, and every response matches the documented schema and status codes."""

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from batch_pipeline.pipeline.runs import launch_key
from batch_pipeline.pipeline.sensors import run_request_for
from tests.api_fixtures import USER_KEY, Deployment

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    home = tmp_path_factory.mktemp("dagster_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        patch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(home / "data"))  # fuzzed paths must not touch the disk
        deployment = Deployment(home, max_concurrent_runs=0)
        yield deployment
        deployment.stop()


@pytest.mark.slow
def test_no_input_fails_the_server_and_every_response_matches_the_schema(deployment):
    schema = schemathesis.openapi.from_asgi("/openapi.json", deployment.client.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7  # every route of the spec, and health
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(
                headers={"x-api-key": USER_KEY},
                checks=[
                    not_a_server_error,
                    status_code_conformance,
                    content_type_conformance,
                    response_schema_conformance,
                ],
            )

        fuzz()


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# Values JSON can carry that no field may hold, as a hostile client sends them (json.dumps writes NaN and
# Infinity literals, and a lone surrogate as its \u escape): each must get a 4xx, never a 5xx.
HOSTILE_VALUES = st.sampled_from(
    [
        float("nan"),
        float("inf"),
        float("-inf"),
        "x\ud800",
        "\udfff",
        "a\x00b",
        10**400,
        -(10**100),
        2**63,
        "1" + "0" * 100,
        _nested(80),
        _nested(900),
        [[[[[[[[[[]]]]]]]]]],
    ]
)


def _positions(value, path=()):
    """Every place in a JSON document a value can be put: each member, each item, and the root."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _positions(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _positions(item, (*path, index))


def _put(document, path, value):
    if not path:
        return value
    document = json.loads(json.dumps(document))
    node = document
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return document


@pytest.mark.slow
def test_hostile_values_anywhere_in_a_body_get_4xx(deployment):
    """Schemathesis' bodies with one value swapped for a hostile one (NaN, infinities, lone surrogates, NUL,
    huge numbers, deep nesting), posted as raw JSON: no answer is a 5xx, and every job stored can become a
    run (a value put in a member the contract does not know is ignored, so such a body may be accepted)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", deployment.client.app)
    with_bodies = [
        operation
        for operation in (result.ok() for result in schema.get_all_operations())
        if operation.method.upper() == "POST" and operation.body
    ]
    assert len(with_bodies) == 5  # v1 and v2 create, update priority, OpenAI's file upload and batch create
    for operation in with_bodies:

        @given(case=operation.as_strategy(), hostile=HOSTILE_VALUES, data=st.data())
        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case, hostile, data):
            if not isinstance(case.body, (dict, list)):
                return
            path = data.draw(st.sampled_from(list(_positions(case.body))))
            body = _put(case.body, path, hostile)
            response = deployment.client.request(
                "POST",
                case.formatted_path,
                content=json.dumps(body).encode(),
                headers={"x-api-key": USER_KEY, "content-type": "application/json"},
            )
            assert response.status_code < 500, (path, repr(hostile)[:80], response.status_code, response.text)

        fuzz()
    key = launch_key(deployment.instance)
    for record in deployment.store.list().jobs:
        assert run_request_for(record, None, key).run_key == record.job_id  # raises for a job that could not run
