"""The Dagster UI for operators only: the webserver behind a login no team's key opens.

Whoever reaches a bare Dagster webserver can launch, re-execute and terminate any team's runs and read every
run's config (paths, prompts' files, chat templates, labels) and logs. So no bare webserver listens anywhere:

    python -m batch_pipeline.entrypoints.dagster_ui -w workspace.yaml [--host 127.0.0.1] [--port 3000]

serves Dagster's own webserver app in this process, behind `OperatorsOnly` (`make serve` runs this line), and

    python -m batch_pipeline.entrypoints.dagster_ui --upstream http://dagster-webserver-read-only:80 --port 8080

is the same gate as a reverse proxy, for Kubernetes (k8s/dagster-ui.yaml), where the chart's webservers admit
this proxy's pods alone (k8s/network-policy.yaml).

An operator signs in with HTTP basic auth, the password being an operator key: an admin key of the tenants
file (BATCH_PIPELINE_TENANTS), or, locally, the key `serve` keeps in `$DAGSTER_HOME/operator.key` (made on
first start, readable by the service's user only). A team's key opens nothing here: teams watch their jobs on
the API's team page.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from batch_pipeline.core.settings import SettingsError, settings
from batch_pipeline.tenancy.tenants import TenantsFileError, tenants_at

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPERATOR_KEY_FILE = "operator.key"
REALM = "batch_pipeline operators (an admin key)"
# Signed in, a browser is sent on to `next`: with the key in a sign-in URL's user info, the UI's own pages
# then load from URLs without it (the page's scripts cannot fetch from a URL that holds credentials).
SIGN_IN_PATH = "/_operators/sign-in"
DEFAULT_LIVE_DATA_POLL_RATE_MS = 2000
GRAPHQL_PATH = "/graphql"  # dagster-webserver's --live-data-poll-rate default
# Methods a browser sends cross-site without asking the server first: they change nothing.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Hop-by-hop headers (RFC 9110 7.6.1) and the operator's credentials stay at the gate.
_NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "authorization", "host", "content-length"}
)  # fmt: skip


def operator_key(home: str | os.PathLike[str]) -> str:
    """The deployment's local operator key, made once (0600, the service user's) in DAGSTER_HOME."""
    path = Path(home) / OPERATOR_KEY_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_private(path)
    key = secrets.token_urlsafe(32)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(key + "\n")
    return key


def _read_private(path: Path) -> str:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor) as handle:
        if os.fstat(handle.fileno()).st_mode & 0o077:  # a key others could read is no operator's secret
            raise PermissionError(f"{path} is readable by other users: chmod 600 it, or delete it for a new key")
        return handle.read().strip()


class OperatorKeys:
    """Which keys open the UI: the tenants file's admin keys, and the local operator key where there is one.
    Both are read again on every request, so that a revoked admin key or a deleted key file stops at once."""

    def __init__(self, tenants_path: str, key_file: Path | None = None) -> None:
        self._tenants_path = tenants_path
        self._key_file = key_file

    def _local(self) -> bytes | None:
        try:
            return hashlib.sha256(_read_private(self._key_file).encode()).digest() if self._key_file else None
        except OSError:  # deleted (to rotate it) or made readable by others: it opens nothing
            return None

    def __bool__(self) -> bool:
        registry = tenants_at(self._tenants_path)
        admins = registry is not None and any(team is None for _, team in registry.key_digests())
        return self._local() is not None or admins

    def accepts(self, key: str) -> bool:
        raw = key.encode()
        local = self._local()
        if local is not None and hmac.compare_digest(hashlib.sha256(raw).digest(), local):
            return True
        registry = tenants_at(self._tenants_path)
        return registry is not None and registry.identify(raw) == (None, True)


def _basic_credentials(header: str | None) -> tuple[str, str] | None:
    if not header or not header[:6].lower() == "basic ":
        return None
    try:
        user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user, password


class OperatorsOnly:
    """ASGI middleware: every HTTP request and WebSocket to the wrapped app carries an operator key (basic
    auth; the key is the password, or the user name with no password, as Scale's SDK sends keys), and no
    other site's page can act through an operator's browser: a browser sends the cached key cross-site too,
    so a state-changing request or a WebSocket must come from this host's own pages (Origin), and a
    cross-site request (Sec-Fetch-Site) is refused unless it is a link followed to a page, never GraphQL
    (whose GET runs mutations, so it takes a JSON POST only), and no other site may frame it."""

    def __init__(self, app: ASGIApp, keys: OperatorKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        credentials = _basic_credentials(headers.get("authorization"))
        key = (credentials[1] or credentials[0]) if credentials else None
        if key is None or not self.keys.accepts(key):
            await _refuse(scope, send, 401, "the Dagster UI is for operators: sign in with an admin key")
            return
        if _from_another_site(scope, headers):
            await _refuse(scope, send, 403, "refused: the request comes from another site's page")
            return
        if scope["type"] == "http" and scope["path"] == SIGN_IN_PATH:
            # Absolute: a relative Location would keep the sign-in URL's user info, key and all.
            origin = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"
            await _redirect(send, origin + _local_target(scope.get("query_string", b"").decode("latin-1")))
            return
        if scope["type"] == "http" and _graphql_outside_a_json_post(scope, headers):
            await _refuse(scope, send, 403, "GraphQL takes a JSON POST from the UI's own pages")
            return
        await self.app(scope, receive, _framed_by_none(send) if scope["type"] == "http" else send)


def _graphql_outside_a_json_post(scope: Scope, headers: dict[str, str]) -> bool:
    """Dagster runs a mutation sent as GET /graphql?query=... (an <img> would do, from a browser that says
    nothing of where a request comes from) or as a form's POST; its own UI POSTs JSON."""
    if not scope["path"].startswith(GRAPHQL_PATH):
        return False
    if scope.get("method") == "POST":
        return headers.get("content-type", "").split(";")[0].strip().lower() != "application/json"
    return bool(scope.get("query_string"))


def _framed_by_none(send: Send) -> Send:
    """No other site frames the UI: a page that did could have the operator click its Launch Run button."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [
                *message.get("headers", []),
                (b"x-frame-options", b"DENY"),
                (b"content-security-policy", b"frame-ancestors 'none'"),
            ]
        await send(message)

    return sending


def _from_another_site(scope: Scope, headers: dict[str, str]) -> bool:
    changes = scope["type"] == "websocket" or scope.get("method", "GET") not in SAFE_METHODS
    if changes and not _same_origin(headers):
        return True
    site = headers.get("sec-fetch-site")
    if site is None or site in ("same-origin", "none"):  # not a browser's, or typed in by the operator
        return False
    # A link followed to a page, in the operator's own window: an iframe navigates too, but is no document.
    followed_link = (
        headers.get("sec-fetch-mode") == "navigate" and headers.get("sec-fetch-dest") == "document" and not changes
    )
    return not followed_link or scope["path"].startswith(GRAPHQL_PATH)


def _same_origin(headers: dict[str, str]) -> bool:
    origin = headers.get("origin")
    if origin is None:  # not a browser's cross-site request (browsers send Origin on these)
        return True
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()


def _local_target(query: str) -> str:
    """`next` of the sign-in URL, kept to a path of this host (never an open redirect)."""
    target = parse_qs(query).get("next", ["/"])[0]
    if not target.startswith("/") or target.startswith("//") or "\\" in target or not target.isprintable():
        return "/"  # control characters would split the Location header, or be stripped into //host by a browser
    return target


async def _redirect(send: Send, location: str) -> None:
    headers = [(b"location", location.encode("latin-1", "replace")), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        # Closed before it is accepted: the handshake is answered 403, whatever the reason.
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = (message + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", f'Basic realm="{REALM}", charset="UTF-8"'.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ReverseProxy:
    """ASGI app forwarding HTTP and WebSockets to one upstream webserver (the chart's, in the cluster), with
    the operator's credentials left at the gate."""

    def __init__(self, upstream: str) -> None:
        import httpx

        self.upstream = upstream.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(60.0, connect=10.0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self.client.aclose()
            await send({"type": "lifespan.shutdown.complete"})

    @staticmethod
    def _target(scope: Scope) -> str:
        query = scope.get("query_string", b"").decode("latin-1")
        return scope.get("raw_path", scope["path"].encode()).decode("latin-1") + (f"?{query}" if query else "")

    @staticmethod
    def _forwarded_headers(scope: Scope) -> list[tuple[str, str]]:
        return [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope["headers"]
            if name.decode("latin-1").lower() not in _NOT_FORWARDED and not name.lower().startswith(b"sec-websocket")
        ]

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def body() -> Any:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                if not message.get("more_body"):
                    return

        method = scope["method"]
        request = self.client.build_request(
            method,
            self._target(scope),
            headers=self._forwarded_headers(scope),
            content=body() if method not in ("GET", "HEAD") else None,
        )
        response = await self.client.send(request, stream=True)
        try:
            headers = [
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in response.headers.multi_items()
                if name.lower() not in _NOT_FORWARDED or name.lower() == "content-length"
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        from websockets.asyncio.client import connect

        first = await receive()  # websocket.connect
        assert first["type"] == "websocket.connect"
        url = "ws" + self.upstream.removeprefix("http") + self._target(scope)
        subprotocols = scope.get("subprotocols") or None
        async with connect(url, subprotocols=subprotocols, additional_headers=self._forwarded_headers(scope)) as up:
            await send({"type": "websocket.accept", "subprotocol": up.subprotocol})

            async def downstream() -> None:
                async for message in up:
                    key = "text" if isinstance(message, str) else "bytes"
                    await send({"type": "websocket.send", key: message})

            async def upstream() -> None:
                while (message := await receive())["type"] == "websocket.receive":
                    await up.send(message["text"] if message.get("text") is not None else message["bytes"])

            tasks = [asyncio.ensure_future(downstream()), asyncio.ensure_future(upstream())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
        try:
            await send({"type": "websocket.close", "code": 1000})
        except Exception:  # the browser left first
            pass


def main(argv: Collection[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batch_pipeline.entrypoints.dagster_ui", description=__doc__)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("-w", "--workspace", help="serve Dagster's webserver for this workspace, in this process")
    target.add_argument("--upstream", help="proxy to this webserver (http://host:port) instead")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        configured = settings()
        tenants_at(configured.tenants)  # a wrong file is named now, not at the first request
        home = os.environ.get("DAGSTER_HOME")
        key_file = None
        if args.workspace and home:
            operator_key(home)
            key_file = Path(home) / OPERATOR_KEY_FILE
    except (SettingsError, TenantsFileError, OSError) as exc:
        parser.error(str(exc))
    keys = OperatorKeys(configured.tenants, key_file)
    if not keys:
        parser.error("no operator key: name admin keys in the tenants file (BATCH_PIPELINE_TENANTS, `admins:`)")
    import uvicorn

    if args.upstream:
        # Behind the cluster's TLS ingress: its X-Forwarded-Proto makes the sign-in redirect https.
        gate = OperatorsOnly(ReverseProxy(args.upstream), keys)
        uvicorn.run(gate, host=args.host, port=args.port, proxy_headers=True, forwarded_allow_ips="*")
        return 0
    return _serve_webserver(args.workspace, args.host, args.port, keys)


def _serve_webserver(workspace: str, host: str, port: int, keys: OperatorKeys) -> int:
    """Dagster's webserver as `dagster-webserver -w WORKSPACE` builds it, served behind the gate."""
    import uvicorn
    from dagster import DagsterInstance
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from dagster_webserver.app import create_app_from_workspace_process_context
    from dagster_webserver.cli import DEFAULT_DB_STATEMENT_TIMEOUT, DEFAULT_POOL_MAX_OVERFLOW, DEFAULT_POOL_RECYCLE
    from dagster_webserver.version import __version__

    with DagsterInstance.get() as instance:
        instance.optimize_for_webserver(DEFAULT_DB_STATEMENT_TIMEOUT, DEFAULT_POOL_RECYCLE, DEFAULT_POOL_MAX_OVERFLOW)
        with WorkspaceProcessContext(
            instance, version=__version__, read_only=False, workspace_load_target=WorkspaceFileTarget([workspace])
        ) as context:
            app = create_app_from_workspace_process_context(context, "", DEFAULT_LIVE_DATA_POLL_RATE_MS)
            uvicorn.run(OperatorsOnly(app, keys), host=host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
