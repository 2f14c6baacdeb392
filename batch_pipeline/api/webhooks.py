"""`GET /v2/batch-completions/{job_id}/webhooks`: the delivery state of each webhook event of a job, for its
owner (or an admin) only; another team's job reads as absent, as everywhere. Endpoints are named by their
place in the team's `webhooks` list, never by URL (a URL may carry a token); no secret is ever here."""

from __future__ import annotations

from batch_pipeline.api.auth import Caller
from batch_pipeline.api.service import JobNotFound
from batch_pipeline.contract.webhooks import WebhookEventsResponse, WebhookEventState
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.webhooks import WebhookEvent, WebhookOutbox


def job_webhooks(store: JobStore, caller: Caller, job_id: str) -> WebhookEventsResponse:
    record = store.get(job_id)
    if record is None or (record.owner != caller.owner and not caller.is_admin):
        raise JobNotFound(job_id)
    events = WebhookOutbox(engine=store.engine).events_of_job(record.job_id)
    return WebhookEventsResponse(job_id=record.job_id, events=[_state(event) for event in events])


def _state(event: WebhookEvent) -> WebhookEventState:
    return WebhookEventState(
        id=event.event_id,
        type=event.type,
        state=event.state,
        attempts=event.attempts,
        created_at=event.created_at.isoformat(),
        last_attempt_at=event.last_attempt_at.isoformat() if event.last_attempt_at else None,
        next_attempt_at=event.next_attempt_at.isoformat() if event.state == "pending" else None,
        delivered_at=event.delivered_at.isoformat() if event.delivered_at else None,
        last_error=event.last_error,
    )
