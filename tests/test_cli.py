"""`make run`'s command: the checked-in sample request through the CLI, as a new user runs it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_batch_pipeline_run_prints_real_completions_of_the_sample(tmp_path, dagster_home):
    shutil.copy(REPO / "examples" / "sample_request.json", tmp_path / "request.json")
    completed = subprocess.run(
        [sys.executable, "-m", "batch_pipeline.cli", "run", "request.json", "--show", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    sample = json.loads((REPO / "examples" / "sample_request.json").read_text())
    output_path = tmp_path / sample["output_data_path"]
    outputs = json.loads(output_path.read_text())
    assert len(outputs) == len(sample["content"]["prompts"]) == 20
    assert f"output:   {output_path}" in completed.stdout
    assert "20 requests (0 errors) in 2 shards" in completed.stdout
    assert f"[0] {outputs[0]['text'].strip()[:200]!r}" in completed.stdout


def test_models_lists_the_catalog():
    completed = subprocess.run(
        [sys.executable, "-m", "batch_pipeline.cli", "models"], capture_output=True, text=True, check=True
    )
    assert completed.stdout.startswith("smollm2-135m-instruct")
