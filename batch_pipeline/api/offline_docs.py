"""`/docs` without the network: FastAPI's Swagger UI page loads its script and stylesheet from a CDN, so it
was blank on a machine offline. vLLM, which every deployment installs, ships the same two files (for its
own `--enable-offline-docs`); the page loads them from here. Where they are not installed, `/docs` says so
and points at `/openapi.json`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

# Where vLLM keeps them, inside its package (found without importing vLLM, which takes seconds).
_VLLM_STATIC = ("entrypoints", "serve", "instrumentator", "static")
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
ASSETS_PATH = "/docs/static"


def swagger_assets_dir() -> Path | None:
    """The directory holding both of Swagger UI's files, or None where no installed package has them."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        directory = Path(root).joinpath(*_VLLM_STATIC)
        if all((directory / name).is_file() for name in ASSETS):
            return directory
    return None


def add_offline_docs(app: FastAPI, assets: Path | None) -> None:
    """`/docs` (the app made with `docs_url=None`) over Swagger UI's files in `assets`, served at
    ASSETS_PATH; with none, a page saying why and where the OpenAPI document is."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        if assets is None:
            return HTMLResponse(
                "<!doctype html><title>API docs</title><p>Swagger UI's files are not installed here (vLLM's "
                f'package ships them). The OpenAPI document is at <a href="{openapi_url}">{openapi_url}</a>; '
                '<a href="/redoc">/redoc</a> renders it where a CDN is reachable.</p>'
            )
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url="data:,",  # FastAPI's default is fetched from its site
        )

    @app.get(ASSETS_PATH + "/{name}", include_in_schema=False)
    def swagger_asset(name: str) -> Response:
        if assets is None or name not in ASSETS:  # these two names alone: nothing else of the directory
            return Response(status_code=404)
        return FileResponse(assets / name, media_type=ASSETS[name], headers={"Cache-Control": "max-age=86400"})
