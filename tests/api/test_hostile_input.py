"""Hostile input against the real server over real sockets (uvicorn, httpx): every answer is a 4xx that
names what is wrong, none is a 5xx, and nothing is stored that cannot run. The jobs sensor, fed a job
that cannot become a run, marks that job failed and goes on with the others."""

import json
import os
import stat
import time
import warnings
from datetime import UTC

import dagster as dg
import httpx
import pytest

from batch_pipeline.pipeline.resources import RunLaunching
from batch_pipeline.pipeline.sensors import batch_jobs_sensor
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LABEL_TAG_PREFIX, label_tag_key, run_tags
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.schema import jobs
from tests.api_fixtures import USER_KEY, sensor_resources
from tests.conftest import MODEL

ALICE = {"x-api-key": USER_KEY}
NAN, INF = float("nan"), float("inf")
LONE_SURROGATE = "x\ud800"  # json.dumps writes it as the escape "x\\ud800", as a hostile client would
HUGE = 10**400


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _v1_body(tmp_path, **fields) -> dict:
    return {
        "output_data_path": str(tmp_path / "out" / "output.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0},
        **fields,
    }


def _with(body: dict, path: str, value) -> dict:
    """A deep copy of `body` with the value at a dotted path (`content.0.temperature`) set."""
    body = json.loads(json.dumps(body))
    *parents, last = path.split(".")
    node = body
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return body


@pytest.fixture
def served(deployment_factory):
    api = deployment_factory(max_concurrent_runs=0)
    url = api.serve_http()
    with httpx.Client(base_url=url, headers=ALICE, timeout=120) as client:
        yield api, client


def _post(client: httpx.Client, route: str, body, headers: dict | None = None) -> httpx.Response:
    # json.dumps as a client would send it: NaN/Infinity literals, lone surrogates as \u escapes.
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(route, content=raw, headers={"content-type": "application/json", **(headers or {})})


def _locations(response: httpx.Response) -> list[list]:
    """Where each error is, without the tag of the content shape (`content.v1.prompts` -> `content.prompts`):
    the v1 route has no such tag, the v2 route names the shape it judged the content to be."""
    return [
        [part for i, part in enumerate(error["loc"]) if not (i == 2 and error["loc"][1] == "content" and part == "v1")]
        for error in response.json()["detail"]
    ]


def test_non_finite_numbers_get_422_naming_the_field(served, tmp_path):
    api, client = served
    v1 = _v1_body(tmp_path)
    completion = _v1_body(tmp_path, content=[{"prompt": "x", "max_tokens": 3}])
    chat = _v1_body(tmp_path, content=[{"messages": [{"role": "user", "content": "x"}]}])
    cases = [
        ("/v1/llm/batch-completions", v1, "content.temperature", ["body", "content", "temperature"]),
        ("/v1/llm/batch-completions", v1, "content.top_p", ["body", "content", "top_p"]),
        (
            "/v2/batch-completions",
            v1,
            "model_config.gpu_memory_utilization",
            ["body", "model_config", "gpu_memory_utilization"],
        ),
        ("/v2/batch-completions", v1, "cpus", ["body", "cpus"]),
        (
            "/v2/batch-completions",
            completion,
            "content.0.temperature",
            ["body", "content", 0, "temperature"],
        ),
        (
            "/v2/batch-completions",
            completion,
            "content.0.length_penalty",
            ["body", "content", 0, "length_penalty"],
        ),
        ("/v2/batch-completions", chat, "content.0.top_p", ["body", "content", 0, "top_p"]),
        # Free-form JSON holds no non-finite number either: it could not be written as JSON again.
        ("/v2/batch-completions", v1, "model_config.rope_scaling", ["body", "model_config", "rope_scaling"]),
        (
            "/v2/batch-completions",
            completion,
            "content.0.logit_bias",
            ["body", "content", 0, "logit_bias"],
        ),
    ]
    for value in (NAN, INF, -INF):
        for route, body, path, location in cases:
            if path.endswith(("rope_scaling", "logit_bias")):
                value_at_path = {"factor": value} if path.endswith("rope_scaling") else {"42": value}
            else:
                value_at_path = value
            response = _post(client, route, _with(body, path, value_at_path))
            assert response.status_code == 422, (path, value, response.status_code, response.text)
            assert any(loc[: len(location)] == location for loc in _locations(response)), (path, response.text)
    assert api.store.list().jobs == []


def test_lone_surrogates_and_nul_get_422_naming_the_field(served, tmp_path):
    api, client = served
    v1 = _v1_body(tmp_path)
    chat = _v1_body(tmp_path, content=[{"messages": [{"role": "user", "content": "x"}]}])
    cases = [
        (v1, "labels.team", ["body", "labels"]),
        (v1, "model_config.model", ["body", "model_config", "model"]),
        (v1, "model_config.tokenizer", ["body", "model_config", "tokenizer"]),
        (v1, "priority", ["body", "priority"]),
        (v1, "output_data_path", ["body", "output_data_path"]),
        (v1, "content.prompts.0", ["body", "content", "prompts"]),
        (chat, "content.0.messages.0.content", ["body", "content", 0, "messages", 0, "content"]),
        (v1, "model_config.rope_scaling", ["body", "model_config", "rope_scaling"]),
    ]
    for route in ("/v1/llm/batch-completions", "/v2/batch-completions"):
        for body, path, location in cases:
            if route.startswith("/v1") and body is chat:
                continue
            value = {"type": LONE_SURROGATE} if path.endswith("rope_scaling") else LONE_SURROGATE
            response = _post(client, route, _with(body, path, value))
            assert response.status_code == 422, (route, path, response.status_code, response.text)
            assert any(loc[: len(location)] == location for loc in _locations(response)), (path, response.text)
    # A surrogate in a key of free-form JSON, which becomes a run tag for labels.
    keyed = _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels={LONE_SURROGATE: "a"}))
    assert keyed.status_code == 422 and ["body", "labels"] in [loc[:2] for loc in _locations(keyed)], keyed.text
    # NUL cannot be stored in a Postgres text column or a run tag, nor name a file.
    for path, location in [
        ("labels.team", ["body", "labels"]),
        ("model_config.model", ["body", "model_config", "model"]),
        ("priority", ["body", "priority"]),
        ("output_data_path", ["body", "output_data_path"]),
    ]:
        response = _post(client, "/v2/batch-completions", _with(v1, path, "a\x00b"))
        assert response.status_code == 422, (path, response.status_code, response.text)
        assert any(loc[: len(location)] == location for loc in _locations(response)), (path, response.text)
    assert api.store.list().jobs == []
    # A surrogate pair is a real character (an emoji), not a lone surrogate: accepted.
    emoji = _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels={"mood": "\U0001f600"}))
    assert emoji.status_code == 200, emoji.text
    # In text for the model a NUL is stored escaped (JSON) and is the model's business: accepted.
    for body, path in [(v1, "content.prompts.0"), (chat, "content.0.messages.0.content")]:
        response = _post(client, "/v2/batch-completions", _with(body, path, "a\x00b"))
        assert response.status_code == 200, (path, response.text)


def test_deeply_nested_json_gets_422_naming_the_field_or_the_body(served, tmp_path):
    api, client = served
    v1 = _v1_body(tmp_path)
    completion = _v1_body(tmp_path, content=[{"prompt": "x"}])
    schema_format = {"type": "json_schema", "json_schema": {"name": "deep"}}
    cases = [
        (v1, "model_config.rope_scaling", ["body", "model_config", "rope_scaling"]),
        (v1, "model_config.override_neuron_config", ["body", "model_config", "override_neuron_config"]),
        (v1, "model_config.mm_processor_kwargs", ["body", "model_config", "mm_processor_kwargs"]),
        (completion, "content.0.guided_json", ["body", "content", 0, "guided_json"]),
        (
            _with(completion, "content.0.response_format", schema_format),
            "content.0.response_format.json_schema.schema",
            ["body", "content", 0, "response_format"],
        ),
    ]
    for depth in (100, 900):
        for body, path, location in cases:
            response = _post(client, "/v2/batch-completions", _with(body, path, _nested(depth)))
            assert response.status_code == 422, (path, depth, response.status_code, response.text)
            if depth == 100:  # parsed, then refused by the contract's depth bound: it names the field
                assert any(loc[: len(location)] == location for loc in _locations(response)), (path, response.text)
            else:  # deeper than any JSON this API parses: the body is named
                assert all(loc[0] == "body" for loc in _locations(response)), response.text
    whole_body = b"[" * 100_000 + b"]" * 100_000
    response = _post(client, "/v2/batch-completions", whole_body)
    assert response.status_code == 422 and _locations(response)[0][0] == "body", response.text
    assert api.store.list().jobs == []


def _token_id_prompts(tmp_path, requests: int) -> dict:
    # Prompts given as token ids: 2000 five-digit ids each, ~12 KB of a body a request.
    return _v1_body(tmp_path, content=[{"prompt": [30_000 + i % 9 for i in range(2000)]} for _ in range(requests)])


def test_a_body_of_millions_of_token_ids_gets_422_naming_the_field_and_nothing_is_stored(served, tmp_path):
    """900 completion requests of 2000 token ids (12 MB) hold 1.8 million values: past the bound of a body's,
    refused naming `content` before pydantic builds each id; a body within it is taken."""
    api, client = served
    v1_prompts = _v1_body(tmp_path, content={"prompts": ["ab"] * 1_100_000, "max_new_tokens": 1})
    for body, location in (
        (_token_id_prompts(tmp_path, 900), ["body", "content"]),
        (v1_prompts, ["body", "content", "prompts"]),
    ):
        response = _post(client, "/v2/batch-completions", body)
        assert response.status_code == 422, (response.status_code, response.text[:500])
        [error] = response.json()["detail"]
        assert error["loc"] == location and "more than 1000000 JSON values" in error["msg"], error
    assert api.store.list().jobs == []
    within = _post(client, "/v2/batch-completions", _token_id_prompts(tmp_path, 400))
    assert within.status_code == 200, within.text[:500]


def test_a_body_of_millions_of_token_ids_is_refused_holding_about_the_body(tmp_path):
    """pydantic builds every token id (~36 bytes each, ~6 on the wire) before a bound is checked: 12 MB of
    them held 88 MB while parsed; refused by their count first, the parse holds a fraction of the body."""
    import tracemalloc

    from fastapi.exceptions import RequestValidationError

    from batch_pipeline.api.body import parse_json_body
    from batch_pipeline.contract.requests import CreateBatchCompletionsV2Request

    raw = json.dumps(_token_id_prompts(tmp_path, 900)).encode()
    tracemalloc.start()
    try:
        with pytest.raises(RequestValidationError) as refused:
            parse_json_body(raw, CreateBatchCompletionsV2Request)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [error["loc"] for error in refused.value.errors()] == [("body", "content")]
    assert peak < len(raw), (peak, len(raw))


def test_huge_numbers_get_422_and_are_never_stored(served, tmp_path):
    api, client = served
    v1 = _v1_body(tmp_path)
    completion = _v1_body(tmp_path, content=[{"prompt": "x"}])
    cases = [
        (v1, "content.max_new_tokens", ["body", "content", "max_new_tokens"]),
        (v1, "gpus", ["body", "gpus"]),
        (v1, "data_parallelism", ["body", "data_parallelism"]),
        (v1, "max_runtime_sec", ["body", "max_runtime_sec"]),
        (v1, "model_config.seed", ["body", "model_config", "seed"]),
        (v1, "model_config.max_model_len", ["body", "model_config", "max_model_len"]),
        (completion, "content.0.seed", ["body", "content", 0, "seed"]),
        (completion, "content.0.max_tokens", ["body", "content", 0, "max_tokens"]),
    ]
    for value in (10**100, -(10**100), HUGE, 2**63):
        for body, path, location in cases:
            response = _post(client, "/v2/batch-completions", _with(body, path, value))
            assert response.status_code == 422, (path, value, response.status_code, response.text)
            assert any(loc[: len(location)] == location for loc in _locations(response)), (path, response.text)
    as_float = _post(
        client, "/v2/batch-completions", json.dumps(v1).replace('"temperature": 0.0', '"temperature": 1e400').encode()
    )
    assert as_float.status_code == 422 and ["body", "content", "temperature"] in _locations(as_float), as_float.text
    assert api.store.list().jobs == []


def test_priority_is_bounded_on_create_and_update(served, tmp_path):
    api, client = served
    # Longer than the store keeps: refused, naming the field.
    for priority in ("1" + "0" * 100, "0" * 5000 + "1", "x" * 10_000):
        response = _post(client, "/v2/batch-completions", _v1_body(tmp_path, priority=priority))
        assert response.status_code == 422, (priority[:20], response.status_code, response.text)
        assert _locations(response) == [["body", "priority"]]
    assert api.store.list().jobs == []
    # Integers past the named levels run at the bound: no key jumps ahead of `highest`.
    for priority in ("21", "-21", "20", "-20", "highest", "lowest", "9" * 64, " 7 "):
        assert _post(client, "/v2/batch-completions", _v1_body(tmp_path, priority=priority)).status_code == 200
    # No tenants file: no team's cap, only the contract's bounds.
    levels = {record.priority: run_tags(record, None)["dagster/priority"] for record in api.store.list().jobs}
    assert levels == {
        "21": "20",
        "-21": "-20",
        "20": "20",
        "-20": "-20",
        "highest": "20",
        "lowest": "-20",
        "9" * 64: "20",
        " 7 ": "7",
    }
    job_id = api.store.list().jobs[0].job_id
    for priority in ("1" + "0" * 100, "0" * 5000 + "1"):
        response = _post(client, f"/v2/batch-completions/{job_id}", {"job_id": job_id, "priority": priority})
        assert response.status_code == 422, (priority[:20], response.status_code, response.text)
    assert api.store.get(job_id).priority == " 7 "


# The largest labels a job may carry: 64 pairs, 64-character keys, 512-character values.
LARGEST_LABELS = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(64)}
# Labels past each bound, and what the 422 must name: the label, or how many there are.
LABELS_PAST_THE_BOUNDS = [
    ({"k" * 65: "v"}, "k" * 64),
    ({"x" * 5000: "v"}, "x" * 64),  # a 5 kB key was a 500
    ({"team": "v" * 513}, "'team'"),
    ({"team": "v" * 6000}, "'team'"),  # a 6,000-character value broke Dagster's tag index on Postgres
    ({"team": "y" * 2**21}, "'team'"),
    ({f"k{i}": "v" for i in range(65)}, "at most 64 labels"),
    ({f"k{i}": "v" for i in range(20_000)}, "at most 64 labels"),
]


def test_labels_past_their_bounds_get_422_naming_the_label_and_the_largest_allowed_are_the_runs_tags(served, tmp_path):
    api, client = served
    for labels, named in LABELS_PAST_THE_BOUNDS:
        v1_model_config = _with(_v1_body(tmp_path), "model_config.labels", labels)
        for route, body, location in [
            ("/v2/batch-completions", _v1_body(tmp_path, labels=labels), ["body", "labels"]),
            ("/v1/llm/batch-completions", _v1_body(tmp_path, labels=labels), ["body", "labels"]),
            # Where Scale's SDK puts a v1 job's labels.
            ("/v1/llm/batch-completions", v1_model_config, ["body", "model_config", "labels"]),
        ]:
            response = _post(client, route, body)
            assert response.status_code == 422, (route, named[:20], response.status_code, response.text[:500])
            ((error,),) = [[error for error in response.json()["detail"] if error["loc"] == location]]
            assert named in error["msg"], (route, error)
            assert len(response.content) < 2000, "the answer does not echo the label"
    # A v1 job's labels are both sets together: 40 and 40 different ones are more than 64.
    split = _with(_v1_body(tmp_path, labels={f"a{i}": "v" for i in range(40)}), "model_config.labels", {})
    split["model_config"]["labels"] = {f"b{i}": "v" for i in range(40)}
    response = _post(client, "/v1/llm/batch-completions", split)
    assert response.status_code == 422, response.text
    assert [error["loc"] for error in response.json()["detail"]] == [["body", "model_config"]]
    assert "model_config.labels and labels together are 80 labels" in response.json()["detail"][0]["msg"]
    # An OpenAI batch's metadata (its job's labels) is held to OpenAI's 16 pairs, 64 and 512 characters.
    bearer = {"Authorization": f"Bearer {USER_KEY}"}
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"team": "v" * 513}):
        body = {"input_file_id": "file-none", "endpoint": "/v1/completions", "metadata": metadata}
        response = _post(client, "/v1/batches", body, headers=bearer)
        assert response.status_code == 400 and response.json()["error"]["param"] == "metadata", response.text
    assert api.store.list().jobs == []

    # The largest labels allowed are the job's labels, and its run's tags, on both routes.
    v2 = _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels=LARGEST_LABELS))
    v1 = _post(client, "/v1/llm/batch-completions", _with(_v1_body(tmp_path), "model_config.labels", LARGEST_LABELS))
    # The same 64 keys in both v1 sets are 64 labels.
    both = _post(
        client,
        "/v1/llm/batch-completions",
        _with(_v1_body(tmp_path, labels=LARGEST_LABELS), "model_config.labels", LARGEST_LABELS),
    )
    for response in (v2, v1, both):
        assert response.status_code == 200, response.text
        job = client.get(f"/v2/batch-completions/{response.json()['job_id']}").json()["job"]
        assert json.loads(job["metadata"]["labels"]) == LARGEST_LABELS
    tick = _sensor_run_requests(api)
    assert len(tick) == 3
    for request in tick:
        assert {key: value for key, value in request.tags.items() if key.startswith(LABEL_TAG_PREFIX)} == {
            label_tag_key(key): value for key, value in LARGEST_LABELS.items()
        }


# Keys a label may have that Dagster refuses in a tag key (it warns now, and says it will refuse them).
ODD_LABEL_KEYS = ["cost center", "team/search", "équipe", "", "a" * 64, "a b", "a_b", "x" * 63]


def test_every_label_is_a_run_tag_dagster_allows_and_no_two_labels_share_one(served, tmp_path):
    """Every label tag (`batch_pipeline/label/<key>`, two namespace sections) was one Dagster deprecates,
    whatever the key; a future Dagster that refuses them would fail every labelled job's run."""
    from dagster._utils.tags import is_valid_tag_key

    api, client = served
    labels = {key: f"value {i}" for i, key in enumerate(ODD_LABEL_KEYS)}
    # A key Dagster allows, spelling the tag another key is written as.
    labels[label_tag_key("cost center").removeprefix(LABEL_TAG_PREFIX)] = "spelled like cost center's tag"
    response = _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels=labels))
    assert response.status_code == 200, response.text
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # Dagster's warning for a non-compliant tag key
        (request,) = _sensor_run_requests(api)
    assert all(is_valid_tag_key(key) for key in request.tags), [k for k in request.tags if not is_valid_tag_key(k)]
    label_tags = {key: value for key, value in request.tags.items() if key.startswith(LABEL_TAG_PREFIX)}
    assert sorted(label_tags.values()) == sorted(labels.values())  # one tag a label
    assert label_tags[LABEL_TAG_PREFIX + "x" * 63] == labels["x" * 63]  # an allowed key is itself


def test_a_model_name_longer_than_the_store_keeps_gets_422(served, tmp_path):
    api, client = served
    for route in ("/v1/llm/batch-completions", "/v2/batch-completions"):
        response = _post(client, route, _with(_v1_body(tmp_path), "model_config.model", "m" * 257))
        assert response.status_code == 422, response.text
        assert _locations(response) == [["body", "model_config", "model"]], response.text
    assert api.store.list().jobs == []


def test_idempotency_key_empty_is_refused_and_a_different_body_conflicts(served, tmp_path):
    api, client = served
    empty = _post(client, "/v2/batch-completions", _v1_body(tmp_path), headers={"Idempotency-Key": ""})
    assert empty.status_code == 422 and _locations(empty) == [["header", "Idempotency-Key"]], empty.text
    assert api.store.list().jobs == []

    key = {"Idempotency-Key": "order-1"}
    first = _post(client, "/v2/batch-completions", _v1_body(tmp_path), headers=key)
    assert first.status_code == 200
    again = _post(client, "/v2/batch-completions", _v1_body(tmp_path), headers=key)
    assert again.status_code == 200 and again.json()["job_id"] == first.json()["job_id"]
    # The same request with a default spelled out is the same request.
    spelled_out = _post(client, "/v2/batch-completions", _v1_body(tmp_path, data_parallelism=1), headers=key)
    assert spelled_out.status_code == 200 and spelled_out.json()["job_id"] == first.json()["job_id"]
    different = _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels={"team": "b"}), headers=key)
    assert different.status_code == 409, different.text
    assert "Idempotency-Key" in different.json()["detail"]
    v1_route = _post(client, "/v1/llm/batch-completions", _v1_body(tmp_path, priority="high"), headers=key)
    assert v1_route.status_code == 409, v1_route.text
    assert [job.job_id for job in api.store.list().jobs] == [first.json()["job_id"]]


def test_malformed_job_ids_are_404_not_5xx(served):
    _, client = served
    for job_id in ("x%00y", "%ED%A0%80", "a" * 5000):
        assert client.get(f"/v2/batch-completions/{job_id}").status_code == 404
        assert client.post(f"/v2/batch-completions/{job_id}/actions/cancel").status_code == 404


def test_the_jobs_database_is_not_readable_by_other_users(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    store.list().jobs  # opens the database: its WAL and shared-memory files appear
    files = [tmp_path / name for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm")]
    assert all(path.exists() for path in files[:2])
    for path in files:
        if path.exists():
            assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, (path, oct(os.stat(path).st_mode))
    store.engine.dispose()


def _insert_poisoned(store: JobStore, job_id: str, request_text: str, labels_text: str = "{}") -> None:
    """A row as an older server could have stored it, written straight into the store."""
    from datetime import datetime, timedelta

    now = datetime.now(UTC) - timedelta(minutes=5)  # older than every job the API stores next
    with store.engine.begin() as connection:
        connection.execute(
            jobs.insert().values(
                job_id=job_id,
                owner=_alice_owner(),
                idempotency_key=None,
                request=request_text,
                priority=None,
                labels=labels_text,
                created_at=now,
                expires_at=now + timedelta(days=1),
                run_id=None,
                cancelled_at=None,
            )
        )


def _alice_owner() -> str:
    import hashlib

    return hashlib.sha256(USER_KEY.encode()).hexdigest()[:24]


def _sensor_run_requests(api, **resources: object) -> list[dg.RunRequest]:
    context = dg.build_sensor_context(
        instance=api.instance, resources=sensor_resources(str(api.store.engine.url), **resources)
    )
    return list(batch_jobs_sensor(interval_s=1)(context) or [])


def _poison(api, tmp_path) -> list[str]:
    """Jobs that cannot become runs, all older than any good job: a request the contract refuses, a label
    with a lone surrogate (a run tag SQLite cannot encode), a priority longer than the store keeps, a row
    that is not JSON."""
    good = _v1_body(tmp_path)
    poisoned = {
        "batch-poison-invalid": (json.dumps({**good, "content": {"prompts": "not a list"}}), "{}"),
        "batch-poison-surrogate": (
            json.dumps({**good, "labels": {"team": LONE_SURROGATE}}),
            json.dumps({"team": LONE_SURROGATE}),
        ),
        "batch-poison-not-json": ("{not json", "{}"),
    }
    for job_id, (request_text, labels_text) in poisoned.items():
        _insert_poisoned(api.store, job_id, request_text, labels_text)
    with api.store.engine.begin() as connection:  # a priority longer than its column (SQLite keeps it)
        connection.execute(jobs.update().where(jobs.c.job_id == "batch-poison-invalid").values(priority="1" + "0" * 70))
    return list(poisoned)


def test_a_job_that_cannot_become_a_run_is_failed_with_the_reason_and_the_others_go_on(served, tmp_path):
    api, client = served
    poisoned = _poison(api, tmp_path)
    good = _post(client, "/v2/batch-completions", _v1_body(tmp_path)).json()["job_id"]

    assert [request.run_key for request in _sensor_run_requests(api)] == [good]
    for job_id in poisoned:
        job = client.get(f"/v2/batch-completions/{job_id}")
        assert job.status_code == 200, job.text
        assert job.json()["job"]["status"] == "failed", job.text
        assert job.json()["job"]["metadata"]["failure_reason"].startswith("could not start"), job.text
    assert (
        "labels"
        in client.get("/v2/batch-completions/batch-poison-surrogate").json()["job"]["metadata"]["failure_reason"]
    )
    listed = client.get("/v2/batch-completions")
    assert listed.status_code == 200 and len(listed.json()["jobs"]) == 4
    # Failed jobs are not taken again, and cannot be reprioritised or cancelled.
    assert [request.run_key for request in _sensor_run_requests(api)] == [good]
    cancel = client.post("/v2/batch-completions/batch-poison-invalid/actions/cancel").json()
    assert cancel["success"] is False and cancel["reason"].startswith("the job has ended (failed)")


def test_a_sensor_tick_stays_small_whatever_the_jobs_sizes_their_content_is_by_reference(served, tmp_path):
    api, client = served
    big = {"prompts": ["y" * 1_000_000], "max_new_tokens": 1, "temperature": 0.0}
    job_ids = [
        _post(client, "/v2/batch-completions", _v1_body(tmp_path, content=big)).json()["job_id"] for _ in range(5)
    ]
    tick = _sensor_run_requests(api)
    assert [request.run_key for request in tick] == job_ids  # every job in one tick, oldest first
    for request in tick:
        config = request.run_config["ops"]["validate_input"]["config"]
        assert "content" not in config and len(json.dumps(request.run_config)) < 4096
        with open(config["content_path"]) as handle:  # the content as sent, in the job's own work dir
            stored = json.load(handle)
        assert {key: stored[key] for key in big} == big
        assert os.stat(config["content_path"]).st_mode & 0o077 == 0
    assert len(api.store.get(job_ids[0]).request_json) < 4096


def test_rows_an_older_release_stored_with_inline_content_are_bounded_per_tick(served, tmp_path):
    api, client = served
    big = {"prompts": ["y" * 100_000], "max_new_tokens": 1, "temperature": 0.0}
    job_ids = [f"batch-legacy-{i}" for i in range(5)]
    for job_id in job_ids:
        _insert_poisoned(api.store, job_id, json.dumps(_v1_body(tmp_path, content=big)))
    first_tick = [
        request.run_key for request in _sensor_run_requests(api, run_launching=RunLaunching(max_tick_bytes=300_000))
    ]
    assert len(first_tick) == 2, first_tick  # while the next would pass the bound
    assert len(_sensor_run_requests(api, run_launching=RunLaunching(max_tick_bytes=1))) == 1  # one at least


@pytest.mark.slow
def test_with_the_daemon_a_poisoned_job_does_not_stop_the_queue(served, tmp_path):
    api, client = served
    _poison(api, tmp_path)
    good = [_post(client, "/v2/batch-completions", _v1_body(tmp_path)).json()["job_id"] for _ in range(2)]
    api.start_daemon()
    deadline = time.monotonic() + 180
    while True:
        runs = api.instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"))
        if len(runs) >= 2:
            break
        log = (api.home / "daemon.log").read_text() if (api.home / "daemon.log").exists() else ""
        assert time.monotonic() < deadline, f"the good jobs got no runs; daemon log tail:\n{log[-3000:]}"
        time.sleep(1)
    time.sleep(3)
    runs = api.instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"))
    assert sorted(run.tags[JOB_ID_TAG] for run in runs) == sorted(good)
    assert client.get("/v2/batch-completions/batch-poison-surrogate").json()["job"]["status"] == "failed"


def test_a_list_of_jobs_with_the_largest_labels_is_paged_by_size_and_loses_no_job(served, tmp_path):
    """1,000 jobs of the widest labels allowed made one LIST answer 518 MB (the API at 2.2 GB): a page now
    ends at a few MB, whatever its `limit`, and its cursor leads to the rest."""
    _, client = served
    # 64 labels of a 64-character key and a 512-character value, each character 4 bytes in UTF-8.
    widest = {f"{i:02d}" + "\U0001f600" * 62: "\U0001f680" * 512 for i in range(64)}
    created = {
        _post(client, "/v2/batch-completions", _v1_body(tmp_path, labels=widest)).json()["job_id"] for _ in range(70)
    }
    assert len(created) == 70
    seen, after, pages = [], None, 0
    while True:
        response = client.get("/v2/batch-completions", params={"limit": 1000, **({"after": after} if after else {})})
        assert response.status_code == 200, response.text[:300]
        assert len(response.content) < 16 * 2**20, f"a page of {len(response.content)} bytes"
        page = response.json()
        seen += [job["job_id"] for job in page["jobs"]]
        assert all(json.loads(job["metadata"]["labels"]) == widest for job in page["jobs"])
        pages += 1
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages > 1
    assert sorted(seen) == sorted(created) and len(seen) == len(set(seen))
