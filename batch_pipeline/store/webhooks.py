"""The webhook outbox (`batch_webhook_events`): the event a job's end announces, written by the job store in
the transaction that ends the job (`add_end_event`), and read and updated by the delivery process
(`batch_pipeline.webhooks`) as it sends each one; its state per event is what a team reads back.

A job's event goes to its own owner's endpoints only: the owner is copied from the job's row in the same
transaction, and nothing a request sends names an endpoint.

The event of a job whose run stopped early (cancelled, failed) is written held: `keep_partial_results` is
about to merge the results its shards finished into the job's output, and a receiver told at once would
read an output not written yet. The transaction that records that output as final releases it
(`release_held_event`); an event whose output never comes (keep_partial_results failed for good, or never
ran) is sent `PARTIAL_RESULTS_WAIT` after the end all the same, so that no end goes unannounced.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.openai import batches
from batch_pipeline.store.schema import JobStatus, failed_at_deadline, jobs, webhook_events
from batch_pipeline.store.sql import of_owners, owner_bucket, utc, utc_now

JOB_EVENTS = ("job.completed", "job.failed", "job.cancelled", "job.expired")
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = JOB_EVENTS + BATCH_EVENTS
STATES = ("pending", "delivered", "failed", "unsubscribed")
# The longest a stopped job's event waits for keep_partial_results to write its output (which takes seconds
# to minutes): then it is sent, whatever became of that output.
PARTIAL_RESULTS_WAIT = timedelta(hours=1)


@dataclass(frozen=True)
class WebhookEvent:
    event_id: str
    job_id: str
    owner: str
    type: str
    payload: str
    created_at: datetime
    state: str
    attempts: int
    next_attempt_at: datetime
    last_attempt_at: datetime | None
    last_error: str | None
    delivered_to: tuple[str, ...]
    delivered_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> WebhookEvent:
        return cls(
            event_id=row.event_id,
            job_id=row.job_id,
            owner=row.owner,
            type=row.type,
            payload=row.payload,
            created_at=utc(row.created_at),
            state=row.state,
            attempts=int(row.attempts),
            next_attempt_at=utc(row.next_attempt_at),
            last_attempt_at=utc(row.last_attempt_at),
            last_error=row.last_error,
            delivered_to=tuple(json.loads(row.delivered_to or "[]")),
            delivered_at=utc(row.delivered_at),
        )


def add_end_event(connection: sa.Connection, job_id: str, held: bool = False) -> str | None:
    """In the caller's transaction, which has just ended the job: the event its end announces, from the
    job's row as that transaction sees it. None (nothing written) for a job not ended. `held`: the job's
    output is still being written (keep_partial_results), so the event is not due before
    `release_held_event`, or `PARTIAL_RESULTS_WAIT` from now at the latest."""
    row = connection.execute(
        sa.select(jobs.c.owner, jobs.c.status, jobs.c.failure_reason, jobs.c.completed_at, jobs.c.expires_at).where(
            jobs.c.job_id == job_id
        )
    ).first()
    if row is None or row.completed_at is None or row.status not in JOB_STATUS_EVENT:
        return None
    at_deadline = failed_at_deadline(row.status, row.failure_reason, row.completed_at, row.expires_at)
    outcome = "expired" if at_deadline else row.status
    outcome = JOB_STATUS_EVENT.get(outcome, outcome)
    is_batch = connection.execute(sa.select(batches.c.batch_id).where(batches.c.batch_id == job_id)).first()
    now = utc_now()
    event_id = f"evt_{uuid.uuid4().hex}"
    payload: dict[str, Any]
    if is_batch:  # OpenAI's event object (https://platform.openai.com/docs/api-reference/webhook-events)
        event_type = f"batch.{outcome}"
        payload = {
            "id": event_id,
            "object": "event",
            "created_at": int(now.timestamp()),
            "type": event_type,
            "data": {"id": job_id},
        }
    else:  # Standard Webhooks' payload shape: type, timestamp, data
        event_type = f"job.{outcome}"
        payload = {"type": event_type, "timestamp": now.isoformat(), "data": {"job_id": job_id, "status": outcome}}
    connection.execute(
        webhook_events.insert().values(
            event_id=event_id,
            job_id=job_id,
            owner=row.owner,
            type=event_type,
            payload=json.dumps(payload, separators=(",", ":")),
            created_at=now,
            state="pending",
            attempts=0,
            next_attempt_at=now + PARTIAL_RESULTS_WAIT if held else now,
            delivered_to="[]",
        )
    )
    return event_id


def release_held_event(connection: sa.Connection, event_id: str) -> bool:
    """In the caller's transaction, which records the job's output as final (or gives up on it): the held
    end event `event_id` is due now. False, and nothing changed, when it is not held any more (released
    already, or sent once its wait ended): an event is written once, and this never writes one."""
    now = utc_now()
    held = sa.and_(
        webhook_events.c.event_id == event_id,
        webhook_events.c.state == "pending",
        webhook_events.c.attempts == 0,
        webhook_events.c.next_attempt_at > now,
    )
    return connection.execute(webhook_events.update().where(held).values(next_attempt_at=now)).rowcount > 0


# A finished status's event name ("expired" is a failure at the deadline).
JOB_STATUS_EVENT = {
    JobStatus.COMPLETED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
    "expired": "expired",
}


class WebhookOutbox(StoreBase):
    def events_of_job(self, job_id: str) -> list[WebhookEvent]:
        """The events of one job, oldest first (the caller checks the job is the asker's)."""
        query = (
            sa.select(webhook_events)
            .where(webhook_events.c.job_id == job_id)
            .order_by(webhook_events.c.created_at, webhook_events.c.event_id)
        )
        with self.engine.connect() as connection:
            return [WebhookEvent.from_row(row) for row in connection.execute(query)]

    def release(self, event_id: str) -> bool:
        """`release_held_event` in a transaction of its own: for a job whose output will not be written."""
        with self.engine.begin() as connection:
            return release_held_event(connection, event_id)

    def get(self, event_id: str) -> WebhookEvent | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(webhook_events).where(webhook_events.c.event_id == event_id)).first()
        return WebhookEvent.from_row(row) if row else None

    def claim_due(
        self,
        now: datetime,
        limit: int,
        lease: timedelta,
        per_owner: int,
        in_flight: Mapping[str, int] | None = None,
    ) -> list[WebhookEvent]:
        """Up to `limit` pending events due by `now`, oldest due first, each claimed for `lease` (its next
        attempt moved past the lease, its attempts counted), so that another delivery process, or this one's
        next tick, does not send it again while this attempt runs. An attempt that dies with its process is
        retried when the lease ends: at least once. At most `per_owner` events of an owner are in flight
        (`in_flight`: theirs already sent), so that one team's events, however many and however slow its
        receiver, never take every worker."""
        in_flight = in_flight or {}
        due = sa.and_(webhook_events.c.state == "pending", webhook_events.c.next_attempt_at <= now)
        # Each owner's oldest due events first, at most `per_owner` of them: a team with thousands due
        # leaves room in the query for the others.
        place = sa.func.row_number().over(
            partition_by=webhook_events.c.owner, order_by=(webhook_events.c.next_attempt_at, webhook_events.c.event_id)
        )
        ranked = (
            sa.select(
                webhook_events.c.event_id,
                webhook_events.c.next_attempt_at,
                webhook_events.c.owner,
                place.label("place"),
            )
            .where(due)
            .subquery()
        )
        query = (
            sa.select(ranked.c.event_id, ranked.c.next_attempt_at, ranked.c.owner)
            .where(ranked.c.place <= per_owner)
            .order_by(ranked.c.next_attempt_at)
        )
        taking: Counter[str] = Counter(in_flight)
        claimed: list[str] = []
        with self.engine.begin() as connection:
            for event_id, due_at, owner in connection.execute(query).all():
                if len(claimed) >= limit:
                    break
                if taking[owner] >= per_owner:
                    continue
                taken = connection.execute(
                    webhook_events.update()
                    .where(
                        webhook_events.c.event_id == event_id,
                        webhook_events.c.state == "pending",
                        webhook_events.c.next_attempt_at == due_at,
                    )
                    .values(
                        next_attempt_at=now + lease,
                        attempts=webhook_events.c.attempts + 1,
                        last_attempt_at=now,
                    )
                ).rowcount
                if taken:
                    claimed.append(event_id)
                    taking[owner] += 1
            if not claimed:
                return []
            rows = connection.execute(sa.select(webhook_events).where(webhook_events.c.event_id.in_(claimed)))
            by_id = {row.event_id: WebhookEvent.from_row(row) for row in rows}
        return [by_id[event_id] for event_id in claimed]

    def record_attempt(
        self,
        event: WebhookEvent,
        delivered_to: Collection[str],
        state: str,
        error: str | None,
        next_attempt_at: datetime | None,
        now: datetime,
    ) -> None:
        """How an attempt went: the endpoints that took the event so far, its state, the last error, and
        when to try again (pending)."""
        values: dict[str, Any] = {
            "delivered_to": json.dumps(sorted(set(delivered_to))),
            "state": state,
            "last_error": error,
        }
        if next_attempt_at is not None:
            values["next_attempt_at"] = next_attempt_at
        if state == "delivered":
            values["delivered_at"] = now
        with self.engine.begin() as connection:
            connection.execute(
                webhook_events.update()
                .where(webhook_events.c.event_id == event.event_id, webhook_events.c.state == "pending")
                .values(**values)
            )

    # --- figures for /metrics ---------------------------------------------------------------------------

    def figures_by_team(self, named: Collection[str]) -> list[tuple[str | None, str, str, int, int]]:
        """(owner, event type, state, events, attempts) over every event, by owner of `named` (every other
        owner summed as None)."""
        per_event = sa.select(
            owner_bucket(webhook_events.c.owner, named).label("owner"),
            webhook_events.c.type,
            webhook_events.c.state,
            webhook_events.c.attempts,
        ).subquery()
        query = sa.select(
            per_event.c.owner,
            per_event.c.type,
            per_event.c.state,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(per_event.c.attempts), 0),
        ).group_by(per_event.c.owner, per_event.c.type, per_event.c.state)
        with self.engine.connect() as connection:
            return [(o, t, s, int(c), int(a)) for o, t, s, c, a in connection.execute(query)]

    def delivery_latencies(self, since: datetime) -> list[float]:
        """Seconds from each event's job end (the event's creation) to its delivery, for events delivered
        since `since` (the bench's figure)."""
        query = sa.select(webhook_events.c.created_at, webhook_events.c.delivered_at).where(
            webhook_events.c.delivered_at.is_not(None), webhook_events.c.delivered_at >= since
        )
        with self.engine.connect() as connection:
            return [(utc(done) - utc(made)).total_seconds() for made, done in connection.execute(query)]


def _finished_before(
    created_before: datetime, owners: Collection[str] | None, other_than: Collection[str]
) -> sa.ColumnElement[bool]:
    """Events no longer pending (delivered, given up, or for no endpoint) created before `created_before`, of
    `owners` (None: any owner) other than those of `other_than`. A pending event is still to be sent."""
    return sa.and_(
        webhook_events.c.state.in_(("delivered", "failed", "unsubscribed")),
        webhook_events.c.created_at < created_before,
        of_owners(webhook_events.c.owner, owners, other_than),
    )


def delete_finished_events(
    engine: sa.Engine,
    created_before: datetime,
    owners: Collection[str] | None = None,
    other_than: Collection[str] = (),
    limit: int = 10_000,
) -> int:
    """Retention (the `cleanup` job): delete up to `limit` of the `_finished_before` events, the oldest first;
    how many were deleted. A pending event is never deleted."""
    condition = _finished_before(created_before, owners, other_than)
    oldest = (
        sa.select(webhook_events.c.event_id)
        .where(condition)
        .order_by(webhook_events.c.created_at, webhook_events.c.event_id)
        .limit(limit)
    )
    with engine.connect() as connection:
        event_ids = list(connection.execute(oldest).scalars()) if limit > 0 else []
    deleted = 0
    for start in range(0, len(event_ids), 500):  # a transaction a chunk: the store's writers wait on none long
        with engine.begin() as connection:
            chunk = webhook_events.c.event_id.in_(event_ids[start : start + 500])
            deleted += connection.execute(webhook_events.delete().where(chunk, condition)).rowcount
    return deleted


def finished_events_due(
    engine: sa.Engine, created_before: datetime, owners: Collection[str] | None = None, other_than: Collection[str] = ()
) -> bool:
    """Whether any event is due for `delete_finished_events`: one row read, for the schedule's every tick."""
    query = sa.select(webhook_events.c.event_id).where(_finished_before(created_before, owners, other_than)).limit(1)
    with engine.connect() as connection:
        return connection.execute(query).first() is not None


def count_finished_events(
    engine: sa.Engine, created_before: datetime, owners: Collection[str] | None = None, other_than: Collection[str] = ()
) -> int:
    """How many events `delete_finished_events` would delete without a limit: what a bounded cleanup left."""
    query = (
        sa.select(sa.func.count())
        .select_from(webhook_events)
        .where(_finished_before(created_before, owners, other_than))
    )
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())
