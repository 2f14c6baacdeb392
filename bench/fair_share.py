"""Fair share between teams: the admission decision's cost at scale, and the shares its policy gives.

    .venv/bin/python bench/fair_share.py [--queued 10000] [--teams 100] [--finished 20000] [--slots 20]
                                         [--window-s 14400] [--sim-slots 8] [--out PATH]

1. **Decision time.** A job store (SQLite in a temporary directory) holding `--queued` waiting jobs across
   `--teams` teams and `--finished` jobs that used run slots in the last hours; the time of what the jobs
   sensor does each tick with a tenants file: read every team's usage and holders from the store
   (`pipeline.admission.team_shares`) and pick the jobs for `--slots` free slots (`fair_share.admit`),
   against the same tick without fair share (reading the waiting jobs, which both do). Goal: <= 50 ms.
2. **Shares.** Three teams with weights 1:1:2 submitting continuously (each always has jobs waiting; every
   job holds one slot for 60 s), admitted by the same `admit` and `decayed_slot_seconds` over a simulated
   `--window-s` with `--sim-slots` slots, against first-come-first-served from the same arrivals: each
   team's share of the slot-seconds, against 25/25/50 (goal within +-10 %). A simulation of the policy,
   not of the service: the service's runs are tested through `serve` in tests/test_fair_share.py.

Writes bench/results/fair_share-<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"


def _tenants_file(directory: Path, teams: int) -> Path:
    path = directory / "tenants.yaml"
    lines = ["tenants:"]
    for k in range(teams):
        lines += [f"  team-{k}:", f"    weight: {1 + k % 3}", f"    data_roots: [/srv/team-{k}]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def decision_time(queued: int, teams: int, finished: int, slots: int, repeat: int = 5) -> dict:
    from batch_pipeline.pipeline.admission import team_shares
    from batch_pipeline.store.jobs import JobStore, NewJob
    from batch_pipeline.tenancy.fair_share import WaitingJob, admit
    from batch_pipeline.tenancy.tenants import tenants

    with tempfile.TemporaryDirectory() as directory:
        os.environ["BATCH_PIPELINE_TENANTS"] = str(_tenants_file(Path(directory), teams))
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
                    priority=str(n % 3 * 10),
                    labels={},
                    max_runtime_sec=86400,
                )
            )
            if n >= queued:  # a job that ran an hour or so ago, for 60 s
                started = datetime.now(UTC) - timedelta(seconds=n % 7200)
                store.mark_started(record.job_id, f"run-{n}", started)
                store.mark_run_ended(record.job_id, f"run-{n}", "completed", started + timedelta(seconds=60))
        registry = tenants()
        assert registry is not None
        waiting_reads, decisions = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            records = [record for chunk in store.awaiting_launch() for record in chunk]
            waiting_reads.append(time.perf_counter() - started)
            started = time.perf_counter()
            shares = team_shares(store, registry, datetime.now(UTC))
            waiting = [WaitingJob(r.job_id, r.owner, 0, r.created_at) for r in records]
            chosen = admit(waiting, shares, slots)
            decisions.append(time.perf_counter() - started)
        assert len(records) == queued and len(chosen) == slots
        store.engine.dispose()
    return {
        "queued": queued,
        "teams": teams,
        "finished": finished,
        "slots": slots,
        "read_waiting_ms": round(statistics.median(waiting_reads) * 1000, 1),
        "fair_share_decision_ms": round(statistics.median(decisions) * 1000, 1),
    }


def simulated_shares(window_s: float, slots: int, job_s: float = 60.0, half_life_s: float = 3600.0) -> dict:
    from batch_pipeline.tenancy.fair_share import TeamShare, WaitingJob, admit, decayed_slot_seconds

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
                    chosen = [admission.job for admission in admit(waiting, shares, free)]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=100)
    parser.add_argument("--finished", type=int, default=20_000)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=14_400)
    parser.add_argument("--sim-slots", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "date": datetime.now(UTC).isoformat(),
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?"),
        "avx512_bf16": "avx512_bf16" in open("/proc/cpuinfo").read(),
        "decision": decision_time(args.queued, args.teams, args.finished, args.slots),
        "shares": simulated_shares(args.window_s, args.sim_slots),
    }
    print(json.dumps(results, indent=2))
    out = args.out or RESULTS / f"fair_share-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
