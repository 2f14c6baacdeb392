"""Request bodies parsed by pydantic straight from their bytes, spooled to disk while they arrive.

FastAPI's own path holds a body several times over (the chunks, their join, `json.loads`' objects, the
validated model, the errors echoing the input), and parses it on the event loop. Here a body is written
to a temporary file as it streams in, read back once, and validated from JSON in a worker thread, so the
API holds about one copy of a body plus its model, and `/healthz` answers while large bodies parse.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from batch_pipeline.api.limits import LargeBodySlots, TeamBodies, TeamBusy
from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.json_values import MAX_BODY_VALUES, values_past

# Bodies up to this size stay in memory while they arrive; larger ones go to a temporary file. Small: a team
# may have BATCH_PIPELINE_MAX_BODIES_PER_TEAM bodies arriving at once, each for minutes if it trickles.
SPOOL_IN_MEMORY_BYTES = 64 * 1024
# A parsed body costs a few times its size (its model, the stored JSON): bodies over LARGE_BODY_BYTES are
# parsed and handled in a few slots (BATCH_PIPELINE_MAX_CONCURRENT_LARGE_BODIES), shared fairly between
# teams (api/limits.py), so concurrent large POSTs queue instead of adding up past the pod's memory limit;
# small ones never wait. pydantic holds the GIL while it validates: more parsing threads would add no speed.
LARGE_BODY_BYTES = 8 * 1024 * 1024


class WireBodyRoute(APIRoute):
    """A route whose wire-model body is authenticated for, then read and validated as described above;
    FastAPI's handler (dependencies, the route, its OpenAPI document) then gets the validated model.

    Every request with a body, on any of these routes (file uploads too), first takes one of its team's
    places (BATCH_PIPELINE_MAX_BODIES_PER_TEAM, `TeamBodies`), held while its body arrives (where FastAPI
    reads it, an upload's form: until it is answered); beyond them, its body is read and dropped, never
    held, then answered 429. A body sent whole holds its place for no time: 200 concurrent small POSTs of
    one team never had more than one place held at once."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _wire_body_model(self)

        async def count_then_handle(request: Request) -> Response:
            if not _has_body(request):
                return await handler(request)
            # The caller is known before the body is read: no one without a key makes the API parse 64 MB.
            team = request.app.state.api_keys.authenticate(request).owner
            bodies: TeamBodies = request.app.state.large_body_slots.bodies
            try:
                bodies.enter(team)
            except TeamBusy as exc:
                return await _drained_then_refused(request, str(exc))
            arriving = _Arriving(bodies, team)
            try:
                if model is None or not _declares_json(request):
                    return await handler(request)  # FastAPI's own reading (an upload's form, a non-JSON body)
                return await parse_then_handle(request, team, model, arriving)
            finally:
                arriving.done()

        async def parse_then_handle(
            request: Request, team: str, model: type[BaseModel], arriving: _Arriving
        ) -> Response:
            large_bodies: LargeBodySlots = request.app.state.large_body_slots
            with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
                body = _LargeBodyPlace(large_bodies, team)
                try:
                    if _declared_length(request) > LARGE_BODY_BYTES:
                        body.enter()  # before any of it is read
                    await _receive_into(spool, request, body)
                    arriving.done()  # arrived: its place goes to the team's next body while this one parses
                    if body.refused is not None:
                        raise HTTPException(status_code=429, detail=body.refused, headers={"Retry-After": "5"})
                    if not body.entered:
                        parsed = await run_in_threadpool(_parse_spooled, spool, model)
                        return await handler(_ParsedBodyRequest(request, parsed))
                    if not await _slot_unless_client_leaves(large_bodies, team, request):
                        return Response(status_code=400)  # the client left while it waited; no one reads this
                    try:
                        parsed = await run_in_threadpool(_parse_spooled, spool, model)
                        return await handler(_ParsedBodyRequest(request, parsed))
                    finally:
                        large_bodies.release(team)
                except ClientDisconnect:
                    return Response(status_code=400)  # the client left (or a size or time limit answered)
                finally:
                    body.leave()

        return count_then_handle


class _Arriving:
    """A body's place among its team's bodies (TeamBodies), given up once, when it has arrived or is answered."""

    def __init__(self, bodies: TeamBodies, team: str) -> None:
        self.bodies = bodies
        self.team = team
        self.held = True

    def done(self) -> None:
        if self.held:
            self.held = False
            self.bodies.leave(self.team)


async def _drained_then_refused(request: Request, detail: str) -> Response:
    """The body read to its end and dropped, then a 429: answered before it is read, a client still sending
    could see its connection reset. BodyTimeouts and BodySizeLimit bound the reading as any other's."""
    try:
        async for _ in request.stream():
            pass
    except ClientDisconnect:
        return Response(status_code=400)  # the client left (or a size or time limit answered)
    raise HTTPException(status_code=429, detail=detail, headers={"Retry-After": "5"})


def _has_body(request: Request) -> bool:
    declared = request.headers.get("content-length")
    if declared is not None:
        return declared.strip() not in ("", "0")
    return "transfer-encoding" in request.headers


class _LargeBodyPlace:
    """A body's place among its team's large bodies, taken once it is known to be large: from its declared
    length, or once as many bytes have arrived. Refused, the rest of the body is read and dropped, then
    answered 429: answered before it is read, a client still sending could see its connection reset."""

    def __init__(self, slots: LargeBodySlots, team: str) -> None:
        self.slots = slots
        self.team = team
        self.entered = False
        self.refused: str | None = None

    def enter(self) -> None:
        if self.entered or self.refused is not None:
            return
        try:
            self.slots.enter(self.team)
        except TeamBusy as exc:
            self.refused = str(exc)
        else:
            self.entered = True

    def leave(self) -> None:
        if self.entered:
            self.slots.leave(self.team)
            self.entered = False


async def _slot_unless_client_leaves(slots: LargeBodySlots, team: str, request: Request) -> bool:
    """Waits on the event loop for one of the large-body slots; False, holding none, if the client leaves
    first (its place and its turn then go to the next)."""
    got_slot = False
    async with anyio.create_task_group() as waiting:

        async def until_client_leaves() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            waiting.cancel_scope.cancel()

        waiting.start_soon(until_client_leaves)
        await slots.acquire(team)
        got_slot = True
        waiting.cancel_scope.cancel()
    return got_slot


def parse_json_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, or a RequestValidationError whose locations start with `body`."""
    if (where := values_past(raw, MAX_BODY_VALUES)) is not None:
        raise RequestValidationError(
            [
                {
                    "type": "too_many_values",
                    "loc": ("body", *where.split(".")) if where else ("body",),
                    "msg": f"the body holds more than {MAX_BODY_VALUES} JSON values (numbers, strings, arrays "
                    "and objects), most of them here; send a job this large by input_data_path",
                    "input": None,
                }
            ]
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if any(error["type"] == "json_invalid" for error in errors):
        errors = _named_errors(raw, model) or errors
    raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in errors])


def _named_errors(raw: bytes, model: type[BaseModel]) -> list[ErrorDetails] | None:
    """pydantic's JSON parser refuses some documents Python's reads (lone surrogate escapes, numbers of
    hundreds of digits, nesting past 200 levels) with a position only; read by Python's parser, the
    contract refuses the same value naming its field. None when that names nothing better."""
    try:
        model.model_validate(json.loads(raw))
    except ValidationError as exc:
        return exc.errors(include_url=False, include_input=False, include_context=False)
    except (ValueError, RecursionError):  # not JSON to Python either, or too deep for it
        return None
    return None


class _ParsedBodyRequest(Request):
    """The request as FastAPI's handler sees it: its JSON is the validated model, the bytes are gone."""

    def __init__(self, request: Request, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._parsed = parsed

    async def body(self) -> bytes:
        return b"{}"  # FastAPI only asks whether there is a body; the bytes were released once parsed

    async def json(self) -> Any:
        return self._parsed


async def _receive_into(spool: Any, request: Request, body: _LargeBodyPlace) -> int:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > LARGE_BODY_BYTES:
            body.enter()
        if body.refused is None:
            spool.write(chunk)
    return size


def _declared_length(request: Request) -> int:
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else 0


def _parse_spooled(spool: Any, model: type[BaseModel]) -> BaseModel:
    spool.seek(0)
    return parse_json_body(spool.read(), model)  # the bytes live only while they are parsed


def _wire_body_model(route: APIRoute) -> type[BaseModel] | None:
    params = route.dependant.body_params
    if len(params) != 1:
        return None
    annotation = params[0].field_info.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, WireModel) else None


def _declares_json(request: Request) -> bool:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return True  # FastAPI reads a body without a content type as JSON too
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))
