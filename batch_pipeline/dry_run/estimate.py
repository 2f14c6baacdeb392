"""A dry run: a request read, checked and tokenized as its job would be, and what it would cost here,
with nothing launched, stored or written.

The records are read as `plan_shards` reads them (inline content, or the input file streamed), and each
request goes through the shard worker's own request handlers, with a recorder standing where the engine
stands: so a field the worker refuses, a chat template that does not render, and the prompt the engine
would get (chat through the template) are exactly the worker's. The prompts are counted with the model's
tokenizer against its context. The time is estimated from the throughput this deployment measured on its
latest completed jobs of the model.

The reading, rendering and tokenizing (`dry_run.counting`) run in a child process of their own
(`dry_run.child`), bounded in memory and time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from batch_pipeline.admission.hardware import kubernetes_quantity
from batch_pipeline.admission.paths import DataFiles, names_a_hub_model
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.contract.estimate import BatchCompletionsEstimate, RuntimeEstimate
from batch_pipeline.core.settings import Settings
from batch_pipeline.core.slots import SlotsBusy, TeamSlots
from batch_pipeline.dry_run.child import counted_apart, model_context_apart
from batch_pipeline.dry_run.counting import Counts
from batch_pipeline.shards.planning import PlanningSettings
from batch_pipeline.store.results import CompletedFigures

# Completed jobs of the model whose throughput the estimate takes the median of.
HISTORY_JOBS = 20
# Model configs a submission's check has read (and their contexts), kept so that the next job of one is not
# read again.
MODELS_KEPT = 64


class DryRunsBusy(SlotsBusy):
    """As many dry runs as this process takes at once, or as the caller's team may hold, are in progress."""


@dataclass(frozen=True)
class DryRuns:
    """An API process's dry runs: the slots they hold (each holds a thread and a child process for as long
    as its input takes; a team at most its share, so that two slow chat templates of one team leave the
    others a slot), and the planning its jobs' shard workers are chosen by."""

    slots: TeamSlots
    planning: PlanningSettings
    # A model config's JSON -> its context, for the configs a submission's check read without a refusal.
    models_read: dict[str, int] = field(default_factory=dict, compare=False)

    @classmethod
    def of_deployment(cls, configured: Settings) -> DryRuns:
        """The deployment's: its dry-run limits, and the planning settings definitions.py builds its
        ShardPlanning resource from (the launcher's own limit on workers at once is not known here)."""
        slots = TeamSlots(
            "dry runs",
            configured.max_concurrent_dry_runs,
            configured.max_dry_runs_per_team,
            "BATCH_PIPELINE_MAX_DRY_RUNS_PER_TEAM",
            busy=DryRunsBusy,
        )
        planning = PlanningSettings.of_deployment(
            configured.max_shards_per_job, configured.min_shard_tokens, configured.deduplicate, slots=None
        )
        return cls(slots, planning)

    def model_context(self, request: CreateBatchCompletionsV2Request, team: str | None) -> int | None:
        """The context of a hub model a submission names, read as its dry run reads it
        (`model_context_apart`), for a request whose paths `check_servable` accepted: so that a name no
        engine here could load (none on the hub, or a hub this server cannot reach) is refused now, naming
        the field, not after its shards tried it for minutes. None for what is not looked up on the hub: a
        catalog model (its context is the catalog's), a local directory or a checkpoint the data roots
        admitted. Raises UnservableRequest naming the field, DryRunsBusy as a dry run would."""
        config = request.model_cfg
        if config.checkpoint_path is not None or not names_a_hub_model(config.model):
            return None
        key = config.model_dump_json()
        if (known := self.models_read.get(key)) is not None:
            return known
        with self.slots.hold(team):
            context = model_context_apart(request)
        if len(self.models_read) >= MODELS_KEPT:
            self.models_read.pop(next(iter(self.models_read)), None)
        self.models_read[key] = context
        return context

    def estimate(
        self,
        request: CreateBatchCompletionsV2Request,
        history: list[CompletedFigures],
        files: DataFiles,
        team: str | None,
    ) -> BatchCompletionsEstimate:
        """The dry run of a request whose paths and fields `check_servable` accepted, its input opened as its
        job would open it (`files`: beneath the requester's data roots), in one of the slots `team`
        (`Caller.owner`) may hold. `history` is the model's completed jobs' figures, newest first
        (`ReportStore.completed_figures`). Raises UnservableRequest naming the field for what makes the whole
        job fail (an unreadable input, a model with no tokenizer here), and DryRunsBusy when the process
        runs as many dry runs as it takes, or the team holds its share."""
        with self.slots.hold(team):
            counts, context_length = counted_apart(request, files)
        return BatchCompletionsEstimate(
            model=request.model_cfg.model,
            context_length=context_length,
            num_requests=counts.requests,
            num_prompts=counts.prompts,
            prompt_tokens=counts.prompt_tokens,
            max_output_tokens=counts.output_tokens,
            num_cannot_run=counts.cannot_run,
            cannot_run=counts.cannot_run_listed,
            num_cut_at_context=counts.cut,
            cut_at_context=counts.cut_listed,
            **_runtime(request, counts, history, self.planning),
        )


# --- time and cost -----------------------------------------------------------------------------------------


def _runtime(
    request: CreateBatchCompletionsV2Request,
    counts: Counts,
    history: list[CompletedFigures],
    planning: PlanningSettings,
) -> dict:
    # A job of kinds that generate nothing (embeddings) reads its prompts, at the rate its model's jobs read
    # theirs; any other generates its output tokens, at the rate they generated theirs.
    pooling = counts.pooled_tokens > 0 and counts.output_tokens == 0
    if pooling:
        rates, engine_starts = _pooling_rates(history)
        work = counts.pooled_tokens
    else:
        rates, engine_starts = _generation_rates(history)
        work = counts.output_tokens
    if not rates:
        model = request.model_cfg.model
        if not history:
            why = f"no history: no job of {model!a} has completed on this deployment yet"
        elif pooling:
            why = f"no history: no completed job of {model!a} here measured how fast it read its inputs"
        else:
            why = f"no history: no completed job of {model!a} here generated any tokens"
        return {"no_history": why + ", so there is no throughput to estimate from"}
    rate = statistics.median(rates)
    # Shard workers the job would run in, as plan_shards decides it.
    workers = planning.shards_for(request.data_parallelism or 1, counts.prompt_tokens + counts.output_tokens)[0]
    # Every worker starts its engine, then does its share.
    engine_start_s = statistics.median(engine_starts) if engine_starts else 0.0
    wall_s = engine_start_s + work / (rate * workers)
    worker_hours = wall_s * workers / 3600
    cpus = float(kubernetes_quantity("cpus", request.cpus)[1]) if request.cpus is not None else None
    return {
        "estimate": RuntimeEstimate(
            completion_tokens_per_s=None if pooling else round(rate, 2),
            prompt_tokens_per_s=round(rate, 2) if pooling else None,
            engine_start_s=round(engine_start_s, 1),
            from_jobs=len(rates),
            workers=workers,
            wall_s=round(wall_s, 1),
            worker_hours=round(worker_hours, 4),
            gpu_hours=round(worker_hours * request.gpus, 4) if request.gpus else None,
            cpu_hours=round(worker_hours * cpus, 4) if cpus else None,
        )
    }


def _pooling_rates(history: list[CompletedFigures]) -> tuple[list[float], list[float]]:
    """Each job's prompt tokens per second per shard worker while it ran, and its slowest engine start, from
    the jobs that generated nothing (embeddings) of a release that measured it (issue 48)."""
    measured = [
        figures.results
        for figures in history
        if not figures.results.completion_tokens and (figures.results.prompt_tokens_per_s or 0) > 0
    ]
    rates = [results.prompt_tokens_per_s or 0.0 for results in measured]
    return rates, [results.engine_start_s for results in measured if results.engine_start_s is not None]


def _generation_rates(history: list[CompletedFigures]) -> tuple[list[float], list[float]]:
    """Each job's completion tokens per second per shard worker while it generated, and its slowest engine
    start, from the jobs a release since issue 46 ran (their `completion_tokens_per_wall_s` says so). Only
    where there are none: each older job's tokens over its whole wall per shard worker, as before, which
    counted its engine starts as time generating (11 minutes estimated for what took 1-2)."""
    measured = [figures.results for figures in history if figures.results.completion_tokens_per_wall_s is not None]
    rates = [rate for results in measured if (rate := results.completion_tokens_per_s or 0) > 0]
    if rates:
        starts = [results.engine_start_s for results in measured if results.engine_start_s is not None]
        return rates, starts
    older = [
        rate / max(1, figures.shards)
        for figures in history
        if (rate := figures.results.completion_tokens_per_s or 0) > 0
    ]
    return older, []
