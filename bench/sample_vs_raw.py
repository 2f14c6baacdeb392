"""The sample request as a full job of our pipeline vs. the same prompts through raw `vllm.LLM.generate`.

    .venv/bin/python bench/sample_vs_raw.py [REQUEST.json] [--repeat N]

Both sides start from a cold process (imports, engine start and model load included), alternate, and
report wall time and completion tokens/s; the ratio ours/raw is printed from medians.
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
from pathlib import Path

from engine_overhead import run_script  # timed from process start to exit, as ours is

REPO = Path(__file__).resolve().parents[1]

RAW = r"""
import json, sys
import os
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from batch_pipeline.models.catalog import resolve_model
request = json.load(open(sys.argv[1]))
content = request["content"]
llm = LLM(model=resolve_model(request["model_config"]["model"]), enforce_eager=True)
params = SamplingParams(max_tokens=content["max_new_tokens"], temperature=content["temperature"],
                        stop=content.get("stop_sequences"))
outputs = llm.generate(content["prompts"], params, use_tqdm=False)
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"completion_tokens": tokens}))
"""


def run_ours(request_path: Path) -> dict:
    with tempfile.TemporaryDirectory() as home:
        request = json.loads(request_path.read_text())
        request["output_data_path"] = str(Path(home) / "output.json")
        patched = Path(home) / "request.json"
        patched.write_text(json.dumps(request))
        env = {**os.environ, "DAGSTER_HOME": home, "VLLM_LOGGING_LEVEL": "WARNING"}
        Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "batch_pipeline.entrypoints.cli", "run", str(patched)],
            env=env,
            check=True,
            capture_output=True,
        )
        wall = time.monotonic() - started
        metadata = json.loads(Path(request["output_data_path"] + ".metadata.json").read_text())
        return {"wall_s": wall, "completion_tokens": metadata["completion_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("request", nargs="?", type=Path, default=REPO / "examples" / "sample_request.json")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"ours": [], "raw_vllm": []}
    for _ in range(args.repeat):
        results["ours"].append(run_ours(args.request))
        results["raw_vllm"].append(run_script(RAW, args.request))
    summary = {}
    for name, runs in results.items():
        walls = [r["wall_s"] for r in runs]
        summary[name] = {
            "wall_s_median": round(statistics.median(walls), 2),
            "wall_s_range": [round(min(walls), 2), round(max(walls), 2)],
            "completion_tokens": runs[0]["completion_tokens"],
            "tokens_per_s_median": round(statistics.median(r["completion_tokens"] / r["wall_s"] for r in runs), 1),
        }
    summary["ratio_wall_ours_over_raw"] = round(
        summary["ours"]["wall_s_median"] / summary["raw_vllm"]["wall_s_median"], 2
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
