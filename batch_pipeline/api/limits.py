"""Limits on what one client or one team can hold of the API: a body's size, a slow client's connection,
and the slots large bodies are parsed in.

uvicorn bounds neither the time a client takes to send a request's head nor its body, nor the time it may leave
a response unread: the head and the unread response are bounded by `HTTPProtocolWithHeadTimeout` (serve.py
runs uvicorn with it), the body by `BodyTimeouts`. The protocol takes its `ConnectionTimeouts` from the app
it serves: `create_app`'s lifespan puts them in the state uvicorn hands each connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from batch_pipeline.core.settings import Settings

# A multipart body's boundaries and part headers around an upload of the largest size.
MULTIPART_MARGIN = 64 * 1024


class BodySizeLimit:
    """Answers 413 when a body is over `max_bytes`, whether it declares its length or streams chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Routes whose bodies are streamed to storage, never parsed whole (file uploads), by exact path.
        self.larger = larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.larger[path] + MULTIPART_MARGIN if path in self.larger else self.max_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, limit)
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Answer now; to the app the client has gone, and whatever it sends is dropped.
                    refused = True
                    await self._refuse(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Send, limit: int) -> None:
        body = b'{"detail":"request body too large (limit %d bytes)"}' % limit
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class BodyTimeouts:
    """Answers 408 and closes the connection when a request body pauses longer than `idle_s` between chunks
    or takes longer than `total_s` in all: a client trickling a body cannot hold a connection (and whatever
    the route holds while it reads) for ever. To the app, such a client has gone."""

    def __init__(self, app: ASGIApp, idle_s: float, total_s: float) -> None:
        self.app = app
        self.idle_s = idle_s
        self.total_s = total_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.total_s
        body_complete = False
        timed_out = False
        response_started = False

        async def timed_receive() -> Message:
            nonlocal body_complete, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_complete:  # waiting for the client to leave (a route watching for it): no bound
                return await receive()
            with anyio.move_on_after(min(self.idle_s, max(0.0, deadline - anyio.current_time()))):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_complete = True
                return message
            timed_out = True
            if not response_started:
                await _answer(send, 408, b'{"detail":"the request body did not arrive in time"}', close=True)
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if timed_out:
                return
            response_started = True
            await send(message)

        await self.app(scope, timed_receive, guarded_send)


async def _answer(send: Send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # uvicorn closes the connection after a response that says so
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class ConnectionTimeouts:
    head_s: float  # to send a request's line and headers (BATCH_PIPELINE_HEADER_TIMEOUT_S)
    write_s: float  # to read down the server's unread writes (BATCH_PIPELINE_WRITE_TIMEOUT_S)

    @classmethod
    def of_deployment(cls, configured: Settings) -> ConnectionTimeouts:
        return cls(head_s=configured.header_timeout_s, write_s=configured.write_timeout_s)

    def lifespan(self) -> Callable[[object], contextlib.AbstractAsyncContextManager[Mapping[str, object]]]:
        """An app's lifespan that hands these to the server's connections (as its state)."""

        @contextlib.asynccontextmanager
        async def serving(app: object) -> AsyncIterator[Mapping[str, object]]:
            yield {_TIMEOUTS_STATE: self}

        return serving


_TIMEOUTS_STATE = "batch_pipeline.connection_timeouts"


def _served_timeouts(app_state: Mapping[str, object]) -> ConnectionTimeouts:
    timeouts = app_state.get(_TIMEOUTS_STATE)
    if not isinstance(timeouts, ConnectionTimeouts):  # uvicorn run with --lifespan off, or another app
        raise RuntimeError("HTTPProtocolWithHeadTimeout serves create_app's app, with its lifespan on")
    return timeouts


class _HeadTimeout:
    """Closes a connection whose client has not sent a whole request head (request line and headers) within
    BATCH_PIPELINE_HEADER_TIMEOUT_S of connecting, or of the previous response (slowloris). uvicorn's own
    keep-alive timeout only runs between a response and the next request's first byte."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    app_state: dict[str, object]
    cycle: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timeout_s = _served_timeouts(self.app_state).head_s
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # before: a pipelined request already read is started by the call below
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        # A request whose head arrived (the newest cycle) is the app's and the body timeouts' to bound.
        waiting_for_a_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_a_head and not self.transport.is_closing():
            self.transport.close()


class _WriteTimeout:
    """Aborts a connection whose client has left the server's writes unread for BATCH_PIPELINE_WRITE_TIMEOUT_S
    (a slow reader). uvicorn stops a response while the transport's buffer is over its high-water mark
    (`pause_writing`, then FlowControl's `drain` waits) until the client reads it down (`resume_writing`), and
    bounds none of it: a client that never read held its response's buffered chunks (2 MiB of a file's
    content) for ever. Aborted, not closed: `close` would wait for the unread buffer to be sent."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    app_state: dict[str, object]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._write_timeout_s = _served_timeouts(self.app_state).write_s
        self._write_deadline: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self._write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_deadline()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_write_deadline()  # uvicorn resumes its writers itself, without `resume_writing`
        super().connection_lost(exc)  # type: ignore[misc]

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_timed_out(self) -> None:
        self._write_deadline = None
        self.transport.abort()  # connection_lost follows: the response's sends return, its buffer is dropped


class H11WithHeadTimeout(_HeadTimeout, _WriteTimeout, H11Protocol):
    pass


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn picks h11 without httptools, and so do we
    HTTPProtocolWithHeadTimeout: type[asyncio.Protocol] = H11WithHeadTimeout
else:

    class HttpToolsWithHeadTimeout(_HeadTimeout, _WriteTimeout, HttpToolsProtocol):
        pass

    HTTPProtocolWithHeadTimeout = HttpToolsWithHeadTimeout


class TeamBusy(Exception):
    """The team already has as many bodies (or large bodies) in this process as it may."""


class TeamBodies:
    """How many request bodies each team has arriving in this process: at most `per_team` (`enter`; beyond
    it, TeamBusy). Every body holds memory while it arrives (up to SPOOL_IN_MEMORY_BYTES, then a temporary
    file) and may take BATCH_PIPELINE_BODY_TIMEOUT_S to: unbounded, one team's trickled bodies of 8 MiB or
    less added up past the pod's memory limit. Thread-safe."""

    def __init__(
        self,
        per_team: int,
        refusal: str = "request bodies arriving here (BATCH_PIPELINE_MAX_BODIES_PER_TEAM); send this one again "
        "when one has arrived",
    ) -> None:
        self.per_team = per_team
        self._refusal = refusal
        self._lock = threading.Lock()
        self._entered: dict[str, int] = {}

    def enter(self, team: str) -> None:
        with self._lock:
            if self._entered.get(team, 0) >= self.per_team:
                raise TeamBusy(f"your team has {self.per_team} {self._refusal}")
            self._entered[team] = self._entered.get(team, 0) + 1

    def leave(self, team: str) -> None:
        with self._lock:
            self._entered[team] -= 1
            if not self._entered[team]:
                del self._entered[team]

    def count(self, team: str) -> int:
        with self._lock:
            return self._entered.get(team, 0)


class _Waiter:
    def __init__(self) -> None:
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.granted = False  # set under the lock, when a slot is taken for it


class LargeBodySlots:
    """The slots bodies over 8 MiB are parsed in, shared between teams, waited for on the event loop (never in
    a worker thread: 40 threads waiting for one slot once left none to parse it, and every `def` route hung).

    A team has at most `per_team` large bodies here at once, arriving, waiting or parsing (`enter`; beyond it,
    TeamBusy); of the `slots`, a team holds at most half, rounded up; a freed slot goes to the next team in
    turn that waits, so one team's queue never stands in front of another team's body. Thread-safe: the
    state is guarded by a lock, and a waiter is woken on its own event loop. `bodies` counts every body of
    each team's, of any size (TeamBodies): the app holds both on `app.state.large_body_slots`."""

    def __init__(
        self,
        slots: int,
        per_team: int,
        bodies_per_team: int = Settings.model_fields["max_bodies_per_team"].default,
    ) -> None:
        self.slots = slots
        self.per_team = per_team
        self.bodies = TeamBodies(bodies_per_team)
        self.held_per_team = math.ceil(slots / 2)
        self._lock = threading.Lock()
        self._free = slots
        self._large = TeamBodies(
            per_team,
            "bodies over 8 MiB in progress here (BATCH_PIPELINE_MAX_LARGE_BODIES_PER_TEAM); send this one again "
            "when one is answered",
        )
        self._held: dict[str, int] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()  # teams with waiters, the next to be served first

    @classmethod
    def of_deployment(cls, configured: Settings) -> LargeBodySlots:
        return cls(
            configured.max_concurrent_large_bodies,
            configured.max_large_bodies_per_team,
            configured.max_bodies_per_team,
        )

    def enter(self, team: str) -> None:
        self._large.enter(team)

    def leave(self, team: str) -> None:
        self._large.leave(team)

    async def acquire(self, team: str) -> None:
        """A slot for `team`, once it is the team's turn. Cancelled (the client left), it frees its place."""
        with self._lock:
            if self._free and self._held.get(team, 0) < self.held_per_team:
                self._take(team)
                return
            waiter = _Waiter()
            self._waiting.setdefault(team, deque()).append(waiter)
            if team not in self._turns:
                self._turns.append(team)
        try:
            await waiter.woken
        except asyncio.CancelledError:
            with self._lock:
                if not waiter.granted:
                    self._forget(team, waiter)
            if waiter.granted:  # given a slot as it was cancelled: the slot goes to the next in turn
                self.release(team)
            raise

    def release(self, team: str) -> None:
        with self._lock:
            self._held[team] -= 1
            if not self._held[team]:
                del self._held[team]
            self._free += 1
            self._hand_on()

    def counts(self, team: str) -> tuple[int, int, int]:
        """The team's large bodies here, slots held and bodies waiting for one."""
        with self._lock:
            return self._large.count(team), self._held.get(team, 0), len(self._waiting.get(team, ()))

    def _take(self, team: str) -> None:
        self._free -= 1
        self._held[team] = self._held.get(team, 0) + 1

    def _forget(self, team: str, waiter: _Waiter) -> None:
        queue = self._waiting.get(team)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[team]
                self._turns.remove(team)

    def _hand_on(self) -> None:
        """Free slots to waiting teams in turn, each within its share (called with the lock held)."""
        passed = 0  # teams looked at in a row that could take nothing
        while self._free and self._turns and passed < len(self._turns):
            team = self._turns.popleft()
            queue = self._waiting[team]
            if self._held.get(team, 0) < self.held_per_team:
                waiter = queue.popleft()
                try:
                    waiter.woken.get_loop().call_soon_threadsafe(_wake, waiter.woken)
                except RuntimeError:  # its event loop has closed: no one waits there any more
                    pass
                else:
                    self._take(team)
                    waiter.granted = True
                    passed = 0
            else:
                passed += 1
            if queue:
                self._turns.append(team)  # its next body waits for the team's next turn
            else:
                del self._waiting[team]


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
