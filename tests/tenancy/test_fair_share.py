"""Each team's own bounds from the tenants file (a queue quota answered 429 with nothing stored, a priority
cap read as the cap), and run slots shared out by fair share between teams."""

import hashlib
import heapq
import json
import os
import random
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest

from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.run_slots import slot_grants, team_shares, waiting_queues
from batch_pipeline.pipeline.sensors import batch_jobs_sensor
from batch_pipeline.pipeline.tags import JOB_ID_TAG
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.quotas import QuotaStore
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.sharing import SharingStore
from batch_pipeline.tenancy.fair_share import (
    Queues,
    TeamShare,
    WaitingJob,
    decayed_slot_seconds,
    grant_slots,
    queue_position,
)
from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError, tenants_at
from tests.admission.test_quotas import _ran
from tests.api_fixtures import sensor_resources, write_instance_config
from tests.conftest import MODEL
from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

HALF_LIFE_S = 3600.0  # the deployment's default, which the API's queue_position decays by in these tests

BOUNDED, FREE, ADMIN = "key-of-the-bounded-team", "key-of-the-free-team", "key-of-an-admin"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def teams(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("bounded", "free")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        f"admins:\n  api_keys_sha256: [{_digest(ADMIN)}]\n"
        "tenants:\n"  # last: a fixture may add a team at the end
        "  bounded:\n"
        f"    api_keys_sha256: [{_digest(BOUNDED)}]\n"
        f"    data_roots: [{roots['bounded']}]\n"
        "    max_queued_jobs: 2\n"
        "    max_priority: high\n"
        "    weight: 2\n"
        "  free:\n"
        f"    api_keys_sha256: [{_digest(FREE)}]\n"
        f"    data_roots: [{roots['free']}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _body(output, **fields) -> dict:
    return {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
        **fields,
    }


def _submit(api, key: str, output, idempotency_key: str | None = None, **fields):
    headers = {"x-api-key": key} | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    return api.post("/v2/batch-completions", json=_body(output, **fields), headers=headers)


def _listed(api, key: str) -> list[str]:
    return [job["job_id"] for job in api.get("/v2/batch-completions", headers={"x-api-key": key}).json()["jobs"]]


def test_a_team_past_its_queue_quota_gets_429_and_nothing_is_stored(api, teams, tmp_path):
    first = _submit(api, BOUNDED, teams["bounded"] / "1.json")
    second = _submit(api, BOUNDED, teams["bounded"] / "2.json", idempotency_key="second")
    assert first.status_code == second.status_code == 200
    work = tmp_path / "dagster_home" / "work"
    stored = sorted(path.name for path in work.iterdir())

    refused = _submit(api, BOUNDED, teams["bounded"] / "3.json")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"
    detail = refused.json()["detail"]
    assert detail.startswith("max_queued_jobs:") and "2 jobs waiting to start" in detail and "quota of 2" in detail
    assert sorted(_listed(api, BOUNDED)) == sorted([first.json()["job_id"], second.json()["job_id"]])
    assert sorted(path.name for path in work.iterdir()) == stored  # no content file for the refused job

    # A retry of a submission that made its job is answered with that job, not refused.
    retried = _submit(api, BOUNDED, teams["bounded"] / "2.json", idempotency_key="second")
    assert retried.status_code == 200 and retried.json()["job_id"] == second.json()["job_id"]
    # Another team's queue is its own.
    assert _submit(api, FREE, teams["free"] / "1.json").status_code == 200
    # Once a job of the team starts, the team may queue one more.
    JobStore(settings().job_store_url).mark_started(first.json()["job_id"], "run-1", None)
    assert _submit(api, BOUNDED, teams["bounded"] / "3.json").status_code == 200


def test_an_openai_batch_past_the_queue_quota_gets_openais_429_and_no_batch(api, teams):
    bearer = {"Authorization": f"Bearer {BOUNDED}"}
    for name in ("1.json", "2.json"):
        assert _submit(api, BOUNDED, teams["bounded"] / name).status_code == 200
    uploaded = _upload(api, _jsonl([_line("a")]), key=BOUNDED)
    assert uploaded.status_code == 200, uploaded.text
    refused = _create(api, uploaded.json()["id"], key=BOUNDED)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"].startswith("max_queued_jobs:")
    assert refused.headers["retry-after"] == "30"
    assert api.get("/v1/batches", headers=bearer).json()["data"] == []
    assert len(_listed(api, BOUNDED)) == 2


def test_a_priority_above_the_teams_cap_is_read_as_the_cap_and_says_so(api, teams):
    asked = _submit(api, BOUNDED, teams["bounded"] / "1.json", priority="highest").json()
    job = api.get(f"/v2/batch-completions/{asked['job_id']}", headers={"x-api-key": BOUNDED}).json()["job"]
    assert job["metadata"]["priority_read_as"] == "10 (your team's max_priority; asked 20 (highest))"
    # Within the cap, and for a team without one, the priority is as asked.
    within = _submit(api, BOUNDED, teams["bounded"] / "2.json", priority="low").json()
    free = _submit(api, FREE, teams["free"] / "1.json", priority="highest").json()
    # The runs the jobs sensor makes of them.
    context = dg.build_sensor_context(
        instance=dg.DagsterInstance.get(),
        resources=sensor_resources(str(JobStore(settings().job_store_url).engine.url)),
    )
    run_priorities = {
        request.tags[JOB_ID_TAG]: request.tags["dagster/priority"]
        for request in batch_jobs_sensor(interval_s=1)(context)
    }
    assert run_priorities == {asked["job_id"]: "10", within["job_id"]: "-10", free["job_id"]: "20"}
    # Raising a queued job's priority is capped the same way.
    raised = api.post(
        f"/v2/batch-completions/{within['job_id']}",
        json={"job_id": within["job_id"], "priority": "99"},
        headers={"x-api-key": BOUNDED},
    ).json()
    assert raised["success"] is True
    assert raised["metadata"]["priority_read_as"].startswith("10 (your team's max_priority")


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("weight: 0", "line 3: tenants.t.weight"),
        ("max_priority: superhigh", "line 3: tenants.t.max_priority"),
        ("max_queued_jobs: -1", "line 3: tenants.t.max_queued_jobs"),
        ("max_running_jobs: 0", "line 3: tenants.t.max_running_jobs"),
        ("max_tokens_per_dai: 5", "line 3: tenants.t.max_tokens_per_dai"),
    ],
)
def test_a_teams_bound_that_cannot_be_is_named_with_its_line(tmp_path, setting, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  t:\n    {setting}\n")
    with pytest.raises(TenantsFileError, match=f"^{path}:{named}"):
        Tenants.load(str(path))


def test_every_bound_of_a_team_is_read(tmp_path):
    path = tmp_path / "tenants.yaml"
    bounds = {
        "weight": 2.5,
        "max_running_jobs": 3,
        "max_queued_jobs": 10,
        "max_priority": 5,
        "max_stored_bytes": 2**30,
        "max_tokens_per_day": 10**7,
    }
    path.write_text(json.dumps({"tenants": {"t": bounds}}))  # JSON is YAML too
    config = Tenants.load(str(path)).teams["t"].config
    assert {name: getattr(config, name) for name in bounds} == bounds
    assert config.priority_cap == 5


# --- admission by fair share -------------------------------------------------------------------------


def _waiting(owner: str, count: int, priority: int = 0, start: int = 0) -> list[WaitingJob]:
    base = datetime(2026, 12, 1, tzinfo=UTC)
    return [WaitingJob(f"{owner}-{i}", owner, priority, base + timedelta(seconds=start + i)) for i in range(count)]


def test_a_team_below_its_share_takes_the_next_slot_however_many_highest_jobs_another_queued():
    waiting = _waiting("a", 6, priority=20) + _waiting("b", 1, start=100)
    teams = {"a": TeamShare(usage=120.0, running=2), "b": TeamShare()}
    assert [chosen.job.job_id for chosen in grant_slots(waiting, teams, slots=1)] == ["b-0"]


def test_a_lone_team_fills_every_slot_in_its_priority_order_then_age():
    waiting = _waiting("a", 3) + [WaitingJob("a-urgent", "a", 20, datetime(2026, 12, 2, tzinfo=UTC))]
    chosen = [chosen.job.job_id for chosen in grant_slots(waiting, {"a": TeamShare(usage=1e9)}, slots=3)]
    assert chosen == ["a-urgent", "a-0", "a-1"]
    assert len(grant_slots(waiting, {}, slots=None)) == 4  # no slot limit: every job at once


def test_free_slots_alternate_between_teams_of_equal_standing_and_weights_tilt_the_usage():
    waiting = _waiting("a", 4) + _waiting("b", 4, start=10)
    assert [c.job.owner for c in grant_slots(waiting, {}, slots=4)] == ["a", "b", "a", "b"]
    # b has used twice a's slot-seconds, with twice the weight: they stand level, so running jobs decide.
    teams = {"a": TeamShare(usage=100.0, weight=1), "b": TeamShare(usage=200.0, weight=2, running=1)}
    assert [c.job.owner for c in grant_slots(waiting, teams, slots=3)] == ["a", "b", "a"]


def test_a_team_at_its_max_running_jobs_waits_and_leaves_the_slot_to_others():
    waiting = _waiting("a", 3) + _waiting("b", 1, start=10)
    teams = {"a": TeamShare(max_running_jobs=1, running=1), "b": TeamShare(usage=5e6)}
    assert [c.job.job_id for c in grant_slots(waiting, teams, slots=3)] == ["b-0"]


def test_usage_decays_with_the_half_life():
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    hour = timedelta(hours=1)
    recent = decayed_slot_seconds(now - timedelta(seconds=10), now, units=2, now=now, half_life_s=3600)
    assert recent == pytest.approx(20, rel=0.01)  # 10 s on 2 GPUs, all but new
    old = decayed_slot_seconds(now - hour - timedelta(seconds=10), now - hour, units=2, now=now, half_life_s=3600)
    assert old == pytest.approx(10, rel=0.01)  # the same an hour ago: half
    running = decayed_slot_seconds(now - timedelta(seconds=10), None, units=1, now=now, half_life_s=3600)
    assert running == pytest.approx(10, rel=0.01)  # a running job counts up to now


# --- the fast path against a straightforward reference ----------------------------------------------


def _reference_admit(waiting: list[WaitingJob], teams: dict[str, TeamShare], slots: int | None) -> list[str]:
    """The admission as first written (every team's whole queue sorted, one heap pop per slot): the
    reference the fast path must agree with."""
    queues: dict[str, list[WaitingJob]] = {}
    for job in waiting:
        queues.setdefault(job.owner, []).append(job)
    for jobs in queues.values():
        jobs.sort(key=lambda job: (-job.priority, job.created_at, job.job_id), reverse=True)
    running = {owner: teams.get(owner, TeamShare()).running for owner in queues}

    def standing(owner: str):
        share = teams.get(owner, TeamShare())
        return (share.usage / share.weight, running[owner] / share.weight, queues[owner][-1].created_at)

    heap = [(standing(owner), owner) for owner in queues]
    heapq.heapify(heap)
    admitted: list[str] = []
    while heap and (slots is None or len(admitted) < slots):
        _, owner = heapq.heappop(heap)
        share = teams.get(owner, TeamShare())
        if _over_tokens(share) or (share.max_running_jobs is not None and running[owner] >= share.max_running_jobs):
            continue
        admitted.append(queues[owner].pop().job_id)
        running[owner] += 1
        if queues[owner]:
            heapq.heappush(heap, (standing(owner), owner))
    return admitted


def _over_tokens(share: TeamShare) -> bool:
    return share.max_tokens_per_day is not None and share.tokens_today >= share.max_tokens_per_day


def _reference_order(waiting: list[WaitingJob], teams: dict[str, TeamShare]) -> list[str]:
    """Every waiting job in the order slots go out: those admission would start now, as it starts them
    (with a slot for each), then those their team's max_running_jobs (or tokens of the day) holds back, by
    the same standing."""
    started = _reference_admit(waiting, teams, None)
    held = []
    for owner in {job.owner for job in waiting}:
        share = teams.get(owner, TeamShare())
        mine = sorted((j for j in waiting if j.owner == owner), key=lambda j: (-j.priority, j.created_at, j.job_id))
        for rank, job in enumerate(mine):
            if job.job_id not in started:
                key = (share.usage / share.weight, (share.running + rank) / share.weight, job.created_at, owner)
                held.append((key, job.job_id))
    return started + [job_id for _, job_id in sorted(held)]


def _random_case(rng: random.Random):
    base = datetime(2026, 12, 1, tzinfo=UTC)
    owners = [f"team:t{k}" for k in range(rng.randint(1, 7))]
    teams = {}
    for owner in owners:
        if rng.random() < 0.8:  # some owners have no share: weight 1, no usage
            teams[owner] = TeamShare(
                weight=rng.choice([0.5, 1.0, 2.0, 3.0]),
                max_running_jobs=rng.choice([None, None, 1, 2, 4]),
                usage=rng.choice([0.0, 0.0, 100.0, 200.0, rng.uniform(0, 500)]),  # ties, and not
                running=rng.choice([0, 0, 1, 2, 3]),
            )
    waiting = [
        WaitingJob(
            f"job-{n:03d}",
            rng.choice(owners),
            rng.choice([-10, 0, 0, 10, 20]),
            base + timedelta(seconds=rng.randint(0, 40)),  # equal ages across teams and within one
        )
        for n in range(rng.randint(0, 60))
    ]
    rng.shuffle(waiting)
    return waiting, teams


def test_the_fast_admission_picks_the_jobs_the_reference_picks_over_random_queues():
    rng = random.Random(20261201)
    for _ in range(400):
        waiting, teams = _random_case(rng)
        slots = rng.choice([None, 0, 1, 2, 3, 5, 10, 100])
        expected = _reference_admit(waiting, teams, slots)
        assert [a.job.job_id for a in grant_slots(waiting, teams, slots)] == expected
        assert [a.job.job_id for a in grant_slots(Queues(waiting), teams, slots)] == expected


def test_queue_position_is_the_place_in_the_order_admission_gives_slots_out_over_random_queues():
    rng = random.Random(7)
    for _ in range(200):
        waiting, teams = _random_case(rng)
        order = _reference_order(waiting, teams)
        queues = Queues(waiting)
        started = set(_reference_admit(waiting, teams, None))
        for job in waiting:
            place = queue_position(queues, teams, job.job_id, job.owner)
            assert place is not None and place.position == order.index(job.job_id) + 1
            assert place.held_by_bound == (job.job_id not in started)
        assert queue_position(queues, teams, "job-none", "team:t0") is None
        # The first `slots` places are the jobs admission starts with that many slots.
        for slots in (1, 3):
            firsts = {
                job.job_id for job in waiting if queue_position(queues, teams, job.job_id, job.owner).position <= slots
            }
            assert firsts == {a.job.job_id for a in grant_slots(queues, teams, slots)} or len(started) < slots


def test_a_team_over_its_tokens_of_the_day_is_held_as_one_at_its_bound_over_random_queues():
    """Every job of a team whose tokens of the day reached its max_tokens_per_day is held: admission gives
    it no slot however many are free, and its queue_position is after every job that may start now, among
    the held ones (of either hold) by standing, as a job its max_running_jobs holds."""
    rng = random.Random(20261202)
    for _ in range(200):
        waiting, teams = _random_case(rng)
        for owner in {job.owner for job in waiting}:
            share = teams.get(owner, TeamShare())
            if rng.random() < 0.4:
                teams[owner] = replace(share, max_tokens_per_day=100, tokens_today=rng.choice([100, 250]))
            elif rng.random() < 0.3:
                teams[owner] = replace(share, max_tokens_per_day=100, tokens_today=99)  # below it: not held
        over = {owner for owner, share in teams.items() if _over_tokens(share)}
        slots = rng.choice([None, 1, 3, 100])
        chosen = [a.job.job_id for a in grant_slots(waiting, teams, slots)]
        assert chosen == _reference_admit(waiting, teams, slots)
        assert not {job.owner for job in waiting if job.job_id in chosen} & over
        order, queues = _reference_order(waiting, teams), Queues(waiting)
        for job in waiting:
            place = queue_position(queues, teams, job.job_id, job.owner)
            assert place is not None and place.position == order.index(job.job_id) + 1
            assert place.held_by_tokens == (job.owner in over)


# --- the job store's reads, as the sensor and a GET make them ---------------------------------------


def _store_job(store: JobStore, job_id: str, owner: str, priority: str | None = None, runtime: int = 3600) -> None:
    store.create(
        NewJob(
            job_id=job_id,
            owner=owner,
            request_json=json.dumps({"output_data_path": "/o", "model_config": {"model": MODEL}, "gpus": 2}),
            request_sha256="0" * 64,
            model=MODEL,
            priority=priority,
            labels={},
            max_runtime_sec=runtime,
        )
    )


def _old_usage(store: JobStore, now: datetime) -> dict[str, float]:
    """Usage as the first release read it: every job that used slots in the last 10 half-lives."""
    half_life_s = HALF_LIFE_S
    usage: dict[str, float] = {}
    for use in SharingStore(engine=store.engine).slot_usage_since(now - timedelta(seconds=half_life_s * 10)):
        units = max(use.shards, 1) * json.loads(use.request_json)["gpus"]
        usage[use.owner] = usage.get(use.owner, 0.0) + decayed_slot_seconds(
            use.started_at, use.ended_at, units, now, half_life_s
        )
    return usage


def test_usage_counted_as_jobs_end_is_the_usage_read_from_every_job(teams, tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    registry = tenants_at(os.environ["BATCH_PIPELINE_TENANTS"])  # the `teams` fixture's
    rng = random.Random(3)
    now = datetime.now(UTC)
    for n in range(60):
        owner = rng.choice(["team:bounded", "team:free", "someone"])
        _store_job(store, f"job-{n:02d}", owner)
        if n % 4:  # three in four have run: ended a while ago, or still running
            started = now - timedelta(seconds=rng.randint(60, 20000))
            store.mark_started(f"job-{n:02d}", f"run-{n}", started)
            if n % 3:
                ended = started + timedelta(seconds=rng.randint(1, 600))
                store.mark_run_ended(f"job-{n:02d}", f"run-{n}", "completed", ended)
    ShardProgressStore(engine=store.engine).record_shards("job-01", {0: 1, 1: 1, 2: 1})  # three shards of two GPUs
    sharing = SharingStore(engine=store.engine)
    first = team_shares(sharing, registry, now, HALF_LIFE_S, count=True)  # the sensor's tick: the ended jobs counted
    again = team_shares(sharing, registry, now, HALF_LIFE_S)  # read from the counts now
    old = _old_usage(store, now)
    for owner in old:
        assert first[owner].usage == pytest.approx(old[owner], rel=1e-6)
        assert again[owner].usage == pytest.approx(old[owner], rel=1e-6)
    # A counted job run again (a re-execution) counts its first run and this one while it runs, and once,
    # not twice, after it ends again.
    finished = next(f"job-{n:02d}" for n in range(60) if n % 4 and n % 3)
    store.mark_started(finished, "run-again", now - timedelta(seconds=30))
    later = now + timedelta(seconds=10)
    assert team_shares(SharingStore(engine=store.engine), registry, later, HALF_LIFE_S, count=True)[
        store.get(finished).owner
    ].usage == pytest.approx(_old_usage(store, later)[store.get(finished).owner], rel=1e-6)
    store.mark_run_ended(finished, "run-again", "completed", later)
    latest = later + timedelta(seconds=100)
    team_shares(SharingStore(engine=store.engine), registry, latest, HALF_LIFE_S, count=True)
    for owner, value in _old_usage(store, latest).items():
        assert team_shares(SharingStore(engine=store.engine), registry, latest, HALF_LIFE_S)[
            owner
        ].usage == pytest.approx(value, rel=1e-6)


def test_the_store_read_admits_what_the_reference_admits_from_whole_records(teams, tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    registry = tenants_at(os.environ["BATCH_PIPELINE_TENANTS"])  # the `teams` fixture's
    rng = random.Random(11)
    for n in range(80):
        priority = rng.choice([None, "low", "high", "highest", "15", "-5"])
        _store_job(store, f"job-{n:02d}", rng.choice(["team:bounded", "team:free", "someone", "schedule:s"]), priority)
    now = datetime.now(UTC)
    shares = team_shares(SharingStore(engine=store.engine), registry, now, HALF_LIFE_S)
    records = [record for chunk in store.awaiting_launch() for record in chunk if record.owner != "schedule:s"]
    cap = {"team:bounded": 10}  # the bounded team's max_priority: high
    from batch_pipeline.contract.priority import run_priority

    reference = [
        WaitingJob(r.job_id, r.owner, run_priority(r.priority, cap.get(r.owner)), r.created_at) for r in records
    ]
    sharing = SharingStore(engine=store.engine)
    queues = waiting_queues(sharing, registry, skip_owners="schedule:")
    assert len(queues) == len(records)
    for slots in (None, 1, 5, 30):
        assert [a.job.job_id for a in slot_grants(queues, sharing, registry, slots, now, HALF_LIFE_S, count=False)] == (
            _reference_admit(reference, shares, slots)
        )


# --- queue_position through the API, and the sensor's word for it -----------------------------------


def test_a_waiting_jobs_get_gives_its_queue_position_in_the_order_the_sensor_admits(api, teams, capfd):
    bounded = [
        _submit(api, BOUNDED, teams["bounded"] / f"{i}.json", priority="highest").json()["job_id"] for i in range(2)
    ]
    free = [_submit(api, FREE, teams["free"] / f"{i}.json").json()["job_id"] for i in range(3)]
    store = JobStore(settings().job_store_url)
    # The free team has used slots lately: the bounded team's jobs go first, then the free team's by age.
    store.mark_started(free[0], "run-free", datetime.now(UTC) - timedelta(seconds=120))
    store.mark_run_ended(free[0], "run-free", "completed", datetime.now(UTC) - timedelta(seconds=60))

    def metadata(key: str, job_id: str) -> dict[str, str]:
        response = api.get(f"/v2/batch-completions/{job_id}", headers={"x-api-key": key})
        assert response.status_code == 200
        return response.json()["job"]["metadata"]

    # An admin sees each job's place among every team's; a team its place among its own team's jobs.
    waiting = [*bounded, *free[1:]]
    assert [int(metadata(ADMIN, job_id)["queue_position"]) for job_id in waiting] == [1, 2, 3, 4]
    assert metadata(ADMIN, free[2])["waiting_for"].startswith(
        "a run slot: 3 jobs ahead by fair share between teams (1 of them its team's);"
    )
    places = {job_id: metadata(BOUNDED, job_id) for job_id in bounded} | {
        job_id: metadata(FREE, job_id) for job_id in free[1:]
    }
    assert [int(places[job_id]["queue_position"]) for job_id in waiting] == [1, 2, 1, 2]
    why = places[free[2]]["waiting_for"]
    assert why.startswith("a run slot: 1 of your team's jobs goes first; your team has used"), why
    assert "slot-seconds per weight (weight 1, 0 running)" in why
    for key_of_other in ("bounded", *bounded, "ahead"):  # no other team's name, nor its jobs, nor a count
        assert key_of_other not in why
    assert (
        "queue_position"
        not in api.get("/v2/batch-completions", headers={"x-api-key": FREE}).json()["jobs"][0]["metadata"]
    )

    # The sensor gives runs out in that order, and says why in one line per job.
    instance = dg.DagsterInstance.get()
    context = dg.build_sensor_context(instance=instance, resources=sensor_resources(str(store.engine.url)))
    capfd.readouterr()
    requests = list(batch_jobs_sensor(interval_s=1)(context) or [])
    assert [request.run_key for request in requests] == [bounded[0], bounded[1], free[1], free[2]]
    lines = [line for line in capfd.readouterr().err.splitlines() if "takes a run slot" in line]
    assert len(lines) == 4 and f"team:bounded's job {bounded[0]} takes a run slot" in lines[0], lines
    assert "slot-seconds per weight" in lines[0] and "priority (10)" in lines[0]


def test_a_teams_queue_position_and_waiting_for_say_nothing_of_how_many_jobs_other_teams_have_waiting(api, teams):
    """A team's GET of its waiting job counted the jobs of other teams ahead of it: by submitting one job
    and reading its queue_position, a team learnt how many jobs the others had queued, and when."""
    store = JobStore(settings().job_store_url)
    mine = _submit(api, FREE, teams["free"] / "mine.json").json()["job_id"]
    # The free team has used slots lately, so every job of the bounded team stands ahead of its own.
    store.mark_started(mine, "run-free", datetime.now(UTC) - timedelta(seconds=120))
    store.mark_run_ended(mine, "run-free", "completed", datetime.now(UTC) - timedelta(seconds=60))
    waiting = _submit(api, FREE, teams["free"] / "waiting.json").json()["job_id"]

    def told() -> dict[str, str]:
        metadata = _metadata(api, FREE, waiting)
        return {field: metadata[field] for field in ("queue_position", "waiting_for")}

    alone = told()
    assert alone["queue_position"] == "1"
    for i in range(2):  # the bounded team's max_queued_jobs
        queued = _submit(api, BOUNDED, teams["bounded"] / f"{i}.json", priority="highest")
        assert queued.status_code == 200, queued.text
    assert _metadata(api, ADMIN, waiting)["queue_position"] == "3"  # they do stand ahead of it
    assert told() == alone


def test_the_sensor_fails_a_job_whose_deadline_passed_while_it_waited_and_admits_the_rest(api, teams):
    store = JobStore(settings().job_store_url)
    _store_job(store, "batch-late", "team:free", runtime=0)
    on_time = _submit(api, FREE, teams["free"] / "1.json").json()["job_id"]
    context = dg.build_sensor_context(
        instance=dg.DagsterInstance.get(), resources=sensor_resources(str(store.engine.url))
    )
    assert [request.run_key for request in batch_jobs_sensor(interval_s=1)(context) or []] == [on_time]
    late = store.get("batch-late")
    assert late.status == "failed" and "passed while it waited for a run slot" in late.failure_reason


@pytest.mark.slow
def test_through_serve_a_second_teams_job_starts_at_the_first_free_slot_and_a_lone_team_fills_both(
    teams, tmp_path, monkeypatch
):
    """Two run slots. Team bounded queues four jobs at `highest` (read as its cap, high) and fills both
    slots alone; team free's one job, sent after them, starts at the first slots that free, before the
    bounded team's last job."""
    import httpx

    from tests.entrypoints.test_serve import Served

    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
    served = Served(
        tmp_path,
        env={"BATCH_PIPELINE_TENANTS": os.environ["BATCH_PIPELINE_TENANTS"]},
        max_concurrent_runs=2,
    )
    try:
        served.wait_until_up()

        def submit(key: str, output, **fields) -> str:
            response = httpx.post(
                f"{served.api}/v2/batch-completions",
                json=_body(output, **fields),
                headers={"x-api-key": key},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            return response.json()["job_id"]

        def job(key: str, job_id: str) -> dict:
            url = f"{served.api}/v2/batch-completions/{job_id}"
            return httpx.get(url, headers={"x-api-key": key}, timeout=30).json()["job"]

        store = JobStore(f"sqlite:///{served.home}/batch_jobs.db")  # when each job started: not on the wire
        # max_queued_jobs is 2 for the bounded team: two now, two more once those have started.
        bounded = [submit(BOUNDED, teams["bounded"] / f"{i}.json", priority="highest") for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(job(BOUNDED, job_id)["status"] != "queued" for job_id in bounded):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(0.5)
        bounded += [submit(BOUNDED, teams["bounded"] / f"{i}.json", priority="highest") for i in range(2, 4)]
        waiting = job(BOUNDED, bounded[2])
        why = waiting["metadata"]["waiting_for"]  # its team's own standing in fair share, no other team's
        assert waiting["status"] == "queued" and "slot-seconds per weight" in why, why
        other = submit(FREE, teams["free"] / "0.json")

        def finished(key: str, job_id: str) -> dict:
            while (found := job(key, job_id))["status"] in ("queued", "running"):
                assert time.monotonic() < deadline + 300, served.log.read_text()[-3000:]
                time.sleep(0.5)
            assert found["status"] == "completed", found
            return found

        for job_id in bounded:
            finished(BOUNDED, job_id)
        finished(FREE, other)
        rows = {job_id: store.get(job_id) for job_id in [*bounded, other]}
        started = sorted(rows, key=lambda job_id: rows[job_id].started_at)
        assert set(started[:2]) == set(bounded[:2])  # the lone team took both slots
        a, b = (rows[job_id] for job_id in bounded[:2])
        assert a.started_at < b.completed_at and b.started_at < a.completed_at  # at once
        # The other team's job takes one of the first slots to free, ahead of the bounded team's last job; by
        # priority alone it would run last. (When both slots free in one tick, both get runs at once, and
        # Dagster's queue starts the higher priority a moment first: so third or fourth.)
        assert started.index(other) in (2, 3) and started.index(other) < started.index(bounded[3]), started
    finally:
        served.kill()


# --- max_tokens_per_day: a team over its tokens of the UTC day is held by the sensor -------------------

CAPPED, TOKENS_PER_DAY = "key-of-the-capped-team", 1000


@pytest.fixture
def capped(teams, tmp_path):
    """The tenants file with a third team, `capped`, whose jobs may use TOKENS_PER_DAY tokens a UTC day."""
    teams["capped"] = tmp_path / "capped"
    teams["capped"].mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        tenants_file.read_text() + "  capped:\n"
        f"    api_keys_sha256: [{_digest(CAPPED)}]\n"
        f"    data_roots: [{teams['capped']}]\n"
        f"    max_tokens_per_day: {TOKENS_PER_DAY}\n"
    )
    return teams


def _one_slot_sensor(tmp_path, store: JobStore):
    """The real jobs sensor over an instance with one free run slot (QueuedRunCoordinator, no run)."""
    home = tmp_path / "dagster_home"
    write_instance_config(home, max_concurrent_runs=1)
    instance = dg.DagsterInstance.from_config(str(home))
    context = dg.build_sensor_context(instance=instance, resources=sensor_resources(str(store.engine.url)))
    return lambda: [request.run_key for request in batch_jobs_sensor(interval_s=1)(context) or []]


def _metadata(api, key: str, job_id: str) -> dict[str, str]:
    response = api.get(f"/v2/batch-completions/{job_id}", headers={"x-api-key": key})
    assert response.status_code == 200
    return response.json()["job"]["metadata"]


def _busy_free_team(api, teams, store: JobStore, now: datetime) -> None:
    """A job of the free team (no tokens quota) that held a slot for two hours until a minute ago and used
    a billion tokens: by fair share alone, the capped team's jobs go first."""
    job_id = _submit(api, FREE, teams["free"] / "old.json").json()["job_id"]
    _ran(job_id, 10**9, now - timedelta(hours=2), now - timedelta(minutes=1))


def test_a_team_over_its_tokens_of_the_day_gets_no_run_and_another_teams_job_takes_the_free_slot(api, capped, tmp_path):
    store, now = JobStore(settings().job_store_url), datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    _busy_free_team(api, capped, store, now)
    spent, running, *waiting = (
        _submit(api, CAPPED, capped["capped"] / f"{i}.json", priority="highest").json()["job_id"] for i in range(4)
    )
    free = _submit(api, FREE, capped["free"] / "1.json").json()["job_id"]
    _store_job(store, "batch-late", "team:capped", runtime=0)  # its deadline passes while its team is held
    # Today: 600 tokens of a job that ended, 399 so far of one still running (a second each: little usage).
    _ran(spent, 600, now - timedelta(seconds=1), now)
    _ran(running, TOKENS_PER_DAY - 600 - 1, now - timedelta(seconds=1), None)
    assert SharingStore(engine=store.engine).tokens_since_by_owner(
        ["team:capped", "team:free", "team:bounded"], midnight
    ) == {
        owner: QuotaStore(engine=store.engine).tokens_since(owner, midnight) for owner in ("team:capped", "team:free")
    }
    # One token below its quota: not held, its jobs stand first.
    below = _metadata(api, CAPPED, waiting[0])
    assert below["queue_position"] == "1" and "max_tokens_per_day" not in below["waiting_for"], below

    _ran(running, TOKENS_PER_DAY - 600, now - timedelta(seconds=1), None)  # the quota reached: held
    # After every job that may start now (the free team's), in its own team's order: an admin sees both,
    # the team its own team's order only.
    assert [int(_metadata(api, ADMIN, job_id)["queue_position"]) for job_id in waiting] == [2, 3]
    places = {job_id: _metadata(api, CAPPED, job_id) for job_id in waiting}
    assert [int(places[job_id]["queue_position"]) for job_id in waiting] == [1, 2]
    why = places[waiting[0]]["waiting_for"]
    assert why.startswith(
        f"your team's max_tokens_per_day: it has used {TOKENS_PER_DAY}/{TOKENS_PER_DAY} tokens today (UTC); its "
        "jobs wait until 00:00 UTC, then a run slot: 0 of your team's jobs go first;"
    ), why
    # The free team has no such quota: never held, however many tokens it used today.
    assert _metadata(api, FREE, free)["queue_position"] == "1"
    assert "max_tokens_per_day" not in _metadata(api, FREE, free)["waiting_for"]

    # The sensor gives the one free slot to the free team; the held team's late job still fails.
    registry = tenants_at(os.environ["BATCH_PIPELINE_TENANTS"])  # the `teams` fixture's
    sharing = SharingStore(engine=store.engine)
    queues = waiting_queues(sharing, registry, skip_owners="schedule:")
    held = slot_grants(queues, sharing, registry, 1, now, HALF_LIFE_S, count=False).held  # for the sensor's log
    assert held == {
        "team:capped": f"3 waiting jobs are held by its max_tokens_per_day: it has used {TOKENS_PER_DAY}/"
        f"{TOKENS_PER_DAY} tokens today (UTC); they wait until 00:00 UTC"
    }
    tick = _one_slot_sensor(tmp_path, store)
    assert tick() == [free]
    late = store.get("batch-late")
    assert late.status == "failed" and "passed while it waited for a run slot" in late.failure_reason
    assert all(store.get(job_id).run_id is None for job_id in waiting)
    # With every other job gone, the slot stays free: the held team still gets none today.
    store.cancel_before_launch(free)
    assert tick() == []


def test_tokens_of_yesterday_do_not_hold_a_team(api, capped, tmp_path):
    store, now = JobStore(settings().job_store_url), datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    _busy_free_team(api, capped, store, now)
    yesterday, waiting = (_submit(api, CAPPED, capped["capped"] / f"{i}.json").json()["job_id"] for i in range(2))
    free = _submit(api, FREE, capped["free"] / "1.json").json()["job_id"]
    # Ten days' quota, by a job that ended a second before midnight.
    _ran(yesterday, 10 * TOKENS_PER_DAY, midnight - timedelta(seconds=2), midnight - timedelta(seconds=1))
    place = _metadata(api, CAPPED, waiting)
    assert place["queue_position"] == "1" and "max_tokens_per_day" not in place["waiting_for"]
    assert _one_slot_sensor(tmp_path, store)() == [waiting]
    assert store.get(free).run_id is None
