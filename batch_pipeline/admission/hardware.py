"""The hardware a request may ask for: `gpus` a count, `cpus`/`memory`/`storage` Kubernetes quantities (a
number is cores, or GiB), each positive and within the maxima the operator set. Checked when a job is
submitted, so that a size no pod can carry is a 422 naming the field, not a shard failing later; and again
on the hardware a shard's pod gets, which may be inferred from the weights.

Maxima (unset = no bound), in the same units as the request: BATCH_PIPELINE_MAX_GPUS (a count),
BATCH_PIPELINE_MAX_CPUS, BATCH_PIPELINE_MAX_MEMORY, BATCH_PIPELINE_MAX_STORAGE (quantities: `64`, `512Gi`).

The engine arguments that size what a shard's engine allocates (`max_model_len`, `max_num_seqs`,
`block_size`, `num_gpu_blocks_override`, ...) are bounded the same way, by BATCH_PIPELINE_MAX_<FIELD>, each
with a default that a deployment of today's GPUs serves (see settings.py): vLLM takes them as given, so a
request could otherwise have an engine allocate what no machine holds, or skip vLLM's own memory check.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from batch_pipeline.core.settings import KUBERNETES_QUANTITY, Settings

# A number means this unit, as the pod's requests have always read it.
BARE_UNITS = {"cpus": "", "memory": "Gi", "storage": "Gi"}
HARDWARE_FIELDS = ("gpus", "cpus", "memory", "storage")
EXAMPLES = "e.g. 8, 500m, 16Gi"


class InvalidHardware(ValueError):
    """A hardware field that no pod can carry; the message names the field."""


# What Kubernetes keeps of a quantity in an int64: bytes, or a CPU's milli-units.
LARGEST_QUANTITY = {"cpus": Decimal(2**63 - 1) / 1000, "memory": Decimal(2**63 - 1), "storage": Decimal(2**63 - 1)}


def kubernetes_quantity(field: str, value: Any) -> tuple[str, Decimal]:
    """The quantity as a pod spec writes it, and its value in base units (cores, bytes). Raises
    InvalidHardware naming the field unless it is a positive quantity."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidHardware(f"{field}: {value!r} is not a Kubernetes quantity ({EXAMPLES})")
    # Imported here: the kubernetes package takes ~0.5-0.8 s to import, on the path of every process that
    # checks requests (`batch-pipeline run` before its run starts), and only a request naming hardware or a
    # deployment bounding it uses it (a Kubernetes launcher's step server imports it once a run).
    from kubernetes.utils.quantity import parse_quantity

    text = f"{value}{BARE_UNITS[field]}" if isinstance(value, (int, float)) else value
    if not KUBERNETES_QUANTITY.fullmatch(text):
        raise InvalidHardware(f"{field}: {value!r} is not a Kubernetes quantity ({EXAMPLES})")
    amount = parse_quantity(text)
    if amount <= 0:
        raise InvalidHardware(f"{field}: {value!r} is not a positive Kubernetes quantity ({EXAMPLES})")
    if amount > LARGEST_QUANTITY.get(field, LARGEST_QUANTITY["memory"]):  # "1e400" matches the grammar
        raise InvalidHardware(f"{field}: {str(value)[:64]!r} is larger than any Kubernetes quantity ({EXAMPLES})")
    return text, amount


def hardware_maxima(written: Mapping[str, int | str | None]) -> dict[str, tuple[str, Decimal]]:
    """The operator's bound per field, from the bounds as written (`{"gpus": 8, "memory": "512Gi"}`; a field
    absent or None has none): (as written, value in base units)."""
    maxima = {}
    for field in HARDWARE_FIELDS:
        bound = written.get(field)
        if bound is not None:
            amount = Decimal(bound) if field == "gpus" else kubernetes_quantity(field, bound)[1]
            maxima[field] = (str(bound), amount)
    return maxima


def configured_hardware_maxima(configured: Settings) -> dict[str, int | str]:
    """The bounds as the settings write them (BATCH_PIPELINE_MAX_GPUS, ..._CPUS, ..._MEMORY, ..._STORAGE),
    each field with one; the settings have checked them."""
    bounds = {field: getattr(configured, f"max_{field}") for field in HARDWARE_FIELDS}
    return {field: bound for field, bound in bounds.items() if bound is not None}


def hardware_problems(hardware: Mapping[str, Any], maxima: Mapping[str, tuple[str, Decimal]]) -> list[tuple[str, str]]:
    """`(field, why)` for each of `gpus`, `cpus`, `memory`, `storage` in `hardware` that no pod of this
    deployment (its `maxima`, `hardware_maxima`) may carry; fields left out (None) are not checked."""
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


def hardware_refusals(request: Any, maxima: Mapping[str, tuple[str, Decimal]]) -> list[tuple[str, str]]:
    """`(field, why)` for each hardware field of a batch completions request that no pod may carry."""
    return hardware_problems({field: getattr(request, field, None) for field in HARDWARE_FIELDS}, maxima)


# Each bounded engine argument of model_config, and the setting holding its maximum (`max_<field>`, without
# doubling a leading `max_`). The deprecated max_context_length fills max_model_len, so shares its bound.
ENGINE_ARGUMENT_MAXIMA = {
    field: "max_" + field.removeprefix("max_")
    for field in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_seq_len_to_capture",
        "block_size",
        "num_gpu_blocks_override",
        "swap_space",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "pipeline_parallel_size",
    )
} | {"max_context_length": "max_model_len"}


def engine_argument_refusals(
    model_config: Any, maxima: Mapping[str, float], max_gpus: int | None
) -> list[tuple[str, str]]:
    """`(field, why)` for each engine argument of a request's model config over this deployment's maximum
    (`maxima` by field; the contract has refused what no engine takes: non-positive counts, a fraction past 1)."""
    found = []
    for field, maximum in maxima.items():
        value = getattr(model_config, field, None)
        if value is not None and value > maximum:
            found.append((f"model_config.{field}", f"{value} is more than this deployment's maximum of {maximum}"))
    # One engine spans tensor x pipeline parallel GPUs: no more than a request may ask for.
    spanned = (model_config.tensor_parallel_size or 1) * (model_config.pipeline_parallel_size or 1)
    if max_gpus is not None and spanned > max_gpus:
        found.append(
            (
                "model_config.tensor_parallel_size",
                f"tensor x pipeline parallelism spans {spanned} GPUs, more than this deployment's maximum of "
                f"{max_gpus}",
            )
        )
    return found
