"""Every BATCH_PIPELINE_* environment variable, and DAGSTER_HOME, with its default and what it does.

`settings()` reads the environment when it is called, not when this module is imported, so a process (or a
test) that changes a variable is seen by the next call; each process calls it once as it starts, so that a
bad value fails the start naming the variable. The table of docs/operations/settings.md is printed from these fields:
`python -m batch_pipeline.core.settings`.

This module imports nothing else of ours, so that every layer (API, pipeline, launchers, worker, stores)
can read its settings here.
"""

from __future__ import annotations

import ipaddress
import os
import re
from decimal import Decimal
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "BATCH_PIPELINE_"
# Kubernetes' quantity grammar without a sign (apimachinery's resource.Quantity). parse_quantity alone
# would also take what the API server refuses: "NaN", " 8", "1_000", "16 Gi".
KUBERNETES_QUANTITY = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE])?")
# The variables read under their own names: Dagster's, which the service shares.
_UNPREFIXED = {"DAGSTER_HOME"}
# The one variable whose empty value is not "unset": no protocol at all.
_EMPTY_IS_A_VALUE = {"allowed_protocols"}


class SettingsError(ValueError):
    """A variable with a value this service cannot use; the message names it and says what is wrong."""


class _EnvironmentSettings(BaseSettings):
    # An alias per field rather than env_prefix: names stay case-sensitive, as os.environ.get read them
    # (with case_sensitive, env_prefix would look for BATCH_PIPELINE_sensor_interval_s).
    model_config = SettingsConfigDict(
        alias_generator=lambda name: ENV_PREFIX + name.upper(), case_sensitive=True, frozen=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        """A variable set to "" (or spaces) reads as unset, as `os.environ.get(...) or default` did."""
        if not isinstance(value, str):
            return value
        value = value.strip()
        if value or info.field_name in _EMPTY_IS_A_VALUE:
            return value
        return cls.model_fields[str(info.field_name)].get_default(call_default_factory=True)


class Settings(_EnvironmentSettings):
    """The service's settings: the API, the pipeline, the launchers and the shard worker."""

    # The API
    api_keys: str = Field(
        "", description="API keys, comma-separated; `KEY:admin` marks an admin key (no keys at all: the API is open)"
    )
    api_keys_file: str = Field("", description="A file of more API keys, one per line")
    tenants: str = Field(
        "",
        description="A YAML file of the teams sharing the deployment: each team's key digests and data roots, "
        "and the admins' (set: it replaces the two key variables above)",
    )
    host: str = Field(
        "127.0.0.1",
        description="`make serve`: the address the API listens on (the UI keeps to loopback)",
    )
    port: int = Field(8000, description="`make serve`: the API's port")
    max_body_bytes: int = Field(64 * 2**20, description="Largest request body, in bytes (64 MiB); larger ones get 413")
    max_concurrent_large_bodies: int = Field(
        1, ge=1, description="Bodies over 8 MB an API process parses at once; the others wait"
    )
    max_file_bytes: int = Field(
        200 * 2**20, description="Largest `POST /v1/files` upload, in bytes (200 MiB, OpenAI's)"
    )
    max_batch_requests: int = Field(
        100_000, description="Most requests in an OpenAI batch's input file (OpenAI's limit is 50,000)"
    )
    max_concurrent_batch_checks: int = Field(
        2,
        ge=1,
        description="OpenAI batch input files an API process checks at once (creating or dry-running); more get 429",
    )
    max_batch_checks_per_team: int | None = Field(
        None,
        ge=1,
        description="OpenAI batch input files one team may have checked at once; more get 429 "
        "(unset: half of `BATCH_PIPELINE_MAX_CONCURRENT_BATCH_CHECKS`, rounded up)",
    )
    max_concurrent_dry_runs: int = Field(2, ge=0, description="Dry runs an API process runs at once; more get 429")
    # What one team or one client may hold of an API process (no team can stop the others)
    max_dry_runs_per_team: int | None = Field(
        None,
        ge=1,
        description="Dry runs one team may run at once in an API process; more get 429 "
        "(unset: half of `BATCH_PIPELINE_MAX_CONCURRENT_DRY_RUNS`, rounded up)",
    )
    max_large_bodies_per_team: int = Field(
        4,
        ge=1,
        description="Bodies over 8 MB one team may have in an API process at once, arriving, waiting or parsing; "
        "more get 429. A team parses at most half of the large-body slots at once (rounded up), and a freed "
        "slot goes to the next team in turn",
    )
    header_timeout_s: float = Field(
        20.0,
        gt=0,
        description="Seconds a client has to send a request's line and headers, from connecting or from the last "
        "response; then the connection is closed (`serve` runs uvicorn with this bound; uvicorn has none)",
    )
    body_idle_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a request body may pause between chunks; then a 408 and the connection closed"
    )
    body_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a whole request body may take to arrive; then a 408 and the connection closed"
    )
    write_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a client may leave the server's writes unread (a response's chunk, up to 1 MiB, still "
        "buffered) before its connection is closed (`serve` runs uvicorn with this bound; uvicorn has none)",
    )
    max_bodies_per_team: int = Field(
        32,
        ge=1,
        description="Request bodies of any size one team may have arriving at once in an API process (an upload: "
        "until it is answered); more are read and dropped, never held, then get 429",
    )
    dry_run_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a dry run may take to read, render and tokenize its requests; then a 422"
    )
    dry_run_memory_mb: int = Field(
        2048, ge=64, description="Memory a dry run's checking process may add, in MiB (a chat template's strings too)"
    )
    model_catalog: str = Field("", description="A YAML file mapping an OpenAI batch's `model` names to model configs")
    # What a request may ask for
    allowed_protocols: str = Field(
        "file,s3",
        description="Protocols a request's paths may use, comma-separated (`file` also admits `local`; empty: none)",
    )
    data_roots: str = Field(
        "", description="Directories, `:`-separated, that local paths must lie inside (unset: any local path)"
    )
    allow_remote_code: bool = Field(
        False, description="`1` lets a request's `trust_remote_code` run a model's own Python in the worker"
    )
    max_gpus: int | None = Field(None, ge=0, description="Most GPUs a request may ask for (unset: no bound)")
    max_cpus: str | None = Field(
        None,
        description="Most CPUs a request may ask for, a Kubernetes quantity (`64`, `500m`; unset: no bound in a "
        "cluster, the machine's cores on one machine)",
    )
    max_memory: str | None = Field(
        None, description="Most memory a request may ask for, a Kubernetes quantity in bytes (`512Gi`; unset: no bound)"
    )
    max_storage: str | None = Field(
        None,
        description="Most ephemeral storage a request may ask for, a quantity as for memory (unset: no bound)",
    )
    # The engine arguments a request may set, each at most this (model_config's field of the same name):
    # what one shard's engine may allocate, and how long it may take to start.
    max_model_len: int = Field(
        131072, ge=1, description="Largest `model_config.max_model_len` (and `max_context_length`), in tokens"
    )
    max_num_seqs: int = Field(1024, ge=1, description="Largest `model_config.max_num_seqs`")
    max_num_batched_tokens: int = Field(131072, ge=1, description="Largest `model_config.max_num_batched_tokens`")
    max_seq_len_to_capture: int = Field(131072, ge=1, description="Largest `model_config.max_seq_len_to_capture`")
    max_block_size: int = Field(
        256, ge=1, description="Largest `model_config.block_size`, in tokens (a request's must be a power of two)"
    )
    # An override skips vLLM's own measure of what fits: 32768 blocks of 16 tokens is 512k tokens of cache.
    max_num_gpu_blocks_override: int = Field(
        32768, ge=1, description="Largest `model_config.num_gpu_blocks_override` (vLLM sizes the cache itself without)"
    )
    max_swap_space: float = Field(64.0, ge=0, description="Largest `model_config.swap_space`, in GiB per GPU")
    max_gpu_memory_utilization: float = Field(
        0.95, gt=0, le=1, description="Largest `model_config.gpu_memory_utilization` (a fraction of each GPU)"
    )
    max_tensor_parallel_size: int = Field(
        8,
        ge=1,
        description="Largest `model_config.tensor_parallel_size` (with `BATCH_PIPELINE_MAX_GPUS` set, the GPUs "
        "tensor x pipeline parallelism spans are bounded by it too)",
    )
    max_pipeline_parallel_size: int = Field(8, ge=1, description="Largest `model_config.pipeline_parallel_size`")
    # Where things are kept
    dagster_home: str = Field(
        "dagster_home",
        alias="DAGSTER_HOME",
        description="Dagster's instance directory (Dagster reads it too; relative: to the working directory): "
        "the default place of the job store and the work dirs, made private to the service's user at start",
    )
    jobs_db: str = Field(
        "", description="The job store's SQLAlchemy URL (unset: SQLite `batch_jobs.db` in `$DAGSTER_HOME`)"
    )
    work_dir: str = Field(
        "", description="Where jobs' work dirs go: a directory or `s3://bucket/prefix` (unset: `$DAGSTER_HOME/work`)"
    )
    model_cache: str = Field(
        "",
        description="Where catalog models and synced checkpoints are kept (unset: `~/.cache/batch_pipeline/models`)",
    )
    retention_days: int = Field(
        30,
        ge=0,
        le=36500,
        description="Days a finished job's work dir (inline content, shard inputs, checkpoints) is kept after the job "
        "ended; then the `cleanup` schedule deletes it and the job can no longer be resumed (0: kept forever; a "
        "team's `retention_days` in the tenants file wins). Outputs the user named are never deleted",
    )
    # The pipeline
    sensor_interval_s: int = Field(
        2, description="Seconds between the sensors' polls of the job store (read when the definitions load)"
    )
    sensor_max_tick_bytes: int = Field(
        32 * 2**20, description="Bytes of requests one sensor tick launches at most (32 MiB; always at least one job)"
    )
    fair_share_half_life_s: float = Field(
        3600.0,
        gt=0,
        description="With a tenants file: seconds after which a team's use of run slots counts half when the "
        "next job is chosen (fair share by decayed usage)",
    )
    schedules: str = Field("", description="A YAML file of recurring batches (see `examples/schedules.yaml`)")
    max_shards_per_job: int | None = Field(
        None, ge=1, description="Most shards a job is split into (unset: what the launcher runs at once)"
    )
    # A shard is worth its engine start (10-20 s on 2 CPU cores) when it has about 20 s of generation to do
    # there; GPU deployments generate far faster per engine start and should raise it.
    min_shard_tokens: int = Field(
        8192, ge=0, description="Estimated tokens a shard must have to be worth its engine start (0: any)"
    )
    deduplicate: bool = Field(
        True,
        description="`0` generates repeats of a deterministic request again instead of copying the first's "
        "output, and deterministic requests differing only in their output limit each on its own",
    )
    result_cache: bool = Field(
        True,
        description="`0` turns the teams' result caches off: every job generates every request, and keeps none "
        "of its results for later jobs (a team's `result_cache` and a request's `cache` turn it off for theirs)",
    )
    local_shard_concurrency: int | None = Field(
        None, ge=1, description="Shard workers the local launcher runs at once (unset: the core count)"
    )
    shard_launcher: Literal["local", "k8s"] = Field(
        "local", description="`k8s` runs each shard worker in a pod of its own; `local`, a subprocess"
    )
    standby_worker: str = Field(
        "",
        description="Set by `batch-pipeline run` for the steps of its own run, not by operators: the directory "
        "where the shard worker it started ahead waits for the local launcher (`launch/standby.py`)",
    )
    engine_pool_dir: str = Field(
        "",
        description="Set by `serve` for its services, not by operators: the directory of this machine's warm "
        "engine pool (`launch/pool.py`), where shard workers wait with their engines for the next shard",
    )
    # Each waiting worker holds its engine: ~1.2 GiB for the catalog model on the CPU in float32 (weights,
    # 1 GiB of KV cache, torch); a GPU worker holds its GPU too.
    engine_pool_workers: int = Field(
        2,
        ge=0,
        description="With the `local` launcher under `serve`: shard workers kept waiting with a warm engine (0: none)",
    )
    engine_pool_idle_s: float = Field(
        300.0, gt=0, description="How long a warm worker waits for a shard before it leaves (the pool scales to zero)"
    )
    engine_pool_memory_mib: int = Field(
        8192, ge=0, description="The memory the waiting warm workers may hold together, in MiB (0: unbounded)"
    )
    worker_image: str = Field("", description="With the `k8s` launcher: the shard workers' image (required)")
    k8s_namespace: str = Field("default", description="With the `k8s` launcher: the shard pods' namespace")
    k8s_service_account: str = Field(
        "", description="With the `k8s` launcher: the shard pods' service account (unset: the namespace's default)"
    )
    kubeconfig: str = Field(
        "",
        description="With the `k8s` launcher outside the cluster: the kubeconfig file (unset: the in-cluster config)",
    )
    k8s_poll_interval_s: float = Field(
        10.0, description="With the `k8s` launcher: seconds between reads of a shard pod's state"
    )
    # A pod without limits may take a whole node's cores and memory, its neighbours' (other teams') included.
    k8s_default_cpus: str = Field(
        "8",
        description="With the `k8s` launcher: the CPU limit (and request) of a shard pod whose request names no "
        "`cpus`, a Kubernetes quantity (at most `BATCH_PIPELINE_MAX_CPUS`)",
    )
    k8s_default_memory: str = Field(
        "64Gi",
        description="With the `k8s` launcher: the memory limit (and request) of a shard pod whose request names no "
        "`memory` and whose model's weights cannot be listed to size it (at most `BATCH_PIPELINE_MAX_MEMORY`)",
    )
    # Webhooks (the delivery process, `python -m batch_pipeline.webhooks`)
    webhook_attempt_timeout_s: float = Field(
        30.0,
        gt=0,
        le=90,
        description="Seconds one delivery attempt of a webhook event may take in all, however slowly a receiver "
        "answers (each read and write also times out after 5 s); then it counts as failed and is retried with "
        "backoff. At most 90, so that an attempt ends within its 2-minute claim",
    )
    webhook_allow_private_networks: str = Field(
        "",
        description="Networks (CIDRs, comma-separated: `10.20.0.0/16,127.0.0.1/32`) where webhook receivers may be "
        "although they are not public. Unset, an endpoint whose host resolves to a loopback, private, link-local "
        "(a cloud's metadata address), shared or reserved address is not sent to, wherever its DNS points",
    )
    # The shard worker
    checkpoint_upload_s: float = Field(
        30.0, description="Seconds between uploads of a shard's checkpoint to a remote work dir"
    )
    sandbox_uid_base: int = Field(
        61000, description="`code_evaluator`: the first uid sandboxed executions run as (unused by any account)"
    )
    sandbox_uids: int = Field(
        64, ge=1, description="`code_evaluator`: uids from the first, one per execution running on the machine"
    )
    sandbox_memory_mb: int = Field(
        1024, ge=1, description="`code_evaluator`: memory of one execution, all its processes together, in MiB"
    )
    sandbox_python: str = Field(
        "",
        description="`code_evaluator`: the Python executions run (unset: the worker's, else the system's `python3`)",
    )
    sandbox_allow_network: bool = Field(
        False,
        description="`1` runs `tool_config` code even where the kernel gives the sandbox no network namespace (a "
        "container without CAP_SYS_ADMIN: Docker's default, every Kubernetes pod): the code then reaches whatever "
        "the worker reaches, loopback (the Dagster UI) and a cloud's metadata address included. Unset, such "
        "requests get an error entry saying so",
    )

    @field_validator("webhook_allow_private_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        for network in (part.strip() for part in value.split(",") if part.strip()):
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not a network (CIDR, e.g. 10.20.0.0/16)") from None
        return value

    @field_validator("max_cpus", "max_memory", "max_storage", "k8s_default_cpus", "k8s_default_memory")
    @classmethod
    def _positive_quantity(cls, value: str | None) -> str | None:
        if value is not None:
            matched = KUBERNETES_QUANTITY.fullmatch(value)
            if matched is None or Decimal(matched[1]) <= 0:
                raise ValueError("must be a positive Kubernetes quantity (e.g. 8, 500m, 16Gi)")
        return value

    @property
    def job_store_url(self) -> str:
        """The job store's SQLAlchemy URL: `BATCH_PIPELINE_JOBS_DB`, or SQLite in DAGSTER_HOME."""
        return self.jobs_db or f"sqlite:///{os.path.abspath(self.dagster_home)}/batch_jobs.db"

    @property
    def work_dir_base(self) -> str:
        """Where jobs' work dirs go: `BATCH_PIPELINE_WORK_DIR`, or DAGSTER_HOME's `work/`."""
        return self.work_dir or os.path.join(self.dagster_home, "work")

    @model_validator(mode="after")
    def _k8s_has_an_image(self) -> Settings:
        if self.shard_launcher == "k8s" and not self.worker_image:
            raise ValueError(f"{ENV_PREFIX}WORKER_IMAGE: must be set when {ENV_PREFIX}SHARD_LAUNCHER=k8s")
        return self


class ClientSettings(_EnvironmentSettings):
    """The `batch-pipeline` CLI's own settings, as a client of the API; the server never reads them."""

    url: str = Field("http://127.0.0.1:8000", description="The API's base URL (`--url` wins)")
    api_key: str = Field("", description="The API key sent with each request (`--api-key` wins)")


def settings() -> Settings:
    """The settings as the environment has them now. Raises SettingsError naming each invalid variable."""
    return _read(Settings)


def client_settings() -> ClientSettings:
    return _read(ClientSettings)


Read = TypeVar("Read", bound=_EnvironmentSettings)
# Building the settings takes ~0.7 ms, and a request reads them several times: they are built again only
# when a BATCH_PIPELINE_ variable has changed (the objects are frozen, so sharing one is safe).
_built: dict[type[_EnvironmentSettings], tuple[tuple[tuple[str, str], ...], Any]] = {}


def _read(kind: type[Read]) -> Read:
    environment = tuple(sorted(item for item in os.environ.items() if _is_read(item[0])))
    built = _built.get(kind)
    if built is not None and built[0] == environment:
        return built[1]
    try:
        fresh = kind()
    except ValidationError as exc:
        raise SettingsError("; ".join(_problem(error) for error in exc.errors(include_url=False))) from None
    _built[kind] = (environment, fresh)
    return fresh


def _is_read(variable: str) -> bool:
    return variable.startswith(ENV_PREFIX) or variable in _UNPREFIXED


def _problem(error: ErrorDetails) -> str:
    variable = ".".join(str(part) for part in error["loc"])
    if error["type"] == "value_error":
        why = str(error["ctx"]["error"])
    else:
        why = error["msg"].replace("Input should be", "must be")
    # A check across variables names them itself and has no one input to show.
    return f"{variable}: {why}, got {error['input']!r}" if variable else why


def _shown_default(field: FieldInfo) -> str:
    if field.default in (None, ""):
        return "unset"
    if isinstance(field.default, bool):
        return f"`{int(field.default)}`"
    if isinstance(field.default, float):
        return f"`{field.default:g}`"
    return f"`{field.default}`"


def settings_table() -> str:
    """docs/operations/settings.md's table of the variables: the service's, then the CLI's."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    for kind, reader in ((Settings, ""), (ClientSettings, "*Client:* ")):
        for field in kind.model_fields.values():
            rows.append(f"| `{field.alias}` | {_shown_default(field)} | {reader}{field.description} |")
    return "\n".join(rows) + "\n"


def variable_names() -> set[str]:
    return {field.alias for kind in (Settings, ClientSettings) for field in kind.model_fields.values() if field.alias}


if __name__ == "__main__":
    print(settings_table(), end="")
