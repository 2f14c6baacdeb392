"""Model configuration of a batch job: which model, and the vLLM engine arguments to build it with."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.labels import Labels

# The job store's model column (String(256)), and the run's model tag: Postgres refuses a longer one.
MAX_MODEL_CHARS = 256
# Engine arguments that count something (tokens, sequences, blocks, GPUs): vLLM takes none below 1, and a
# shard that fails at its engine's start is a worse answer than a 422 naming the field.
COUNT_ARGUMENTS = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_seq_len_to_capture",
    "num_gpu_blocks_override",
    "block_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


class BatchCompletionsModelConfig(WireModel):
    """The v2 model config: the model plus vLLM engine arguments (None = vLLM's default)."""

    max_model_len: int | None = Field(
        None, description="Model context length, If unspecified, will be automatically derived from the model config"
    )
    max_num_seqs: int | None = Field(None, description="Maximum number of sequences per iteration")
    enforce_eager: bool | None = Field(
        None,
        description="Always use eager-mode PyTorch. If False, will use eager mode and CUDA graph in hybrid for "
        "maximal perforamnce and flexibility",
    )
    trust_remote_code: bool | None = Field(
        False,
        description="Whether to trust remote code from Hugging face hub. This is only applicable to models whose "
        "code is not supported natively by the transformers library (e.g. deepseek). Default to False.",
    )
    pipeline_parallel_size: int | None = Field(None, description="Number of pipeline stages. Default to None.")
    tensor_parallel_size: int | None = Field(None, description="Number of tensor parallel replicas. Default to None.")
    quantization: str | None = Field(
        None,
        description="Method used to quantize the weights. If None, we first check the `quantization_config` "
        "attribute in the model config file. If that is None, we assume the model weights are not quantized and "
        "use `dtype` to determine the data type of the weights.",
    )
    disable_log_requests: bool | None = Field(None, description="Disable logging requests. Default to None.")
    chat_template: str | None = Field(
        None,
        description="A Jinja template to use for this endpoint. If not provided, will use the chat template from "
        "the checkpoint",
    )
    tool_call_parser: str | None = Field(None, description="Tool call parser")
    enable_auto_tool_choice: bool | None = Field(None, description="Enable auto tool choice")
    load_format: str | None = Field(
        None,
        description="The format of the model weights to load.\n\n"
        '* "auto" will try to load the weights in the safetensors format and fall back to the pytorch bin '
        "format if safetensors format is not available.\n"
        '* "pt" will load the weights in the pytorch bin format.\n'
        '* "safetensors" will load the weights in the safetensors format.\n'
        '* "npcache" will load the weights in pytorch format and store a numpy cache to speed up the loading.\n'
        '* "dummy" will initialize the weights with random values, which is mainly for profiling.\n'
        '* "tensorizer" will load the weights using tensorizer from CoreWeave. See the Tensorize vLLM Model '
        "script in the Examples section for more information.\n"
        '* "bitsandbytes" will load the weights using bitsandbytes quantization.\n',
    )
    config_format: str | None = Field(
        None,
        description="The config format which shall be loaded.  Defaults to 'auto' which defaults to 'hf'.",
    )
    tokenizer_mode: str | None = Field(
        None,
        description="Tokenizer mode. 'auto' will use the fast tokenizer ifavailable, 'slow' will always use the "
        "slow tokenizer, and'mistral' will always use the tokenizer from `mistral_common`.",
    )
    limit_mm_per_prompt: str | None = Field(
        None,
        description="Maximum number of data instances per modality per prompt. Only applicable for multimodal models.",
    )
    max_num_batched_tokens: int | None = Field(None, description="Maximum number of batched tokens per iteration")
    tokenizer: str | None = Field(None, description="Name or path of the huggingface tokenizer to use.")
    dtype: str | None = Field(
        None,
        description="Data type for model weights and activations. The 'auto' option will use FP16 precision for "
        "FP32 and FP16 models, and BF16 precision for BF16 models.",
    )
    seed: int | None = Field(None, description="Random seed for the model.")
    revision: str | None = Field(
        None,
        description="The specific model version to use. It can be a branch name, a tag name, or a commit id. If "
        "unspecified, will use the default version.",
    )
    code_revision: str | None = Field(
        None,
        description="The specific revision to use for the model code on Hugging Face Hub. It can be a branch name, "
        "a tag name, or a commit id. If unspecified, will use the default version.",
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Dictionary containing the scaling configuration for the RoPE embeddings. When using this "
        "flag, don't update `max_position_embeddings` to the expected new maximum.",
    )
    tokenizer_revision: str | None = Field(
        None,
        description="The specific tokenizer version to use. It can be a branch name, a tag name, or a commit id. "
        "If unspecified, will use the default version.",
    )
    quantization_param_path: str | None = Field(
        None,
        description="Path to JSON file containing scaling factors. Used to load KV cache scaling factors into the "
        "model when KV cache type is FP8_E4M3 on ROCm (AMD GPU). In the future these will also be used to load "
        "activation and weight scaling factors when the model dtype is FP8_E4M3 on ROCm.",
    )
    max_seq_len_to_capture: int | None = Field(
        None,
        description="Maximum sequence len covered by CUDA graphs. When a sequence has context length larger than "
        "this, we fall back to eager mode. Additionally for encoder-decoder models, if the sequence length of the "
        "encoder input is larger than this, we fall back to the eager mode.",
    )
    disable_sliding_window: bool | None = Field(
        None,
        description="Whether to disable sliding window. If True, we will disable the sliding window functionality "
        "of the model. If the model does not support sliding window, this argument is ignored.",
    )
    skip_tokenizer_init: bool | None = Field(
        None, description="If true, skip initialization of tokenizer and detokenizer."
    )
    served_model_name: str | None = Field(
        None,
        description="The model name used in metrics tag `model_name`, matches the model name exposed via the APIs. "
        "If multiple model names provided, the first name will be used. If not specified, the model name will be "
        "the same as `model`.",
    )
    override_neuron_config: dict[str, Any] | None = Field(
        None,
        description="Initialize non default neuron config or override default neuron config that are specific to "
        "Neuron devices, this argument will be used to configure the neuron config that can not be gathered from "
        "the vllm arguments.",
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None,
        description="Arguments to be forwarded to the model's processor for multi-modal data, e.g., image processor.",
    )
    block_size: int | None = Field(None, description="Size of a cache block in number of tokens.")
    gpu_memory_utilization: float | None = Field(
        None, description="Fraction of GPU memory to use for the vLLM execution."
    )
    swap_space: float | None = Field(None, description="Size of the CPU swap space per GPU (in GiB).")
    cache_dtype: str | None = Field(None, description="Data type for kv cache storage.")
    num_gpu_blocks_override: int | None = Field(
        None,
        description="Number of GPU blocks to use. This overrides the profiled num_gpu_blocks if specified. Does "
        "nothing if None.",
    )
    enable_prefix_caching: bool | None = Field(None, description="Enables automatic prefix caching.")
    model: str = Field(description="ID of the model to use.")
    checkpoint_path: str | None = Field(None, description="Path to the checkpoint to load the model from.")
    num_shards: int | None = Field(
        1,
        ge=1,
        description="\nSuggested number of shards to distribute the model. When not specified, will infer the "
        "number of shards based on model config.\nSystem may decide to use a different number than the given "
        "value.\n",
    )
    max_context_length: int | None = Field(
        None,
        ge=1,
        description="Maximum context length to use for the model. Defaults to the max allowed by the model. "
        "Deprecated in favor of max_model_len.",
    )
    response_role: str | None = Field(
        None, description="Role of the response in the conversation. Only supported in chat completions."
    )

    # Bounds in validators, not Field constraints, so that the JSON schema stays the spec's. How large each
    # may be is the operator's call (BATCH_PIPELINE_MAX_*, checked at admission), not the contract's.
    @field_validator("model")
    @classmethod
    def _model_fits_the_store(cls, value: str) -> str:
        if len(value) > MAX_MODEL_CHARS:
            raise ValueError(f"at most {MAX_MODEL_CHARS} characters (got {len(value)})")
        return value

    @field_validator(*COUNT_ARGUMENTS)
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        # Every attention backend's kernel takes blocks of a power of two (or a multiple of one).
        if value is not None and value & (value - 1):
            raise ValueError(f"must be a power of two (16, 32, 64, ...), got {value}")
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _a_fraction(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise ValueError("must be a fraction of the GPU's memory: more than 0, at most 1")
        return value

    @field_validator("swap_space")
    @classmethod
    def _not_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError("must be 0 or more GiB")
        return value


class CreateBatchCompletionsV1ModelConfig(BatchCompletionsModelConfig):
    """The v1 model config: the v2 one plus labels."""

    labels: Labels = Field(default={}, description="Labels to attach to the batch inference job.")
