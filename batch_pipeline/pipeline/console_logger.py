"""The console logger of a job's runs: Dagster's own (colored, to stderr, DEBUG and up), with the events a
cancel causes said in one line each. A cancelled run's shard step was interrupted, its worker stopped on
SIGINT, and its run ended: Dagster logged each with the interruption's stack trace, some 150 lines on
`serve`'s console for a normal cancel. The run's event log in the UI keeps them whole."""

from __future__ import annotations

import logging
from typing import Any

import dagster as dg
from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR
from dagster._loggers import colored_console_logger

# What a cancel interrupts with: Dagster's interrupt in the steps and the run, SIGINT in the shard worker.
INTERRUPTIONS = frozenset({"DagsterExecutionInterruptedError", "KeyboardInterrupt"})


@dg.logger(
    config_schema={
        # As Dagster's console logger where a run names no logger (`default_system_loggers`): every level.
        "log_level": dg.Field(str, is_required=False, default_value="DEBUG"),
        "name": dg.Field(str, is_required=False, default_value="dagster"),
    },
    description="Dagster's console logger, with the events a cancel causes in one line each (no stack trace)",
)
def console_logger(init_context: dg.InitLoggerContext) -> logging.Logger:
    logger = colored_console_logger.logger_fn(init_context)
    logger.addFilter(_one_line_interruptions)
    return logger


def _one_line_interruptions(record: logging.LogRecord) -> bool:
    """Keeps every record; one whose event's error was an interruption loses the error's text."""
    meta = getattr(record, LOG_RECORD_METADATA_ATTR, None)
    event = meta.get("dagster_event") if isinstance(meta, dict) else None
    error = getattr(getattr(event, "event_specific_data", None), "error", None)
    if error is not None and _interrupted(error) and isinstance(record.msg, str):
        record.msg = record.msg.split("\n\n", 1)[0] + " (interrupted: the run was cancelled)"
        record.args = None
    return True


def _interrupted(error: Any) -> bool:
    """Whether a serialized error is, or was raised because of, an interruption."""
    seen = 0
    while error is not None and seen < 16:  # its cause and context chain, bounded
        if error.cls_name in INTERRUPTIONS:
            return True
        if error.cause is not None and _interrupted(error.cause):
            return True
        error, seen = error.context, seen + 1
    return False
