"""A small client of the batch completions API, for the CLI: the routes of spec 001-003 over httpx."""

from __future__ import annotations

from typing import Any

import httpx

from batch_pipeline.core.settings import client_settings

# A dry run, and a submission whose hub model is read as a dry run reads it, may take the server's
# BATCH_PIPELINE_DRY_RUN_TIMEOUT_S (300 s) and the checking process's start besides.
CHECKING_TIMEOUT_S = 360.0


class ApiError(RuntimeError):
    """The API answered with an error, or could not be reached; the message is for people."""


class BatchClient:
    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
        configured = client_settings()
        self.url = (url or configured.url).rstrip("/")
        api_key = api_key or configured.api_key
        headers = {"x-api-key": api_key} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def create(self, request: dict[str, Any], api: str = "v2", idempotency_key: str | None = None) -> dict[str, Any]:
        path = "/v1/llm/batch-completions" if api == "v1" else "/v2/batch-completions"
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", path, json=request, headers=headers, timeout=CHECKING_TIMEOUT_S)

    def dry_run(self, request: dict[str, Any]) -> dict[str, Any]:
        """The request checked and tokenized as its job would be, nothing created: a BatchCompletionsEstimate."""
        return self._call(
            "POST", "/v2/batch-completions", params={"dry_run": "true"}, json=request, timeout=CHECKING_TIMEOUT_S
        )

    def resume(self, job_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", f"/v2/batch-completions/{job_id}/actions/resume", headers=headers)["job"]

    def set_priority(self, job_id: str, priority: str) -> dict[str, Any]:
        """The job, with `success`: false once it has started (its run's priority is set)."""
        return self._call("POST", f"/v2/batch-completions/{job_id}", json={"job_id": job_id, "priority": priority})

    def usage(self, since: str | None = None, until: str | None = None) -> dict[str, Any]:
        params = {name: value for name, value in (("since", since), ("until", until)) if value}
        return self._call("GET", "/v2/usage", params=params)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v2/batch-completions/{job_id}")["job"]

    def list(
        self,
        status: str | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 100,
        page_size: int = 1000,
        team: str | None = None,
    ) -> list[dict[str, Any]]:
        """Up to `limit` jobs, newest first, following the API's pages of `page_size` (at most 1000); with
        `team`, that team's alone (an admin key's filter)."""
        params: list[tuple[str, str]] = [("status", status)] if status else []
        params += [("team", team)] if team else []
        params += [("label", f"{key}:{value}") for key, value in (labels or {}).items()]
        jobs: list[dict[str, Any]] = []
        after: list[tuple[str, str]] = []
        while len(jobs) < limit:
            size = [("limit", str(min(limit - len(jobs), page_size)))]
            page = self._call("GET", "/v2/batch-completions", params=params + size + after)
            jobs += page["jobs"]
            if not page.get("has_more"):
                break
            after = [("after", page["last_id"])]
        return jobs

    def cancel(self, job_id: str) -> dict[str, Any]:
        """`success`, and where it is false the server's `reason`."""
        return self._call("POST", f"/v2/batch-completions/{job_id}/actions/cancel")

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(f"cannot reach the API at {self.url} ({exc}); is it running (`make serve`)?") from None
        if response.status_code >= 400:
            raise ApiError(f"{method} {path}: {response.status_code} {_detail(response)}")
        return response.json()

    def close(self) -> None:
        self._http.close()


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):  # FastAPI's validation errors: name each field
        return "; ".join(
            f"{'.'.join(str(p) for p in error.get('loc', [])[1:])}: {error.get('msg')}" for error in detail
        )
    return str(detail)
