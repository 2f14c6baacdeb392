"""Control plane: submit → run started latency, and create-job requests/s with concurrent clients.

    .venv/bin/python bench/control_plane.py [--latency-samples 5] [--clients 50] [--requests 500]

Starts the real local deployment (`python -m batch_pipeline.serve`: API, Dagster webserver, daemon) in a
temporary DAGSTER_HOME with one run slot, and measures over HTTP on loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
from served import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]


def _body(out_dir: str, i: int) -> dict:
    return {
        "output_data_path": f"{out_dir}/job-{i}.json",
        "model_config": {"model": "smollm2-135m-instruct"},
        "content": {"prompts": [f"Prompt {i}"], "max_new_tokens": 1, "temperature": 0.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-samples", type=int, default=5)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="bench-dagster-home-")
    Path(home, "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
        "  config:\n    max_concurrent_runs: 1\n    dequeue_interval_seconds: 1\n"
        "telemetry:\n  enabled: false\n"
    )
    api_port, dagster_port = free_port(), free_port()
    env = {**os.environ, "DAGSTER_HOME": home, "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "batch_pipeline.serve", "--port", str(api_port), "--dagster-port", str(dagster_port)],
        env=env, cwd=REPO, stdout=open(Path(home, "serve.log"), "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{api_port}"
    try:
        client = httpx.Client(base_url=base, timeout=30)
        wait_until_healthy(client, serve, Path(home, "serve.log"), "the deployment", interval_s=0.5)

        from dagster import DagsterInstance, RunsFilter

        instance = DagsterInstance.from_config(home)
        latencies = []
        for i in range(args.latency_samples):
            submitted = time.time()
            job_id = client.post("/v2/batch-completions", json=_body(home, i)).json()["job_id"]
            while True:
                records = instance.get_run_records(filters=RunsFilter(tags={"batch_pipeline/job_id": job_id}), limit=1)
                if records and records[0].start_time:
                    latencies.append(records[0].start_time - submitted)
                    break
                time.sleep(0.1)
            client.post(f"/v2/batch-completions/{job_id}/actions/cancel")
            while client.get(f"/v2/batch-completions/{job_id}").json()["job"]["status"] not in ("cancelled", "completed"):
                time.sleep(0.2)

        def create(i: int) -> int:
            return client.post("/v2/batch-completions", json=_body(home, 1000 + i)).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.clients) as pool:
            codes = list(pool.map(create, range(args.requests)))
        elapsed = time.monotonic() - started
        result = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "submit_to_run_started_s": {
                "median": round(statistics.median(latencies), 2),
                "min": round(min(latencies), 2),
                "max": round(max(latencies), 2),
                "samples": len(latencies),
            },
            "create_job": {
                "clients": args.clients,
                "requests": args.requests,
                "ok": codes.count(200),
                "requests_per_s": round(args.requests / elapsed, 1),
            },
        }
        print(json.dumps(result, indent=2))
        out = REPO / "bench" / "results" / f"control_plane-{datetime.now():%Y-%m-%d}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(timeout=60)


if __name__ == "__main__":
    main()
