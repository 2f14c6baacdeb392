"""The resources every op of a job shares: the job store, where a job's work files live, the shard launcher,
the teams, how the jobs sensor launches; each fixed by the deployment (`deployment_resource`), never by a
run's config."""

from __future__ import annotations

import os

import dagster as dg
from pydantic import Field

from batch_pipeline.core import io
from batch_pipeline.core.settings import Settings
from batch_pipeline.shards.planning import PlanningSettings
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.quotas import QuotaStore
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.tenancy.tenants import Tenants, tenants_at


def deployment_resource(resource: object) -> dg.ResourceDefinition:
    """`resource` exactly as the deployment built it. A ConfigurableResource's fields are defaults that any
    run's config may override (`resources: {shard_launcher: {config: {env: ...}}}`): from the launchpad or
    GraphQL that set the worker's environment, its Python, the work dir and the job store. This definition
    takes no config at all, so Dagster refuses such a launch before any step runs, naming the field."""
    return dg.ResourceDefinition(
        resource_fn=lambda _: resource,
        config_schema={},
        description=f"{type(resource).__name__}: {type(resource).__doc__ or ''}".strip().split("\n")[0],
    )


class JobStorage(dg.ConfigurableResource):
    """Where a job's intermediate files (shard inputs, checkpoints, shard outputs) live.

    Every step and every shard worker of a job must see the same place: a local directory on one machine,
    an s3:// prefix when shards run in pods.
    """

    work_dir_base: str = Field(description="Base path or URL of job work dirs (`Settings.work_dir_base`).")
    retention_days: int = Field(
        default=30, ge=0, description="Days a finished job's work dir is kept (0: forever); a team's own wins."
    )

    def base(self) -> str:
        base = self.work_dir_base
        return os.path.abspath(base) if io.is_local(base) else base

    def work_dir(self, job_id: str) -> str:
        return io.join(self.base(), job_id)

    def files_dir(self) -> str:
        """Where the OpenAI Batch API's files are kept (uploads, batch outputs): beside the work dirs."""
        return io.join(self.base(), "files")

    def result_cache_dir(self) -> str:
        """Where the teams' result caches keep their payloads (`store/result_cache.py`): beside the work dirs."""
        return io.join(self.base(), "result_cache")


class JobStoreResource(dg.ConfigurableResource):
    """The API's job store, as the sensors and the ops see it: the same database through a store of each purpose."""

    url: str = Field(description="SQLAlchemy URL (a deployment's: `Settings.job_store_url`).")

    def get_store(self) -> JobStore:
        return JobStore(self.url)

    def progress(self) -> ShardProgressStore:
        return ShardProgressStore(self.url)

    def quotas(self) -> QuotaStore:
        return QuotaStore(self.url)

    def result_cache(self) -> ResultCacheStore:
        return ResultCacheStore(self.url)


class ShardPlanning(dg.ConfigurableResource):
    """How the deployment splits a job into shards: each shard starts an engine, so no more shards than it
    runs at once and none too small to pay for its engine."""

    max_shards_per_job: int | None = Field(
        description="At most this many shards a job (None: what the launcher runs at once)."
    )
    min_shard_tokens: int = Field(
        ge=0, description="Estimated tokens each shard of a split job carries at least (0: any)."
    )
    deduplicate: bool = Field(description="Repeats of a deterministic request within a job are generated once.")
    result_cache: bool = Field(
        default=True, description="Deterministic results are kept and reused across a team's jobs (issue 49)."
    )

    def for_launcher(self, slots: int | None) -> PlanningSettings:
        """The plan's settings with a launcher that runs `slots` shards at once (None: no limit)."""
        return PlanningSettings.of_deployment(self.max_shards_per_job, self.min_shard_tokens, self.deduplicate, slots)


class Tenancy(dg.ConfigurableResource):
    """The teams sharing the deployment, as the jobs sensor and the cleanup see them: the tenants file, read
    at use and again as it changes (an edit counts from the next tick), and how fast fair share forgets
    what a team used."""

    tenants_file: str = Field(description="The tenants file (BATCH_PIPELINE_TENANTS); empty = no teams.")
    fair_share_half_life_s: float = Field(
        gt=0, description="Seconds after which a team's use of run slots counts half (fair share)."
    )

    @classmethod
    def of_deployment(cls, configured: Settings) -> Tenancy:
        return cls(tenants_file=configured.tenants, fair_share_half_life_s=configured.fair_share_half_life_s)

    def registry(self) -> Tenants | None:
        return tenants_at(self.tenants_file)


class RunLaunching(dg.ConfigurableResource):
    """How the jobs sensor turns stored jobs into runs. One tick's run requests travel to the daemon as one
    gRPC message, capped by Dagster at 100 MB; requests name their content by reference, so the bound holds
    back only rows an older release stored inline."""

    max_tick_bytes: int = Field(gt=0, description="Bytes of requests one tick launches at most (one job at least).")

    @classmethod
    def of_deployment(cls, configured: Settings) -> RunLaunching:
        return cls(max_tick_bytes=configured.sensor_max_tick_bytes)
