"""Labels: the key/value pairs a job carries (v2 `labels`, v1 `model_config.labels`, an OpenAI batch's
`metadata`), and the bounds every one of them obeys.

A label becomes a Dagster run tag (`batch_pipeline.label/<key>`, its key made one Dagster allows by
`pipeline.tags.label_tag_key`), a row of the job store's label index, and part of every GET and LIST that
shows its job. Postgres' btree indexes, Dagster's tag index among them, hold at most 2704 bytes an entry; a
tag past it makes the run's row fail, and the jobs sensor, which finds a job's run by its tags, launches
another every tick. So labels are bounded as OpenAI bounds batch metadata, with more pairs: at most 64
pairs, keys of at most 64 characters, values of at most 512. The largest tag is then 84 bytes of key
(ASCII) and 4 x 512 of value in UTF-8 (2,132 bytes), which fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated

from pydantic import AfterValidator

MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 512
# OpenAI's own bound on a batch's metadata (its keys and values are bounded as labels are).
MAX_OPENAI_METADATA_PAIRS = 16


def label_problem(labels: Mapping[str, str], max_pairs: int = MAX_LABELS) -> str | None:
    """Why these labels cannot be a job's (None when they can); the message names the label to blame."""
    if len(labels) > max_pairs:
        return f"at most {max_pairs} labels (got {len(labels)})"
    for key, value in labels.items():
        if len(key) > MAX_LABEL_KEY_CHARS:
            # Only its start is shown: the key itself may be megabytes.
            shown = f"{key[:MAX_LABEL_KEY_CHARS]!a}..."
            return f"label {shown}: keys are at most {MAX_LABEL_KEY_CHARS} characters (this one has {len(key)})"
        if len(value) > MAX_LABEL_VALUE_CHARS:
            return f"label {key!a}: values are at most {MAX_LABEL_VALUE_CHARS} characters (this one has {len(value)})"
    return None


def _bounded(max_pairs: int) -> Callable[[dict[str, str] | None], dict[str, str] | None]:
    def check(labels: dict[str, str] | None) -> dict[str, str] | None:
        if labels is not None and (problem := label_problem(labels, max_pairs)):
            raise ValueError(problem)
        return labels

    return check


# A validator, not `max_length` constraints: those would echo a too-long key (megabytes) in the error's
# location, and would add bounds to the spec's JSON schema.
Labels = Annotated[dict[str, str], AfterValidator(_bounded(MAX_LABELS))]
OpenAIMetadata = Annotated[dict[str, str] | None, AfterValidator(_bounded(MAX_OPENAI_METADATA_PAIRS))]
