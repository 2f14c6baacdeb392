"""Sharding: the same job at several `data_parallelism` values through `batch-pipeline run`, and what the
measurements predict for N devices.

    .venv/bin/python bench/sharding.py [--prompts 512] [--max-tokens 64] [--dp 1 2 4] [--repeat 3]

The job is engine_overhead.py's: its chat prompts, greedy, from a cold process. Each run reads the job's
metadata file for its shards' own timings: engine start (vLLM's import, the engine's build and the model
load) and generation. Reports, per dp, the wall time, completion tokens/s, the fixed cost per shard and the
job's overhead: its wall minus its longest worker (shards beyond what the machine runs at once, its core
count here, wait their turn, and that wait counts too). Writes bench/results/sharding-<time>.json.

The prediction: a job is a fixed cost (the orchestration around the workers, plus one engine start, paid by
every shard at once) and its generation work, which N shards on N devices split. From the dp=1 runs,
wall(N) ≈ fixed + work/N, for devices each as fast as this machine's one engine. On this machine shards
share the same cores, so its walls at dp > 1 show what sharding costs, not what it gains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from engine_overhead import MODEL, RESULTS, prompts, run_job

PREDICTED_DEVICES = (1, 2, 4, 8, 16, 64)


def summarize(runs: list[dict]) -> list[dict]:
    """Per dp: medians and spread of the wall and tokens/s, the median engine start of a shard, the slowest
    shard's generation, and the overhead (wall minus the longest worker)."""
    summary = []
    for dp in sorted({run["dp"] for run in runs}):
        of_dp = [run for run in runs if run["dp"] == dp]
        walls = [run["wall_s"] for run in of_dp]
        summary.append(
            {
                "dp": dp,
                "runs": len(of_dp),
                "shards": of_dp[0]["shards_run"],
                "wall_s_median": round(statistics.median(walls), 1),
                "wall_s_min": round(min(walls), 1),
                "wall_s_max": round(max(walls), 1),
                "tokens_per_s_median": round(statistics.median(run["tokens_per_s"] for run in of_dp), 1),
                "engine_start_s_median": round(
                    statistics.median(s["engine_start_s"] for run in of_dp for s in run["shards"]), 1
                ),
                "slowest_generate_s_median": round(
                    statistics.median(max(s["generate_s"] for s in run["shards"]) for run in of_dp), 1
                ),
                "overhead_s_median": round(
                    statistics.median(run["wall_s"] - max(s["wall_s"] for s in run["shards"]) for run in of_dp), 1
                ),
            }
        )
    return summary


def predict(runs: list[dict]) -> dict | None:
    """wall(N) ≈ fixed + work/N, fitted on the dp=1 runs (None without them)."""
    single = [run for run in runs if run["dp"] == 1]
    if not single:
        return None
    work = statistics.median(run["shards"][0]["generate_s"] for run in single)
    fixed = statistics.median(run["wall_s"] - run["shards"][0]["generate_s"] for run in single)
    tokens = single[0]["completion_tokens"]
    walls = {n: fixed + work / n for n in PREDICTED_DEVICES}
    return {
        "fixed_s": round(fixed, 1),
        "work_s": round(work, 1),
        "engine_start_s": round(statistics.median(run["shards"][0]["engine_start_s"] for run in single), 1),
        "devices": [
            {
                "n": n,
                "wall_s": round(wall, 1),
                "tokens_per_s": round(tokens / wall, 1),
                "speedup": round(walls[1] / wall, 2),
            }
            for n, wall in walls.items()
        ],
        "speedup_limit": round(walls[1] / fixed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()

    spec = {"model": MODEL, "prompts": prompts(options.prompts), "max_tokens": options.max_tokens, "temperature": 0.0}
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(options.repeat):
            shift = round_index % len(options.dp)
            for dp in options.dp[shift:] + options.dp[:shift]:  # rotate who goes first, as engine_overhead does
                wall, metadata = run_job(spec, Path(scratch), data_parallelism=dp)
                shards = [
                    {key: shard[key] for key in ("shard_index", "items", "engine_start_s", "generate_s", "wall_s")}
                    for shard in metadata["shards"]
                ]
                run = {
                    "dp": dp,
                    "round": round_index,
                    "wall_s": round(wall, 2),
                    "shards_run": len(shards),
                    "completion_tokens": metadata["completion_tokens"],
                    "tokens_per_s": round(metadata["completion_tokens"] / wall, 1),
                    "shards": shards,
                }
                runs.append(run)
                print(json.dumps(run), flush=True)

    summary, model = summarize(runs), predict(runs)
    out = options.out or RESULTS / f"sharding-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "sharding",
                "prompts": options.prompts,
                "max_tokens": options.max_tokens,
                "cpu_count": os.cpu_count(),
                "runs": runs,
                "summary": summary,
                "model": model,
            },
            indent=2,
        )
    )
    print(
        "\n| dp | shards | wall s (median, min-max) | completion tokens/s | engine start s per shard "
        "| slowest shard generate s | overhead s |\n|---|---|---|---|---|---|---|"
    )
    for row in summary:
        print(
            f"| {row['dp']} | {row['shards']} | {row['wall_s_median']} ({row['wall_s_min']}-{row['wall_s_max']}) "
            f"| {row['tokens_per_s_median']} | {row['engine_start_s_median']} | {row['slowest_generate_s_median']} "
            f"| {row['overhead_s_median']} |"
        )
    if model:
        print(
            f"\nwall(N) ≈ fixed + work/N, fixed {model['fixed_s']} s "
            f"(of which engine start {model['engine_start_s']} s),"
            f" work {model['work_s']} s (dp=1 medians); N devices each as fast as this machine's one engine:\n"
            "\n| devices | predicted wall s | completion tokens/s | speed-up |\n|---|---|---|---|"
        )
        for row in model["devices"]:
            print(f"| {row['n']} | {row['wall_s']} | {row['tokens_per_s']} | {row['speedup']}x |")
        print(f"\nno number of devices does better than {model['speedup_limit']}x: the fixed cost stays")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
