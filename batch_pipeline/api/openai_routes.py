"""OpenAI's Batch API (files and batches) as thin routes over `OpenAIBatchService`, answering errors in
OpenAI's shape so the `openai` SDK reads them (`OpenAI(base_url=".../v1", api_key=KEY)`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message

from batch_pipeline.admission.submission import QuotaExceeded, StoredBytes
from batch_pipeline.api.auth import Caller
from batch_pipeline.api.body import WireBodyRoute
from batch_pipeline.api.errors import ErrorShape, ShapedRoute, validation_problems
from batch_pipeline.api.limits import MULTIPART_MARGIN
from batch_pipeline.api.openai_service import BatchNotFound, FileNotFound, InvalidOpenAIRequest, OpenAIBatchService
from batch_pipeline.contract import BatchCompletionsEstimate
from batch_pipeline.contract.openai_batch import (
    MAX_EXPIRES_AFTER_S,
    MIN_EXPIRES_AFTER_S,
    Batch,
    BatchList,
    CreateBatchRequest,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FilePurpose,
    OpenAIErrorBody,
    OpenAIFile,
)
from batch_pipeline.core.slots import SlotsBusy
from batch_pipeline.dry_run.estimate import DryRunsBusy

# OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, for every error of these routes
# (their 422s answered 400, as OpenAI answers an invalid parameter), so the SDK raises its typed errors.
openai_errors = ErrorShape("OpenAI")


class OpenAIRoute(WireBodyRoute, ShapedRoute):
    error_shape = openai_errors


def _caller(request: Request) -> Caller:
    return request.app.state.api_keys.authenticate(request)


def _service(request: Request) -> OpenAIBatchService:
    return request.app.state.openai_service


CallerDep = Annotated[Caller, Depends(_caller)]
ServiceDep = Annotated[OpenAIBatchService, Depends(_service)]
_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 413)}
router = APIRouter(prefix="/v1", tags=["OpenAI Batch API"], responses=_ERRORS, route_class=OpenAIRoute)

_UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary", "description": "the JSONL input"},
                    "purpose": {"type": "string", "enum": ["batch"]},
                    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                    "expires_after[seconds]": {
                        "type": "integer",
                        "minimum": MIN_EXPIRES_AFTER_S,
                        "maximum": MAX_EXPIRES_AFTER_S,
                        "description": "the file expires this many seconds after its creation (as the openai SDK "
                        "sends `expires_after`; a JSON object in a field `expires_after` is read too)",
                    },
                },
            }
        }
    },
}


@router.post(
    "/files",
    response_model=OpenAIFile,
    openapi_extra={"requestBody": _UPLOAD_BODY},
    responses={429: {"model": OpenAIErrorBody, "description": "The upload would take the team past max_stored_bytes"}},
)
async def upload_file(request: Request, who: CallerDep, service: ServiceDep):
    """Upload a batch input file (multipart `file` and `purpose=batch`), at most
    BATCH_PIPELINE_MAX_FILE_BYTES (200 MB); spooled to disk as it arrives, never held whole. Past the
    team's max_stored_bytes: 429, as soon as the body is known to be too large."""
    # The caller was authenticated (a dependency) before any of the body was read.
    quota = await run_in_threadpool(service.stored_bytes, who)
    if quota is not None:
        request = _within_room(request, quota)
    async with request.form(max_files=1, max_fields=8) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidOpenAIRequest("file", "a multipart field `file` holding the JSONL is required")
        if not isinstance(purpose, str):
            raise InvalidOpenAIRequest("purpose", "a multipart field `purpose` (batch) is required")
        expires_after = _expires_after(form)
        return await run_in_threadpool(service.upload, who, upload.filename or "", purpose, upload.file, expires_after)


def _expires_after(form: FormData) -> ExpiresAfter | None:
    """An upload's `expires_after`: the fields `expires_after[anchor]` and `expires_after[seconds]` (as the
    openai SDK sends it), or a JSON object in `expires_after`; InvalidOpenAIRequest names a bad field."""
    fields: dict[str, Any] = {}
    for name in ("anchor", "seconds"):
        value = form.get(f"expires_after[{name}]")
        if value is not None:
            if not isinstance(value, str):
                raise InvalidOpenAIRequest(f"expires_after.{name}", f"expires_after.{name}: must be a form field")
            fields[name] = value
    whole = form.get("expires_after")
    if whole is not None:
        if fields or not isinstance(whole, str):
            raise InvalidOpenAIRequest("expires_after", "expires_after: give it once, as a JSON object")
        try:
            fields = json.loads(whole[:1024])
        except (ValueError, RecursionError):  # 1,000 "[" nest past the parser's stack
            raise InvalidOpenAIRequest("expires_after", "expires_after: must be a JSON object") from None
        if not isinstance(fields, dict):
            raise InvalidOpenAIRequest("expires_after", "expires_after: must be a JSON object")
    if not fields:
        return None
    try:
        return ExpiresAfter.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = ".".join(["expires_after", *(str(part) for part in error["loc"])])
        raise InvalidOpenAIRequest(param, f"{param}: {error['msg']}") from None


def _within_room(request: Request, quota: StoredBytes) -> Request:
    """The upload's request, refused (QuotaExceeded) once its body is known to hold more than the team's
    room: by its declared length, else as soon as that much has arrived; from then on the body is read
    and dropped, never spooled, and answered 429 once it ends (answered while the client still sends, it
    could see its connection reset; BodySizeLimit and BodyTimeouts bound the reading as any other's). The
    body's other parts get the margin BodySizeLimit gives them; the exact check is the upload's own, once
    the file's size is known."""
    most = quota.room + MULTIPART_MARGIN
    declared = request.headers.get("content-length", "")
    received = int(declared) if declared.isdigit() and int(declared) > most else 0

    async def counted() -> Message:
        nonlocal received
        if received > most:  # known too large before any of it was read
            await _drain(request.receive)
            raise quota.refusal(received - MULTIPART_MARGIN, "this upload", at_least=True)
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > most:  # starlette's parser closes (deletes) the part of the file spooled so far
                if message.get("more_body", False):
                    await _drain(request.receive)
                raise quota.refusal(received - MULTIPART_MARGIN, "this upload", at_least=True)
        return message

    return Request(request.scope, counted)


async def _drain(receive: Callable[[], Awaitable[Message]]) -> None:
    """The rest of a body, read and dropped (until its end, or the client has gone)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


@router.get("/files", response_model=FileList)
def list_files(
    who: CallerDep,
    service: ServiceDep,
    purpose: FilePurpose | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
):
    files, more = service.list_files(who, purpose, limit, after)
    return FileList(
        data=files, first_id=files[0].id if files else None, last_id=files[-1].id if files else None, has_more=more
    )


@router.get("/files/{file_id}", response_model=OpenAIFile)
def get_file(file_id: str, who: CallerDep, service: ServiceDep):
    return service.get_file(who, file_id)


@router.get("/files/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, who: CallerDep, service: ServiceDep):
    """The file's bytes, streamed."""
    file, chunks = service.file_chunks(who, file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={"Content-Length": str(file.bytes)})


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, who: CallerDep, service: ServiceDep):
    return service.delete_file(who, file_id)


@router.post(
    "/batches",
    response_model=Batch | BatchCompletionsEstimate,
    responses={429: {"model": OpenAIErrorBody, "description": "dry_run: too many dry runs at once"}},
)
def create_batch(
    body: CreateBatchRequest,
    who: CallerDep,
    service: ServiceDep,
    dry_run: Annotated[
        bool,
        Query(
            description=(
                "Create nothing: check the input file as a batch's is checked (a file that does not validate is a 400 "
                "naming its lines), read and tokenize its requests as the job would, and answer a "
                "BatchCompletionsEstimate (requests, prompt tokens, the requests that cannot run, the most output "
                "tokens, the wall time and machine hours at this deployment's measured throughput for the model)."
            )
        ),
    ] = False,
):
    """Check the input file (each error in the batch's `errors`, with its line) and queue its job."""
    try:  # a batch's model check reads a model as a dry run does, in the same slots
        return service.estimate_batch(who, body) if dry_run else service.create_batch(who, body)
    except DryRunsBusy as exc:
        return openai_error(429, str(exc), code="rate_limit_exceeded")


@router.get("/batches", response_model=BatchList)
def list_batches(
    who: CallerDep,
    service: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
):
    batches, more = service.list_batches(who, limit, after)
    return BatchList(
        data=batches,
        first_id=batches[0].id if batches else None,
        last_id=batches[-1].id if batches else None,
        has_more=more,
    )


@router.get("/batches/{batch_id}", response_model=Batch)
def get_batch(batch_id: str, who: CallerDep, service: ServiceDep):
    return service.get_batch(who, batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
def cancel_batch(batch_id: str, who: CallerDep, service: ServiceDep):
    return service.cancel_batch(who, batch_id)


def openai_error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: Literal["invalid_request_error", "authentication_error"] = "invalid_request_error",
) -> Response:
    body = OpenAIErrorBody.model_validate({"error": {"message": message, "type": kind, "param": param, "code": code}})
    return JSONResponse(status_code=status, content=body.model_dump())


@openai_errors.renders(RequestValidationError)
async def _invalid_parameter(_: Request, exc: RequestValidationError) -> Response:
    # As OpenAI answers an invalid parameter: a 400 naming the first one.
    first = validation_problems(exc)[0]
    param = ".".join(str(part) for part in first.loc[1:]) or None
    return openai_error(400, f"{param or 'the request'}: {first.msg}", param=param)


@openai_errors.renders(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
    kind: Literal["invalid_request_error", "authentication_error"] = (
        "authentication_error" if exc.status_code == 401 else "invalid_request_error"
    )
    response = openai_error(exc.status_code, str(exc.detail), kind=kind)
    response.headers.update(exc.headers or {})
    return response


@openai_errors.renders(SlotsBusy)
async def _busy(_: Request, exc: SlotsBusy) -> Response:
    response = openai_error(429, str(exc), code="rate_limit_exceeded")
    response.headers["Retry-After"] = "5"
    return response


@openai_errors.renders(QuotaExceeded)
async def _over_quota(_: Request, exc: QuotaExceeded) -> Response:
    # As OpenAI answers a rate limit.
    response = openai_error(429, str(exc), param=exc.param, code="rate_limit_exceeded")
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


@openai_errors.renders(FileNotFound)
async def _no_file(_: Request, exc: FileNotFound) -> Response:
    return openai_error(404, f"No such File object: {exc.args[0][:100]!a}", param=exc.param)


@openai_errors.renders(BatchNotFound)
async def _no_batch(_: Request, exc: BatchNotFound) -> Response:
    return openai_error(404, f"No such Batch object: {exc.args[0][:100]!a}", param="batch_id")


@openai_errors.renders(InvalidOpenAIRequest)
async def _invalid(_: Request, exc: InvalidOpenAIRequest) -> Response:
    return openai_error(400, str(exc), param=exc.param)
