"""The API over HTTP against a real Dagster instance: routes, errors, auth, the store and the sensor."""

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from batch_pipeline.api.offline_docs import add_offline_docs
from batch_pipeline.pipeline.sensors import batch_jobs_sensor
from batch_pipeline.pipeline.tags import JOB_ID_TAG
from tests.api_fixtures import ADMIN_KEY, OTHER_KEY, USER_KEY, sensor_resources
from tests.conftest import MODEL

ALICE = {"x-api-key": USER_KEY}
BOB = {"x-api-key": OTHER_KEY}


def _body(tmp_path, name="out", **fields):
    return {
        "output_data_path": str(tmp_path / name / "output.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0},
        **fields,
    }


def _sensor_run_requests(deployment):
    context = dg.build_sensor_context(
        instance=deployment.instance, resources=sensor_resources(str(deployment.store.engine.url))
    )
    return list(batch_jobs_sensor(interval_s=1)(context) or [])


def test_health_and_openapi_name_the_spec_routes_and_schemas(deployment_factory):
    api = deployment_factory()
    assert api.client.get("/healthz").json() == {"status": "ok"}
    schema = api.client.get("/openapi.json").json()
    assert {
        "/v1/llm/batch-completions",
        "/v2/batch-completions",
        "/v2/batch-completions/{job_id}",
        "/v2/batch-completions/{job_id}/actions/cancel",
    } <= set(schema["paths"])
    assert {"CreateBatchCompletionsV1Request", "CreateBatchCompletionsV2Request", "BatchCompletionsJob"} <= set(
        schema["components"]["schemas"]
    )


def test_the_docs_page_loads_swagger_ui_from_this_server_not_a_cdn(deployment_factory):
    """Issue 46: `/docs` was blank offline, FastAPI's page fetching Swagger UI from a CDN."""
    api = deployment_factory()
    page = api.client.get("/docs")
    assert page.status_code == 200
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "/docs/static/swagger-ui-bundle.js" in sources and "/docs/static/swagger-ui.css" in sources
    assert not [source for source in sources if "//" in source]  # nothing from another host
    script = api.client.get("/docs/static/swagger-ui-bundle.js")
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text[:2000]
    assert script.headers["content-type"].startswith("text/javascript")
    assert api.client.get("/docs/static/swagger-ui.css").status_code == 200
    for other in ("swagger-ui-bundle.js.LICENSE.txt", "..%2F..%2F__init__.py", "../../__init__.py"):
        assert api.client.get(f"/docs/static/{other}").status_code == 404, other

    # Where no installed package ships the files, the page says so and where the document is.
    bare = FastAPI(docs_url=None)
    add_offline_docs(bare, None)
    with TestClient(bare) as client:
        said = client.get("/docs").text
    assert "not installed here" in said and 'href="/openapi.json"' in said


def test_v1_and_v2_create_then_get_and_list(deployment_factory, tmp_path):
    api = deployment_factory()
    v1 = api.client.post("/v1/llm/batch-completions", json=_body(tmp_path, labels={"team": "a"}), headers=ALICE)
    assert v1.status_code == 200 and set(v1.json()) == {"job_id"}
    v2 = api.client.post("/v2/batch-completions", json=_body(tmp_path, "two", priority="high"), headers=ALICE)
    assert v2.status_code == 200
    job = v2.json()
    assert job["status"] == "queued" and job["priority"] == "high"
    assert job["model_config"]["model"] == MODEL and job["completed_at"] is None
    assert job["output_data_path"].endswith("two/output.json")

    fetched = api.job(v1.json()["job_id"])
    assert fetched["status"] == "queued" and fetched["metadata"]["labels"] == json.dumps({"team": "a"})
    # The model config as asked, not a null for each of its ~40 optional fields; the job's own nullable
    # fields the spec requires stay.
    assert fetched["model_config"] == {"model": MODEL, "trust_remote_code": False, "num_shards": 1}
    assert fetched["completed_at"] is None and "input_data_path" in fetched

    listed = api.client.get("/v2/batch-completions", headers=ALICE).json()["jobs"]
    assert [j["job_id"] for j in listed] == [job["job_id"], v1.json()["job_id"]]  # newest first
    by_label = api.client.get("/v2/batch-completions", params={"label": "team:a"}, headers=ALICE).json()["jobs"]
    assert [j["job_id"] for j in by_label] == [v1.json()["job_id"]]
    assert api.client.get("/v2/batch-completions", params={"status": "completed"}, headers=ALICE).json()["jobs"] == []


def test_bad_bodies_get_422_naming_the_field(deployment_factory, tmp_path):
    api = deployment_factory()
    cases = [
        (
            _body(tmp_path, content={"prompts": ["x"], "max_new_tokens": 4, "temperature": 1.5}),
            ["body", "content", "temperature"],
        ),
        (_body(tmp_path, data_parallelism=65), ["body", "data_parallelism"]),
        (
            {"model_config": {"model": MODEL}, "content": {"prompts": [], "max_new_tokens": 1, "temperature": 0}},
            ["body", "output_data_path"],
        ),
        (_body(tmp_path, priority="x" * 65), ["body", "priority"]),  # longer than the store keeps
        (_body(tmp_path, tool_config={"name": "web_browser"}), ["body", "tool_config", "name"]),
        (
            _body(tmp_path, tool_config={"name": "code_evaluator", "max_iterations": 0}),
            ["body", "tool_config", "max_iterations"],
        ),
        (_body(tmp_path, nodes_per_worker=2), ["body", "nodes_per_worker"]),
        # a catalog model misspelled: refused now, not after its engine searched the hub for minutes
        (_body(tmp_path, model_config={"model": "smollm2-135m"}), ["body", "model_config", "model"]),
        (_body(tmp_path, model_config={"model": "SmolLM2-135M-instruc"}), ["body", "model_config", "model"]),
        # the catalog's embedding model generates no text: none of a batch completion's requests could run
        (_body(tmp_path, model_config={"model": "all-minilm-l6-v2"}), ["body", "model_config", "model"]),
        # past the catalog model's 8,192-token context with any prompt, or past the engine's own max_model_len
        (
            _body(tmp_path, content={"prompts": ["x"], "max_new_tokens": 500_000, "temperature": 0}),
            ["body", "content", "max_new_tokens"],
        ),
        (
            _body(
                tmp_path,
                model_config={"model": MODEL, "max_model_len": 512},
                content={"prompts": ["x"], "max_new_tokens": 512, "temperature": 0},
            ),
            ["body", "content", "max_new_tokens"],
        ),
    ]
    completions = api.client.post(
        "/v2/batch-completions", json=_body(tmp_path, content=[{"prompt": "x", "max_tokens": 3}]), headers=ALICE
    )
    assert completions.status_code == 200
    for body, location in cases:
        response = api.client.post("/v1/llm/batch-completions", json=body, headers=ALICE)
        assert response.status_code == 422, body
        assert any(error["loc"] == location for error in response.json()["detail"]), response.json()
    typo = api.client.post(
        "/v2/batch-completions", json=_body(tmp_path, model_config={"model": "smollm2-135m"}), headers=ALICE
    )
    assert typo.status_code == 422 and typo.json()["detail"][0]["loc"] == ["body", "model_config", "model"]
    v2 = api.client.post(
        "/v2/batch-completions", json=_body(tmp_path, content=[{"prompt": "x", "n": 0}]), headers=ALICE
    )
    assert v2.status_code == 422
    assert v2.json()["detail"][0]["loc"] == ["body", "content", 0, "n"]  # the wire's path: no `completion` in it
    mixed = [{"prompt": "a"}, {"prompt": "b"}, {"messages": [{"role": "user", "content": "hi"}]}]
    both = api.client.post("/v2/batch-completions", json=_body(tmp_path, content=mixed), headers=ALICE)
    assert both.status_code == 422
    (error,) = both.json()["detail"]
    assert error["loc"] == ["body", "content", 2] and "request 2 is a chat request" in error["msg"], error
    # tool_config with a list of requests is accepted, as Scale's server does (the job runs them without the
    # tool: test_code_evaluator_e2e); a tool it does not know or an over-long timeout is still refused.
    tools_on_chat = _body(
        tmp_path, content=[{"messages": [{"role": "user", "content": "x"}]}], tool_config={"name": "code_evaluator"}
    )
    assert api.client.post("/v2/batch-completions", json=tools_on_chat, headers=ALICE).status_code == 200
    for tool_config, location in [
        ({"name": "web_browser"}, ["body", "tool_config", "name"]),
        (
            {"name": "code_evaluator", "execution_timeout_seconds": 601},
            ["body", "tool_config", "execution_timeout_seconds"],
        ),
    ]:
        refused = api.client.post(
            "/v2/batch-completions", json={**tools_on_chat, "tool_config": tool_config}, headers=ALICE
        )
        assert refused.status_code == 422
        assert refused.json()["detail"][0]["loc"] == location


def test_auth_keys_and_ownership(deployment_factory, tmp_path):
    api = deployment_factory()
    assert api.client.post("/v2/batch-completions", json=_body(tmp_path)).status_code == 401
    assert (
        api.client.post("/v2/batch-completions", json=_body(tmp_path), headers={"x-api-key": "nope"}).status_code == 401
    )
    basic = {"authorization": "Basic " + base64.b64encode(f"{USER_KEY}:".encode()).decode()}
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=basic).json()["job_id"]
    assert api.job(job_id)["job_id"] == job_id  # the same key by header: the same owner
    for route in (f"/v2/batch-completions/{job_id}",):
        assert api.client.get(route, headers=BOB).status_code == 404
        assert api.client.get(route).status_code == 401
    assert (
        api.client.post(
            f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": "1"}, headers=BOB
        ).status_code
        == 404
    )
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=BOB).status_code == 404
    assert api.client.get("/v2/batch-completions", headers=BOB).json()["jobs"] == []
    assert api.job(job_id, key=ADMIN_KEY)["job_id"] == job_id
    assert api.client.get("/v2/batch-completions/batch-doesnotexist", headers=ALICE).status_code == 404
    every_route = [
        ("POST", "/v1/llm/batch-completions", _body(tmp_path)),
        ("POST", "/v2/batch-completions", _body(tmp_path)),
        ("GET", "/v2/batch-completions", None),
        ("GET", f"/v2/batch-completions/{job_id}", None),
        ("POST", f"/v2/batch-completions/{job_id}", {"job_id": job_id, "priority": "1"}),
        ("POST", f"/v2/batch-completions/{job_id}/actions/cancel", None),
    ]
    for method, route, body in every_route:
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Basic " + base64.b64encode(b"wrong:").decode()}):
            response = api.client.request(method, route, json=body, headers=headers)
            assert response.status_code == 401, (method, route, headers, response.status_code)
    assert api.job(job_id)["status"] == "queued"  # none of those touched the job


def test_idempotency_key_returns_the_same_job(deployment_factory, tmp_path):
    api = deployment_factory()
    headers = {**ALICE, "Idempotency-Key": "retry-me"}
    first = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=headers).json()
    second = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=headers).json()
    assert first["job_id"] == second["job_id"]
    other_user = api.client.post(
        "/v2/batch-completions", json=_body(tmp_path), headers={**BOB, "Idempotency-Key": "retry-me"}
    )
    assert other_user.json()["job_id"] != first["job_id"]
    assert len(api.store.list().jobs) == 2


def test_cancel_before_launch_never_launches(deployment_factory, tmp_path):
    api = deployment_factory()
    kept = api.client.post("/v2/batch-completions", json=_body(tmp_path, "kept"), headers=ALICE).json()["job_id"]
    dropped = api.client.post("/v2/batch-completions", json=_body(tmp_path, "dropped"), headers=ALICE).json()["job_id"]
    assert api.client.post(f"/v2/batch-completions/{dropped}/actions/cancel", headers=ALICE).json() == {"success": True}
    job = api.job(dropped)
    assert job["status"] == "cancelled" and job["completed_at"] is not None
    assert [request.run_key for request in _sensor_run_requests(api)] == [kept]


def test_cancelling_a_job_that_has_ended_says_why_nothing_was_cancelled(deployment_factory, tmp_path):
    from datetime import UTC, datetime

    from batch_pipeline.store.schema import JobStatus

    api = deployment_factory()
    done, broken = (
        api.client.post("/v2/batch-completions", json=_body(tmp_path, name), headers=ALICE).json()["job_id"]
        for name in ("done", "broken")
    )
    api.store.mark_started(done, f"run-{done}")
    api.store.mark_run_ended(done, f"run-{done}", JobStatus.COMPLETED, datetime.now(UTC))
    api.store.mark_failed(broken, "its shard failed")
    completed = api.client.post(f"/v2/batch-completions/{done}/actions/cancel", headers=ALICE)
    assert completed.status_code == 200
    assert completed.json() == {
        "success": False,
        "reason": "the job has ended (completed): there is nothing to cancel; its output is final",
    }
    failed = api.client.post(f"/v2/batch-completions/{broken}/actions/cancel", headers=ALICE).json()
    assert failed["success"] is False and f"/v2/batch-completions/{broken}/actions/resume" in failed["reason"]
    assert api.job(done)["status"] == "completed" and api.job(broken)["status"] == "failed"


def test_priority_update_before_launch_reaches_the_run_tags(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path, priority="low"), headers=ALICE).json()[
        "job_id"
    ]
    response = api.client.post(
        f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": "high"}, headers=ALICE
    )
    assert response.status_code == 200
    assert response.json()["success"] is True and response.json()["priority"] == "high"
    (run_request,) = _sensor_run_requests(api)
    assert run_request.tags["dagster/priority"] == "10"
    assert run_request.tags[JOB_ID_TAG] == job_id
    bad = api.client.post(
        f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": "x" * 65}, headers=ALICE
    )
    assert bad.status_code == 422


@pytest.mark.slow
def test_two_hundred_concurrent_posts_become_two_hundred_jobs_and_runs_once(deployment_factory, tmp_path):
    api = deployment_factory(max_concurrent_runs=0)  # runs stay queued: this is about the control plane
    url = api.serve_http()  # real sockets: 200 clients at once against uvicorn

    def submit(i):
        with httpx.Client(base_url=url, headers=ALICE, timeout=120) as client:
            return client.post("/v2/batch-completions", json=_body(tmp_path, f"o{i}"))

    with ThreadPoolExecutor(max_workers=200) as pool:
        responses = list(pool.map(submit, range(200)))
    assert [r.status_code for r in responses] == [200] * 200
    job_ids = {r.json()["job_id"] for r in responses}
    assert len(job_ids) == 200

    api.start_daemon()
    deadline = time.monotonic() + 300
    while len(api.instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"))) < 200:
        assert time.monotonic() < deadline, "the sensor did not create 200 runs"
        time.sleep(1)
    time.sleep(4)  # more sensor ticks: nothing is launched twice
    runs = api.instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"))
    assert sorted(run.tags[JOB_ID_TAG] for run in runs) == sorted(job_ids)
    assert _sensor_run_requests(api) == []
    assert {api.job(job_id)["status"] for job_id in list(job_ids)[:5]} == {"queued"}


def test_a_body_over_the_size_limit_gets_413_declared_or_streamed(deployment_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_BODY_BYTES", "4096")
    api = deployment_factory()
    big = _body(tmp_path, content={"prompts": ["x" * 5000], "max_new_tokens": 1, "temperature": 0.0})
    assert api.client.post("/v2/batch-completions", json=big, headers=ALICE).status_code == 413

    def chunks():
        payload = json.dumps(big).encode()
        for start in range(0, len(payload), 1000):
            yield payload[start : start + 1000]

    streamed = api.client.post(
        "/v2/batch-completions", content=chunks(), headers={**ALICE, "content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert api.store.list().jobs == []
    assert api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).status_code == 200


def test_local_paths_outside_the_data_roots_are_refused(deployment_factory, tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "in").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(root))
    api = deployment_factory()
    content = {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0}
    refused = {
        "output_data_path": [f"{root}/../outside.json", "/etc/cron.d/evil", f"{root}/escape/passwd", "relative.json"],
        "input_data_path": ["/etc/passwd", f"{root}/in/../../secrets.json"],
    }
    for field, paths in refused.items():
        for path in paths:
            body = {"output_data_path": f"{root}/out.json", "model_config": {"model": MODEL}, field: path}
            if field == "output_data_path":
                body["content"] = content
            response = api.client.post("/v2/batch-completions", json=body, headers=ALICE)
            assert response.status_code == 422, (field, path)
            assert response.json()["detail"][0]["loc"] == ["body", field]
    inside = {"output_data_path": f"{root}/out/o.json", "model_config": {"model": MODEL}, "content": content}
    assert api.client.post("/v2/batch-completions", json=inside, headers=ALICE).status_code == 200
    remote = {**inside, "output_data_path": "s3://bucket/o.json"}
    assert api.client.post("/v2/batch-completions", json=remote, headers=ALICE).status_code == 200
