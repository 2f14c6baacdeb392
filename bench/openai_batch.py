"""OpenAI's Batch API: what the batch path adds around vLLM, against baselines measured in the same run.

    .venv/bin/python bench/openai_batch.py [--lines 50000] [--e2e-prompts 256] [--max-tokens 32] [--repeat 2]
        [--no-e2e] [--out PATH]

Part 1, no engine: a file of `--lines` chat requests (~370 bytes a line), through the API in a fresh
DAGSTER_HOME (uvicorn, no daemon: nothing runs).
- upload: `POST /v1/files`, wall and MB/s, and the API's peak RSS over idle (VmHWM); baseline: copying the
  same file on the same disk.
- check: `POST /v1/batches` (each line checked, the job's content written); baseline: vLLM's `run_batch`
  parse of the same lines (`BatchRequestInput.model_validate_json` a line, what it does before any engine).
- results: `write_result_files` over `--lines` chat.completion entries; baseline: `json.loads` and
  `json.dumps` of each entry, the floor of rewriting a line.
Part 2, vLLM: `--e2e-prompts` chat requests as one batch file.
- ours: `python -m batch_pipeline.entrypoints.serve` (API, Dagster webserver and daemon), up before timing; timed from
  the upload to the output file downloaded (polled every 0.5 s), the shard's engine start included;
- run_batch: vLLM's own `run_batch` entrypoint on the same file, a cold process timed start to exit.
Medians (and min-max) over `--repeat` rounds, systems alternated; ratios ours/baseline. Writes
bench/results/openai_batch-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from control_plane import clean_environment, machine, start_api, write_dagster_yaml
from engine_overhead import prompts, run_batch_file
from served import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


def batch_file(path: Path, texts: list[str], model: str, max_tokens: int) -> int:
    with open(path, "w") as handle:
        for index, text in enumerate(texts):
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": text},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            handle.write(json.dumps({"custom_id": f"req-{index}", "method": "POST", "url": CHAT, "body": body}) + "\n")
    return path.stat().st_size


def status_mb(pid: int, field: str) -> float:
    """A memory figure of /proc/PID/status: VmRSS (now) or VmHWM (the peak since the last reset)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS


def vllm_parse(path: Path) -> float:
    from vllm.entrypoints.launchers.run_batch import BatchRequestInput

    started = time.perf_counter()
    with open(path) as handle:
        for line in handle:
            if line.strip():
                BatchRequestInput.model_validate_json(line)
    return time.perf_counter() - started


def results_entries(count: int) -> list[dict]:
    return [
        {
            "id": f"chatcmpl-{i}",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"An answer of a few words, {i}."},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": 32, "total_tokens": 72},
        }
        for i in range(count)
    ]


def part_one(options: argparse.Namespace, work: Path) -> dict:
    from batch_pipeline.openai_batch.jobs import write_result_files

    source = work / "input.jsonl"
    size = batch_file(source, [f"{text} ({i})" for i, text in enumerate(prompts(options.lines))], MODEL, 32)
    rounds: dict[str, list[float]] = {
        name: []
        for name in (
            "upload_s",
            "copy_s",
            "upload_peak_over_idle_mb",
            "check_s",
            "vllm_parse_s",
            "results_s",
            "rewrite_s",
        )
    }
    entries = results_entries(options.lines)
    ids = work / "custom_ids.jsonl"
    ids.write_text("".join(json.dumps(f"req-{i}") + "\n" for i in range(options.lines)))
    for round_index in range(options.repeat):
        home = tempfile.mkdtemp(dir=work)
        server, client = start_api(home)
        try:
            client.get("/v1/files")  # first-request imports are not upload memory
            time.sleep(0.5)
            reset_peak(server.pid)
            idle = status_mb(server.pid, "VmRSS")
            started = time.perf_counter()
            with open(source, "rb") as handle:
                uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", handle)})
            rounds["upload_s"].append(time.perf_counter() - started)
            rounds["upload_peak_over_idle_mb"].append(status_mb(server.pid, "VmHWM") - idle)
            assert uploaded.status_code == 200, uploaded.text
            started = time.perf_counter()
            batch = client.post(
                "/v1/batches",
                json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
            ).json()
            rounds["check_s"].append(time.perf_counter() - started)
            assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == options.lines, batch
        finally:
            server.terminate()
            server.wait()
        started = time.perf_counter()
        shutil.copyfile(source, work / f"copy-{round_index}")
        rounds["copy_s"].append(time.perf_counter() - started)
        rounds["vllm_parse_s"].append(vllm_parse(source))
        started = time.perf_counter()
        write_result_files("batch-bench", "bench", str(ids), iter(entries), str(work / f"files-{round_index}"))
        rounds["results_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with open(work / f"rewrite-{round_index}", "w") as out:
            for entry in entries:
                out.write(json.dumps({"custom_id": entry["id"], "response": json.loads(json.dumps(entry))}) + "\n")
        rounds["rewrite_s"].append(time.perf_counter() - started)
        shutil.rmtree(home, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "lines": options.lines,
        "file_mb": round(size / 1e6, 1),
        "rounds": {name: [round(v, 3) for v in values] for name, values in rounds.items()},
        "medians": {name: round(value, 3) for name, value in medians.items()},
        "upload_mb_per_s": round(size / 1e6 / medians["upload_s"], 1),
        "ratios": {
            "upload / copy": round(medians["upload_s"] / medians["copy_s"], 1),
            "check / vllm_parse": round(medians["check_s"] / medians["vllm_parse_s"], 2),
            "results / rewrite": round(medians["results_s"] / medians["rewrite_s"], 2),
        },
    }


def start_serve(home: str) -> tuple[subprocess.Popen, httpx.Client]:
    write_dagster_yaml(home, run_slots=1)
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
        cwd=REPO,
        # Its rounds run the same greedy batch (embeddings.py's: the same inputs) on one deployment: the result
        # cache would answer the later rounds, and what is measured is their generation.
        env=clean_environment(home, VLLM_LOGGING_LEVEL="WARNING", BATCH_PIPELINE_RESULT_CACHE="0"),
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120)
    wait_until_healthy(client, serve, log, "the deployment", interval_s=0.5)
    return serve, client


def ours_e2e(client: httpx.Client, source: Path) -> dict:
    started = time.monotonic()
    with open(source, "rb") as handle:
        file_id = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", handle)}).json()["id"]
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    ).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed", batch
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    wall = time.monotonic() - started
    tokens = sum(
        json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in filter(None, output.split("\n"))
    )
    return {"wall_s": wall, "completion_tokens": tokens}


def part_two(options: argparse.Namespace, work: Path) -> dict:
    from batch_pipeline.models.catalog import resolve_model

    model_path = resolve_model(MODEL)
    texts = prompts(options.e2e_prompts)
    ours_file, vllm_file = work / "e2e-ours.jsonl", work / "e2e-vllm.jsonl"
    batch_file(ours_file, texts, MODEL, options.max_tokens)
    batch_file(vllm_file, texts, model_path, options.max_tokens)
    home = tempfile.mkdtemp(dir=work)
    serve, client = start_serve(home)
    results: dict[str, list[dict]] = {"ours": [], "run_batch": []}
    try:
        for round_index in range(options.repeat):
            order = ["ours", "run_batch"] if round_index % 2 == 0 else ["run_batch", "ours"]
            for system in order:
                if system == "ours":
                    results[system].append(ours_e2e(client, ours_file))
                else:
                    results[system].append(run_batch_file(vllm_file, work / f"out-{round_index}.jsonl", model_path))
                print(system, {k: round(v, 2) for k, v in results[system][-1].items()}, flush=True)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
    summary = {}
    for system, runs in results.items():
        walls = [run["wall_s"] for run in runs]
        summary[system] = {
            "wall_s": round(statistics.median(walls), 2),
            "min_s": round(min(walls), 2),
            "max_s": round(max(walls), 2),
            "completion_tokens": runs[-1]["completion_tokens"],
        }
    return {
        "prompts": options.e2e_prompts,
        "max_tokens": options.max_tokens,
        "systems": summary,
        "ours / run_batch": round(summary["ours"]["wall_s"] / summary["run_batch"]["wall_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--e2e-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    report = {"machine": machine(), "started_at": datetime.now(UTC).isoformat()}
    with tempfile.TemporaryDirectory() as work:
        report["part_one"] = part_one(options, Path(work))
        print(json.dumps(report["part_one"], indent=2), flush=True)
        if not options.no_e2e:
            report["part_two"] = part_two(options, Path(work))
            print(json.dumps(report["part_two"], indent=2), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = options.out or RESULTS / f"openai_batch-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
