"""API memory: what the API holds per byte of request body, and how /healthz answers, under concurrent large POSTs.

    .venv/bin/python bench/api_memory.py [--body-mb 60] [--concurrency 3] [--prompt-chars 16] [--repeat 3]

Two systems, each in a fresh uvicorn process with its own DAGSTER_HOME and jobs DB, on loopback only:
- ours: `batch_pipeline.api.app:create_app` (bodies spooled to disk, validated from their bytes in a worker
  thread, large ones one at a time; the job is stored in the jobs DB);
- fastapi_default: `fastapi_default_app` below, one `POST /v2/batch-completions` taking the same
  `CreateBatchCompletionsV2Request` the default way (a `def` route with the pydantic body parameter) and a sync
  `def /healthz`, answering a small dict: what FastAPI does with no special care, and storing nothing.

For each: a warm-up POST of a small body (first-request imports are not body memory), idle RSS, then
`--concurrency` POSTs of the same ~`--body-mb` MB body at once while one client polls /healthz. Peak RSS is
the kernel's high-water mark (`VmHWM`, reset after idle), so no short peak is missed between samples. Held
per body byte = (peak - idle) / (concurrency x body bytes). `--repeat` rounds, the systems alternated;
the report is medians and min-max, and ours / fastapi_default of the medians. Linux only (/proc). Writes
bench/results/api_memory-<time>.json (or `--out`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
from served import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SYSTEMS = {
    "ours": ["batch_pipeline.api.app:create_app"],
    "fastapi_default": ["--app-dir", str(Path(__file__).parent), "api_memory:fastapi_default_app"],
}
HEALTHZ_INTERVAL_S = 0.05
# Compared as ours / fastapi_default, medians over the rounds.
METRICS = (
    "idle_rss_mb",
    "peak_rss_mb",
    "peak_over_idle_mb",
    "held_per_body_byte",
    "wall_s",
    "healthz_max_s",
    "healthz_median_s",
)


def fastapi_default_app():
    """The baseline: FastAPI's default body handling (read on the event loop, `json.loads`, validated there).
    No `from __future__ import annotations` in this module: FastAPI must see the body's class, not its name."""
    from fastapi import FastAPI

    from batch_pipeline.contract import CreateBatchCompletionsV2Request

    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v2/batch-completions")
    def create(body: CreateBatchCompletionsV2Request) -> dict[str, str]:
        return {"status": "accepted"}

    return app


def request_body(out_dir: str, prompt_count: int, prompt_chars: int) -> bytes:
    """A valid create request: prompt_count prompts of prompt_chars characters each."""
    prompts = [f"{i} " + "x" * prompt_chars for i in range(prompt_count)]
    return json.dumps(
        {
            "output_data_path": f"{out_dir}/out.json",
            "model_config": {"model": "smollm2-135m-instruct"},
            "content": {"prompts": prompts, "max_new_tokens": 4, "temperature": 0.0},
        },
        separators=(",", ":"),
    ).encode()


def proc_status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure(system: str, body: bytes, concurrency: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-api-memory-{system}-") as home:  # its jobs DB holds the bodies
        return measure_in(system, body, concurrency, home)


def measure_in(system: str, body: bytes, concurrency: int, home: str) -> dict:
    Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCH_PIPELINE_API_KEYS")}
    env.update(
        DAGSTER_HOME=home,
        BATCH_PIPELINE_JOBS_DB=f"sqlite:///{home}/jobs.db",
        # a body past the deployment's default limit (64 MiB) is measured, not refused
        BATCH_PIPELINE_MAX_BODY_BYTES=str(max(64 * 1024 * 1024, len(body))),
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", *SYSTEMS[system], "--port", str(port), "--log-level", "warning"],
        cwd=REPO,
        env=env,
        stdout=open(Path(home, "server.log"), "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=600, headers={"content-type": "application/json"}
        )
        wait_until_healthy(client, server, Path(home, "server.log"), system)
        warm_up = client.post("/v2/batch-completions", content=request_body(home, 10, 16)).status_code
        time.sleep(0.5)
        idle_mb = proc_status_mb(server.pid, "VmRSS")
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # VmHWM from here on: the peak under load

        latencies: list[float] = []
        posts_done = threading.Event()

        def poll_healthz() -> None:  # at least once, then every HEALTHZ_INTERVAL_S until the POSTs are answered
            with httpx.Client(base_url=client.base_url, timeout=600) as poller:
                while True:
                    started = time.monotonic()
                    poller.get("/healthz").raise_for_status()
                    latencies.append(time.monotonic() - started)
                    if posts_done.wait(HEALTHZ_INTERVAL_S):
                        return

        poller = threading.Thread(target=poll_healthz)
        poller.start()
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            codes = list(
                pool.map(lambda _: client.post("/v2/batch-completions", content=body).status_code, range(concurrency))
            )
        wall_s = time.monotonic() - started
        posts_done.set()
        poller.join()
        peak_mb = proc_status_mb(server.pid, "VmHWM")
        held = (peak_mb - idle_mb) * 1024 * 1024 / (concurrency * len(body))
        return {
            "warm_up_code": warm_up,
            "codes": codes,
            "wall_s": round(wall_s, 2),
            "idle_rss_mb": round(idle_mb, 1),
            "peak_rss_mb": round(peak_mb, 1),
            "peak_over_idle_mb": round(peak_mb - idle_mb, 1),
            "held_per_body_byte": round(held, 2),
            "healthz_max_s": round(max(latencies), 3),
            "healthz_median_s": round(statistics.median(latencies), 3),
            "healthz_calls": len(latencies),
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--body-mb", type=float, default=60, help="each body's size, MB (10^6 bytes)")
    parser.add_argument("--concurrency", type=int, default=3, help="POSTs at once")
    parser.add_argument("--prompt-chars", type=int, default=16, help="characters per prompt (e.g. 16 or 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each system in a fresh process every round")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/api_memory-<time>.json)")
    options = parser.parse_args()
    out = options.out or RESULTS / f"api_memory-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    target_bytes = int(options.body_mb * 1e6)
    prompt_count = max(1, target_bytes // (options.prompt_chars + 10))
    body = request_body(tempfile.gettempdir(), prompt_count, options.prompt_chars)
    prompt_count = max(1, round(prompt_count * target_bytes / len(body)))  # once more, sized from the first try
    body = request_body(tempfile.gettempdir(), prompt_count, options.prompt_chars)
    runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    for round_index in range(options.repeat):  # alternated, so a busy spell on the machine hits both
        for system in SYSTEMS:
            runs[system].append(measure(system, body, options.concurrency))
            run = runs[system][-1]
            print(
                f"round {round_index + 1} {system}: codes {run['codes']}, peak RSS {run['peak_rss_mb']:.0f} MB, "
                f"wall {run['wall_s']} s, healthz max {run['healthz_max_s']} s",
                flush=True,
            )
    medians = {
        system: {key: statistics.median(run[key] for run in of_system) for key in METRICS}
        for system, of_system in runs.items()
    }
    ours, baseline = medians["ours"], medians["fastapi_default"]
    ratios = {key: round(ours[key] / baseline[key], 2) if baseline[key] else None for key in METRICS}
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "body_bytes": len(body),
        "prompts": prompt_count,
        "prompt_chars": options.prompt_chars,
        "concurrency": options.concurrency,
        "repeat": options.repeat,
        "runs": runs,
        "medians": medians,
        "ratios_ours_over_fastapi_default": ratios,
    }
    print(
        f"\n{options.concurrency} POSTs at once of {len(body) / 1e6:.1f} MB ({prompt_count} prompts of "
        f"{options.prompt_chars} chars), {os.cpu_count()} CPUs, {options.repeat} rounds: median (min-max)\n"
    )
    print(
        "| system | body MB | idle RSS MB | peak RSS MB | held per body byte | codes | wall s | healthz max s "
        "| healthz median s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for system, of_system in runs.items():

        def spread(key: str, digits: int) -> str:
            values = [run[key] for run in of_system]
            return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

        codes = [code for run in of_system for code in run["codes"]]
        code_counts = " ".join(f"{code} x{codes.count(code)}" for code in sorted(set(codes)))
        print(
            f"| {system} | {len(body) / 1e6:.1f} | {spread('idle_rss_mb', 0)} | {spread('peak_rss_mb', 0)} | "
            f"{spread('held_per_body_byte', 2)} | {code_counts} | "
            f"{spread('wall_s', 1)} | {spread('healthz_max_s', 3)} | {spread('healthz_median_s', 3)} |"
        )
    print("\nours / fastapi_default (medians): " + ", ".join(f"{key} {value}x" for key, value in ratios.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
