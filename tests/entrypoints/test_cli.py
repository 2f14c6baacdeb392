"""The `batch-pipeline` CLI as users run it: `run` on the checked-in sample (make run's command), and the
API commands against a real server (uvicorn over TCP, the real daemon, real vLLM)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batch_pipeline.entrypoints.client import BatchClient
from tests.api_fixtures import OTHER_KEY, USER_KEY
from tests.conftest import MODEL

REPO = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "batch-pipeline")

pytestmark = pytest.mark.slow


def test_batch_pipeline_run_prints_real_completions_of_the_sample(tmp_path, dagster_home):
    shutil.copy(REPO / "examples" / "sample_request.json", tmp_path / "request.json")
    # As a user runs it: the planning settings the other tests set are left out.
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("BATCH_PIPELINE_MIN_SHARD_TOKENS", "BATCH_PIPELINE_MAX_SHARDS_PER_JOB")
    }
    completed = _run(tmp_path, environment)
    assert completed.returncode == 0, completed.stderr[-3000:]
    sample = json.loads((REPO / "examples" / "sample_request.json").read_text())
    output_path = tmp_path / sample["output_data_path"]
    outputs = json.loads(output_path.read_text())
    assert len(outputs) == len(sample["content"]["prompts"]) == 20
    assert f"output:   {output_path}" in completed.stdout
    # It asks for 2 shards; 20 short prompts do not pay for a second engine, and the output says so.
    assert "20 requests (0 errors) in 1 shard," in completed.stdout
    assert "1 of the 2 shards asked: the job's ~" in completed.stdout
    assert "computed in " in completed.stdout
    assert f"[0] {outputs[0]['text'].strip()[:200]!r}" in completed.stdout
    # A quiet console: the run's progress, not vLLM's, torch's or Dagster's own warnings (those go to the
    # shard's worker.log, beside its checkpoint).
    console = completed.stdout + completed.stderr
    assert "progress 20/20 requests" in console
    for noise in ("Warning", "WARNING", "Loading safetensors", "deprecated"):
        assert noise not in console, console[-3000:]
    (worker_log,) = Path(os.environ["DAGSTER_HOME"]).glob("work/*/shards/000/worker.log")
    assert "safetensors" in worker_log.read_text()
    # Its one shard ran in the worker the CLI started ahead, which imported vLLM while the run was planned.
    assert "shard 0: handed to the worker `batch-pipeline run` started ahead" in console
    # Its metadata tells that import apart from the engine start that followed the handoff.
    (shard,) = json.loads(Path(f"{output_path}.metadata.json").read_text())["shards"]
    assert shard["imported_ahead_s"] > 0 and shard["engine_start_s"] > 0
    _assert_no_standby_left(tmp_path)


def _run(directory: Path, environment: dict[str, str]) -> subprocess.CompletedProcess:
    """`batch-pipeline run request.json` in `directory`, its temporary files (the standby worker's) there too.
    Its output goes to files, not pipes: what is awaited is the command's exit, as a shell awaits it, and
    what the run leaves running is looked for at that moment."""
    stdout_path, stderr_path = directory / "cli.stdout", directory / "cli.stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "batch_pipeline.entrypoints.cli", "run", "request.json", "--show", "2"],
            cwd=directory,
            env={**environment, "TMPDIR": str(directory)},
            stdout=stdout,
            stderr=stderr,
        )
        returncode = process.wait(timeout=600)
    left = _processes_left(directory)
    completed = subprocess.CompletedProcess(process.args, returncode, stdout_path.read_text(), stderr_path.read_text())
    assert not left, f"still running after the command exited: {left}"
    return completed


def _processes_left(directory: Path) -> list[str]:
    """The run's step server (forkserver) and standby worker, where one still runs. The step server's
    teardown, ~0.6 s with Dagster imported, held the command's output open after the command had ended."""
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode()
            environ = (cmdline.parent / "environ").read_bytes().split(b"\0")
        except OSError:  # it has exited
            continue
        ours = f"TMPDIR={directory}".encode() in environ
        if ours and ("multiprocessing.forkserver" in command or "--standby" in command):
            left.append(command)
    return left


def _assert_no_standby_left(directory: Path) -> None:
    """The CLI has exited: no worker it started ahead still runs, and its directory is gone."""
    assert not list(directory.glob("batch_pipeline-standby-*"))
    assert not _processes_left(directory)


def test_a_run_of_two_shards_and_one_that_fails_early_both_stop_the_standby_worker(tmp_path, dagster_home):
    """Two shards split the cores, so their workers need thread settings the standby did not import torch
    with: both are launched, the standby is stopped, and the outputs are whole. A request the run refuses
    before any shard leaves no standby either."""
    sample = json.loads((REPO / "examples" / "sample_request.json").read_text())
    (tmp_path / "request.json").write_text(json.dumps(sample))
    environment = {**os.environ, "BATCH_PIPELINE_MIN_SHARD_TOKENS": "0"}
    completed = _run(tmp_path, environment)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "20 requests (0 errors) in 2 shards," in completed.stdout
    assert len(json.loads((tmp_path / sample["output_data_path"]).read_text())) == 20
    assert "started ahead" not in completed.stdout + completed.stderr
    shards = json.loads((tmp_path / f"{sample['output_data_path']}.metadata.json").read_text())["shards"]
    assert [shard["imported_ahead_s"] for shard in shards] == [0, 0]  # launched: their imports are in engine_start_s
    _assert_no_standby_left(tmp_path)

    del sample["content"]
    sample["input_data_path"] = str(tmp_path / "no-such-input.json")
    (tmp_path / "request.json").write_text(json.dumps(sample))
    refused = _run(tmp_path, environment)
    assert refused.returncode == 1 and "step validate_input failed" in refused.stderr, refused.stderr[-3000:]
    _assert_no_standby_left(tmp_path)


def test_models_lists_the_catalog():
    completed = subprocess.run(
        [sys.executable, "-m", "batch_pipeline.entrypoints.cli", "models"], capture_output=True, text=True, check=True
    )
    assert completed.stdout.startswith("smollm2-135m-instruct")


def test_api_commands_submit_follow_list_and_cancel_jobs_on_a_real_server(deployment_factory, tmp_path):
    api = deployment_factory(max_concurrent_runs=1)
    api.start_daemon()
    url = api.serve_http()

    def cli(*args: str, key: str = USER_KEY) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CLI, "--url", url, "--api-key", key, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path
        )

    (tmp_path / "prompts.txt").write_text("The capital of France is\n\nWater boils at\n")
    output = tmp_path / "out.json"
    submitted = cli(
        "submit",
        "--prompts",
        "prompts.txt",
        "--model",
        MODEL,
        "--output",
        str(output),
        "--max-new-tokens",
        "6",
        "--label",
        "team=cli",
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    # Until it ends, its status says where it is (issue 46: it read running, 0 done, while its engine started).
    early = cli("status", job_id).stdout
    assert any(f"phase: {phase}" in early for phase in ("queued", "planning", "starting", "generating")), early
    # queued behind the first (one run at a time), then cancelled
    request = {
        "output_data_path": str(tmp_path / "never.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["x"], "max_new_tokens": 4, "temperature": 0.0},
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    second = cli("submit", "request.json", "--api", "v1").stdout.strip()
    cancelled = cli("cancel", second)
    assert cancelled.returncode == 0 and f"{second} cancelled" in cancelled.stdout

    waited = cli("wait", job_id, "--interval", "0.5")
    assert waited.returncode == 0, waited.stderr
    assert f"{job_id} completed" in waited.stdout
    assert "2/2" in waited.stderr  # the progress bar reached every prompt
    assert len(json.loads(output.read_text())) == 2
    # Followed once it has ended, the job's requests are not read as done in an instant ("282 req/s").
    again = cli("wait", job_id)
    assert again.returncode == 0 and "2/2" in again.stderr and "req/s" not in again.stderr, again.stderr
    ended = cli("cancel", job_id)
    assert ended.returncode == 1
    assert f"{job_id} was not cancelled: the job has ended (completed)" in ended.stderr, ended.stderr

    status = cli("status", job_id)
    assert f"{job_id}  completed  model {MODEL}" in status.stdout
    assert "results: 2 requests (0 errors)" in status.stdout
    assert json.loads(cli("status", job_id, "--json").stdout)["status"] == "completed"
    assert cli("status", second).stdout.split()[1] == "cancelled"

    listed = cli("list", "--label", "team=cli").stdout.splitlines()
    assert [line.split()[:2] for line in listed] == [[job_id, "completed"]]
    assert {line.split()[0] for line in cli("list").stdout.splitlines()} == {job_id, second}
    assert [line.split()[0] for line in cli("list", "--limit", "1").stdout.splitlines()] == [second]  # newest
    # the client follows the API's pages: one job a page here
    paged = BatchClient(url, USER_KEY).list(limit=5, page_size=1)
    assert [job["job_id"] for job in paged] == [second, job_id]

    # errors name what is wrong and exit non-zero
    other = cli("status", job_id, key=OTHER_KEY)
    assert other.returncode == 2 and "404" in other.stderr
    (tmp_path / "bad.json").write_text(json.dumps({"model_config": {"model": MODEL}, "content": request["content"]}))
    bad = cli("submit", "bad.json")
    assert bad.returncode == 2 and "output_data_path" in bad.stderr


def test_run_without_dagster_home_uses_the_checkouts_instance_as_make_run_does(monkeypatch):
    """Outside `make`, DAGSTER_HOME was unset and `run` died of DagsterHomeNotSetError's traceback."""
    from batch_pipeline.entrypoints.cli import _no_dagster_home

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert _no_dagster_home() is None
    assert os.environ["DAGSTER_HOME"] == str(REPO / "dagster_home")
    monkeypatch.setenv("DAGSTER_HOME", "/srv/elsewhere")  # one the user named is kept
    assert _no_dagster_home() is None and os.environ["DAGSTER_HOME"] == "/srv/elsewhere"


def test_dry_run_priority_resume_and_usage_commands_on_a_real_server(deployment_factory, tmp_path):
    """Issue 46: the CLI had no dry-run, resume, priority or usage command; each was a curl away."""
    api = deployment_factory()  # no daemon: the job stays queued until it is cancelled
    url = api.serve_http()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CLI, "--url", url, "--api-key", USER_KEY, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )

    (tmp_path / "prompts.txt").write_text("The capital of France is\nWater boils at\n")
    flags = ("--prompts", "prompts.txt", "--model", MODEL, "--output", str(tmp_path / "out.json"))
    checked = cli("dry-run", *flags, "--max-new-tokens", "6")
    assert checked.returncode == 0, checked.stderr
    assert "2 requests" in checked.stdout and "at most 12 output tokens (context 8192)" in checked.stdout
    assert "no history" in checked.stdout
    assert api.store.list().jobs == []  # a dry run creates nothing

    job_id = cli("submit", *flags).stdout.strip()
    raised = cli("priority", job_id, "high")
    assert raised.returncode == 0 and f"{job_id} priority 10" in raised.stdout, raised.stdout + raised.stderr
    queued = cli("resume", job_id)
    assert queued.returncode == 2 and "409" in queued.stderr, queued.stderr  # only a stopped job resumes
    assert cli("cancel", job_id).returncode == 0
    resumed = cli("resume", job_id)
    assert resumed.returncode == 0 and resumed.stdout.startswith(f"{job_id} queued (resume 1)"), resumed.stdout

    report = cli("usage")
    assert report.returncode == 0, report.stderr
    header, *rows = report.stdout.splitlines()
    assert header.split()[:2] == ["team", "jobs"] and len(rows) == 1 and rows[0].split()[1] == "1", report.stdout
