"""OpenAI embedding requests (`/v1/embeddings` lines) on vLLM's pooling runner: each input one pooling
request of the shard's engine, the item's output OpenAI's embedding response.

What the engine would refuse without naming the field (a token id past the vocabulary, `dimensions` the
model was not trained for) is refused here first, naming it; the rest of the batch runs.
"""

from __future__ import annotations

import base64
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.kinds.embedding import EmbeddingRequest
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.worker.handlers import RequestRefused
from batch_pipeline.worker.vllm_api import PoolingParams


class EmbeddingRequests:
    def __init__(self, llm: Any, model_config: BatchCompletionsModelConfig) -> None:
        self.engine_model = llm.llm_engine.model_config
        self.model_name = model_config.served_model_name or model_config.model

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        request = EmbeddingRequest.model_validate(item.request)
        model = self.engine_model  # a pooling model's: worker/kinds.py builds this handler for no other
        if request.dimensions is not None:
            self._check_dimensions(request.dimensions)
        vocabulary = model.get_vocab_size()
        prompts: list[str | dict[str, Any]] = []
        for position, one in enumerate(request.inputs()):
            if isinstance(one, str):
                prompts.append(one)
                continue
            if (largest := max(one)) >= vocabulary:
                raise RequestRefused(
                    "invalid_request",
                    "input",
                    f"input {position}: token id {largest} is past the model's vocabulary of {vocabulary} tokens",
                )
            prompts.append({"prompt_token_ids": one})
        params = PoolingParams(task="embed", dimensions=request.dimensions)
        added: list[str] = []
        try:  # all or none
            for position, prompt in enumerate(prompts):
                engine_id = f"{item.index}-{position}"
                engine.add_request(engine_id, prompt, params)
                added.append(engine_id)
        except Exception:
            if added:
                engine.abort_request(added)
            raise
        return added

    def _check_dimensions(self, dimensions: int) -> None:
        model = self.engine_model
        if not model.is_matryoshka:
            raise RequestRefused(
                "unsupported_field",
                "dimensions",
                f"{self.model_name!r} is not trained for fewer dimensions (Matryoshka); leave dimensions unset",
            )
        size = model.embedding_size
        allowed = model.matryoshka_dimensions
        if not 1 <= dimensions <= size or (allowed is not None and dimensions not in allowed):
            which = f"one of {allowed}" if allowed is not None else f"1 to {size}"
            raise RequestRefused("invalid_request", "dimensions", f"must be {which} for {self.model_name!r}")

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any]:
        as_base64 = item.request.get("encoding_format") == "base64"
        data = []
        for position, result in enumerate(results):
            vector = result.outputs.data.float()
            embedding: str | list[float]
            if as_base64:  # OpenAI's: the vector's float32 bytes, little-endian, as the openai SDK decodes them
                embedding = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": position, "embedding": embedding})
        tokens = sum(len(result.prompt_token_ids or []) for result in results)
        return {
            "object": "list",
            "data": data,
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
