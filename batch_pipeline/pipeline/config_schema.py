"""The Dagster config schema of a pydantic model, so the launchpad shows the request as typed config; and
the run config of a request (what the jobs sensor, schedules and `batch-pipeline run` launch).

Field names, descriptions and defaults come from the contract. A union Dagster cannot express (content:
an object or one of two lists; cpus: a string or a number) becomes `Any`; the contract validates it when
the run starts, with the same errors the API gives.
"""

from __future__ import annotations

import enum
import os
import tempfile
import types
import typing
from typing import Any, Union

import dagster as dg
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import Settings
from batch_pipeline.models.catalog import CATALOG

_SCALARS = {str: dg.String, int: dg.Int, float: dg.Float, bool: dg.Bool}


def config_schema_for(model: type[BaseModel]) -> dg.Shape:
    fields = {}
    for name, info in model.model_fields.items():
        config_type, nullable = _config_type(info.annotation)
        if nullable:
            config_type = dg.Noneable(config_type)
        description = (info.description or "").strip() or None
        if info.is_required():
            fields[info.alias or name] = dg.Field(config_type, is_required=True, description=description)
            continue
        default = info.get_default(call_default_factory=True)
        if default is None or default is PydanticUndefined:
            fields[info.alias or name] = dg.Field(config_type, is_required=False, description=description)
        else:
            fields[info.alias or name] = dg.Field(
                config_type, default_value=_plain(default), is_required=False, description=description
            )
    return dg.Shape(fields)


def _config_type(annotation: Any) -> tuple[Any, bool]:
    """(Dagster config type, whether None is allowed) for a field annotation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _config_type(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
        if len(members) == 1:
            return _config_type(members[0])[0], nullable
        return dg.Any, nullable
    if origin is list:
        (item,) = typing.get_args(annotation)
        return dg.Array(_config_type(item)[0]), False
    if origin is dict:
        key, value = typing.get_args(annotation)
        if key is str and value in _SCALARS:
            return dg.Map(str, _SCALARS[value]), False
        return dg.Permissive(), False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return config_schema_for(annotation), False
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return dg.Enum(annotation.__name__, [dg.EnumValue(member.value) for member in annotation]), False
    if annotation in _SCALARS:
        return _SCALARS[annotation], False
    return dg.Any, False


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def launchpad_template(configured: Settings) -> dict[str, Any]:
    """The run config the launchpad opens with: a small request that runs as it is on this deployment
    without a tenants file (a catalog model, two inline prompts, an output in the first data root, else
    in the temporary directory); with one, it names no `team`, which the run then asks for. Only a run
    given no `validate_input` config runs it: every run the service launches gives its request."""
    root = next((root for root in configured.data_roots.split(os.pathsep) if root), tempfile.gettempdir())
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "output_data_path": os.path.join(root, "batch_pipeline-launchpad-sample", "output.json"),
            "model_config": {"model": next(iter(CATALOG))},
            "content": {
                "prompts": ["The capital of France is", "Water boils at"],
                "max_new_tokens": 16,
                "temperature": 0.0,
            },
            "labels": {"example": "launchpad"},
        }
    )
    return {"ops": run_config_for(request)["ops"]}


def run_config_for(request: CreateBatchCompletionsV2Request, log_level: str | None = None) -> dict[str, Any]:
    """The run config of a request: the request itself, as the config of `validate_input`."""
    config: dict[str, Any] = {
        "ops": {"validate_input": {"config": request.model_dump(mode="json", by_alias=True, exclude_none=True)}}
    }
    # Always named: a job's own logger (pipeline/console_logger.py) is used only where its run config names it.
    config["loggers"] = {"console": {"config": {"log_level": log_level}} if log_level else {}}
    return config
