"""The `batch_completions` job: validate → plan shards → one worker per shard → merge → job metadata.

The ops orchestrate; inference happens in the shard workers the launcher starts.
"""

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster import OpExecutionContext
from pydantic import TypeAdapter, ValidationError

from batch_pipeline.admission.output_room import bounded_output
from batch_pipeline.admission.paths import DataFiles, metadata_path
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import (
    QuotaExceeded,
    StoredRequest,
    UnservableRequest,
    check_servable,
    stored_bytes_of,
    submit,
)
from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.priority import InvalidPriority
from batch_pipeline.contract.records import RecordError, describe_validation_error
from batch_pipeline.contract.requests import DEFAULT_MAX_RUNTIME_SEC
from batch_pipeline.core import io
from batch_pipeline.core.settings import settings as deployment_settings
from batch_pipeline.launch.base import ShardLauncher, ShardResult
from batch_pipeline.openai_batch.jobs import finalize_batch
from batch_pipeline.pipeline.config_schema import config_schema_for, launchpad_template
from batch_pipeline.pipeline.console_logger import console_logger
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource, ShardPlanning
from batch_pipeline.pipeline.result_cache import (
    JobCache,
    job_cache,
    keep_results,
    lookup_in,
    planned_identity,
    record_planned_identity,
    shard_machine,
)
from batch_pipeline.pipeline.runs import job_id_of, launch_tags, not_the_run_of, tagged_job_id
from batch_pipeline.pipeline.tags import DEADLINE_TAG, JOB_ID_TAG, MAX_RUNTIME_TAG, max_runtime_from, run_tags
from batch_pipeline.shards.format import checkpoint_bytes
from batch_pipeline.shards.merge import MissingResult, checkpointed, merge_sorted_outputs, write_output_array
from batch_pipeline.shards.metadata import DataParallelism, JobMetadata, ShardEntry, write_metadata
from batch_pipeline.shards.planning import RecordedPlan, ShardPlan
from batch_pipeline.shards.protocol import ShardHardware, ShardTask
from batch_pipeline.shards.records import KindsRead, work_items
from batch_pipeline.shards.replanning import write_job_shards
from batch_pipeline.shards.result_cache import with_cache_hits
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.quotas import QuotaStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.results import JobResults
from batch_pipeline.tenancy.tenants import TEAM_OWNER_PREFIX, Tenants, owner_team

# Every finished job materializes this asset, partitioned by job id: the UI's catalog of outputs.
OUTPUTS_ASSET = dg.AssetKey(["batch_completions", "outputs"])
# Its definition in the catalog, which without one called it "External asset ... no software definition".
OUTPUTS_ASSET_SPEC = dg.AssetSpec(
    OUTPUTS_ASSET,
    description=(
        "Each finished job's outputs, one materialization a job (its partition: the job id): the output file "
        "and its .metadata.json at output_data_path, with the job's counts and token figures. Written by "
        "write_job_metadata, the last step of the job's batch_completions run; a job is made by submitting "
        "it (the API, the launchpad of batch_completions, a schedule), not by materializing this here."
    ),
    group_name="batch_completions",
    kinds={"json"},
)
SHARD_STEP_TAG = "batch_pipeline/step"
# The request's fields a launcher sizes a shard's machine by.
HARDWARE_FIELDS = ("gpus", "gpu_type", "cpus", "memory", "storage")
_HARDWARE: TypeAdapter[ShardHardware] = TypeAdapter(ShardHardware)
# Owner of the jobs registered for runs launched outside the API (launchpad, `batch-pipeline run`) where
# the deployment has no tenants file: API admins see them. With one, such a run names its team (TEAM_FIELD).
DAGSTER_OWNER = "dagster"
# The field of validate_input's run config, beside the request, that names the team owning a launched run.
TEAM_FIELD = "team"


@dataclass(frozen=True)
class PlanSummary:
    """How the job was split: its shard plan, and how many requests take an earlier repeat's output."""

    plan: ShardPlan
    deduplicated: int


@dataclass(frozen=True)
class MergedOutput:
    """The job's output, merged: where, how many results, and how long the merge took."""

    output_data_path: str
    results: int
    merge_s: float


def current_job_id(context: OpExecutionContext) -> str:
    """The job id as stored now: validate_input may have tagged the run after its steps were planned,
    and a step's own copy of the run predates that."""
    return job_id_of(context.instance, context.instance.get_run_by_id(context.run_id) or context.run)


# The deployment's admission policy, as an op or schedule takes it: a plain object, bound by definitions.py.
AdmissionPolicyParam = dg.ResourceParam[AdmissionPolicy]


def job_data_files(
    context: OpExecutionContext, job_store: JobStoreResource, job_storage: JobStorage, admission: AdmissionPolicy
) -> DataFiles:
    """How this job opens the files its request names: beneath its team's data roots (the job's owner's),
    at the moment it opens them."""
    job_id = current_job_id(context)
    record = job_store.get_store().get(job_id)
    owner = record.owner if record is not None else DAGSTER_OWNER
    return admission.data_files(owner, job_storage.work_dir(job_id))


def job_deadline(context: OpExecutionContext, max_runtime_sec: int | None) -> float:
    """The job's deadline in epoch seconds: its expires_at, carried by every run of the job (retries copy
    the tag). A run with no job record behind it (a test's `execute_request`) counts from its own start."""
    run = context.instance.get_run_by_id(context.run_id) or context.run
    if DEADLINE_TAG in run.tags:
        return float(run.tags[DEADLINE_TAG])
    return _run_start(context) + (max_runtime_sec or DEFAULT_MAX_RUNTIME_SEC)


def _validate_input_config() -> dg.Shape:
    """The request, as typed config, and the team that owns a run launched from the launchpad."""
    request = config_schema_for(StoredRequest)
    team = dg.Field(
        dg.Noneable(dg.String),
        is_required=False,
        description="The team (of the tenants file) that owns this run: its job is checked against that team's "
        "data roots, priority cap and quotas, as the team's API submission is. Required where the deployment has "
        "a tenants file; leave it empty on a run the jobs sensor or a schedule launched.",
    )
    return dg.Shape({**request.fields, TEAM_FIELD: team})


@dg.op(
    config_schema=_validate_input_config(),
    description="Check the request (the run config) against the contract and the paths it names, as a "
    "submission of the job's team.",
)
def validate_input(
    context: OpExecutionContext, job_store: JobStoreResource, job_storage: JobStorage, admission: AdmissionPolicyParam
) -> StoredRequest:
    config = dict(context.op_config)
    team = config.pop(TEAM_FIELD, None)
    try:
        request = StoredRequest.model_validate(config)
    except ValidationError as exc:
        raise dg.Failure(f"invalid request: {describe_validation_error(exc)}") from None
    job_id = tagged_job_id(context.instance, context.run)
    store = job_store.get_store()
    record = store.get(job_id) if job_id is not None else None
    registry = admission.teams()
    if record is not None:
        # A job-id tag is anyone's to set: the run is the job's only if the service launched it for the job.
        if (why := not_the_run_of(context.instance, context.run, record)) is not None:
            raise dg.Failure(f"this run is not the run of job {job_id}: {why}", allow_retries=False)
        if team is not None and registry is not None and TEAM_OWNER_PREFIX + team != record.owner:
            raise dg.Failure(f"{TEAM_FIELD}: job {job_id} is not team {team}'s", allow_retries=False)
        owner = record.owner
    elif job_id is not None and registry is not None:
        raise dg.Failure(
            f"{JOB_ID_TAG}: there is no job {job_id}; launch the run without the tag, naming its {TEAM_FIELD}",
            allow_retries=False,
        )
    else:
        owner = _launching_owner(context, registry, team)
    # Held to the paths of the team whose job it is, again now that the run starts (the tenants file may
    # have changed since).
    try:
        check_servable(request, owner, admission, own_dir=job_storage.work_dir(job_id) if job_id is not None else None)
    except UnservableRequest as exc:
        raise dg.Failure(str(exc)) from None
    except InvalidPriority as exc:
        raise dg.Failure(f"priority: {exc}") from None
    files = admission.data_files(owner, own_dir=job_storage.work_dir(job_id) if job_id is not None else None)
    try:
        if request.input_data_path is not None and not files.exists(request.input_data_path):
            raise dg.Failure(f"input_data_path: no file at {request.input_data_path}")
    except OSError as exc:
        raise dg.Failure(f"input_data_path: cannot read {request.input_data_path}: {exc}") from None
    try:
        files.check_writable(request.output_data_path)
    except OSError as exc:
        raise dg.Failure(f"output_data_path: cannot write {request.output_data_path}: {exc}") from None
    if request.content_path is not None:
        # Only the submission path names a content file: the one it wrote for this job.
        if record is None or record.content_path != request.content_path:
            raise dg.Failure(
                "content_path: set by the submission path only, to the file it wrote for the job; "
                "send content or input_data_path instead",
                allow_retries=False,
            )
    if job_id is None:
        job_id = _register_job(context, job_store, job_storage, admission, request, owner)
    # Started when Dagster started the run, not when this first step got going (~2 s later here).
    if not store.mark_started(job_id, context.run_id, datetime.fromtimestamp(_run_start(context), UTC)):
        # A run the jobs sensor asked for just before the cancel: it stops as a cancelled run, not a failed one
        # (Dagster ends a canceling run whose step fails as canceled). A failure would read, beside the sensor
        # that launched it in the Dagster UI, as a red run of a broken sensor.
        reason = "the job was cancelled before its run started"
        context.instance.report_run_canceling(context.run, message=reason)
        raise dg.Failure(reason, allow_retries=False)
    _enforce_deadline(context, request.max_runtime_sec)
    return request


def _enforce_deadline(context: OpExecutionContext, max_runtime_sec: int | None) -> None:
    """Run monitoring's limit counts from run start, the job's deadline from submission: now that the run
    has started, its limit is set to end at the deadline (plus the grace), however long it was queued."""
    deadline = job_deadline(context, max_runtime_sec)
    if time.time() >= deadline:
        raise dg.Failure(
            "max_runtime_sec exceeded: the job's deadline "
            f"({datetime.fromtimestamp(deadline, UTC).isoformat()}) passed before this run started",
            allow_retries=False,
        )
    context.instance.add_run_tags(context.run_id, {MAX_RUNTIME_TAG: max_runtime_from(deadline, _run_start(context))})


def _launching_owner(context: OpExecutionContext, registry: Tenants | None, team: str | None) -> str:
    """Who owns a run launched outside the API: the team its config names, which must be a team of the
    tenants file; without one (the embedded single-user default) the operator."""
    if registry is None:
        if team is not None:
            context.log.info(f"{TEAM_FIELD} {team!r} is ignored: the deployment has no tenants file")
        return DAGSTER_OWNER
    if team is None:
        raise dg.Failure(
            f"{TEAM_FIELD}: name the team that owns this run (ops.validate_input.config.{TEAM_FIELD}): the deployment "
            "has a tenants file, and a run is checked against its team's data roots and quotas",
            allow_retries=False,
        )
    if team not in registry.teams:
        raise dg.Failure(f"{TEAM_FIELD}: no team {team!r} in the tenants file", allow_retries=False)
    return TEAM_OWNER_PREFIX + team


def _register_job(
    context: OpExecutionContext,
    job_store: JobStoreResource,
    job_storage: JobStorage,
    admission: AdmissionPolicy,
    request: StoredRequest,
    owner: str,
) -> str:
    """A run launched outside the API (the launchpad, a re-execution of one, `batch-pipeline run`) becomes
    a job of `owner` too, through the same submission path (its team's roots, priority cap and quotas), so
    the API lists it, reports its status and can cancel it. Later steps, and re-executions (which copy the
    run's tags, its launch signature among them), use the job id's work dir."""
    try:
        record, _ = submit(
            job_store.get_store(),
            job_storage.work_dir,
            owner,
            request,
            admission,
            idempotency_key=f"run:{context.run.root_run_id or context.run_id}",
            run_id=context.run_id,
        )
    except QuotaExceeded as exc:
        raise dg.Failure(str(exc), allow_retries=False) from None
    tags = run_tags(record, admission.priority_cap(record.owner)) | launch_tags(context.instance, record)
    context.instance.add_run_tags(context.run_id, tags)
    context.log.info(f"registered as job {record.job_id} of {record.owner}")
    return record.job_id


def _hold_planned_tokens(store: QuotaStore, record: JobRecord | None, admission: AdmissionPolicy, tokens: int) -> None:
    """The job's tokens reserved as its plan reads them, held to its team's max_tokens_per_day as its
    submission was: its input file, reserved by its size at submission, may hold far more by now (or a
    growing file each of many jobs), and it is stopped before it generates past the team's day."""
    team = admission.team_of_owner(record.owner) if record is not None else None
    limit = team.config.max_tokens_per_day if team is not None else None
    if record is None or limit is None:
        return
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if (others := store.hold_planned_tokens(record.job_id, record.owner, tokens, limit, midnight)) is not None:
        raise dg.Failure(
            f"max_tokens_per_day: the team's other jobs hold {others.held}/{limit} tokens of today (UTC) already, "
            f"and this job's input holds ~{tokens}: it stops before generating; resume it after 00:00 UTC",
            allow_retries=False,
        )


@dg.op(
    out={"shards": dg.DynamicOut(ShardTask), "plan": dg.Out(PlanSummary)},
    description="Stream the prompts into shard inputs balanced by estimated tokens: `data_parallelism` of them, "
    "or fewer where the deployment cannot run them at once or the work is too small to pay for their engines.",
)
def plan_shards(
    context: OpExecutionContext,
    request: StoredRequest,
    job_storage: JobStorage,
    job_store: JobStoreResource,
    shard_launcher: ShardLauncher,
    shard_planning: ShardPlanning,
    admission: AdmissionPolicyParam,
):
    job_id = current_job_id(context)
    work_dir = job_storage.work_dir(job_id)
    store = job_store.get_store()
    record = store.get(job_id)
    # Every later run of the job (a retry, a resume) writes the shards its first run planned, whatever the
    # settings say now: each checkpointed result lies in the shard that plan put its request in.
    kept = RecordedPlan.from_json(record.shard_plan) if record is not None and record.shard_plan else None
    settings = shard_planning.for_launcher(shard_launcher.shard_slots())
    model_config = admission.shard_model_config(request.model_cfg)
    hardware = _HARDWARE.validate_python(
        request.model_dump(mode="json", include=set(HARDWARE_FIELDS), exclude_none=True)
    )
    machine = _shard_machine(shard_launcher, hardware)
    cache = _job_cache(context, shard_planning, record, request, model_config, admission, job_store, machine)
    hits = None
    if cache.identity is not None and record is not None:
        hits = functools.partial(
            with_cache_hits, identity=cache.identity, lookup=lookup_in(job_store.result_cache(), record.owner)
        )
    try:
        kinds = KindsRead()
        items = kinds.passed(work_items(_records(request, job_data_files(context, job_store, job_storage, admission))))
        # Outputs their tokens do not bound (embeddings) held to the team's max_stored_bytes as they are read.
        team_of_job = admission.team_of_owner(record.owner) if record is not None else None
        items = bounded_output(items, store, record, team_of_job, model_config.model)
        tool_loop = request.tool_config is not None
        written = write_job_shards(
            items, work_dir, kept, request.data_parallelism or 1, settings, tool_loop, cache_hits=hits
        )
    except (RecordError, io.InputFileError) as exc:
        raise dg.Failure(str(exc)) from None
    except io.SymlinkRefused as exc:
        message = f"input_data_path: cannot read {request.input_data_path}: {exc}"
        raise dg.Failure(message, allow_retries=False) from None
    except QuotaExceeded as exc:  # nothing frees room by retrying
        raise dg.Failure(str(exc), allow_retries=False) from None
    if not written.shards:
        raise dg.Failure("the request holds no prompts: nothing to generate")
    if record is not None:
        # What the merge keeps this job's results under: the plan's identity, the same in every run of it.
        record_planned_identity(work_dir, cache.identity)
    _hold_planned_tokens(job_store.quotas(), record, admission, written.estimated_tokens)
    progress = job_store.progress()
    progress.record_shards(
        job_id,
        {shard.shard_index: shard.item_count for shard in written.shards},
        {shard.shard_index: checkpoint_bytes(shard.directory) for shard in written.shards},
        shard_plan=written.recorded.to_json(),
        request_kind=kinds.kind,
    )
    if written.input_changes is not None:
        context.log.warning(written.input_changes)
    if written.cached:
        shards = written.shards
        progress.record_cached(
            job_id,
            written.cached,
            sum(shard.cached_prompt_tokens for shard in shards),
            sum(shard.cached_completion_tokens for shard in shards),
        )
        context.log.info(f"{written.cached} requests answered from the team's result cache: not generated again")
    _count_kept(context, store, progress, job_id, work_dir)
    deadline = job_deadline(context, request.max_runtime_sec)
    context.log.info(written.describe(work_dir))
    yield dg.Output(PlanSummary(plan=written.recorded.plan, deduplicated=written.copies), "plan")
    # The job's team as the job store holds it, which a launcher may queue the shards by: not the request's word.
    team = owner_team(record.owner) if record is not None else None
    for shard in written.shards:
        task = ShardTask(
            shard=shard,
            model_config=model_config,
            shard_count=len(written.shards),
            deadline=deadline,
            job_id=job_id,
            owner_team=team,
            hardware=hardware,
            labels=request.labels,
            tool_config=request.tool_config,
            share_generations=written.recorded.deduplicate,
        )
        yield dg.DynamicOutput(task, output_name="shards", mapping_key=f"shard_{shard.shard_index:03d}")


def _shard_machine(shard_launcher: ShardLauncher, hardware: ShardHardware) -> str:
    """Where the job's shards compute, for its result cache's key: the launcher, its pods' image, the hardware."""
    return shard_machine(shard_launcher.kind.name, shard_launcher.worker_image(), hardware)


def _job_cache(
    context: OpExecutionContext,
    shard_planning: ShardPlanning,
    record: JobRecord | None,
    request: StoredRequest,
    model_config: BatchCompletionsModelConfig,
    admission: AdmissionPolicy,
    job_store: JobStoreResource,
    machine: str,
) -> JobCache:
    """The job's part in its team's result cache; none where it has no job record (a test's
    `execute_request`), and none, said in the run's log, where the cache cannot be read."""
    if record is None:
        return JobCache(None, "the run has no job")
    try:
        cache = job_cache(
            shard_planning.result_cache,
            record.owner,
            request.cache,
            request.tool_config is not None,
            model_config,
            admission,
            job_store.result_cache(),
            machine,
        )
    except Exception as exc:  # the cache never fails a job: it is generated whole instead
        context.log.warning(f"result cache: not used for this job: {exc}")
        return JobCache(None, str(exc))
    if cache.identity is None:
        context.log.info(f"result cache: not used for this job: {cache.reason}")
    return cache


def _keep_in_cache(
    context: OpExecutionContext,
    request: StoredRequest,
    shard_results: list[ShardResult],
    job_store: JobStoreResource,
    job_storage: JobStorage,
    shard_planning: ShardPlanning,
    admission: AdmissionPolicy,
    shard_launcher: ShardLauncher,
) -> None:
    """The completed job's deterministic results, kept in its team's cache for its next jobs: under the
    identity every run of it planned under, and only while that is still the model's (its files unchanged
    since, so that the results of the weights its shards loaded are never kept as a newer one's)."""
    job_id = current_job_id(context)
    record = job_store.get_store().get(job_id)
    model_config = admission.shard_model_config(request.model_cfg)
    hardware = shard_results[0].task.hardware if shard_results else ShardHardware()
    machine = _shard_machine(shard_launcher, hardware)
    cache = _job_cache(context, shard_planning, record, request, model_config, admission, job_store, machine)
    if cache.identity is None or record is None:
        return
    planned = planned_identity(job_storage.work_dir(job_id))
    if planned != cache.identity:
        context.log.warning(
            "result cache: this job's results were not kept: the model's files or the engine changed since its "
            "plan (or between its runs)"
        )
        return
    specs = sorted((result.task.shard for result in shard_results), key=lambda spec: spec.shard_index)
    try:
        # What the team's max_stored_bytes leaves: the cache never takes a team past its quota.
        stored = stored_bytes_of(job_store.get_store(), record.owner, admission.team_of_owner(record.owner))
        added = keep_results(
            job_store.result_cache(),
            cache.identity,
            job_id,
            [spec.directory for spec in specs],
            job_storage.result_cache_dir(),
            max_bytes=stored.room if stored is not None else None,
        )
    except Exception as exc:  # nothing kept: the next job generates these again
        context.log.warning(f"result cache: this job's results were not kept: {exc}")
        return
    context.log.info(f"result cache: {added} of this job's results kept for the team's next jobs")


def _count_kept(
    context: OpExecutionContext, store: JobStore, progress: ShardProgressStore, job_id: str, work_dir: str
) -> None:
    """A resumed job's first run counts what the checkpoints already hold, before any shard runs: those
    requests are kept, never generated again (the same plan puts each request in the same shard, whose
    worker skips what its checkpoint holds). A retry of that run finds the count made and keeps it."""
    record = store.get(job_id)
    if record is None or not record.resume_count or record.requests_kept is not None:
        return
    kept = checkpointed(work_dir)
    if progress.record_kept(job_id, kept.requests, kept.prompt_tokens, kept.completion_tokens):
        context.log.info(
            f"resumed from {record.resumed_from} (run {record.resumed_from_run_id}): {kept.requests} requests "
            f"({kept.completion_tokens} completion tokens) kept from the checkpoints; only the rest are generated"
        )


def _records(request: StoredRequest, files: DataFiles) -> Iterator[tuple[str, Any]]:
    """(where the record is, the record) of each record of the request, raw, as a file would hold it."""
    if request.content_path is not None:  # content sent inline, written at submission
        return (
            (f"content.{position}", record)
            for position, (_, record) in enumerate(io.iter_json_records(request.content_path))
        )
    if request.input_data_path is not None:
        return io.iter_json_records(request.input_data_path, files.open)
    content = request.model_dump(mode="json", by_alias=True, include={"content"})["content"]
    if isinstance(content, dict):
        return iter([("content", content)])
    return ((f"content.{position}", record) for position, record in enumerate(content))


@dg.op(
    tags={SHARD_STEP_TAG: "shard"},
    retry_policy=dg.RetryPolicy(max_retries=2, delay=2),
    description="Run the shard worker (vLLM) on one shard; a retry resumes from its checkpoint.",
)
def run_shard(
    context: OpExecutionContext, task: ShardTask, shard_launcher: ShardLauncher, job_store: JobStoreResource
) -> ShardResult:
    store = job_store.progress()

    def record_progress(figures: dict[str, int]) -> None:
        store.record_shard_progress(task.job_id, task.shard.shard_index, figures)

    # What the launcher gives the worker, not what the request declared, is what fair share and usage charge.
    store.record_shard_charge(task.job_id, task.shard.shard_index, shard_launcher.shard_charge(task))
    try:
        result = shard_launcher.run_shard(context, task, on_progress=record_progress)
    finally:  # however the attempt ended (failed, stopped): its checkpoint is stored until retention deletes it
        _record_checkpoint_bytes(context, store, task)
    stats = result.stats
    if stats.engine_pooled:
        store.record_shard_engine(task.job_id, task.shard.shard_index, stats.engine_warm, stats.engine_start_saved_s)
    record_progress(
        {
            "requests_done": stats.items,
            "errors": stats.errors,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
        }
    )
    context.add_output_metadata(
        {
            "requests": stats.items,
            "errors": stats.errors,
            "completion_tokens": stats.completion_tokens,
            "engine_start_s": stats.engine_start_s,
            "imported_ahead_s": stats.imported_ahead_s,
            "generate_s": stats.generate_s,
            "resumed": stats.resumed,
            "engine_warm": stats.engine_warm,
        }
    )
    return result


def _record_checkpoint_bytes(context: OpExecutionContext, store: ShardProgressStore, task: ShardTask) -> None:
    """What the shard's checkpoint holds now, counted in its team's stored bytes."""
    try:
        store.record_checkpoint_bytes(task.job_id, task.shard.shard_index, checkpoint_bytes(task.shard.directory))
    except Exception as exc:  # a figure never fails a shard, nor hides why it failed
        context.log.warning(f"could not measure shard {task.shard.shard_index}'s checkpoint: {exc}")


@dg.op(description="Merge the shard outputs in input order into one JSON array at output_data_path.")
def merge_outputs(
    context: OpExecutionContext,
    request: StoredRequest,
    shard_results: list[ShardResult],
    job_store: JobStoreResource,
    job_storage: JobStorage,
    shard_planning: ShardPlanning,
    shard_launcher: ShardLauncher,
    admission: AdmissionPolicyParam,
) -> MergedOutput:
    specs = sorted((result.task.shard for result in shard_results), key=lambda spec: spec.shard_index)
    expected = sum(spec.item_count for spec in specs)
    output_path = request.output_data_path
    started = time.monotonic()
    try:
        with job_data_files(context, job_store, job_storage, admission).atomic_write(output_path) as output:
            written = write_output_array(output, merge_sorted_outputs([spec.output_path for spec in specs]), expected)
    except MissingResult as exc:
        raise dg.Failure(f"shard outputs are incomplete: {exc}") from None
    except OSError as exc:
        raise dg.Failure(f"output_data_path: cannot write {output_path}: {exc}") from None
    merge_s = round(time.monotonic() - started, 3)
    _keep_in_cache(context, request, shard_results, job_store, job_storage, shard_planning, admission, shard_launcher)
    context.add_output_metadata({"output_data_path": output_path, "results": written, "merge_s": merge_s})
    return MergedOutput(output_data_path=output_path, results=written, merge_s=merge_s)


@dg.op(
    description="For a job that is an OpenAI batch: its output and error files (JSONL by custom_id), from "
    "the merged output. Other jobs have nothing to do here."
)
def write_batch_files(
    context: OpExecutionContext, merged: MergedOutput, job_store: JobStoreResource, job_storage: JobStorage
) -> dict:
    job_id = current_job_id(context)
    results = finalize_batch(
        job_store.get_store(), job_id, merged.output_data_path, job_storage.work_dir(job_id), job_storage.files_dir()
    )
    if results is None:
        return {}
    summary = {
        "completed": results.completed,
        "failed": results.failed,
        "output_file_id": results.output_file.file_id if results.output_file else None,
        "error_file_id": results.error_file.file_id if results.error_file else None,
    }
    context.add_output_metadata(summary)
    return summary


@dg.op(description="Write the job's counts, tokens and timings beside the output, and as run metadata.")
def write_job_metadata(
    context: OpExecutionContext,
    request: StoredRequest,
    merged: MergedOutput,
    shard_results: list[ShardResult],
    plan: PlanSummary,
    job_store: JobStoreResource,
    job_storage: JobStorage,
    admission: AdmissionPolicyParam,
) -> JobMetadata:
    store = job_store.get_store()
    record = store.get(current_job_id(context))
    metadata = _finished_metadata(context, request, merged, shard_results, plan, record)
    if record is not None:
        metadata = metadata.with_resume(record, metadata.num_requests, metadata.completion_tokens)
    files = job_data_files(context, job_store, job_storage, admission)
    write_metadata(files, metadata_path(merged.output_data_path), metadata)
    shards = dg.MetadataValue.json([entry.model_dump() for entry in metadata.shards or []])
    context.add_output_metadata(metadata.fields() | {"shards": shards})
    # The job reads completed when Dagster records the run's success (`record_run_end`), not before.
    job_store.progress().record_results(metadata.job_id, context.run_id, _row_results(metadata))
    context.log_event(_outputs_materialization(metadata, merged.output_data_path))
    return metadata


def _finished_metadata(
    context: OpExecutionContext,
    request: StoredRequest,
    merged: MergedOutput,
    shard_results: list[ShardResult],
    plan: PlanSummary,
    record: JobRecord | None,
) -> JobMetadata:
    """A completed run's metadata file: its totals, timings, how it was split and each shard's entry."""
    shard_results = sorted(shard_results, key=lambda result: result.stats.shard_index)
    stats = [result.stats for result in shard_results]
    wall_s = round(time.time() - _run_start(context), 3)
    completion_tokens = sum(s.completion_tokens for s in stats)
    # A resumed shard's tokens include those its checkpoint kept, which this attempt did not generate, and a
    # shard's those of its requests the result cache answered.
    generated = [r for r in shard_results if r.stats.resumed == 0 and r.stats.generate_s > 0]
    generate_s = sum(r.stats.generate_s for r in generated)
    generated_tokens = sum(r.stats.completion_tokens - r.task.shard.cached_completion_tokens for r in generated)
    generation_rate = round(generated_tokens / generate_s, 2) if generated else None
    read_tokens = sum(r.stats.prompt_tokens - r.task.shard.cached_prompt_tokens for r in generated)
    cached = record.cached_requests if record is not None else None
    return JobMetadata(
        job_id=current_job_id(context),
        dagster_run_id=context.run_id,
        model=request.model_cfg.model,
        output_data_path=merged.output_data_path,
        num_requests=merged.results,
        num_errors=sum(s.errors for s in stats),
        prompt_tokens=sum(s.prompt_tokens for s in stats),
        completion_tokens=completion_tokens,
        wall_s=wall_s,
        completion_tokens_per_s=generation_rate,
        completion_tokens_per_wall_s=round(completion_tokens / wall_s, 2) if wall_s > 0 else None,
        engine_start_s=max((s.engine_start_s for s in stats if s.generate_s > 0), default=None),
        prompt_tokens_per_s=round(read_tokens / generate_s, 2) if generated else None,
        merge_s=merged.merge_s,
        finished_at=datetime.now(UTC),
        data_parallelism=DataParallelism(requested=plan.plan.requested, used=plan.plan.used, reason=plan.plan.reason),
        num_deduplicated=plan.deduplicated,
        num_cut_from_longer=sum(s.cut_from_longer for s in stats),
        num_cached=cached or 0,
        cached_prompt_tokens=(record.cached_prompt_tokens or 0) if record is not None else 0,
        cached_completion_tokens=(record.cached_completion_tokens or 0) if record is not None else 0,
        dtype=", ".join(sorted({s.dtype for s in stats if s.dtype})) or None,
        tool_config=next((s.tool_config for s in stats if s.tool_config), None),
        shards=[ShardEntry.model_validate(result.metadata_entry()) for result in shard_results],
    )


def _row_results(metadata: JobMetadata) -> JobResults:
    """The figures the job's row keeps of a completed run: it did every request it planned."""
    return JobResults(
        num_requests=metadata.num_requests,
        num_errors=metadata.num_errors,
        prompt_tokens=metadata.prompt_tokens,
        completion_tokens=metadata.completion_tokens,
        completion_tokens_per_s=metadata.completion_tokens_per_s,
        wall_s=metadata.wall_s,
        merge_s=metadata.merge_s,
        requests_total=metadata.num_requests,
        requests_done=metadata.num_requests,
        errors=metadata.num_errors,
        completion_tokens_per_wall_s=metadata.completion_tokens_per_wall_s,
        engine_start_s=metadata.engine_start_s,
        prompt_tokens_per_s=metadata.prompt_tokens_per_s,
    )


def _outputs_materialization(metadata: JobMetadata, output_data_path: str) -> dg.AssetMaterialization:
    """The job's outputs as the asset's partition: its summary, and where they are."""
    summary = metadata.model_dump(
        include={
            "job_id",
            "model",
            "num_requests",
            "num_errors",
            "completion_tokens",
            "completion_tokens_per_s",
            "completion_tokens_per_wall_s",
            "wall_s",
        }
    )
    return dg.AssetMaterialization(
        asset_key=OUTPUTS_ASSET,
        partition=metadata.job_id,
        description=f"outputs of job {metadata.job_id}",
        metadata=summary | {"output_data_path": dg.MetadataValue.path(output_data_path)},
    )


def _run_start(context: OpExecutionContext) -> float:
    record = context.instance.get_run_record_by_id(context.run_id)
    return (record.start_time if record and record.start_time else None) or time.time()


@dg.job(
    description="One batch completions request: its prompts through vLLM, sharded, merged in input order.",
    logger_defs={"console": console_logger},
    config=launchpad_template(deployment_settings()),  # what the launchpad opens with; every launched run gives its own
)
def batch_completions():
    request = validate_input()
    shards, plan = plan_shards(request)
    shard_results = shards.map(run_shard).collect()
    merged = merge_outputs(request, shard_results)
    write_batch_files(merged)
    write_job_metadata(request, merged, shard_results, plan)
