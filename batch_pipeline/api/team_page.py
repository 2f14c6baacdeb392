"""The team page: a team watches its jobs in a browser with its own key, without the Dagster UI (which is for
operators). Rendered on the server from the job service, as the API's routes answer; no framework, no CDN,
and one small script that refreshes what is still running.

- `GET /team`: the caller's jobs, newest first, paged (an admin's: every team's, each with its team); its
  usage, as `GET /v2/usage` answers it; its quotas, each limit beside what is used.
- `GET /team/jobs/{job_id}`: a job's fields, progress, errors, and a link to its output.
- `GET /team/jobs/{job_id}/status`: `{"job": ...}` as `GET /v2/batch-completions/{job_id}` answers it, which
  the page polls while the job runs.
- `GET /team/jobs/{job_id}/output`: the job's output file, opened as its owner's jobs open it (the path policy).
- `GET`, `POST /team/login`; `POST /team/logout`: the session.

A browser cannot send `x-api-key`, so a login form exchanges the key for a session cookie: HttpOnly,
SameSite=Strict, Secure over https, for `/team` only, for 8 hours. The cookie holds no key: it is signed
with a secret of the deployment, kept in the Dagster instance's database (which every API replica shares),
over the key's sha256, so a key taken out of the tenants file ends its sessions at once. Only these routes
read the cookie (the API's never do, so no other site can have a browser act on the API through it), and
each POST carries a CSRF token. Scripts may send the key as the API takes it instead of logging in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from typing import IO, Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from batch_pipeline.admission.submission import stored_bytes_of
from batch_pipeline.api.auth import OPEN_ACCESS, ApiKeys, Caller, presented_key
from batch_pipeline.api.service import BatchJobService, JobNotFound
from batch_pipeline.api.team_page_assets import TEAM_CSS, TEAM_JS
from batch_pipeline.api.usage import team_label, usage_report
from batch_pipeline.contract import BatchCompletionsJob, BatchCompletionsJobStatus, GetBatchCompletionV2Response
from batch_pipeline.core.io import InputFileError, iter_json_records
from batch_pipeline.store.quotas import QuotaStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.sharing import SharingStore
from batch_pipeline.tenancy.tenants import Team

SESSION_COOKIE = "batch_pipeline_team_session"
CSRF_COOKIE = "batch_pipeline_team_login_csrf"
SESSION_TTL_S = 8 * 3600
LOGIN_FORM_TTL_S = 3600
JOBS_PER_PAGE = 50
# A job's page lists its first error entries, reading at most this many entries of its output to find them:
# the page costs the same whatever the output's size.
ERRORS_SHOWN, ENTRIES_SCANNED = 20, 20_000
MAX_KEY_CHARS = 4096
MAX_FORM_BYTES = 16 * 1024
_SESSION_PURPOSE = b"batch_pipeline team page session"
_SECRET_NAME = "batch_pipeline/team_page/session_secret"
_ENDED_PREFIX = "batch_pipeline/team_page/sessions_ended_until/"
_CHUNK = 1 << 16

# What the browser may do with these pages: only this origin's own script, style and requests; no frame,
# no plugin, no inline code, no form sent elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends its own form POSTs with `Origin: null`, as a foreign one's.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/team", include_in_schema=False)


# --- markup: every value is escaped unless it is markup made here --------------------------------------


class Html(str):
    """Markup built by this module; any other str put into a template is escaped."""


def html(template: str, **values: object) -> Html:
    return Html(template.format(**{name: _escaped(value) for name, value in values.items()}))


def _escaped(value: object) -> str:
    return value if isinstance(value, Html) else escape("" if value is None else str(value), quote=True)


def joined(parts: Iterable[Html]) -> Html:
    return Html("".join(parts))


# --- sessions --------------------------------------------------------------------------------------------


def deployment_secret(service: BatchJobService) -> bytes:
    """The secret the deployment's sessions are signed with: made on first use and kept in the Dagster
    instance's key-value store, which every API replica shares and only the control plane reads (a tenants
    file's digests alone, a ConfigMap in a cluster, sign nothing). Read at each use: should two replicas
    make one at the same instant, the one kept wins everywhere (the other's few sessions log in again)."""
    storage = service.instance.run_storage
    if (found := storage.get_cursor_values({_SECRET_NAME}).get(_SECRET_NAME)) is None:
        storage.set_cursor_values({_SECRET_NAME: secrets.token_hex(32)})
        found = storage.get_cursor_values({_SECRET_NAME})[_SECRET_NAME]
    return bytes.fromhex(found)


def _mac(secret: bytes, digest: bytes, expires: int, nonce: str) -> str:
    signed = hmac.new(secret, b"%s\x00%s\x00%d\x00%s" % (_SESSION_PURPOSE, digest, expires, nonce.encode()), "sha256")
    return base64.urlsafe_b64encode(signed.digest()).decode().rstrip("=")


def new_session(secret: bytes, presented: bytes, now: float) -> str:
    """A session of the key `presented` (already identified): `expires.nonce.mac`, the mac of the
    deployment's secret over the key's sha256 (the digest the tenants file keeps), expiry and nonce."""
    expires, nonce = int(now) + SESSION_TTL_S, secrets.token_urlsafe(16)
    return f"{expires}.{nonce}.{_mac(secret, hashlib.sha256(presented).digest(), expires, nonce)}"


def session_caller(
    keys: ApiKeys, secret: bytes, token: str, now: float, ended_until: Callable[[bytes], int] = lambda _: 0
) -> Caller | None:
    """Whom a session acts for: the key whose digest it was signed over, if that key is still valid, the
    session has not expired and its key's sessions were not ended since it was made (`ended_until(digest)`:
    the expiry of the last session logged out with that key); else None. Every key's mac is compared, in
    constant time."""
    found = _session_key(keys, secret, token, now)
    if found is None or int(token.split(".", 1)[0]) <= ended_until(found[0]):
        return None
    return found[1]


def _session_key(keys: ApiKeys, secret: bytes, token: str, now: float) -> tuple[bytes, Caller] | None:
    parts = token.split(".")
    if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 12 or len(parts[1]) > 64:
        return None
    expires, nonce, mac = int(parts[0]), parts[1], parts[2]
    if not now < expires <= now + SESSION_TTL_S:
        return None
    found = None
    for digest, caller in keys.key_digests():
        if hmac.compare_digest(_mac(secret, digest, expires, nonce), mac) and found is None:
            found = (digest, caller)
    return found


def _ended_until(service: BatchJobService) -> Callable[[bytes], int]:
    """A key's sessions ended by a log out, as the instance's key-value store (which every replica shares)
    keeps them: a session copied before its log out opens nothing after it."""

    def ended(digest: bytes) -> int:
        name = _ENDED_PREFIX + digest.hex()
        return int(service.instance.run_storage.get_cursor_values({name}).get(name) or 0)

    return ended


def _logout_token(session: str) -> str:
    """The logout form's CSRF token: bound to the session, and only readable on this origin's pages."""
    return hashlib.sha256(f"logout\x00{session}".encode()).hexdigest()


def page_caller(request: Request) -> Caller | None:
    """Whom the key the request sends (as the API takes it) acts for, else the session's; None: neither."""
    keys: ApiKeys = request.app.state.api_keys
    if keys.is_open:
        return OPEN_ACCESS
    if presented := presented_key(request):  # a key sent on purpose says who calls, whatever the cookie
        return keys.identify(presented)
    if not (token := request.cookies.get(SESSION_COOKIE)):
        return None
    service = request.app.state.job_service
    return session_caller(keys, deployment_secret(service), token, time.time(), _ended_until(service))


def _same_origin(request: Request) -> bool:
    """A form POST from this origin's own page: browsers say where a request comes from (Sec-Fetch-Site,
    Origin); one that says another site is refused whatever its token."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.url.netloc}"


def _secured(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def _page(
    title: str, body: Html, caller: Caller | None = None, session: str | None = None, status: int = 200
) -> Response:
    who = Html("")
    if caller is not None and caller is not OPEN_ACCESS:
        who = html('<span class="who">{who}</span>', who=_caller_name(caller))
        if session is not None:
            who = html(
                '{who}<form method="post" action="/team/logout"><input type="hidden" name="csrf" value="{csrf}">'
                '<button type="submit">Log out</button></form>',
                who=who,
                csrf=_logout_token(session),
            )
    document = html(
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
        '<link rel="stylesheet" href="/team/static/team.css"><script src="/team/static/team.js" defer></script>'
        '</head><body><header><h1><a href="/team">batch_pipeline</a> · {title}</h1>{who}</header>'
        "<main>{body}</main></body></html>",
        title=title,
        who=who,
        body=body,
    )
    return _secured(HTMLResponse(document, status_code=status))


def _caller_name(caller: Caller) -> str:
    if caller.is_admin:
        return "admin: every team"
    return f"team {team_label(caller.owner)}"


def _to_login() -> Response:
    return _secured(RedirectResponse("/team/login", status_code=303))


def _unauthenticated() -> Response:
    # No WWW-Authenticate: a browser would prompt for basic auth instead of showing the login.
    return _secured(JSONResponse({"detail": "log in at /team/login, or send an API key"}, status_code=401))


def _login_form(request: Request, message: str | None = None, status: int = 200) -> Response:
    csrf = secrets.token_urlsafe(32)
    notice = html('<p class="notice">{message}</p>', message=message) if message else Html("")
    body = html(
        '<form class="login" method="post" action="/team/login"><h2>Your team\'s jobs</h2>{notice}'
        '<label for="key">API key</label><input type="password" id="key" name="key" autocomplete="current-password" '
        'required autofocus><input type="hidden" name="csrf" value="{csrf}"><button type="submit">Log in</button>'
        '<p class="muted">The key your team sends the API as <code>x-api-key</code>. The session lasts 8 hours.</p>'
        "</form>",
        notice=notice,
        csrf=csrf,
    )
    response = _page("log in", body, status=status)
    response.set_cookie(
        CSRF_COOKIE,
        csrf,
        max_age=LOGIN_FORM_TTL_S,
        path="/team",
        httponly=True,
        samesite="strict",
        secure=_https(request),
    )
    return response


async def _small_form(request: Request) -> dict[str, str] | None:
    """A URL-encoded form of at most MAX_FORM_BYTES, else None. Read before anyone is known: a client
    sending megabytes to the login holds no more than this."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        fields = parse_qs(body.decode(), max_num_fields=8, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return None
    return {name: values[0] for name, values in fields.items()}


def _https(request: Request) -> bool:
    return request.url.scheme == "https"


# --- routes ----------------------------------------------------------------------------------------------


@router.get("/static/team.css")
def stylesheet() -> Response:
    return _secured(Response(TEAM_CSS, media_type="text/css"))


@router.get("/static/team.js")
def script() -> Response:
    return _secured(Response(TEAM_JS, media_type="text/javascript"))


@router.get("/login")
def login_form(request: Request) -> Response:
    return _login_form(request)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await _small_form(request)
    if form is None:
        return _login_form(request, f"the form: at most {MAX_FORM_BYTES} bytes, URL-encoded", 413)
    csrf, cookie = form.get("csrf"), request.cookies.get(CSRF_COOKIE)
    if not _same_origin(request) or not (
        isinstance(csrf, str) and cookie and hmac.compare_digest(csrf.encode(), cookie.encode())
    ):
        return _login_form(request, "csrf: the form has expired or came from another site; log in again", 403)
    key = form.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        return _login_form(request, f"key: an API key of 1 to {MAX_KEY_CHARS} characters is required", 422)
    keys: ApiKeys = request.app.state.api_keys
    presented = key.encode()
    if keys.is_open or keys.identify(presented) is None:
        message = "key: no key is needed here" if keys.is_open else "key: not a valid API key"
        return _login_form(request, message, 401 if not keys.is_open else 400)
    response = _secured(RedirectResponse("/team", status_code=303))
    response.set_cookie(
        SESSION_COOKIE,
        new_session(deployment_secret(request.app.state.job_service), presented, time.time()),
        max_age=SESSION_TTL_S,
        path="/team",
        httponly=True,
        samesite="strict",
        secure=_https(request),
    )
    response.delete_cookie(CSRF_COOKIE, path="/team")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    form = await _small_form(request) or {}
    session, csrf = request.cookies.get(SESSION_COOKIE), form.get("csrf")
    if not session or not isinstance(csrf, str) or not _same_origin(request):
        return _secured(JSONResponse({"detail": "csrf: log out from the team page's own form"}, status_code=403))
    if not hmac.compare_digest(csrf.encode(), _logout_token(session).encode()):
        return _secured(JSONResponse({"detail": "csrf: log out from the team page's own form"}, status_code=403))
    service = request.app.state.job_service
    if (
        found := _session_key(request.app.state.api_keys, deployment_secret(service), session, time.time())
    ) is not None:
        # Every session of this key made up to this one ends (one a copy of the cookie kept too).
        name, until = _ENDED_PREFIX + found[0].hex(), int(session.split(".", 1)[0])
        service.instance.run_storage.set_cursor_values({name: str(max(until, _ended_until(service)(found[0])))})
    response = _to_login()
    response.delete_cookie(SESSION_COOKIE, path="/team", httponly=True, samesite="strict", secure=_https(request))
    return response


@router.get("")
def team_page(
    request: Request,
    status: BatchCompletionsJobStatus | None = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    caller = page_caller(request)
    if caller is None:
        return _to_login()
    service: BatchJobService = request.app.state.job_service
    jobs, next_after = service.list(caller, status, None, JOBS_PER_PAGE, after)
    records = {job.job_id: service.store.get(job.job_id) for job in jobs}
    body = joined(
        [
            html("<h2>Jobs</h2>{filters}", filters=_status_filter(status)),
            _jobs_table(jobs, records, caller),
            _pager(status, after, next_after),
            _usage_section(service, caller),
            _quotas_section(service, caller),
        ]
    )
    return _page("jobs", body, caller, request.cookies.get(SESSION_COOKIE))


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str) -> Response:
    caller = page_caller(request)
    if caller is None:
        return _to_login()
    service: BatchJobService = request.app.state.job_service
    try:
        job = service.get(caller, job_id)
        record = service.store.get(job_id)  # None: deleted since
    except JobNotFound:
        record = None
    if record is None:
        return _page("no such job", html("<p>No job {job_id} of yours.</p>", job_id=job_id[:100]), caller, status=404)
    output = JobOutput.of(service, record)
    body = joined([_job_summary(job, record, caller, output), _errors_section(job, output)])
    return _page(f"job {job_id}", body, caller, request.cookies.get(SESSION_COOKIE))


@router.get("/jobs/{job_id}/status")
def job_status(request: Request, job_id: str) -> Response:
    caller = page_caller(request)
    if caller is None:
        return _unauthenticated()
    service: BatchJobService = request.app.state.job_service
    try:
        job = service.get(caller, job_id)
    except JobNotFound:
        return _secured(JSONResponse({"detail": f"no batch job {job_id[:100]!a}"}, status_code=404))
    return _secured(JSONResponse(GetBatchCompletionV2Response(job=job).model_dump(mode="json", by_alias=True)))


@router.get("/jobs/{job_id}/output")
def job_output(request: Request, job_id: str) -> Response:
    caller = page_caller(request)
    if caller is None:
        return _unauthenticated()
    service: BatchJobService = request.app.state.job_service
    try:
        service.get(caller, job_id)  # someone else's job is absent, as on every route
    except JobNotFound:
        return _secured(JSONResponse({"detail": f"no batch job {job_id[:100]!a}"}, status_code=404))
    record = service.store.get(job_id)
    output = JobOutput.of(service, record) if record is not None else None
    handle = output.open() if output is not None else None
    if handle is None:
        why = output.missing if output is not None else "no such job"
        return _secured(JSONResponse({"detail": f"the job has no output to download: {why}"}, status_code=404))
    headers = {"Content-Disposition": f'attachment; filename="{job_id}.json"'}
    return _secured(StreamingResponse(_chunks(handle), media_type="application/octet-stream", headers=headers))


def _chunks(handle: IO[bytes]) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(_CHUNK):
            yield chunk


# --- a job's output --------------------------------------------------------------------------------------


@dataclass
class JobOutput:
    """A job's output file, as its owner's jobs open it: the path policy of the job's team as it is now
    (a root taken out of the tenants file is no longer served), beneath the root with no symlink followed.
    `missing` says why there is none to open."""

    service: BatchJobService
    record: JobRecord
    path: str
    missing: str | None

    @classmethod
    def of(cls, service: BatchJobService, record: JobRecord) -> JobOutput:
        path = record.request.get("output_data_path")
        if not isinstance(path, str) or not path:
            return cls(service, record, "", "its request names no output")
        # A stopped job's kept results are its output, written whole (keep_partial_results).
        if record.status != JobStatus.COMPLETED and not (record.results and record.results.num_finished is not None):
            return cls(service, record, path, f"the job is {record.status.value}")
        own_dir = service.job_storage.work_dir(record.job_id).rstrip("/") + "/"
        in_own_dir = path.startswith(own_dir) and ".." not in path.split("/")  # an OpenAI batch's, placed there
        if not in_own_dir and (why := service.admission.paths_for(record.owner).data_path_refusal(path)):
            return cls(service, record, path, f"its path is no longer one its team may read: {why}")
        return cls(service, record, path, None)

    def _open(self, path: str, mode: str = "rb") -> IO[Any]:
        own_dir = self.service.job_storage.work_dir(self.record.job_id)
        return self.service.admission.data_files(self.record.owner, own_dir).open(path, mode)

    def open(self) -> IO[bytes] | None:
        if self.missing is not None:
            return None
        try:
            return self._open(self.path)
        except (OSError, ValueError) as exc:  # gone, or a symlink on the way (refused, never followed)
            self.missing = f"it cannot be opened ({type(exc).__name__})"
            return None

    def errors(self) -> tuple[list[tuple[int, dict[str, Any]]], int, bool]:
        """The first error entries (index, error) of the output, the entries read, and whether all were."""
        found: list[tuple[int, dict[str, Any]]] = []
        scanned = 0
        if self.missing is not None:
            return found, scanned, False
        try:
            for scanned, (_, entry) in enumerate(iter_json_records(self.path, self._open), start=1):
                if isinstance(entry, dict) and isinstance(entry.get("error"), dict):
                    found.append((scanned - 1, entry["error"]))
                if len(found) >= ERRORS_SHOWN or scanned >= ENTRIES_SCANNED:
                    return found, scanned, False
        except (OSError, ValueError, InputFileError):
            return found, scanned, False
        return found, scanned, True


# --- sections --------------------------------------------------------------------------------------------


def _when(moment: datetime | str | None) -> str:
    if moment is None:
        return "—"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _labels(labels: dict[str, str]) -> Html:
    return joined(html('<span class="label">{key}: {value}</span>', key=k, value=v) for k, v in labels.items())


def _progress(job: BatchCompletionsJob) -> Html:
    meta = job.metadata or {}
    # A finished job's row may hold only its output's count.
    total = meta.get("requests_total") or meta.get("num_requests")
    done = meta.get("requests_done") or (total if job.status == BatchCompletionsJobStatus.COMPLETED else "0")
    text = f"{done}/{total}" if total else ""
    bar = html('<progress max="{total}" value="{done}"></progress> ', total=total, done=done) if total else Html("")
    # Where a job that has not ended is (`starting engine`, `generating 3/10`, ...); empty once it has.
    return html(
        '{bar}<span data-field="progress">{text}</span> <span class="phase" data-field="phase">{phase}</span>',
        bar=bar,
        text=text,
        phase=meta.get("phase", ""),
    )


def _error_summary(job: BatchCompletionsJob, cut: int | None = None) -> str:
    """Why the job failed or is being retried, and how many of its requests have an error entry."""
    meta = job.metadata or {}
    parts = []
    if reason := meta.get("failure_reason"):
        parts.append(reason if cut is None or len(reason) <= cut else reason[:cut] + "…")
    if retrying := meta.get("retrying_after"):
        parts.append(f"retrying after: {retrying}")
    if (errors := meta.get("num_errors")) and errors != "0":
        parts.append(f"{errors} request{'s' if errors != '1' else ''} with an error entry")
    return "; ".join(parts)


def _status_filter(status: BatchCompletionsJobStatus | None) -> Html:
    links = [html('<a href="/team">{text}</a>', text="all") if status else Html("<strong>all</strong>")]
    for choice in BatchCompletionsJobStatus:
        if choice == status:
            links.append(html("<strong>{name}</strong>", name=choice.value))
        else:
            links.append(html('<a href="/team?status={name}">{name}</a>', name=choice.value))
    return html('<p class="pager">{links}</p>', links=joined(links))


def _pager(status: BatchCompletionsJobStatus | None, after: str | None, next_after: str | None) -> Html:
    query = f"status={status.value}&" if status else ""
    first = html('<a href="/team?{query}">newest</a>', query=query) if after else Html("")
    more = (
        html('<a href="/team?{query}after={after}">older →</a>', query=query, after=next_after)
        if next_after
        else Html("")
    )
    return html('<p class="pager">{first}{more}</p>', first=first, more=more)


def _jobs_table(jobs: list[BatchCompletionsJob], records: dict[str, JobRecord | None], caller: Caller) -> Html:
    if not jobs:
        return Html('<p class="muted">No jobs.</p>')
    head = "<th>team</th>" if caller.is_admin else ""
    rows = []
    for job in jobs:
        record = records.get(job.job_id)
        owner = html("<td>{team}</td>", team=team_label(record.owner) if record else "?") if caller.is_admin else ""
        rows.append(
            html(
                '<tr data-job-id="{id}" data-status="{status}"><td class="mono"><a href="/team/jobs/{id}">{id}</a></td>'
                '{owner}<td><span class="status" data-field="status">{status}</span></td><td>{progress}</td>'
                "<td>{model}</td><td>{priority}</td><td>{created}</td><td>{started}</td><td>{ended}</td>"
                '<td class="wrap">{labels}</td><td class="wrap error">{errors}</td></tr>',
                id=job.job_id,
                owner=Html(owner),
                status=job.status.value,
                progress=_progress(job),
                model=job.model_cfg.model,
                priority=job.priority or "",
                created=_when(job.created_at),
                started=_when(record.started_at if record else None),
                ended=_when(job.completed_at),
                labels=_labels(record.labels if record else {}),
                errors=_error_summary(job, cut=300),
            )
        )
    return html(
        "<table><thead><tr><th>job</th>{head}<th>status</th><th>progress</th><th>model</th><th>priority</th>"
        "<th>created (UTC)</th><th>started</th><th>ended</th><th>labels</th><th>errors</th></tr></thead>"
        "<tbody>{rows}</tbody></table>",
        head=Html(head),
        rows=joined(rows),
    )


def _job_summary(job: BatchCompletionsJob, record: JobRecord, caller: Caller, output: JobOutput) -> Html:
    fields: list[tuple[str, object]] = [("progress", _progress(job))]
    if caller.is_admin:
        fields.append(("team", team_label(record.owner)))
    fields += [
        ("model", job.model_cfg.model),
        ("priority", job.priority or ""),
        ("labels", _labels(record.labels)),
        ("input", job.input_data_path or "inline content"),
        ("output", job.output_data_path),
        ("created (UTC)", _when(job.created_at)),
        ("started", _when(record.started_at)),
        ("ended", _when(job.completed_at)),
        ("expires", _when(job.expires_at)),
    ]
    rows = [
        html(
            '<tr><th>status</th><td><span class="status" data-field="status">{status}</span></td></tr>',
            status=job.status.value,
        )
    ]
    rows += [html('<tr><th>{name}</th><td class="wrap">{value}</td></tr>', name=n, value=v) for n, v in fields]
    download = (
        html('<p><a href="/team/jobs/{id}/output" download>Download the output</a></p>', id=job.job_id)
        if output.missing is None
        else html('<p class="muted">No output to download: {why}.</p>', why=output.missing)
    )
    metadata = joined(
        html('<tr><th>{key}</th><td class="wrap mono">{value}</td></tr>', key=key, value=value)
        for key, value in sorted((job.metadata or {}).items())
        if key != "labels"
    )
    # While it runs the page follows it, and shows its output and errors once it has ended.
    return html(
        '<div data-job-id="{id}" data-status="{status}" data-reload-when-done="true"><table>{rows}</table></div>'
        "{download}<h2>Metadata</h2><table>{metadata}</table>",
        id=job.job_id,
        status=job.status.value,
        rows=joined(rows),
        download=download,
        metadata=metadata,
    )


def _errors_section(job: BatchCompletionsJob, output: JobOutput) -> Html:
    summary = _error_summary(job)
    entries, scanned, whole = output.errors()
    if not entries:
        listed = Html("") if summary else Html('<p class="muted">No errors.</p>')
    else:
        rows = joined(
            html(
                '<tr><td class="num">{index}</td><td>{code}</td><td>{param}</td><td class="wrap">{message}</td></tr>',
                index=index,
                code=error.get("code", ""),
                param=error.get("param") or "",
                message=str(error.get("message", ""))[:1000],
            )
            for index, error in entries
        )
        scope = "" if whole else f" (the first {len(entries)} found in its first {scanned} entries)"
        listed = html(
            "<p>Error entries of the output{scope}:</p><table><thead><tr><th>index</th><th>code</th><th>param</th>"
            "<th>message</th></tr></thead><tbody>{rows}</tbody></table>",
            scope=scope,
            rows=rows,
        )
    notice = html('<p class="notice">{summary}</p>', summary=summary) if summary else Html("")
    return html("<h2>Errors</h2>{notice}{listed}", notice=notice, listed=listed)


def _usage_section(service: BatchJobService, caller: Caller) -> Html:
    report = usage_report(service.reports, service.admission.teams(), caller)
    columns = ("jobs", "requests", "prompt_tokens", "completion_tokens", "gpu_seconds", "stored_bytes")
    head = joined(html("<th>{name}</th>", name=name) for name in columns)
    teams = joined(
        html(
            '<tr><td>{team}</td>{cells}<td class="num">{now}</td></tr>',
            team=team.team,
            cells=joined(html('<td class="num">{v}</td>', v=getattr(team, name)) for name in columns),
            now=team.stored_bytes_now,
        )
        for team in report.teams
    )
    days = joined(
        html(
            "<tr><td>{day}</td><td>{team}</td>{cells}</tr>",
            day=day.day,
            team=day.team,
            cells=joined(html('<td class="num">{v}</td>', v=getattr(day, name)) for name in columns),
        )
        for day in reversed(report.days)
    )
    return html(
        '<h2>Usage</h2><p class="muted">From {since} to {until}, as <code>GET /v2/usage</code> answers it.</p>'
        "<table><thead><tr><th>team</th>{head}<th>stored_bytes_now</th></tr></thead><tbody>{teams}</tbody></table>"
        "<h2>Usage per UTC day</h2><table><thead><tr><th>day</th><th>team</th>{head}</tr></thead>"
        "<tbody>{days}</tbody></table>",
        since=_when(report.since.replace("Z", "+00:00")),
        until=_when(report.until.replace("Z", "+00:00")),
        head=head,
        teams=teams,
        days=days or Html('<tr><td colspan="8" class="muted">Nothing used.</td></tr>'),
    )


def _quotas_section(service: BatchJobService, caller: Caller) -> Html:
    registry = service.admission.teams()
    if registry is None:
        return Html('<h2>Quotas</h2><p class="muted">No tenants file: no team and no quota.</p>')
    if caller.is_admin:
        teams = list(registry.teams.values())
    else:
        own = registry.team_of_owner(caller.owner)
        teams = [own] if own is not None else []
    holding = SharingStore(engine=service.store.engine).slot_holders()
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = joined(_quota_row(service, team, holding, midnight) for team in teams)
    return html(
        "<h2>Quotas</h2><table><thead><tr><th>team</th><th>weight</th><th>queued / max_queued_jobs</th>"
        "<th>running / max_running_jobs</th><th>tokens today (UTC) / max_tokens_per_day</th>"
        "<th>stored bytes / max_stored_bytes</th><th>max_priority</th><th>retention_days</th></tr></thead>"
        "<tbody>{rows}</tbody></table>",
        rows=rows,
    )


def _quota_row(service: BatchJobService, team: Team, holding: dict[str, int], midnight: datetime) -> Html:
    config, quotas = team.config, QuotaStore(engine=service.store.engine)
    stored = stored_bytes_of(service.store, team.owner, team)
    stored_now = stored.stored if stored is not None else None

    def used(value: int | None, limit: int | None) -> str:
        shown = "—" if value is None else str(value)
        return f"{shown} / {'no limit' if limit is None else limit}"

    return html(
        '<tr><td>{team}</td><td class="num">{weight}</td><td>{queued}</td><td>{running}</td><td>{tokens}</td>'
        "<td>{stored}</td><td>{priority}</td><td>{retention}</td></tr>",
        team=team.name,
        weight=f"{config.weight:g}",
        queued=used(quotas.count_queued(team.owner), config.max_queued_jobs),
        running=used(holding.get(team.owner, 0), config.max_running_jobs),
        tokens=used(quotas.tokens_since(team.owner, midnight), config.max_tokens_per_day),
        stored=used(stored_now, config.max_stored_bytes),
        priority="no cap" if config.max_priority is None else config.max_priority,
        retention="the deployment's" if config.retention_days is None else config.retention_days,
    )
