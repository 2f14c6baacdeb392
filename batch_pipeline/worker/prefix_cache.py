"""Each team's requests in a prefix cache of their own: every prompt a shard adds to the engine carries its
owner team's `cache_salt`, which vLLM mixes into the hash of a prompt's first KV block (and so of every block
after it). An engine shared between jobs then never serves one team's request from blocks another team's
prompts computed: a hit would tell that team what the other sent (its timing shows), and the other's
prefixes are not its to use. Within a team, repeated prefixes hit as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Fixed, so a team's salt is the same in every worker and engine; a prefix of our own, so it is no digest
# that another use of the team's name would produce.
_SALT_PREFIX = b"batch-pipeline prefix cache of team\x00"


def team_cache_salt(team: str | None) -> str:
    """The cache salt of a team's requests: a digest of its name (vLLM takes at most 128 characters, none of
    `@/\\`), never the name itself. A job of no team (no tenants file) has the salt of the empty name."""
    return hashlib.sha256(_SALT_PREFIX + (team or "").encode()).hexdigest()


def salted(prompt: Any, salt: str) -> dict[str, Any]:
    """A prompt as the handlers give it (text, or `{"prompt_token_ids": [...]}`), with the salt."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {**prompt, "cache_salt": salt}


class SaltedEngine:
    """The engine as one shard's handlers drive it: each prompt added carries the shard's team's salt,
    whatever the handler (or the request) put there."""

    def __init__(self, engine: Any, team: str | None) -> None:
        self._engine = engine
        self.cache_salt = team_cache_salt(team)

    def add_request(
        self, request_id: str, prompt: Any, params: Any, tokenization_kwargs: dict[str, Any] | None = None
    ) -> None:
        self._engine.add_request(request_id, salted(prompt, self.cache_salt), params, tokenization_kwargs)

    def step(self) -> list[Any]:
        return self._engine.step()

    def abort_request(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)
