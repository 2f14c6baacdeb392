"""`GET /v2/batch-completions/{job_id}/webhooks`: the delivery state of each webhook event of a job.
Endpoints are named by their place in the team's `webhooks` list, never by URL (a URL may carry a token)."""

from __future__ import annotations

from pydantic import Field

from batch_pipeline.contract.base import WireModel


class WebhookEventState(WireModel):
    id: str = Field(description="The event's id: the webhook-id header it is sent with")
    type: str = Field(description="job.completed, job.failed, job.cancelled, job.expired, or batch.* for a batch")
    state: str = Field(
        description="pending (being sent, or waiting to retry), delivered (every endpoint taking its type "
        "answered 2xx), failed (given up after 24 hours of retries), unsubscribed (no endpoint takes its type)"
    )
    attempts: int
    created_at: str
    last_attempt_at: str | None = None
    next_attempt_at: str | None = Field(None, description="While pending: when it is tried again")
    delivered_at: str | None = None
    last_error: str | None = Field(None, description='e.g. "webhooks[0]: HTTP 500" (the team\'s first endpoint)')


class WebhookEventsResponse(WireModel):
    job_id: str
    events: list[WebhookEventState]
