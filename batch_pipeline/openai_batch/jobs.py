"""OpenAI batches on the batch completions pipeline: an input file checked and turned into a job's content,
and the job's output turned into OpenAI's output and error files. No HTTP here (the API's routes call it)
and no Dagster (the pipeline's ops call it).

A batch's job has in its work dir:
  content.json      the requests' bodies, one a line, in input order (the job's content, as inline
                    content is stored)
  custom_ids.jsonl  each line's custom_id (a JSON string a line), in the same order
  output.json       the job's output (a JSON array in input order), as any job writes it
and its output and error files are files of the file store, listed by the batch's row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import ijson
import yaml
from pydantic import ValidationError

from batch_pipeline.admission.output_room import OutputBytes
from batch_pipeline.admission.submission import CONTENT_FILE
from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.json_values import values_past
from batch_pipeline.contract.kinds import BATCH_ENDPOINTS
from batch_pipeline.contract.openai_batch import BATCH_LINES, BatchError, BatchInputLine, BatchInputLineBase
from batch_pipeline.core import io
from batch_pipeline.core.settings import Settings
from batch_pipeline.models.catalog import embedding_dimensions, runner_of
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import BatchResults, FileRecord, OpenAIStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.schema import failed_at_deadline

CUSTOM_IDS_FILE = "custom_ids.jsonl"
OUTPUT_FILE = "output.json"
# A batch's errors list at most this many lines; a file wrong throughout is not echoed whole.
MAX_LISTED_ERRORS = 100
MAX_MODEL_CHARS = 256

# The error entries a stopped job leaves at the requests it did not finish (see partial_results), as the
# codes OpenAI gives such requests.
_UNFINISHED_CODES = {"cancelled": "batch_cancelled", "job_failed": "batch_failed"}


@dataclass
class CheckedInput:
    """What checking a batch's input file found: its model and request count, or the errors by line; and the
    estimated bytes of its outputs that their kind sizes (embeddings), for its team's max_stored_bytes."""

    model: str | None = None
    total: int = 0
    errors: list[BatchError] = field(default_factory=list)
    more_errors: int = 0  # past MAX_LISTED_ERRORS
    output: OutputBytes = field(default_factory=OutputBytes)

    def add_error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))
        else:
            self.more_errors += 1


@dataclass(frozen=True, kw_only=True)
class BatchApiLimits:
    """What this deployment's OpenAI Batch API takes: its settings of the same names."""

    max_file_bytes: int  # the largest upload
    max_batch_requests: int  # the most lines a batch's input file may hold
    # A YAML mapping of the model names batches may use to whole model configs; empty: no catalog.
    model_catalog: str
    # Input files being checked at once in an API process (each read whole in a worker thread), and the
    # most of them one team may have checked (None: half of them rounded up).
    max_concurrent_batch_checks: int
    max_batch_checks_per_team: int | None

    @classmethod
    def of_deployment(cls, configured: Settings) -> BatchApiLimits:
        return cls(**{limit.name: getattr(configured, limit.name) for limit in fields(cls)})


def check_input_file(
    source: str, endpoint: str, work_dir: str, max_requests: int, model_catalog: str = ""
) -> CheckedInput:
    """Check each line of a batch's input file as OpenAI does before any engine starts (JSON, the line's
    fields, the body for the endpoint, one `model` for the file, `custom_id`s unique) and write the job's
    content and custom ids into `work_dir` as it goes. On errors those files are removed and the errors
    say which lines; the file is read once, streaming, whatever its size. The outputs' bytes are estimated
    as it goes for a kind that sizes them, on the model its name resolves to (`model_catalog`: the
    operator's catalog, BATCH_PIPELINE_MODEL_CATALOG)."""
    typed_line = BATCH_LINES[endpoint]
    kind = BATCH_ENDPOINTS[endpoint]
    dimensions: int | None = None
    checked = CheckedInput()
    seen: set[bytes] = set()  # 128-bit digests of the custom ids: a few MB for the most a batch holds
    limit = max_requests
    content_path, ids_path = io.join(work_dir, CONTENT_FILE), io.join(work_dir, CUSTOM_IDS_FILE)
    with (
        io.open_file(source, "rb") as lines,
        io.atomic_write(content_path, "w") as content,
        io.atomic_write(ids_path, "w") as custom_ids,
    ):
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            checked.total += 1
            if checked.total > limit:
                checked.add_error("too_many_requests", f"a batch holds at most {limit} requests here", number)
                break
            first = checked.model is None
            line = _checked_line(raw, number, endpoint, typed_line, checked)
            if line is None:
                continue
            if not kind.generates:
                if first:
                    dimensions = model_dimensions(line.body.model, model_catalog)
                checked.output.add(kind, line.body.model_dump(exclude_none=True), dimensions)
            digest = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
            if digest in seen:
                checked.add_error(
                    "duplicate_custom_id",
                    f"custom_id {line.custom_id[:100]!a} is used by an earlier line: each request needs its own",
                    number,
                    "custom_id",
                )
            seen.add(digest)
            if checked.errors:
                continue  # nothing more is written: the batch will not run
            content.write(line.body.model_dump_json(by_alias=True, exclude_unset=True, exclude={"model"}) + "\n")
            custom_ids.write(json.dumps(line.custom_id, ensure_ascii=False) + "\n")
    if checked.total == 0:
        checked.add_error("empty_file", "the input file holds no requests", None)
    if checked.errors:
        for path in (content_path, ids_path):
            io.remove(path)
    return checked


def _checked_line(
    raw: bytes, number: int, endpoint: str, typed_line: type[BatchInputLineBase], checked: CheckedInput
) -> Any:
    """The line parsed and validated in one pass (pydantic from its bytes), or None when it is wrong; the
    slow path only names what is wrong."""
    limit = BATCH_ENDPOINTS[endpoint].max_values + _LINE_VALUES
    if (where := values_past(raw, limit)) is not None:
        where = where or "the line"
        checked.add_error(
            "invalid_request",
            f"{where}: the line holds more than {limit} JSON values (numbers, strings, arrays and objects), more "
            f"than any {endpoint} request may",
            number,
            where,
        )
        return None
    try:
        line: Any = typed_line.model_validate_json(raw)
    except ValidationError as exc:
        _name_the_error(raw, number, endpoint, exc, checked)
        return None
    if line.url != endpoint:
        checked.add_error(
            "mismatched_url", f"url {line.url[:100]!a} is not the batch's endpoint {endpoint}", number, "url"
        )
        return None
    model = line.body.model
    if not model or not model.strip() or len(model) > MAX_MODEL_CHARS:
        checked.add_error(
            "invalid_model",
            f"body.model must name the model (at most {MAX_MODEL_CHARS} characters)",
            number,
            "body.model",
        )
        return None
    if checked.model is None:
        checked.model = model
        if (refusal := runner_refusal(model, endpoint)) is not None:
            checked.add_error("model_not_supported", refusal, number, "body.model")
            return None
    elif model != checked.model:
        checked.add_error(
            "mismatched_model",
            f"body.model {model[:100]!a} differs from {checked.model[:100]!a} "
            "of the lines before: a batch runs one model",
            number,
            "body.model",
        )
        return None
    return line


# The values of a line around its body: the line, its custom_id, method, url and body.
_LINE_VALUES = 8


def runner_refusal(model: str, endpoint: str) -> str | None:
    """Why a catalog model cannot serve the endpoint's kind (an embedding model asked to chat, a chat model
    asked to embed); None where it can, or where the catalog does not know the model (vLLM decides)."""
    runner, kind = runner_of(model), BATCH_ENDPOINTS[endpoint]
    if runner is None or runner == kind.runner:
        return None
    does = {"pooling": "computes embeddings", "generate": "generates text"}
    return f"{model[:100]!a} {does[runner]}; {endpoint} needs a model that {does[kind.runner]}"


def _name_the_error(raw: bytes, number: int, endpoint: str, typed: ValidationError, checked: CheckedInput) -> None:
    """The first of the checks a line fails, in the order a reader expects: JSON, the line's own fields, its
    url, then its body for the endpoint."""
    try:
        line = BatchInputLine.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            checked.add_error("invalid_json_line", f"not a JSON object: {error['msg']}", number)
        else:
            where = ".".join(str(part) for part in error["loc"]) or None
            checked.add_error("invalid_request", f"{where or 'the line'}: {error['msg']}", number, where)
        return
    if line.url != endpoint:
        checked.add_error(
            "mismatched_url", f"url {line.url[:100]!a} is not the batch's endpoint {endpoint}", number, "url"
        )
        return
    error = typed.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    checked.add_error("invalid_request", f"{where}: {error['msg']}", number, where)


def model_dimensions(model: str, catalog_path: str) -> int | None:
    """The vector size of the model a batch's `model` names (the built-in catalog's, through the operator's
    catalog); None where it is not known, or the operator's entry does not read (the batch fails on it)."""
    try:
        return embedding_dimensions(model_config_for(model, catalog_path).model)
    except (OSError, ValueError, yaml.YAMLError):  # pydantic's ValidationError is a ValueError
        return None


def model_config_for(model: str, catalog_path: str) -> BatchCompletionsModelConfig:
    """The model config of a batch's `model`: the entry of that name in the operator's catalog at `catalog_path`
    (BATCH_PIPELINE_MODEL_CATALOG, a YAML mapping of names to model configs), else the name itself as
    `model_config.model` (a built-in catalog name, a Hugging Face id, a local path or an s3:// checkpoint)."""
    if catalog_path:
        with open(catalog_path) as handle:
            catalog = yaml.safe_load(handle) or {}
        if model in catalog:
            return BatchCompletionsModelConfig.model_validate(catalog[model])
    return BatchCompletionsModelConfig(model=model)


def expired(job: JobRecord) -> bool:
    """Whether the job failed at its deadline (an OpenAI batch's completion window): stopped by run
    monitoring, or found past it when its run started (`failed_at_deadline`, the rule its webhook event's
    type follows too)."""
    return failed_at_deadline(job.status, job.failure_reason, job.completed_at, job.expires_at)


def write_result_files(
    batch_id: str, owner: str, custom_ids_path: str, entries: Iterable[Any], directory: str, expired: bool = False
) -> BatchResults:
    """OpenAI's output file (the requests answered) and error file (the others) of a batch, in `directory`:
    `entries` are its job's outputs in input order (`output_entries`), matched to the custom ids in order."""
    output_id, error_id = FileRecord.new_id(), FileRecord.new_id()
    output_path, error_path = io.join(directory, output_id), io.join(directory, error_id)
    completed = failed = 0
    with (
        io.open_file(custom_ids_path, "rb") as custom_ids,
        io.atomic_write(output_path, "w") as output,
        io.atomic_write(error_path, "w") as errors,
    ):
        for index, (raw_id, entry) in enumerate(zip(custom_ids, entries, strict=True)):
            line = {"id": f"batch_req_{batch_id.removeprefix('batch-')}_{index}", "custom_id": json.loads(raw_id)}
            if "error" not in entry:
                line |= {"response": {"status_code": 200, "request_id": entry.get("id"), "body": entry}, "error": None}
                output.write(json.dumps(line, ensure_ascii=False) + "\n")
                completed += 1
                continue
            error = entry["error"]
            code = _UNFINISHED_CODES.get(error.get("code"))
            if code is not None:  # never ran: no response, as OpenAI reports a request its batch did not reach
                code = "batch_expired" if expired else code
                line |= {"response": None, "error": {"code": code, "message": error.get("message")}}
            else:
                status = 500 if error.get("type") == "server_error" else 400
                line |= {
                    "response": {"status_code": status, "request_id": None, "body": {"error": error}},
                    "error": {"code": error.get("code"), "message": error.get("message")},
                }
            errors.write(json.dumps(line, ensure_ascii=False) + "\n")
            failed += 1
    now = datetime.now(UTC)

    def stored(file_id: str, path: str, suffix: str, count: int) -> FileRecord | None:
        if not count:
            io.remove(path)
            return None
        return FileRecord(
            file_id=file_id,
            owner=owner,
            filename=f"{batch_id}_{suffix}.jsonl",
            purpose="batch_output",
            bytes=io.size(path),
            created_at=now,
            path=path,
        )

    return BatchResults(
        output_file=stored(output_id, output_path, "output", completed),
        error_file=stored(error_id, error_path, "error", failed),
        completed=completed,
        failed=failed,
    )


def output_entries(path: str) -> Iterator[Any]:
    """A job's output array, an entry at a time."""
    with io.open_file(path, "rb") as handle:
        yield from ijson.items(handle, "item", use_float=True)


def finalize_batch(
    jobs: JobStore, job_id: str, output_path: str, work_dir: str, files_dir: str, expired: bool = False
) -> BatchResults | None:
    """Write the output and error files of the batch that job `job_id` is, from the job's output (whole, or
    partial for a stopped job) and record them on the batch; None, and nothing done, for any other job."""
    batches = OpenAIStore(engine=jobs.engine)
    batch = batches.get_batch(job_id)
    if batch is None:
        return None
    results = write_result_files(
        job_id, batch.owner, io.join(work_dir, CUSTOM_IDS_FILE), output_entries(output_path), files_dir, expired
    )
    keep_results(batches, job_id, results)
    return results


def keep_results(batches: OpenAIStore, batch_id: str, results: BatchResults) -> None:
    """Record a batch's output and error files, and remove those they replace."""
    for replaced in batches.record_results(batch_id, results):
        io.remove(replaced)
