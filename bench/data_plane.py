"""The data plane without inference: plan_shards' work (stream the input, write shard inputs) and
merge_outputs' work (k-way merge of sorted shard outputs into one JSON array) on synthetic inputs.

    .venv/bin/python bench/data_plane.py [--sizes 10000 100000 1000000] [--formats jsonl json] [--shards 4]

Each phase runs in a fresh process, so its peak RSS is its own; the stand-in shard outputs (what the
workers would write) are made between the two phases and not timed. Writes bench/results/data_plane-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def make_input(path: Path, size: int, fmt: str) -> None:
    """OpenAI-style completion requests of varied length, one per record."""
    with open(path, "w", encoding="utf-8") as handle:
        if fmt == "json":
            handle.write("[\n")
        for index in range(size):
            record = json.dumps(
                {
                    "prompt": f"Request {index}: " + "tell me about batch inference " * (index % 7 + 1),
                    "max_tokens": 64,
                    "temperature": 0.0,
                }
            )
            if fmt == "json":
                record += ",\n" if index < size - 1 else "\n"
            else:
                record += "\n"
            handle.write(record)
        if fmt == "json":
            handle.write("]\n")


def plan(input_path: str, work_dir: str, shards: int) -> dict:
    from batch_pipeline.core import io
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.records import work_items

    started = time.perf_counter()
    specs = write_shards(work_items(io.iter_json_records(input_path)), shards, work_dir, deduplicate=True)
    return {"seconds": time.perf_counter() - started, "items": sum(spec.item_count for spec in specs)}


def merge(work_dir: str, output_path: str, expected: int) -> dict:
    from batch_pipeline.core import io
    from batch_pipeline.shards.format import shard_directories
    from batch_pipeline.shards.merge import merge_sorted_outputs, write_output_array

    started = time.perf_counter()
    outputs = [f"{directory}/output.tsv" for directory in shard_directories(work_dir)]
    with io.atomic_write(output_path) as output:
        written = write_output_array(output, merge_sorted_outputs(outputs), expected)
    return {"seconds": time.perf_counter() - started, "items": written}


def stand_in_outputs(work_dir: str) -> None:
    """What each worker's checkpoint becomes: one output per request, sorted by index."""
    from batch_pipeline.shards.format import format_result, read_work_items, shard_directories

    for directory in shard_directories(work_dir):
        with open(f"{directory}/output.tsv", "w", encoding="utf-8") as handle:
            for item in sorted(read_work_items(f"{directory}/input.jsonl"), key=lambda item: item.index):
                handle.write(
                    format_result(
                        item.index,
                        {"text": " a stand-in completion", "num_prompt_tokens": 9, "num_completion_tokens": 4},
                    )
                )


def peak_rss_mb() -> float:
    """This process's own peak RSS. Not getrusage's ru_maxrss: Linux carries that across fork and exec, so a
    child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_child(phase: str, *args: str) -> dict:
    completed = subprocess.run(
        [sys.executable, __file__, "--phase", phase, *args], capture_output=True, text=True, check=True
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--formats", nargs="+", choices=("jsonl", "json"), default=["jsonl", "json"])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", type=Path, help="results file (default bench/results/data_plane-<time>.json)")
    parser.add_argument("--phase", choices=("plan", "merge"), help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.phase:  # a child: one phase, then its own peak RSS
        result = (
            plan(options.args[0], options.args[1], int(options.args[2]))
            if options.phase == "plan"
            else merge(options.args[0], options.args[1], int(options.args[2]))
        )
        result["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return

    rows = []
    for fmt in options.formats:
        for size in options.sizes:
            with tempfile.TemporaryDirectory() as scratch:
                input_path, work_dir, output_path = f"{scratch}/input.{fmt}", f"{scratch}/work", f"{scratch}/out.json"
                make_input(Path(input_path), size, fmt)
                planned = in_child("plan", input_path, work_dir, str(options.shards))
                stand_in_outputs(work_dir)
                merged = in_child("merge", work_dir, output_path, str(size))
                assert planned["items"] == merged["items"] == size
                row = {
                    "format": fmt,
                    "prompts": size,
                    "shards": options.shards,
                    "input_mb": round(Path(input_path).stat().st_size / 2**20, 1),
                    "plan_s": round(planned["seconds"], 2),
                    "merge_s": round(merged["seconds"], 2),
                    "plan_peak_rss_mb": round(planned["peak_rss_mb"]),
                    "merge_peak_rss_mb": round(merged["peak_rss_mb"]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = options.out or RESULTS / f"data_plane-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "data_plane", "rows": rows}, indent=2))
    print(
        "\n| format | prompts | input MB | plan s | merge s | plan peak RSS MB | merge peak RSS MB |"
        "\n|---|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['format']} | {row['prompts']} | {row['input_mb']} | {row['plan_s']} | {row['merge_s']} | "
            f"{row['plan_peak_rss_mb']} | {row['merge_peak_rss_mb']} |"
        )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
