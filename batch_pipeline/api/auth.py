"""Who is calling: a team of the tenants file (BATCH_PIPELINE_TENANTS), or else one of the keys of
BATCH_PIPELINE_API_KEYS (comma-separated) or BATCH_PIPELINE_API_KEYS_FILE (one per line).

With a tenants file, every key of a team acts for the team, and admin keys for everyone. Without one, an
entry is `KEY` or `KEY:admin`, and each key owns its jobs. A key may hold any character (`a:b` is the key
`a:b`; only a final `:admin` is read as the role). Clients send the key as `x-api-key`, as the user name
of HTTP basic auth (Scale's llmengine SDK sends both), or as a bearer token (`Authorization: Bearer KEY`,
the `openai` SDK's way). With no key configured the API is open: every caller is the same admin user,
and a warning says so at start-up.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.core.settings import Settings
from batch_pipeline.tenancy.tenants import ADMINS_OWNER, TEAM_OWNER_PREFIX, Tenants

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    owner: str  # whom the caller's jobs belong to: its team, or a digest of its key (keys are never stored)
    is_admin: bool


OPEN_ACCESS = Caller(owner="anonymous", is_admin=True)


class ApiKeys:
    def __init__(self, entries: list[str], teams: Callable[[], Tenants | None] | None = None) -> None:
        # The tenants file, read at each request as it is now (a revoked key stops at once); its keys replace
        # the entries.
        self._teams = teams
        self._keys: dict[str, bool] = {}
        for entry in entries:
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            key, admin = (entry.removesuffix(":admin"), True) if entry.endswith(":admin") else (entry, False)
            self._keys[key] = admin

    @classmethod
    def of_deployment(cls, configured: Settings, admission: AdmissionPolicy) -> ApiKeys:
        """The admission policy's teams when it has a tenants file; else the keys the settings list."""
        registry = admission.teams()
        if registry is not None:
            if not registry.has_keys():
                logger.warning("the tenants file %s lists no API key: no one can call the API", registry.source)
            return cls([], admission.teams)
        entries = configured.api_keys.split(",")
        if configured.api_keys_file:
            with open(configured.api_keys_file) as handle:
                entries += handle.read().splitlines()
        keys = cls(entries)
        if not keys._keys:
            logger.warning("no API keys configured: the API is open to anyone who can reach it")
        else:
            logger.warning("no tenants file (BATCH_PIPELINE_TENANTS): every key's requests share the same data roots")
        return keys

    def authenticate(self, request: Request) -> Caller:
        if self._teams is None and not self._keys:
            return OPEN_ACCESS
        if (presented := presented_key(request)) and (caller := self._identify(presented)) is not None:
            return caller
        raise HTTPException(
            status_code=401, detail="a valid API key is required", headers={"WWW-Authenticate": "Basic"}
        )

    @property
    def is_open(self) -> bool:
        """No key configured: every caller is OPEN_ACCESS."""
        return self._teams is None and not self._keys

    def identify(self, presented: bytes) -> Caller | None:
        """Whom a key acts for, or None for no valid key (an open API has none: see is_open)."""
        return self._identify(presented)

    def key_digests(self) -> list[tuple[bytes, Caller]]:
        """Each valid key's sha256, and whom it acts for, as the tenants file (or the settings) has them now:
        what the team page's sessions are signed with, so that a revoked key's sessions end with it."""
        if self._teams is not None:
            registry = self._teams()
            return [(digest, _team_caller(team)) for digest, team in registry.key_digests()] if registry else []
        return [
            (hashlib.sha256(key.encode()).digest(), Caller(hashlib.sha256(key.encode()).hexdigest()[:24], is_admin))
            for key, is_admin in self._keys.items()
        ]

    def _identify(self, presented: bytes) -> Caller | None:
        if self._teams is not None:
            registry = self._teams()
            found = registry.identify(presented) if registry is not None else None
            return _team_caller(found[0]) if found is not None else None
        for key, is_admin in self._keys.items():
            if hmac.compare_digest(key.encode(), presented):
                return Caller(owner=hashlib.sha256(key.encode()).hexdigest()[:24], is_admin=is_admin)
        return None


def _team_caller(team: str | None) -> Caller:
    """The caller a tenants file's key makes: its team, or the admins (None)."""
    return Caller(owner=TEAM_OWNER_PREFIX + team, is_admin=False) if team is not None else Caller(ADMINS_OWNER, True)


def presented_key(request: Request) -> bytes | None:
    """The key's bytes as the client sent them: a header's value is its bytes (Starlette decoded them as
    Latin-1), and basic auth's user its base64-decoded bytes, so a key of any characters compares whole."""
    authorization = request.headers.get("authorization")
    header = request.headers.get("x-api-key")
    if header:
        return header.encode("latin-1")
    return _basic_auth_user(authorization) or _bearer(authorization)


def _basic_auth_user(header: str | None) -> bytes | None:
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:], validate=True)
    except ValueError:
        return None
    # The SDKs send the key as the user with an empty password (`KEY:`); a key may hold colons itself.
    user = decoded[:-1] if decoded.endswith(b":") else decoded.partition(b":")[0]
    return user or None


def _bearer(header: str | None) -> bytes | None:
    if not header or not header.lower().startswith("bearer "):
        return None
    return header[7:].strip().encode("latin-1") or None
