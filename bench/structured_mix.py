"""Cost of structured outputs in a mixed batch: the same 64 completion requests, all free vs. half of them
constrained by a JSON schema, each through one shard worker (one engine, per-request parameters).

    .venv/bin/python bench/structured_mix.py [--repeat 2]

Reports the worker's generation time (engine start excluded) and completion tokens/s, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.protocol import ShardTask
from batch_pipeline.shards.records import work_items

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


def requests(structured_share: float) -> list[dict]:
    batch = []
    for i in range(64):
        request = {"prompt": f"Person {i} described as JSON:", "max_tokens": 48, "temperature": 0.0}
        if i < 64 * structured_share:
            request["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        batch.append(request)
    return batch


def run_worker(batch: list[dict]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        (shard,) = write_shards(work_items((f"element {i}", r) for i, r in enumerate(batch)), 1, work)
        task = Path(work, "task.json")
        task.write_text(json.dumps(ShardTask(shard=shard, model_config={"model": "smollm2-135m-instruct"}).to_dict()))
        completed = subprocess.run(
            [sys.executable, "-m", "batch_pipeline.worker", "--task", str(task)],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        )
        return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"free": [], "half_json_schema": []}
    for _ in range(args.repeat):
        runs["free"].append(run_worker(requests(0.0)))
        runs["half_json_schema"].append(run_worker(requests(0.5)))
    summary = {
        name: {
            "generate_s_median": round(statistics.median(r["generate_s"] for r in results), 2),
            "completion_tokens_per_s_median": round(
                statistics.median(r["completion_tokens"] / r["generate_s"] for r in results), 1
            ),
            "errors": results[0]["errors"],
        }
        for name, results in runs.items()
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
