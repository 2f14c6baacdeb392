"""The deployment's admission policy: which paths a request may name, which teams share the deployment, the
hardware and engine arguments a request may ask for, whether a model's own code may run.

Built once from the settings where the deployment is composed (the API app, Dagster's definitions) and handed
to every check: no check reads the environment itself, so what one process admits is what it started with,
and a test builds the policy it means instead of patching variables. The tenants file alone is read at use,
and again as it changes (a revoked team stops at once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal

from batch_pipeline.admission.hardware import ENGINE_ARGUMENT_MAXIMA, configured_hardware_maxima, hardware_maxima
from batch_pipeline.admission.paths import DataFiles, PathPolicy
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.core.settings import Settings
from batch_pipeline.tenancy.tenants import TEAM_OWNER_PREFIX, DataRoots, Team, Tenants, tenants_at


@dataclass(frozen=True, kw_only=True)
class AdmissionPolicy:
    """What this deployment admits. Every field is required: a policy built by hand names each bound it
    leaves open, rather than inheriting none by default."""

    # The deployment's own paths: its protocols and data roots, before any team's are applied.
    paths: PathPolicy
    # The tenants file; empty: no teams (every caller is the deployment's single user or an admin).
    tenants_file: str
    # With trust_remote_code a request chooses Python that the worker imports with all its rights: only an
    # operator who vets the models may allow it.
    allow_remote_code: bool
    # Per hardware field: (the bound as written, in base units); a field left out has no bound.
    hardware_maxima: Mapping[str, tuple[str, Decimal]]
    # Per bounded engine argument of model_config (ENGINE_ARGUMENT_MAXIMA): its largest value.
    engine_maxima: Mapping[str, float]

    @property
    def max_gpus(self) -> int | None:
        bound = self.hardware_maxima.get("gpus")
        return int(bound[1]) if bound is not None else None

    @classmethod
    def of_deployment(cls, configured: Settings) -> AdmissionPolicy:
        return cls(
            paths=PathPolicy.of_deployment(configured),
            tenants_file=configured.tenants,
            allow_remote_code=configured.allow_remote_code,
            hardware_maxima=_local_cores_bound(configured, hardware_maxima(configured_hardware_maxima(configured))),
            engine_maxima={name: getattr(configured, setting) for name, setting in ENGINE_ARGUMENT_MAXIMA.items()},
        )

    def teams(self) -> Tenants | None:
        """The tenants file as it is now (the last good one while an edit is in progress)."""
        return tenants_at(self.tenants_file)

    def team_of_owner(self, owner: str) -> Team | None:
        """The team whose job this is, or None (no tenants file, an admin's or an operator's)."""
        registry = self.teams()
        return registry.team_of_owner(owner) if registry is not None else None

    def priority_cap(self, owner: str) -> int | None:
        """The highest run priority `owner`'s jobs may have: its team's `max_priority`, or None."""
        team = self.team_of_owner(owner)
        return team.config.priority_cap if team is not None else None

    def paths_for(self, owner: str | None) -> PathPolicy:
        """The policy for the paths of a job `owner` makes: its team's roots when there is a tenants file."""
        registry = self.teams()
        if registry is None or owner is None:
            return self.paths
        team = registry.team_of_owner(owner)
        if team is not None:
            roots = team.roots
        elif owner.startswith(TEAM_OWNER_PREFIX):  # a team no longer in the file: nowhere
            roots = DataRoots((), ())
        else:  # admins and operators (launchpad runs, schedules)
            roots = registry.all_roots() | DataRoots(self.paths.roots, ())
            return replace(self.paths, roots=roots.local, remote_roots=roots.remote, confined=True)
        return replace(self.paths, roots=roots.local, remote_roots=roots.remote, confined=True, local_models=False)

    def data_files(self, owner: str | None, own_dir: str | None = None) -> DataFiles:
        """How a job of `owner`'s opens the files its request names (`own_dir`: the job's work dir)."""
        return DataFiles(self.paths_for(owner), own_dir)

    def shard_model_config(self, model_config: BatchCompletionsModelConfig) -> BatchCompletionsModelConfig:
        """The model config a shard worker is given: trust_remote_code as this policy decides it, since the
        worker (a pod of its own) has no policy to check and must not take the request's word."""
        trusted = bool(model_config.trust_remote_code) and self.allow_remote_code
        return model_config.model_copy(update={"trust_remote_code": trusted})


def _local_cores_bound(
    configured: Settings, maxima: Mapping[str, tuple[str, Decimal]]
) -> Mapping[str, tuple[str, Decimal]]:
    """The local launcher runs every shard's worker on this machine's cores: where the operator set no
    BATCH_PIPELINE_MAX_CPUS, a request for more cores is refused at submission, not failed at its launch."""
    if configured.shard_launcher != "local" or "cpus" in maxima:
        return maxima
    cores = os.cpu_count() or 1
    return {**maxima, "cpus": (f"{cores}, the cores of the machine the local launcher runs shards on", Decimal(cores))}
