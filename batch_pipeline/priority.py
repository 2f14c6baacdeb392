"""The spec's free-form `priority` string as Dagster's run priority (`dagster/priority`: higher runs first).

An integer string is taken as given ("5", "-3") within the range of the named levels, so no caller can
set a priority above `highest` and jump every queue; names map to fixed levels. Anything else is refused at
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


MIN_PRIORITY, MAX_PRIORITY = min(NAMED_PRIORITIES.values()), max(NAMED_PRIORITIES.values())
MAX_PRIORITY_CHARS = 32


class InvalidPriority(ValueError):
    pass


def run_priority(priority: str | None) -> int:
    if priority is None or not priority.strip():
        return 0
    text = priority.strip().lower()
    if text in NAMED_PRIORITIES:
        return NAMED_PRIORITIES[text]
    try:
        level = int(text) if len(text) <= MAX_PRIORITY_CHARS else None
    except ValueError:
        level = None
    if level is None or not MIN_PRIORITY <= level <= MAX_PRIORITY:
        shown = priority if len(priority) <= MAX_PRIORITY_CHARS else priority[:MAX_PRIORITY_CHARS] + "..."
        raise InvalidPriority(
            f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY} or one of "
            f"{', '.join(NAMED_PRIORITIES)}; got {shown!a}"
        )
    return level
