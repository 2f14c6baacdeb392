"""The shard worker `batch-pipeline run` starts ahead (launch/standby.py, `python -m batch_pipeline.worker
--standby`): real standby processes, claimed as the local launcher claims them. Whole runs through it are in
tests/entrypoints/test_cli.py."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from batch_pipeline.core.environment import child_environment
from batch_pipeline.launch.standby import StartedStandby, claim_standby
from batch_pipeline.shards.protocol import STANDBY_DIR_ENV, STANDBY_EXIT


@pytest.fixture
def start_standby(tmp_path, monkeypatch):
    """Starts a standby worker, as `batch-pipeline run` does; called in the test itself, whose environment it
    keeps (pytest changes PYTEST_CURRENT_TEST between a fixture and its test)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(STANDBY_DIR_ENV, raising=False)
    started: list[StartedStandby] = []

    def start() -> StartedStandby:
        started.append(StartedStandby.start())
        return started[-1]

    yield start
    for standby in started:
        standby.stop()
        assert not Path(standby.directory).exists()


def launched_env() -> dict[str, str]:
    """What the local launcher would give a worker of a shard on local files, in the test's environment."""
    return child_environment(os.environ, object_store=False)


def _gone(process: subprocess.Popen, timeout: float = 10) -> int:
    return process.wait(timeout=timeout)


def test_batch_pipeline_run_starts_its_standby_before_it_imports_dagster():
    """What the command has imported when it starts the standby: Dagster's import (~0.5 s on 2 cores) came
    first, and the worker's own imports, which a small job's engine waits for, began that much later."""
    script = (
        "import sys\nimport batch_pipeline.entrypoints.cli\nfrom batch_pipeline.launch.standby import StartedStandby\n"
        "print(sorted({name.split('.')[0] for name in sys.modules} & {'dagster', 'torch', 'vllm', 'kubernetes'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_one_shard_takes_the_standby_and_a_second_does_not(start_standby):
    standby = start_standby()
    taken = claim_standby(launched_env())
    assert taken is not None and taken.pid == standby.process.pid
    assert claim_standby(launched_env()) is None  # the run's other shards launch their own
    taken.close()  # never handed a shard (its step failed first): killed, not left waiting
    assert _gone(standby.process) == -signal.SIGKILL


def test_a_shard_whose_worker_needs_other_thread_settings_kills_the_standby(start_standby):
    standby = start_standby()
    """Two shards side by side split the cores: torch reads that as it imports, so the standby cannot serve."""
    assert claim_standby({**launched_env(), "OMP_NUM_THREADS": "1"}) is None
    assert _gone(standby.process) == -signal.SIGKILL


@pytest.mark.parametrize("how", ["readable by others", "a link to it"])
def test_a_standby_directory_that_is_not_the_services_own_is_not_trusted(start_standby, tmp_path, how):
    standby = start_standby()
    directory = standby.directory
    if how == "readable by others":
        os.chmod(directory, 0o755)
    else:
        directory = str(tmp_path / "link")
        os.symlink(standby.directory, directory)
    assert claim_standby({**launched_env(), STANDBY_DIR_ENV: directory}) is None
    assert standby.process.poll() is None  # not claimed: still there for its own run


def test_without_a_standby_every_shard_launches_its_worker(monkeypatch):
    monkeypatch.delenv(STANDBY_DIR_ENV, raising=False)
    assert claim_standby(launched_env()) is None


@pytest.mark.slow
def test_the_exit_code_of_a_standby_that_fails_after_its_handoff_is_its_own(start_standby, tmp_path):
    """Its launcher is not its parent: the code it leaves is what the step sees, here the 2 of a worker
    started outside Dagster Pipes (a handoff without the Pipes bootstrap), with its output in the shard's log."""
    standby = start_standby()
    taken = claim_standby(launched_env())
    assert taken is not None
    log = tmp_path / "worker.log"
    taken.hand_off({}, str(log))
    try:
        assert taken.wait(timeout=120) == 2
    finally:
        taken.close()
    assert (Path(standby.directory) / STANDBY_EXIT).read_text() == "2"
    assert "not launched by Dagster Pipes" in log.read_text()


@pytest.mark.slow
def test_a_standby_whose_batch_pipeline_run_was_killed_leaves_and_takes_its_directory(tmp_path):
    """`batch-pipeline run` killed (no cleanup of its own): its standby notices once it has imported vLLM."""
    starter = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from batch_pipeline.launch.standby import StartedStandby; "
            "s = StartedStandby.start(); print(s.process.pid, s.directory, flush=True); os._exit(0)",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    pid, directory = starter.stdout.split()
    deadline = time.monotonic() + 120
    while _running(pid) or Path(directory).exists():
        assert time.monotonic() < deadline, (
            f"the orphaned standby: running {_running(pid)}, its directory left {Path(directory).exists()}"
        )
        time.sleep(0.2)


def _running(pid: str) -> bool:
    """Whether the process runs: an exited one stays a zombie until whoever adopted it reaps it, which an
    init that is not a real one (a CI container's) may never do."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
