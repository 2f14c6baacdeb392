"""A job's part in its team's result cache (issue 49): whether it takes part and under which identity, the
plan's lookup of its requests' results, and the results its completed run keeps for the team's next jobs.

A job takes part unless its request or its team turned the cache off, or it runs a tool loop (code whose
output may change between runs), or its model's files are not on this machine (their identity cannot be
checked). What decides a result is in its key (`shards/result_cache.CacheIdentity`); a result is found by
its own team's lookups only. A failure of the cache never fails a job: the job computes what it could not
find, and keeps nothing it could not store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.core import io
from batch_pipeline.core.io import make_private_directory
from batch_pipeline.models.platform import numerics_platform
from batch_pipeline.models.weights import Memo, model_directory, weights_digest
from batch_pipeline.shards.format import CachedResult
from batch_pipeline.shards.result_cache import (
    CacheableResult,
    CacheIdentity,
    Lookup,
    cacheable_results,
)
from batch_pipeline.store.result_cache import CachedEntry, NewEntry, ResultCacheStore


@dataclass(frozen=True)
class JobCache:
    """A job's part in its team's cache: its identity, or None and why it takes no part."""

    identity: CacheIdentity | None
    reason: str | None = None


# Model config fields naming files of their own, beside the model's, that decide its outputs: each must be on
# this machine, and its files' digest is part of the model's.
_OWN_FILES_FIELDS = ("tokenizer", "quantization_param_path")
# The hardware fields of a request that pick what its shards compute on: a GPU or the CPU, which GPU, and the
# CPU threads (a CPU's matrix products sum in an order of its thread count).
_NUMERICS_HARDWARE = ("gpus", "gpu_type", "cpus")


def shard_machine(launcher_kind: str, worker_image: str | None, hardware: Mapping[str, Any]) -> str:
    """Where a job's shards compute, as far as it decides their numbers: the launcher (this machine, or pods),
    the pods' image (their vLLM and torch), and the hardware the request asks for."""
    asked = {name: str(hardware[name]) for name in _NUMERICS_HARDWARE if name in hardware}
    return json.dumps({"launcher": launcher_kind, "image": worker_image, "hardware": asked}, sort_keys=True)


def job_cache(
    deployment_on: bool,
    owner: str,
    cache_mode: str,
    uses_tools: bool,
    model_config: BatchCompletionsModelConfig,
    admission: AdmissionPolicy,
    store: ResultCacheStore,
    machine: str,
) -> JobCache:
    """Whether a job of `owner` on `model_config` (as its shards get it), its shards computing on `machine`
    (`shard_machine`), takes part, and as what."""
    if not deployment_on:
        return JobCache(None, "the deployment's result cache is off (BATCH_PIPELINE_RESULT_CACHE)")
    if cache_mode == "off":
        return JobCache(None, "the request's cache is off")
    team = admission.team_of_owner(owner)
    if team is not None and not team.config.result_cache:
        return JobCache(None, "the team's result_cache is off in the tenants file")
    if uses_tools:
        return JobCache(None, "tool_config: its code's output may change between runs")
    location = model_directory(model_config.model, model_config.checkpoint_path)
    if location is None:
        return JobCache(None, "the model's files are not on this machine, so their identity cannot be checked")
    memo = Memo(store.weights_digest, store.record_weights_digest)
    digest = weights_digest(location, memo)
    for field in _OWN_FILES_FIELDS:
        if (named := getattr(model_config, field)) is None:
            continue
        own = model_directory(named)
        if own is None:
            return JobCache(None, f"model_config.{field}: its files are not on this machine, so cannot be checked")
        digest = hashlib.sha256(f"{digest}\0{field}\0{weights_digest(own, memo)}".encode()).hexdigest()
    engine = json.dumps(
        [model_config.model_dump(mode="json", exclude_none=True), numerics_platform(), machine], sort_keys=True
    )
    return JobCache(CacheIdentity(owner, model_config.model, digest, engine))


# The job's work-dir file that holds the identity its first plan looked its requests up under.
PLANNED_IDENTITY_FILE = "result_cache_identity.json"
# What that file holds once two runs of the job planned under different identities: its results are of both.
_MIXED = "mixed"


def record_planned_identity(work_dir: str, identity: CacheIdentity | None) -> None:
    """Remember the identity a run of the job plans under; a job whose runs planned under different ones
    (the model's files changed between a run and its resume) is marked mixed, and keeps none of its results."""
    path = io.join(work_dir, PLANNED_IDENTITY_FILE)
    current = json.dumps(asdict(identity) if identity is not None else None, sort_keys=True)
    if io.exists(path):
        with io.open_file(path, "r", encoding="utf-8") as handle:
            if handle.read() == current:
                return
        current = json.dumps(_MIXED)
    with io.atomic_write(path, "w") as handle:
        handle.write(current)


def planned_identity(work_dir: str) -> CacheIdentity | None:
    """The identity every run of the job planned under; None where none did, or they differed."""
    path = io.join(work_dir, PLANNED_IDENTITY_FILE)
    if not io.exists(path):
        return None
    with io.open_file(path, "r", encoding="utf-8") as handle:
        recorded = json.loads(handle.read())
    return CacheIdentity(**recorded) if isinstance(recorded, dict) else None


def lookup_in(store: ResultCacheStore, owner: str) -> Lookup:
    """The plan's lookup in `owner`'s cache: the index in bulk, then each payload file's size once. An entry
    whose line its file no longer holds is a miss; one replaced under its index is found out as its shard's
    checkpoint is written (`shards/result_cache.CachedOutputs`), and generated then."""

    def lookup(keys: list[str]) -> dict[str, CachedResult]:
        entries = store.lookup(owner, keys)
        return locate_payloads(entries.values())

    return lookup


def locate_payloads(entries: Iterable[CachedEntry]) -> dict[str, CachedResult]:
    """Where the entries' outputs are, by key: those whose payload file still holds their line's bytes."""
    by_file: dict[str, list[CachedEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.payload_path, []).append(entry)
    found: dict[str, CachedResult] = {}
    for path, in_file in by_file.items():  # `path` shared by its hits: thousands of them hold one string
        try:
            size = io.size(path)
        except OSError:  # gone (a DELETE, retention): generated instead
            continue
        for entry in in_file:
            if entry.payload_offset + entry.payload_length > size:  # cut short
                continue
            found[entry.key] = CachedResult(
                path,
                entry.payload_offset,
                entry.payload_length,
                entry.job_id,
                entry.prompt_tokens,
                entry.completion_tokens,
            )
    return found


def payload_path(cache_dir: str, owner: str, job_id: str) -> str:
    """Where a job's cached results are kept: under a directory of its owner's (by digest: an owner is no
    path), a file of the job's."""
    return io.join(cache_dir, hashlib.sha256(owner.encode()).hexdigest()[:32], f"{job_id}.jsonl")


def keep_results(
    store: ResultCacheStore,
    identity: CacheIdentity,
    job_id: str,
    shard_directories: list[str],
    cache_dir: str,
    max_bytes: int | None = None,
) -> int:
    """A completed job's deterministic results, kept in its team's cache: their outputs written to the job's
    payload file, then indexed; no more than `max_bytes` of them (what the team's max_stored_bytes leaves,
    None: no bound). Returns how many were added (a key cached already keeps its first)."""
    path = payload_path(cache_dir, identity.owner, job_id)
    if io.is_local(path):  # the team's outputs: for the service's user alone
        make_private_directory(cache_dir)
        make_private_directory(path.rsplit("/", 1)[0])
    with io.atomic_write(path, "wb") as payloads:  # the whole file before any entry points into it
        written = 0
        for result in _within(_results(identity, shard_directories), max_bytes):
            payloads.write(result.payload.encode("utf-8") + b"\n")
            written += 1
    if not written:
        io.remove(path)
        return 0
    for stale in store.drop_other_weights(identity.owner, identity.model, identity.weights_digest):
        io.remove(stale)
    entries = _entries(_within(_results(identity, shard_directories), max_bytes))
    return store.add(identity.owner, job_id, identity.model, identity.weights_digest, path, entries)


def _results(identity: CacheIdentity, shard_directories: list[str]) -> Iterator[CacheableResult]:
    for directory in shard_directories:
        yield from cacheable_results(directory, identity)


def _within(results: Iterator[CacheableResult], max_bytes: int | None) -> Iterator[CacheableResult]:
    """The results, up to the first that would take their payload past `max_bytes`."""
    total = 0
    for result in results:
        total += len(result.payload.encode("utf-8")) + 1
        if max_bytes is not None and total > max_bytes:
            return
        yield result


def _entries(results: Iterator[CacheableResult]) -> Iterator[NewEntry]:
    """The payload file's entries, read again from the shards as keep_results wrote them (memory stays
    bounded for a million results)."""
    offset = 0
    for result in results:
        length = len(result.payload.encode("utf-8"))
        yield NewEntry(result.key, offset, length, result.prompt_tokens, result.completion_tokens)
        offset += length + 1
