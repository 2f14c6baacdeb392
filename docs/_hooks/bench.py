"""MkDocs hook: the benchmarks' pages, from the files kept beside the scripts.

- bench.md is bench/README.md (the scripts and the current table), with the current numbers' two charts
  drawn as the site builds from bench/current.toml, the file the table is written from (bench/plots.py: SVG
  text, no matplotlib), so the charts are the table's numbers on any machine; then the PNGs `make bench`
  drew into bench/results/ (not in git), where this machine has them.
- bench-history.md is bench/HISTORY.md, every earlier run as it was written.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path
from types import ModuleType

from mkdocs.structure.files import File, Files

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULT_CHARTS = ("engine_overhead.png", "sharding.png", "data_plane.png")  # bench/plots.py's, from make bench
# The benchmarks' files as the site names them: a link between them in bench/ is a link between these pages.
SITE_NAMES = {"README.md": "bench.md", "HISTORY.md": "bench-history.md", "current.toml": "bench-current.toml"}
CHART_TITLES = {
    "current-goals.svg": "Each workload of the current table against its goal",
    "current-baselines.svg": "Each workload of the current table against its baseline",
}


@cache
def plots() -> ModuleType:
    """bench/plots.py (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_plots", BENCH / "plots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site_links(text: str) -> str:
    """Links to the benchmarks' files in bench/ pointed at their pages on the site."""
    return re.sub(
        r"\]\((README\.md|HISTORY\.md|current\.toml)(#[^)]*)?\)",
        lambda match: f"]({SITE_NAMES[match.group(1)]}{match.group(2) or ''})",
        text,
    )


def current_charts() -> dict[str, str]:
    return plots().current_charts(plots().current_rows())


def bench_page() -> str:
    """The page: bench/README.md, the current charts after its table, then the charts of make bench's results."""
    end = plots().TABLE_END
    text = (BENCH / "README.md").read_text()
    if end not in text:
        raise ValueError(f"bench/README.md holds no {end!r}: the current table's charts go after it")
    charts = "\n\n".join(f"![{CHART_TITLES[name]}](bench-charts/{name})" for name in current_charts())
    text = text.replace(end, f"{end}\n\n{charts}\n", 1)
    drawn = [name for name in RESULT_CHARTS if (BENCH / "results" / name).is_file()]
    text += "\n## Charts of this machine's results\n\n"
    if drawn:
        text += "\n\n".join(f"![{name}](bench-charts/{name})" for name in drawn) + "\n"
    else:
        text += "None drawn on this machine: `make bench` writes them into `bench/results/` (not in git).\n"
    return _site_links(text)


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "bench.md", content=bench_page()))
    files.append(File.generated(config, "bench-history.md", content=_site_links((BENCH / "HISTORY.md").read_text())))
    files.append(File.generated(config, "bench-current.toml", content=(BENCH / "current.toml").read_text()))
    for name, svg in current_charts().items():
        files.append(File.generated(config, f"bench-charts/{name}", content=svg))
    for name in RESULT_CHARTS:
        chart = BENCH / "results" / name
        if chart.is_file():
            files.append(File.generated(config, f"bench-charts/{name}", abs_src_path=str(chart)))
    return files
