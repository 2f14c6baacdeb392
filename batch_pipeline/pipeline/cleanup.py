"""Retention: the `cleanup` schedule, and the small job it launches when something is due, so that each
deletion is a run the UI shows (what it deleted in its metadata and log).

- A finished job's work dir (inline content, shard inputs, checkpoints, a batch's copy of its input) is
  deleted `retention_days` after the job ended: the deployment's (BATCH_PIPELINE_RETENTION_DAYS), or its
  team's in the tenants file; 0 keeps them forever. The job's row says when (`work_dir_deleted_at`), and a
  resume is refused from then on (409, `store.retention.checkpoints_deleted`).
- An OpenAI file is deleted once it expired (`expires_after`, a batch's `output_expires_after`); it reads
  as absent from the moment it expires, cleaned up or not.
- A webhook event no longer pending (delivered, given up, or for no endpoint) is deleted from the outbox
  `retention_days` after it was written (its job's end), by the same groups; a pending one never is.
- A team's result cache entries (issue 49) are deleted `retention_days` after they were written, by the
  same groups, with the payload files they leave unused.
- Outputs the user named are never deleted: a job's `output_data_path` and its metadata file stay even
  where they lie inside its work dir. An OpenAI batch's output is its output and error files, which
  expire only as their batch asked.

One run deletes at most `max_work_dirs` work dirs, `max_files` files and `max_webhook_events` events (its
config; the defaults below), so that a backlog (a first deployment of retention, a lowered
`retention_days`) is spread over the hourly runs instead of holding a run slot for hours; what is left is
in the run's metadata and log, for the next run.

Every delete goes through fsspec (a work dir on s3:// is deleted as a local one), is idempotent (a
second run, or a retry, finds nothing more to do), and never follows a symlink: a local work dir is
removed beneath the base's descriptor (a symlink in its place, or in it, is unlinked, never followed).
"""

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from dagster import OpExecutionContext
from dagster._core.storage.dagster_run import IN_PROGRESS_RUN_STATUSES
from pydantic import Field

from batch_pipeline.admission.paths import metadata_path
from batch_pipeline.core import io
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource, Tenancy
from batch_pipeline.store import retention
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import OpenAIStore
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.store.webhooks import count_finished_events, delete_finished_events, finished_events_due
from batch_pipeline.tenancy.tenants import Tenants

CLEANUP_CRON = "23 * * * *"  # hourly
# One run's bounds (its config's defaults): the rest is left to the next hour's run.
MAX_WORK_DIRS_PER_RUN = 1000
MAX_FILES_PER_RUN = 1000
MAX_WEBHOOK_EVENTS_PER_RUN = 10_000  # rows only: cheap to delete
_CHUNK = 500
# A work dir is base/<job id>: a job id is one plain name (never `files`, the OpenAI files' directory).
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NOT_WORK_DIRS = frozenset({"files"})


@dataclass(frozen=True)
class RetentionGroup:
    """Jobs whose work dirs are kept `days` days: those of `owners` (None: any owner but `other_than`)."""

    days: int
    owners: tuple[str, ...] | None
    other_than: tuple[str, ...] = ()


def retention_groups(default_days: int, registry: Tenants | None) -> list[RetentionGroup]:
    """The deployment's retention and each team's own, as groups of owners (0 days: kept forever, no group)."""
    overrides: dict[int, list[str]] = {}
    for team in registry.teams.values() if registry else ():
        if team.config.retention_days is not None:
            overrides.setdefault(team.config.retention_days, []).append(team.owner)
    own = tuple(owner for owners in overrides.values() for owner in owners)
    groups = [RetentionGroup(days, tuple(owners)) for days, owners in sorted(overrides.items())]
    groups.append(RetentionGroup(default_days, None, own))
    return [group for group in groups if group.days > 0]


class CleanupLimits(dg.Config):
    """How much one cleanup run deletes at most; what is due beyond it is left to the next run."""

    max_work_dirs: int = Field(default=MAX_WORK_DIRS_PER_RUN, ge=1, description="Work dirs one run deletes at most")
    max_files: int = Field(default=MAX_FILES_PER_RUN, ge=1, description="Expired OpenAI files one run deletes at most")
    max_webhook_events: int = Field(
        default=MAX_WEBHOOK_EVENTS_PER_RUN, ge=1, description="Webhook outbox rows one run deletes at most"
    )


@dataclass
class CleanupReport:
    work_dirs_deleted: list[str] = field(default_factory=list)
    files_deleted: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    webhook_events_deleted: int = 0
    cache_entries_deleted: int = 0  # result cache entries past their team's retention
    # Still due once the run's bounds were reached (or a deletion failed): for the next run.
    work_dirs_left: int = 0
    files_left: int = 0
    webhook_events_left: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "work_dirs_deleted": len(self.work_dirs_deleted),
            "files_deleted": len(self.files_deleted),
            "webhook_events_deleted": self.webhook_events_deleted,
            "cache_entries_deleted": self.cache_entries_deleted,
            "failures": len(self.failures),
            "work_dirs_left": self.work_dirs_left,
            "files_left": self.files_left,
            "webhook_events_left": self.webhook_events_left,
        }

    def left(self) -> str | None:
        """What the next run is left to delete, in words; None when nothing."""
        parts = [
            f"{count} {what}{'s' if count > 1 else ''}"
            for count, what in (
                (self.work_dirs_left, "work dir"),
                (self.files_left, "file"),
                (self.webhook_events_left, "webhook event"),
            )
            if count
        ]
        return f"left to the next cleanup, still due: {', '.join(parts)}" if parts else None


def anything_due(store: JobStore, storage: JobStorage, registry: Tenants | None, now: datetime) -> bool:
    """Whether a cleanup run would delete anything now (reads of one row each)."""
    if OpenAIStore(engine=store.engine).expired_files(now, limit=1):
        return True
    for group in retention_groups(storage.retention_days, registry):
        cutoff = now - timedelta(days=group.days)
        if retention.due_work_dirs(store.engine, cutoff, group.owners, group.other_than, 1):
            return True
        if finished_events_due(store.engine, cutoff, group.owners, group.other_than):
            return True
        if _cache_owners_due(ResultCacheStore(engine=store.engine), group, cutoff):
            return True
    return False


def clean_up(
    store: JobStore,
    storage: JobStorage,
    registry: Tenants | None,
    now: datetime,
    log: Any,
    limits: CleanupLimits | None = None,
) -> CleanupReport:
    """Delete the expired OpenAI files, the work dirs past their retention (the deployment's, or a team's
    of `registry`) and the webhook events past it, as of `now`, at most `limits` of each; the report says
    what is left."""
    limits = limits or CleanupLimits()
    report = CleanupReport()
    files = OpenAIStore(engine=store.engine)
    _delete_expired_files(files, storage.files_dir(), now, log, report, limits.max_files)
    report.files_left = files.count_expired_files(now)
    work_dirs, events = limits.max_work_dirs, limits.max_webhook_events
    groups = retention_groups(storage.retention_days, registry)
    failed: set[str] = set()
    # Each group its share of the bound first, then what the others left unused: a team with a retention of
    # its own and a backlog cannot spend every run on itself while the others' work dirs stay (and count in
    # their quota).
    for fair in (True, False):
        for position, group in enumerate(groups):
            cutoff = now - timedelta(days=group.days)
            groups_left = len(groups) - position
            share = -(-work_dirs // groups_left) if fair else work_dirs
            work_dirs -= _delete_due_work_dirs(store, storage, group, now, log, report, share, failed)
            share = -(-events // groups_left) if fair else events
            deleted = delete_finished_events(store.engine, cutoff, group.owners, group.other_than, share)
            events -= deleted
            report.webhook_events_deleted += deleted
            if deleted:
                log.info(f"{deleted} webhook events written before {cutoff} deleted ({group.days} days kept)")
    for group in groups:
        _expire_cached_results(store, storage, group, now - timedelta(days=group.days), log, report)
    for group in groups:
        cutoff = now - timedelta(days=group.days)
        report.work_dirs_left += retention.count_due_work_dirs(store.engine, cutoff, group.owners, group.other_than)
        report.webhook_events_left += count_finished_events(store.engine, cutoff, group.owners, group.other_than)
    return report


def _cache_owners_due(cache: ResultCacheStore, group: RetentionGroup, cutoff: datetime) -> list[str]:
    """The owners of `group` whose result caches hold entries written before `cutoff`."""
    owners = cache.owners_with_entries_before(cutoff)
    if group.owners is not None:
        return [owner for owner in owners if owner in group.owners]
    return [owner for owner in owners if owner not in group.other_than]


def _expire_cached_results(
    store: JobStore, storage: JobStorage, group: RetentionGroup, cutoff: datetime, log: Any, report: CleanupReport
) -> None:
    """The result cache's entries past their team's retention, and the payload files they leave unused
    (only beneath the deployment's cache directory)."""
    cache = ResultCacheStore(engine=store.engine)
    root = storage.result_cache_dir().rstrip("/") + "/"
    for owner in _cache_owners_due(cache, group, cutoff):
        before = cache.figures(owner).entries
        for path in cache.drop(owner, created_before=cutoff):
            if not path.startswith(root):
                log.warning(f"result cache of {owner}: {path} is not under {root}; only its entries are deleted")
                continue
            try:
                io.remove(path)
            except Exception as exc:  # found by no lookup: left for an operator
                report.failures.append(f"{path}: {exc}")
        expired = before - cache.figures(owner).entries
        report.cache_entries_deleted += expired
        log.info(f"result cache of {owner}: {expired} entries written before {cutoff} deleted ({group.days} days kept)")


def _delete_expired_files(
    files: OpenAIStore, files_dir: str, now: datetime, log: Any, report: CleanupReport, limit: int
) -> None:
    failed: set[str] = set()  # tried once this run: left to the next one
    tried = 0
    while tried < limit and (expired := files.expired_files(now, _CHUNK)):
        progressed = False
        for record in expired:
            if record.file_id in failed:
                continue
            if tried >= limit:
                return
            tried += 1
            try:
                if record.path == io.join(files_dir, record.file_id) and _PLAIN_NAME.match(record.file_id):
                    _delete_entry(files_dir, record.file_id)
                else:  # not where this deployment keeps files: its row goes, nothing outside is touched
                    log.warning(f"{record.file_id}: its bytes are not under {files_dir}; only its row is deleted")
            except Exception as exc:  # an object store's error too: the other files are still deleted
                failed.add(record.file_id)
                report.failures.append(f"{record.file_id}: {exc}")
                log.error(f"{record.file_id}: could not delete its bytes: {exc}")
                continue
            if files.forget_expired_file(record.file_id, now):
                report.files_deleted.append(record.file_id)
                progressed = True
                log.info(f"{record.file_id} ({record.owner}) expired at {record.expires_at}: deleted")
        if not progressed:
            return


def _delete_due_work_dirs(
    store: JobStore,
    storage: JobStorage,
    group: RetentionGroup,
    now: datetime,
    log: Any,
    report: CleanupReport,
    limit: int,
    failed: set[str],
) -> int:
    """Delete the group's due work dirs, at most `limit` of them tried; how many were tried. `failed`: those
    this run could not delete (added to here), tried once a run: left to the next one."""
    cutoff = now - timedelta(days=group.days)
    batches = OpenAIStore(engine=store.engine)
    tried = 0
    while tried < limit and (
        due := retention.due_work_dirs(store.engine, cutoff, group.owners, group.other_than, _CHUNK)
    ):
        progressed = False
        for job in due:
            if job.job_id in failed:
                continue
            if tried >= limit:
                return tried
            tried += 1
            if not _PLAIN_NAME.match(job.job_id) or job.job_id in _NOT_WORK_DIRS:
                log.warning(f"{job.job_id!r}: not a work dir's name; its row is marked, nothing is deleted")
                retention.claim_work_dir(store.engine, job.job_id, cutoff, now)
                progressed = True
                continue
            if not retention.claim_work_dir(store.engine, job.job_id, cutoff, now):
                continue  # resumed, or claimed by another cleanup, since it was read
            # An OpenAI batch's output in its work dir is the service's (its output and error files are the
            # user's); any other job's named output, and its metadata, are the user's.
            keep = () if batches.get_batch(job.job_id) is not None else _named_outputs(job.request_json)
            try:
                delete_work_dir(storage.base(), job.job_id, keep)
            except Exception as exc:  # an object store's error too: the other work dirs are still deleted
                failed.add(job.job_id)
                retention.release_work_dir(store.engine, job.job_id, now, job.content_bytes, job.checkpoint_bytes)
                report.failures.append(f"{job.job_id}: {exc}")
                log.error(f"{job.job_id}: could not delete its work dir: {exc}")
                continue
            progressed = True
            report.work_dirs_deleted.append(job.job_id)
            log.info(f"{job.job_id} ({job.owner}) ended {job.completed_at}: work dir deleted ({group.days} days kept)")
        if not progressed:
            return tried
    return tried


def _named_outputs(request_json: str) -> tuple[str, ...]:
    try:
        output = json.loads(request_json).get("output_data_path")
    except (ValueError, AttributeError):
        return ()
    return (output, metadata_path(output)) if isinstance(output, str) and output else ()


def delete_work_dir(base: str, job_id: str, keep: Collection[str] = ()) -> None:
    """Delete the work dir `base/job_id` and everything in it but the paths of `keep` (and the
    directories holding them); nothing when it is already gone. Locally no symlink is followed."""
    if not _PLAIN_NAME.match(job_id) or job_id in _NOT_WORK_DIRS:
        raise ValueError(f"{job_id!r} is not a work dir's name")
    root = io.join(base, job_id)
    kept = {path[len(root) + 1 :] for path in (_normal(path) for path in keep) if path.startswith(root + "/")}
    if not io.is_local(root):
        fs, resolved = io.filesystem(root)
        if not kept:
            io.remove_tree(root)
            return
        for path in fs.find(resolved):
            if path.removeprefix(resolved.rstrip("/") + "/") not in kept:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(path)
        return
    if not kept:
        _delete_entry(base, job_id)
        return
    _prune_beneath(io.filesystem(base)[1], job_id, kept)


def _normal(path: str) -> str:
    return os.path.abspath(path) if io.is_local(path) else path


def _delete_entry(directory: str, name: str) -> None:
    """Delete `directory/name` (a file, a symlink or a whole tree), beneath the directory's descriptor and
    with no symlink followed; nothing when it is gone. On an object store, the object or prefix."""
    if not io.is_local(directory):
        path = io.join(directory, name)
        fs, resolved = io.filesystem(path)
        if fs.isdir(resolved):
            io.remove_tree(path)
        else:
            io.remove(path)
        return
    try:
        fd = os.open(io.filesystem(directory)[1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's
    except FileNotFoundError:
        return  # no base yet: nothing was ever written there
    try:
        try:
            mode = os.lstat(name, dir_fd=fd).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(name, dir_fd=fd)  # descriptor-based: a symlink inside is unlinked, never followed
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)  # a file, or a symlink put there: the link goes, not its target
    finally:
        os.close(fd)


def _prune_beneath(base: str, name: str, kept: set[str]) -> None:
    """Delete everything under `base/name` but the relative paths of `kept`, no symlink followed."""
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        try:
            if not stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                os.unlink(name, dir_fd=fd)  # a symlink in the work dir's place: unlinked, never followed
                return
        except FileNotFoundError:
            return
        for top, directories, names, top_fd in os.fwalk(name, dir_fd=fd, topdown=False, follow_symlinks=False):
            relative = top.removeprefix(name).lstrip("/")
            for entry in names:
                if os.path.join(relative, entry) not in kept:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=top_fd)
            for entry in directories:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISLNK(os.lstat(entry, dir_fd=top_fd).st_mode):
                        os.unlink(entry, dir_fd=top_fd)
                    else:
                        with contextlib.suppress(OSError):  # not empty: it holds a kept file
                            os.rmdir(entry, dir_fd=top_fd)
    finally:
        os.close(fd)


@dg.op(
    description="Delete expired OpenAI files, the work dirs of jobs past their retention and the webhook events "
    "past it, at most the config's bounds of each a run."
)
def delete_expired(
    context: OpExecutionContext,
    config: CleanupLimits,
    job_store: JobStoreResource,
    job_storage: JobStorage,
    tenancy: Tenancy,
) -> dict[str, int]:
    report = clean_up(job_store.get_store(), job_storage, tenancy.registry(), datetime.now(UTC), context.log, config)
    if (left := report.left()) is not None:
        context.log.info(left)
    context.add_output_metadata(
        {
            **report.summary(),
            "work_dirs": ", ".join(report.work_dirs_deleted[:100]),
            "files": ", ".join(report.files_deleted[:100]),
        }
    )
    if report.failures:
        raise dg.Failure(
            f"{len(report.failures)} deletions failed (retried by the next cleanup): {'; '.join(report.failures[:5])}"
        )
    return report.summary()


@dg.job(
    executor_def=dg.in_process_executor,
    description="Retention: expired OpenAI files, old work dirs and old webhook events deleted.",
)
def cleanup():
    delete_expired()


@dg.schedule(
    name="cleanup",
    cron_schedule=CLEANUP_CRON,
    job=cleanup,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly: a `cleanup` run when an OpenAI file expired, or a finished job's work dir or a sent "
    "webhook event is past its retention (BATCH_PIPELINE_RETENTION_DAYS, or the team's retention_days); else the "
    "tick is skipped.",
)
def cleanup_schedule(
    context: dg.ScheduleEvaluationContext, job_store: JobStoreResource, job_storage: JobStorage, tenancy: Tenancy
):
    tick = context.scheduled_execution_time or datetime.now(UTC)
    # One cleanup at a time: each holds a run slot the teams' jobs share, and a long one (many files) must not
    # be joined by the next hour's.
    unfinished = context.instance.get_run_ids(
        dg.RunsFilter(
            job_name=cleanup.name,
            statuses=[*IN_PROGRESS_RUN_STATUSES, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED],
        ),
        limit=1,
    )
    if unfinished:
        return dg.SkipReason(f"the cleanup run {unfinished[0]} has not finished: it deletes the rest")
    if not anything_due(job_store.get_store(), job_storage, tenancy.registry(), datetime.now(UTC)):
        return dg.SkipReason("no OpenAI file has expired and no work dir or webhook event is past its retention")
    return dg.RunRequest(run_key=f"cleanup@{tick.astimezone(UTC).isoformat()}")
