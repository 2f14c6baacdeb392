"""GET and DELETE /v2/result-cache (issue 49): a team reads and empties its own result cache only, an admin
names the team; emptying frees its stored bytes and its payload files, and leaves the other team's."""

from __future__ import annotations

import os
from pathlib import Path

from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.pipeline.result_cache import payload_path
from batch_pipeline.store.result_cache import NewEntry, ResultCacheStore
from tests.api.test_usage import A_KEY, ADMIN_KEY, B_KEY, _headers, api, teams  # noqa: F401

__all__ = ["api", "teams"]


def _cache_of(store: ResultCacheStore, owner: str, job_id: str, outputs: list[str]) -> Path:
    """Entries of `owner`'s cache, as a completed job keeps them: its payload file, then the index."""
    path = Path(payload_path(JobStorage(work_dir_base=settings().work_dir_base).result_cache_dir(), owner, job_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(output.encode() + b"\n" for output in outputs))
    offset, entries = 0, []
    for number, output in enumerate(outputs):
        entries.append(NewEntry(f"{owner}-{number}".ljust(32, "0")[:32], offset, len(output.encode()), 1, 1))
        offset += len(output.encode()) + 1
    store.add(owner, job_id, "m", "w", str(path), entries)
    return path


def test_a_team_reads_and_empties_its_own_cache_and_never_anothers(api):
    store = ResultCacheStore(os.environ["BATCH_PIPELINE_JOBS_DB"])
    a_file = _cache_of(store, "team:team-a", "job-a", ['{"text": "é"}', '{"text": "b"}'])
    b_file = _cache_of(store, "team:team-b", "job-b", ['{"text": "c"}'])

    a = api.get("/v2/result-cache", headers=_headers(A_KEY)).json()
    assert a == {"team": "team-a", "entries": 2, "stored_bytes": a_file.stat().st_size - 2}
    assert api.get("/v2/result-cache?team=team-b", headers=_headers(A_KEY)).status_code == 403
    assert api.delete("/v2/result-cache?team=team-b", headers=_headers(A_KEY)).status_code == 403
    unknown = api.get("/v2/result-cache?team=team-c", headers=_headers(ADMIN_KEY))
    assert unknown.status_code == 422 and "team" in unknown.text

    emptied = api.delete("/v2/result-cache", headers=_headers(A_KEY)).json()
    assert emptied == {"team": "team-a", "deleted_entries": 2, "freed_bytes": a["stored_bytes"]}
    assert not a_file.exists() and b_file.exists()
    assert api.get("/v2/result-cache", headers=_headers(B_KEY)).json()["entries"] == 1
    # An admin names the team whose cache it reads or empties.
    assert api.get("/v2/result-cache?team=team-b", headers=_headers(ADMIN_KEY)).json()["entries"] == 1
    assert api.delete("/v2/result-cache?team=team-b", headers=_headers(ADMIN_KEY)).json()["deleted_entries"] == 1
    assert not b_file.exists()
