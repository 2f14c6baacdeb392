"""The batch job requests of `POST /v1/llm/batch-completions` and `POST /v2/batch-completions`."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, Union, get_args

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds import (
    INLINE_LIST_KINDS,
    INLINE_OBJECT_KINDS,
    KINDS,
    inline_content_kind,
    inline_list_kind,
)
from batch_pipeline.contract.kinds.v1 import CreateBatchCompletionsV1RequestContent
from batch_pipeline.contract.labels import MAX_LABELS, Labels
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig, CreateBatchCompletionsV1ModelConfig


class GpuType(str, Enum):
    """Lists allowed GPU types for Launch."""

    NVIDIA_TESLA_T4 = "nvidia-tesla-t4"
    NVIDIA_AMPERE_A10 = "nvidia-ampere-a10"
    NVIDIA_AMPERE_A100 = "nvidia-ampere-a100"
    NVIDIA_AMPERE_A100E = "nvidia-ampere-a100e"
    NVIDIA_HOPPER_H100 = "nvidia-hopper-h100"
    NVIDIA_HOPPER_H100_1G20GB = "nvidia-hopper-h100-1g20gb"
    NVIDIA_HOPPER_H100_3G40GB = "nvidia-hopper-h100-3g40gb"


# The one tool `tool_config.name` may name here: the worker's code_evaluator loop over v1 prompts.
CODE_EVALUATOR = "code_evaluator"


class ToolConfig(WireModel):
    """Configuration for tool use.
    NOTE: this config is highly experimental and signature will change significantly in future iterations."""

    name: str
    max_iterations: int | None = 10
    execution_timeout_seconds: int | None = 60
    should_retry_on_error: bool | None = True

    # Not bounds of the spec's schema (so kept out of it), but no loop runs no rounds or in no time.
    @field_validator("max_iterations", "execution_timeout_seconds")
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value


_HARDWARE_DESCRIPTIONS = {
    "cpus": "CPUs to use for the batch inference.",
    "gpus": "Number of GPUs to use for the batch inference.",
    "memory": "Amount of memory to use for the batch inference.",
    "gpu_type": "GPU type to use for the batch inference.",
    "storage": "Storage to use for the batch inference.",
    "nodes_per_worker": "Number of nodes per worker for the batch inference.",
}


# The spec's default max_runtime_sec: one day.
DEFAULT_MAX_RUNTIME_SEC = 86400
MAX_DATA_PARALLELISM = 64  # the spec's bound

InputDataPath = Annotated[
    str | None,
    Field(
        description="Path to the input file. The input file should be a JSON file of type "
        "List[CreateBatchCompletionsRequestContent]."
    ),
]
OutputDataPath = Annotated[
    str,
    Field(description="Path to the output file. The output file will be a JSON file of type List[CompletionOutput]."),
]
Priority = Annotated[str | None, Field(description="Priority of the batch inference job. Default to None.")]
# The result cache (issue 49): a job's deterministic requests (greedy, or sampled with a seed) are answered
# from its team's earlier jobs' results where they hold one, and its own are kept for the next, unless off.
ResultCacheMode = Annotated[
    Literal["on", "off"],
    Field(
        description="`off`: every request is generated, and none of this job's results are kept for the team's "
        "later jobs. `on` (the default): a deterministic request (greedy, or sampled with a seed) that an earlier "
        "job of the team computed on the same model, weights and engine arguments takes that result (its entry "
        "says `cached_from_job_id`), and this job's are kept for later ones."
    ),
]


class _BatchCompletionsRequestBase(WireModel):
    input_data_path: InputDataPath = None
    output_data_path: OutputDataPath
    labels: Labels = Field(default={}, description="Labels to attach to the batch inference job.")
    data_parallelism: int | None = Field(
        1,
        ge=1,
        le=MAX_DATA_PARALLELISM,
        description="Number of replicas to run the batch inference. More replicas are slower to schedule but "
        "faster to inference.",
    )
    max_runtime_sec: int | None = Field(
        DEFAULT_MAX_RUNTIME_SEC,
        ge=1,
        le=172800,
        description="Maximum runtime of the batch inference in seconds. Default to one day.",
    )
    priority: Priority = None
    tool_config: ToolConfig | None = Field(
        None,
        description="\nConfiguration for tool use.\nNOTE: this config is highly experimental and signature will "
        "change significantly in future iterations.",
    )
    cpus: str | int | float | None = Field(None, description=_HARDWARE_DESCRIPTIONS["cpus"])
    gpus: int | None = Field(None, description=_HARDWARE_DESCRIPTIONS["gpus"])
    memory: str | int | float | None = Field(None, description=_HARDWARE_DESCRIPTIONS["memory"])
    gpu_type: GpuType | None = Field(None, description=_HARDWARE_DESCRIPTIONS["gpu_type"])
    storage: str | int | float | None = Field(None, description=_HARDWARE_DESCRIPTIONS["storage"])
    nodes_per_worker: int | None = Field(None, description=_HARDWARE_DESCRIPTIONS["nodes_per_worker"])

    @model_validator(mode="after")
    def _exactly_one_input(self) -> Self:
        content = getattr(self, "content", None)  # each request type declares its own
        if self.input_data_path is None and content is None:
            raise ValueError("Either input_data_path or content needs to be provided.")
        if self.input_data_path is not None and content is not None:
            raise ValueError("Only one of input_data_path and content can be provided.")
        return self


class CreateBatchCompletionsV1Request(_BatchCompletionsRequestBase):
    """Request object for batch completions."""

    content: CreateBatchCompletionsV1RequestContent | None = None
    model_cfg: CreateBatchCompletionsV1ModelConfig = Field(alias="model_config")

    # The job's labels are both sets together (see submission.from_v1): together they are bounded too.
    @field_validator("model_cfg")
    @classmethod
    def _labels_together_within_the_bound(
        cls, model_cfg: CreateBatchCompletionsV1ModelConfig, info: ValidationInfo
    ) -> CreateBatchCompletionsV1ModelConfig:
        labels = info.data.get("labels")  # absent when they were refused themselves
        if labels is not None and (together := len({**model_cfg.labels, **labels})) > MAX_LABELS:
            raise ValueError(
                f"labels: model_config.labels and labels together are {together} labels, at most {MAX_LABELS}"
            )
        return model_cfg


def _inline_content() -> Any:
    """v2 content: one of the inline shapes of the registry's kinds, told apart by `inline_content_kind`."""
    shapes = tuple(Annotated[kind.inline_content, Tag(kind.name)] for kind in KINDS if kind.inline_content is not None)
    objects = " or ".join(kind.prompt_field for kind in INLINE_OBJECT_KINDS)
    lists = " or ".join(kind.name for kind in INLINE_LIST_KINDS)
    return Annotated[
        Union[shapes],  # noqa: UP007 (a union of a tuple of types, built at runtime)
        Discriminator(
            inline_content_kind,
            custom_error_type="invalid_content",
            custom_error_message=f"content must be an object of {objects}, or a list of {lists} requests",
        ),
    ]


if TYPE_CHECKING:
    BatchContent = Any
else:
    BatchContent = _inline_content()


class CreateBatchCompletionsV2Request(_BatchCompletionsRequestBase):
    """Request object for batch completions."""

    content: BatchContent | None = Field(
        None,
        description="Either `input_data_path` or `content` needs to be provided. When input_data_path is provided, "
        "the input file should be a JSON file of type List[CreateBatchCompletionsRequestContent].",
    )
    model_cfg: BatchCompletionsModelConfig = Field(alias="model_config")
    # Not in Scale's v2: ours (v1 keeps Scale's schema exactly; its jobs use the team's and deployment's).
    cache: ResultCacheMode = "on"

    @field_validator("content", mode="before")
    @classmethod
    def _one_kind_of_request(cls, content: Any) -> Any:
        """A list mixing chat and completion requests is named for what it is, at the first request of the
        other kind (`content.2`): otherwise it fails deep inside the kind the first request chose
        (`content.chat.2.messages`)."""
        if isinstance(content, list) and content and all(isinstance(item, dict) for item in content):
            kinds = [inline_list_kind(item).name for item in content]
            if (other := next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)) is not None:
                each = " or ".join(f"all {kind.name} requests (`{kind.prompt_field}`)" for kind in INLINE_LIST_KINDS)
                why = (
                    f"request {other} is a {kinds[other]} request and request 0 a {kinds[0]} request: a job's "
                    f"content is {each}; send two jobs"
                )
                # At the request of the other kind (`content.2`), where the client's list went wrong.
                raise ValidationError.from_exception_data(
                    "content",
                    [
                        InitErrorDetails(
                            type=PydanticCustomError("mixed_requests", why), loc=(other,), input=content[other]
                        )
                    ],
                )
        return content

    @field_validator("content", mode="wrap")
    @classmethod
    def _errors_at_wire_paths(cls, content: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """An error inside the content is located where it is on the wire (`content.0.n`), without the name
        of the shape the parser tried (`content.completion.0.n`), which no request spells."""
        try:
            return handler(content)
        except ValidationError as exc:
            raise ValidationError.from_exception_data(
                exc.title, [_at_wire_path(error) for error in exc.errors()]
            ) from None


_CONTENT_TAGS = {kind.name for kind in KINDS}
_BUILT_IN_ERRORS = set(get_args(ErrorType))


def _at_wire_path(error: Any) -> InitErrorDetails:
    """One content error again, its location without the shape's tag."""
    loc = tuple(error["loc"])
    if loc and loc[0] in _CONTENT_TAGS:
        loc = loc[1:]
    kind = error["type"]
    if kind in _BUILT_IN_ERRORS:
        return InitErrorDetails(type=kind, loc=loc, input=error["input"], ctx=error.get("ctx", {}))
    # The discriminator's own error type: its message is already written out.
    return InitErrorDetails(
        type=PydanticCustomError(kind, error["msg"].replace("{", "{{").replace("}", "}}")),
        loc=loc,
        input=error["input"],
    )
