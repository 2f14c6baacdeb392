"""Charts of the newest results of engine_overhead.py, data_plane.py and sharding.py, as PNGs beside them.

    .venv/bin/python bench/plots.py [--results bench/results]

- engine_overhead.png: completion tokens/s per system and mode, the median with min-max bars
- data_plane.png: plan and merge time, and each phase's peak RSS, against the number of prompts, per format
- sharding.png: wall time against data_parallelism (median, min-max bars), with the N-device prediction

A benchmark without results is skipped. Drawing needs matplotlib (`pip install -e '.[bench]'`, as `make bench`
does); reading the results does not, so tests check the series without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def newest(results: Path, benchmark: str) -> dict | None:
    """The newest results file of a benchmark (their names end in a UTC timestamp)."""
    paths = sorted(results.glob(f"{benchmark}-*.json"), key=lambda path: path.name)
    return json.loads(paths[-1].read_text()) if paths else None


def engine_series(result: dict) -> list[dict]:
    """Per mode and system: tokens/s median, min and max over the rounds."""
    rows = []
    for mode, by_system in result["runs"].items():
        for system, runs in by_system.items():
            rates = [run["tokens_per_s"] for run in runs]
            rows.append(
                {
                    "mode": mode,
                    "system": system,
                    "median": statistics.median(rates),
                    "min": min(rates),
                    "max": max(rates),
                }
            )
    return rows


def data_plane_series(result: dict) -> dict[str, dict[str, list]]:
    """Per input format, columns sorted by the number of prompts."""
    series: dict[str, dict[str, list]] = {}
    for row in sorted(result["rows"], key=lambda row: row["prompts"]):
        columns = series.setdefault(row["format"], {})
        for key in ("prompts", "plan_s", "merge_s", "plan_peak_rss_mb", "merge_peak_rss_mb"):
            columns.setdefault(key, []).append(row[key])
    return series


def sharding_series(result: dict) -> dict[str, list]:
    """Wall time per dp (median, min, max), and the prediction's wall per number of devices."""
    summary = sorted(result["summary"], key=lambda row: row["dp"])
    predicted = (result.get("model") or {}).get("devices", [])
    return {
        "dp": [row["dp"] for row in summary],
        "median": [row["wall_s_median"] for row in summary],
        "min": [row["wall_s_min"] for row in summary],
        "max": [row["wall_s_max"] for row in summary],
        "devices": [row["n"] for row in predicted],
        "predicted": [row["wall_s"] for row in predicted],
    }


def draw_engine(plt, rows: list[dict], result: dict):
    figure, axes = plt.subplots(figsize=(8, 4.5))
    labels = [f"{row['system']}\n{row['mode']}" for row in rows]
    medians = [row["median"] for row in rows]
    errors = [[row["median"] - row["min"] for row in rows], [row["max"] - row["median"] for row in rows]]
    axes.bar(labels, medians, yerr=errors, capsize=4, color="tab:blue")
    axes.set_ylabel("completion tokens/s")
    axes.set_title(f"{result['prompts']} chat prompts, up to {result['max_tokens']} new tokens (median, min-max)")
    return figure


def draw_data_plane(plt, series: dict[str, dict[str, list]], result: dict):
    figure, (time_axes, rss_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for fmt, columns in series.items():
        time_axes.plot(columns["prompts"], columns["plan_s"], marker="o", label=f"plan, {fmt}")
        time_axes.plot(columns["prompts"], columns["merge_s"], marker="s", linestyle="--", label=f"merge, {fmt}")
        rss_axes.plot(columns["prompts"], columns["plan_peak_rss_mb"], marker="o", label=f"plan, {fmt}")
        rss_axes.plot(
            columns["prompts"], columns["merge_peak_rss_mb"], marker="s", linestyle="--", label=f"merge, {fmt}"
        )
    for axes, label in ((time_axes, "seconds"), (rss_axes, "peak RSS, MB")):
        axes.set_xscale("log")
        axes.set_xlabel("prompts")
        axes.set_ylabel(label)
        axes.legend()
    rss_axes.set_ylim(bottom=0)
    figure.suptitle("data plane: plan_shards and merge_outputs without inference")
    return figure


def draw_sharding(plt, series: dict[str, list], result: dict):
    figure, axes = plt.subplots(figsize=(8, 4.5))
    errors = [
        [m - low for m, low in zip(series["median"], series["min"])],
        [high - m for m, high in zip(series["median"], series["max"])],
    ]
    axes.errorbar(
        series["dp"],
        series["median"],
        yerr=errors,
        marker="o",
        capsize=4,
        label=f"measured, this machine ({result.get('cpu_count')} cores)",
    )
    if series["devices"]:
        axes.plot(
            series["devices"],
            series["predicted"],
            marker="x",
            linestyle="--",
            label="predicted: fixed + work/N on N devices",
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("data_parallelism (shards)")
    axes.set_ylabel("wall s")
    axes.set_ylim(bottom=0)
    axes.legend()
    axes.set_title(f"{result['prompts']} chat prompts, up to {result['max_tokens']} new tokens")
    return figure


CHARTS = {
    "engine_overhead": (engine_series, draw_engine),
    "data_plane": (data_plane_series, draw_data_plane),
    "sharding": (sharding_series, draw_sharding),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the results are, and the charts go")
    options = parser.parse_args()
    try:
        import matplotlib
    except ImportError:
        print("plots.py needs matplotlib: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        return 1
    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    for benchmark, (series_of, draw) in CHARTS.items():
        result = newest(options.results, benchmark)
        if result is None:
            print(f"{benchmark}: no results in {options.results}, skipped")
            continue
        figure = draw(plt, series_of(result), result)
        figure.tight_layout()
        out = options.results / f"{benchmark}.png"
        figure.savefig(out, dpi=120)
        plt.close(figure)
        print(f"{benchmark}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
