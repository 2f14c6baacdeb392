"""Outputs that a job's tokens do not bound, held to its team's max_stored_bytes before any engine starts.

An embedding is large next to its input: a 10 MB file of short inputs is ~15 GB of JSON floats (384
dimensions at ~22 bytes a float, per input). Each kind says what its outputs take
(`RequestKind.output_bytes`; None for a kind that generates text, which max_tokens_per_day bounds). A job
whose outputs would take its team past its quota is refused where they are first known: an OpenAI
batch's when its file is checked (a 429 naming `max_stored_bytes` and `input_file_id`), an input file's as
its plan reads it (the job fails before its shards start).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from batch_pipeline.admission.submission import QuotaExceeded, StoredBytes, stored_bytes_of
from batch_pipeline.contract.kinds import RequestKind, kind_named
from batch_pipeline.models.catalog import embedding_dimensions
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.records import ItemSize
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import OpenAIStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.tenancy.tenants import Team

# What a team stores of each output until retention deletes its job's work dir: the shard's checkpoint
# (results.tsv) and its sorted output (output.tsv) each hold it, and an OpenAI batch's output file once more.
CHECKPOINT_COPIES = 2
BATCH_OUTPUT_COPIES = CHECKPOINT_COPIES + 1


@dataclass
class OutputBytes:
    """The estimated bytes of a job's outputs that their kinds size, and how many requests those are."""

    bytes: int = 0
    requests: int = 0

    def add(self, kind: RequestKind, request: dict[str, Any], model_dimensions: int | None) -> None:
        size = kind.output_bytes(request, model_dimensions)
        if size is not None:
            self.bytes += size
            self.requests += 1

    def refusal(
        self,
        stored: StoredBytes,
        copies: int,
        what: str,
        param: str | None = None,
        own_bytes: int = 0,
        so_far: bool = False,
    ) -> QuotaExceeded | None:
        """QuotaExceeded when `copies` of these outputs pass what the team may still store (`own_bytes`: what
        the job stores of them already, a resumed job's checkpoints; `so_far`: more are still to be read);
        None when they fit."""
        room = stored.limit - (stored.stored - own_bytes)
        if self.bytes * copies <= room:
            return None
        kept = (
            f"kept {copies} times (its shards' checkpoints and sorted outputs, until retention deletes its work dir"
            + ("; its output file)" if copies > CHECKPOINT_COPIES else ")")
        )
        return QuotaExceeded(
            "max_stored_bytes",
            f"{what}'s {'first ' if so_far else ''}{self.requests} embedding requests are estimated at "
            f"~{self.bytes} bytes of vectors{' already' if so_far else ''}, {kept}: "
            f"~{self.bytes * copies} bytes, past the {max(0, room)} bytes its team may still store (it stores "
            f"{stored.stored - own_bytes} of its quota of {stored.limit}). Ask for encoding_format base64 (a "
            "quarter of float's bytes), fewer dimensions where the model allows it or fewer inputs a batch, or "
            "make room: delete files it no longer needs (DELETE /v1/files/{file_id}) or empty its result cache "
            "(DELETE /v2/result-cache)",
            param=param,
        )


def bounded_output(
    items: Iterable[tuple[WorkItem, ItemSize]], store: JobStore, record: JobRecord | None, team: Team | None, model: str
) -> Iterator[tuple[WorkItem, ItemSize]]:
    """A plan's work items, passed on as they are read, with their outputs held to their job's team's
    max_stored_bytes: QuotaExceeded as soon as what they would store passes what the team may still store
    (no engine has started). `model`: the model the shards run (its vector size, from the catalog)."""
    stored = stored_bytes_of(store, record.owner, team) if record is not None else None
    if stored is None or record is None:
        return iter(items)
    is_batch = OpenAIStore(engine=store.engine).get_batch(record.job_id) is not None
    copies = BATCH_OUTPUT_COPIES if is_batch else CHECKPOINT_COPIES
    own = record.checkpoint_bytes or 0  # a resumed job's: part of what its outputs take
    return _bounded(items, stored, copies, own, embedding_dimensions(model))


def _bounded(
    items: Iterable[tuple[WorkItem, ItemSize]], stored: StoredBytes, copies: int, own: int, dimensions: int | None
) -> Iterator[tuple[WorkItem, ItemSize]]:
    output = OutputBytes()
    for item, size in items:
        kind = kind_named(item.kind)
        if not kind.generates:
            output.add(kind, item.request, dimensions)
            if (refused := output.refusal(stored, copies, "this job", own_bytes=own, so_far=True)) is not None:
                raise refused
        yield item, size
