"""The hardware a request may ask for: `gpus` a count, `cpus`/`memory`/`storage` Kubernetes quantities (a
number is cores, or GiB), each positive and within the maxima the operator set. Checked when a job is
submitted, so that a size no pod can carry is a 422 naming the field, not a shard failing later; and again
on the hardware a shard's pod gets, which may be inferred from the weights.

Maxima (unset = no bound), in the same units as the request: BATCH_PIPELINE_MAX_GPUS (a count),
BATCH_PIPELINE_MAX_CPUS, BATCH_PIPELINE_MAX_MEMORY, BATCH_PIPELINE_MAX_STORAGE (quantities: `64`, `512Gi`).
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from batch_pipeline.settings import KUBERNETES_QUANTITY, settings

# A number means this unit, as the pod's requests have always read it.
BARE_UNITS = {"cpus": "", "memory": "Gi", "storage": "Gi"}
HARDWARE_FIELDS = ("gpus", "cpus", "memory", "storage")
EXAMPLES = "e.g. 8, 500m, 16Gi"


class InvalidHardware(ValueError):
    """A hardware field that no pod can carry; the message names the field."""


def kubernetes_quantity(field: str, value: Any) -> tuple[str, Decimal]:
    """The quantity as a pod spec writes it, and its value in base units (cores, bytes). Raises
    InvalidHardware naming the field unless it is a positive quantity."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidHardware(f"{field}: {value!r} is not a Kubernetes quantity ({EXAMPLES})")
    text = f"{value}{BARE_UNITS[field]}" if isinstance(value, (int, float)) else value
    if not KUBERNETES_QUANTITY.fullmatch(text):
        raise InvalidHardware(f"{field}: {value!r} is not a Kubernetes quantity ({EXAMPLES})")
    amount = parse_quantity(text)
    if amount <= 0:
        raise InvalidHardware(f"{field}: {value!r} is not a positive Kubernetes quantity ({EXAMPLES})")
    return text, amount


def hardware_maxima() -> dict[str, tuple[str, Decimal]]:
    """The operator's bound per field: (as written, value in base units). Raises SettingsError (a
    ValueError) naming the variable that is not a valid bound."""
    configured = settings()  # has checked each bound
    maxima = {}
    for field in HARDWARE_FIELDS:
        written = getattr(configured, f"max_{field}")
        if written is not None:
            amount = Decimal(written) if field == "gpus" else kubernetes_quantity(field, written)[1]
            maxima[field] = (str(written), amount)
    return maxima


def hardware_problems(hardware: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`(field, why)` for each of `gpus`, `cpus`, `memory`, `storage` in `hardware` that no pod of this
    deployment may carry; fields left out (None) are not checked."""
    maxima = hardware_maxima()
    found = []
    for field in HARDWARE_FIELDS:
        value = hardware.get(field)
        if value is None:
            continue
        if field == "gpus":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                found.append((field, f"{value!r} is not a number of GPUs (0 or more)"))
                continue
            amount = Decimal(value)
        else:
            try:
                amount = kubernetes_quantity(field, value)[1]
            except InvalidHardware as exc:
                found.append((field, str(exc).removeprefix(f"{field}: ")))
                continue
        if field in maxima and amount > maxima[field][1]:
            shown = value if field == "gpus" or isinstance(value, str) else f"{value}{BARE_UNITS[field]}"
            found.append((field, f"{shown} is more than this deployment's maximum of {maxima[field][0]}"))
    return found


def hardware_refusals(request: Any) -> list[tuple[str, str]]:
    """`(field, why)` for each hardware field of a batch completions request that no pod may carry."""
    return hardware_problems({field: getattr(request, field, None) for field in HARDWARE_FIELDS})
