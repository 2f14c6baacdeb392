"""The HTTP API of Scale LLM Engine's batch completions, as thin routes over `BatchJobService`.

uvicorn --factory batch_pipeline.api.app:create_app
"""

import json
from typing import Annotated, Any

import dagster as dg
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from batch_pipeline.admission.submission import QuotaExceeded, from_v1
from batch_pipeline.api import openai_routes, team_page
from batch_pipeline.api.auth import ApiKeys, Caller
from batch_pipeline.api.body import WireBodyRoute
from batch_pipeline.api.errors import ErrorShape, ShapedRoute, answer_errors_in_route_shapes, validation_problems
from batch_pipeline.api.limits import BodySizeLimit, BodyTimeouts, ConnectionTimeouts, LargeBodySlots
from batch_pipeline.api.metrics import metrics_text
from batch_pipeline.api.offline_docs import add_offline_docs, swagger_assets_dir
from batch_pipeline.api.openai_service import OpenAIBatchService
from batch_pipeline.api.result_cache import UnknownTeam, cache_figures, cache_owner, empty_cache
from batch_pipeline.api.service import (
    BatchJobService,
    ForbiddenTeam,
    IdempotencyConflict,
    JobNotFound,
    ResumeConflict,
    UnservableRequest,
)
from batch_pipeline.api.usage import InvalidUsageQuery, usage_report
from batch_pipeline.api.webhooks import job_webhooks
from batch_pipeline.contract import (
    BatchCompletionsEstimate,
    BatchCompletionsJob,
    BatchCompletionsJobStatus,
    CancelBatchCompletionsV2Response,
    CreateBatchCompletionsV1Request,
    CreateBatchCompletionsV1Response,
    CreateBatchCompletionsV2Request,
    GetBatchCompletionV2Response,
    ListBatchCompletionV2Response,
    UpdateBatchCompletionsV2Request,
    UpdateBatchCompletionsV2Response,
)
from batch_pipeline.contract.priority import InvalidPriority
from batch_pipeline.contract.result_cache import ResultCacheEmptied, ResultCacheFigures
from batch_pipeline.contract.usage import UsageResponse
from batch_pipeline.contract.webhooks import WebhookEventsResponse
from batch_pipeline.core.settings import settings
from batch_pipeline.core.slots import SlotsBusy
from batch_pipeline.dry_run.estimate import DryRunsBusy
from batch_pipeline.openai_batch.jobs import BatchApiLimits
from batch_pipeline.pipeline.service_paths import secure_service_paths
from batch_pipeline.store.jobs import JobStore


class AsciiJSONResponse(JSONResponse):
    """Errors can quote what a client sent (a key, a path); escaped to ASCII, any of it can be rendered."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _unprocessable(problems: list[tuple[str, str]]) -> JSONResponse:
    """The same shape as FastAPI's own validation errors, so clients parse one format."""
    detail = [
        {"loc": ["body", *field.split(".")], "msg": message, "type": "value_error"} for field, message in problems
    ]
    return AsciiJSONResponse(status_code=422, content={"detail": detail})


# Scale's error shape: FastAPI's `{"detail": ...}`, a 422's detail a list of problems naming their fields.
scale_errors = ErrorShape("Scale")


@scale_errors.renders(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> Response:
    detail = [problem.model_dump() for problem in validation_problems(exc)]
    return AsciiJSONResponse(status_code=422, content={"detail": detail})


@scale_errors.renders(InvalidPriority)
async def _bad_priority(_: Request, exc: InvalidPriority) -> Response:
    return _unprocessable([("priority", str(exc))])


@scale_errors.renders(UnservableRequest)
async def _unservable(_: Request, exc: UnservableRequest) -> Response:
    return _unprocessable(exc.refused)


@scale_errors.renders(JobNotFound)
async def _not_found(_: Request, exc: JobNotFound) -> Response:
    return AsciiJSONResponse(status_code=404, content={"detail": f"no batch job {exc.args[0][:100]!a}"})


@scale_errors.renders(IdempotencyConflict, ResumeConflict)
async def _conflict(_: Request, exc: Exception) -> Response:
    return AsciiJSONResponse(status_code=409, content={"detail": str(exc)})


@scale_errors.renders(SlotsBusy)
async def _busy(_: Request, exc: SlotsBusy) -> Response:
    return AsciiJSONResponse(status_code=429, content={"detail": str(exc)}, headers={"Retry-After": "5"})


@scale_errors.renders(QuotaExceeded)
async def _over_quota(_: Request, exc: QuotaExceeded) -> Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    return AsciiJSONResponse(status_code=429, content={"detail": str(exc)}, headers=headers)


scale_errors.renders(StarletteHTTPException)(http_exception_handler)


class ScaleRoute(WireBodyRoute, ShapedRoute):
    error_shape = scale_errors


def current_caller(request: Request) -> Caller:
    return request.app.state.api_keys.authenticate(request)


def job_service(request: Request) -> BatchJobService:
    return request.app.state.job_service


class ErrorBody(BaseModel):
    detail: str


# What the routes answer besides success and FastAPI's 422, so clients (and the OpenAPI document) know.
# Typed as FastAPI's `responses` parameter takes them.
_Responses = dict[int | str, dict[str, Any]]
_UNAUTHORIZED: _Responses = {
    401: {"model": ErrorBody, "description": "API keys are configured and none valid was sent"}
}
_NOT_FOUND: _Responses = {404: {"model": ErrorBody, "description": "No such job, or not one of the caller's"}}
_TOO_LARGE: _Responses = {413: {"model": ErrorBody, "description": "The body exceeds BATCH_PIPELINE_MAX_BODY_BYTES"}}
_FORBIDDEN: _Responses = {403: {"model": ErrorBody, "description": "Not an admin key"}}
_CONFLICT: _Responses = {
    409: {"model": ErrorBody, "description": "The Idempotency-Key was used before with a different request"}
}

CallerDep = Annotated[Caller, Depends(current_caller)]
ServiceDep = Annotated[BatchJobService, Depends(job_service)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=256)]
router = APIRouter(responses=_UNAUTHORIZED, route_class=ScaleRoute)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    # On the event loop itself: it answers even while every worker thread is busy with large bodies.
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses=_FORBIDDEN)
def metrics(who: CallerDep, service: ServiceDep) -> Response:
    """Prometheus' text format: jobs by status and model, queue depth and age, start latency, requests and
    tokens generated. Every tenant's figures: admin keys only (Prometheus sends one as basic_auth's user)."""
    if not who.is_admin:
        raise HTTPException(status_code=403, detail="an admin key is required")
    text = metrics_text(service.reports, service.admission.teams(), service.engine_pool_dir)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@router.post(
    "/v1/llm/batch-completions", response_model=CreateBatchCompletionsV1Response, responses=_TOO_LARGE | _CONFLICT
)
def create_v1(
    body: CreateBatchCompletionsV1Request, who: CallerDep, service: ServiceDep, idempotency_key: IdempotencyKey = None
):
    try:
        job = service.create(who, from_v1(body), idempotency_key)
    except DryRunsBusy as exc:  # the model check at submission reads a model as a dry run does
        raise HTTPException(status_code=429, detail=str(exc), headers={"Retry-After": "5"}) from None
    return CreateBatchCompletionsV1Response(job_id=job.job_id)


@router.post(
    "/v2/batch-completions",
    response_model=BatchCompletionsJob | BatchCompletionsEstimate,
    responses=_TOO_LARGE
    | _CONFLICT
    | {
        429: {
            "model": ErrorBody,
            "description": "dry_run: as many dry runs as the server takes at once are in progress; retry shortly",
        }
    },
)
def create_v2(
    body: CreateBatchCompletionsV2Request,
    who: CallerDep,
    service: ServiceDep,
    idempotency_key: IdempotencyKey = None,
    dry_run: Annotated[
        bool,
        Query(
            description=(
                "Create nothing: check the request as a submission is checked, read and tokenize its prompts as the "
                "job would, and answer a BatchCompletionsEstimate: the requests and prompt tokens, the requests that "
                "cannot run (with their index and why), the most output tokens, and the wall time and machine hours "
                "at the throughput this deployment measured on the model's completed jobs (or why there is none)."
            )
        ),
    ] = False,
):
    try:  # a submission's model check reads a model as a dry run does, in the same slots
        return service.estimate(who, body) if dry_run else service.create(who, body, idempotency_key)
    except DryRunsBusy as exc:
        raise HTTPException(status_code=429, detail=str(exc), headers={"Retry-After": "5"}) from None


@router.get(
    "/v2/batch-completions",
    response_model=ListBatchCompletionV2Response,
    responses={403: {"model": ErrorBody, "description": "A team's key naming another team"}},
)
def list_jobs(
    who: CallerDep,
    service: ServiceDep,
    status: BatchCompletionsJobStatus | None = None,
    label: Annotated[list[str] | None, Query(description="KEY:VALUE; repeat to require several")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="jobs per page")] = 100,
    after: Annotated[str | None, Query(description="the last_id of the previous page")] = None,
    team: Annotated[
        str | None,
        Query(
            description="Admin keys: that team's jobs alone (as their metadata.owner names it); a team's key: its "
            "own only"
        ),
    ] = None,
):
    """A page of the caller's jobs (an admin key: every team's, each with `metadata.owner`)."""
    wanted = {}
    for item in label or []:
        key, sep, value = item.partition(":")
        if not sep:
            raise HTTPException(
                422, detail=[{"loc": ["query", "label"], "msg": "expected KEY:VALUE", "type": "value_error"}]
            )
        wanted[key] = value
    try:
        jobs, next_after = service.list(who, status, wanted, limit, after, team)
    except ForbiddenTeam as exc:
        raise HTTPException(status_code=403, detail=str(exc)) from None
    last_id = jobs[-1].job_id if jobs else None
    return ListBatchCompletionV2Response(jobs=jobs, has_more=next_after is not None, last_id=last_id)


@router.get("/v2/batch-completions/{job_id}", response_model=GetBatchCompletionV2Response, responses=_NOT_FOUND)
def get_job(job_id: str, who: CallerDep, service: ServiceDep):
    return GetBatchCompletionV2Response(job=service.get(who, job_id))


@router.post(
    "/v2/batch-completions/{job_id}", response_model=UpdateBatchCompletionsV2Response, responses=_NOT_FOUND | _TOO_LARGE
)
def update_job(job_id: str, body: UpdateBatchCompletionsV2Request, who: CallerDep, service: ServiceDep):
    job, success = service.update_priority(who, job_id, body.priority)
    return UpdateBatchCompletionsV2Response(**job.model_dump(by_alias=True), success=success)


@router.post(
    "/v2/batch-completions/{job_id}/actions/cancel",
    response_model=CancelBatchCompletionsV2Response,
    response_model_exclude_none=True,  # `{"success": true}` as the spec's, a reason only when not
    responses=_NOT_FOUND,
)
def cancel_job(job_id: str, who: CallerDep, service: ServiceDep):
    return service.cancel_job(who, job_id)


@router.get("/v2/batch-completions/{job_id}/webhooks", response_model=WebhookEventsResponse, responses=_NOT_FOUND)
def job_webhooks_route(job_id: str, who: CallerDep, service: ServiceDep):
    """The delivery state of each webhook event of the job (its end, announced to its team's endpoints)."""
    return job_webhooks(service.store, who, job_id)


@router.post(
    "/v2/batch-completions/{job_id}/actions/resume",
    response_model=GetBatchCompletionV2Response,
    responses=_NOT_FOUND
    | {
        409: {
            "model": ErrorBody,
            "description": "The job cannot be resumed now, and why: it is queued, running or completed (only a "
            "failed, cancelled or expired job can be), its run is still stopping, or its checkpoints were deleted",
        },
        429: {
            "model": ErrorBody,
            "description": "max_queued_jobs: the job's team already has its quota of jobs waiting to start; a resume "
            "queues the job again, as a submission does (Retry-After says when to try again)",
        },
    },
)
def resume_job(job_id: str, who: CallerDep, service: ServiceDep, idempotency_key: IdempotencyKey = None):
    """Run a failed, cancelled or expired job (an OpenAI batch too: a batch is a job) again on the requests
    it has no result for: the finished ones are kept from its checkpoints, never generated again. The same
    job writes its same output path whole (a batch: its output and error files), its deadline renewed from
    `max_runtime_sec`; its metadata says `resumed_from` and the requests and tokens kept and generated.
    With an `Idempotency-Key` this job's last resume was made with, that resume is answered again."""
    return GetBatchCompletionV2Response(job=service.resume(who, job_id, idempotency_key))


@router.get(
    "/v2/usage",
    response_model=UsageResponse,
    responses={403: {"model": ErrorBody, "description": "A team's key naming another team"}},
)
def usage(
    who: CallerDep,
    service: ServiceDep,
    since: Annotated[
        str | None,
        Query(
            description="A date (its UTC day included) or an RFC 3339 datetime; default: 30 UTC days back, "
            "today included"
        ),
    ] = None,
    until: Annotated[
        str | None,
        Query(description="A date (its UTC day included) or an RFC 3339 datetime (excluded); default: now"),
    ] = None,
    team: Annotated[
        str | None, Query(description="Admin keys: that team's figures alone (a team's key: its own only)")
    ] = None,
):
    """Each team's usage per UTC day: a team's key reads its own team's, an admin key every team's (the
    tenants file's teams, `admins`, and `other`). The response schema defines each figure; at most 366
    days, and a bad `since` or `until` is a 422 naming it."""
    try:
        return usage_report(service.reports, service.admission.teams(), who, since, until, team)
    except InvalidUsageQuery as exc:
        raise HTTPException(
            422, detail=[{"loc": ["query", exc.field], "msg": str(exc), "type": "value_error"}]
        ) from None
    except ForbiddenTeam as exc:
        raise HTTPException(status_code=403, detail=str(exc)) from None


TeamQuery = Annotated[
    str | None, Query(description="Admin keys: that team's result cache (a team's key: its own only)")
]


def _cache_owner(who: CallerDep, service: ServiceDep, team: str | None) -> str:
    try:
        return cache_owner(who, service.admission.teams(), team)
    except ForbiddenTeam as exc:
        raise HTTPException(status_code=403, detail=str(exc)) from None
    except UnknownTeam as exc:
        raise HTTPException(422, detail=[{"loc": ["query", "team"], "msg": str(exc), "type": "value_error"}]) from None


@router.get(
    "/v2/result-cache",
    response_model=ResultCacheFigures,
    responses={403: {"model": ErrorBody, "description": "A team's key naming another team"}},
)
def get_result_cache(who: CallerDep, service: ServiceDep, team: TeamQuery = None):
    """What the team's result cache holds: its deterministic results kept from its completed jobs, which
    answer its later jobs' identical requests (docs: Result cache)."""
    return cache_figures(service.result_cache, _cache_owner(who, service, team))


@router.delete(
    "/v2/result-cache",
    response_model=ResultCacheEmptied,
    responses={403: {"model": ErrorBody, "description": "A team's key naming another team"}},
)
def delete_result_cache(who: CallerDep, service: ServiceDep, team: TeamQuery = None):
    """Empty the team's result cache: its later jobs generate every request again, and its stored bytes no
    longer count the cache. Jobs planned already keep what they took from it."""
    return empty_cache(service.result_cache, _cache_owner(who, service, team))


def create_app(service: BatchJobService | None = None, keys: ApiKeys | None = None) -> FastAPI:
    configured = settings()  # a mistyped variable fails the deployment, not the requests that read it
    secure_service_paths(configured)  # so does a wrong tenants file, or a service path inside a team's roots
    if service is None:
        store = JobStore(configured.job_store_url)
        service = BatchJobService.of_deployment(configured, store, dg.DagsterInstance.get())
    app = FastAPI(
        title="batch_pipeline",
        description="Scale LLM Engine batch completions on Dagster and vLLM",
        lifespan=ConnectionTimeouts.of_deployment(configured).lifespan(),
        docs_url=None,  # add_offline_docs: FastAPI's page loads its assets from a CDN
    )
    add_offline_docs(app, swagger_assets_dir())
    app.state.job_service = service
    app.state.openai_service = openai_service = OpenAIBatchService(service, BatchApiLimits.of_deployment(configured))
    app.state.api_keys = keys or ApiKeys.of_deployment(configured, service.admission)
    app.include_router(router)
    app.include_router(openai_routes.router)
    app.include_router(team_page.router)
    answer_errors_in_route_shapes(app, default=scale_errors, shapes=[openai_routes.openai_errors])
    app.state.large_body_slots = LargeBodySlots.of_deployment(configured)
    app.add_middleware(
        BodySizeLimit, max_bytes=configured.max_body_bytes, larger={"/v1/files": openai_service.limits.max_file_bytes}
    )
    # Outermost: it bounds the client's receive that the others read.
    app.add_middleware(BodyTimeouts, idle_s=configured.body_idle_timeout_s, total_s=configured.body_timeout_s)
    return app
