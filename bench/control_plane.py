"""Control plane: status reads and lists over a large job store, a jobs-sensor tick over many queued jobs,
and submit → run started through the real deployment, each against issue #15's target (reported, never
asserted: timing stays out of tests).

    .venv/bin/python bench/control_plane.py [--store-jobs 10000] [--big-prompts 1000000] [--tick-jobs 1000]
        [--tick-content-kb 50] [--tick-submit api|direct] [--latency-samples 5] [--burst 20] [--run-slots 2]
        [--no-serve] [--keep] [--out PATH]

Part 1, reads (no daemon, no vLLM): a temporary DAGSTER_HOME whose job store (SQLite, the default
`batch_jobs.db`) holds `--store-jobs` finished jobs (completed, failed, cancelled, with results, labels,
owners; inserted in one transaction with the store's own table, as `JobStore.create` writes them) and three
running jobs of 1k, 100k and `--big-prompts` prompts made through `submission.submit`, then
`mark_started`, `record_shards` (4 shards) and `record_shard_progress` (half done), as the pipeline
records them. Unless `--no-shard-files`, their work dirs hold what a run of that size leaves
(`shards/00k/input.jsonl` with every work item, `results.tsv` with half of them): the status read used to
count those lines on every GET. The API (`uvicorn --factory batch_pipeline.api.app:create_app`, no keys:
every caller is admin) is timed with httpx over loopback, one request at a time on a kept-alive
connection (client-side, so a few hundred µs of httpx are in every figure): GET of the largest running
job, GET of random finished jobs, GET of each running job interleaved (does it grow with the job?), LIST
of 100 (first page, and the page after it), then `--create-requests` POSTs from `--clients` threads.

Part 2, a jobs-sensor tick: `--tick-jobs` queued jobs, each with `--tick-content-kb` KB of inline
content, posted through that API (`--tick-submit api`) or made by `submission.submit` in this process
(`direct`); then `batch_jobs_sensor` evaluated in this process against the same store and Dagster instance
(`build_sensor_context`), `--tick-repeat` times (a tick here creates no run: each sees every job). Per
tick: wall time and the RunRequests' total serialized size (json of run_config + tags, and Dagster's own
serialization of the RunRequest).

Part 3, the deployment (`python -m batch_pipeline.entrypoints.serve`: API, webserver, daemon; `--run-slots` runs at
once, sensors every second), in its own temporary DAGSTER_HOME; it runs real vLLM jobs of one token.
`--latency-samples` jobs one at a time: submit → the Dagster run's start, and → the job's row reads
running; each cancelled once running. Then `--burst` tiny jobs posted at once: the time until every one
has a Dagster run, and until none reads `queued` through the API (LIST polled every second), and the
statuses then. Whatever is unfinished is cancelled at the end, and every process left with that
DAGSTER_HOME is stopped by its pid. `--no-serve` or `--burst 0 --latency-samples 0` skips this part.

Writes bench/results/control_plane-<time>.json (or `--out`), with the machine's CPU model and whether it
has AVX-512. Temporary dirs are removed unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from served import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
SHARDS = 4
# Issue #15's targets: what each measured figure is compared with (≤, except where "<").
TARGETS = {
    "get_p50_ms": 20,
    "get_p99_ms": 50,
    "list_p50_ms": 100,
    "list_p99_ms": 100,
    "tick_wall_s": 2,
    "tick_run_requests_mb": 10,
    "submit_to_start_median_s": 5,
}


# --- the machine -----------------------------------------------------------------------------------------


def write_results(name: str, results: dict, out: Path | None) -> Path:
    """Print a benchmark's results and write them to `out`, by default bench/results/<name>-<time>.json."""
    print(json.dumps(results, indent=2))
    out = out or RESULTS / f"{name}-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), None
    )
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "avx512": any(flag.startswith("avx512") for flag in flags),
        "avx512_flags": sorted(flag for flag in flags if flag.startswith("avx512")),
        "load_average_at_start": list(os.getloadavg()),
        "python": sys.version.split()[0],
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or under it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {
        "samples": len(ms),
        "p50_ms": round(percentile(ms, 0.5), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def write_dagster_yaml(home: str, run_slots: int) -> None:
    """The repository's instance (dagster_home/dagster.yaml), with `run_slots` runs at once and a quicker
    dequeue."""
    Path(home, "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
        f"  config:\n    max_concurrent_runs: {run_slots}\n    dequeue_interval_seconds: 1\n"
        "run_monitoring:\n  enabled: true\n  poll_interval_seconds: 10\n"
        "run_retries:\n  enabled: true\n  max_retries: 2\n  retry_on_asset_or_op_failure: false\n"
        "telemetry:\n  enabled: false\n"
    )


def clean_environment(home: str, **extra: str) -> dict[str, str]:
    """This process's environment without the deployment's own settings (keys, paths, limits), in `home`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCH_PIPELINE_")}
    return env | {"DAGSTER_HOME": home, **extra}


# --- part 1: a large job store, read through the API -----------------------------------------------------


def stored_request_template() -> dict:
    """A request as the store holds it (`submission.submit`'s dump, every default included)."""
    from batch_pipeline.contract import CreateBatchCompletionsV2Request

    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": "/placeholder/input.jsonl",
            "output_data_path": "/placeholder/output.json",
            "model_config": {"model": MODEL, "max_model_len": 2048},
            "max_runtime_sec": 86400,
            "labels": {"team": "placeholder"},
        }
    )
    return request.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"content"})


def seed_finished_jobs(store, count: int, home: str, seed: int = 0) -> list[str]:
    """`count` finished jobs over the last 30 days, in one transaction: the rows `JobStore.create` writes,
    then what `mark_started` and `mark_run_ended` write (status, times, counts, the results summary)."""
    import uuid

    from batch_pipeline.store.records import NewJob
    from batch_pipeline.store.schema import JobStatus, job_labels, jobs, label_digest

    rng = random.Random(seed)
    template = stored_request_template()
    now = datetime.now(UTC)
    rows, label_rows, job_ids = [], [], []
    for i in range(count):
        job_id = NewJob.new_id()
        job_ids.append(job_id)
        created = (
            now
            - timedelta(days=30)
            + timedelta(seconds=i * 30 * 86400 / max(count, 1))
            + timedelta(microseconds=rng.randrange(1_000_000))
        )
        labels = {"team": f"team-{i % 7}", "env": "prod" if i % 3 else "dev"}
        request = template | {
            "input_data_path": f"{home}/inputs/{i}.jsonl",
            "output_data_path": f"{home}/out/{job_id}.json",
            "labels": labels,
        }
        requests = rng.randrange(10, 50_000)
        status = JobStatus.COMPLETED if i % 20 < 17 else JobStatus.FAILED if i % 20 < 19 else JobStatus.CANCELLED
        wait_s, wall_s = rng.uniform(1, 120), rng.uniform(30, 3600)
        started = created + timedelta(seconds=wait_s)
        ended = started + timedelta(seconds=wall_s)
        done = requests if status == JobStatus.COMPLETED else rng.randrange(requests)
        completion_tokens = done * rng.randrange(10, 200)
        results = {
            "num_requests": requests,
            "num_errors": 0,
            "prompt_tokens": done * 40,
            "completion_tokens": completion_tokens,
            "completion_tokens_per_s": round(completion_tokens / wall_s, 1),
            "wall_s": round(wall_s, 3),
            "merge_s": round(requests / 40_000, 3),
            "requests_total": requests,
            "requests_done": done,
            "errors": 0,
        }
        rows.append(
            {
                "job_id": job_id,
                "owner": "anonymous" if i % 2 else f"tenant-{i % 13}",
                "idempotency_key": None,
                "request": json.dumps(request),
                "request_sha256": f"{rng.getrandbits(256):064x}",
                "content_path": None,
                "model": MODEL,
                "priority": None,
                "labels": json.dumps(labels),
                "created_at": created,
                "expires_at": created + timedelta(seconds=86400),
                "run_id": str(uuid.UUID(int=rng.getrandbits(128))),
                "status": status,
                "status_detail": None,
                "started_at": started,
                "queue_wait_s": wait_s,
                "completed_at": ended,
                "cancelled_at": ended if status == JobStatus.CANCELLED else None,
                "failed_at": None,
                "failure_reason": "shard 2: the worker exited with code 137" if status == JobStatus.FAILED else None,
                "requests_total": requests,
                "requests_done": done,
                "errors": 0,
                "prompt_tokens": done * 40,
                "completion_tokens": completion_tokens,
                "results": json.dumps(results) if status == JobStatus.COMPLETED else None,
            }
        )
        label_rows.extend(
            {"job_id": job_id, "key": key, "value": value, "digest": label_digest(key, value)}
            for key, value in labels.items()
        )
    with store.engine.begin() as connection:
        if rows:
            connection.execute(jobs.insert(), rows)
            connection.execute(job_labels.insert(), label_rows)
    return job_ids


def write_shard_files(work_dir: str, requests_per_shard: dict[int, int]) -> int:
    """What a run of the job leaves in its work dir while it runs: each shard's input (every work item)
    and its checkpoint (half of them done). Returns the bytes written."""
    written, index = 0, 0
    for shard, count in requests_per_shard.items():
        directory = Path(work_dir, "shards", f"{shard:03d}")
        directory.mkdir(parents=True, exist_ok=True)
        first = index
        with open(directory / "input.jsonl", "w") as handle:
            for start in range(first, first + count, 10_000):
                handle.write(
                    "".join(
                        f'{{"index": {i}, "kind": "completion", '
                        f'"request": {{"prompt": "Prompt {i}", "max_tokens": 16}}}}\n'
                        for i in range(start, min(start + 10_000, first + count))
                    )
                )
            written += handle.tell()
        with open(directory / "results.tsv", "w") as handle:
            for start in range(first, first + count // 2, 10_000):
                handle.write(
                    "".join(
                        f'{i}\t{{"text": "ok", "num_prompt_tokens": 3, "num_completion_tokens": 16}}\n'
                        for i in range(start, min(start + 10_000, first + count // 2))
                    )
                )
            written += handle.tell()
        index += count
    return written


def make_running_job(store, job_storage, home: str, prompts: int, shard_files: bool) -> tuple[str, int]:
    """A job of `prompts` prompts, submitted, started, planned into SHARDS shards and half done, as the
    pipeline records it; its work dir as such a run leaves it when `shard_files`. Returns (id, bytes)."""
    import uuid

    from batch_pipeline.admission.policy import AdmissionPolicy
    from batch_pipeline.admission.submission import submit
    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.core.settings import settings
    from batch_pipeline.store.progress import ShardProgressStore

    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": f"{home}/inputs/big-{prompts}.jsonl",
            "output_data_path": f"{home}/out/big-{prompts}.json",
            "model_config": {"model": MODEL},
            "data_parallelism": SHARDS,
            "labels": {"size": str(prompts)},
        }
    )
    record, _ = submit(store, job_storage.work_dir, "anonymous", request, AdmissionPolicy.of_deployment(settings()))
    store.mark_started(record.job_id, str(uuid.uuid4()))
    per_shard = {k: prompts // SHARDS + (1 if k < prompts % SHARDS else 0) for k in range(SHARDS)}
    ShardProgressStore(engine=store.engine).record_shards(record.job_id, per_shard)
    for shard, total in per_shard.items():
        ShardProgressStore(engine=store.engine).record_shard_progress(
            record.job_id,
            shard,
            {"requests_done": total // 2, "completion_tokens": total * 8, "prompt_tokens": total * 20, "errors": 0},
        )
    written = write_shard_files(job_storage.work_dir(record.job_id), per_shard) if shard_files else 0
    return record.job_id, written


def start_api(home: str) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    log = Path(home, "api.log")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "batch_pipeline.api.app:create_app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=clean_environment(home),
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    wait_until_healthy(client, server, log, "the API")
    return server, client


def timed_get(client: httpx.Client, url: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.get(url)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response


def measure_reads(
    client: httpx.Client, big: dict[int, str], finished: list[str], samples: int, list_samples: int
) -> dict:
    largest = big[max(big)]
    for _ in range(20):  # first-request imports and caches are not a status read
        timed_get(client, f"/v2/batch-completions/{largest}")
        timed_get(client, "/v2/batch-completions?limit=100")
    _, response = timed_get(client, f"/v2/batch-completions/{largest}")
    shown = response.json()["job"]
    get_largest = [timed_get(client, f"/v2/batch-completions/{largest}")[0] for _ in range(samples)]
    rng = random.Random(1)
    get_finished = [timed_get(client, f"/v2/batch-completions/{rng.choice(finished)}")[0] for _ in range(samples)]
    by_size: dict[int, list[float]] = {size: [] for size in big}
    for _ in range(max(1, samples // 4)):  # interleaved: a busy spell on the machine hits every size
        for size, job_id in big.items():
            by_size[size].append(timed_get(client, f"/v2/batch-completions/{job_id}")[0])
    first_page = [timed_get(client, "/v2/batch-completions?limit=100") for _ in range(list_samples)]
    page = first_page[-1][1].json()
    after = page["last_id"]
    second_page = [timed_get(client, f"/v2/batch-completions?limit=100&after={after}")[0] for _ in range(list_samples)]
    return {
        "largest_job_as_shown": {"status": shown["status"], "metadata": shown["metadata"]},
        "get_largest_running_job": summary_ms(get_largest),
        "get_random_finished_job": summary_ms(get_finished),
        "get_running_job_by_prompts": {str(size): summary_ms(values) for size, values in by_size.items()},
        "list_100_first_page": summary_ms([elapsed for elapsed, _ in first_page])
        | {"jobs": len(page["jobs"]), "has_more": page["has_more"], "response_bytes": len(first_page[-1][1].content)},
        "list_100_second_page": summary_ms(second_page),
    }


def measure_create_rate(client: httpx.Client, home: str, clients: int, requests: int) -> dict:
    def create(i: int) -> int:
        body = {
            "output_data_path": f"{home}/out/rate-{i}.json",
            "model_config": {"model": MODEL},
            "content": {"prompts": [f"Prompt {i}"], "max_new_tokens": 1, "temperature": 0.0},
        }
        return client.post("/v2/batch-completions", json=body).status_code

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        codes = list(pool.map(create, range(requests)))
    elapsed = time.monotonic() - started
    return {
        "clients": clients,
        "requests": requests,
        "ok": codes.count(200),
        "wall_s": round(elapsed, 2),
        "requests_per_s": round(requests / elapsed, 1),
    }


# --- part 2: one jobs-sensor tick over many queued jobs with large inline content ------------------------


def tick_body(home: str, i: int, content_kb: float) -> dict:
    """A job whose inline content is about `content_kb` KB: prompts of ~500 characters."""
    prompt_chars = 500
    prompts = [
        f"job {i} prompt {j}: " + "lorem ipsum dolor sit amet " * (prompt_chars // 27)
        for j in range(max(1, round(content_kb * 1000 / (prompt_chars + 20))))
    ]
    return {
        "output_data_path": f"{home}/out/tick-{i}.json",
        "model_config": {"model": MODEL},
        "content": {"prompts": prompts, "max_new_tokens": 16, "temperature": 0.0},
        "labels": {"bench": "tick", "n": str(i)},
    }


def submit_tick_jobs(
    how: str, client: httpx.Client, store, job_storage, home: str, count: int, content_kb: float
) -> dict:
    from batch_pipeline.admission.policy import AdmissionPolicy
    from batch_pipeline.admission.submission import submit
    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.core.settings import settings

    def post(i: int) -> int:
        body = json.dumps(tick_body(home, i, content_kb), separators=(",", ":")).encode()
        return client.post(
            "/v2/batch-completions", content=body, headers={"content-type": "application/json"}
        ).status_code

    admission = AdmissionPolicy.of_deployment(settings())

    def direct(i: int) -> int:
        submit(
            store,
            job_storage.work_dir,
            "anonymous",
            CreateBatchCompletionsV2Request.model_validate(tick_body(home, i, content_kb)),
            admission,
        )
        return 200

    body_bytes = len(json.dumps(tick_body(home, 0, content_kb), separators=(",", ":")))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=4 if how == "api" else 1) as pool:
        codes = list(pool.map(post if how == "api" else direct, range(count)))
    elapsed = time.monotonic() - started
    if codes.count(200) != count:
        raise SystemExit(f"tick jobs: {count - codes.count(200)} of {count} submissions failed: {sorted(set(codes))}")
    return {
        "via": how,
        "jobs": count,
        "body_bytes_each": body_bytes,
        "content_mb_total": round(body_bytes * count / 1e6, 1),
        "wall_s": round(elapsed, 2),
        "jobs_per_s": round(count / elapsed, 1),
    }


def measure_tick(home: str, store_url: str, repeat: int, expected: int) -> dict:
    import dagster as dg
    from dagster._serdes import serialize_value

    from batch_pipeline.core.settings import settings
    from batch_pipeline.pipeline.resources import JobStoreResource, RunLaunching, Tenancy
    from batch_pipeline.pipeline.sensors import batch_jobs_sensor

    instance = dg.DagsterInstance.from_config(home)
    configured = settings()
    resources = {
        "job_store": JobStoreResource(url=store_url),
        "tenancy": Tenancy.of_deployment(configured),
        "run_launching": RunLaunching.of_deployment(configured),
    }
    ticks = []
    try:
        for _ in range(repeat):
            context = dg.build_sensor_context(instance=instance, resources=resources)
            started = time.perf_counter()
            requests = list(batch_jobs_sensor(interval_s=1)(context) or [])
            wall = time.perf_counter() - started
            json_bytes = sum(len(json.dumps(r.run_config)) + len(json.dumps(r.tags)) for r in requests)
            dagster_bytes = sum(len(serialize_value(r)) for r in requests)
            ticks.append(
                {
                    "wall_s": round(wall, 3),
                    "run_requests": len(requests),
                    "run_config_and_tags_json_mb": round(json_bytes / 1e6, 3),
                    "run_requests_serialized_mb": round(dagster_bytes / 1e6, 3),
                    "largest_run_request_bytes": max((len(serialize_value(r)) for r in requests), default=0),
                }
            )
            if len(requests) != expected:
                print(f"warning: the tick yielded {len(requests)} run requests for {expected} queued jobs", flush=True)
    finally:
        instance.dispose()
    walls = [tick["wall_s"] for tick in ticks]
    return {
        "ticks": ticks,
        "first_wall_s": walls[0],
        "median_wall_s": round(statistics.median(walls), 3),
        "run_requests": ticks[0]["run_requests"],
        "run_config_and_tags_json_mb": ticks[0]["run_config_and_tags_json_mb"],
        "run_requests_serialized_mb": ticks[0]["run_requests_serialized_mb"],
    }


def part_one_and_two(options: argparse.Namespace, home: str) -> dict:
    Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["DAGSTER_HOME"] = home  # this process's Dagster and job store, like the server's
    from batch_pipeline.pipeline.resources import JobStorage
    from batch_pipeline.store.jobs import JobStore

    store_url = f"sqlite:///{home}/batch_jobs.db"
    store = JobStore(store_url)
    job_storage = JobStorage(work_dir_base=f"{home}/work")
    started = time.monotonic()
    finished = seed_finished_jobs(store, options.store_jobs, home)
    sizes = sorted(
        {1000, 100_000, options.big_prompts}
        if options.big_prompts > 100_000
        else {min(1000, options.big_prompts), options.big_prompts}
    )
    big, shard_bytes = {}, 0
    for size in sizes:
        big[size], written = make_running_job(store, job_storage, home, size, not options.no_shard_files)
        shard_bytes += written
    seeding = {
        "finished_jobs": len(finished),
        "running_jobs": {str(size): job_id for size, job_id in big.items()},
        "shard_files_written": not options.no_shard_files,
        "shard_files_mb": round(shard_bytes / 1e6, 1),
        "seed_s": round(time.monotonic() - started, 1),
    }
    print(
        f"store: {len(finished)} finished jobs and running jobs of {', '.join(map(str, sizes))} prompts "
        f"(shard files {seeding['shard_files_mb']} MB) in {seeding['seed_s']} s",
        flush=True,
    )

    server, client = start_api(home)
    try:
        reads = measure_reads(client, big, finished, options.samples, options.list_samples)
        print(
            f"reads: GET p50 {reads['get_largest_running_job']['p50_ms']} ms, "
            f"LIST p50 {reads['list_100_first_page']['p50_ms']} ms",
            flush=True,
        )
        tick_submission = submit_tick_jobs(
            options.tick_submit, client, store, job_storage, home, options.tick_jobs, options.tick_content_kb
        )
        print(
            f"tick jobs: {options.tick_jobs} submitted ({options.tick_submit}) in {tick_submission['wall_s']} s",
            flush=True,
        )
        tick = measure_tick(home, store_url, options.tick_repeat, options.tick_jobs)
        print(f"tick: {tick['first_wall_s']} s first, {tick['median_wall_s']} s median", flush=True)
        create_rate = (
            measure_create_rate(client, home, options.clients, options.create_requests)
            if options.create_requests
            else None
        )
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=60)
        store.engine.dispose()
    return {
        "seeding": seeding,
        "reads": reads,
        "tick_submission": tick_submission,
        "tick": tick,
        "create_job": create_rate,
    }


# --- part 3: submit → start, and a burst, through the real deployment -------------------------------------


def processes_with_home(home: str) -> list[int]:
    """Pids of the processes this benchmark's deployment started (they carry its DAGSTER_HOME)."""
    marker = f"DAGSTER_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def stop_leftovers(home: str) -> list[int]:
    pids = processes_with_home(home)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.2)
    return pids


def tiny_body(home: str, name: str) -> dict:
    return {
        "output_data_path": f"{home}/out/{name}.json",
        "model_config": {"model": MODEL},
        "content": {"prompts": [f"Say {name}"], "max_new_tokens": 1, "temperature": 0.0},
    }


def wait_idle(instance, timeout_s: float) -> bool:
    """Until the instance has no unfinished run (cancelled jobs launch keep_partial_results runs)."""
    import dagster as dg

    unfinished = [
        dg.DagsterRunStatus.QUEUED,
        dg.DagsterRunStatus.NOT_STARTED,
        dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED,
        dg.DagsterRunStatus.CANCELING,
    ]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not instance.get_runs(filters=dg.RunsFilter(statuses=unfinished), limit=1):
            return True
        time.sleep(1)
    return False


def statuses(client: httpx.Client, wanted: set[str]) -> dict[str, str]:
    """The status of each wanted job as the API lists it (newest first, paged)."""
    seen: dict[str, str] = {}
    after = None
    while True:
        page = client.get("/v2/batch-completions", params={"limit": 1000, **({"after": after} if after else {})}).json()
        seen |= {job["job_id"]: job["status"] for job in page["jobs"] if job["job_id"] in wanted}
        if len(seen) == len(wanted) or not page["has_more"]:
            return seen
        after = page["last_id"]


def measure_latency(client: httpx.Client, instance, store, home: str, samples: int) -> dict:
    import dagster as dg

    from batch_pipeline.pipeline.tags import JOB_ID_TAG

    rows = []
    for i in range(samples):
        submitted = time.time()
        job_id = client.post("/v2/batch-completions", json=tiny_body(home, f"latency-{i}")).json()["job_id"]
        run_started = job_running = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if run_started is None:
                records = instance.get_run_records(filters=dg.RunsFilter(tags={JOB_ID_TAG: job_id}), limit=1)
                if records and records[0].start_time:
                    run_started = records[0].start_time - submitted
            status = client.get(f"/v2/batch-completions/{job_id}").json()["job"]["status"]
            if status != "queued":
                job_running = time.time() - submitted
                break
            time.sleep(0.1)
        record = store.get(job_id)
        rows.append(
            {
                "job_id": job_id,
                "run_started_s": round(run_started, 2) if run_started is not None else None,
                "api_not_queued_s": round(job_running, 2) if job_running is not None else None,
                "row_queue_wait_s": round(record.queue_wait_s, 2) if record.queue_wait_s is not None else None,
                "status_seen": status,
            }
        )
        print(f"latency sample {i + 1}: {rows[-1]}", flush=True)
        client.post(f"/v2/batch-completions/{job_id}/actions/cancel")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and client.get(f"/v2/batch-completions/{job_id}").json()["job"][
            "status"
        ] not in ("cancelled", "completed", "failed"):
            time.sleep(0.2)

    def spread(key: str) -> dict | None:
        values = [row[key] for row in rows if row[key] is not None]
        if not values:
            return None
        return {
            "median": round(statistics.median(values), 2),
            "min": min(values),
            "max": max(values),
            "samples": len(values),
        }

    return {
        "samples": rows,
        "run_started_s": spread("run_started_s"),
        "api_not_queued_s": spread("api_not_queued_s"),
        "row_queue_wait_s": spread("row_queue_wait_s"),
    }


def measure_burst(client: httpx.Client, instance, store, home: str, count: int, timeout_s: float) -> dict:
    import dagster as dg

    from batch_pipeline.pipeline.tags import JOB_ID_TAG

    started = time.time()
    with ThreadPoolExecutor(max_workers=16) as pool:
        responses = list(
            pool.map(lambda i: client.post("/v2/batch-completions", json=tiny_body(home, f"burst-{i}")), range(count))
        )
    posted_s = time.time() - started
    job_ids = {response.json()["job_id"] for response in responses if response.status_code == 200}
    launched_at: dict[str, float] = {}
    left_queued_at: dict[str, float] = {}
    all_launched_s = all_left_queued_s = None
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time() - started
        for run in instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"), limit=len(job_ids) + 100):
            job_id = run.tags.get(JOB_ID_TAG)
            if job_id in job_ids and job_id not in launched_at:
                launched_at[job_id] = now
        if all_launched_s is None and len(launched_at) == len(job_ids):
            all_launched_s = round(now, 2)
        seen = statuses(client, job_ids)
        for job_id, status in seen.items():
            if status != "queued" and job_id not in left_queued_at:
                left_queued_at[job_id] = now
        if len(left_queued_at) == len(job_ids):
            all_left_queued_s = round(now, 2)
            break
        time.sleep(1)
    counts = {status: list(seen.values()).count(status) for status in sorted(set(seen.values()))}
    waits = [store.get(job_id).queue_wait_s for job_id in job_ids]
    waits = [wait for wait in waits if wait is not None]
    unfinished = [job_id for job_id, status in seen.items() if status in ("queued", "running")]
    for job_id in unfinished:  # a timed-out burst does not keep running (or queue) after the benchmark
        client.post(f"/v2/batch-completions/{job_id}/actions/cancel")
    return {
        "jobs": count,
        "accepted": len(job_ids),
        "post_wall_s": round(posted_s, 2),
        "all_launched_s": all_launched_s,
        "launched": len(launched_at),
        "all_left_queued_s": all_left_queued_s,
        "left_queued": len(left_queued_at),
        "timed_out": all_left_queued_s is None,
        "timeout_s": timeout_s,
        "statuses_then": counts,
        "reached_running_or_completed": sum(counts.get(status, 0) for status in ("running", "completed")),
        "row_queue_wait_s": {
            "median": round(statistics.median(waits), 2),
            "max": round(max(waits), 2),
            "samples": len(waits),
        }
        if waits
        else None,
        "cancelled_at_end": len(unfinished),
    }


def part_three(options: argparse.Namespace, home: str) -> dict:
    write_dagster_yaml(home, options.run_slots)
    api_port, dagster_port = free_port(), free_port()
    log = Path(home, "serve.log")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batch_pipeline.entrypoints.serve",
            "--port",
            str(api_port),
            "--dagster-port",
            str(dagster_port),
        ],
        env=clean_environment(home, BATCH_PIPELINE_SENSOR_INTERVAL_S="1"),
        cwd=REPO,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120)
    instance = store = None
    try:
        wait_until_healthy(client, serve, log, "the deployment", interval_s=0.5)
        import dagster as dg

        from batch_pipeline.store.jobs import JobStore

        instance = dg.DagsterInstance.from_config(home)
        store = JobStore(f"sqlite:///{home}/batch_jobs.db")
        result: dict = {"run_slots": options.run_slots}
        if options.latency_samples:
            result["latency"] = measure_latency(client, instance, store, home, options.latency_samples)
            result["idle_before_burst"] = wait_idle(instance, 180)
        if options.burst:
            timeout_s = options.burst_timeout or 120 + 60 * options.burst / options.run_slots
            result["burst"] = measure_burst(client, instance, store, home, options.burst, timeout_s)
            print(f"burst: {result['burst']}", flush=True)
        wait_idle(instance, 120)
        return result
    finally:
        client.close()
        if instance is not None:
            instance.dispose()
        if store is not None:
            store.engine.dispose()
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        if leftovers := stop_leftovers(home):
            print(f"stopped {len(leftovers)} leftover processes of the deployment: {leftovers}", flush=True)


# --- the report --------------------------------------------------------------------------------------------


def verdicts(result: dict) -> list[tuple[str, str, str, bool | None]]:
    """(what, measured, target, met) for each of issue #15's targets that this run measured."""
    rows: list[tuple[str, str, str, bool | None]] = []
    stores = result["parameters"]["store_jobs"]
    if reads := result.get("reads"):
        get, listed = reads["get_largest_running_job"], reads["list_100_first_page"]
        big = result["parameters"]["big_prompts"]
        rows += [
            (
                f"GET running {big}-prompt job, {stores} jobs stored: p50",
                f"{get['p50_ms']} ms",
                f"≤ {TARGETS['get_p50_ms']} ms",
                get["p50_ms"] <= TARGETS["get_p50_ms"],
            ),
            ("  p99", f"{get['p99_ms']} ms", f"≤ {TARGETS['get_p99_ms']} ms", get["p99_ms"] <= TARGETS["get_p99_ms"]),
            (
                "GET random finished job: p50 / p99",
                f"{reads['get_random_finished_job']['p50_ms']} / {reads['get_random_finished_job']['p99_ms']} ms",
                f"≤ {TARGETS['get_p50_ms']} / {TARGETS['get_p99_ms']} ms",
                reads["get_random_finished_job"]["p50_ms"] <= TARGETS["get_p50_ms"]
                and reads["get_random_finished_job"]["p99_ms"] <= TARGETS["get_p99_ms"],
            ),
            (
                f"LIST limit=100, {stores} jobs stored: p50",
                f"{listed['p50_ms']} ms",
                f"≤ {TARGETS['list_p50_ms']} ms",
                listed["p50_ms"] <= TARGETS["list_p50_ms"],
            ),
            (
                "  p99",
                f"{listed['p99_ms']} ms",
                f"≤ {TARGETS['list_p99_ms']} ms",
                listed["p99_ms"] <= TARGETS["list_p99_ms"],
            ),
        ]
        for size, figures in reads["get_running_job_by_prompts"].items():
            rows.append((f"GET p50, running job of {size} prompts", f"{figures['p50_ms']} ms", "flat in size", None))
    if tick := result.get("tick"):
        jobs = result["parameters"]["tick_jobs"]
        submitted = result["tick_submission"]
        content = (
            f"{submitted['content_mb_total']} MB of content, {'posted' if submitted['via'] == 'api' else 'submitted'} "
            f"{'to the API' if submitted['via'] == 'api' else 'directly'}"
        )
        rows += [
            (
                f"sensor tick, {jobs} queued jobs: wall (first / median)",
                f"{tick['first_wall_s']} / {tick['median_wall_s']} s",
                f"≤ {TARGETS['tick_wall_s']} s",
                tick["median_wall_s"] <= TARGETS["tick_wall_s"],
            ),
            (
                f"  RunRequests: json of run_config + tags ({tick['run_requests']} requests; {content})",
                f"{tick['run_config_and_tags_json_mb']} MB",
                f"< {TARGETS['tick_run_requests_mb']} MB",
                tick["run_config_and_tags_json_mb"] < TARGETS["tick_run_requests_mb"],
            ),
            (
                "  RunRequests as Dagster serializes them",
                f"{tick['run_requests_serialized_mb']} MB",
                f"< {TARGETS['tick_run_requests_mb']} MB",
                tick["run_requests_serialized_mb"] < TARGETS["tick_run_requests_mb"],
            ),
        ]
    if create := result.get("create_job"):
        rows.append(
            (
                f"POST create, {create['clients']} clients",
                f"{create['requests_per_s']} /s ({create['ok']}/{create['requests']} ok)",
                "-",
                None,
            )
        )
    deployment = result.get("deployment") or {}
    if (latency := deployment.get("latency")) and latency["run_started_s"]:
        median = latency["run_started_s"]["median"]
        rows.append(
            (
                f"submit → Dagster run started: median of {latency['run_started_s']['samples']}",
                f"{median} s",
                f"≤ {TARGETS['submit_to_start_median_s']} s",
                median <= TARGETS["submit_to_start_median_s"],
            )
        )
        if latency["row_queue_wait_s"]:
            rows.append(
                (
                    "submit → job row running (queue_wait_s): median",
                    f"{latency['row_queue_wait_s']['median']} s",
                    f"≤ {TARGETS['submit_to_start_median_s']} s",
                    latency["row_queue_wait_s"]["median"] <= TARGETS["submit_to_start_median_s"],
                )
            )
    if burst := deployment.get("burst"):
        rows.append(
            (
                f"burst of {burst['jobs']} jobs, {deployment['run_slots']} run slots: all have a run",
                f"{burst['all_launched_s']} s ({burst['launched']}/{burst['accepted']})",
                "-",
                None,
            )
        )
        rows.append(
            (
                "  all left queued (then: " + ", ".join(f"{k} {v}" for k, v in burst["statuses_then"].items()) + ")",
                f"{burst['all_left_queued_s']} s ({burst['left_queued']}/{burst['accepted']})",
                "all start",
                not burst["timed_out"],
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store-jobs", type=int, default=10_000, help="finished jobs in the store (issue: 10,000)")
    parser.add_argument("--big-prompts", type=int, default=1_000_000, help="prompts of the largest running job")
    parser.add_argument("--no-shard-files", action="store_true", help="leave the running jobs' work dirs empty")
    parser.add_argument("--samples", type=int, default=1000, help="GETs per measurement")
    parser.add_argument("--list-samples", type=int, default=200, help="LISTs per page measured")
    parser.add_argument("--tick-jobs", type=int, default=1000, help="queued jobs for the sensor tick")
    parser.add_argument("--tick-content-kb", type=float, default=50, help="inline content of each tick job, KB")
    parser.add_argument(
        "--tick-submit",
        choices=("api", "direct"),
        default="api",
        help="post the tick jobs to the API, or call submission.submit in this process",
    )
    parser.add_argument("--tick-repeat", type=int, default=3, help="sensor ticks evaluated")
    parser.add_argument("--clients", type=int, default=50, help="threads of the create-rate measurement")
    parser.add_argument(
        "--create-requests", type=int, default=500, help="tiny POSTs timed for the create rate (0: skip)"
    )
    parser.add_argument("--no-serve", action="store_true", help="skip part 3 (the deployment, real vLLM jobs)")
    parser.add_argument("--latency-samples", type=int, default=5, help="jobs timed one at a time, submit → start")
    parser.add_argument("--burst", type=int, default=20, help="tiny jobs posted at once (issue: 200; each runs vLLM)")
    parser.add_argument(
        "--burst-timeout",
        type=float,
        default=0,
        help="seconds to wait for the burst to leave the queue (0: 120 + 60 x burst / run slots)",
    )
    parser.add_argument("--run-slots", type=int, default=2, help="runs at once in part 3 (max_concurrent_runs)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary DAGSTER_HOMEs (their paths are printed)"
    )
    parser.add_argument("--out", type=Path, help="results file (default bench/results/control_plane-<time>.json)")
    options = parser.parse_args()
    out = options.out or RESULTS / f"control_plane-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"

    result: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "parameters": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(options).items()},
        "targets": TARGETS,
    }
    homes = []
    try:
        home = tempfile.mkdtemp(prefix="bench-control-plane-store-")
        homes.append(home)
        result |= part_one_and_two(options, home)
        if not options.no_serve and (options.latency_samples or options.burst):
            home = tempfile.mkdtemp(prefix="bench-control-plane-serve-")
            homes.append(home)
            result["deployment"] = part_three(options, home)
    finally:
        for home in homes:
            if options.keep:
                print(f"kept {home}")
            else:
                shutil.rmtree(home, ignore_errors=True)

    rows = verdicts(result)
    result["verdicts"] = [
        {"what": what.strip(), "measured": measured, "target": target, "met": met}
        for what, measured, target, met in rows
    ]
    cpu = result["machine"]
    print(
        f"\n{cpu['cpu_model']}, {cpu['cpu_count']} CPUs, AVX-512 {'yes' if cpu['avx512'] else 'no'}; "
        f"times are client-side over loopback\n"
    )
    print("| measurement | measured | target (#15) | met |")
    print("|---|---|---|---|")
    for what, measured, target, met in rows:
        print(f"| {what} | {measured} | {target} | {'-' if met is None else 'yes' if met else 'NO'} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
