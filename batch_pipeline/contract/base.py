"""The one base class of every wire type, and the rules every value of the wire obeys.

Whatever a request holds is stored (SQLite or Postgres text), becomes run tags and run config, and is
written as JSON again. So, for every field of every wire type, typed or free-form JSON:
- numbers are finite, and integers fit in 64 bits (engines, tags and databases take no more);
- strings hold no lone surrogate (it cannot be encoded as UTF-8) and, outside text meant for the model,
  no NUL (Postgres text and file names cannot hold it);
- free-form JSON (`rope_scaling`, schemas, ...) nests at most `MAX_JSON_DEPTH` levels.
A value that breaks one is refused at validation, naming the field, as any other invalid value.
"""

from __future__ import annotations

import math
import re
from itertools import repeat
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_UNENCODABLE = re.compile("[\ud800-\udfff]")
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class WireModel(BaseModel):
    # Clients of this API (Scale's llmengine SDK, OpenAI-style tooling) send fields newer or older than ours;
    # like the reference server, unknown fields are ignored rather than refused. `model_*` field names are
    # part of the wire format, so pydantic's protected namespace is lifted. NaN and infinities are refused.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True, allow_inf_nan=False)

    # Fields whose strings are text for the model (prompts, messages): a NUL there is stored escaped and is
    # the model's business; everywhere else it is refused.
    text_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, value: Any, info: ValidationInfo) -> Any:
        forbidden = _UNENCODABLE if info.field_name in cls.text_fields else _UNSTORABLE
        if problem := wire_value_problem(value, forbidden):
            raise ValueError(problem)
        return value


def wire_value_problem(value: Any, forbidden: re.Pattern[str] = _UNSTORABLE) -> str | None:
    """Why a validated value cannot travel on (None when it can). Nested wire models checked their own
    fields, so they are not walked again; everything else is, without recursion, however deep."""
    pending: list[tuple[Any, int, str]] = [(value, 0, "")]
    while pending:
        item, depth, where = pending.pop()
        at = f" at {where}" if where else ""
        if isinstance(item, (str, bool)) or item is None or isinstance(item, BaseModel):
            if isinstance(item, str) and (found := forbidden.search(item)):
                return f"{_describe(found.group())}{at}, which cannot be stored"
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                return f"integer{at} out of range: at most 64 bits"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"number{at} must be finite"
        elif isinstance(item, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels{at}"
            if isinstance(item, dict):
                for key, entry in item.items():
                    if isinstance(key, str) and (found := forbidden.search(key)):
                        return f"{_describe(found.group())} in the key {key!a}{at}, which cannot be stored"
                    pending.append((entry, depth + 1, f"{where}[{key!a}]"))
            elif not _plain_ascii_strings(item, forbidden):
                pending.extend((entry, depth + 1, f"{where}[{index}]") for index, entry in enumerate(item))
    return None


def _plain_ascii_strings(items: list[Any] | tuple[Any, ...], forbidden: re.Pattern[str]) -> bool:
    """Whether every item is an ASCII string without a forbidden character: a million prompts are checked
    at C speed (`isascii` is a flag of the string) instead of one regular-expression search each."""
    try:
        if not all(map(str.isascii, items)):
            return False
    except TypeError:  # not all strings
        return False
    return forbidden is _UNENCODABLE or not any(map(str.__contains__, items, repeat("\x00")))


def _describe(character: str) -> str:
    return "a NUL character" if character == "\x00" else f"a lone surrogate ({character!a})"
