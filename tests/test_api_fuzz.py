"""Every route fuzzed from our own OpenAPI document (schemathesis, property-based): no input makes the
server fail, and every response matches the documented schema and status codes."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.checks import not_a_server_error

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
                checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                        response_schema_conformance],
            )

        fuzz()
