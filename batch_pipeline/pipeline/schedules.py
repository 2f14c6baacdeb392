"""Recurring batches, declared in a YAML file (`BATCH_PIPELINE_SCHEDULES`; see examples/schedules.yaml).

Each tick makes a job through the same submission path as the API (so the API lists it, reports it and
can cancel it). The job's idempotency key is the tick, so a tick evaluated twice (a daemon restarted
mid-tick) makes one job and one run. An invalid file fails the code location's load, naming the file, the
line and the field.

Where the deployment has teams (a tenants file), each schedule names its `team`: every tick's job is that
team's, checked against its data roots, priority cap and quotas as the team's API submission is, and the
jobs sensor launches it when fair share gives the team a run slot; a tick refused says why in its skip
reason. Without a tenants file the tick's job is the schedule's own (owner `schedule:NAME`), and the tick
launches its run.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import dagster as dg
import yaml
from pydantic import Field, ValidationError, field_validator

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import QuotaExceeded, UnservableRequest, submit
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.priority import InvalidPriority
from batch_pipeline.pipeline.job import batch_completions
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource
from batch_pipeline.pipeline.runs import launch_key
from batch_pipeline.pipeline.sensors import run_request_for
from batch_pipeline.pipeline.tags import SCHEDULE_OWNER_PREFIX
from batch_pipeline.tenancy.tenants import Team, Tenants

SCHEDULE_LABEL = "schedule"
# Placeholders a template's paths may use, filled from the tick's time in the schedule's timezone.
PLACEHOLDERS = {
    "date": "%Y-%m-%d",
    "time": "%H%M",
    "datetime": "%Y-%m-%dT%H%M",
    "year": "%Y",
    "month": "%m",
    "day": "%d",
    "hour": "%H",
}
TEMPLATED_FIELDS = ("input_data_path", "output_data_path")
# `{data_root}`: where the tick's job may read and write, so that one template serves any deployment.
DATA_ROOT = "data_root"
RESERVED_NAMES = frozenset({"cleanup"})  # retention's schedule (pipeline/cleanup.py)


class ScheduleFileError(ValueError):
    pass


class TemplateError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ScheduleSpec(WireModel):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=100)
    cron: str
    timezone: str = "UTC"
    status: Literal["running", "stopped"] = "stopped"
    description: str | None = None
    # The team that owns every tick's job: required where the deployment has a tenants file.
    team: str | None = None
    request: dict[str, Any]

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {value!r}") from None
        return value

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        from dagster._utils.schedules import is_valid_cron_string  # Dagster's own check, as its definitions use

        if not is_valid_cron_string(value):
            raise ValueError(f"not a valid cron string: {value!r}")
        return value

    def request_at(self, tick: datetime, data_root: str = "/data-root") -> CreateBatchCompletionsV2Request:
        """The request of one tick: the template's paths filled in (`data_root`: see `data_root_of`), its
        labels naming the schedule."""
        local = tick.astimezone(ZoneInfo(self.timezone))
        values = {key: local.strftime(pattern) for key, pattern in PLACEHOLDERS.items()}
        values |= {"name": self.name, DATA_ROOT: data_root.rstrip("/")}
        body = dict(self.request)
        for field in TEMPLATED_FIELDS:
            if isinstance(body.get(field), str):
                body[field] = _fill(body[field], values, field)
        body["labels"] = {**(body.get("labels") or {}), SCHEDULE_LABEL: self.name}
        return CreateBatchCompletionsV2Request.model_validate(body)


def data_root_of(admission: AdmissionPolicy, team: Team | None) -> str:
    """What `{data_root}` stands for: the team's first data root (as the tenants file writes it), else the
    deployment's first (BATCH_PIPELINE_DATA_ROOTS), else the code location's working directory."""
    if team is not None and team.config.data_roots:
        return team.config.data_roots[0]
    return str(admission.paths.roots[0]) if admission.paths.roots else os.getcwd()


def _fill(template: str, values: dict[str, str], field: str) -> str:
    unknown = sorted(set(re.findall(r"{(\w*)}", template)) - set(values))
    if unknown:
        raise TemplateError(field, f"unknown placeholder {{{unknown[0]}}}; known: {', '.join(sorted(values))}")
    return template.format_map(values)


def load_schedule_specs(path: str, teams: Tenants | None = None) -> list[ScheduleSpec]:
    """The schedules of the file at `path`; `teams`: the deployment's tenants file, whose team each schedule
    must name (None: no tenants file, and `team` is not checked)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        root = yaml.compose(text)
        document = yaml.safe_load(text)
    except OSError as exc:
        raise ScheduleFileError(f"{path}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ScheduleFileError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(document, dict) or not isinstance(document.get("schedules"), list):
        raise ScheduleFileError(f"{path}:1: expected a mapping with a list under `schedules`")
    specs, names = [], set()
    entries = _child(root, "schedules")
    for position, raw in enumerate(document["schedules"]):
        entry_node = entries.value[position]
        label = f"schedules.{position}"
        try:
            spec = ScheduleSpec.model_validate(raw)
            spec.request_at(datetime(2000, 1, 1, tzinfo=UTC))  # the template makes a valid request
        except ValidationError as exc:
            error = exc.errors()[0]
            location = [str(part) for part in error["loc"]]
            if exc.title == CreateBatchCompletionsV2Request.__name__:
                location = ["request", *location]
            line = _line(entry_node, location)
            raise ScheduleFileError(f"{path}:{line}: {label}.{'.'.join(location)}: {error['msg']}") from None
        except TemplateError as exc:
            line = _line(entry_node, ["request", exc.field])
            raise ScheduleFileError(f"{path}:{line}: {label}.request.{exc}") from None
        if spec.name in names:
            raise ScheduleFileError(f"{path}:{_line(entry_node, ['name'])}: {label}.name: {spec.name!r} is used twice")
        if spec.name in RESERVED_NAMES:
            raise ScheduleFileError(
                f"{path}:{_line(entry_node, ['name'])}: {label}.name: {spec.name!r} is the service's own schedule"
            )
        if teams is not None and spec.team is None:
            raise ScheduleFileError(
                f"{path}:{_line(entry_node, ['name'])}: {label}.team: name the team whose jobs the schedule makes "
                f"(the deployment has a tenants file, {teams.source})"
            )
        if teams is not None and spec.team not in teams.teams:
            raise ScheduleFileError(
                f"{path}:{_line(entry_node, ['team'])}: {label}.team: no team {spec.team!r} in the tenants file "
                f"{teams.source}"
            )
        names.add(spec.name)
        specs.append(spec)
    return specs


def _child(node: Any, key: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == key:
                return value_node
    return None


def _line(node: Any, location: list[str]) -> int:
    """The line of the deepest node of `location` that the file has (1-based)."""
    for part in location:
        if isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            child = node.value[int(part)]
        else:
            child = _child(node, part)
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def schedule_for(spec: ScheduleSpec) -> dg.ScheduleDefinition:
    @dg.schedule(
        name=spec.name,
        cron_schedule=spec.cron,
        execution_timezone=spec.timezone,
        job=batch_completions,
        description=spec.description or f"a batch job from the template {spec.name} of the schedules file",
        default_status=dg.DefaultScheduleStatus.RUNNING
        if spec.status == "running"
        else dg.DefaultScheduleStatus.STOPPED,
    )
    def _tick(
        context: dg.ScheduleEvaluationContext,
        job_store: JobStoreResource,
        job_storage: JobStorage,
        admission: dg.ResourceParam[AdmissionPolicy],
    ):
        tick = context.scheduled_execution_time or datetime.now(UTC)
        at = tick.astimezone(UTC).isoformat()
        registry = admission.teams()
        team = None
        if registry is not None:
            team = registry.teams.get(spec.team) if spec.team is not None else None
            if team is None:  # the tenants file changed since the schedules loaded
                return dg.SkipReason(f"team: no team {spec.team!r} in the tenants file {registry.source}")
            owner, idempotency_key = team.owner, f"schedule:{spec.name}@{at}"
        else:
            owner, idempotency_key = SCHEDULE_OWNER_PREFIX + spec.name, f"{spec.name}@{at}"
        try:
            record, created = submit(
                job_store.get_store(),
                job_storage.work_dir,
                owner,
                spec.request_at(tick, data_root_of(admission, team)),
                admission,
                idempotency_key=idempotency_key,
            )
        except (UnservableRequest, InvalidPriority, QuotaExceeded) as exc:
            whose = f" of team {spec.team}" if registry is not None else ""
            return dg.SkipReason(f"the job{whose} for the tick at {tick.isoformat()} was refused: {exc}")
        context.log.info(f"{'stored' if created else 'found'} job {record.job_id} for the tick at {tick.isoformat()}")
        if registry is not None:
            # The team's job waits its turn with the team's other jobs: the jobs sensor launches it.
            return dg.SkipReason(
                f"job {record.job_id} of team {spec.team} stored; the jobs sensor launches it when fair share gives "
                "the team a run slot"
            )
        key = launch_key(context.instance)
        assert key is not None  # made if missing
        return run_request_for(record, admission.priority_cap(record.owner), key)

    return _tick


def schedules_in(path: str, teams: Tenants | None = None) -> list[dg.ScheduleDefinition]:
    """A schedule for each template of the schedules file at `path` (BATCH_PIPELINE_SCHEDULES); none for "".
    `teams`: the deployment's tenants file, whose team each schedule must name."""
    return [schedule_for(spec) for spec in load_schedule_specs(path, teams)] if path else []
