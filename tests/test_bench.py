"""The benchmark scripts run (on tiny inputs: timing belongs in bench/, never in tests)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_data_plane_benchmark_plans_and_merges_every_prompt(tmp_path):
    out = tmp_path / "data_plane.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "data_plane.py"), "--sizes", "50", "120", "--formats", "jsonl", "json",
         "--shards", "3", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(row["format"], row["prompts"]) for row in rows] == [("jsonl", 50), ("jsonl", 120), ("json", 50), ("json", 120)]
    assert all(row["plan_peak_rss_mb"] > 0 and row["merge_s"] >= 0 for row in rows)
