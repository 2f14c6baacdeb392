"""Charts of the benchmarks: the current numbers' (bench/current.toml), and the newest results of
engine_overhead.py, data_plane.py and sharding.py as PNGs beside them.

    .venv/bin/python bench/plots.py [--results bench/results]
    .venv/bin/python bench/plots.py --current

- engine_overhead.png: completion tokens/s per system and mode, the median with min-max bars
- data_plane.png: plan and merge time, and each phase's peak RSS, against the number of prompts, per format
- sharding.png: wall time against data_parallelism (median, min-max bars), with the N-device prediction

A benchmark without results is skipped. Drawing the PNGs needs matplotlib (`pip install -e '.[bench]'`, as
`make bench` does); reading the results does not, so tests check the series without it.

`--current` writes bench/README.md's current table from bench/current.toml, the one place its figures are
kept. The docs site draws that file's two charts (`current_charts`, SVG text: no matplotlib) as it builds
(docs/_hooks/bench.py), so they are always the table's numbers, on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tomllib
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

RESULTS = Path(__file__).parent / "results"
CURRENT = Path(__file__).parent / "current.toml"
README = Path(__file__).parent / "README.md"
# The current table's place in bench/README.md: what lies between these two lines is `current_table`'s.
TABLE_START = "<!-- the current table: written from bench/current.toml by `python bench/plots.py --current` -->"
TABLE_END = "<!-- end of the current table -->"


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


# --- the current numbers: bench/current.toml --------------------------------------------------------------

REQUIRED = ("script", "workload", "figure", "baseline", "date", "cpu", "tree")
OPTIONAL = ("ratio", "goal", "value", "bound", "verdict", "note")
VERDICTS = ("met", "missed", "not shown")


def current_rows(path: Path = CURRENT) -> list[dict]:
    """The current workloads, in the file's order, each with its `verdict` decided: met when its value is
    within its numeric bound, missed when not. A workload named twice, a field unknown or missing, or a
    verdict that its own numbers contradict is a ValueError naming the workload."""
    rows = tomllib.loads(path.read_text())["workload"]
    seen: set[str] = set()
    for row in rows:
        name = f"{row.get('script')} {row.get('workload')}"
        if missing := [field for field in REQUIRED if not row.get(field)]:
            raise ValueError(f"{name}: no {', '.join(missing)}")
        if unknown := sorted(set(row) - set(REQUIRED) - set(OPTIONAL)):
            raise ValueError(f"{name}: unknown fields {', '.join(unknown)}")
        if row["workload"] in seen:
            raise ValueError(f"{name}: a second entry for the same workload")
        seen.add(row["workload"])
        if ("value" in row) != ("bound" in row):
            raise ValueError(f"{name}: a value needs its bound, and a bound its value")
        if "value" in row and "goal" not in row:
            raise ValueError(f"{name}: a bound needs the goal it stands for")
        given = row.get("verdict")
        if given is not None and given not in VERDICTS:
            raise ValueError(f"{name}: verdict {given!r} is none of {', '.join(VERDICTS)}")
        if "value" in row:
            decided = "met" if row["value"] <= row["bound"] else "missed"
            if given not in (None, "not shown", decided):
                raise ValueError(f"{name}: verdict {given!r}, but {row['value']} against {row['bound']} is {decided}")
            row["verdict"] = given or decided
        elif given is None and "goal" in row:
            raise ValueError(f"{name}: a goal with neither a value and bound nor a verdict")
    return rows


def ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def current_table(rows: list[dict]) -> str:
    """The README's current table, a row per workload, then the rows' notes."""
    lines = [
        "| workload | figure | baseline | ours / baseline | goal | verdict | measured: date, CPU, tree |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            f"`{row['script']}` {row['workload']}",
            row["figure"],
            row["baseline"],
            f"**{ratio_text(row['ratio'])}**" if "ratio" in row else "–",
            row.get("goal", "–"),
            row.get("verdict", "–"),
            f"{row['date']}, {row['cpu']}, {row['tree']}",
        ]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    notes = [f"- `{row['script']}` {row['workload']}: {row['note']}" for row in rows if "note" in row]
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


def readme_with_table(readme: str, rows: list[dict]) -> str:
    """bench/README.md with its current table (between TABLE_START and TABLE_END) written from `rows`."""
    before, start, rest = readme.partition(TABLE_START + "\n")
    _, end, after = rest.partition(TABLE_END)
    if not start or not end:
        raise ValueError(f"bench/README.md holds no {TABLE_START!r} ... {TABLE_END!r}")
    return before + start + current_table(rows) + end + after


def readme_table(readme: str) -> str:
    """What bench/README.md holds as its current table."""
    return readme.partition(TABLE_START + "\n")[2].partition(TABLE_END)[0]


# Colours by verdict: a bar within its goal, past it, or on a machine too noisy to say.
COLOURS = {"met": "#2e7d32", "missed": "#c62828", "not shown": "#9e9e9e", "–": "#1565c0"}
LABEL_WIDTH, BAR_WIDTH, ROW_HEIGHT, TOP, LABEL_CHARS = 480, 330, 22, 46, 70


def _svg(title: str, subtitle: str, body: list[str], rows: int) -> str:
    width, height = LABEL_WIDTH + BAR_WIDTH + 150, TOP + rows * ROW_HEIGHT + 34
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="8" y="18" font-size="14" font-weight="bold">{escape(title)}</text>',
            f'<text x="8" y="35" fill="#555">{escape(subtitle)}</text>',
            *body,
            "</svg>",
            "",
        ]
    )


def _label(row: dict) -> str:
    text = f"{row['script'].removesuffix('.py')}: {row['workload']}"
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def _bar(index: int, row: dict, x0: float, x1: float, colour: str, shown: str, **data: object) -> list[str]:
    y = TOP + index * ROW_HEIGHT
    left, right = sorted((x0, x1))
    attributes = " ".join(f"data-{key}={quoteattr(str(value))}" for key, value in data.items())
    return [
        f'<text x="{LABEL_WIDTH - 6}" y="{y + 15}" text-anchor="end">{escape(_label(row))}</text>',
        f'<rect class="bar" x="{left:.1f}" y="{y + 4}" width="{max(right - left, 1):.1f}" height="{ROW_HEIGHT - 8}" '
        f'fill="{colour}" data-workload={quoteattr(row["workload"])} {attributes}>'
        f"<title>{escape(row['workload'])}: {escape(shown)}</title></rect>",
        f'<text x="{right + 4:.1f}" y="{y + 15}" fill="#333">{escape(shown)}</text>',
    ]


def goals_chart_svg(rows: list[dict]) -> str:
    """Each workload with a numeric goal, as its value over its bound: 1 is the goal, a bar past it missed."""
    charted = [row for row in rows if "value" in row]
    top = max(2.0, math.ceil(max(row["value"] / row["bound"] for row in charted) * 2) / 2)

    def x(share: float) -> float:
        return LABEL_WIDTH + BAR_WIDTH * min(share, top) / top

    body = []
    for index, row in enumerate(charted):
        share = row["value"] / row["bound"]
        shown = f"{share:.2f}: {row['verdict']}"
        colour = COLOURS[row["verdict"]]
        body += _bar(index, row, x(0), x(share), colour, shown, share=f"{share:.4f}", verdict=row["verdict"])
    bottom = TOP + len(charted) * ROW_HEIGHT
    body += [
        f'<line x1="{x(1):.1f}" y1="{TOP - 4}" x2="{x(1):.1f}" y2="{bottom}" stroke="black" stroke-dasharray="4 3"/>',
        f'<text x="{x(1):.1f}" y="{bottom + 16}" text-anchor="middle">the goal</text>',
        f'<text x="{x(0):.1f}" y="{bottom + 16}" text-anchor="middle">0</text>',
        f'<text x="{x(top):.1f}" y="{bottom + 16}" text-anchor="middle">{top:g}x the goal</text>',
    ]
    return _svg(
        "Each workload against its goal",
        "its figure over its goal's bound, 1 the goal: within it met (green), past it missed (red), "
        "grey too noisy to say",
        body,
        len(charted),
    )


def baselines_chart_svg(rows: list[dict]) -> str:
    """Each workload with a baseline, as ours over the baseline on a log scale: left of 1 is better."""
    charted = [row for row in rows if "ratio" in row]
    low, high = 0.01, 10.0

    def x(ratio: float) -> float:
        clamped = min(max(ratio, low), high)
        return LABEL_WIDTH + BAR_WIDTH * (math.log10(clamped) - math.log10(low)) / (math.log10(high) - math.log10(low))

    body = []
    for index, row in enumerate(charted):
        colour = COLOURS[row.get("verdict", "–")]
        body += _bar(index, row, x(1), x(row["ratio"]), colour, ratio_text(row["ratio"]), ratio=row["ratio"])
    bottom = TOP + len(charted) * ROW_HEIGHT
    body.append(f'<line x1="{x(1):.1f}" y1="{TOP - 4}" x2="{x(1):.1f}" y2="{bottom}" stroke="black"/>')
    for tick in (0.01, 0.1, 1, 10):
        body.append(f'<text x="{x(tick):.1f}" y="{bottom + 16}" text-anchor="middle">{tick:g}x</text>')
    return _svg(
        "Ours against each baseline",
        "ours / the baseline of the same run, log scale: left of 1x faster or smaller; "
        "colour its goal's verdict, blue none",
        body,
        len(charted),
    )


def current_charts(rows: list[dict]) -> dict[str, str]:
    """The current numbers' charts, by file name."""
    return {"current-goals.svg": goals_chart_svg(rows), "current-baselines.svg": baselines_chart_svg(rows)}


def write_current_table(readme: Path = README, current: Path = CURRENT) -> None:
    readme.write_text(readme_with_table(readme.read_text(), current_rows(current)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the results are, and the charts go")
    parser.add_argument(
        "--current", action="store_true", help="write bench/README.md's current table from bench/current.toml"
    )
    options = parser.parse_args()
    if options.current:
        write_current_table()
        print(f"{README}: the current table of {CURRENT}")
        return 0
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
