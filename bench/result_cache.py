"""A team's result cache across jobs (issue 49): what a resubmission with a few requests changed costs.

    .venv/bin/python bench/result_cache.py [--requests 10000] [--changed 0.02] [--max-tokens 16]
        [--planning 1000000] [--no-serve] [--no-planning] [--out PATH]

Part 1, served: `python -m batch_pipeline.entrypoints.serve` with BATCH_PIPELINE_RESULT_CACHE=1 (API, Dagster
webserver and daemon, real vLLM), up before timing, in a fresh DAGSTER_HOME. A job of `--requests` greedy
completion requests (`--max-tokens` each), submission to completed; then the same job with `--changed` of its
requests' prompts changed (every 1/changed-th). Reports both walls and their ratio; checks that every
unchanged request's output equals the first job's (which generated it: a fresh run's) and says it came from
it (`cached_from_job_id`), that every changed one was generated (no marker), and the job's `num_cached`.

Part 2, planning: a `--planning`-request job's plan (`shards.replanning.write_job_shards`, what the pipeline's
plan step calls) in a fresh work dir, without the cache, then again as a resubmission whose every request
its team's cache holds (`with_cache_hits` over `lookup_in` a SQLite job store, as the plan step wires them).
The cache is filled by the merge's own keep path (`pipeline.result_cache.keep_results`) over the first
plan's shards, each given an output line per request as a worker writes them. Ratio: with / without.
Writes bench/results/result_cache-<time>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from control_plane import clean_environment, machine, stop_leftovers, write_dagster_yaml, write_results
from resume import ENDED, MODEL, wait_for_job
from served import start_serve, stop_serve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OWNER = "bench-team"


def prompt(index: int, changed: bool) -> str:
    return f"Request {index}{' (changed)' if changed else ''}: the number after {index} is"


def changed_indices(requests: int, share: float) -> set[int]:
    step = max(1, round(1 / share)) if share > 0 else requests + 1
    return set(range(step - 1, requests, step))


def content(requests: int, max_tokens: int, changed: set[int]) -> list[dict]:
    return [{"prompt": prompt(i, i in changed), "max_tokens": max_tokens, "temperature": 0.0} for i in range(requests)]


def run_job(client, out: Path, name: str, body: list[dict], log: Path) -> tuple[float, dict, list[dict]]:
    """A job submitted and waited for: its wall (submission to completed), its metadata file and its output."""
    output = out / f"{name}.json"
    started = time.monotonic()
    response = client.post(
        "/v2/batch-completions",
        json={"output_data_path": str(output), "model_config": {"model": MODEL}, "content": body},
    )
    assert response.status_code == 200, response.text
    job_id = response.json()["job_id"]
    job = wait_for_job(client, job_id, lambda j: j["status"] in ENDED, 7200, log)
    wall = time.monotonic() - started
    assert job["status"] == "completed", job
    metadata = json.loads(Path(f"{output}.metadata.json").read_text())
    return wall, {"job_id": job_id, **metadata}, json.loads(output.read_text())


def output_text(entry: dict) -> str:
    return entry["text"] if "text" in entry else entry["choices"][0]["text"]


def served(requests: int, share: float, max_tokens: int) -> dict:
    changed = changed_indices(requests, share)
    with tempfile.TemporaryDirectory(prefix="bench-result-cache-") as directory:
        work = Path(directory)
        home, out = work / "dagster_home", work / "out"
        home.mkdir()
        out.mkdir()
        write_dagster_yaml(str(home), 1)
        env = clean_environment(
            str(home),
            BATCH_PIPELINE_RESULT_CACHE="1",
            BATCH_PIPELINE_SENSOR_INTERVAL_S="1",
            VLLM_LOGGING_LEVEL="WARNING",
        )
        serve, client = start_serve(home, env, REPO)
        log = home / "serve.log"
        try:
            first_wall, first, first_out = run_job(client, out, "first", content(requests, max_tokens, set()), log)
            print(json.dumps({"first_wall_s": round(first_wall, 2)}), flush=True)
            second_wall, second, second_out = run_job(
                client, out, "second", content(requests, max_tokens, changed), log
            )
            print(json.dumps({"second_wall_s": round(second_wall, 2)}), flush=True)
        finally:
            client.close()
            stop_serve(serve)
            stop_leftovers(str(home))
    assert len(first_out) == len(second_out) == requests
    unchanged = [i for i in range(requests) if i not in changed]
    assert first.get("num_cached") in (None, 0), first  # the first job generated every request
    differ = [i for i in unchanged if output_text(second_out[i]) != output_text(first_out[i])]
    not_marked = [i for i in unchanged if second_out[i].get("cached_from_job_id") != first["job_id"]]
    changed_cached = [i for i in sorted(changed) if "cached_from_job_id" in second_out[i]]
    return {
        "requests": requests,
        "changed": len(changed),
        "max_tokens": max_tokens,
        "first_wall_s": round(first_wall, 2),
        "second_wall_s": round(second_wall, 2),
        "second / first": round(second_wall / first_wall, 4),
        "second_num_cached": second.get("num_cached"),
        "unchanged_outputs_differing_from_first": len(differ),
        "unchanged_not_marked_cached_from_first": len(not_marked),
        "changed_marked_cached": len(changed_cached),
    }


def planning(requests: int) -> dict:
    from batch_pipeline.core import io
    from batch_pipeline.pipeline.result_cache import keep_results, lookup_in
    from batch_pipeline.shards.format import OUTPUT_FILE, read_work_items
    from batch_pipeline.shards.planning import PlanningSettings
    from batch_pipeline.shards.records import work_items
    from batch_pipeline.shards.replanning import write_job_shards
    from batch_pipeline.shards.result_cache import CacheIdentity, with_cache_hits
    from batch_pipeline.store.result_cache import ResultCacheStore

    identity = CacheIdentity(owner=OWNER, model=MODEL, weights_digest="bench", engine='{"dtype": "float32"}')
    settings = PlanningSettings(max_shards=2, min_tokens_per_shard=0)
    with tempfile.TemporaryDirectory(prefix="bench-result-cache-plan-") as directory:
        work = Path(directory)
        # The job's input file, read as the plan step reads an `input_data_path`.
        source = work / "input.jsonl"
        with open(source, "w") as handle:
            for record in content(requests, 16, set()):
                handle.write(json.dumps(record) + "\n")

        def items():
            return work_items(io.iter_json_records(str(source)))

        store = ResultCacheStore(f"sqlite:///{work}/jobs.db")
        started = time.perf_counter()
        without = write_job_shards(items(), str(work / "first"), None, 2, settings, False)
        without_s = time.perf_counter() - started
        print(json.dumps({"planning_without_cache_s": round(without_s, 2)}), flush=True)
        # What the first job's workers wrote, then what its merge keeps.
        for shard in without.shards:
            with open(Path(shard.directory, OUTPUT_FILE), "w") as handle:
                for item in read_work_items(shard.input_path):
                    entry = {
                        "text": f" {item.index + 1}.",
                        "num_prompt_tokens": 12,
                        "num_completion_tokens": 3,
                        "finish_reason": "stop",
                    }
                    handle.write(f"{item.index}\t{json.dumps(entry)}\n")
        started = time.perf_counter()
        kept = keep_results(
            store, identity, "job-first", [shard.directory for shard in without.shards], str(work / "cache")
        )
        keep_s = time.perf_counter() - started
        assert kept == requests, kept
        print(json.dumps({"kept": kept, "keep_s": round(keep_s, 2)}), flush=True)
        hits = functools.partial(with_cache_hits, identity=identity, lookup=lookup_in(store, OWNER))
        started = time.perf_counter()
        with_cache = write_job_shards(items(), str(work / "second"), None, 2, settings, False, cache_hits=hits)
        with_s = time.perf_counter() - started
        cached = sum(shard.cached_count for shard in with_cache.shards)
        assert cached == requests, cached
    return {
        "requests": requests,
        "cache_entries": kept,
        "keep_s": round(keep_s, 2),
        "without_cache_s": round(without_s, 2),
        "with_cache_s": round(with_s, 2),
        "hits": cached,
        "with / without": round(with_s / without_s, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="the served job's requests")
    parser.add_argument("--changed", type=float, default=0.02, help="the share of them the second job changes")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--planning", type=int, default=1_000_000, help="the planned job's requests")
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--no-planning", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict = {"benchmark": "result_cache", "at": datetime.now(UTC).isoformat(), "machine": machine()}
    if not args.no_planning:
        results["planning"] = planning(args.planning)
        print(json.dumps(results["planning"]), flush=True)
    if not args.no_serve:
        results["served"] = served(args.requests, args.changed, args.max_tokens)
        print(json.dumps(results["served"]), flush=True)
    results["load_average_at_end"] = list(os.getloadavg())
    write_results("result_cache", results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
