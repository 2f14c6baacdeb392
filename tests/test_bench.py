"""The benchmark scripts run (on tiny inputs: timing belongs in bench/, never in tests), and the benchmarks'
pages show one current table, whose figures its charts and the docs' summary repeat."""

import importlib.util
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run bench/<script> on tiny inputs, as `make bench` runs it."""
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # a benchmark
def test_the_data_plane_benchmark_plans_and_merges_every_prompt(tmp_path):
    out = tmp_path / "data_plane.json"
    _bench("data_plane.py", "--sizes", "50", "120", "--formats", "jsonl", "json", "--shards", "3", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["format"], row["prompts"]) for row in rows] == [
        ("jsonl", 50),
        ("jsonl", 120),
        ("json", 50),
        ("json", 120),
    ]
    assert all(row["plan_peak_rss_mb"] > 0 and row["merge_s"] >= 0 for row in rows)


@pytest.mark.slow
def test_the_openai_batch_benchmark_uploads_checks_and_writes_every_line(tmp_path):
    out = tmp_path / "openai_batch.json"
    _bench("openai_batch.py", "--lines", "200", "--repeat", "1", "--no-e2e", "--out", str(out))
    result = json.loads(out.read_text())["part_one"]
    assert result["lines"] == 200 and result["upload_mb_per_s"] > 0
    assert set(result["ratios"]) == {"upload / copy", "check / vllm_parse", "results / rewrite"}
    assert all(value >= 0 for value in result["medians"].values())


@pytest.mark.slow
def test_the_sharding_benchmark_runs_the_job_at_each_dp_and_predicts_from_dp_1(tmp_path):
    out = tmp_path / "sharding.json"
    completed = _bench(
        "sharding.py",
        "--prompts",
        "4",
        "--max-tokens",
        "4",
        "--dp",
        "1",
        "2",
        "--repeat",
        "1",
        "--out",
        str(out),
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert [(run["dp"], run["shards_run"]) for run in result["runs"]] == [(1, 1), (2, 2)]
    assert all(shard["engine_start_s"] > 0 and shard["items"] > 0 for run in result["runs"] for shard in run["shards"])
    assert [row["dp"] for row in result["summary"]] == [1, 2]
    model = result["model"]
    assert model["fixed_s"] > model["engine_start_s"] > 0
    assert [row["n"] for row in model["devices"]][:2] == [1, 2] and model["devices"][0]["speedup"] == 1.0
    assert "| dp | shards |" in completed.stdout


def load_plots():
    spec = importlib.util.spec_from_file_location("plots", REPO / "bench" / "plots.py")
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    return plots


def runs(*rates: float) -> list[dict]:
    return [{"wall_s": 1.0, "completion_tokens": 10, "tokens_per_s": rate} for rate in rates]


def write_results(results: Path) -> None:
    """Small results of the three benchmarks plots.py draws, and an older one it must not pick."""
    (results / "engine_overhead-20260101T000000.json").write_text(
        json.dumps({"prompts": 8, "max_tokens": 4, "runs": {"greedy": {"ours": runs(1.0)}}})
    )
    (results / "engine_overhead-20261129T120000.json").write_text(
        json.dumps(
            {"prompts": 8, "max_tokens": 4, "runs": {"greedy": {"ours": runs(30.0, 20.0, 25.0), "raw": runs(40.0)}}}
        )
    )
    (results / "data_plane-20261129T120000.json").write_text(
        json.dumps(
            {
                "rows": [
                    {
                        "format": fmt,
                        "prompts": size,
                        "plan_s": size / 1000,
                        "merge_s": size / 5000,
                        "plan_peak_rss_mb": 37,
                        "merge_peak_rss_mb": 36,
                    }
                    for fmt in ("jsonl", "json")
                    for size in (1000, 100)
                ]
            }
        )
    )
    (results / "sharding-20261129T120000.json").write_text(
        json.dumps(
            {
                "prompts": 8,
                "max_tokens": 4,
                "cpu_count": 2,
                "summary": [
                    {"dp": dp, "wall_s_median": 30.0 + dp, "wall_s_min": 29.0 + dp, "wall_s_max": 33.0 + dp}
                    for dp in (2, 1)
                ],
                "model": {"devices": [{"n": n, "wall_s": 20 + 10 / n} for n in (1, 2, 4)]},
            }
        )
    )


def test_plots_reads_the_newest_results_of_each_benchmark_into_its_series(tmp_path):
    plots = load_plots()  # reading needs no matplotlib: CI does not install it
    write_results(tmp_path)
    engine = plots.engine_series(plots.newest(tmp_path, "engine_overhead"))
    assert engine == [
        {"mode": "greedy", "system": "ours", "median": 25.0, "min": 20.0, "max": 30.0},
        {"mode": "greedy", "system": "raw", "median": 40.0, "min": 40.0, "max": 40.0},
    ]
    data_plane = plots.data_plane_series(plots.newest(tmp_path, "data_plane"))
    assert data_plane["json"]["prompts"] == [100, 1000] and data_plane["json"]["plan_s"] == [0.1, 1.0]
    sharding = plots.sharding_series(plots.newest(tmp_path, "sharding"))
    assert sharding["dp"] == [1, 2] and sharding["min"] == [30.0, 31.0] and sharding["devices"] == [1, 2, 4]
    assert plots.newest(tmp_path, "control_plane") is None


def test_plots_draws_a_png_per_benchmark(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra; `make bench` installs it
    write_results(tmp_path)
    completed = _bench("plots.py", "--results", str(tmp_path))
    for name in ("engine_overhead", "data_plane", "sharding"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", completed.stdout


def load_docs_hook():
    spec = importlib.util.spec_from_file_location("bench_hook", REPO / "docs" / "_hooks" / "bench.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def readme_rows(plots) -> list[dict]:
    """The current table as bench/README.md shows it: workload, ratio and verdict of each row."""
    rows = []
    for line in plots.readme_table((REPO / "bench" / "README.md").read_text()).splitlines():
        if not line.startswith("| `"):
            continue  # the header, its rule, the notes
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        script, workload = re.fullmatch(r"`([^`]+)` (.+)", cells[0]).groups()
        ratio = None if cells[3] == "–" else float(cells[3].strip("*").removesuffix("x"))
        rows.append({"script": script, "workload": workload, "ratio": ratio, "verdict": cells[5]})
    return rows


def chart_bars(svg: str) -> list[dict[str, str]]:
    return [
        {key.removeprefix("data-"): value for key, value in bar.attrib.items() if key.startswith("data-")}
        for bar in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}rect")
        if bar.get("class") == "bar"
    ]


def test_the_readme_shows_one_current_table_written_from_current_toml_a_row_a_workload():
    plots = load_plots()
    rows = plots.current_rows()
    readme = (REPO / "bench" / "README.md").read_text()
    assert plots.readme_table(readme) == plots.current_table(rows), "run `python bench/plots.py --current`"
    shown = readme_rows(plots)
    assert len(shown) == len(rows) > 30
    workloads = [row["workload"] for row in shown]
    assert len(set(workloads)) == len(workloads), "a workload in two rows"
    assert readme.count(plots.TABLE_START) == 1 and "## Latest numbers" not in readme
    # Every script with numbers has its rows; the others are named as having none yet.
    scripts = {path.name for path in (REPO / "bench").glob("*.py")} - {"plots.py", "served.py"}
    without = scripts - {row["script"] for row in shown}
    assert without == {"resume.py", "webhooks.py", "sample_vs_raw.py"}
    assert all(f"`{script}`" in readme.partition(plots.TABLE_END)[2] for script in without)


def test_the_sites_charts_draw_the_rows_of_the_readmes_table():
    """The docs hook draws them as the site builds, from the file the table is written from: each bar is a
    row of the table, with the table's ratio and verdict."""
    plots = load_plots()
    shown = {row["workload"]: row for row in readme_rows(plots)}
    hook = load_docs_hook()
    charts = hook.current_charts()
    assert set(charts) == {"current-goals.svg", "current-baselines.svg"}
    page = hook.bench_page()  # the site's page: the charts right after the table, links to the site's pages
    assert page.index(plots.TABLE_END) < page.index("(bench-charts/current-goals.svg)")
    assert "](bench-history.md)" in page and "](HISTORY.md)" not in page

    baselines = chart_bars(charts["current-baselines.svg"])
    assert [bar["workload"] for bar in baselines] == [name for name, row in shown.items() if row["ratio"] is not None]
    for bar in baselines:
        assert float(bar["ratio"]) == shown[bar["workload"]]["ratio"], bar

    goals = chart_bars(charts["current-goals.svg"])
    charted = [row for row in plots.current_rows() if "value" in row]
    assert [bar["workload"] for bar in goals] == [row["workload"] for row in charted] and len(goals) > 10
    for bar in goals:
        assert bar["verdict"] == shown[bar["workload"]]["verdict"], bar
        assert (float(bar["share"]) <= 1) == (bar["verdict"] == "met") or bar["verdict"] == "not shown", bar


def test_the_current_numbers_refuse_a_workload_twice_and_a_verdict_their_figures_contradict(tmp_path):
    plots = load_plots()
    entry = (
        '[[workload]]\nscript = "real_batches.py"\nworkload = "loop"\nfigure = "101.7 s"\nbaseline = "raw 126.9 s"\n'
        'ratio = 0.80\ngoal = "≤ 0.80x"\nvalue = 0.801\nbound = 0.80\ndate = "2026-12-03"\ncpu = "AMD EPYC"\n'
        'tree = "ce0ce2e"\n'
    )
    current = tmp_path / "current.toml"
    current.write_text(entry)
    assert plots.current_rows(current)[0]["verdict"] == "missed"  # decided by its numbers, 0.801 > 0.80
    current.write_text(entry + 'verdict = "met"\n')
    with pytest.raises(ValueError, match="verdict 'met', but 0.801 against 0.8 is missed"):
        plots.current_rows(current)
    again = entry.replace("value = 0.801", "value = 0.98").replace("bound = 0.80", "bound = 1.0")
    current.write_text(entry + "\n" + again)
    with pytest.raises(ValueError, match="a second entry for the same workload"):
        plots.current_rows(current)


def test_the_benchmarks_summary_quotes_figures_of_the_current_table_only():
    """docs/benchmarks.md quoted an older run than the table's: each figure and date it gives is one of the
    current table's."""
    plots = load_plots()
    table = plots.readme_table((REPO / "bench" / "README.md").read_text())
    summary = (REPO / "docs" / "benchmarks.md").read_text()
    quoted = re.findall(r"\d[\d,]*(?:\.\d+)?(?:x| s| ms| MB)(?!\w)|\d{4}-\d{2}-\d{2}", summary)
    assert len(quoted) > 10
    assert [figure for figure in quoted if figure not in table] == []


@pytest.mark.slow  # a benchmark
def test_the_api_memory_benchmark_posts_to_our_api_and_fastapis_default(tmp_path):
    out = tmp_path / "api_memory.json"
    completed = _bench("api_memory.py", "--body-mb", "1", "--concurrency", "2", "--repeat", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert {system: [run["codes"] for run in runs] for system, runs in result["runs"].items()} == {
        "ours": [[200, 200]],
        "fastapi_default": [[200, 200]],
    }
    assert all(run["peak_rss_mb"] > 0 and run["healthz_calls"] >= 1 for runs in result["runs"].values() for run in runs)
    assert set(result["ratios_ours_over_fastapi_default"]) >= {"held_per_body_byte", "healthz_max_s"}
    assert "| ours |" in completed.stdout


@pytest.mark.slow
def test_the_real_batches_benchmark_runs_the_job_with_and_without_deduplication(tmp_path):
    out = tmp_path / "real_batches.json"
    completed = _bench(
        "real_batches.py", "--sections", "dedup", "--scale", "0.05", "--repeat", "1", "--out", str(out), timeout=600
    )
    result = json.loads(out.read_text())
    assert result["workloads"]["dedup"]["requests"] == 6 and result["workloads"]["dedup"]["distinct"] == 3
    runs = result["runs"]["dedup"]
    assert {system: len(of_system) for system, of_system in runs.items()} == {"job": 1, "job_no_dedup": 1}
    assert all(
        run["wall_s"] > 0 and run["entries"] == 6 and run["num_errors"] == 0
        for of_system in runs.values()
        for run in of_system
    )
    assert [run["num_deduplicated"] for run in runs["job"]] == [3]
    assert [run["num_deduplicated"] for run in runs["job_no_dedup"]] == [0]
    assert all(run["copy_mismatches"] == 0 for run in runs["job"])
    summary = result["summary"]["dedup"]
    assert summary["entries_equal"] and summary["job_over_no_dedup"] > 0
    assert result["code_root"] == str(REPO) and result["code_commit"]
    assert "| dedup | job / job with BATCH_PIPELINE_DEDUPLICATE=0 |" in completed.stdout


@pytest.mark.slow
def test_the_real_batches_sample_is_set_against_a_cold_engine_start_of_the_same_run(tmp_path):
    """The sample goal (issue 29): the job's wall within 3 s of what a cold process takes to import vLLM and
    build the same engine, measured beside it."""
    out = tmp_path / "real_batches.json"
    completed = _bench(
        "real_batches.py", "--sections", "sample", "--scale", "0.05", "--repeat", "1", "--out", str(out), timeout=600
    )
    result = json.loads(out.read_text())
    runs = result["runs"]["sample"]
    assert {system: len(of_system) for system, of_system in runs.items()} == {"job": 1, "engine_start": 1}
    (start,) = runs["engine_start"]
    assert 0 < start["import_s"] < start["engine_start_s"] < start["wall_s"]
    assert start["engine_start_s"] == pytest.approx(start["import_s"] + start["engine_s"], abs=0.01)
    summary = result["summary"]["sample"]
    assert summary["cold_engine_start_s"]["median"] == round(start["engine_start_s"], 2)
    assert summary["goal_wall_s"] == round(summary["cold_engine_start_s"]["median"] + 3, 2)
    assert summary["job_over_goal_s"] == round(runs["job"][0]["wall_s"] - summary["goal_wall_s"], 2)
    assert "a cold engine start" in completed.stdout


@pytest.mark.slow
def test_the_api_flood_benchmark_measures_team_b_during_team_as_flood(tmp_path):
    out = tmp_path / "api_flood.json"
    _bench("api_flood.py", "--flood", "3", "--body-mb", "0.1", "--after-rounds", "1", "--out", str(out))
    result = json.loads(out.read_text())["after"]
    assert sum(result["team_a"]["statuses"].values()) == 3
    for phase in ("team_b_idle", "team_b_during", "team_b_after"):
        assert result[phase]["samples"] >= 3 and result[phase]["p99_s"] >= result[phase]["p50_s"] > 0


@pytest.mark.slow  # a benchmark
def test_the_fair_share_benchmark_times_a_decision_and_its_shares_follow_the_weights(tmp_path):
    out = tmp_path / "fair_share.json"
    tiny = ["--queued", "120", "--teams", "6", "--finished", "60", "--slots", "3", "--window-s", "3600"]
    _bench("fair_share.py", *tiny, "--sim-slots", "4", "--no-serve", "--out", str(out))
    results = json.loads(out.read_text())
    assert results["decision"]["queued"] == 120 and results["decision"]["fair_share_decision_ms"] > 0
    shares = results["shares"]
    assert shares["target_pct"] == {"team-a": 25.0, "team-b": 25.0, "team-c": 50.0}
    for team, target in shares["target_pct"].items():
        assert abs(shares["fair_share_pct"][team] - target) <= 10, shares
    assert shares["first_come_pct"]["team-a"] > 90  # what fair share is measured against


@pytest.mark.slow  # a benchmark
def test_the_api_memory_label_cases_refuse_the_huge_label_and_list_the_largest_allowed(tmp_path):
    out = tmp_path / "api_memory_labels.json"
    tiny = ["--jobs", "2", "--huge-jobs", "1", "--label-mib", "1", "--lists", "1"]
    _bench("api_memory.py", "--labels", *tiny, "--out", str(out))
    runs = {run["case"]: run for run in json.loads(out.read_text())["runs"]}
    assert runs["huge"]["codes"] == {"422": 1} and runs["huge"]["listed_jobs"] == 1  # the warm-up's job alone
    for case in ("largest_ascii", "largest_wide"):
        assert runs[case]["codes"] == {"200": 2} and runs[case]["listed_jobs"] == 3
        assert runs[case]["list_bytes"] > 0 and runs[case]["list_peak_rss_mb"] > 0


@pytest.mark.slow
def test_the_resume_benchmark_resumes_a_cancelled_job_against_a_fresh_one(tmp_path):
    out = tmp_path / "resume.json"
    _bench("resume.py", "--requests", "600", "--max-tokens", "4", "--rounds", "1", "--out", str(out), timeout=1500)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fresh"]["requests_generated"] == 600
    resumed = row["resumed"]
    assert resumed["requests_kept"] + resumed["requests_generated"] == 600 and resumed["requests_kept"] > 0
    assert row["wall_ratio"] > 0 and row["tokens_ratio"] < 1


def test_the_real_batches_lengths_workload_asks_each_prompt_at_three_lengths_only():
    """Issue 29's mixed-length batch: shared prompts whose greedy requests differ in max_tokens alone, so
    deduplication leaves every one to the engine."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import real_batches
    finally:
        sys.path.remove(str(REPO / "bench"))
    requests = real_batches.lengths_requests(1.0)
    by_prompt: dict[str, list[int]] = {}
    for request in requests:
        by_prompt.setdefault(json.dumps(request["messages"]), []).append(request["max_tokens"])
    assert len(requests) == 288 and len(by_prompt) == 96
    assert all(sorted(lengths) == [8, 32, 96] for lengths in by_prompt.values())
    assert len({json.dumps(r, sort_keys=True) for r in requests}) == len(requests)
    # The workloads of the table: 10,000 unique x 32, 256 unique x 48, 1,024 x 64.
    many, unique = real_batches.many_requests(1.0), real_batches.unique_requests(1.0)
    assert (len(many), {r["max_tokens"] for r in many}) == (10_000, {32})
    assert (real_batches.describe(unique)["distinct"], {r["max_tokens"] for r in unique}) == (256, {48})
    assert len(real_batches.loop_requests(1.0)) == 1024


@pytest.mark.slow
def test_the_real_batches_text_checked_workloads_match_raw_vllms_greedy_texts(tmp_path):
    out = tmp_path / "real_batches.json"
    _bench(
        "real_batches.py",
        *("--sections", "lengths", "--scale", "0.03", "--repeat", "1", "--raw-block-size", "32", "--out", str(out)),
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert result["workloads"]["lengths"]["requests"] == 9
    # raw built with the block size asked for (the job's worker uses 32 on the CPU), and the run says so
    assert result["raw_block_size"] == 32 and result["runs"]["lengths"]["raw"][0]["block_size"] == 32
    summary = result["summary"]["lengths"]
    assert summary["runs"] == {"job": 1, "raw": 1, "run_batch": 1} and summary["text_mismatches"] == [0]
    # vLLM's run_batch on the same requests: its wall beside the job's, its texts compared with raw's too
    assert summary["job_over_run_batch"] > 0 and len(summary["run_batch_text_mismatches"]) == 1


@pytest.mark.slow
def test_the_worker_loop_benchmark_runs_the_worker_alone_and_raw_on_the_same_requests(tmp_path):
    out = tmp_path / "worker_loop.json"
    _bench("worker_loop.py", "--requests", "6", "--max-tokens", "4", "--out", str(out), timeout=600)
    result = json.loads(out.read_text())
    worker, raw = result["runs"]["worker"], result["runs"]["raw"]
    assert len(worker) == len(raw) == 1
    # every request answered by both, at the same dtype, and the worker's greedy texts are raw's
    assert worker[0]["completion_tokens"] == raw[0]["completion_tokens"] > 0
    assert worker[0]["dtype"] == raw[0]["dtype"]
    assert result["summary"]["text_mismatches"] == [0]
    assert 0 < worker[0]["generate_s"] < worker[0]["wall_s"]


@pytest.mark.slow  # a benchmark: two deployments and two raw processes
def test_the_warm_engines_benchmark_runs_small_jobs_through_serve_with_and_without_the_pool(tmp_path):
    out = tmp_path / "warm_engines.json"
    _bench(
        "warm_engines.py",
        *("--jobs", "2", "--prompts", "2", "--max-tokens", "2", "--rounds", "1", "--out", str(out)),
        timeout=1200,
    )
    summary = json.loads(out.read_text())
    assert set(summary["walls_s"]) == {"pool", "no_pool", "raw_defaults", "raw_ours"}
    [warm] = summary["small_job"]["pool"]
    [cold] = summary["small_job"]["no_pool"]
    # After the first jobs, the small job's shard found a warm engine in the pool, and none without it.
    assert (warm["small_engine_warm"], cold["small_engine_warm"]) == (True, False)
    assert "run_shard[shard_000]:start" in warm["small_timeline_s"]


@pytest.mark.slow  # a benchmark: serve, a vLLM engine and sentence-transformers
def test_the_embeddings_benchmark_runs_each_system_on_the_same_inputs_and_checks_their_vectors(tmp_path):
    out = tmp_path / "embeddings.json"
    _bench("embeddings.py", "--inputs", "40", "--per-line", "4", "--out", str(out), timeout=600)
    report = json.loads(out.read_text())
    assert report["inputs"] == 40 and set(report["systems"]) == {"ours", "llm_embed", "sentence_transformers"}
    assert all(figures["least_cosine_to_sentence_transformers"] >= 0.999 for figures in report["systems"].values())
    assert report["ours / llm_embed"] > 0 and report["ours / sentence_transformers"] > 0


def test_the_result_cache_benchmark_plans_a_resubmission_whose_every_request_hits(tmp_path):
    out = tmp_path / "result_cache.json"
    _bench("result_cache.py", "--no-serve", "--planning", "500", "--out", str(out))
    planning = json.loads(out.read_text())["planning"]
    assert planning["cache_entries"] == planning["hits"] == 500
    assert planning["with_cache_s"] > 0 and planning["without_cache_s"] > 0 and planning["with / without"] > 0


@pytest.mark.slow  # a benchmark: serve and a vLLM engine, two jobs
def test_the_result_cache_benchmark_takes_the_unchanged_requests_from_the_first_job(tmp_path):
    out = tmp_path / "result_cache.json"
    _bench(
        "result_cache.py",
        *("--no-planning", "--requests", "20", "--changed", "0.1", "--max-tokens", "4", "--out", str(out)),
        timeout=900,
    )
    served = json.loads(out.read_text())["served"]
    assert (served["requests"], served["changed"], served["second_num_cached"]) == (20, 2, 18)
    assert served["unchanged_outputs_differing_from_first"] == served["unchanged_not_marked_cached_from_first"] == 0
    assert served["changed_marked_cached"] == 0
