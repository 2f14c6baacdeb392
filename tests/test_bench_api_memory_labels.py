"""bench/api_memory.py's label cases run (on tiny inputs: timing belongs in bench/, never in tests)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_label_cases_refuse_the_huge_label_and_list_the_largest_allowed(tmp_path):
    out = tmp_path / "api_memory_labels.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "api_memory.py"),
            "--labels",
            "--jobs",
            "2",
            "--huge-jobs",
            "1",
            "--label-mib",
            "1",
            "--lists",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    runs = {run["case"]: run for run in json.loads(out.read_text())["runs"]}
    assert runs["huge"]["codes"] == {"422": 1} and runs["huge"]["listed_jobs"] == 1  # the warm-up's job alone
    for case in ("largest_ascii", "largest_wide"):
        assert runs[case]["codes"] == {"200": 2} and runs[case]["listed_jobs"] == 3
        assert runs[case]["list_bytes"] > 0 and runs[case]["list_peak_rss_mb"] > 0
