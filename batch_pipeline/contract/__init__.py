"""The wire contract: every type of the batch completions API (see shared/spec). Nothing else in the
package knows the wire format; everything else imports it from here."""

from batch_pipeline.contract.estimate import BatchCompletionsEstimate
from batch_pipeline.contract.jobs import (
    BatchCompletionsJob,
    BatchCompletionsJobStatus,
    CancelBatchCompletionsV2Response,
    CreateBatchCompletionsV1Response,
    CreateBatchCompletionsV2Response,
    GetBatchCompletionV2Response,
    ListBatchCompletionV2Response,
    UpdateBatchCompletionsV2Request,
    UpdateBatchCompletionsV2Response,
)
from batch_pipeline.contract.kinds.v1 import CreateBatchCompletionsV1RequestContent
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig, CreateBatchCompletionsV1ModelConfig
from batch_pipeline.contract.openai import (
    ChatMessage,
    FilteredChatCompletionV2Request,
    FilteredCompletionV2Request,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatText,
)
from batch_pipeline.contract.outputs import CompletionOutput, ErrorDetail, ErrorOutput, TokenOutput
from batch_pipeline.contract.requests import (
    CreateBatchCompletionsV1Request,
    CreateBatchCompletionsV2Request,
    GpuType,
    ToolConfig,
)

__all__ = [
    "BatchCompletionsEstimate",
    "BatchCompletionsJob",
    "BatchCompletionsJobStatus",
    "BatchCompletionsModelConfig",
    "CancelBatchCompletionsV2Response",
    "ChatMessage",
    "CompletionOutput",
    "CreateBatchCompletionsV1ModelConfig",
    "CreateBatchCompletionsV1Request",
    "CreateBatchCompletionsV1RequestContent",
    "CreateBatchCompletionsV1Response",
    "CreateBatchCompletionsV2Request",
    "CreateBatchCompletionsV2Response",
    "ErrorDetail",
    "ErrorOutput",
    "FilteredChatCompletionV2Request",
    "FilteredCompletionV2Request",
    "GetBatchCompletionV2Response",
    "GpuType",
    "ListBatchCompletionV2Response",
    "ResponseFormatJsonObject",
    "ResponseFormatJsonSchema",
    "ResponseFormatText",
    "TokenOutput",
    "ToolConfig",
    "UpdateBatchCompletionsV2Request",
    "UpdateBatchCompletionsV2Response",
]
