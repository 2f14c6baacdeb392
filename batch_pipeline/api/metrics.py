"""`GET /metrics`: the job store's figures in Prometheus' text format, read from the job rows at scrape
time (a few grouped queries; no file, no run, no event log), so every API replica reports the same. Jobs,
requests and tokens are counted by model and request kind (`contract/kinds`' names: `v1`, `completion`,
`chat`, `embeddings`, `responses`; `mixed` for an input file of several), so embeddings are seen apart from chat.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from batch_pipeline.api.usage import named_owners, team_label
from batch_pipeline.shards.protocol import pool_gauges
from batch_pipeline.store.reports import ReportStore
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.webhooks import WebhookOutbox
from batch_pipeline.tenancy.tenants import Tenants

# The `kind` of a job whose requests' kind is not known: an input file not planned yet, a job of an earlier release.
UNKNOWN_KIND = "unknown"
# Submission to run start, in seconds: from an idle local deployment (~2 s) to a queue hours deep.
START_LATENCY_BUCKETS = (1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class JobStoreCollector(Collector):
    def __init__(self, store: ReportStore, named: list[str], engine_pool_dir: str = "") -> None:
        self.store = store
        self.named = named  # the owners whose figures are told apart (`named_owners`)
        self.engine_pool_dir = engine_pool_dir  # this machine's warm engine pool, where `serve` made one

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "kind"]
        jobs = GaugeMetricFamily(
            "batch_pipeline_jobs", "Batch jobs by status, model and request kind.", labels=["status", *labels]
        )
        requests = CounterMetricFamily(
            "batch_pipeline_requests_generated",
            "Requests of batch jobs finished (results and error entries), by model and request kind.",
            labels=labels,
        )
        prompt_tokens = CounterMetricFamily(
            "batch_pipeline_prompt_tokens", "Prompt tokens read (embedded), by model and request kind.", labels=labels
        )
        tokens = CounterMetricFamily(
            "batch_pipeline_completion_tokens", "Completion tokens generated, by model and request kind.", labels=labels
        )
        queued = 0
        per_model: dict[tuple[str, str], list[int]] = {}
        for status, model, kind, count, *figures in self.store.counts_by_status_model_and_kind():
            key = (model, kind or UNKNOWN_KIND)
            jobs.add_metric([status, *key], count)
            queued += count if status == JobStatus.QUEUED else 0
            totals = per_model.setdefault(key, [0, 0, 0])
            for index, value in enumerate(figures):  # requests done, prompt and completion tokens
                totals[index] += value
        for key, (requests_done, prompt, completion) in sorted(per_model.items()):
            requests.add_metric(list(key), requests_done)
            prompt_tokens.add_metric(list(key), prompt)
            tokens.add_metric(list(key), completion)
        yield from (jobs, requests, prompt_tokens, tokens)
        yield from _team_figures(self.store, self.named)
        yield from _webhook_figures(self.store, self.named)
        yield from _engine_pool_figures(self.store, self.engine_pool_dir)
        yield GaugeMetricFamily(
            "batch_pipeline_queue_depth", "Jobs waiting for their first run to start.", value=queued
        )
        oldest = self.store.oldest_queued_created_at()
        age = (datetime.now(UTC) - oldest).total_seconds() if oldest else 0.0
        yield GaugeMetricFamily(
            "batch_pipeline_oldest_queued_job_age_seconds",
            "Age of the oldest job still waiting to start (0 with none).",
            value=max(age, 0.0),
        )
        counts, started, total_wait = self.store.queue_wait_buckets(START_LATENCY_BUCKETS)
        yield HistogramMetricFamily(
            "batch_pipeline_job_start_latency_seconds",
            "Seconds from a job's submission to its first run's start.",
            buckets=[(str(float(bound)), count) for bound, count in zip(START_LATENCY_BUCKETS, counts)]
            + [("+Inf", started)],
            sum_value=total_wait,
        )


def _team_figures(store: ReportStore, named: list[str]) -> Iterator[Metric]:
    """The job, request and token figures by team: the tenants file's teams, `admins`, and `other` for every
    other owner, so the series are as many as the teams (GET /v2/usage has them per day)."""
    jobs = GaugeMetricFamily("batch_pipeline_team_jobs", "Batch jobs by team and status.", labels=["team", "status"])
    requests = CounterMetricFamily(
        "batch_pipeline_team_requests_generated",
        "Requests of batch jobs done (results and error entries), by team.",
        labels=["team"],
    )
    prompt_tokens = CounterMetricFamily(
        "batch_pipeline_team_prompt_tokens", "Prompt tokens of batch jobs, by team.", labels=["team"]
    )
    completion_tokens = CounterMetricFamily(
        "batch_pipeline_team_completion_tokens", "Completion tokens generated, by team.", labels=["team"]
    )
    per_team: dict[str, list[int]] = {label: [0, 0, 0] for label in map(team_label, [*named, None])}
    per_status: dict[tuple[str, str], int] = {}
    for owner, status, count, requests_done, prompt, completion in store.figures_by_team(named):
        label = team_label(owner)
        per_status[label, status] = per_status.get((label, status), 0) + count
        totals = per_team.setdefault(label, [0, 0, 0])
        for index, value in enumerate((requests_done, prompt, completion)):
            totals[index] += value
    for (label, status), count in sorted(per_status.items()):
        jobs.add_metric([label, status], count)
    for label, (requests_done, prompt, completion) in sorted(per_team.items()):
        requests.add_metric([label], requests_done)
        prompt_tokens.add_metric([label], prompt)
        completion_tokens.add_metric([label], completion)
    yield from (jobs, requests, prompt_tokens, completion_tokens)


def _webhook_figures(store: ReportStore, named: list[str]) -> Iterator[Metric]:
    """The webhook outbox's figures by team and event type, read from its rows (the delivery process is
    another process: every API replica reports the same)."""
    labels = ["team", "type"]
    events = CounterMetricFamily(
        "batch_pipeline_webhook_events", "Webhook events written as jobs ended.", labels=labels
    )
    delivered = CounterMetricFamily(
        "batch_pipeline_webhook_delivered", "Webhook events every subscribed endpoint took (2xx).", labels=labels
    )
    given_up = CounterMetricFamily(
        "batch_pipeline_webhook_given_up", "Webhook events given up after the 24-hour retry window.", labels=labels
    )
    attempts = CounterMetricFamily(
        "batch_pipeline_webhook_delivery_attempts", "Attempts to deliver webhook events.", labels=labels
    )
    pending = GaugeMetricFamily(
        "batch_pipeline_webhook_pending", "Webhook events not delivered yet (being sent or retried).", labels=labels
    )
    totals: dict[tuple[str, str], list[int]] = {}
    for owner, event_type, state, count, tries in WebhookOutbox(engine=store.engine).figures_by_team(named):
        figures = totals.setdefault((team_label(owner), event_type), [0, 0, 0, 0, 0])
        figures[0] += count
        figures[1] += count if state == "delivered" else 0
        figures[2] += count if state == "failed" else 0
        figures[3] += tries
        figures[4] += count if state == "pending" else 0
    families: tuple[CounterMetricFamily | GaugeMetricFamily, ...] = (events, delivered, given_up, attempts, pending)
    for key, figures in sorted(totals.items()):
        for family, value in zip(families, figures):
            family.add_metric(list(key), value)
    yield from (events, delivered, given_up, attempts, pending)


def _engine_pool_figures(store: ReportStore, pool_directory: str) -> Iterator[Metric]:
    """The warm engine pool's: shards that found their engine warm or started one there, and the engine
    starts that saved (from the job store); what waits in this machine's pool now, and its evictions."""
    warm, cold, saved = store.engine_pool_figures()
    yield CounterMetricFamily(
        "batch_pipeline_engine_pool_hits", "Shards that ran on a warm engine of the pool.", value=warm
    )
    yield CounterMetricFamily(
        "batch_pipeline_engine_pool_misses",
        "Shards that started an engine in the pool (none warm for them).",
        value=cold,
    )
    yield CounterMetricFamily(
        "batch_pipeline_engine_pool_engine_seconds_saved",
        "Engine-start seconds the pool's warm engines saved (what building each had taken).",
        value=saved,
    )
    gauges = pool_gauges(pool_directory)
    if gauges is None:
        return
    yield GaugeMetricFamily(
        "batch_pipeline_engine_pool_waiting_workers",
        "Workers waiting with a warm engine now.",
        value=gauges.waiting_workers,
    )
    yield GaugeMetricFamily(
        "batch_pipeline_engine_pool_waiting_bytes", "Memory the waiting workers hold.", value=gauges.waiting_bytes
    )
    yield CounterMetricFamily(
        "batch_pipeline_engine_pool_evictions",
        "Waiting workers evicted to keep the pool within its bound (since serve started).",
        value=gauges.evictions,
    )


def metrics_text(store: ReportStore, teams: Tenants | None, engine_pool_dir: str = "") -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobStoreCollector(store, named_owners(teams), engine_pool_dir))
    return generate_latest(registry)
