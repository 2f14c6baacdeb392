"""Fair share between teams: the admission decision's cost at scale, and the shares its policy gives.

    .venv/bin/python bench/fair_share.py [--queued 10000] [--teams 100] [--finished 20000] [--slots 20]
                                         [--window-s 14400] [--sim-slots 8] [--served-jobs 6]
                                         [--served-prompts 4] [--served-max-tokens 16] [--served-rounds 2]
                                         [--run-slots 2] [--no-serve] [--out PATH]

1. **Decision time.** A job store (SQLite in a temporary directory) holding `--queued` waiting jobs across
   `--teams` teams (priorities low, none, high) and `--finished` jobs that used run slots in the last
   hours; the time of what the jobs sensor does each tick with a tenants file, its store reads included:
   the expired waiting jobs, the waiting jobs' index (`pipeline.run_slots.waiting_queues`), every team's
   usage and holders (`team_shares`, counting the jobs that ended since the last tick) and the picks for
   `--slots` free slots (`fair_share.grant_slots`), then the chosen jobs' records. Beside it, alternated, the same
   tick as it was before (`_decision_before`, kept here: every waiting job read whole, every job of the
   last 10 half-lives read and its request parsed), which must choose the same jobs; and a GET of the
   newest waiting job (`BatchJobService.get`, with its `queue_position`) against describing the same row
   without it. Goal: <= 50 ms.
2. **Shares.** Three teams with weights 1:1:2 submitting continuously (each always has jobs waiting; every
   job holds one slot for 60 s), admitted by the same `grant_slots` and `decayed_slot_seconds` over a simulated
   `--window-s` with `--sim-slots` slots, against first-come-first-served from the same arrivals: each
   team's share of the slot-seconds, against 25/25/50 (goal within +-10 %). A simulation of the policy,
   not of the service: the service's runs are tested through `serve` in tests/tenancy/test_fair_share.py.
3. **A lone team's throughput.** The real deployment (`python -m batch_pipeline.entrypoints.serve`, a fresh
   DAGSTER_HOME each time, `--run-slots` run slots: max_concurrent_runs in its dagster.yaml, sensors every
   second) started twice: without a tenants file (every job gets its Dagster run at once and waits in
   Dagster's queue: main's path) and with a tenants file naming one team (its jobs wait in the job store and
   the jobs sensor admits them to free slots: the new path). Each is sent the same `--served-jobs` jobs of
   `--served-prompts` short prompts (`--served-max-tokens` new tokens, temperature 0, smollm2-135m-instruct)
   through the HTTP API, once the API, the webserver and the daemon are up; timed from the first submission
   to the last job seen completed (polled every 0.5 s): wall and jobs/minute, the two configurations
   alternated over `--served-rounds` rounds, medians and the ratio new / main. Goal: unchanged within noise.
   `--no-serve` skips it (tests/test_bench.py's quick run).

Writes bench/results/fair_share-<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from control_plane import clean_environment, stop_leftovers, write_dagster_yaml
from served import start_serve, stop_serve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "A short poem about rain:"]


def _tenants_file(directory: Path, teams: int) -> Path:
    path = directory / "tenants.yaml"
    lines = ["tenants:"]
    for k in range(teams):
        lines += [f"  team-{k}:", f"    weight: {1 + k % 3}", f"    data_roots: [/srv/team-{k}]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def decision_time(queued: int, teams: int, finished: int, slots: int, repeat: int = 7) -> dict:
    import dagster as dg

    from batch_pipeline.api.auth import Caller
    from batch_pipeline.api.service import BatchJobService
    from batch_pipeline.core.settings import settings
    from batch_pipeline.pipeline.run_slots import slot_grants, waiting_queues
    from batch_pipeline.store.jobs import JobStore
    from batch_pipeline.store.records import NewJob
    from batch_pipeline.store.sharing import SharingStore
    from batch_pipeline.tenancy.tenants import tenants_at

    with tempfile.TemporaryDirectory() as directory:
        os.environ["BATCH_PIPELINE_TENANTS"] = str(_tenants_file(Path(directory), teams))
        os.environ["DAGSTER_HOME"] = directory
        store = JobStore(f"sqlite:///{directory}/jobs.db")
        request = json.dumps({"output_data_path": "/srv/o.json", "model_config": {"model": "m"}, "gpus": 1})
        for n in range(queued + finished):
            record, _ = store.create(
                NewJob(
                    job_id=f"batch-{n:08d}",
                    owner=f"team:team-{n % teams}",
                    request_json=request,
                    request_sha256=None,
                    model="m",
                    priority=["low", None, "high"][n % 3],
                    labels={},
                    max_runtime_sec=86400,
                )
            )
            if n >= queued:  # a job that ran an hour or so ago, for 60 s
                started = datetime.now(UTC) - timedelta(seconds=n % 7200)
                store.mark_started(record.job_id, f"run-{n}", started)
                store.mark_run_ended(record.job_id, f"run-{n}", "completed", started + timedelta(seconds=60))
        registry = tenants_at(settings().tenants)
        assert registry is not None

        def tick() -> list:
            """What the jobs sensor does with a tenants file, its store reads and writes included."""
            now, sharing = datetime.now(UTC), SharingStore(engine=store.engine)
            sharing.expired_waiting(now)
            queues = waiting_queues(sharing, registry, skip_owners="schedule:")
            chosen = slot_grants(queues, sharing, registry, slots, now, settings().fair_share_half_life_s)
            return sharing.waiting_records(admission.job.job_id for admission in chosen)

        def before() -> list:
            return _decision_before(store, registry, slots)

        tick()  # the first tick after the upgrade counts the ended jobs into their teams' usage rows
        ticks, befores, waiting_reads = [], [], []
        for _ in range(repeat):  # alternated, so that the machine's load falls on both alike; each from a
            # collected heap, so that neither pays for the other's garbage
            gc.collect()
            started = time.perf_counter()
            chosen = tick()
            ticks.append(time.perf_counter() - started)
            gc.collect()
            started = time.perf_counter()
            chosen_before = before()
            befores.append(time.perf_counter() - started)
            gc.collect()
            started = time.perf_counter()
            records = [record for chunk in store.awaiting_launch() for record in chunk]
            waiting_reads.append(time.perf_counter() - started)
        assert len(records) == queued and len(chosen) == slots
        assert [record.job_id for record in chosen] == chosen_before, "the two paths chose different jobs"

        # A GET of the newest waiting job (the last in its team's order), as the API answers it.
        service = BatchJobService.of_deployment(settings(), store, dg.DagsterInstance.ephemeral())
        newest = f"batch-{queued - 1:08d}"
        # An admin's GET: its place among every team's jobs, the costlier reading (a team's counts its own only).
        caller = Caller(owner="admins", is_admin=True)
        gets, plain = [], []
        for _ in range(repeat):
            gc.collect()
            started = time.perf_counter()
            job = service.get(caller, newest)
            gets.append(time.perf_counter() - started)
            started = time.perf_counter()
            service.describe(store.get(newest))
            plain.append(time.perf_counter() - started)
        store.engine.dispose()
    return {
        "queued": queued,
        "teams": teams,
        "finished": finished,
        "slots": slots,
        "fair_share_decision_ms": _ms(ticks),
        "before_fair_share_decision_ms": _ms(befores),
        "read_waiting_records_ms": _ms(waiting_reads),
        "get_with_queue_position_ms": _ms(gets),
        "get_without_queue_position_ms": _ms(plain),
        "queue_position_of_newest": int(job.metadata["queue_position"]),
    }


def _ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1000, 1)


def _decision_before(store, registry, slots: int) -> list[str]:
    """The tick as it was before (kept here only, to time it beside the new one): every waiting job read
    whole, each one's priority capped by a read of the tenants file, every job of the last 10 half-lives
    read with its request parsed for its GPUs and its decay summed, and every team's queue sorted."""
    import heapq

    from batch_pipeline.contract.priority import InvalidPriority, run_priority
    from batch_pipeline.core.settings import settings
    from batch_pipeline.store.sharing import SharingStore
    from batch_pipeline.tenancy.fair_share import TeamShare, decayed_slot_seconds
    from batch_pipeline.tenancy.tenants import tenants_at

    now = datetime.now(UTC)
    records = []
    for chunk in store.awaiting_launch():
        records += [record for record in chunk if record.expires_at > now]
    half_life_s = settings().fair_share_half_life_s
    usage: dict[str, float] = {}
    for use in SharingStore(engine=store.engine).slot_usage_since(now - timedelta(seconds=half_life_s * 10)):
        gpus = json.loads(use.request_json).get("gpus") or 1
        usage[use.owner] = usage.get(use.owner, 0.0) + decayed_slot_seconds(
            use.started_at, use.ended_at, max(use.shards, 1) * gpus, now, half_life_s
        )
    holders = SharingStore(engine=store.engine).slot_holders()
    teams = {}
    for owner in set(usage) | set(holders):
        team = registry.team_of_owner(owner)
        teams[owner] = TeamShare(
            team.config.weight if team else 1.0, None, usage.get(owner, 0.0), holders.get(owner, 0)
        )
    queues: dict[str, list] = {}
    for record in records:
        try:
            # the tenants file found again for each job, as it was
            priority = run_priority(record.priority, tenants_at(settings().tenants).priority_cap(record.owner))
        except InvalidPriority:
            priority = 0
        queues.setdefault(record.owner, []).append((-priority, record.created_at, record.job_id))
    for jobs in queues.values():
        jobs.sort(reverse=True)  # next job last
    running = {owner: teams.get(owner, TeamShare()).running for owner in queues}

    def standing(owner: str) -> tuple:
        share = teams.get(owner, TeamShare())
        return (share.usage / share.weight, running[owner] / share.weight, queues[owner][-1][1])

    heap = [(standing(owner), owner) for owner in queues]
    heapq.heapify(heap)
    admitted: list[str] = []
    while heap and len(admitted) < slots:
        _, owner = heapq.heappop(heap)
        admitted.append(queues[owner].pop()[2])
        running[owner] += 1
        if queues[owner]:
            heapq.heappush(heap, (standing(owner), owner))
    return admitted


def simulated_shares(window_s: float, slots: int, job_s: float = 60.0, half_life_s: float = 3600.0) -> dict:
    from batch_pipeline.tenancy.fair_share import TeamShare, WaitingJob, decayed_slot_seconds, grant_slots

    weights = {"team-a": 1.0, "team-b": 1.0, "team-c": 2.0}
    start = datetime(2026, 12, 1, tzinfo=UTC)

    def run(policy: str) -> dict[str, float]:
        held: list[tuple[str, datetime, datetime]] = []  # (team, started, ends)
        used = dict.fromkeys(weights, 0.0)
        serial = 0
        now = start
        while (now - start).total_seconds() < window_s:
            running = [h for h in held if h[2] > now]
            free = slots - len(running)
            if free > 0:
                # Each team always has more jobs waiting than slots; team a's arrive first (an FCFS worst case).
                waiting = []
                for k, team in enumerate(weights):
                    for i in range(slots):
                        serial += 1
                        waiting.append(
                            WaitingJob(f"{team}-{serial}", team, 0, now + timedelta(microseconds=k * 100 + i))
                        )
                if policy == "fair share":
                    shares = {
                        team: TeamShare(
                            weight=weight,
                            usage=sum(
                                decayed_slot_seconds(s, min(e, now), 1, now, half_life_s)
                                for t, s, e in held
                                if t == team
                            ),
                            running=sum(1 for t, _, _ in running if t == team),
                        )
                        for team, weight in weights.items()
                    }
                    chosen = [admission.job for admission in grant_slots(waiting, shares, free)]
                else:
                    chosen = sorted(waiting, key=lambda job: job.created_at)[:free]
                held += [(job.owner, now, now + timedelta(seconds=job_s)) for job in chosen]
            now += timedelta(seconds=job_s / 4)
        end = start + timedelta(seconds=window_s)
        for team, started, ends in held:
            used[team] += max(0.0, (min(ends, end) - started).total_seconds())
        total = sum(used.values())
        return {team: round(100 * seconds / total, 1) for team, seconds in used.items()}

    target = {team: round(100 * weight / sum(weights.values()), 1) for team, weight in weights.items()}
    return {
        "window_s": window_s,
        "slots": slots,
        "target_pct": target,
        "fair_share_pct": run("fair share"),
        "first_come_pct": run("first come"),
    }


def _served_round(work: Path, config: str, jobs: int, prompts: int, max_tokens: int, run_slots: int) -> dict:
    """One deployment of `config` ("main": no tenants file; "new": a tenants file of one team), sent `jobs`
    jobs at once; from the first submission to the last job seen completed."""
    home, out = work / "dagster_home", work / "out"
    home.mkdir(parents=True)
    out.mkdir()
    write_dagster_yaml(str(home), run_slots)
    env = clean_environment(str(home), BATCH_PIPELINE_SENSOR_INTERVAL_S="1", VLLM_LOGGING_LEVEL="WARNING")
    headers = {}
    if config == "new":
        key = "key-of-the-lone-team"
        tenants_file = work / "tenants.yaml"
        tenants_file.write_text(
            "tenants:\n"
            "  team-a:\n"
            f"    api_keys_sha256: [{hashlib.sha256(key.encode()).hexdigest()}]\n"
            f"    data_roots: [{out}]\n"
        )
        env["BATCH_PIPELINE_TENANTS"] = str(tenants_file)
        headers = {"x-api-key": key}
    serve, client = start_serve(home, env, REPO)
    try:
        bodies = [
            {
                "output_data_path": str(out / f"job-{j}.json"),
                "model_config": {"model": MODEL},
                "content": {
                    "prompts": [f"{PROMPTS[p % len(PROMPTS)]} ({j})" for p in range(prompts)],
                    "max_new_tokens": max_tokens,
                    "temperature": 0.0,
                },
            }
            for j in range(jobs)
        ]
        started = time.monotonic()
        job_ids = []
        for body in bodies:
            response = client.post("/v2/batch-completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            job_ids.append(response.json()["job_id"])
        submitted_s = time.monotonic() - started
        statuses: dict[str, str] = {}
        deadline = started + 600 + 120 * jobs / run_slots
        while True:
            for job_id in job_ids:
                if statuses.get(job_id) not in ("completed", "failed", "cancelled"):
                    statuses[job_id] = client.get(f"/v2/batch-completions/{job_id}", headers=headers).json()["job"][
                        "status"
                    ]
            if all(status in ("completed", "failed", "cancelled") for status in statuses.values()):
                break
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{config}: jobs did not finish: {statuses}\n{(home / 'serve.log').read_text()[-4000:]}"
                )
            time.sleep(0.5)
        wall = time.monotonic() - started
        assert all(status == "completed" for status in statuses.values()), statuses
        return {
            "config": config,
            "jobs": jobs,
            "submit_s": round(submitted_s, 2),
            "wall_s": round(wall, 2),
            "jobs_per_min": round(60 * jobs / wall, 2),
        }
    finally:
        client.close()
        stop_serve(serve)
        stop_leftovers(str(home))


def lone_team_throughput(jobs: int, prompts: int, max_tokens: int, rounds: int, run_slots: int) -> dict:
    """A lone team's job throughput through `serve`, with a tenants file (new) against without (main)."""
    runs: dict[str, list[dict]] = {"main": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="bench-fair-share-serve-") as directory:
        for round_index in range(rounds):
            for config in ("main", "new") if round_index % 2 == 0 else ("new", "main"):
                work = Path(directory, f"{config}-{round_index}")
                runs[config].append(_served_round(work, config, jobs, prompts, max_tokens, run_slots))
                print(f"served round {round_index}: {runs[config][-1]}", flush=True)
    summary = {
        config: {
            "wall_s_median": round(statistics.median(run["wall_s"] for run in of_config), 2),
            "wall_s_min": min(run["wall_s"] for run in of_config),
            "wall_s_max": max(run["wall_s"] for run in of_config),
            "jobs_per_min_median": round(statistics.median(run["jobs_per_min"] for run in of_config), 2),
        }
        for config, of_config in runs.items()
    }
    return {
        "jobs": jobs,
        "prompts_per_job": prompts,
        "max_new_tokens": max_tokens,
        "run_slots": run_slots,
        "rounds": rounds,
        "runs": runs,
        "summary": summary,
        "new_over_main_jobs_per_min": round(
            summary["new"]["jobs_per_min_median"] / summary["main"]["jobs_per_min_median"], 3
        ),
    }


def _table(served: dict) -> str:
    rows = [
        "| configuration | wall s (median, min-max) | jobs/min (median) |",
        "|---|---|---|",
    ]
    for config, label in (("main", "main: no tenants file"), ("new", "new: tenants file, one team")):
        figures = served["summary"][config]
        rows.append(
            f"| {label} | {figures['wall_s_median']} ({figures['wall_s_min']}-{figures['wall_s_max']}) "
            f"| {figures['jobs_per_min_median']} |"
        )
    rows.append(f"| new / main (jobs/min) | | {served['new_over_main_jobs_per_min']} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=100)
    parser.add_argument("--finished", type=int, default=20_000)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=14_400)
    parser.add_argument("--sim-slots", type=int, default=8)
    parser.add_argument("--served-jobs", type=int, default=6)
    parser.add_argument("--served-prompts", type=int, default=4)
    parser.add_argument("--served-max-tokens", type=int, default=16)
    parser.add_argument("--served-rounds", type=int, default=2)
    parser.add_argument("--run-slots", type=int, default=2)
    parser.add_argument("--no-serve", action="store_true", help="skip part 3 (the deployment, real vLLM jobs)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "date": datetime.now(UTC).isoformat(),
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?"),
        "avx512_bf16": "avx512_bf16" in open("/proc/cpuinfo").read(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),  # other work on the machine
        "decision": decision_time(args.queued, args.teams, args.finished, args.slots),
        "shares": simulated_shares(args.window_s, args.sim_slots),
    }
    print(json.dumps(results, indent=2), flush=True)
    if not args.no_serve:
        results["lone_team"] = lone_team_throughput(
            args.served_jobs, args.served_prompts, args.served_max_tokens, args.served_rounds, args.run_slots
        )
        results["load_average_at_end"] = list(os.getloadavg())
        print(json.dumps(results["lone_team"], indent=2))
        print(_table(results["lone_team"]))
    out = args.out or RESULTS / f"fair_share-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
