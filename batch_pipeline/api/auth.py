"""API keys: from BATCH_PIPELINE_API_KEYS (comma-separated) or BATCH_PIPELINE_API_KEYS_FILE (one per line).

An entry is `KEY` or `KEY:admin`. Clients send the key as `x-api-key`, as the user name of HTTP basic
auth (Scale's llmengine SDK sends both), or as a bearer token (`Authorization: Bearer KEY`, the `openai`
SDK's way). With no key configured the API is open: every caller is the
same admin user, and a warning says so at start-up.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from dataclasses import dataclass

from fastapi import HTTPException, Request

from batch_pipeline.settings import settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    owner: str  # a digest of the key: jobs are owned by keys, and keys are never stored
    is_admin: bool


OPEN_ACCESS = Caller(owner="anonymous", is_admin=True)


class ApiKeys:
    def __init__(self, entries: list[str]) -> None:
        self._keys: dict[str, bool] = {}
        for entry in entries:
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            key, _, role = entry.partition(":")
            self._keys[key] = role.strip() == "admin"

    @classmethod
    def from_environment(cls) -> ApiKeys:
        configured = settings()
        entries = configured.api_keys.split(",")
        if configured.api_keys_file:
            with open(configured.api_keys_file) as handle:
                entries += handle.read().splitlines()
        keys = cls(entries)
        if not keys._keys:
            logger.warning("no API keys configured: the API is open to anyone who can reach it")
        return keys

    def authenticate(self, request: Request) -> Caller:
        if not self._keys:
            return OPEN_ACCESS
        authorization = request.headers.get("authorization")
        presented = request.headers.get("x-api-key") or _basic_auth_user(authorization) or _bearer(authorization)
        if presented:
            for key, is_admin in self._keys.items():
                if hmac.compare_digest(key.encode(), presented.encode()):
                    return Caller(owner=hashlib.sha256(key.encode()).hexdigest()[:24], is_admin=is_admin)
        raise HTTPException(
            status_code=401, detail="a valid API key is required", headers={"WWW-Authenticate": "Basic"}
        )


def _basic_auth_user(header: str | None) -> str | None:
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:]).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded.partition(":")[0] or None


def _bearer(header: str | None) -> str | None:
    if not header or not header.lower().startswith("bearer "):
        return None
    return header[7:].strip() or None
