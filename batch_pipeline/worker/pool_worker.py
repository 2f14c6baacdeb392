"""A pool worker's side of the warm engine pool (`python -m batch_pipeline.worker --pool DIR`; the
launcher's side, and the files they share, are in launch/pool.py).

It imports vLLM, then runs each shard a launcher hands it (as a standby worker runs its one), keeping its
engine between them: a shard built for the same engine (`shards.protocol.engine_key`) starts at once. After
a shard it waits in the pool for the next one, announcing the engine it keeps, unless the pool's bound on
waiting workers or their memory has no room even after the longest-waiting workers are evicted. It leaves
after waiting `idle_s` (the pool scales to zero), when evicted, or when its pool is gone (`serve` stopped).
A shard it fails, or that is stopped (cancelled, its launcher gone), is its last: the engine may still
hold the shard's requests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from batch_pipeline.core import io
from batch_pipeline.shards.protocol import (
    POOL_BUSY,
    POOL_CLAIMED,
    POOL_EVICTIONS,
    POOL_IDLE,
    POOL_OUTPUT,
    POOL_OWNER,
    POOL_RETIRED,
    POOL_SHARD_EXIT,
    STANDBY_HANDOFF,
    PoolShardExit,
    PoolWorkerBusy,
    PoolWorkerIdle,
    StandbyHandoff,
    announced_workers,
    is_pool_worker,
)
from batch_pipeline.worker.engine import KeptEngine

HANDOFF_POLL_S = 0.02
# A launcher claims a waiting worker (or starts one) and hands it the shard in the same breath; one that
# claimed and never handed it over (killed in between) has left this worker with nobody to wait for.
CLAIM_TIMEOUT_S = 60.0
# How long a worker waits for its launcher to read its shard's exit code (the step polls every 50 ms).
ACK_TIMEOUT_S = 30.0
POOL_LOCK = "pool.lock"  # in the pool's directory: one worker at a time decides whether it stays


@dataclass(frozen=True)
class PoolLimits:
    idle_s: float  # a worker waiting this long for a shard leaves
    max_idle: int  # workers the pool keeps waiting at once
    max_idle_memory: int  # bytes those waiting workers may hold together; 0: no bound


def serve_pool_shards(
    directory: str,
    limits: PoolLimits,
    run_shard: Callable[[KeptEngine], int],
    import_engine: Callable[[], None],
    write_output_to: Callable[[str, str], None],
) -> int:
    """Shard after shard in `directory` until the pool has no more use for this worker; the exit code."""
    owner_gone = pool_owner(os.path.dirname(directory))
    started = time.monotonic()
    import_engine()
    kept = KeptEngine(imported_s=time.monotonic() - started)
    pool_output = os.path.join(directory, POOL_OUTPUT)
    code = 0
    try:
        while (handoff := wait_for_shard(directory, limits.idle_s, owner_gone)) is not None:
            if kept.engine is None:  # its first shard's log gets what it wrote as it imported
                write_output_to(handoff.log, pool_output)
            else:  # never what it wrote between shards: another team's shard may have left some there
                _output_to(handoff.log)
            os.truncate(pool_output, 0)
            os.environ.update(handoff.env)  # this shard's Pipes bootstrap, in place of the last one's
            with io.atomic_write(os.path.join(directory, POOL_BUSY)) as busy:
                busy.write(PoolWorkerBusy(log=handoff.log, shards_before=kept.shards_served).model_dump_json())
            code = 1  # what an exception leaves
            try:
                with stopped_when_gone(handoff.launcher_pid):
                    code = run_shard(kept)
            except KeyboardInterrupt:  # cancelled, or its launcher is gone
                code = 130
                raise
            finally:
                _output_to(pool_output)  # nothing after its exit code goes to the shard's log
                report_exit(directory, handoff, code)
            if code != 0 or not stay_warm(directory, handoff.pool_key or kept.key, kept, limits):
                return code  # a failed shard's engine may still hold its requests: its last
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def report_exit(directory: str, handoff: StandbyHandoff, code: int, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """Leave the shard's exit code for the launcher that handed it over, and wait until that launcher has
    read it (or is gone): until then this worker is not announced, so no other launcher claims it, signals
    it, or reads a code that is not its own."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, POOL_BUSY))
    path = os.path.join(directory, POOL_SHARD_EXIT)
    with io.atomic_write(path) as exit_file:
        exit_file.write(PoolShardExit(token=handoff.token or "", code=code).model_dump_json())
    deadline = time.monotonic() + timeout_s
    with _watching(handoff.launcher_pid) as launcher_gone:
        while os.path.exists(path) and not launcher_gone() and time.monotonic() < deadline:
            time.sleep(HANDOFF_POLL_S)
    with contextlib.suppress(FileNotFoundError):  # unread: its launcher is gone
        os.unlink(path)


@contextlib.contextmanager
def _watching(pid: int | None) -> Iterator[Callable[[], bool]]:
    """Whether process `pid` has exited (a pidfd: a pid reused later is not it), asked without waiting; its
    pidfd closed after (a worker serves shard after shard: one left open a shard would run out)."""
    if pid is None:
        yield lambda: False
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        yield lambda: True
        return
    try:
        yield lambda: bool(select.select([pidfd], [], [], 0)[0])
    finally:
        os.close(pidfd)


def pool_owner(pool: str) -> Callable[[], bool]:
    """Whether the `serve` that made the pool (POOL_OWNER) is gone, asked without a syscall's wait."""
    try:
        with open(os.path.join(pool, POOL_OWNER)) as handle:
            owner = int(handle.read())
        pidfd = os.pidfd_open(owner)  # held for the worker's life
    except ProcessLookupError:  # gone before this worker started
        return lambda: True
    except (OSError, ValueError):  # a pool made by hand, with no owner to watch
        return lambda: False
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def wait_for_shard(
    directory: str, idle_s: float, owner_gone: Callable[[], bool] = lambda: False
) -> StandbyHandoff | None:
    """The next shard's handoff; None once this worker has waited `idle_s`, was evicted, was claimed by a
    launcher that never handed a shard over, or its pool is gone (its directory, or its `serve`, killed
    before it could remove it)."""
    handoff_path = os.path.join(directory, STANDBY_HANDOFF)
    claimed_path = os.path.join(directory, POOL_CLAIMED)
    deadline = time.monotonic() + idle_s
    claimed_at: float | None = None
    while True:
        if os.path.exists(handoff_path):
            with open(handoff_path) as handle:
                handoff = StandbyHandoff.model_validate_json(handle.read())
            os.unlink(handoff_path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claimed_path)
            return handoff
        if not os.path.isdir(os.path.dirname(directory)) or os.path.exists(os.path.join(directory, POOL_RETIRED)):
            return None
        if owner_gone():
            return None
        now = time.monotonic()
        if os.path.exists(claimed_path):
            claimed_at = claimed_at or now
            if now - claimed_at > CLAIM_TIMEOUT_S:
                return None
        elif now > deadline and retire(directory):
            return None
        time.sleep(HANDOFF_POLL_S)


def retire(directory: str) -> bool:
    """End a waiting worker's wait (its own idle time, or an eviction); False if a launcher claimed it first."""
    try:
        os.rename(os.path.join(directory, POOL_IDLE), os.path.join(directory, POOL_RETIRED))
    except FileNotFoundError:
        return False
    return True


def stay_warm(directory: str, key: str, kept: KeptEngine, limits: PoolLimits) -> bool:
    """Announce this worker as waiting under `key` (its launcher's), with its engine, if the pool's bound has
    room for it; False: it leaves instead. A worker whose engine has served more than one shard (a key in
    use) evicts the longest-waiting workers to make room; one that served a single shard does not, so that
    jobs each of a config of their own (a team's, on purpose or not) never push out engines in use."""
    pool = os.path.dirname(directory)
    own = _rss_bytes()
    if limits.max_idle < 1 or (limits.max_idle_memory and own > limits.max_idle_memory):
        return False
    try:
        lock = os.open(os.path.join(pool, POOL_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    except FileNotFoundError:  # the pool is gone
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = sorted(waiting_workers(pool), key=lambda entry: entry[1].idle_since)

        def full() -> bool:
            held = sum(idle.rss_bytes for _, idle in waiting) + own
            return len(waiting) + 1 > limits.max_idle or bool(limits.max_idle_memory and held > limits.max_idle_memory)

        while waiting and full() and kept.shards_served > 1:
            if retire(waiting.pop(0)[0]):
                _count_eviction(pool)
        if full():
            return False
        idle = PoolWorkerIdle(engine_key=key, shards_served=kept.shards_served, idle_since=time.time(), rss_bytes=own)
        with io.atomic_write(os.path.join(directory, POOL_IDLE)) as idle_file:
            idle_file.write(idle.model_dump_json())
    finally:
        os.close(lock)
    return True


def _count_eviction(pool: str) -> None:
    """One more in the pool's count of evictions (under the pool's lock, held by the caller)."""
    path = os.path.join(pool, POOL_EVICTIONS)
    try:
        with open(path) as handle:
            count = int(handle.read())
    except (OSError, ValueError):
        count = 0
    with io.atomic_write(path) as handle:
        handle.write(str(count + 1))


def waiting_workers(pool: str) -> Iterator[tuple[str, PoolWorkerIdle]]:
    """The pool's waiting workers: each one's directory and what it announced. A worker killed as it
    waited left its announcement: its directory is removed, and it counts for nothing."""
    for path, idle, started in announced_workers(os.scandir(pool)):
        if is_pool_worker(path, started.pid):
            yield path, idle
        elif retire(path):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def stopped_when_gone(launcher_pid: int | None) -> Iterator[None]:
    """While the shard runs, a launcher (its step) that exits stops it as a cancel does: a pool worker is not
    its launcher's child, and a retry of the step would otherwise run the shard beside it."""
    if launcher_pid is None:
        yield
        return
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        raise KeyboardInterrupt from None
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if select.select([pidfd], [], [], 0.5)[0]:
                if not done.is_set():
                    os.kill(os.getpid(), signal.SIGINT)
                return

    watcher = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        os.close(pidfd)


def _output_to(path: str) -> None:
    """From now on, this process's output goes to `path`: what it buffered goes where it was written."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _rss_bytes() -> int:
    """This process's resident memory now (its engine's weights and KV cache included)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
