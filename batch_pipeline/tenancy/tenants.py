"""The teams sharing a deployment: the tenants file named by BATCH_PIPELINE_TENANTS.

```yaml
tenants:
  team-a:
    api_keys_sha256: ["<hex sha256 of a key>"]   # keys are never stored in clear
    data_roots: ["/srv/batch/team-a", "s3://team-a-data/batch/"]
admins:
  api_keys_sha256: ["..."]
```

Every key of a team acts for the team: it sees the team's jobs, files and batches, and the paths its
requests name must lie inside the team's data roots. Admin keys see every team's. The file is read once
a process starts to serve and checked whole; a mistake is named with its line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from fsspec.core import split_protocol
from fsspec.registry import known_implementations
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from batch_pipeline.contract.priority import NAMED_PRIORITIES, read_priority

logger = logging.getLogger(__name__)
# A team's name is a DNS label, so that it can name a Kubernetes object or a Kueue queue as it is.
TenantName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
KeyDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", to_lower=True)]
# Owners of jobs made by a team's keys and by admin keys. Without a tenants file each key owns its jobs
# (its digest's first 24 hex digits); a team's prefix cannot be mistaken for one.
TEAM_OWNER_PREFIX = "team:"
ADMINS_OWNER = "admins"
# The usage report (api/usage.py) labels a team's figures with its name, the admins' `admins` and every
# owner of no team `other`: no team may take either name. (Other owners, `dagster`, `schedule:...`, a
# key's digest, never meet a team's `team:` name.)
RESERVED_TEAM_NAMES = (ADMINS_OWNER, "other")


def owner_team(owner: str) -> str | None:
    """The team a job's owner (as the job store holds it) names, or None for an owner of no team."""
    return owner.removeprefix(TEAM_OWNER_PREFIX) if owner.startswith(TEAM_OWNER_PREFIX) else None


def owner_name(owner: str) -> str:
    """How a job's owner is named to admins: its team's name, else the owner itself (`admins`,
    `schedule:NAME`, a key's digest where the deployment has no tenants file)."""
    return owner_team(owner) or owner


class TenantsFileError(ValueError):
    """A tenants file this service cannot use; the message names the file, the line and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The events a team's webhook endpoint may take: its jobs' ends, and for OpenAI batches OpenAI's names.
WEBHOOK_EVENT_TYPES = (
    "job.completed", "job.failed", "job.cancelled", "job.expired",
    "batch.completed", "batch.failed", "batch.cancelled", "batch.expired",
)  # fmt: skip


class WebhookConfig(_Strict):
    """One endpoint of a team's webhooks: the operator's, never a request's. Its secret is not in the file:
    `secret_env` names the environment variable of the delivery process that holds it (`whsec_...`)."""

    url: str = Field(description="Where the team's events are POSTed: an http:// or https:// URL")
    secret_env: str = Field(description="The environment variable holding the Standard Webhooks secret")
    events: list[str] = Field(
        default_factory=lambda: list(WEBHOOK_EVENT_TYPES), min_length=1, description="The event types it takes"
    )

    @field_validator("url")
    @classmethod
    def _an_http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("a webhook url is an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("a webhook url holds no credentials (the signature authenticates the service)")
        if any(c in url for c in "\x00\r\n \t"):
            raise ValueError("a webhook url holds no spaces or control characters")
        return url

    @field_validator("secret_env")
    @classmethod
    def _a_variable_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name):
            raise ValueError(f"{name!r} is not an environment variable's name")
        return name

    @field_validator("events")
    @classmethod
    def _known_events(cls, events: list[str]) -> list[str]:
        unknown = [event for event in events if event not in WEBHOOK_EVENT_TYPES]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not an event type ({', '.join(WEBHOOK_EVENT_TYPES)})")
        return events

    @property
    def endpoint_id(self) -> str:
        """The endpoint's name in the outbox (which endpoints took an event): a digest of its URL, not the
        URL, which may carry a token in its path."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]


class TenantConfig(_Strict):
    api_keys_sha256: list[KeyDigest] = Field(default_factory=list)
    data_roots: list[str] = Field(default_factory=list)
    # Fair share between teams: each optional, unset meaning no bound.
    weight: float = Field(1.0, gt=0, description="The team's share of the run slots, against the others' weights")
    max_running_jobs: int | None = Field(None, ge=1, description="Jobs of the team running at once")
    max_queued_jobs: int | None = Field(None, ge=0, description="Jobs of the team waiting to start; more get 429")
    max_priority: str | int | None = Field(
        None, description="The highest priority the team's jobs may ask for (a name or an integer)"
    )
    max_stored_bytes: int | None = Field(None, ge=0, description="OpenAI files plus inline contents, in bytes")
    max_tokens_per_day: int | None = Field(None, ge=0, description="Prompt plus completion tokens a day")
    retention_days: int | None = Field(
        None,
        ge=0,
        le=36500,
        description="Days the team's finished jobs' work dirs are kept (0: forever; unset: the deployment's)",
    )
    result_cache: bool = Field(
        True,
        description="Whether the team's deterministic results are kept and reused across its jobs (issue 49); "
        "false: every request of its jobs is generated, and none kept",
    )
    # Kueue's share of the GPUs, cluster-wide: the team's shard pods name this LocalQueue (of the shard
    # pods' namespace) in their `kueue.x-k8s.io/queue-name` label. Unset: its pods are not queued by Kueue.
    kueue_queue: TenantName | None = Field(
        None, description="The Kueue LocalQueue of the team's shard pods (a DNS label, as team names are)"
    )
    # Signed webhooks when the team's jobs end (`batch_pipeline/webhooks/`).
    webhooks: list[WebhookConfig] = Field(default_factory=list, description="Where the team's job events go")

    @field_validator("max_priority")
    @classmethod
    def _a_priority_level(cls, value: str | int | None) -> str | int | None:
        if value is None:
            return None
        text = str(value).strip().lower()
        if text not in NAMED_PRIORITIES and not re.fullmatch(r"[+-]?[0-9]{1,4}", text):
            raise ValueError(f"{value!r} is not a priority name ({', '.join(NAMED_PRIORITIES)}) or an integer")
        return value

    @property
    def priority_cap(self) -> int | None:
        return None if self.max_priority is None else read_priority(str(self.max_priority)).level

    @field_validator("data_roots")
    @classmethod
    def _roots_are_absolute_or_urls(cls, roots: list[str]) -> list[str]:
        for root in roots:
            protocol = split_protocol(root)[0]
            if "::" in root or "\x00" in root:
                raise ValueError(f"{root!r}: a data root is one directory or one bucket prefix")
            if protocol is None and not os.path.isabs(root):
                raise ValueError(f"{root!r}: a local data root must be an absolute path")
            if protocol is not None and not split_protocol(root)[1].strip("/"):
                raise ValueError(f"{root!r}: a remote data root names at least its bucket")
            if protocol is not None and any(
                segment in ("", ".", "..") for segment in split_protocol(root)[1].rstrip("/").split("/")
            ):
                # An object store takes a prefix as written: `bucket//team-a` is not `bucket/team-a`.
                raise ValueError(f"{root!r}: a remote data root holds no empty, `.` or `..` segment")
        return roots


class AdminsConfig(_Strict):
    api_keys_sha256: list[KeyDigest] = Field(default_factory=list)


class TenantsFile(_Strict):
    tenants: dict[TenantName, TenantConfig]
    admins: AdminsConfig = Field(default_factory=AdminsConfig)


@dataclass(frozen=True)
class DataRoots:
    """Where a team's paths may lie: local directories (resolved once, when the file is read) and remote
    prefixes (`protocol`, `bucket/prefix/`)."""

    local: tuple[Path, ...]
    remote: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, roots: list[str] | tuple[str, ...]) -> DataRoots:
        local, remote = [], []
        for root in roots:
            protocol, rest = split_protocol(root)
            if protocol is None or protocol.lower() in ("file", "local"):
                local.append(Path(rest).resolve())
            else:
                remote.append((_protocol_family(protocol), rest.strip("/") + "/"))
        return cls(tuple(local), tuple(remote))

    def __or__(self, other: DataRoots) -> DataRoots:
        return DataRoots(self.local + other.local, self.remote + other.remote)

    def holds_remote(self, protocol: str, bucket_and_key: str) -> bool:
        family = _protocol_family(protocol)
        return any(family == root_family and bucket_and_key.startswith(prefix) for root_family, prefix in self.remote)


def _protocol_family(protocol: str) -> str:
    """One name for the protocols that open the same store, whatever their case: the first, in order, of
    fsspec's names for its filesystem (`s3a` and `S3` are `s3`; `gs` is `gcs`)."""
    name = protocol.lower()
    known = known_implementations.get(name)
    if known is None:
        return name
    return min(alias for alias, other in known_implementations.items() if other["class"] == known["class"])


@dataclass(frozen=True)
class Team:
    name: str
    roots: DataRoots
    config: TenantConfig

    @property
    def owner(self) -> str:
        return TEAM_OWNER_PREFIX + self.name


class Tenants:
    """The tenants file, read and checked."""

    def __init__(self, parsed: TenantsFile, source: str) -> None:
        self.source = source
        self.teams = {
            name: Team(name, DataRoots.of(config.data_roots), config) for name, config in parsed.tenants.items()
        }
        # Digest -> team name, or None for an admin key.
        self._keys: list[tuple[bytes, str | None]] = [
            (bytes.fromhex(digest), name)
            for name, config in parsed.tenants.items()
            for digest in config.api_keys_sha256
        ]
        self._keys += [(bytes.fromhex(digest), None) for digest in parsed.admins.api_keys_sha256]

    @classmethod
    def load(cls, path: str) -> Tenants:
        return cls.parse(_read(path), path)

    @classmethod
    def parse(cls, data: bytes, path: str) -> Tenants:
        """The tenants file `path` whose bytes are `data`, checked whole."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TenantsFileError(f"{path}: the tenants file is not UTF-8 text (byte {exc.start})") from None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark is not None else "?"
            raise TenantsFileError(f"{path}:{where}: not YAML: {getattr(exc, 'problem', exc)}") from None
        _check_unique_keys(root, path)
        try:
            parsed = TenantsFile.model_validate(loaded)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            field = ".".join(str(part) for part in error["loc"]) or "the file"
            line = _line_of(root, error["loc"])
            raise TenantsFileError(f"{path}:line {line}: {field}: {error['msg']}") from None
        for name in parsed.tenants:
            if name in RESERVED_TEAM_NAMES:
                line = _line_of(root, ("tenants", name, "[key]"))
                raise TenantsFileError(
                    f"{path}:line {line}: tenants.{name}: a reserved name (the usage report labels the admins' "
                    "figures `admins` and those of owners of no team `other`)"
                )
        tenants = cls(parsed, path)
        tenants._check_disjoint(root)
        return tenants

    def _check_disjoint(self, root: Any) -> None:
        """A key acts for one team only, and no team's root lies inside another's: either would let one
        team read or write the other's data."""
        seen: dict[bytes, str] = {}
        for digest, name in self._keys:
            holder = name or "admins"
            if digest in seen and seen[digest] != holder:
                raise TenantsFileError(
                    f"{self.source}: one API key digest is listed for both {seen[digest]} and {holder}"
                )
            seen[digest] = holder
        for team in self.teams.values():
            for other in self.teams.values():
                if other is team:
                    continue
                for mine in team.roots.local:
                    if any(mine.is_relative_to(theirs) for theirs in other.roots.local):
                        line = _line_of(root, ("tenants", team.name, "data_roots"))
                        raise TenantsFileError(
                            f"{self.source}:line {line}: tenants.{team.name}.data_roots: {mine} lies inside "
                            f"{other.name}'s data roots"
                        )
                for family, prefix in team.roots.remote:
                    if any(family == f and prefix.startswith(p) for f, p in other.roots.remote):
                        line = _line_of(root, ("tenants", team.name, "data_roots"))
                        raise TenantsFileError(
                            f"{self.source}:line {line}: tenants.{team.name}.data_roots: {family}://{prefix} lies "
                            f"inside {other.name}'s data roots"
                        )

    def identify(self, key: bytes) -> tuple[str | None, bool] | None:
        """(team name, False) for a team's key, (None, True) for an admin's, None for no key of the file.
        Every digest is compared, in constant time, so the answer's timing says nothing of which matched."""
        presented = hashlib.sha256(key).digest()
        found: tuple[str | None, bool] | None = None
        for digest, name in self._keys:
            if hmac.compare_digest(digest, presented) and found is None:
                found = (name, name is None)
        return found

    def has_keys(self) -> bool:
        return bool(self._keys)

    def key_digests(self) -> list[tuple[bytes, str | None]]:
        """(sha256 of a key, its team's name or None for an admin's) for each key of the file."""
        return list(self._keys)

    def team_of_owner(self, owner: str) -> Team | None:
        if not owner.startswith(TEAM_OWNER_PREFIX):
            return None
        return self.teams.get(owner.removeprefix(TEAM_OWNER_PREFIX))

    def priority_cap(self, owner: str) -> int | None:
        """The highest run priority `owner`'s jobs may have: its team's `max_priority`, or None."""
        team = self.team_of_owner(owner)
        return team.config.priority_cap if team is not None else None

    def kueue_queue(self, owner: str) -> str | None:
        """The Kueue LocalQueue of `owner`'s shard pods: its team's `kueue_queue`, or None (no team, or none set)."""
        team = self.team_of_owner(owner)
        return team.config.kueue_queue if team is not None else None

    def all_roots(self) -> DataRoots:
        roots = DataRoots((), ())
        for team in self.teams.values():
            roots = roots | team.roots
        return roots

    def check_service_paths(self, paths: dict[str, str]) -> None:
        """Refuse to serve when a service path (its work dir, DAGSTER_HOME, the job store) and a team's
        roots overlap: that team could then read or replace every team's jobs."""
        for what, path in paths.items():
            protocol, rest = split_protocol(path)
            for team in self.teams.values():
                if protocol in (None, "file", "local"):
                    real = Path(rest).resolve()
                    overlap = any(real.is_relative_to(root) or root.is_relative_to(real) for root in team.roots.local)
                else:  # either inside the other, as for local paths
                    prefix, family = rest.strip("/") + "/", _protocol_family(protocol)
                    overlap = team.roots.holds_remote(protocol, prefix) or any(
                        root_family == family and root.startswith(prefix) for root_family, root in team.roots.remote
                    )
                if overlap:
                    raise TenantsFileError(
                        f"{self.source}: {what} ({path}) overlaps the data roots of {team.name}: keep the service's "
                        "files out of every team's roots"
                    )


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {exc.strerror}") from None


# The file last read at each path: the digest of its bytes, and what they said.
_loaded: dict[str, tuple[bytes, Tenants]] = {}


def tenants_at(path: str) -> Tenants | None:
    """The tenants file at `path`, read again when its bytes change; None without one (an empty path). A
    file changed into one with a mistake keeps the last good one in force (and says so), so that an edit in
    progress never stops every request; a process starting on a wrong file fails, naming the mistake.

    The bytes are read and hashed on every call (a few kilobytes: microseconds) and parsed only when their
    digest changed: a file's size and mtime can be kept across an edit (`touch -r`, a copy that keeps them),
    and a revoked key must stop at once."""
    if not path:
        return None
    last = _loaded.get(path)
    try:
        data = _read(path)
        digest = hashlib.sha256(data).digest()
        if last is not None and last[0] == digest:
            return last[1]
        fresh = Tenants.parse(data, path)
        _loaded.clear()
        _loaded[path] = (digest, fresh)
        return fresh
    except TenantsFileError as exc:
        if last is None:
            raise
        logger.warning("%s; the tenants file read before stays in force", exc)
        return last[1]


def _check_unique_keys(node: Any, path: str, field: str = "") -> None:
    """A key given twice in one mapping is refused, naming its second line: YAML keeps the last silently,
    so a team listed twice would merge into one, its first roots and keys dropped unseen."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, path, f"{field}.{index}" if field else str(index))
    if not isinstance(node, yaml.MappingNode):
        return
    first: dict[str, int] = {}
    for key, value in node.value:
        name = str(key.value)
        where = f"{field}.{name}" if field else name
        if isinstance(key, yaml.ScalarNode) and name in first:
            raise TenantsFileError(
                f"{path}:line {key.start_mark.line + 1}: {where}: listed twice (first at line {first[name]})"
            )
        first[name] = key.start_mark.line + 1
        _check_unique_keys(value, path, where)


def _line_of(node: Any, loc: tuple[int | str, ...] | list[int | str]) -> int:
    """The line (1-based) of the deepest YAML node `loc` reaches: the field an error names, or its parent;
    a key's own line where pydantic says the key is wrong (`[key]`)."""
    line = node.start_mark.line + 1 if node is not None else 1
    parts = list(loc)
    for index, part in enumerate(parts):
        child = None
        if isinstance(node, yaml.MappingNode):
            pairs = [(key, value) for key, value in node.value if key.value == str(part)]
            if pairs:
                key, value = pairs[0]
                wrong_key = index + 1 < len(parts) and parts[index + 1] == "[key]"
                child = key if wrong_key or value is None else value
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        if child is None:
            break
        node, line = child, child.start_mark.line + 1
    return line
