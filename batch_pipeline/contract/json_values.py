"""Counting a JSON document's values before it is parsed: pydantic builds every value of a document before
any bound of the model is checked (a Python int is ~36 bytes where its token id took ~6 on the wire), so a
document holding millions is refused by its count, naming the field that holds the most, none built."""

from __future__ import annotations

from collections import Counter

import ijson

# The events of ijson's that are a value.
_VALUE_EVENTS = frozenset({"null", "boolean", "integer", "double", "number", "string", "start_map", "start_array"})


def values_past(raw: bytes, limit: int) -> str | None:
    """The field (`body.input`, `content`; "" for the document itself) holding the most of a document's JSON
    values once they pass `limit`, counted as they stream, none built; None within it, or where it is no
    JSON (the parse then names what is wrong)."""
    # Every value but the first follows a comma or opens its array or object (those in strings count too).
    if 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{") <= limit:
        return None
    counts: Counter[str] = Counter()
    values = 0
    try:
        for prefix, event, _ in ijson.parse(raw):
            if event in _VALUE_EVENTS:
                counts[field_of(prefix)] += 1
                values += 1
                if values > limit:
                    return counts.most_common(1)[0][0]
    except ijson.JSONError:
        return None
    return None


def field_of(prefix: str) -> str:
    """A value's field as errors name it (`body.input`), from ijson's path to it (`body.input.item.item`):
    its first two names, before any array's items; "" for the document itself."""
    names: list[str] = []
    for name in prefix.split(".") if prefix else ():
        if name == "item" or len(names) == 2:
            break
        names.append(name)
    return ".".join(names)


# The most JSON values a request body of the API may hold: a million (token ids, prompts, their arrays and
# objects), ~40 MB once built, e.g. 400 requests of 2,500 token ids inline. Past it a body is refused with a
# 422 naming the field that holds the most, before it is parsed: 10 MB of token ids were 70 MB built. A
# larger job goes by `input_data_path`, read a record at a time.
MAX_BODY_VALUES = 1_000_000
