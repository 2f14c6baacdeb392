"""The spec's free-form `priority` string as Dagster's run priority (`dagster/priority`: higher runs first).

The spec lets a client send any string, so any string is accepted and read, and the job says how it was
read: a name maps to a fixed level; an integer ("5", "-3") is taken as given, clamped to the range of the
named levels, so no caller can rank above `highest` and jump every queue; anything else runs at the normal
level (0). Only a priority longer than the job store keeps is refused, naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
# The job store's column (`batch_jobs.priority`, String(64)): Postgres refuses a longer value.
MAX_PRIORITY_CHARS = 64
# ASCII digits only: int() also takes "1_000" and other scripts' digits, which no client means as a level.
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


class InvalidPriority(ValueError):
    pass


@dataclass(frozen=True)
class PriorityReading:
    """The run priority a `priority` string gives, and how it was read (for the job's metadata)."""

    level: int
    reading: str


def read_priority(priority: str | None, cap: int | None = None) -> PriorityReading:
    """How a `priority` is run, at most `cap` (the team's `max_priority`); raises InvalidPriority only for
    one longer than the store keeps."""
    reading = _read(priority)
    if cap is not None and reading.level > cap:
        return PriorityReading(cap, f"{cap} (your team's max_priority; asked {reading.reading})")
    return reading


def _read(priority: str | None) -> PriorityReading:
    if priority is not None and len(priority) > MAX_PRIORITY_CHARS:
        # Not echoed: it is the one thing here that is too long to show.
        raise InvalidPriority(f"at most {MAX_PRIORITY_CHARS} characters (got {len(priority)})")
    stripped = (priority or "").strip()
    text = stripped.lower()
    if not text:
        return PriorityReading(0, "0 (normal: no priority given)")
    if text in NAMED_PRIORITIES:
        level = NAMED_PRIORITIES[text]
        return PriorityReading(level, f"{level} ({text})")
    if _INTEGER.fullmatch(text):
        given = int(text)  # at most 64 digits
        level = min(max(given, MIN_PRIORITY), MAX_PRIORITY)
        if level == given:
            return PriorityReading(level, f"{level} (an integer, as given)")
        side = "above the highest" if given > level else "below the lowest"
        return PriorityReading(level, f"{level} ({given} is {side} priority, {level})")
    return PriorityReading(
        0,
        f"0 (normal: {stripped!a} is not a known priority; known are integers "
        f"{MIN_PRIORITY}..{MAX_PRIORITY} and {', '.join(NAMED_PRIORITIES)})",
    )


def run_priority(priority: str | None, cap: int | None = None) -> int:
    """The `dagster/priority` of a job's runs."""
    return read_priority(priority, cap).level
