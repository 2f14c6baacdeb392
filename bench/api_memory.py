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

    .venv/bin/python bench/api_memory.py --labels [--jobs 100] [--huge-jobs 6] [--label-mib 25] [--lists 3]

The label cases, ours only, each in a fresh process: `huge`, `--huge-jobs` POSTs each with one label of
`--label-mib` MiB (before labels were bounded, six such jobs made a LIST answer 150 MiB and the API grow
from 0.35 to 1.1 GB; now each is a 422); `largest_ascii` and `largest_wide`, `--jobs` jobs with the largest
labels allowed (64 pairs of 64 and 512 characters), ASCII or of 4-byte characters (the most JSON bytes a
label can take). For each: the RSS at rest, then the peak over the POSTs and over `--lists` LISTs of every
job, as ratios to the RSS at rest. Writes bench/results/api_memory_labels-<time>.json (or `--out`).
"""

import argparse
import contextlib
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
from served import free_port, wait_until_healthy

from batch_pipeline.contract.labels import MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SYSTEMS = {
    "ours": ["batch_pipeline.api.app:create_app"],
    "fastapi_default": ["--app-dir", str(Path(__file__).parent), "api_memory:fastapi_default_app"],
}
HEALTHZ_INTERVAL_S = 0.05
MAX_LIST_LIMIT = 1000  # the most jobs a LIST page holds
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


@contextlib.contextmanager
def serving(system: str, home: str, max_body_bytes: int) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """The system in a fresh uvicorn process with its own DAGSTER_HOME and jobs DB in `home`, healthy."""
    Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCH_PIPELINE_API_KEYS")}
    env.update(
        DAGSTER_HOME=home,
        BATCH_PIPELINE_JOBS_DB=f"sqlite:///{home}/jobs.db",
        BATCH_PIPELINE_MAX_BODY_BYTES=str(max_body_bytes),
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
        yield server, client
    finally:
        server.terminate()
        server.wait(timeout=60)


def at_rest_mb(server: subprocess.Popen, client: httpx.Client, home: str) -> tuple[int, float]:
    """After a warm-up POST of a small body (first-request imports are not what is measured): its status,
    and the RSS at rest. The peak (VmHWM) counts from here on."""
    warm_up = client.post("/v2/batch-completions", content=request_body(home, 10, 16)).status_code
    time.sleep(0.5)
    idle_mb = proc_status_mb(server.pid, "VmRSS")
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")
    return warm_up, idle_mb


def measure_in(system: str, body: bytes, concurrency: int, home: str) -> dict:
    # a body past the deployment's default limit (64 MiB) is measured, not refused
    with serving(system, home, max(64 * 1024 * 1024, len(body))) as (server, client):
        warm_up, idle_mb = at_rest_mb(server, client, home)

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


def largest_labels(wide: bool) -> dict[str, str]:
    """The largest labels a job may carry (64 pairs, 64-character keys, 512-character values): ASCII, or
    (`wide`) characters of 4 bytes in UTF-8, which JSON writes as two \\u escapes each."""
    draw = random.Random(25)
    if wide:

        def text(length: int) -> str:
            return "".join(chr(draw.randrange(0x10000, 0x1FFFF)) for _ in range(length))

    else:

        def text(length: int) -> str:
            return "".join(draw.choice(string.ascii_letters) for _ in range(length))

    return {text(MAX_LABEL_KEY_CHARS): text(MAX_LABEL_VALUE_CHARS) for _ in range(MAX_LABELS)}


def labelled_body(out_dir: str, labels: dict[str, str]) -> bytes:
    body = json.loads(request_body(out_dir, 1, 16))
    return json.dumps({**body, "labels": labels}, separators=(",", ":")).encode()


def measure_labels(case: str, jobs: int, label_mib: float, lists: int, home: str) -> dict:
    """One label case in a fresh process: `huge`, `jobs` POSTs of one label of `label_mib` MiB each (refused
    now; a LIST of them answered 150 MiB before); `largest_ascii` / `largest_wide`, `jobs` jobs of the largest
    labels allowed. Then `lists` LISTs of every job. The RSS at rest, the peak over the POSTs and over the
    LISTs, each as a ratio to the RSS at rest."""
    with serving("ours", home, 64 * 1024 * 1024) as (server, client):
        warm_up, idle_mb = at_rest_mb(server, client, home)
        if case == "huge":
            body = labelled_body(home, {"team": "y" * int(label_mib * 2**20)})
        else:
            body = labelled_body(home, largest_labels(wide=case == "largest_wide"))
        started = time.monotonic()
        codes = [client.post("/v2/batch-completions", content=body).status_code for _ in range(jobs)]
        posts_s = time.monotonic() - started
        posts_peak_mb = proc_status_mb(server.pid, "VmHWM")
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")
        list_bytes, list_s = 0, []
        for _ in range(lists):
            started = time.monotonic()
            listed = client.get("/v2/batch-completions", params={"limit": min(jobs + 1, MAX_LIST_LIMIT)})
            list_s.append(time.monotonic() - started)
            listed.raise_for_status()
            list_bytes = len(listed.content)
            listed_jobs = len(listed.json()["jobs"])
        list_peak_mb = proc_status_mb(server.pid, "VmHWM")
        return {
            "case": case,
            "warm_up_code": warm_up,
            "body_bytes": len(body),
            "codes": {str(code): codes.count(code) for code in sorted(set(codes))},
            "posts_s": round(posts_s, 2),
            "idle_rss_mb": round(idle_mb, 1),
            "posts_peak_rss_mb": round(posts_peak_mb, 1),
            "posts_peak_over_rest": round(posts_peak_mb / idle_mb, 2),
            "listed_jobs": listed_jobs,  # the warm-up's job among them, on a page with room for it
            "list_bytes": list_bytes,
            "list_s_median": round(statistics.median(list_s), 3),
            "list_peak_rss_mb": round(list_peak_mb, 1),
            "list_peak_over_rest": round(list_peak_mb / idle_mb, 2),
        }


def labels_main(options: argparse.Namespace) -> None:
    out = options.out or RESULTS / f"api_memory_labels-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    cases = [("huge", options.huge_jobs), ("largest_ascii", options.jobs), ("largest_wide", options.jobs)]
    runs = []
    for case, jobs in cases:
        with tempfile.TemporaryDirectory(prefix=f"bench-api-memory-{case}-") as home:
            runs.append(measure_labels(case, jobs, options.label_mib, options.lists, home))
        run = runs[-1]
        print(f"{case}: {run}", flush=True)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "label_mib": options.label_mib,
        "lists": options.lists,
        "runs": runs,
    }
    print(f"\nThe API's RSS, at rest and at its peak (VmHWM), {os.cpu_count()} CPUs; peaks as ratios to at rest\n")
    print(
        "| case | jobs posted | body MB | answers | at rest MB | peak over the POSTs | LIST MB | peak over the LISTs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run, (case, jobs) in zip(runs, cases, strict=True):
        answers = " ".join(f"{code} x{count}" for code, count in run["codes"].items())
        print(
            f"| {case} | {jobs} | {run['body_bytes'] / 1e6:.2f} | {answers} | {run['idle_rss_mb']:.0f} | "
            f"{run['posts_peak_rss_mb']:.0f} MB ({run['posts_peak_over_rest']}x) | {run['list_bytes'] / 1e6:.2f} | "
            f"{run['list_peak_rss_mb']:.0f} MB ({run['list_peak_over_rest']}x) |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--body-mb", type=float, default=60, help="each body's size, MB (10^6 bytes)")
    parser.add_argument("--concurrency", type=int, default=3, help="POSTs at once")
    parser.add_argument("--prompt-chars", type=int, default=16, help="characters per prompt (e.g. 16 or 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each system in a fresh process every round")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/api_memory-<time>.json)")
    parser.add_argument("--labels", action="store_true", help="the label cases instead of the body sizes")
    parser.add_argument("--jobs", type=int, default=100, help="--labels: jobs of the largest labels allowed")
    parser.add_argument("--huge-jobs", type=int, default=6, help="--labels: POSTs of one huge label each")
    parser.add_argument("--label-mib", type=float, default=25, help="--labels: the huge label's size, MiB")
    parser.add_argument("--lists", type=int, default=3, help="--labels: LISTs of every job")
    options = parser.parse_args()
    if options.labels:
        labels_main(options)
        return
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
