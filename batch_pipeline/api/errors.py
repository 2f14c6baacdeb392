"""Each router's error shape: how its routes answer a refusal, an HTTP error or an invalid request.

A router's route class names its `ErrorShape` (`error_shape`); the app's one handler per exception kind
renders it through the shape of the route the request matched (Starlette's `scope["route"]`, set for a 405
too), so no handler reads the URL. What the route's shape does not render, and a request no route matched,
answer in the app's default shape; a kind only another shape names (raised where it is not expected), in
that one's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

E = TypeVar("E", bound=Exception)
Renderer = Callable[[Request, Any], Awaitable[Response]]


class ErrorShape:
    """The renderers of one error format, by the exception kind each answers (its subclasses too)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.renderers: dict[type[Exception], Renderer] = {}

    def renders(self, *kinds: type[E]) -> Callable[[Callable[[Request, E], Awaitable[Response]]], Renderer]:
        def register(renderer: Callable[[Request, E], Awaitable[Response]]) -> Renderer:
            for kind in kinds:
                self.renderers[kind] = renderer
            return renderer

        return register

    def renderer_for(self, exc: Exception) -> Renderer | None:
        return next((self.renderers[kind] for kind in type(exc).__mro__ if kind in self.renderers), None)


class ShapedRoute(APIRoute):
    """A route whose errors its router's shape renders; a router's route class sets `error_shape`."""

    error_shape: ClassVar[ErrorShape]


def answer_errors_in_route_shapes(app: FastAPI, default: ErrorShape, shapes: list[ErrorShape]) -> None:
    async def render(request: Request, exc: Exception) -> Response:
        route = request.scope.get("route")
        own = [route.error_shape] if isinstance(route, ShapedRoute) else []
        renderer = next(filter(None, (shape.renderer_for(exc) for shape in (*own, default, *shapes))))
        return await renderer(request, exc)

    for kind in {kind for shape in (default, *shapes) for kind in shape.renderers}:
        app.add_exception_handler(kind, render)


class ValidationProblem(BaseModel):
    """One of FastAPI's validation errors, without the input it echoes: that may be a whole body, or a value
    JSON cannot hold (NaN)."""

    loc: list[str | int]
    msg: str
    type: str


def validation_problems(exc: RequestValidationError) -> list[ValidationProblem]:
    return [ValidationProblem(loc=list(error["loc"]), msg=error["msg"], type=error["type"]) for error in exc.errors()]
