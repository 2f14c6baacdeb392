"""MkDocs hook: bench/README.md (the benchmarks' scripts and latest numbers, kept beside the scripts) becomes
the page bench.md, with the charts `make bench` drew into bench/results/ (not in git) where they exist."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

BENCH = Path(__file__).resolve().parents[2] / "bench"
CHARTS = ("engine_overhead.png", "sharding.png", "data_plane.png")  # bench/plots.py's


def bench_page() -> str:
    """The page: bench/README.md, then its charts or where they come from."""
    text = (BENCH / "README.md").read_text()
    drawn = [name for name in CHARTS if (BENCH / "results" / name).is_file()]
    text += "\n## Charts\n\n"
    if drawn:
        text += "\n\n".join(f"![{name}](bench-charts/{name})" for name in drawn) + "\n"
    else:
        text += "None drawn on this machine: `make bench` writes them into `bench/results/` (not in git).\n"
    return text


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "bench.md", content=bench_page()))
    for name in CHARTS:
        chart = BENCH / "results" / name
        if chart.is_file():
            files.append(File.generated(config, f"bench-charts/{name}", abs_src_path=str(chart)))
    return files
