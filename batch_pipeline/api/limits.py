"""A cap on request bodies: a client cannot make the API buffer an unbounded body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batch_pipeline.settings import settings

# A multipart body's boundaries and part headers around an upload of the largest size.
_MULTIPART_MARGIN = 64 * 1024


class BodySizeLimit:
    """Answers 413 when a body is over `max_bytes`, whether it declares its length or streams chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int | None = None, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes or settings().max_body_bytes
        # Routes whose bodies are streamed to storage, never parsed whole (file uploads), by exact path.
        self.larger = larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.larger[path] + _MULTIPART_MARGIN if path in self.larger else self.max_bytes
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
