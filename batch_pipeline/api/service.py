"""What the routes do: jobs made through the submission path, their status read from their rows.

A status read is one indexed query: the pipeline writes status, progress and results into the job's row
as they change, so no file and no Dagster event log is read. Knows nothing of HTTP; raises domain errors
that the routes map to status codes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import dagster as dg
from dagster import DagsterRunStatus
from pydantic import Field, ValidationError

from batch_pipeline.admission.capabilities import length_refusals, scale_model_refusals
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import UnservableRequest, admission_quotas, check_servable, submit
from batch_pipeline.api.auth import Caller
from batch_pipeline.api.usage import ForbiddenTeam
from batch_pipeline.contract import (
    BatchCompletionsEstimate,
    BatchCompletionsJob,
    BatchCompletionsJobStatus,
    BatchCompletionsModelConfig,
    CancelBatchCompletionsV2Response,
    CreateBatchCompletionsV2Request,
)
from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.priority import InvalidPriority, read_priority, run_priority
from batch_pipeline.contract.requests import DEFAULT_MAX_RUNTIME_SEC
from batch_pipeline.core import io
from batch_pipeline.core.settings import Settings
from batch_pipeline.dry_run.estimate import HISTORY_JOBS, DryRuns
from batch_pipeline.openai_batch.jobs import expired
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.pipeline.run_slots import place_in_queue
from batch_pipeline.pipeline.runs import find_run
from batch_pipeline.pipeline.tags import SCHEDULE_OWNER_PREFIX, STOPPED_RUN_TAG
from batch_pipeline.shards.format import shard_directories
from batch_pipeline.shards.metadata import resume_figures
from batch_pipeline.store.jobs import IdempotencyConflict, JobStore
from batch_pipeline.store.progress import ShardPhase
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.reports import ReportStore
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.store.results import JobResults
from batch_pipeline.store.retention import checkpoints_deleted
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.sharing import SharingStore
from batch_pipeline.tenancy.tenants import TEAM_OWNER_PREFIX, Tenants, owner_name

_NOT_STARTED = {DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED}
# A LIST page ends once its jobs' labels and requests pass this many bytes, whatever its `limit`, and the
# rest follow on the next page: 1,000 jobs with the largest labels allowed made an answer of 518 MB and
# the API peak at 2.2 GB, for every team it serves.
LIST_PAGE_BYTES = 8 * 2**20


__all__ = [
    "BatchJobService",
    "ForbiddenTeam",
    "IdempotencyConflict",
    "JobNotFound",
    "ResumeConflict",
    "UnservableRequest",
]
# What a resume can start again from: how the job ended, as its users read it (an expired job is failed).
RESUMABLE = (JobStatus.FAILED, JobStatus.CANCELLED)


class JobNotFound(LookupError):
    pass


class ResumeConflict(ValueError):
    """A job that cannot be resumed now, and why (its status, its run still stopping, its checkpoints gone)."""


class _StoredRequestView(WireModel):
    """What a status read needs of a stored request; pydantic reads it from the stored JSON without
    building the rest."""

    input_data_path: str | None = None
    output_data_path: str
    model_cfg: BatchCompletionsModelConfig = Field(alias="model_config")


def _stored_request_view(record: JobRecord) -> _StoredRequestView:
    try:
        return _StoredRequestView.model_validate_json(record.request_json)
    except ValidationError:
        # A row an older release stored that no longer validates (the sensor fails such a job with the
        # reason): it is still described, with the parts that cannot be shown left empty.
        return _StoredRequestView(output_data_path="", model_cfg=BatchCompletionsModelConfig(model=""))


class BatchJobService:
    def __init__(
        self,
        store: JobStore,
        instance: dg.DagsterInstance,
        job_storage: JobStorage,
        admission: AdmissionPolicy,
        fair_share_half_life_s: float,
        dry_runs: DryRuns,
        engine_pool_dir: str = "",
    ) -> None:
        self.store = store
        self.reports = ReportStore(engine=store.engine)
        self.result_cache = ResultCacheStore(engine=store.engine)
        self.instance = instance
        self.job_storage = job_storage
        # What requests may name and ask for.
        self.admission = admission
        # The jobs sensor's fair-share decay: a queued job's place is told as the sensor will pick it.
        self.fair_share_half_life_s = fair_share_half_life_s
        self.dry_runs = dry_runs
        self.engine_pool_dir = engine_pool_dir  # this machine's warm engine pool, for /metrics

    @classmethod
    def of_deployment(cls, configured: Settings, store: JobStore, instance: dg.DagsterInstance) -> BatchJobService:
        """The service a deployment's API runs, over its job store and Dagster instance."""
        return cls(
            store,
            instance,
            JobStorage(work_dir_base=configured.work_dir_base),
            AdmissionPolicy.of_deployment(configured),
            configured.fair_share_half_life_s,
            DryRuns.of_deployment(configured),
            configured.engine_pool_dir,
        )

    def create(
        self, caller: Caller, request: CreateBatchCompletionsV2Request, idempotency_key: str | None
    ) -> BatchCompletionsJob:
        check_servable(request, caller.owner, self.admission)  # before the model is read: its paths may not be
        if refused := scale_model_refusals(request):
            raise UnservableRequest(refused)
        self.check_model(caller, request)
        record, _ = submit(
            self.store, self.job_storage.work_dir, caller.owner, request, self.admission, idempotency_key
        )
        return self.describe(record, owner_for=caller)

    def check_model(self, caller: Caller, request: CreateBatchCompletionsV2Request) -> None:
        """Refuse, naming the field, a model its job's engine could not load here (neither on the hub nor a
        directory: `smollm2-135m`, a hub this server cannot reach) and a max_new_tokens past its context,
        read as the dry run reads them; a submission's paths are checked first. Its job would otherwise fail
        at its shards minutes later, each retry starting an engine."""
        context = self.dry_runs.model_context(request, team=caller.owner)
        if context is not None and (refused := length_refusals(request, context)):
            raise UnservableRequest(refused)

    def estimate(self, caller: Caller, request: CreateBatchCompletionsV2Request) -> BatchCompletionsEstimate:
        """A dry run: the checks of a real submission first (paths, fields, priority), so that nothing a
        submission may not read is read; then the request read and tokenized; no job, no file."""
        check_servable(request, caller.owner, self.admission)
        if refused := scale_model_refusals(request):
            raise UnservableRequest(refused)
        history = self.reports.completed_figures(request.model_cfg.model, HISTORY_JOBS)
        return self.dry_runs.estimate(request, history, self.admission.data_files(caller.owner), team=caller.owner)

    def get(self, caller: Caller, job_id: str) -> BatchCompletionsJob:
        return self.describe(self._record(caller, job_id), place_for=caller, owner_for=caller)

    def list(
        self,
        caller: Caller,
        status: BatchCompletionsJobStatus | None = None,
        label: dict[str, str] | None = None,
        limit: int = 100,
        after: str | None = None,
        team: str | None = None,
    ) -> tuple[list[BatchCompletionsJob], str | None]:
        """One page of the caller's jobs (everyone's for an admin, or `team`'s alone), newest first; and the
        cursor of the next page, if there is one. A team's key naming another team: ForbiddenTeam."""
        owner = None if caller.is_admin else caller.owner
        if team is not None:
            named = self._owner_named(team)
            if not caller.is_admin and named != caller.owner:
                raise ForbiddenTeam("a team's key lists its own team's jobs only; an admin key lists every team's")
            owner = named
        page = self.store.list(
            owner=owner,
            status=status.value if status else None,
            labels=label,
            limit=limit,
            after=after,
            max_bytes=LIST_PAGE_BYTES,
        )
        return [self.describe(record, owner_for=caller) for record in page.jobs], page.next_after

    def _owner_named(self, team: str) -> str:
        """The owner whose jobs `team` names, as `metadata.owner` shows it: a tenants file's team, else an
        owner as it is (`admins`, `schedule:NAME`, a key's digest)."""
        registry = self.admission.teams()
        return TEAM_OWNER_PREFIX + team if registry is not None and team in registry.teams else team

    def update_priority(self, caller: Caller, job_id: str, priority: str | None) -> tuple[BatchCompletionsJob, bool]:
        """Reprioritise a job that has not started: in the store before launch, on the queued run after."""
        run_priority(priority)
        record = self._record(caller, job_id)
        if record.status != JobStatus.QUEUED:
            return self.describe(record), False
        run = find_run(self.instance, job_id, record.resume_count)
        if run is not None and run.status not in _NOT_STARTED:
            return self.describe(record), False
        if run is not None:
            level = run_priority(priority, self.admission.priority_cap(record.owner))
            self.instance.add_run_tags(run.run_id, {"dagster/priority": str(level)})
        self.store.set_priority(job_id, priority)
        return self.describe(self._record(caller, job_id)), True

    def cancel(self, caller: Caller, job_id: str) -> bool:
        return self.cancel_job(caller, job_id).success

    def cancel_job(self, caller: Caller, job_id: str) -> CancelBatchCompletionsV2Response:
        """Cancel the job; a job that has ended already is not, and the answer says so."""
        record = self._record(caller, job_id)
        if record.status == JobStatus.CANCELLED or record.stopping:  # asked already
            return CancelBatchCompletionsV2Response(success=True)
        if record.is_finished:
            return _not_cancelled(record)
        return CancelBatchCompletionsV2Response(success=self._stop(record))

    def _stop(self, record: JobRecord) -> bool:
        job_id = record.job_id
        run = find_run(self.instance, job_id, record.resume_count)
        if run is None:
            cancelled_before_launch = self.store.cancel_before_launch(job_id)
            # The sensor may have asked for the run just before: look again, and stop that run too. (A run
            # created later still never starts: a job cancelled before any run started refuses to.)
            run = find_run(self.instance, job_id, record.resume_count)
            if run is None:
                return cancelled_before_launch
        if run.is_finished:  # it ended as it was asked; its job reads how in a moment
            return run.status == DagsterRunStatus.CANCELED
        cancelled = self.instance.run_coordinator.cancel_run(run.run_id)
        if cancelled:
            self.store.mark_cancelled(job_id)
        return cancelled

    def resume(self, caller: Caller, job_id: str, idempotency_key: str | None) -> BatchCompletionsJob:
        """Run a failed, cancelled or expired job again on the requests it has no result for: the same job,
        its same output path, its deadline renewed from `max_runtime_sec`. Its next run plans the same
        shards, whose workers skip what their checkpoints hold (see `pipeline.job._count_kept`). With an
        `Idempotency-Key` this job's last resume was made with, that resume's job is answered again."""
        record = self._record(caller, job_id)
        if idempotency_key is not None and record.resume_idempotency_key == idempotency_key:
            return self.describe(record)
        self._check_resumable(record)
        # Queued again, it waits to start as a new job does: held to its team's max_queued_jobs likewise, counted
        # with the resume under the team's admission lock.
        queue_quota = admission_quotas(self.admission.team_of_owner(record.owner), tokens=False)
        resumed_from = "expired" if expired(record) else record.status.value
        max_runtime = _stored_max_runtime(record)
        if not self.store.resume(record, resumed_from, idempotency_key, max_runtime, queue_quota):
            # Changed since it was read: a concurrent resume (with this key: the same answer), or its run's end.
            again = self._record(caller, job_id)
            if idempotency_key is not None and again.resume_idempotency_key == idempotency_key:
                return self.describe(again)
            raise ResumeConflict(f"the job is {again.status.value}: it changed while being resumed; read it again")
        return self.describe(self._record(caller, job_id))

    def _check_resumable(self, record: JobRecord) -> None:
        """Raise ResumeConflict naming why the job cannot be resumed now."""
        if record.stopping:
            raise ResumeConflict(
                f"the job is {record.status_read.value}: it is still stopping, as its cancel asked; resume it once it "
                "reads cancelled"
            )
        if record.status not in RESUMABLE:
            raise ResumeConflict(
                f"the job is {record.status.value}: only a failed, cancelled or expired job can be resumed"
            )
        if record.owner.startswith(SCHEDULE_OWNER_PREFIX):
            raise ResumeConflict("a schedule's job is launched by its schedule's tick and cannot be resumed")
        run = find_run(self.instance, record.job_id, record.resume_count)
        # Its end not recorded yet (a resumed job keeps its previous end until its new run's is recorded).
        ended = record.completed_at is not None and (
            record.resumed_at is None or record.completed_at > record.resumed_at
        )
        if not ended or (run is not None and not run.is_finished):
            raise ResumeConflict(
                f"the job is {record.status.value} but its run is still stopping: resume it once it has stopped"
            )
        if record.run_id is not None and not _output_final(record) and self._keeping_partial_results(record.run_id):
            raise ResumeConflict(
                f"the job is {record.status.value} and its finished results are still being merged into its "
                "output: resume it once that is done"
            )
        if (gone := self._checkpoints_gone(record)) is not None:
            raise ResumeConflict(gone)

    def _keeping_partial_results(self, run_id: str) -> bool:
        """Whether `keep_partial_results` is still merging what the stopped run `run_id` finished."""
        runs = self.instance.get_runs(filters=dg.RunsFilter(tags={STOPPED_RUN_TAG: run_id}), limit=1)
        return bool(runs) and not runs[0].is_finished

    def _checkpoints_gone(self, record: JobRecord) -> str | None:
        """Why the job's work (its inline content, its shards' checkpoints) can no longer be resumed from,
        or None: retention deleted its work dir (when, from its row), or the files are gone otherwise. The
        answer never names the service's paths."""
        if (deleted := checkpoints_deleted(self.store.engine, record.job_id)) is not None:
            return deleted
        work_dir = self.job_storage.work_dir(record.job_id)
        if record.content_path is not None and not io.exists(record.content_path):
            return "the job's checkpoints were deleted: its inline content is no longer stored"
        if record.requests_total and not shard_directories(work_dir):
            return "the job's checkpoints were deleted: its work dir holds no shards"
        return None

    def describe(
        self, record: JobRecord, place_for: Caller | None = None, owner_for: Caller | None = None
    ) -> BatchCompletionsJob:
        """The job as its row has it: no file, no run and no event log is read. With `place_for` (the caller
        of a GET of one job), a job waiting for a run slot says where it stands as that caller may know it
        (the waiting jobs' index is read). With `owner_for` an admin, `metadata.owner` names the job's team
        (a team's own jobs are the only ones its keys see: it is not told its own name)."""
        request = _stored_request_view(record)
        metadata: dict[str, str] = {"labels": _labels_text(record.labels)} if record.labels else {}
        if owner_for is not None and owner_for.is_admin:
            # The owner is the submitting key's team; a `team` label the request set is only a label.
            metadata["owner"] = owner_name(record.owner)
        if record.run_id is not None:
            metadata["dagster_run_id"] = record.run_id
        if record.requests_total:
            metadata |= {
                "requests_done": str(record.requests_done or 0),
                "requests_total": str(record.requests_total),
                "completion_tokens_generated": str(record.completion_tokens or 0),
            }
        if (phase := job_phase(record)) is not None:
            metadata["phase"] = phase
        if record.status_detail:
            metadata["retrying_after"] = record.status_detail  # its run worker died; Dagster runs it again
        waiting = record.status == JobStatus.QUEUED and record.run_id is None
        if waiting and (registry := self.admission.teams()) is not None:
            metadata["waiting_for"] = "a run slot: the jobs sensor gives free ones out by fair share between teams"
            if place_for is not None:
                metadata |= _place_in_queue(
                    SharingStore(engine=self.store.engine), registry, record, self.fair_share_half_life_s, place_for
                )
        if record.results is not None:
            metadata |= _results_metadata(record.results)
        if record.status == JobStatus.FAILED:
            metadata["failure_reason"] = record.failure_reason or "the job failed"
        if record.priority is not None:
            metadata["priority_read_as"] = _priority_read_as(record.priority, self.admission.priority_cap(record.owner))
        if record.resume_count:
            metadata |= _resume_metadata(record)
        if record.cancelled_at is not None:  # a stopping job reads as before until it has stopped (`stopping`)
            metadata["cancel_requested_at"] = record.cancelled_at.isoformat()
        ended = record.is_finished and not record.stopping
        try:
            status = BatchCompletionsJobStatus(record.status_read)
        except ValueError:
            status = BatchCompletionsJobStatus.UNKNOWN
        return BatchCompletionsJob(
            job_id=record.job_id,
            input_data_path=request.input_data_path,
            output_data_path=request.output_data_path,
            model_cfg=request.model_cfg,
            priority=record.priority,
            status=status,
            created_at=record.created_at.isoformat(),
            expires_at=record.expires_at.isoformat(),
            # A resumed job waiting for its new run keeps its last end in the row (fair share counts it): not shown.
            completed_at=record.completed_at.isoformat() if record.completed_at and ended else None,
            metadata=metadata,
        )

    def _record(self, caller: Caller, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        # Someone else's job is reported as absent, not forbidden: its existence is not ours to reveal.
        if record is None or (record.owner != caller.owner and not caller.is_admin):
            raise JobNotFound(job_id)
        return record


def job_phase(record: JobRecord) -> str | None:
    """Where a job that has not ended is, from its row: `queued`, `planning shards`, `starting workers`,
    `starting engine`, `generating n/N` (requests done of the job's), `merging` (every shard done, its output
    being written), `stopping` (a cancel was asked); None once it has ended."""
    if record.stopping:
        return "stopping"
    if record.status == JobStatus.QUEUED:
        return "queued"
    if record.status != JobStatus.RUNNING:
        return None
    total, done = record.requests_total, record.requests_done or 0
    if total is None:  # validate_input and plan_shards have not recorded its shards yet
        return "planning shards"
    if done >= total:
        return "merging"
    if record.shard_phase == ShardPhase.GENERATING:
        return f"generating {done}/{total}"
    if record.shard_phase == ShardPhase.ENGINE:
        return "starting engine"
    return "starting workers"  # launched (importing vLLM, a pod scheduled), or waiting for its step


def _not_cancelled(record: JobRecord) -> CancelBatchCompletionsV2Response:
    then = (
        "its output is final"
        if record.status == JobStatus.COMPLETED
        else f"a failed job can be resumed (POST /v2/batch-completions/{record.job_id}/actions/resume)"
    )
    return CancelBatchCompletionsV2Response(
        success=False, reason=f"the job has ended ({record.status.value}): there is nothing to cancel; {then}"
    )


def _results_metadata(results: JobResults) -> dict[str, str]:
    """The finished job's summary (as in its metadata file) as the API's view of it shows it: each figure
    its run wrote."""
    shown = {
        "num_requests": results.num_requests,
        "num_errors": results.num_errors,
        "prompt_tokens": results.prompt_tokens,
        "completion_tokens": results.completion_tokens,
        "completion_tokens_per_s": results.completion_tokens_per_s,
        "completion_tokens_per_wall_s": results.completion_tokens_per_wall_s,
        "wall_s": results.wall_s,
        "num_finished": results.num_finished,
        "num_unfinished": results.num_unfinished,
    }
    return {key: str(figure) for key, figure in shown.items() if figure is not None}


def _resume_metadata(record: JobRecord) -> dict[str, str]:
    """A resumed job's metadata: from what (status, run) and when it was last resumed; once its run counted
    its checkpoints, the requests and tokens kept from them, and those generated since (requests as they
    finish, completion tokens once it completed: its total less what was kept)."""
    metadata = {"resumed_from": record.resumed_from or "", "resume_count": str(record.resume_count)}
    if record.resumed_from_run_id:
        metadata["resumed_from_run_id"] = record.resumed_from_run_id
    if record.resumed_at:
        metadata["resumed_at"] = record.resumed_at.isoformat()
    completed_tokens = record.completion_tokens if record.status == JobStatus.COMPLETED else None
    if (figures := resume_figures(record, record.requests_done or 0, completed_tokens)) is not None:
        metadata |= {name: str(figure) for name, figure in figures.model_dump(exclude_none=True).items()}
    return metadata


def _output_final(record: JobRecord) -> bool:
    """Whether `keep_partial_results` has written the stopped run's output whole (its run may still be
    finishing: a retry of its step then writes nothing, see `partial_results._merge`)."""
    return record.results is not None and record.results.kept_of(record.run_id)


def _stored_max_runtime(record: JobRecord) -> int:
    """The job's `max_runtime_sec` as stored (a row that does not parse: the default)."""
    try:
        value = record.request.get("max_runtime_sec")
    except ValueError:
        return DEFAULT_MAX_RUNTIME_SEC
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_RUNTIME_SEC


def _place_in_queue(
    store: SharingStore, registry: Tenants, record: JobRecord, half_life_s: float, caller: Caller
) -> dict[str, str]:
    """`queue_position` (1-based) and why, as the jobs sensor's order has it now. A team is told its job's
    place among its own team's waiting jobs, and its own team's standing, never how many jobs other teams
    have waiting or how they stand; an admin, its place among every team's."""
    place = place_in_queue(store, registry, record, datetime.now(UTC), half_life_s, count_other_teams=caller.is_admin)
    if place is None:
        return {}
    standing = (
        f"slot-seconds per weight (weight {place.weight:g}, {place.running} running); slots go to the teams with "
        "less per weight first, then fewer running per weight; within a team, higher priority, then older"
    )
    if caller.is_admin:
        ahead = place.position - 1
        why = (
            f"a run slot: {ahead} job{'s' if ahead != 1 else ''} ahead by fair share between teams "
            f"({place.ahead_in_team} of them its team's); its team has used {place.usage_per_weight:.0f} {standing}"
        )
    else:
        ahead = place.ahead_in_team
        why = (
            f"a run slot: {ahead} of your team's jobs {'go' if ahead != 1 else 'goes'} first; your team has used "
            f"{place.usage_per_weight:.0f} {standing}"
        )
    whose = "its team's" if caller.is_admin else "your team's"
    if place.held_by_bound:
        why = f"one of {whose} {place.running} running jobs to end (its max_running_jobs), then {why}"
    if place.held_by_tokens:
        why = (
            f"{whose} max_tokens_per_day: it has used {place.tokens_today}/{place.max_tokens_per_day} tokens "
            f"today (UTC); its jobs wait until 00:00 UTC, then {why}"
        )
    return {"queue_position": str(place.position), "waiting_for": why}


def _priority_read_as(priority: str, cap: int | None) -> str:
    try:
        return read_priority(priority, cap).reading
    except InvalidPriority as exc:  # a row an older release stored: described, never a failed read
        return f"not read: {exc}"


def _labels_text(labels: dict[str, str]) -> str:
    """Labels as the metadata's JSON string: unescaped, so that a 4-byte character is 4 bytes of the answer
    and not a \\uXXXX pair escaped once more (14), unless a row an older release stored holds a lone
    surrogate, which only an escape can carry."""
    text = json.dumps(labels, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(labels)
    return text
