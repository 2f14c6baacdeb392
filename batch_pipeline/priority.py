"""The spec's free-form `priority` string as Dagster's run priority (`dagster/priority`: higher runs first).

An integer string is taken as given ("5", "-3"); names map to fixed levels. Anything else is refused at
submission, naming the field, rather than silently treated as the default.
"""

from __future__ import annotations

NAMED_PRIORITIES = {
    "lowest": -20,
    "low": -10,
    "normal": 0,
    "medium": 0,
    "default": 0,
    "high": 10,
    "highest": 20,
    "urgent": 20,
    "critical": 20,
}


class InvalidPriority(ValueError):
    pass


def run_priority(priority: str | None) -> int:
    if priority is None or not priority.strip():
        return 0
    text = priority.strip().lower()
    if text in NAMED_PRIORITIES:
        return NAMED_PRIORITIES[text]
    try:
        return int(text)
    except ValueError:
        raise InvalidPriority(
            f"priority must be an integer or one of {', '.join(NAMED_PRIORITIES)}; got {priority!r}"
        ) from None
