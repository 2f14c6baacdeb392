"""Warm engines (issue 47): many small jobs of two teams through `serve`, with the engine pool and without.

    .venv/bin/python bench/warm_engines.py [--jobs 8] [--prompts 16] [--max-tokens 32] [--rounds 2] [--out PATH]

1. **Many small jobs.** `--jobs` jobs of `--prompts` prompts x `--max-tokens` new tokens (greedy,
   smollm2-135m-instruct), half of them each from two teams, all sent at once to a fresh deployment
   (`python -m batch_pipeline.entrypoints.serve`, a tenants file of the two teams, 2 run slots), timed from
   the first submission to the last job seen completed (polled every 0.2 s): with the engine pool (the
   default) and without it (BATCH_PIPELINE_ENGINE_POOL_WORKERS=0: every shard starts its engine, main's path
   before the pool). Baselines in the same run, each a cold process timed from its start to its exit: raw
   `vllm.LLM.generate` on the union of the jobs' prompts at vLLM's defaults (eager, as every benchmark here:
   torch.compile costs 70-95 s per start on the CPU) and at our engine settings (`worker.engine`'s
   arguments: prefix caching, the CPU's block size and dtype). Goal: pool <= 1.5x raw at our settings.
2. **One small job on a warm deployment.** After the jobs of part 1, one more job of 20 prompts, timed from
   its submission to its status read `completed`, against its shard's `generate_s` (the metadata's).
   Goal: <= generate_s + 2 s.

Greedy texts are compared with raw's at our settings, by prompt: where they differ, it is a batch of other
requests beside them (in bfloat16 a greedy text depends on its batch), said as a count. The configurations
alternate over `--rounds`; medians and min-max. Writes bench/results/warm_engines-<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from control_plane import clean_environment, stop_leftovers, write_dagster_yaml
from engine_overhead import run_script
from served import start_serve, stop_serve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m-instruct"
TEAMS = ("team-a", "team-b")
SUBJECTS = ["rain", "a lighthouse", "the sea", "a robot", "autumn", "a city at night", "a cat", "the moon"]

RAW = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.models.catalog import resolve_model
from batch_pipeline.worker.engine import engine_arguments
spec = json.load(open(sys.argv[1]))
if spec["settings"] == "ours":
    arguments, _ = engine_arguments(BatchCompletionsModelConfig(model=spec["model"]))
else:
    arguments = {"model": resolve_model(spec["model"]), "enforce_eager": True}
llm = LLM(**arguments)
outputs = llm.generate(spec["prompts"], SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0), use_tqdm=False)
print(json.dumps({"texts": [o.outputs[0].text for o in outputs],
                  "completion_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}))
"""


def job_prompts(job: int, prompts: int) -> list[str]:
    subjects = [SUBJECTS[(job + line) % len(SUBJECTS)] for line in range(prompts)]
    return [f"Write one line about {subject} (job {job}, line {line})." for line, subject in enumerate(subjects)]


def _tenants(work: Path, out: Path) -> tuple[Path, dict[str, str]]:
    keys = {team: f"key-of-{team}" for team in TEAMS}
    lines = ["tenants:"]
    for team, key in keys.items():
        lines += [f"  {team}:", f"    api_keys_sha256: [{hashlib.sha256(key.encode()).hexdigest()}]"]
        lines += [f"    data_roots: [{out / team}]"]  # one team's root never inside another's
    path = work / "tenants.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, keys


def _wait_completed(client, job_ids: dict[str, str], keys: dict[str, str], deadline: float) -> float:
    """Until every job reads completed; the time it was first seen so."""
    pending = dict(job_ids)
    while pending:
        for job_id, team in list(pending.items()):
            status = client.get(f"/v2/batch-completions/{job_id}", headers={"x-api-key": keys[team]}).json()["job"][
                "status"
            ]
            if status in ("failed", "cancelled"):
                raise SystemExit(f"job {job_id} {status}")
            if status == "completed":
                del pending[job_id]
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"jobs did not finish: {sorted(pending)}")
        time.sleep(0.2)
    return time.monotonic()


def served_round(work: Path, pool: bool, jobs: int, prompts: int, max_tokens: int) -> dict:
    home, out = work / "dagster_home", work / "out"
    home.mkdir(parents=True)
    for team in TEAMS:
        (out / team).mkdir(parents=True)
    write_dagster_yaml(str(home), run_slots=2)
    tenants, keys = _tenants(work, out)
    env = clean_environment(
        str(home),
        BATCH_PIPELINE_SENSOR_INTERVAL_S="1",
        VLLM_LOGGING_LEVEL="WARNING",
        BATCH_PIPELINE_TENANTS=str(tenants),
        BATCH_PIPELINE_ENGINE_POOL_WORKERS="2" if pool else "0",
    )
    serve, client = start_serve(home, env, REPO)
    try:
        bodies = []
        for job in range(jobs):
            team = TEAMS[job % len(TEAMS)]
            body = {
                "output_data_path": str(out / team / f"job-{job}.json"),
                "model_config": {"model": MODEL},
                "content": {"prompts": job_prompts(job, prompts), "max_new_tokens": max_tokens, "temperature": 0.0},
            }
            bodies.append((team, body))
        started = time.monotonic()
        job_ids = {}
        for team, body in bodies:
            response = client.post("/v2/batch-completions", json=body, headers={"x-api-key": keys[team]})
            assert response.status_code == 200, response.text
            job_ids[response.json()["job_id"]] = team
        finished = _wait_completed(client, job_ids, keys, started + 1800)
        texts = [
            [entry["text"] for entry in json.loads((out / team / f"job-{job}.json").read_text())]
            for job, (team, _) in enumerate(bodies)
        ]
        # One more small job, on what the first left warm (or not, without the pool).
        small = {
            "output_data_path": str(out / TEAMS[1] / "small.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": job_prompts(99, 20), "max_new_tokens": max_tokens, "temperature": 0.0},
        }
        small_started = time.monotonic()
        response = client.post("/v2/batch-completions", json=small, headers={"x-api-key": keys[TEAMS[1]]})
        assert response.status_code == 200, response.text
        small_id = response.json()["job_id"]
        small_finished = _wait_completed(client, {small_id: TEAMS[1]}, keys, small_started + 600)
        shard = json.loads((out / TEAMS[1] / "small.json.metadata.json").read_text())["shards"][0]
        job = client.get(f"/v2/batch-completions/{small_id}", headers={"x-api-key": keys[TEAMS[1]]}).json()["job"]
        timeline = run_timeline(home, job["metadata"]["dagster_run_id"], small_started)
        return {
            "pool": pool,
            "jobs_wall_s": round(finished - started, 2),
            "texts": texts,
            "small_job_s": round(small_finished - small_started, 2),
            "small_generate_s": shard["generate_s"],
            "small_engine_warm": shard["engine_warm"],
            "small_timeline_s": timeline,
        }
    finally:
        client.close()
        stop_serve(serve)
        stop_leftovers(str(home))


def run_timeline(home: Path, run_id: str, submitted: float) -> dict[str, float]:
    """Where the small job's time went: each of its run's milestones (the run created by the sensor, started
    by its run worker, each step started and done, the run done), in seconds since it was submitted."""
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        records = instance.all_logs(run_id)
        run = instance.get_run_record_by_id(run_id)
    finally:
        instance.dispose()
    # The event log's times are wall-clock; the submission was timed on the monotonic clock.
    offset = time.time() - time.monotonic()
    milestones: dict[str, float] = {}
    if run is not None:
        milestones["run_created"] = run.create_timestamp.timestamp() - (submitted + offset)
    for record in records:
        event = record.dagster_event
        if event is None:
            continue
        name = {
            "RUN_START": "run_start",
            "RUN_SUCCESS": "run_success",
            "STEP_START": f"{event.step_key}:start",
            "STEP_SUCCESS": f"{event.step_key}:done",
        }.get(event.event_type_value)
        if name is not None:
            milestones.setdefault(name, record.timestamp - (submitted + offset))
    return {name: round(seconds, 2) for name, seconds in sorted(milestones.items(), key=lambda item: item[1])}


def raw_round(work: Path, settings: str, prompts: list[str], max_tokens: int) -> dict:
    spec = work / f"raw-{settings}.json"
    spec.write_text(json.dumps({"settings": settings, "model": MODEL, "prompts": prompts, "max_tokens": max_tokens}))
    return run_script(RAW, spec)


def _figures(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    union = [prompt for job in range(options.jobs) for prompt in job_prompts(job, options.prompts)]
    walls: dict[str, list[float]] = {"pool": [], "no_pool": [], "raw_defaults": [], "raw_ours": []}
    small: dict[str, list[dict]] = {"pool": [], "no_pool": []}
    differing: dict[str, list[int]] = {"pool": [], "no_pool": []}
    with tempfile.TemporaryDirectory(prefix="bench-warm-engines-") as directory:
        for round_index in range(options.rounds):
            raw_texts: list[str] = []
            for settings in ("defaults", "ours"):
                raw = raw_round(Path(directory), settings, union, options.max_tokens)
                walls[f"raw_{settings}"].append(raw["wall_s"])
                raw_texts = raw["texts"] if settings == "ours" else raw_texts
            order = (True, False) if round_index % 2 == 0 else (False, True)
            for pool in order:
                name = "pool" if pool else "no_pool"
                work = Path(directory) / f"{name}-{round_index}"
                result = served_round(work, pool, options.jobs, options.prompts, options.max_tokens)
                walls[name].append(result["jobs_wall_s"])
                small[name].append({key: value for key, value in result.items() if key.startswith("small_")})
                ours = [text for job in result["texts"] for text in job]
                differing[name].append(sum(a != b for a, b in zip(ours, raw_texts, strict=True)))
                print(f"round {round_index} {name}: {result['jobs_wall_s']} s", flush=True)
    summary = {
        "workload": {"jobs": options.jobs, "prompts": options.prompts, "max_tokens": options.max_tokens},
        "walls_s": {name: _figures(values) for name, values in walls.items() if values},
        "pool_over_raw_ours": round(statistics.median(walls["pool"]) / statistics.median(walls["raw_ours"]), 2),
        "no_pool_over_raw_ours": round(statistics.median(walls["no_pool"]) / statistics.median(walls["raw_ours"]), 2),
        "small_job": small,
        "texts_differing_from_raw_ours": differing,
    }
    print(json.dumps(summary, indent=2))
    out = options.out or RESULTS / f"warm_engines-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
