"""The webhook delivery loop: the outbox's due events (`store/webhooks.py`), each POSTed to the endpoints
of its job's team in the tenants file, signed the Standard Webhooks way (`webhook-id`, `webhook-timestamp`,
`webhook-signature`, by the `standardwebhooks` library), retried with exponential backoff for 24 hours and
then given up (state `failed`, visible in the event's state and in /metrics).

It runs in a process of its own (`python -m batch_pipeline.webhooks`, started by `serve`), off every path
a job or a sensor takes: a receiver that is down, slow or answers 500 costs one worker thread of this
process for one attempt, at most BATCH_PIPELINE_WEBHOOK_ATTEMPT_TIMEOUT_S however slowly it answers, and
never a job, a sensor tick or the API. Each team has at most `PER_TEAM_IN_FLIGHT` events in flight, so one
team's slow receiver cannot hold every worker.

What is sent where: an event goes to the endpoints of its job's owner's team only (its `owner` is the
job's, copied in the transaction that ended the job), and only to a URL of the tenants file. Redirects are
not followed (a receiver cannot send the service elsewhere). Secrets are read from the environment
variables the file names, and never logged, stored or shown; errors are recorded as "webhooks[i]: HTTP
500", never with a URL.

Where a host's DNS points is its owner's choice, not the operator's: an endpoint's host is resolved as
each attempt starts, and an address that is not public (loopback, private, link-local such as a cloud's
metadata address, shared, reserved, multicast; an IPv6 form of one too) is not connected to unless it lies
in BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS. The request goes to the address checked, with the URL's
host in its Host header and TLS's SNI and certificate check, so a second lookup cannot send it elsewhere
(DNS rebinding), and a team never reads an internal service's answer back through `last_error`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta

import httpx
from standardwebhooks.webhooks import Webhook

from batch_pipeline.core.settings import Settings
from batch_pipeline.store.sql import utc_now
from batch_pipeline.store.webhooks import WebhookEvent, WebhookOutbox
from batch_pipeline.tenancy.tenants import Tenants, WebhookConfig, tenants_at

logger = logging.getLogger(__name__)

RETRY_WINDOW = timedelta(hours=24)  # then an event's delivery is given up
FIRST_RETRY_S = 2.0  # then doubling, each with +-20% jitter, up to MAX_RETRY_S
MAX_RETRY_S = 3600.0
CONNECT_TIMEOUT_S = 2.0
TIMEOUT_S = 5.0  # each read and write; the response's body is never read
# An attempt whose process died is retried after this; a live one ends before it (the attempt's timeout is
# at most 90 s).
LEASE = timedelta(minutes=2)
WORKERS = 8
PER_TEAM_IN_FLIGHT = 2
POLL_S = 0.5


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# IPv6 prefixes whose addresses carry an IPv4 address in their last 32 bits (NAT64's well-known prefix).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class RefusedAddress(ConnectionError):
    """An endpoint's host resolves to no address delivery may connect to."""


def private_networks(configured: str) -> tuple[Network, ...]:
    """BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS read: the networks receivers may be in though not public."""
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in configured.split(",") if part.strip())


def may_connect(address: str, allowed: tuple[Network, ...] = ()) -> bool:
    """Whether delivery may connect to `address`: a public one, or one in `allowed`. An IPv4-mapped IPv6
    address is its IPv4 address; one that routes to an IPv4 address (6to4, NAT64, Teredo) is judged by both."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    judged: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        judged += [ip.sixtofour] if ip.sixtofour is not None else []
        judged += [ip.teredo[1]] if ip.teredo is not None else []
        judged += [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)] if ip in _NAT64 else []
    return all(
        any(each in network for network in allowed) or (each.is_global and not each.is_multicast) for each in judged
    )


async def connectable_address(host: str, port: int, allowed: tuple[Network, ...]) -> str:
    """The first address `host` resolves to that delivery may connect to; RefusedAddress when none is."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for _family, _type, _proto, _name, sockaddr in infos:
        if may_connect(str(sockaddr[0]).split("%", 1)[0], allowed):
            return str(sockaddr[0])
    raise RefusedAddress(host)


class WebhookSecretError(ValueError):
    """A webhook's secret_env names no usable secret; the message names the field, never the value."""


def signer(config: WebhookConfig) -> Webhook:
    """The endpoint's Standard Webhooks signer, from the variable its `secret_env` names."""
    value = os.environ.get(config.secret_env)
    if not value:
        raise WebhookSecretError(f"secret_env {config.secret_env} is not set")
    try:
        return Webhook(value)
    except Exception:  # the library's errors may quote what it was given: never the secret
        raise WebhookSecretError(
            f"secret_env {config.secret_env} is not a Standard Webhooks secret (whsec_...)"
        ) from None


def check_webhook_secrets(registry: Tenants | None) -> None:
    """Every webhook of the tenants file has its secret in this environment: checked as the delivery process
    (and `serve`) starts, so that a missing one is named at once, not at a job's end."""
    if registry is None:
        return
    for team in registry.teams.values():
        for index, config in enumerate(team.config.webhooks):
            try:
                signer(config)
            except WebhookSecretError as exc:
                raise WebhookSecretError(
                    f"{registry.source}: tenants.{team.name}.webhooks.{index}.secret_env: {exc}"
                ) from None


def signed_headers(webhook: Webhook, event_id: str, payload: str, now: datetime) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "user-agent": "batch_pipeline-webhooks",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": webhook.sign(event_id, now, payload),
    }


def retry_delay(attempts: int) -> float:
    """Seconds before the next attempt after `attempts` failed ones: exponential, jittered."""
    base = min(FIRST_RETRY_S * 2 ** max(attempts - 1, 0), MAX_RETRY_S)
    return base * random.uniform(0.8, 1.2)


def _describe(exc: BaseException) -> str:
    """An attempt's error without its URL (httpx's messages quote it)."""
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return "timed out"
    if isinstance(exc, RefusedAddress):
        return (
            "refused: its host resolves to no public address (BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS "
            "names the private networks receivers may be in)"
        )
    if isinstance(exc, socket.gaierror):
        return "its host name does not resolve"
    if isinstance(exc, httpx.ConnectError):
        return "connection failed"
    if isinstance(exc, WebhookSecretError):
        return str(exc)
    return type(exc).__name__


class Deliverer:
    def __init__(
        self,
        outbox: WebhookOutbox,
        endpoints: Callable[[str], list[WebhookConfig]],
        clock: Callable[[], datetime] = utc_now,
        workers: int = WORKERS,
        attempt_timeout_s: float = Settings.model_fields["webhook_attempt_timeout_s"].default,
        allowed_networks: tuple[Network, ...] = (),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.outbox = outbox
        self.endpoints = endpoints  # an event owner's endpoints, as its team's config says now
        self.clock = clock
        self.attempt_timeout_s = attempt_timeout_s
        self.allowed_networks = allowed_networks  # beside the public addresses
        # Made once, each attempt's client sharing it; the system's CAs unless given others.
        self.tls = tls or httpx.create_ssl_context(trust_env=False)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook")
        self.workers = workers
        self._in_flight: Counter[str] = Counter()  # events being sent, by owner
        self._lock = threading.Lock()

    @classmethod
    def of_deployment(cls, configured: Settings) -> Deliverer:
        """Events from the deployment's job store, to the endpoints its tenants file gives each team."""

        def team_endpoints(owner: str) -> list[WebhookConfig]:
            """The endpoints of the owner's team as the tenants file says now; none for an owner of no team."""
            registry = tenants_at(configured.tenants)
            team = registry.team_of_owner(owner) if registry is not None else None
            return list(team.config.webhooks) if team is not None else []

        return cls(
            WebhookOutbox(url=configured.job_store_url),
            team_endpoints,
            attempt_timeout_s=configured.webhook_attempt_timeout_s,
            allowed_networks=private_networks(configured.webhook_allow_private_networks),
        )

    def tick(self) -> list[Future[None]]:
        """Claim the due events there are free workers for (at most PER_TEAM_IN_FLIGHT a team) and send each
        in a worker; returns their futures (the loop does not wait for them)."""
        with self._lock:
            free = self.workers - sum(self._in_flight.values())
            in_flight = dict(self._in_flight)
        if free <= 0:
            return []
        events = self.outbox.claim_due(self.clock(), free, LEASE, PER_TEAM_IN_FLIGHT, in_flight)
        futures = []
        for event in events:
            with self._lock:
                self._in_flight[event.owner] += 1
            futures.append(self.pool.submit(self._send, event))
        return futures

    def run(self, stop: threading.Event) -> None:
        logger.info("delivering webhook events (%d workers)", self.workers)
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # the store unreachable for a moment: the next tick tries again
                logger.warning("could not read the webhook outbox: %s", type(exc).__name__)
            stop.wait(POLL_S)
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _send(self, event: WebhookEvent) -> None:
        try:
            self._attempt(event)
        except Exception as exc:  # never lose the worker; the lease retries the event
            logger.warning("webhook event %s: %s", event.event_id, type(exc).__name__)
        finally:
            with self._lock:
                self._in_flight[event.owner] -= 1
                if self._in_flight[event.owner] <= 0:
                    del self._in_flight[event.owner]

    def _attempt(self, event: WebhookEvent) -> None:
        configs = [(i, c) for i, c in enumerate(self.endpoints(event.owner)) if event.type in c.events]
        now = self.clock()
        if not configs:
            self.outbox.record_attempt(event, event.delivered_to, "unsubscribed", None, None, now)
            return
        delivered = set(event.delivered_to)
        due = [(index, config) for index, config in configs if config.endpoint_id not in delivered]
        errors = []
        for (index, config), status in zip(due, asyncio.run(self._post_all(due, event)), strict=True):
            if isinstance(status, BaseException):
                errors.append(f"webhooks[{index}]: {_describe(status)}")
            elif 200 <= status < 300:
                delivered.add(config.endpoint_id)
            else:
                note = " (redirects are not followed)" if 300 <= status < 400 else ""
                errors.append(f"webhooks[{index}]: HTTP {status}{note}")
        now = self.clock()
        if not errors:
            self.outbox.record_attempt(event, delivered, "delivered", None, None, now)
            return
        error = "; ".join(errors)
        give_up_at = event.created_at + RETRY_WINDOW
        if now >= give_up_at:
            logger.warning("webhook event %s of %s given up after %d attempts: %s", event.event_id,
                           event.owner, event.attempts, error)  # fmt: skip
            self.outbox.record_attempt(event, delivered, "failed", error, None, now)
            return
        retry_at = min(now + timedelta(seconds=retry_delay(event.attempts)), give_up_at)
        logger.info("webhook event %s attempt %d: %s", event.event_id, event.attempts, error)
        self.outbox.record_attempt(event, delivered, "pending", error, retry_at, now)

    async def _post_all(
        self, endpoints: list[tuple[int, WebhookConfig]], event: WebhookEvent
    ) -> list[int | BaseException]:
        """The event POSTed to these endpoints at once: each one's status, or what failed it. An attempt
        takes at most `attempt_timeout_s` however many endpoints, and a slow one delays no other."""
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            follow_redirects=False,
            trust_env=False,
            verify=self.tls,
        ) as client:
            posts = (self._post(client, config, event) for _, config in endpoints)
            return await asyncio.gather(*posts, return_exceptions=True)

    async def _post(self, client: httpx.AsyncClient, config: WebhookConfig, event: WebhookEvent) -> int:
        # Signed at the wall clock's time, which the receiver checks against its own (5 minutes' tolerance).
        headers = signed_headers(signer(config), event.event_id, event.payload, utc_now())
        url = httpx.URL(config.url)
        host = url.raw_host.decode("ascii")  # IDNA-encoded, or an IP address without brackets
        # httpx's timeouts are per read and write: a receiver that sends a byte every few seconds would hold
        # the worker for ever. This one bounds the whole request, from the lookup to the status line.
        async with asyncio.timeout(self.attempt_timeout_s):
            port = url.port or (443 if url.scheme == "https" else 80)
            address = await connectable_address(host, port, self.allowed_networks)
            # Sent to the address checked: the URL's host is the Host header, TLS's SNI and what its
            # certificate is checked against.
            headers["host"] = url.netloc.decode("ascii")
            extensions = {"sni_hostname": host} if url.scheme == "https" else {}
            target = url.copy_with(host=address)
            payload = event.payload.encode()
            async with client.stream(
                "POST", target, content=payload, headers=headers, extensions=extensions
            ) as response:
                return response.status_code  # the body is not read: a receiver cannot make it hold us
