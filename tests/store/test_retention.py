"""Retention (issue 28 part 3): the real `cleanup` schedule and job delete finished jobs' work dirs past their
retention (the deployment's, or the team's) and expired OpenAI files, and nothing else: not the outputs the
user named, not what a symlink points at, not another job's or team's files. OpenAI files take
`expires_after` (and batches `output_expires_after`) within OpenAI's bounds, and an expired file is a 404
from the moment it expires, through the real app and the `openai` SDK."""

import json
import os
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest
import sqlalchemy as sa

from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.cleanup import cleanup, cleanup_schedule, delete_work_dir
from batch_pipeline.pipeline.resources import JobStorage, Tenancy
from batch_pipeline.store import retention
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import files as files_table
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.schema import JobStatus
from tests.api.test_usage import A_KEY, B_KEY, _body, _digest, _usage
from tests.api_fixtures import OTHER_KEY, USER_KEY, sensor_resources
from tests.openai_batch.test_openai_batch import _bearer, _create, _jsonl, _line, _upload

DAY = timedelta(days=1)


def _run_cleanup(store_url: str, storage: JobStorage, instance: dg.DagsterInstance) -> dict | None:
    """One tick of the real schedule, and the real job it asks for, run in this process: the run's
    summary, or None when the tick was skipped (nothing due)."""
    resources = sensor_resources(store_url, job_storage=storage)
    context = dg.build_schedule_context(
        instance=instance, resources=resources, scheduled_execution_time=datetime.now(UTC)
    )
    result = cleanup_schedule.evaluate_tick(context)
    if not result.run_requests:
        assert result.skip_message, result
        return None
    (request,) = result.run_requests
    run = cleanup.execute_in_process(
        instance=instance, resources=resources, run_config=request.run_config, tags=request.tags
    )
    assert run.success
    assert instance.get_run_by_id(run.run_id).job_name == "cleanup"  # a run the UI lists
    return run.output_for_node("delete_expired")


def _summary(**figures: int) -> dict[str, int]:
    """A cleanup run's summary: the figures given, 0 for the others."""
    names = (
        "work_dirs_deleted", "files_deleted", "webhook_events_deleted", "cache_entries_deleted", "failures",
        "work_dirs_left", "files_left", "webhook_events_left",
    )  # fmt: skip
    return {name: figures.get(name, 0) for name in names}


def _ended(store: JobStore, job_id: str, ended: datetime) -> None:
    """What a run records of a job that ended at `ended`."""
    store.mark_started(job_id, f"run-{job_id}", ended - timedelta(minutes=5))
    store.mark_run_ended(job_id, f"run-{job_id}", JobStatus.COMPLETED, ended)


@pytest.fixture
def teams(tmp_path, monkeypatch):
    """team-a keeps its work dirs 2 days, team-b the deployment's 30."""
    roots = {name: tmp_path / name for name in ("team-a", "team-b")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        f"  team-a:\n    api_keys_sha256: [{_digest(A_KEY)}]\n    data_roots: [{roots['team-a']}]\n"
        "    retention_days: 2\n"
        f"  team-b:\n    api_keys_sha256: [{_digest(B_KEY)}]\n    data_roots: [{roots['team-b']}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


def test_cleanup_frees_work_dirs_past_retention_and_leaves_user_outputs(teams, tenants_api, tmp_path):
    api = tenants_api
    url = os.environ["BATCH_PIPELINE_JOBS_DB"]
    store = JobStore(url)
    storage = JobStorage(work_dir_base=settings().work_dir_base, retention_days=30)
    instance = dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"])
    now = datetime.now(UTC)

    def submit(key: str, root, name: str, prompts=("hi",)) -> str:
        response = api.post("/v2/batch-completions", json=_body(root / name, prompts), headers={"x-api-key": key})
        assert response.status_code == 200, response.text
        return response.json()["job_id"]

    old_b = submit(B_KEY, teams["team-b"], "old.json", ("a prompt of team b",))
    recent_b = submit(B_KEY, teams["team-b"], "recent.json")
    queued_b = submit(B_KEY, teams["team-b"], "queued.json")
    linked_b = submit(B_KEY, teams["team-b"], "linked.json")
    old_a = submit(A_KEY, teams["team-a"], "old.json")
    for job_id in (old_b, recent_b, queued_b, linked_b, old_a):
        assert os.path.exists(os.path.join(storage.work_dir(job_id), "content.json"))
    # What their runs left: checkpoints in the work dirs, and the outputs the users named.
    for job_id in (old_b, recent_b, old_a):
        shard = os.path.join(storage.work_dir(job_id), "shards", "0")
        os.makedirs(shard)
        with open(os.path.join(shard, "results.tsv"), "w") as handle:
            handle.write("0\t{}\n")
    for root in teams.values():
        (root / "old.json").write_text("[]")
        (root / "old.json.metadata.json").write_text("{}")
    # A symlink inside a work dir, and a work dir swapped for a symlink: what they point at stays.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("not the service's to delete")
    os.symlink(precious, os.path.join(storage.work_dir(old_b), "escape"))
    os.rename(storage.work_dir(linked_b), str(tmp_path / "moved-away"))
    os.symlink(precious, storage.work_dir(linked_b))

    _ended(store, old_b, now - 40 * DAY)  # past the deployment's 30 days
    _ended(store, recent_b, now - 10 * DAY)  # within them
    _ended(store, linked_b, now - 40 * DAY)
    _ended(store, old_a, now - 3 * DAY)  # past team-a's own 2 days
    before = {team["team"]: team["stored_bytes_now"] for team in _usage(api, B_KEY)["teams"]}
    content = {job_id: store.get(job_id).content_bytes for job_id in (old_b, recent_b, queued_b, linked_b)}
    assert before["team-b"] == sum(content.values()) > 0

    summary = _run_cleanup(url, storage, instance)
    assert summary == _summary(work_dirs_deleted=3)

    assert not os.path.lexists(storage.work_dir(old_b)) and not os.path.lexists(storage.work_dir(old_a))
    assert not os.path.lexists(storage.work_dir(linked_b))  # the link went, not what it pointed at
    assert (precious / "keep.txt").read_text() == "not the service's to delete"
    for root in teams.values():  # the users' outputs
        assert (root / "old.json").read_text() == "[]" and (root / "old.json.metadata.json").exists()
    for job_id in (recent_b, queued_b):
        assert os.path.exists(os.path.join(storage.work_dir(job_id), "content.json"))
    assert os.path.exists(os.path.join(storage.work_dir(recent_b), "shards", "0", "results.tsv"))

    # Each row says when; a resume is told so (the resume route's 409).
    for job_id in (old_b, old_a, linked_b):
        deleted = retention.work_dir_deleted_at(store.engine, job_id)
        assert deleted is not None and now <= deleted <= datetime.now(UTC)
        assert retention.checkpoints_deleted(store.engine, job_id).startswith(
            f"the checkpoints were deleted on {deleted:%Y-%m-%d %H:%M:%S} UTC"
        )
    for job_id in (recent_b, queued_b):
        assert retention.work_dir_deleted_at(store.engine, job_id) is None
        assert retention.checkpoints_deleted(store.engine, job_id) is None
    assert retention.checkpoints_deleted(store.engine, "no-such-job") is None

    # Usage counts what is still stored.
    after = {team["team"]: team["stored_bytes_now"] for team in _usage(api, B_KEY)["teams"]}
    assert after["team-b"] == content[recent_b] + content[queued_b]

    # Idempotent: the next tick finds nothing due; a run anyway deletes nothing more.
    assert _run_cleanup(url, storage, instance) is None
    again = cleanup.execute_in_process(instance=instance, resources=sensor_resources(url, job_storage=storage))
    assert again.success and again.output_for_node("delete_expired")["work_dirs_deleted"] == 0
    # 0 days keeps work dirs forever.
    assert _run_cleanup(url, JobStorage(work_dir_base=settings().work_dir_base, retention_days=0), instance) is None
    assert os.path.exists(os.path.join(storage.work_dir(recent_b), "content.json"))


def test_a_named_output_inside_a_work_dir_is_kept_on_a_local_and_a_remote_work_dir(tmp_path):
    base = tmp_path / "work"
    work = base / "batch-1"
    (work / "shards" / "0").mkdir(parents=True)
    for name in ("content.json", "out.json", "out.json.metadata.json", "shards/0/results.tsv"):
        (work / name).write_text(name)
    outside = tmp_path / "outside.txt"
    outside.write_text("kept")
    os.symlink(outside, work / "shards" / "link")
    keep = [str(work / "out.json"), str(work / "out.json.metadata.json")]
    delete_work_dir(str(base), "batch-1", keep)
    assert sorted(os.listdir(work)) == ["out.json", "out.json.metadata.json"]
    assert outside.read_text() == "kept"
    delete_work_dir(str(base), "batch-1", keep)  # idempotent
    delete_work_dir(str(base), "batch-2")  # already gone: nothing to do
    delete_work_dir(str(tmp_path / "no-base-yet"), "batch-1")
    for hostile in ("files", "..", "a/b", ""):
        with pytest.raises(ValueError):
            delete_work_dir(str(base), hostile)

    import fsspec

    memory = fsspec.filesystem("memory")
    for name in ("content.json", "out.json", "shards/0/results.tsv"):
        memory.pipe(f"/retention-test/work/batch-1/{name}", b"x")
    delete_work_dir("memory://retention-test/work", "batch-1", ["memory://retention-test/work/batch-1/out.json"])
    assert [path.rsplit("/", 1)[1] for path in memory.find("/retention-test/work")] == ["out.json"]
    delete_work_dir("memory://retention-test/work", "batch-1")
    assert not memory.find("/retention-test/work")


@pytest.fixture
def deployment(deployment_factory):
    return deployment_factory()


def _key(key: str) -> dict[str, str]:
    return {"x-api-key": key}


def _expire(deployment, file_id: str) -> None:
    """Time passing: the file's expiry moved to a moment ago."""
    with deployment.store.engine.begin() as connection:
        connection.execute(
            files_table.update()
            .where(files_table.c.file_id == file_id)
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )


def test_an_expired_file_is_a_404_everywhere_and_the_cleanup_deletes_its_bytes(deployment):
    client = deployment.client
    data = _jsonl([_line("a")])
    fields = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    uploaded = client.post(
        "/v1/files", headers=_bearer(USER_KEY), data=fields, files={"file": ("in.jsonl", data, "application/jsonl")}
    )
    assert uploaded.status_code == 200, uploaded.text
    file = uploaded.json()
    assert file["expires_at"] == file["created_at"] + 3600
    kept = _upload(client, data).json()
    assert kept["expires_at"] is None
    assert client.get(f"/v1/files/{file['id']}", headers=_bearer(USER_KEY)).json() == file
    path = os.path.join(deployment.service.job_storage.files_dir(), file["id"])
    assert os.path.exists(path)

    _expire(deployment, file["id"])
    for method, route in (
        ("GET", f"/v1/files/{file['id']}"),
        ("GET", f"/v1/files/{file['id']}/content"),
        ("DELETE", f"/v1/files/{file['id']}"),
    ):
        response = client.request(method, route, headers=_bearer(USER_KEY))
        assert response.status_code == 404, (route, response.text)
        assert response.json()["error"]["param"] == "file_id"
    listed = client.get("/v1/files", headers=_bearer(USER_KEY)).json()["data"]
    assert [f["id"] for f in listed] == [kept["id"]]
    as_input = _create(client, file["id"])
    assert as_input.status_code == 404 and as_input.json()["error"]["param"] == "input_file_id", as_input.text
    # Another team's key learns nothing more of it than of any file it cannot see.
    assert _create(client, file["id"], key=OTHER_KEY).status_code == 404
    assert client.get(f"/v1/files/{file['id']}", headers=_bearer(OTHER_KEY)).status_code == 404
    assert os.path.exists(path)  # refused before the cleanup ran

    storage = deployment.service.job_storage
    summary = _run_cleanup(os.environ["BATCH_PIPELINE_JOBS_DB"], storage, deployment.instance)
    assert summary == _summary(files_deleted=1)
    assert not os.path.exists(path)
    with deployment.store.engine.connect() as connection:
        ids = set(connection.execute(sa.select(files_table.c.file_id)).scalars())
    assert ids == {kept["id"]}
    assert client.get(f"/v1/files/{kept['id']}/content", headers=_bearer(USER_KEY)).content == data
    assert _run_cleanup(os.environ["BATCH_PIPELINE_JOBS_DB"], storage, deployment.instance) is None


def test_the_openai_sdk_sets_expires_after_and_reads_an_expired_file_as_not_found(deployment):
    import openai

    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key=USER_KEY, http_client=deployment.client, max_retries=0
    )
    data = _jsonl([_line("a")])
    uploaded = client.files.create(
        file=("in.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert uploaded.expires_at == uploaded.created_at + 7200
    assert client.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(
            file=("in.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert refused.value.param == "expires_after.seconds"

    _expire(deployment, uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


UPLOAD_REFUSALS = [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-1"}, "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e400"}, "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after.seconds"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
    ({"expires_after": '{"anchor": "created_at", "seconds": 99999999999999999999}'}, "expires_after.seconds"),
    ({"expires_after": '{"anchor": "created_at", "seconds": true}'}, "expires_after.seconds"),
    ({"expires_after": "[1, 2]"}, "expires_after"),
    ({"expires_after": "{not json"}, "expires_after"),
    ({"expires_after": "[" * 1000}, "expires_after"),  # nested past the JSON parser's stack: was a 500
]
BATCH_REFUSALS = [
    ({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 2592001}, "output_expires_after.seconds"),
    ({"anchor": "created_at", "seconds": "soon"}, "output_expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 10**30}, "output_expires_after.seconds"),
    ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor"),
    ({"seconds": 3600}, "output_expires_after.anchor"),
    ("3600", "output_expires_after"),
]


def test_expires_after_outside_openais_bounds_is_a_400_naming_the_field_and_its_bounds_are_taken(deployment):
    client = deployment.client

    def upload(fields: dict):
        return client.post(
            "/v1/files",
            headers=_bearer(USER_KEY),
            data={"purpose": "batch", **fields},
            files={"file": ("in.jsonl", _jsonl([_line("a")]), "application/jsonl")},
        )

    for fields, param in UPLOAD_REFUSALS:
        response = upload(fields)
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, (fields, response.text)
    assert client.get("/v1/files", headers=_bearer(USER_KEY)).json()["data"] == []  # nothing kept
    for seconds in (3600, 2592000):  # the bounds themselves, as a JSON object too
        for fields in (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(seconds)},
            {"expires_after": json.dumps({"anchor": "created_at", "seconds": seconds})},
        ):
            response = upload(fields)
            assert response.status_code == 200, response.text
            assert response.json()["expires_at"] == response.json()["created_at"] + seconds

    file_id = response.json()["id"]
    for policy, param in BATCH_REFUSALS:
        response = _create(client, file_id, output_expires_after=policy)
        assert response.status_code == 400, (policy, response.text)
        assert response.json()["error"]["param"] == param, (policy, response.text)
    assert client.get("/v1/batches", headers=_bearer(USER_KEY)).json()["data"] == []


def test_a_batchs_output_and_error_files_expire_as_it_asked(deployment):
    client = deployment.client
    file_id = _upload(client, _jsonl([_line("a"), _line("b")])).json()["id"]
    batch = _create(client, file_id, output_expires_after={"anchor": "created_at", "seconds": 86400}).json()
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=_bearer(USER_KEY)).json()
    error_file = client.get(f"/v1/files/{cancelled['error_file_id']}", headers=_bearer(USER_KEY)).json()
    assert error_file["purpose"] == "batch_output"
    assert error_file["expires_at"] == error_file["created_at"] + 86400
    assert client.get(f"/v1/files/{file_id}", headers=_bearer(USER_KEY)).json()["expires_at"] is None


@pytest.mark.parametrize("value", ["-1", "36501", "soon", "1.5"])
def test_a_teams_retention_days_out_of_bounds_is_named_with_its_line(tmp_path, value):
    from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError

    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  team-a:\n    api_keys_sha256: [{_digest(A_KEY)}]\n    retention_days: {value}\n")
    with pytest.raises(TenantsFileError, match=r"retention_days"):
        Tenants.load(str(path))


def test_a_schedules_file_cannot_take_the_cleanup_schedules_name(tmp_path):
    from batch_pipeline.pipeline.schedules import ScheduleFileError, load_schedule_specs
    from tests.pipeline.test_schedules import VALID, _write

    path = _write(tmp_path, VALID.format(out=tmp_path).replace("name: nightly", "name: cleanup"))
    with pytest.raises(ScheduleFileError, match=r":2: schedules.0.name: 'cleanup' is the service's own schedule"):
        load_schedule_specs(path)


def test_a_deletion_that_fails_fails_the_run_keeps_the_row_and_the_next_run_completes_it(tmp_path, monkeypatch):
    """An object store refusing a delete: the run fails (the UI shows it), the job's row is as before (its
    content still counted, its resume still possible), and the next run deletes it."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from batch_pipeline.store.records import NewJob

    class Refusing(MemoryFileSystem):
        protocol = "refusing"
        refuse = True

        @classmethod
        def _strip_protocol(cls, path):
            return MemoryFileSystem._strip_protocol(path.removeprefix("refusing://"))

        def rm(self, path, *args, **kwargs):
            if Refusing.refuse:
                raise PermissionError(f"{path}: access denied")
            return super().rm(path, *args, **kwargs)

    fsspec.register_implementation("refusing", Refusing, clobber=True)
    monkeypatch.delenv("BATCH_PIPELINE_TENANTS", raising=False)
    url = f"sqlite:///{tmp_path}/jobs.db"
    store = JobStore(url)
    job = NewJob.new_id()
    request = {"output_data_path": "refusing://bucket/user/out.json", "model_config": {"model": "m"}}
    store.create(NewJob(job, "team:x", json.dumps(request), "0" * 64, "m", None, {}, 60, content_bytes=7))
    _ended(store, job, datetime.now(UTC) - 40 * DAY)
    storage = JobStorage(work_dir_base="refusing://bucket/work", retention_days=30)
    memory = Refusing()
    memory.pipe(f"/bucket/work/{job}/content.json", b"content")
    memory.pipe("/bucket/user/out.json", b"[]")
    resources = sensor_resources(url, job_storage=storage)

    with dg.instance_for_test() as instance:
        failed = cleanup.execute_in_process(instance=instance, resources=resources, raise_on_error=False)
        assert not failed.success
        assert retention.work_dir_deleted_at(store.engine, job) is None and store.get(job).content_bytes == 7
        assert memory.exists(f"/bucket/work/{job}/content.json")

        Refusing.refuse = False
        assert _run_cleanup(url, storage, instance) == _summary(work_dirs_deleted=1)
    assert not memory.find(f"/bucket/work/{job}") and memory.cat("/bucket/user/out.json") == b"[]"
    assert retention.work_dir_deleted_at(store.engine, job) is not None and store.get(job).content_bytes == 0
    memory.rm("/bucket", recursive=True)


def test_a_cleanup_still_running_is_not_joined_by_the_next_hours(tmp_path):
    """Found by an attacker review: each hour's tick made a run of its own, so cleanups of many files
    overlapped and held every run slot the teams' jobs share."""
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        running = instance.create_run_for_job(job_def=cleanup, status=dg.DagsterRunStatus.STARTED)
        resources = sensor_resources(
            f"sqlite:///{tmp_path}/jobs.db", job_storage=JobStorage(work_dir_base=settings().work_dir_base)
        )
        context = dg.build_schedule_context(
            instance=instance, resources=resources, scheduled_execution_time=datetime.now(UTC)
        )
        result = cleanup_schedule.evaluate_tick(context)
        assert not result.run_requests and running.run_id in result.skip_message


def test_one_cleanup_run_deletes_at_most_its_bounds_and_says_what_it_left_to_the_next(deployment, tmp_path):
    """Found by review (issue 28): one run deleted all that was due, however much, so the first run over a
    backlog (retention deployed over months of jobs, a retention_days lowered) held its run slot for hours,
    and nothing said how far it had got."""
    from tests.api.test_api import _body as job_body

    client, store, storage = deployment.client, deployment.store, deployment.service.job_storage
    url = os.environ["BATCH_PIPELINE_JOBS_DB"]
    jobs = []
    for n in range(3):
        response = client.post("/v2/batch-completions", json=job_body(tmp_path, f"job-{n}"), headers=_key(USER_KEY))
        jobs.append(response.json()["job_id"])
        _ended(store, jobs[-1], datetime.now(UTC) - 40 * DAY)
    files = [_upload(client, _jsonl([_line(f"request-{n}")])).json()["id"] for n in range(3)]
    for file_id in files:
        _expire(deployment, file_id)

    resources = sensor_resources(url, job_storage=storage)
    bounds = {"ops": {"delete_expired": {"config": {"max_work_dirs": 2, "max_files": 2}}}}
    run = cleanup.execute_in_process(instance=deployment.instance, resources=resources, run_config=bounds)
    left = {"work_dirs_left": 1, "files_left": 1}
    assert run.output_for_node("delete_expired") == _summary(work_dirs_deleted=2, files_deleted=2, **left)
    assert [os.path.lexists(storage.work_dir(job_id)) for job_id in jobs] == [False, False, True]  # oldest first
    with store.engine.connect() as connection:
        assert set(connection.execute(sa.select(files_table.c.file_id)).scalars()) == {files[2]}
    (output,) = [event for event in run.events_for_node("delete_expired") if event.event_type_value == "STEP_OUTPUT"]
    assert {name: output.step_output_data.metadata[name].value for name in left} == left
    messages = [entry.user_message for entry in deployment.instance.all_logs(run.run_id)]
    assert "left to the next cleanup, still due: 1 work dir, 1 file" in messages

    # The next run deletes the rest; then nothing is due.
    assert _run_cleanup(url, storage, deployment.instance) == _summary(work_dirs_deleted=1, files_deleted=1)
    assert not os.path.lexists(storage.work_dir(jobs[2]))
    assert _run_cleanup(url, storage, deployment.instance) is None


def test_sent_webhook_events_past_retention_are_deleted_by_the_cleanup_and_pending_ones_never(
    teams, tenants_api, tmp_path
):
    """Found by review (issue 28): the webhook outbox kept every event it ever sent, forever. Delivered,
    given-up and unsubscribed events go once their team's retention has passed since they were written;
    a pending one, however old, is still to be sent."""
    from batch_pipeline.store.schema import webhook_events
    from batch_pipeline.store.webhooks import WebhookOutbox

    url = os.environ["BATCH_PIPELINE_JOBS_DB"]
    store = JobStore(url)
    storage = JobStorage(work_dir_base=settings().work_dir_base, retention_days=30)
    outbox = WebhookOutbox(engine=store.engine)
    # (team, state, age in days): team-a keeps 2 days, team-b the deployment's 30.
    events = {
        "b-delivered-old": ("team-b", "delivered", 40),
        "b-failed-old": ("team-b", "failed", 40),
        "b-unsubscribed-old": ("team-b", "unsubscribed", 40),
        "b-pending-old": ("team-b", "pending", 40),
        "b-delivered-recent": ("team-b", "delivered", 10),
        "a-delivered-old": ("team-a", "delivered", 3),
        "a-delivered-recent": ("team-a", "delivered", 1),
    }
    job_of = {}
    for name, (team, state, days) in events.items():
        key = A_KEY if team == "team-a" else B_KEY
        response = tenants_api.post(
            "/v2/batch-completions", json=_body(teams[team] / f"{name}.json"), headers={"x-api-key": key}
        )
        job_of[name] = response.json()["job_id"]
        _ended(store, job_of[name], datetime.now(UTC) - timedelta(hours=1))  # its work dir is kept: not due
        (event,) = outbox.events_of_job(job_of[name])
        with store.engine.begin() as connection:  # what the delivery process recorded, and time passing
            connection.execute(
                webhook_events.update()
                .where(webhook_events.c.event_id == event.event_id)
                .values(state=state, created_at=datetime.now(UTC) - timedelta(days=days))
            )

    instance = dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"])
    assert _run_cleanup(url, storage, instance) == _summary(webhook_events_deleted=4)
    kept = {name for name, job_id in job_of.items() if outbox.events_of_job(job_id)}
    assert kept == {"b-pending-old", "b-delivered-recent", "a-delivered-recent"}
    assert all(os.path.exists(storage.work_dir(job_id)) for job_id in job_of.values())
    assert _run_cleanup(url, storage, instance) is None  # the old pending one is never due


def test_a_team_with_a_retention_of_its_own_and_a_backlog_does_not_starve_the_others_cleanup(tmp_path):
    """Found by review: a cleanup run spent its bound group by group, the teams with a retention of their own
    first, so a team with one and `max_work_dirs` jobs coming due each hour took every run: the other teams'
    work dirs were never deleted, and stayed counted against their max_stored_bytes. Each group now has its
    share of the run's bound."""
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        f"  team-a:\n    api_keys_sha256: [{'a' * 64}]\n    retention_days: 2\n"
        f"  team-b:\n    api_keys_sha256: [{'b' * 64}]\n"
    )
    url = f"sqlite:///{tmp_path}/jobs.db"
    store = JobStore(url)
    storage = JobStorage(work_dir_base=str(tmp_path / "work"), retention_days=30)
    tenancy = Tenancy(tenants_file=str(tenants_file), fair_share_half_life_s=settings().fair_share_half_life_s)
    resources = sensor_resources(url, job_storage=storage, tenancy=tenancy)
    bounds = {"ops": {"delete_expired": {"config": {"max_work_dirs": 3}}}}

    def ended_job(owner: str, days_ago: int) -> str:
        job_id = NewJob.new_id()
        request = {"output_data_path": str(tmp_path / f"{job_id}.json"), "model_config": {"model": "m"}}
        store.create(NewJob(job_id, owner, json.dumps(request), "0" * 64, "m", None, {}, 60, content_bytes=7))
        _ended(store, job_id, datetime.now(UTC) - days_ago * DAY)
        os.makedirs(storage.work_dir(job_id))
        return job_id

    waiting = ended_job("team:team-b", 40)  # due for ten days already
    with dg.instance_for_test() as instance:
        for hour in range(2):  # each hour team-a has another run's bound of work dirs coming due
            backlog = [ended_job("team:team-a", 3) for _ in range(3)]
            run = cleanup.execute_in_process(instance=instance, resources=resources, run_config=bounds)
            assert run.output_for_node("delete_expired")["work_dirs_deleted"] == 3
            assert sum(not os.path.lexists(storage.work_dir(job_id)) for job_id in backlog) >= 2 - hour
    assert not os.path.lexists(storage.work_dir(waiting))
    assert store.get(waiting).content_bytes == 0  # no longer counted against team-b's quota


Q_KEY, Q_MAX = "key-of-team-q", 1000


@pytest.fixture
def quota_team(tmp_path, monkeypatch):
    """team-q, whose files may take Q_MAX bytes."""
    root = tmp_path / "team-q"
    root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        f"tenants:\n  team-q:\n    api_keys_sha256: [{_digest(Q_KEY)}]\n    data_roots: [{root}]\n"
        f"    max_stored_bytes: {Q_MAX}\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))


def test_an_expired_file_counts_against_max_stored_bytes_until_the_cleanup_deletes_its_bytes(quota_team, tenants_api):
    """Read in the quota's code: an expired file stopped counting the moment it expired, though its bytes
    stay on disk until the hourly cleanup deletes them, so a team's uploads with a short expiry stored past
    its quota in between."""
    api = tenants_api
    data = _jsonl([_line("a", content="x" * 400)])
    assert len(data) <= Q_MAX < 2 * len(data)
    fields = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    uploaded = api.post(
        "/v1/files", headers=_bearer(Q_KEY), data=fields, files={"file": ("in.jsonl", data, "application/jsonl")}
    )
    assert uploaded.status_code == 200, uploaded.text
    store = JobStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    with store.engine.begin() as connection:  # time passing: it expired a moment ago
        connection.execute(
            files_table.update()
            .where(files_table.c.file_id == uploaded.json()["id"])
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    assert api.get(f"/v1/files/{uploaded.json()['id']}", headers=_bearer(Q_KEY)).status_code == 404

    refused = _upload(api, data, key=Q_KEY)
    assert refused.status_code == 429, refused.text
    assert f"stores {len(data)} bytes" in refused.json()["error"]["message"]
    [team] = _usage(api, Q_KEY)["teams"]
    assert team["stored_bytes_now"] == len(data)

    instance = dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"])
    summary = _run_cleanup(
        os.environ["BATCH_PIPELINE_JOBS_DB"],
        JobStorage(work_dir_base=settings().work_dir_base, retention_days=30),
        instance,
    )
    assert summary == _summary(files_deleted=1)
    assert _usage(api, Q_KEY)["teams"][0]["stored_bytes_now"] == 0
    assert _upload(api, data, key=Q_KEY).status_code == 200
