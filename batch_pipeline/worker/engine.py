"""Building the vLLM engine of a shard from the request's `model_config`."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import platform
import time
from collections.abc import Set
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.core import io
from batch_pipeline.models.catalog import catalog_dtype, resolve_model, runner_of
from batch_pipeline.models.platform import BF16_FLAGS, cpu_flags
from batch_pipeline.models.sync import sync_remote_checkpoint

logger = logging.getLogger(__name__)

# Spec names that vLLM spells differently.
_RENAMED = {"cache_dtype": "kv_cache_dtype"}
# Fields of model_config that are not engine arguments: they pick the weights, size the deployment, or
# shape chat serving, and are used where they matter.
_NOT_ENGINE_ARGS = {
    "model",
    "checkpoint_path",
    "num_shards",
    "max_context_length",
    "response_role",
    "chat_template",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "labels",
    "rope_scaling",
    "limit_mm_per_prompt",
    # Offline engines log no requests, so there is nothing to disable.
    "disable_log_requests",
}


def set_engine_environment() -> None:
    """Settings that must be in the environment before vLLM is imported; explicit ones win."""
    # The engine core runs in this process: ~4 s start instead of ~20 s, one process instead of four.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # On the CPU, vLLM sizes the KV cache against one NUMA node unless told; 1 GiB holds ~46k tokens of a
    # small model. GPU builds ignore it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The KV cache block on the CPU unless the request names one. The prefix cache shares whole blocks only, and
# vLLM's CPU default (128 tokens) shares just 256 of a ~300-token system prompt: every request computes the
# rest again. 32 is the smallest block the CPU attention kernels take at full speed. On 2 cores, the same
# engine on bench/real_batches.py's workloads: `real` generates in 19-20 s instead of 23-24 s, same texts;
# `loop` in 75 s instead of 93 s (groups of its prompts share their first 32 tokens: the chat template's
# system prompt and an opening), 7 of 1,024 greedy texts parting late by bfloat16 rounding; `unique` (no
# 32 tokens shared) unchanged. vLLM's GPU default is 16 already.
CPU_BLOCK_SIZE = 32


def choose_dtype(
    model_config: BatchCompletionsModelConfig, on_cpu: bool, flags: Set[str] | None = None
) -> tuple[str | None, str]:
    """The dtype to run the model in, and why: a request that names one gets exactly that; otherwise the
    model's own, except on a CPU that cannot compute bfloat16 natively, where vLLM runs 16-bit models
    through slow fallbacks (SmolLM2-135M, 64 chat prompts: 27 tokens/s in bfloat16, 134 in float32) and
    float32 is both fast and exact."""
    if model_config.dtype is not None:
        return model_config.dtype, "named by the request"
    if (listed := catalog_dtype(model_config.model)) is not None:
        return listed, "the model catalog's for this model"
    if not on_cpu:
        return None, "the model's own, on an accelerator"
    if model_config.quantization is not None:
        return None, "the model's own, for quantized weights"
    if (cpu_flags() if flags is None else flags) & BF16_FLAGS:
        return None, "the model's own: this CPU computes bfloat16 natively"
    return "float32", f"this CPU ({platform.machine()}) computes no bfloat16 natively (avx512_bf16, amx_bf16 or bf16)"


def engine_arguments(model_config: BatchCompletionsModelConfig) -> tuple[dict[str, Any], list[str]]:
    """vLLM engine arguments for every non-null field, and the fields this vLLM cannot take.

    The second list is reported in the shard's stats (and logged) rather than failing the job: the spec
    lists arguments of several vLLM generations, and dropping one of another generation is safer than
    refusing a batch that otherwise runs.
    """
    from batch_pipeline.worker.vllm_api import EngineArgs

    accepted = {field.name for field in dataclasses.fields(EngineArgs)}
    checkpoint = model_config.checkpoint_path
    if checkpoint and not io.is_local(checkpoint):
        checkpoint = str(sync_remote_checkpoint(checkpoint, bool(model_config.trust_remote_code)))
    arguments: dict[str, Any] = {"model": resolve_model(checkpoint or model_config.model)}
    if model_config.checkpoint_path and model_config.served_model_name is None:
        arguments["served_model_name"] = model_config.model
    unsupported: list[str] = []
    for name, value in model_config.model_dump(exclude_none=True).items():
        if name in _NOT_ENGINE_ARGS:
            continue
        engine_name = _RENAMED.get(name, name)
        if engine_name in accepted:
            arguments[engine_name] = value
        else:
            unsupported.append(name)
    if model_config.max_model_len is None and model_config.max_context_length is not None:
        arguments["max_model_len"] = model_config.max_context_length
    if model_config.rope_scaling is not None:
        arguments["hf_overrides"] = {"rope_scaling": model_config.rope_scaling}
    if model_config.limit_mm_per_prompt is not None:
        arguments["limit_mm_per_prompt"] = json.loads(model_config.limit_mm_per_prompt)
    on_cpu = _on_cpu()
    dtype, _ = choose_dtype(model_config, on_cpu)
    if dtype is not None:
        arguments["dtype"] = dtype
    # The model says what it runs as (a catalog embedding model on vLLM's pooling runner), not the request.
    runner = runner_of(model_config.model)
    if runner is not None:
        arguments["runner"] = runner
    # Batch inputs repeat prefixes (templates, system prompts); the cache is on unless the request says no.
    # An encoder-only pooling model (BERT) keeps no KV cache to share, and vLLM's scheduler refuses to start
    # with the prefix cache on and no cacheable layer: off for it, whatever the request says.
    if runner == "pooling":
        arguments["enable_prefix_caching"] = False
    else:
        arguments.setdefault("enable_prefix_caching", True)
    if on_cpu:
        # torch.compile costs 70-95 s at every start on the CPU for 15-25 % more throughput: a loss for
        # all but the longest shards, so it is opt-in there (enforce_eager: false).
        arguments.setdefault("enforce_eager", True)
        arguments.setdefault("block_size", CPU_BLOCK_SIZE)
    if arguments.get("tokenizer"):
        arguments["tokenizer"] = resolve_model(arguments["tokenizer"])
    return arguments, unsupported


@dataclasses.dataclass
class Engine:
    """A shard's vLLM engine and how it was built, for the shard's stats."""

    llm: Any
    engine: Any  # llm's engine, rendering each prompt through vLLM's renderer: what the requests are added to
    unsupported: list[str]  # model_config fields this vLLM cannot take (ignored)
    dtype: str  # what the engine computes in, e.g. "float32"
    dtype_reason: str


def build_llm(model_config: BatchCompletionsModelConfig) -> Engine:
    # vLLM collects garbage several times while it builds an engine, each pass ~0.3 s over the ~600k
    # objects its imports leave, which live as long as the engine: they are frozen out of collections, and
    # automatic ones wait for the engine (engine start 10.1 s instead of 12.6 s here).
    gc.disable()
    try:
        from batch_pipeline.worker.vllm_api import LLM, PromptEngine

        gc.freeze()
        arguments, unsupported = engine_arguments(model_config)
        for name in unsupported:
            logger.warning("model_config.%s is not an engine argument of this vLLM; it is ignored", name)
        llm = LLM(**arguments)
    finally:
        gc.freeze()
        gc.enable()
    _, reason = choose_dtype(model_config, _on_cpu())
    return Engine(
        llm,
        PromptEngine(llm.llm_engine),
        unsupported,
        str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        reason,
    )


@dataclasses.dataclass
class KeptEngine:
    """A pool worker's engine, built for its first shard and kept for the next ones (`launch/pool.py`), which
    its launchers chose for the same engine (`engine_key`)."""

    imported_s: float = 0.0  # the worker's import of torch and vLLM, before its first shard: part of its start
    key: str = ""
    engine: Engine | None = None
    built_s: float = 0.0  # what starting it took (imports included): the start each later shard on it saves
    shards_served: int = 0

    def holds(self, model_config: BatchCompletionsModelConfig) -> bool:
        """Whether the engine kept is the one `model_config` builds."""
        from batch_pipeline.shards.protocol import engine_key

        return self.engine is not None and engine_key(model_config) == self.key

    def engine_for(self, model_config: BatchCompletionsModelConfig) -> tuple[Engine, bool]:
        """The engine for `model_config`, and whether it was already built (warm)."""
        from batch_pipeline.shards.protocol import engine_key

        if self.engine is not None:
            if not self.holds(model_config):  # no launcher hands one over: the old engine could not be freed
                raise RuntimeError("a shard of another engine was handed to this pool worker")
            return self.engine, True
        started = time.monotonic()
        self.engine = build_llm(model_config)
        self.key, self.built_s = engine_key(model_config), self.imported_s + time.monotonic() - started
        return self.engine, False


def _on_cpu() -> bool:
    from batch_pipeline.worker.vllm_api import current_platform

    return current_platform.is_cpu()
