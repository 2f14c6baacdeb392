"""Two teams sharing one deployment through the tenants file: each sees its own jobs and files, names only
paths inside its own data roots, and learns nothing of the other's; admins see both."""

import base64
import hashlib
import json
import os
import stat
import subprocess
import time

import dagster as dg
import httpx
import pytest
from fastapi.testclient import TestClient

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.api.app import create_app
from batch_pipeline.api.auth import ApiKeys
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.core.io import SymlinkRefused
from batch_pipeline.core.settings import settings
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.tenancy.tenants import ADMINS_OWNER, Tenants, TenantsFileError
from tests.api_fixtures import USER_KEY
from tests.conftest import MODEL

# Keys may hold any character: a colon, a space, non-ASCII.
TEAM_A_KEYS = ("acme:9f8e7d6c5b4a", "a second key of team a, with spaces é")
TEAM_B_KEY = "bravo-key"
ADMIN_KEY = "root:of:all"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _headers(key: str) -> dict[str, bytes]:
    return {"x-api-key": key.encode()}  # a key's UTF-8 bytes, as clients send them


def _basic(user: str, password: str = "") -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def teams(tmp_path, monkeypatch):
    """Roots for team-a and team-b, and the tenants file naming them, as the deployment's."""
    roots = {"a": tmp_path / "srv" / "team-a", "b": tmp_path / "srv" / "team-b"}
    for root in roots.values():
        root.mkdir(parents=True)
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  team-a:\n"
        f"    api_keys_sha256: [{', '.join(_digest(key) for key in TEAM_A_KEYS)}]\n"
        f'    data_roots: ["{roots["a"]}", "s3://team-a-data/batch/"]\n'
        "  team-b:\n"
        f"    api_keys_sha256: [{_digest(TEAM_B_KEY)}]\n"
        f'    data_roots: ["{roots["b"]}"]\n'
        "admins:\n"
        f"  api_keys_sha256: [{_digest(ADMIN_KEY)}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _request(output: str, **fields) -> dict:
    return {
        "output_data_path": output,
        "model_config": {"model": MODEL},
        "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        **fields,
    }


def _refused_fields(response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {".".join(map(str, error["loc"][1:])): error["msg"] for error in response.json()["detail"]}


def test_every_key_of_a_team_sees_its_jobs_and_no_other_team_does(api, teams):
    created = api.post(
        "/v2/batch-completions", json=_request(str(teams["a"] / "out.json")), headers=_headers(TEAM_A_KEYS[0])
    )
    assert created.status_code == 200, created.text
    job_id = created.json()["job_id"]

    assert api.get(f"/v2/batch-completions/{job_id}", headers=_headers(TEAM_A_KEYS[1])).status_code == 200
    assert [
        job["job_id"] for job in api.get("/v2/batch-completions", headers=_headers(TEAM_A_KEYS[1])).json()["jobs"]
    ] == [job_id]
    assert api.get(f"/v2/batch-completions/{job_id}", headers=_headers(TEAM_B_KEY)).status_code == 404
    assert api.get("/v2/batch-completions", headers=_headers(TEAM_B_KEY)).json()["jobs"] == []
    assert api.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=_headers(TEAM_B_KEY)).status_code == 404
    assert api.get(f"/v2/batch-completions/{job_id}", headers=_headers(ADMIN_KEY)).status_code == 200


def test_a_key_is_the_whole_key_whatever_it_holds(api):
    """`acme` alone used to authenticate for `acme:9f8e…`: the key was cut at its first colon."""
    key = TEAM_A_KEYS[0]
    assert api.get("/v2/batch-completions", headers=_headers(key)).status_code == 200
    assert api.get("/v2/batch-completions", headers=_basic(key)).status_code == 200  # llmengine's basic auth
    assert api.get("/v2/batch-completions", headers={"authorization": f"Bearer {key}".encode()}).status_code == 200
    for near in ("acme", "acme:", key[:-1], key + " x", key.upper()):
        assert api.get("/v2/batch-completions", headers=_headers(near)).status_code == 401, near
    assert api.get("/v2/batch-completions", headers=_basic("acme", "9f8e7d6c5b4a")).status_code == 401


def test_without_a_tenants_file_a_key_with_a_colon_is_still_the_whole_key(tmp_path):
    keys = ApiKeys(["acme:9f8e7d6c5b4a", "boss:admin"])
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    app = create_app(BatchJobService.of_deployment(settings(), store, dg.DagsterInstance.ephemeral()), keys)
    with TestClient(app) as client:
        assert client.get("/v2/batch-completions", headers=_headers("acme")).status_code == 401
        assert client.get("/v2/batch-completions", headers=_headers("acme:9f8e7d6c5b4a")).status_code == 200
        assert client.get("/metrics", headers=_headers("boss")).status_code == 200  # `:admin` is the role
        assert client.get("/metrics", headers=_headers("acme:9f8e7d6c5b4a")).status_code == 403


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_team_names_no_path_of_another_team_and_learns_nothing_of_it(api, teams, dry_run):
    secret = teams["a"] / "prompts.json"
    secret.write_text(json.dumps([{"prompt": "team a's system prompt"}]))
    secret.chmod(0o600)
    params = {"dry_run": "true"} if dry_run else {}
    own_output = str(teams["b"] / "out.json")

    def refused(body) -> dict[str, str]:
        return _refused_fields(
            api.post("/v2/batch-completions", params=params, json=body, headers=_headers(TEAM_B_KEY))
        )

    body = _request(own_output)
    del body["content"]
    # Another team's file, and another team's missing file: the same answer, no word of either existing.
    existing = refused({**body, "input_data_path": str(secret)})
    missing = refused({**body, "input_data_path": str(teams["a"] / "nothing-here.json")})
    assert set(existing) == {"input_data_path"}
    assert existing == missing
    assert "team a's system prompt" not in json.dumps(existing)
    # The refusal says where team b's paths may lie: its own root, nothing of team a's.
    assert existing["input_data_path"].endswith(f"; yours are {teams['b'].resolve()}"), existing
    assert str(teams["a"]) not in json.dumps(existing) and "team-a-data" not in json.dumps(existing)
    # Another team's output (and its metadata beside it) would be replaced.
    assert set(refused(_request(str(teams["a"] / "out.json")))) == {"output_data_path"}
    # Another bucket, or team a's bucket: team b has no object store root at all.
    for url in ("s3://team-a-data/batch/out.json", "s3://any-bucket/out.json"):
        assert set(refused(_request(url))) == {"output_data_path"}, url
    # A model directory of another team's.
    assert set(refused({**_request(own_output), "model_config": {"model": str(teams["a"])}})) == {"model_config.model"}


def test_a_symlink_in_a_teams_root_does_not_lead_into_another_teams(api, teams):
    (teams["b"] / "shortcut").symlink_to(teams["a"])
    body = _request(str(teams["b"] / "shortcut" / "out.json"))
    assert set(_refused_fields(api.post("/v2/batch-completions", json=body, headers=_headers(TEAM_B_KEY)))) == {
        "output_data_path"
    }


def test_object_store_paths_are_held_to_the_teams_bucket_and_prefix(api, teams):
    key = _headers(TEAM_A_KEYS[0])
    own = teams["a"].resolve()  # a refusal names team a's roots, where its paths may lie
    for url in (
        "s3://team-a-data/other/out.json",
        "s3://team-a-data/batch/../other/out.json",
        "s3://team-a-data2/batch/o",
    ):
        refused = _refused_fields(api.post("/v2/batch-completions", json=_request(url), headers=key))
        assert set(refused) == {"output_data_path"}, url
        if url != "s3://team-a-data/batch/../other/out.json":  # that one's refusal is its `..`
            assert refused["output_data_path"].endswith(f"; yours are {own}, s3://team-a-data/batch/"), refused
    created = api.post("/v2/batch-completions", json=_request("s3://team-a-data/batch/out.json"), headers=key)
    assert created.status_code == 200, created.text


def test_admins_name_any_teams_paths(api, teams):
    for team in ("a", "b"):
        created = api.post(
            "/v2/batch-completions", json=_request(str(teams[team] / "out.json")), headers=_headers(ADMIN_KEY)
        )
        assert created.status_code == 200, created.text
    elsewhere = _request(str(teams["a"].parent / "out.json"))
    assert _refused_fields(api.post("/v2/batch-completions", json=elsewhere, headers=_headers(ADMIN_KEY)))


def test_openai_files_are_the_teams(api):
    uploaded = api.post(
        "/v1/files",
        files={"file": ("in.jsonl", b'{"custom_id": "1"}\n')},
        data={"purpose": "batch"},
        headers={"authorization": f"Bearer {TEAM_A_KEYS[0]}"},
    )
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    assert (
        api.get(f"/v1/files/{file_id}", headers={"authorization": f"Bearer {TEAM_A_KEYS[1]}".encode()}).status_code
        == 200
    )
    assert api.get(f"/v1/files/{file_id}", headers={"authorization": f"Bearer {TEAM_B_KEY}"}).status_code == 404
    assert api.get("/v1/files", headers={"authorization": f"Bearer {TEAM_B_KEY}"}).json()["data"] == []


def test_dagster_home_is_private_to_the_service(api, tmp_path):
    home = tmp_path / "dagster_home"
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    runs_db = home / "history" / "runs.db"
    assert runs_db.exists()
    # What sandboxed model code runs as: another uid, no groups.
    read = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(runs_db)], capture_output=True
    )
    assert read.returncode != 0 and b"Permission denied" in read.stderr


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("tenants:\n  team-a:\n    api_keys_sha256: []\n    data_root: [/srv/a]\n", "line 4: tenants.team-a.data_root"),
        ("tenants:\n  team-a:\n    api_keys_sha256: [nothex]\n", "line 3: tenants.team-a.api_keys_sha256.0"),
        ("tenants:\n  Team A:\n    data_roots: [/srv/a]\n", r"line 2: tenants.Team A.\[key\]"),
        ("tenants:\n  team-a:\n    data_roots: [relative/dir]\n", "line 3: tenants.team-a.data_roots"),
        (
            "tenants:\n  team-a:\n    data_roots: [/srv/a]\n  team-b:\n    data_roots: [/srv/a/b]\n",
            "line 5: tenants.team-b.data_roots",
        ),
        ("tenants:\n  team-a:\n    data_roots: ['s3://bucket//team-a']\n", "line 3: tenants.team-a.data_roots"),
        ("tenants:\n  team-a: {data_roots: [/srv/a]\n", "line 3"),
        ("admins: {}\n", "line 1: tenants"),
    ],
)
def test_a_mistake_in_the_tenants_file_is_named_with_its_line(tmp_path, text, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantsFileError, match=f"^{path}:{named}"):
        Tenants.load(str(path))


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (  # YAML keeps the last of two equal keys: team-a's first roots and keys dropped unseen
            "tenants:\n  team-a:\n    data_roots: [/srv/a]\n  team-b: {}\n  team-a:\n    data_roots: [/srv/c]\n",
            r"line 5: tenants.team-a: listed twice \(first at line 2\)",
        ),
        (
            "tenants:\n  team-a:\n    data_roots: [/srv/a]\n    data_roots: [/srv/c]\n",
            r"line 4: tenants.team-a.data_roots: listed twice \(first at line 3\)",
        ),
        ("admins: {}\nadmins: {}\ntenants: {}\n", "line 2: admins: listed twice"),
        # The usage report's buckets: the admins' figures, and every owner of no team's.
        ("tenants:\n  team-a: {}\n  admins:\n    data_roots: [/srv/a]\n", "line 3: tenants.admins: a reserved name"),
        ("tenants:\n  other: {}\n", "line 2: tenants.other: a reserved name"),
        # One store by another protocol's name, or its name in capitals.
        (
            "tenants:\n  team-a:\n    data_roots: ['s3://bucket/a/']\n  team-b:\n    data_roots: ['S3://bucket/a/b']\n",
            "line 5: tenants.team-b.data_roots: s3://bucket/a/b/ lies inside team-a's data roots",
        ),
        (
            "tenants:\n  team-a:\n    data_roots: ['gs://bucket/a']\n  team-b:\n    data_roots: ['gcs://bucket/a/b']\n",
            "line 5: tenants.team-b.data_roots: gcs://bucket/a/b/ lies inside team-a's data roots",
        ),
        (
            "tenants:\n  team-a:\n    data_roots: ['s3a://bucket']\n  team-b:\n    data_roots: ['s3://bucket/b']\n",
            "line 5: tenants.team-b.data_roots",
        ),
    ],
)
def test_a_team_listed_twice_a_reserved_name_or_a_root_under_another_spelling_is_refused(tmp_path, text, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantsFileError, match=f"^{path}:{named}"):
        Tenants.load(str(path))


def test_the_reserved_team_names_are_the_usage_reports_own_labels():
    from batch_pipeline.api.usage import OTHER, team_label
    from batch_pipeline.tenancy.tenants import RESERVED_TEAM_NAMES

    assert set(RESERVED_TEAM_NAMES) == {team_label(ADMINS_OWNER), OTHER}


def test_one_key_for_two_teams_is_refused(tmp_path):
    path = tmp_path / "tenants.yaml"
    digest = _digest("shared")
    path.write_text(
        f"tenants:\n  team-a:\n    api_keys_sha256: [{digest}]\n  team-b:\n    api_keys_sha256: [{digest}]\n"
    )
    with pytest.raises(TenantsFileError, match="both team-a and team-b"):
        Tenants.load(str(path))


def test_the_service_refuses_to_start_with_its_files_inside_a_teams_root(teams, tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(teams["a"] / "dagster_home"))
    with pytest.raises(TenantsFileError, match="DAGSTER_HOME .* overlaps the data roots of team-a"):
        create_app(BatchJobService.of_deployment(settings(), JobStore("sqlite://"), dg.DagsterInstance.ephemeral()))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BATCH_PIPELINE_WORK_DIR", str(teams["b"] / "work"))
    with pytest.raises(TenantsFileError, match="work dir .* overlaps the data roots of team-b"):
        create_app(BatchJobService.of_deployment(settings(), JobStore("sqlite://"), dg.DagsterInstance.ephemeral()))


# --- what was checked is what is opened: no symlink followed beneath a data root -------------------------


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "out").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(root))
    return root, outside


def test_files_are_written_and_read_beneath_the_root(data_root):
    root, _ = data_root
    files = AdmissionPolicy.of_deployment(settings()).data_files(None)
    with files.atomic_write(str(root / "out" / "new" / "result.json")) as handle:
        handle.write("[]")
    assert (root / "out" / "new" / "result.json").read_text() == "[]"
    assert files.exists(str(root / "out" / "new" / "result.json"))
    with files.open(str(root / "out" / "new" / "result.json")) as handle:
        assert handle.read() == b"[]"
    files.check_writable(str(root / "out" / "other.json"))


def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_written_through(data_root):
    root, outside = data_root
    target = root / "out" / "dir" / "result.json"
    files = AdmissionPolicy.of_deployment(settings()).data_files(None)
    files.check_writable(str(target))  # the check a job makes when it starts
    (root / "out" / "dir").rename(root / "out" / "dir.old")
    (root / "out" / "dir").symlink_to(outside)  # ...and the swap while it runs
    with pytest.raises(SymlinkRefused):
        with files.atomic_write(str(target)) as handle:
            handle.write("[]")
    with pytest.raises(SymlinkRefused):
        files.open(str(target))
    assert list(outside.iterdir()) == []


def test_a_file_swapped_for_a_symlink_is_replaced_not_written_through_and_not_read(data_root):
    root, outside = data_root
    (outside / "secret.json").write_text("other team's")
    link = root / "out" / "result.json"
    link.symlink_to(outside / "secret.json")
    files = AdmissionPolicy.of_deployment(settings()).data_files(None)
    with pytest.raises(SymlinkRefused):
        files.open(str(link))
    with files.atomic_write(str(link)) as handle:
        handle.write("[]")
    assert not link.is_symlink() and link.read_text() == "[]"
    assert (outside / "secret.json").read_text() == "other team's"


@pytest.mark.slow
def test_a_running_jobs_output_directory_swapped_for_a_symlink_fails_the_job_and_writes_nothing_outside(
    deployment_factory, data_root
):
    root, outside = data_root
    api = deployment_factory(max_concurrent_runs=1)
    api.start_daemon()
    output = root / "out" / "dir" / "result.json"
    body = {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["Once upon a time"] * 4, "max_new_tokens": 8, "temperature": 0.5},
    }
    job_id = api.client.post("/v2/batch-completions", json=body, headers={"x-api-key": USER_KEY}).json()["job_id"]
    # Planned: validate_input checked the output's directory (and made it); the engine is still starting.
    api.wait_for(job_id, lambda job: int(job["metadata"].get("requests_total", "0")) > 0, timeout=120)
    (root / "out" / "dir").rename(root / "out" / "dir.checked")
    (root / "out" / "dir").symlink_to(outside)

    job = api.wait_for(job_id, lambda job: job["status"] in ("completed", "failed"), timeout=400)
    assert job["status"] == "failed"
    assert "output_data_path" in job["metadata"]["failure_reason"]
    assert list(outside.iterdir()) == []


@pytest.mark.slow
def test_two_teams_share_make_serve_and_each_gets_its_own_results_only(teams, tmp_path, monkeypatch):
    from tests.entrypoints.test_serve import Served

    monkeypatch.setenv("BATCH_PIPELINE_WORK_DIR", str(tmp_path / "work"))
    served = Served(tmp_path, env={"BATCH_PIPELINE_TENANTS": os.environ["BATCH_PIPELINE_TENANTS"]})
    try:
        served.wait_until_up()
        jobs = {}
        for team, key in (("a", TEAM_A_KEYS[0]), ("b", TEAM_B_KEY)):
            body = {
                **_request(str(teams[team] / "out.json")),
                "content": {"prompts": [f"Team {team} says"], "max_new_tokens": 4, "temperature": 0},
            }
            created = httpx.post(f"{served.api}/v2/batch-completions", json=body, headers=_headers(key), timeout=30)
            assert created.status_code == 200, created.text
            jobs[team] = created.json()["job_id"]
        # Team b's request for team a's output is refused before it is stored.
        stolen = httpx.post(
            f"{served.api}/v2/batch-completions",
            json=_request(str(teams["a"] / "out.json")),
            headers=_headers(TEAM_B_KEY),
            timeout=30,
        )
        assert set(_refused_fields(stolen)) == {"output_data_path"}

        deadline = time.monotonic() + 400
        for team, key in (("a", TEAM_A_KEYS[1]), ("b", TEAM_B_KEY)):
            while (job := _get(served, jobs[team], key).json()["job"])["status"] != "completed":
                assert job["status"] in ("queued", "running"), job
                assert time.monotonic() < deadline, f"{job}\n{served.log.read_text()[-3000:]}"
                time.sleep(1)
            outputs = json.loads((teams[team] / "out.json").read_text())
            assert len(outputs) == 1 and "text" in outputs[0], outputs
        assert _get(served, jobs["a"], TEAM_B_KEY).status_code == 404
        assert _get(served, jobs["b"], TEAM_A_KEYS[0]).status_code == 404
        listed = httpx.get(f"{served.api}/v2/batch-completions", headers=_headers(ADMIN_KEY), timeout=30).json()
        assert {job["job_id"] for job in listed["jobs"]} == set(jobs.values())
    finally:
        served.kill()


def _get(served, job_id: str, key: str) -> httpx.Response:
    return httpx.get(f"{served.api}/v2/batch-completions/{job_id}", headers=_headers(key), timeout=30)


# --- what a security review found after the first steps ------------------------------------------------


def test_a_teams_model_or_checkpoint_in_another_teams_bucket_is_refused(api, teams):
    """A checkpoint in team a's bucket was synced for team b, its tokenizer read by the dry run, and the
    dry run's `nothing at` told which prefixes exist in any bucket."""
    own_output = str(teams["b"] / "out.json")
    for field in ("checkpoint_path", "tokenizer", "model"):
        for url in ("s3://team-a-data/batch/secret-model", "s3://anybucket/model"):
            body = _request(own_output, model_config={"model": MODEL, field: url})
            for params in ({}, {"dry_run": "true"}):
                refused = api.post("/v2/batch-completions", params=params, json=body, headers=_headers(TEAM_B_KEY))
                assert set(_refused_fields(refused)) == {f"model_config.{field}"}, (field, url, params)
    # Team a's own prefix is team a's to load from.
    body = _request(
        str(teams["a"] / "out.json"), model_config={"model": MODEL, "checkpoint_path": "s3://team-a-data/batch/m"}
    )
    assert api.post("/v2/batch-completions", json=body, headers=_headers(TEAM_A_KEYS[0])).status_code == 200


def test_a_teams_model_is_never_a_local_directory_which_could_be_swapped_before_the_engine_loads_it(api, teams):
    (teams["b"] / "model").mkdir()
    body = _request(str(teams["b"] / "out.json"), model_config={"model": str(teams["b"] / "model")})
    refused = _refused_fields(api.post("/v2/batch-completions", json=body, headers=_headers(TEAM_B_KEY)))
    assert set(refused) == {"model_config.model"} and "not a local directory" in refused["model_config.model"]
    # An admin's job may load a local directory inside the data roots, checked as before.
    admitted = api.post("/v2/batch-completions", json=body, headers=_headers(ADMIN_KEY))
    assert admitted.status_code == 200, admitted.text


def test_a_service_prefix_holding_a_teams_bucket_prefix_is_refused(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  t:\n    data_roots: ['s3://svc/files/']\n")
    with pytest.raises(TenantsFileError, match="overlaps the data roots of t"):
        Tenants.load(str(path)).check_service_paths({"the work dir": "s3://svc/"})


def test_a_key_taken_out_of_the_tenants_file_stops_at_once_and_a_broken_edit_keeps_the_last_good_file(api, teams):
    tenants_file = os.environ["BATCH_PIPELINE_TENANTS"]
    assert api.get("/v2/batch-completions", headers=_headers(TEAM_B_KEY)).status_code == 200
    text = open(tenants_file).read()
    revoked = text.replace(_digest(TEAM_B_KEY), _digest("a new key of team b"))
    with open(tenants_file, "w") as handle:
        handle.write(revoked + "\n")  # another size: seen as a change even within the same mtime tick
    assert api.get("/v2/batch-completions", headers=_headers(TEAM_B_KEY)).status_code == 401
    assert api.get("/v2/batch-completions", headers=_headers("a new key of team b")).status_code == 200
    with open(tenants_file, "w") as handle:
        handle.write("tenants: [half an edit\n")
    assert api.get("/v2/batch-completions", headers=_headers("a new key of team b")).status_code == 200


def test_one_teams_batch_checks_hold_only_its_share_and_another_team_checks_its_own(api):
    """Each batch's input file is read whole in a worker thread: one team's burst of batches over a large
    file held every thread, and another team's GET waited 50 s."""
    from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

    files = {}
    for key in (TEAM_A_KEYS[0], TEAM_B_KEY):
        uploaded = _upload(api, _jsonl([_line("1")]), key=key)
        assert uploaded.status_code == 200, uploaded.text
        files[key] = uploaded.json()["id"]
    with api.app.state.openai_service.batch_checks.hold("team:team-b"):  # team b's share (1 of the 2) is in use
        busy = _create(api, files[TEAM_B_KEY], key=TEAM_B_KEY)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "5"
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        assert "BATCH_PIPELINE_MAX_BATCH_CHECKS_PER_TEAM" in busy.json()["error"]["message"]
        assert _create(api, files[TEAM_A_KEYS[0]], key=TEAM_A_KEYS[0]).status_code == 200
    bearer_b = {"authorization": f"Bearer {TEAM_B_KEY}".encode()}
    assert api.get("/v1/batches", headers=bearer_b).json()["data"] == []
    assert _create(api, files[TEAM_B_KEY], key=TEAM_B_KEY).status_code == 200


def test_a_key_revoked_by_an_edit_that_keeps_the_files_size_and_mtime_stops_at_once(api, teams):
    """The reload was keyed on the file's size and mtime: an edit keeping both (a digest swapped for one
    of the same length, the mtime put back as `touch -r` or a copy keeping it would) left the key valid."""
    tenants_file = os.environ["BATCH_PIPELINE_TENANTS"]
    assert api.get("/v2/batch-completions", headers=_headers(TEAM_B_KEY)).status_code == 200
    before = os.stat(tenants_file)
    text = open(tenants_file).read()
    with open(tenants_file, "w") as handle:
        handle.write(text.replace(_digest(TEAM_B_KEY), _digest("a new key of team b")))
    os.utime(tenants_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(tenants_file)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert api.get("/v2/batch-completions", headers=_headers(TEAM_B_KEY)).status_code == 401
    assert api.get("/v2/batch-completions", headers=_headers("a new key of team b")).status_code == 200


def test_an_object_key_with_an_empty_or_dot_segment_is_refused_since_the_store_opens_it_as_written(api, teams):
    """`s3://team-a-data//batch/o` passed the prefix check as `batch/o`, but S3 opens the key `/batch/o`:
    outside the team's prefix `batch/`. A store takes keys as written, so no such segment is read away."""
    key = _headers(TEAM_A_KEYS[0])
    for url in (
        "s3://team-a-data//batch/out.json",
        "s3://team-a-data/./batch/out.json",
        "s3://team-a-data/batch//out.json",
        "s3://team-a-data/batch/./out.json",
    ):
        refused = _refused_fields(api.post("/v2/batch-completions", json=_request(url), headers=key))
        assert set(refused) == {"output_data_path"}, url
        assert "no empty, `.` or `..` segment" in refused["output_data_path"], refused
    reading = _request("s3://team-a-data/batch/out.json", input_data_path="s3://team-a-data//batch/in.jsonl")
    del reading["content"]
    assert set(_refused_fields(api.post("/v2/batch-completions", json=reading, headers=key))) == {"input_data_path"}
    created = api.post("/v2/batch-completions", json=_request("s3://team-a-data/batch/out.json"), headers=key)
    assert created.status_code == 200, created.text


def test_admins_see_each_jobs_owning_team_and_filter_a_list_by_it_and_a_team_lists_its_own_only(api, teams):
    """Issue 46: which team owns a job was visible nowhere; a request's own `team` label is only a label."""
    mine = _request(str(teams["a"] / "out.json"), labels={"team": "team-b"})
    job_a = api.post("/v2/batch-completions", json=mine, headers=_headers(TEAM_A_KEYS[0])).json()["job_id"]
    theirs = _request(str(teams["b"] / "out.json"))
    job_b = api.post("/v2/batch-completions", json=theirs, headers=_headers(TEAM_B_KEY)).json()["job_id"]
    admin = _headers(ADMIN_KEY)

    got = api.get(f"/v2/batch-completions/{job_a}", headers=admin).json()["job"]
    assert got["metadata"]["owner"] == "team-a"  # the key's team, whatever its label says
    assert {
        job["job_id"]: job["metadata"]["owner"]
        for job in api.get("/v2/batch-completions", headers=admin).json()["jobs"]
    } == {job_a: "team-a", job_b: "team-b"}
    assert [job["job_id"] for job in api.get("/v2/batch-completions?team=team-b", headers=admin).json()["jobs"]] == [
        job_b
    ]
    assert api.get("/v2/batch-completions?team=nobody", headers=admin).json()["jobs"] == []

    # A team's key is not told an owner (its keys see its own jobs alone) and may not name another team.
    own = api.get(f"/v2/batch-completions/{job_a}", headers=_headers(TEAM_A_KEYS[1])).json()["job"]
    assert "owner" not in own["metadata"]
    listed = api.get("/v2/batch-completions?team=team-a", headers=_headers(TEAM_A_KEYS[1])).json()["jobs"]
    assert [job["job_id"] for job in listed] == [job_a]
    refused = api.get("/v2/batch-completions?team=team-b", headers=_headers(TEAM_A_KEYS[0]))
    assert refused.status_code == 403, refused.text
