"""The shard worker alone against raw `vllm.LLM.chat`: where a job's generation time goes once Dagster is out
of the way.

    .venv/bin/python bench/worker_loop.py [--requests 10000] [--max-tokens 32] [--repeat 1] [--py-spy]

The same greedy chat requests (`real_batches.many_requests`' prompts) go through (a) `python -m
batch_pipeline.worker --task FILE` on a shard directory written as `plan_shards` writes one (no Dagster, no
step process, no run worker), and (b) raw `LLM.chat`, each a cold process timed from its start to its exit,
rotated within each round. The worker reports its own engine start and generation (`generate_s`); every
greedy text is compared with raw's. `--py-spy` records the worker under py-spy (speedscope JSON beside the
results) for where its loop spends what `engine.step()` does not. Writes bench/results/worker_loop-<UTC
time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from engine_overhead import MODEL, RESULTS, prompts
from real_batches import REPO, chat, environment, run_raw, text_hashes, timed

from batch_pipeline.shards.format import ShardSpec, WorkItem, iter_result_lines
from batch_pipeline.shards.protocol import ShardTask


def write_shard(requests: list[dict], directory: Path) -> Path:
    """The shard's input as plan_shards writes it, and its task as the launcher sends it; the task's path."""
    directory.mkdir(parents=True)
    with open(directory / "input.jsonl", "w", encoding="utf-8") as handle:
        for index, request in enumerate(requests):
            handle.write(WorkItem(index, "chat", {"model": MODEL, **request}).to_line() + "\n")
    spec = ShardSpec(0, str(directory), item_count=len(requests), prompt_count=len(requests))
    task = ShardTask(shard=spec, model_config={"model": MODEL})  # type: ignore[arg-type]  # validated as built
    path = directory.parent / "task.json"
    path.write_text(json.dumps(task.to_dict()))
    return path


def run_worker(requests: list[dict], work: Path, profile: Path | None) -> dict:
    shard = work / "shard"
    shutil.rmtree(shard, ignore_errors=True)
    task = write_shard(requests, shard)
    command = [sys.executable, "-m", "batch_pipeline.worker", "--task", str(task)]
    if profile is not None:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        command = [py_spy, "record", "--format", "speedscope", "--rate", "50", "-o", str(profile), "--", *command]
    wall, completed = timed(command, environment(REPO), REPO)
    # the worker prints its stats as its last JSON line (py-spy prints its own lines after it)
    stats = json.loads(next(line for line in reversed(completed.stdout.splitlines()) if line.startswith("{")))
    with open(shard / "output.tsv", encoding="utf-8") as handle:
        outputs = [json.loads(payload) for _, payload in iter_result_lines(handle)]
    return {
        "wall_s": round(wall, 2),  # the process, from its start to its exit
        "shard_wall_s": stats["wall_s"],  # the worker's own: engine start and generation
        **{key: stats[key] for key in ("engine_start_s", "generate_s", "completion_tokens", "dtype")},
        "texts_sha256": text_hashes(outputs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--py-spy", action="store_true", help="record the worker under py-spy")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    requests = [chat(p, args.max_tokens) for p in prompts(args.requests)]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"worker_loop-{stamp}.json"
    runs: dict[str, list[dict]] = {"worker": [], "raw": []}
    with tempfile.TemporaryDirectory(prefix="worker_loop-") as tmp:
        work = Path(tmp)
        for round_ in range(args.repeat):
            order = ["worker", "raw"] if round_ % 2 == 0 else ["raw", "worker"]
            for system in order:
                load = os.getloadavg()[0]
                if system == "worker":
                    profile = out.with_name(f"{out.stem}-worker{round_}.speedscope.json") if args.py_spy else None
                    result = run_worker(requests, work, profile)
                else:
                    dtype = runs["worker"][-1]["dtype"] if runs["worker"] else None
                    result = run_raw(requests, dtype, REPO, work, texts=True)
                result["load_before"] = round(load, 2)
                runs[system].append(result)
                print(system, {k: v for k, v in result.items() if k != "texts_sha256"}, flush=True)
    raw_texts = runs["raw"][0]["texts_sha256"]
    summary = {
        system: {
            "wall_s": statistics.median(r["wall_s"] for r in results),
            "wall_range": [min(r["wall_s"] for r in results), max(r["wall_s"] for r in results)],
        }
        for system, results in runs.items()
    }
    summary["worker"]["generate_s"] = statistics.median(r["generate_s"] for r in runs["worker"])
    summary["worker"]["engine_start_s"] = statistics.median(r["engine_start_s"] for r in runs["worker"])
    summary["worker_over_raw"] = round(summary["worker"]["wall_s"] / summary["raw"]["wall_s"], 3)
    summary["text_mismatches"] = [
        sum(a != b for a, b in zip(r["texts_sha256"], raw_texts, strict=True)) for r in runs["worker"]
    ]
    for results in runs.values():
        for result in results:
            result.pop("texts_sha256", None)
    record = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "cpu": next((line for line in open("/proc/cpuinfo") if line.startswith("model name")), "").strip(),
        "avx512_bf16": "avx512_bf16" in open("/proc/cpuinfo").read(),
        "runs": runs,
        "summary": summary,
    }
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
