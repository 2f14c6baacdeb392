"""What resuming a stopped job saves: a job cancelled part-way then resumed
(`POST /v2/batch-completions/{job_id}/actions/resume`), against the same job submitted fresh.

Against `python -m batch_pipeline.entrypoints.serve` (API, Dagster daemon and webserver, real vLLM) in a
fresh DAGSTER_HOME, one run slot. Each round, in alternating order:
  fresh    `--requests` completion requests (greedy, `--max-tokens` new tokens each): submission to completed
  resumed  the same requests in another job, cancelled once `--cancel-at` of them are done (its partial
           results kept), then resumed: the resume to completed, and what it kept and generated (the job's
           metadata, from its checkpoints)
The ratios (resumed / fresh: wall, completion tokens generated) are of the same round, so the machine's load
weighs on both. Writes bench/results/resume-<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from control_plane import clean_environment, stop_leftovers, write_dagster_yaml, write_results
from served import start_serve, stop_serve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = "smollm2-135m-instruct"
ENDED = ("completed", "failed", "cancelled")


def _body(out: Path, name: str, requests: int, max_tokens: int) -> dict:
    return {
        "output_data_path": str(out / f"{name}.json"),
        "model_config": {"model": MODEL},
        "content": [
            {"prompt": f"Request {i}: the number after {i} is", "max_tokens": max_tokens, "temperature": 0.0}
            for i in range(requests)
        ],
    }


def wait_for_job(client: httpx.Client, job_id: str, predicate, timeout_s: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v2/batch-completions/{job_id}").json()["job"]
        if predicate(job):
            return job
        if time.monotonic() > deadline:
            raise SystemExit(f"{job_id} did not get there: {job}\n{log.read_text()[-4000:]}")
        time.sleep(0.25)


def _fresh(client: httpx.Client, out: Path, name: str, requests: int, max_tokens: int, log: Path) -> dict:
    started = time.monotonic()
    job_id = client.post("/v2/batch-completions", json=_body(out, name, requests, max_tokens)).json()["job_id"]
    job = wait_for_job(client, job_id, lambda j: j["status"] in ENDED, 3600, log)
    assert job["status"] == "completed", job
    return {
        "wall_s": round(time.monotonic() - started, 2),
        "requests_generated": requests,
        "completion_tokens_generated": int(job["metadata"]["completion_tokens"]),
    }


def _resumed(
    client: httpx.Client, out: Path, name: str, requests: int, max_tokens: int, cancel_at: float, log: Path
) -> dict:
    job_id = client.post("/v2/batch-completions", json=_body(out, name, requests, max_tokens)).json()["job_id"]
    wait_for_job(
        client, job_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= cancel_at * requests, 3600, log
    )
    assert client.post(f"/v2/batch-completions/{job_id}/actions/cancel").json() == {"success": True}
    wait_for_job(client, job_id, lambda j: j["status"] == "cancelled" and "num_finished" in j["metadata"], 600, log)
    started = time.monotonic()
    while (response := client.post(f"/v2/batch-completions/{job_id}/actions/resume")).status_code == 409:
        time.sleep(0.25)  # its run's workers and partial merge still stopping
    assert response.status_code == 200, response.text
    job = wait_for_job(client, job_id, lambda j: j["status"] in ENDED, 3600, log)
    assert job["status"] == "completed", job
    metadata = job["metadata"]
    return {
        "wall_s": round(time.monotonic() - started, 2),
        "requests_kept": int(metadata["resume_requests_kept"]),
        "requests_generated": int(metadata["resume_requests_generated"]),
        "completion_tokens_kept": int(metadata["resume_completion_tokens_kept"]),
        "completion_tokens_generated": int(metadata["resume_completion_tokens_generated"]),
    }


def measure(requests: int, max_tokens: int, cancel_at: float, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as directory:
        work = Path(directory)
        home, out = work / "dagster_home", work / "out"
        home.mkdir()
        out.mkdir()
        write_dagster_yaml(str(home), 1)
        env = clean_environment(str(home), BATCH_PIPELINE_SENSOR_INTERVAL_S="1", VLLM_LOGGING_LEVEL="WARNING")
        serve, client = start_serve(home, env, REPO)
        log = home / "serve.log"
        rows = []
        try:
            for round_ in range(rounds):
                order = ["fresh", "resumed"] if round_ % 2 == 0 else ["resumed", "fresh"]
                row: dict = {"round": round_, "order": order}
                for kind in order:
                    name = f"{kind}-{round_}"
                    if kind == "fresh":
                        row[kind] = _fresh(client, out, name, requests, max_tokens, log)
                    else:
                        row[kind] = _resumed(client, out, name, requests, max_tokens, cancel_at, log)
                    print(json.dumps({name: row[kind]}), flush=True)
                fresh, resumed = row["fresh"], row["resumed"]
                row["wall_ratio"] = round(resumed["wall_s"] / fresh["wall_s"], 3)
                row["tokens_ratio"] = round(
                    resumed["completion_tokens_generated"] / max(1, fresh["completion_tokens_generated"]), 3
                )
                rows.append(row)
        finally:
            client.close()
            stop_serve(serve)
            stop_leftovers(str(home))
    return {
        "rows": rows,
        "median_wall_ratio": statistics.median(row["wall_ratio"] for row in rows),
        "median_tokens_ratio": statistics.median(row["tokens_ratio"] for row in rows),
        "median_fresh_wall_s": statistics.median(row["fresh"]["wall_s"] for row in rows),
        "median_resumed_wall_s": statistics.median(row["resumed"]["wall_s"] for row in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cancel-at", type=float, default=0.5, help="the share of requests done when cancelled")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "benchmark": "resume",
        "at": datetime.now(UTC).isoformat(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "cancel_at": args.cancel_at,
    }
    results |= measure(args.requests, args.max_tokens, args.cancel_at, args.rounds)
    results["load_average_at_end"] = list(os.getloadavg())
    write_results("resume", results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
