"""The warm engine pool (launch/pool.py, worker/pool_worker.py): real pool workers with real engines, reached
by real runs of the job; and the pool's claim and bound on real directories and processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from batch_pipeline.api.metrics import metrics_text
from batch_pipeline.contract import ToolConfig
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.core.environment import child_environment
from batch_pipeline.core.settings import settings
from batch_pipeline.launch.pool import EnginePool, PoolKey, PoolSize, PoolWorker
from batch_pipeline.shards.format import ShardSpec
from batch_pipeline.shards.protocol import (
    POOL_CLAIMED,
    POOL_IDLE,
    POOL_OUTPUT,
    POOL_RETIRED,
    POOL_STARTED,
    PoolWorkerIdle,
    PoolWorkerStarted,
    ShardTask,
    engine_key,
    is_pool_worker,
    pool_gauges,
)
from batch_pipeline.store.reports import ReportStore
from batch_pipeline.worker.engine import KeptEngine
from batch_pipeline.worker.pool_worker import PoolLimits, stay_warm
from tests.conftest import MODEL

SIZE = PoolSize(max_idle=2, idle_s=300.0, max_idle_memory_mib=0)


@pytest.fixture
def engine_pool(tmp_path, monkeypatch):
    """A pool directory as `serve` makes it, named to the runs' steps; no worker of it outlives the test."""
    directory = tmp_path / "pool"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("BATCH_PIPELINE_ENGINE_POOL_DIR", str(directory))
    yield directory
    for pid in pool_worker_pids(directory):
        os.kill(pid, signal.SIGKILL)


def pool_worker_pids(pool: Path) -> list[int]:
    """Live pool workers of `pool` (`python -m batch_pipeline.worker --pool DIR`, DIR in `pool`)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                arguments = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if b"--pool" in arguments and state not in ("Z", "X"):
                directory = arguments[arguments.index(b"--pool") + 1].decode()
                if Path(directory).parent == pool:
                    found.append(int(entry))
    return found


def _task(model_config: dict | None = None, team: str | None = "team-a", tool_config: dict | None = None) -> ShardTask:
    spec = ShardSpec(shard_index=0, directory="/tmp/unused", item_count=1, prompt_count=1)
    return ShardTask(
        shard=spec,
        model_config=BatchCompletionsModelConfig.model_validate(model_config or {"model": MODEL}),
        owner_team=team,
        tool_config=ToolConfig.model_validate(tool_config) if tool_config else None,
    )


def _announce(pool: Path, name: str, key: str, pid: int, env_digest: str, since: float, rss: int = 0) -> Path:
    """A worker's directory as a waiting worker leaves it."""
    directory = pool / name
    directory.mkdir(mode=0o700)
    (directory / POOL_STARTED).write_text(PoolWorkerStarted(pid=pid, env_digest=env_digest).model_dump_json())
    idle = PoolWorkerIdle(engine_key=key, shards_served=1, idle_since=since, rss_bytes=rss)
    (directory / POOL_IDLE).write_text(idle.model_dump_json())
    return directory


def test_the_engine_key_counts_what_builds_the_engine_and_not_what_only_shapes_requests():
    base = engine_key(BatchCompletionsModelConfig(model=MODEL))
    assert engine_key(BatchCompletionsModelConfig(model=MODEL, labels={"team": "x"}, response_role="bot")) == base
    for differs in ({"dtype": "float32"}, {"max_model_len": 2048}, {"model": "other"}, {"revision": "abc"}):
        assert engine_key(BatchCompletionsModelConfig.model_validate({"model": MODEL, **differs})) != base, differs


def test_teams_share_a_warm_engine_but_a_tool_config_shard_only_its_own_teams():
    """Sandboxed code runs beside the worker: a worker that ran one team's code serves no other team."""
    env: dict[str, str] = {"OMP_NUM_THREADS": "2"}
    assert PoolKey.of(_task(team="a"), env) == PoolKey.of(_task(team="b"), env)
    tools = {"name": "code_evaluator"}
    assert PoolKey.of(_task(team="a", tool_config=tools), env) != PoolKey.of(_task(team="b", tool_config=tools), env)
    assert PoolKey.of(_task(team="a", tool_config=tools), env) != PoolKey.of(_task(team="a"), env)
    assert PoolKey.of(_task(), env) != PoolKey.of(_task(), {"OMP_NUM_THREADS": "1"})


def test_a_launcher_claims_only_a_live_waiting_worker_of_its_key_and_only_once(tmp_path, sleepers):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    pool = EnginePool.at(str(pool_dir), SIZE)
    assert pool is not None
    key = PoolKey.of(_task(), {})
    assert key is not None
    # A live process that is this worker by its command line (what a pool worker's is), and a dead one's.
    live_dir = pool_dir / "worker-live"
    live = sleepers(live_dir)
    _announce(pool_dir, "worker-live", key.engine, live, key.env_digest, since=2.0)
    other = _announce(pool_dir, "worker-other", "another-engine", live, key.env_digest, since=1.0)
    dead = _announce(pool_dir, "worker-dead", key.engine, 2**22 + 7, key.env_digest, since=0.0)
    claimed = pool.claim(key)
    assert claimed is not None and claimed.pid == live and claimed.warm
    assert (live_dir / POOL_CLAIMED).exists() and not (live_dir / POOL_IDLE).exists()
    assert not dead.exists()  # announced, but its process is gone: cleared away
    assert (other / POOL_IDLE).exists()  # another engine's: left waiting
    assert pool.claim(key) is None  # taken once
    claimed.close()  # never handed a shard: killed
    deadline = time.monotonic() + 10
    while is_pool_worker(str(live_dir), live):
        assert time.monotonic() < deadline, "the claimed worker was not killed"
        time.sleep(0.05)


def test_a_process_that_took_a_gone_workers_pid_is_not_claimed(tmp_path):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    pool = EnginePool.at(str(pool_dir), SIZE)
    assert pool is not None
    key = PoolKey.of(_task(), {})
    assert key is not None
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _announce(pool_dir, "worker-reused", key.engine, stranger.pid, key.env_digest, since=0.0)
        assert pool.claim(key) is None
        assert stranger.poll() is None  # not signalled
    finally:
        stranger.kill()


@pytest.mark.parametrize("how", ["readable by others", "a link to it"])
def test_a_pool_directory_that_is_not_the_services_own_is_not_used(tmp_path, how):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    named = pool_dir
    if how == "readable by others":
        os.chmod(pool_dir, 0o755)
    else:
        named = tmp_path / "link"
        os.symlink(pool_dir, named)
    assert EnginePool.at(str(named), SIZE) is None


@pytest.fixture
def sleepers():
    """Processes that are pool workers by their command line (`--pool DIR`), as the pool checks them."""
    started: list[subprocess.Popen] = []

    def start(directory: Path) -> int:
        started.append(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--pool", str(directory)])
        )
        deadline = time.monotonic() + 10
        while not is_pool_worker(str(directory), started[-1].pid):  # until its exec shows in /proc
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return started[-1].pid

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_worker_going_idle_evicts_the_longest_waiting_beyond_the_pools_bound(tmp_path, sleepers):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    oldest = _announce(pool_dir, "worker-1", "k", sleepers(pool_dir / "worker-1"), "e", since=1.0, rss=2**30)
    newer = _announce(pool_dir, "worker-2", "k", sleepers(pool_dir / "worker-2"), "e", since=2.0, rss=2**30)
    dead = _announce(pool_dir, "worker-dead", "k", 2**22 + 7, "e", since=0.5)  # killed as it waited
    own = pool_dir / "worker-3"
    own.mkdir(mode=0o700)
    kept = KeptEngine(key="mine", shards_served=2)  # an engine in use
    assert stay_warm(str(own), "mine", kept, PoolLimits(idle_s=60, max_idle=2, max_idle_memory=0))
    assert not dead.exists()  # counted for nothing, and cleared away
    assert (oldest / POOL_RETIRED).exists() and not (oldest / POOL_IDLE).exists()
    assert (newer / POOL_IDLE).exists()
    assert PoolWorkerIdle.model_validate_json((own / POOL_IDLE).read_text()).engine_key == "mine"
    gauges = pool_gauges(str(pool_dir))  # what /metrics tells of the pool
    assert gauges is not None and (gauges.waiting_workers, gauges.evictions) == (1, 1)  # own not yet started
    assert gauges.waiting_bytes == 2**30
    # A memory bound no waiting set fits (this process alone holds more than a byte): it leaves instead.
    (own / POOL_IDLE).unlink()
    assert not stay_warm(str(own), "mine", kept, PoolLimits(idle_s=60, max_idle=2, max_idle_memory=1))
    assert (newer / POOL_IDLE).exists()


def test_a_worker_whose_engine_served_one_shard_never_evicts_another_to_wait(tmp_path, sleepers):
    """A job of a config of its own (a team's, on purpose or not) cannot push out an engine in use."""
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    in_use = _announce(pool_dir, "worker-1", "popular", sleepers(pool_dir / "worker-1"), "e", since=1.0)
    own = pool_dir / "worker-2"
    own.mkdir(mode=0o700)
    once = KeptEngine(key="one-off", shards_served=1)
    assert not stay_warm(str(own), "one-off", once, PoolLimits(idle_s=60, max_idle=1, max_idle_memory=0))
    assert (in_use / POOL_IDLE).exists() and not (own / POOL_IDLE).exists()
    # With room, it waits.
    assert stay_warm(str(own), "one-off", once, PoolLimits(idle_s=60, max_idle=2, max_idle_memory=0))


# A pool worker's loop (worker/pool_worker.serve_pool_shards) on a shard that only prints and sleeps: the
# hand-off protocol between real processes, without an engine's minute.
PROTOCOL_WORKER = r"""
import sys, time
from batch_pipeline.worker.__main__ import _write_output_to
from batch_pipeline.worker.pool_worker import PoolLimits, serve_pool_shards

def run_shard(kept):
    kept.engine, kept.key = kept.engine or object(), "engine"
    kept.shards_served += 1
    print(f"secret of shard {kept.shards_served}")  # buffered: a shard's output, unflushed as it ends
    time.sleep(0.3)
    return 0

sys.exit(serve_pool_shards(sys.argv[2], PoolLimits(30, 2, 0), run_shard, lambda: None, _write_output_to))
"""


def _protocol_worker(pool_dir: Path) -> PoolWorker:
    """A worker started into the pool as `EnginePool.start` starts one, running PROTOCOL_WORKER."""
    directory = pool_dir / f"worker-{len(list(pool_dir.iterdir()))}"
    directory.mkdir(mode=0o700)
    with open(directory / POOL_OUTPUT, "ab") as output:
        process = subprocess.Popen(
            [sys.executable, "-c", PROTOCOL_WORKER, "--pool", str(directory)], stdout=output, stderr=subprocess.STDOUT
        )
    (directory / POOL_STARTED).write_text(PoolWorkerStarted(pid=process.pid, env_digest="e").model_dump_json())
    (directory / POOL_CLAIMED).write_text("born claimed")
    return PoolWorker(str(directory), process.pid, os.pidfd_open(process.pid), warm=False)


def test_no_launcher_claims_a_worker_before_its_last_launcher_read_its_shards_exit(tmp_path):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir(mode=0o700)
    pool = EnginePool.at(str(pool_dir), SIZE)
    assert pool is not None
    key = PoolKey(engine="tool-key-of-team-a", env_digest="e")
    first = _protocol_worker(pool_dir)
    try:
        first.hand_off({}, str(tmp_path / "first.log"), key)
        time.sleep(1.5)  # the shard has ended; its launcher is slow to look (its step polls the run's status)
        assert pool.claim(key) is None  # not announced until its exit code is read
        assert first.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while (second := pool.claim(key)) is None:
            assert time.monotonic() < deadline, "the worker never waited again after its exit was read"
            time.sleep(0.05)
        # It waits under the key its launcher handed it: a tool_config shard's, with its team, never a plain one's.
        assert pool.claim(PoolKey(engine="engine", env_digest="e")) is None
        open_files = len(os.listdir(f"/proc/{first.pid}/fd"))  # waiting, after one shard
        second.hand_off({}, str(tmp_path / "second.log"), key)
        first.send_signal(signal.SIGINT)  # the first launcher's handle: its shard is over, it signals nothing
        assert second.wait(timeout=30) == 0 and first.wait() == 0
        second.close()
        deadline = time.monotonic() + 10
        while not (Path(first.directory) / POOL_IDLE).exists():  # waiting again, after two
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(os.listdir(f"/proc/{first.pid}/fd")) == open_files  # a shard leaves no descriptor open
    finally:
        first.kill()
        first.close()
    # Each shard's log has its own output, never the shard's before it.
    assert "secret of shard 1" in (tmp_path / "first.log").read_text()
    second_log = (tmp_path / "second.log").read_text()
    assert "secret of shard 2" in second_log and "secret of shard 1" not in second_log


def _metadata(output: Path) -> dict:
    return json.loads(Path(str(output) + ".metadata.json").read_text())


def _outputs(output: Path) -> list[dict]:
    return json.loads(output.read_text())


def _request(output: Path, prompts: list[str], max_new_tokens: int = 8) -> dict:
    return {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": 0.0},
    }


@pytest.mark.slow
def test_jobs_reuse_a_warm_engine_a_worker_killed_on_it_loses_nothing_and_the_pool_empties_when_idle(
    run_job, engine_pool, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_PIPELINE_ENGINE_POOL_IDLE_S", "30")
    first = tmp_path / "first.json"
    assert run_job(_request(first, ["The capital of France is", "Water boils at"])).success
    [waiting] = pool_worker_pids(engine_pool)  # stayed, with its engine
    assert _metadata(first)["shards"][0]["engine_warm"] is False

    second = tmp_path / "second.json"
    assert run_job(_request(second, ["Once upon a time", "The best way to learn is"])).success
    shard = _metadata(second)["shards"][0]
    assert (shard["engine_warm"], shard["engine_shards_before"]) == (True, 1)
    assert shard["engine_start_saved_s"] > 0
    assert pool_worker_pids(engine_pool) == [waiting]  # the same worker served it
    assert [len(o["text"]) > 0 for o in _outputs(second)] == [True, True]

    # A third job's shard on the warm worker, which is killed with results on disk and requests in flight
    # (different lengths finish at different times): the retry resumes it on a worker started for it.
    contents = [
        {"prompts": [f"Item {k}-{i}: tell a story" for i in range(6)], "max_new_tokens": 4 + 10 * k, "temperature": 0.0}
        for k in range(5)
    ]
    input_path = tmp_path / "input.json"
    input_path.write_text(json.dumps(contents))
    third = tmp_path / "third.json"
    results = Path(os.environ["DAGSTER_HOME"]) / "work" / "pool-kill" / "shards" / "000" / "results.tsv"
    killed: list[int] = []

    def kill_when_results_appear() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if results.exists() and results.read_text().count("\n") >= 8:
                os.kill(waiting, signal.SIGKILL)
                killed.append(waiting)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_results_appear, daemon=True)
    killer.start()
    run = run_job(
        {"input_data_path": str(input_path), "output_data_path": str(third), "model_config": {"model": MODEL}},
        job_id="pool-kill",
    )
    killer.join(timeout=1)
    assert killed, "the shard finished before its worker could be killed"
    assert run.success
    assert len([e for e in run.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]) == 1
    assert len(_outputs(third)) == 30 and all("text" in o for o in _outputs(third))
    assert sorted(int(line.split("\t")[0]) for line in results.read_text().splitlines()) == list(range(30))
    shard = _metadata(third)["shards"][0]
    assert shard["resumed"] >= 8 and shard["resumed"] + shard["generated"] == 30
    assert shard["engine_warm"] is False  # the retry's worker was started for it
    [restarted] = pool_worker_pids(engine_pool)
    assert restarted != waiting
    # /metrics: the second job's shard warm; the first's and the third's retry started their engines.
    scraped = metrics_text(ReportStore(settings().job_store_url), None, str(engine_pool)).decode()
    for line in (
        "batch_pipeline_engine_pool_hits_total 1.0",
        "batch_pipeline_engine_pool_misses_total 2.0",
        "batch_pipeline_engine_pool_waiting_workers 1.0",
    ):
        assert line in scraped.splitlines(), scraped

    deadline = time.monotonic() + 30 + 60
    while pool_worker_pids(engine_pool) or [path for path in engine_pool.iterdir() if path.is_dir()]:
        assert time.monotonic() < deadline, f"the pool never emptied: {list(engine_pool.iterdir())}"
        time.sleep(0.5)


@pytest.mark.slow
def test_pool_workers_leave_when_the_serve_that_made_their_pool_is_killed(tmp_path):
    """`serve` killed (no cleanup of its own): its pool's directory stays, and its workers notice."""
    maker = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from batch_pipeline.launch.pool import make_pool_directory; "
            "print(make_pool_directory(), flush=True); os._exit(0)",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    pool_dir = Path(maker.stdout.strip())
    pool = EnginePool.at(str(pool_dir), SIZE)
    assert pool is not None
    worker = pool.start(child_environment(os.environ, object_store=False))
    try:
        deadline = time.monotonic() + 180
        while pool_worker_pids(pool_dir) or Path(worker.directory).exists():
            assert time.monotonic() < deadline, "a pool worker outlived the serve of its pool"
            time.sleep(0.2)
    finally:
        worker.close()
