"""Everything Dagster loads: `dagster dev -m batch_pipeline.pipeline.definitions`."""

from __future__ import annotations

import os
import warnings

import dagster as dg

from batch_pipeline.admission.hardware import configured_hardware_maxima
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract.requests import MAX_DATA_PARALLELISM
from batch_pipeline.core.environment import worker_settings
from batch_pipeline.core.settings import settings
from batch_pipeline.launch.base import ShardLauncher
from batch_pipeline.launch.local import LocalShardLauncher
from batch_pipeline.pipeline import step_server
from batch_pipeline.pipeline.cleanup import cleanup, cleanup_schedule
from batch_pipeline.pipeline.job import OUTPUTS_ASSET_SPEC, SHARD_STEP_TAG, batch_completions
from batch_pipeline.pipeline.partial_results import keep_partial_results
from batch_pipeline.pipeline.resources import (
    JobStorage,
    JobStoreResource,
    RunLaunching,
    ShardPlanning,
    Tenancy,
    deployment_resource,
)
from batch_pipeline.pipeline.schedules import schedules_in
from batch_pipeline.pipeline.sensors import batch_jobs_sensor, run_end_sensors
from batch_pipeline.pipeline.service_paths import secure_service_paths
from batch_pipeline.tenancy.tenants import tenants_at

# Dagster's own uses of its beta and preview features, warned about in every step process: it copies each
# sensor with the sensor's (empty) owners when it binds the resources, and every Pipes session reads its
# message reader's `expected_writer_count`. Not ours to act on; our console shows the run's own lines.
warnings.filterwarnings("ignore", message="Parameter `owners`", category=dg.BetaWarning)
warnings.filterwarnings(
    "ignore", message="Function `PipesMessageReader.expected_writer_count`", category=dg.PreviewWarning
)


def shard_launcher_from_environment() -> ShardLauncher:
    """Local subprocesses unless BATCH_PIPELINE_SHARD_LAUNCHER=k8s: then a pod per shard, from
    BATCH_PIPELINE_WORKER_IMAGE, BATCH_PIPELINE_K8S_NAMESPACE, BATCH_PIPELINE_K8S_SERVICE_ACCOUNT, and
    outside the cluster BATCH_PIPELINE_KUBECONFIG."""
    configured = settings()
    if configured.shard_launcher != "k8s":
        return LocalShardLauncher(
            concurrency=configured.local_shard_concurrency,
            engine_pool_dir=configured.engine_pool_dir,
            engine_pool_workers=configured.engine_pool_workers,
            engine_pool_idle_s=configured.engine_pool_idle_s,
            engine_pool_memory_mib=configured.engine_pool_memory_mib,
        )
    from batch_pipeline.launch.k8s import K8sShardLauncher

    return K8sShardLauncher(
        image=configured.worker_image,
        namespace=configured.k8s_namespace,
        service_account_name=configured.k8s_service_account or None,
        kubeconfig_file=configured.kubeconfig or None,
        poll_interval_s=configured.k8s_poll_interval_s,
        max_hardware={field: str(bound) for field, bound in configured_hardware_maxima(configured).items()},
        default_cpus=configured.k8s_default_cpus,
        default_memory=configured.k8s_default_memory,
        tenants_file=configured.tenants,
        # a pod gets none of this process's environment: only the worker's own settings, by name
        env=worker_settings(os.environ),
    )


# Read before anything is built from them: a mistyped variable stops the code location from loading, naming it.
_loaded_with = settings()
_shard_launcher = shard_launcher_from_environment()
# The same for the tenants file; and the instance's files are made private before a run writes any.
secure_service_paths(_loaded_with)


def executor_config(launcher: ShardLauncher, max_shards_per_job: int | None = None) -> dict[str, object]:
    """The multiprocess executor's config for a job whose shards `launcher` runs.

    Step processes fork from a server that has imported this module and the instance's storage once per
    run (step_server), instead of each being a fresh Python that imports them again: ~2.3 s -> ~0.2 s per
    step, five or more steps a job (2 cores). The server starts with a process's first step and keeps that
    environment: a process running several jobs under different variables (the tests) stops it between them.

    A shard step only waits on its worker. Local workers share this machine: as many at once as the
    launcher runs. Pods do not (the cluster and Kueue decide when they run): every shard of the largest job
    (`max_shards_per_job`, else the largest data_parallelism) waits at once, where the executor's default
    would hold them to the run worker's core count.
    """
    slots = launcher.shard_slots()
    preload = [*step_server.PRELOAD_MODULES, *launcher.step_modules()]
    config: dict[str, object] = {"start_method": {"forkserver": {"preload_modules": preload}}}
    if slots is None:
        largest = min(max_shards_per_job or MAX_DATA_PARALLELISM, MAX_DATA_PARALLELISM)
        return config | {"max_concurrent": largest + 1}  # the shards and one other step
    # max_concurrent too: the executor's default, the core count, would cap a concurrency set above it
    return config | {
        "max_concurrent": slots + 1,
        "tag_concurrency_limits": [{"key": SHARD_STEP_TAG, "value": "shard", "limit": slots}],
    }


# The job store the runs record in; a run executed in a process of its own records how it ended there too.
job_store = JobStoreResource(url=_loaded_with.job_store_url)

local_executor = dg.multiprocess_executor.configured(
    executor_config(_shard_launcher, _loaded_with.max_shards_per_job), name="local_executor"
)

defs = dg.Definitions(
    assets=[OUTPUTS_ASSET_SPEC],
    jobs=[batch_completions, keep_partial_results, cleanup],
    sensors=[
        batch_jobs_sensor(_loaded_with.sensor_interval_s),
        *run_end_sensors(_loaded_with.sensor_interval_s),
    ],
    schedules=[*schedules_in(_loaded_with.schedules, tenants_at(_loaded_with.tenants)), cleanup_schedule],
    # Deployment settings, not run config: no run may point a job at another store, work dir or worker.
    resources={
        "job_store": deployment_resource(job_store),
        "admission": deployment_resource(AdmissionPolicy.of_deployment(_loaded_with)),
        "shard_launcher": deployment_resource(_shard_launcher),
        "job_storage": deployment_resource(
            JobStorage(work_dir_base=_loaded_with.work_dir_base, retention_days=_loaded_with.retention_days)
        ),
        "tenancy": deployment_resource(Tenancy.of_deployment(_loaded_with)),
        "run_launching": deployment_resource(RunLaunching.of_deployment(_loaded_with)),
        "shard_planning": deployment_resource(
            ShardPlanning(
                max_shards_per_job=_loaded_with.max_shards_per_job,
                min_shard_tokens=_loaded_with.min_shard_tokens,
                deduplicate=_loaded_with.deduplicate,
                result_cache=_loaded_with.result_cache,
            )
        ),
    },
    executor=local_executor,
)


def batch_completions_job() -> dg.JobDefinition:
    """The job with its resources bound, reconstructable in step processes (see `execute_request`)."""
    return defs.get_job_def("batch_completions")
