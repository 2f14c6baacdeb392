"""Reading inputs, planning shards, checkpoints and the merge: the data plane, without inference."""

import json

import pytest

from batch_pipeline.contract.records import RecordError
from batch_pipeline.core import io
from batch_pipeline.shards.format import format_result, read_work_items
from batch_pipeline.shards.merge import merge_sorted_outputs
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.records import work_items
from batch_pipeline.worker.checkpoint import recover_checkpoint

CONTENT = {"prompts": ["a", "b", "c"], "max_new_tokens": 4, "temperature": 0.0}


def _records(path):
    return [record for _, record in io.iter_json_records(str(path))]


def test_reads_a_json_array_an_object_and_jsonl(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([CONTENT, CONTENT]))
    single = tmp_path / "single.json"
    single.write_text(json.dumps(CONTENT, indent=2))
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps(CONTENT) + "\n\n" + json.dumps(CONTENT) + "\n")
    assert _records(array) == [CONTENT, CONTENT]
    assert _records(single) == [CONTENT]
    assert _records(lines) == [CONTENT, CONTENT]


def test_malformed_json_array_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompts": ["a"], "max_new_tokens": 4, "temperature": 0},\n  {"prompts": ["b"],, }\n]')
    with pytest.raises(io.InputFileError, match=r"line 3, column 21"):
        _records(path)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CONTENT) + "\n" + '{"prompts": ["x"\n')
    with pytest.raises(io.InputFileError, match=r"line 2, column"):
        _records(path)


def test_non_utf8_input_names_the_byte(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"prompts": ["caf\xe9"], "max_new_tokens": 4, "temperature": 0}]')
    with pytest.raises(io.InputFileError, match=r"not valid UTF-8 at byte 18"):
        _records(path)


@pytest.mark.parametrize("text", ["", "   \n", "42"])
def test_empty_or_scalar_input_is_refused(tmp_path, text):
    path = tmp_path / "odd.json"
    path.write_text(text)
    with pytest.raises(io.InputFileError, match=str(path)):
        _records(path)


def test_v1_content_fans_out_one_item_per_prompt_in_order():
    items = list(work_items([("content", CONTENT), ("element 1", {**CONTENT, "prompts": ["d"]})]))
    assert [(item.index, item.request["prompt"], size.prompts) for item, size in items] == [
        (0, "a", 1),
        (1, "b", 1),
        (2, "c", 1),
        (3, "d", 1),
    ]
    assert items[0][0].request == {
        "prompt": "a",
        "max_new_tokens": 4,
        "temperature": 0.0,
        "return_token_log_probs": False,
        "skip_special_tokens": True,
    }


def test_a_bad_record_is_named_with_its_place_and_field():
    records = [("element 0", CONTENT), ("element 1", {**CONTENT, "temperature": "hot"})]
    with pytest.raises(RecordError, match=r"element 1: temperature: Input should be a valid number"):
        list(work_items(records))
    with pytest.raises(RecordError, match=r"line 7: expected `prompts`"):
        list(work_items([("line 7", {"text": "no prompt here"})]))


def test_shards_are_balanced_and_cover_every_index_once(tmp_path):
    content = {**CONTENT, "prompts": [f"p{i}" for i in range(10)]}
    shards = write_shards(work_items([("content", content)]), 3, str(tmp_path))
    assert sorted(shard.prompt_count for shard in shards) == [3, 3, 4]
    seen = []
    for shard in shards:
        indices = [item.index for item in read_work_items(shard.input_path)]
        assert indices == sorted(indices)
        seen += indices
    assert sorted(seen) == list(range(10))


def test_balancing_weighs_completion_requests_by_prompts_and_n(tmp_path):
    records = [
        ("element 0", {"prompt": ["x"] * 6}),
        ("element 1", {"prompt": "y", "n": 2}),
        ("element 2", {"prompt": "z"}),
        ("element 3", {"prompt": [1, 2, 3]}),
    ]
    shards = write_shards(work_items(records), 2, str(tmp_path))
    assert sorted(shard.prompt_count for shard in shards) == [4, 6]


def test_more_shards_than_prompts_leaves_no_empty_shard(tmp_path):
    shards = write_shards(work_items([("content", CONTENT)]), 8, str(tmp_path))
    assert [shard.item_count for shard in shards] == [1, 1, 1]


def test_merge_restores_input_order_across_shards(tmp_path):
    outputs = {0: [0, 3, 4, 9], 1: [1, 2, 7], 2: [5, 6, 8]}
    paths = []
    for shard, indices in outputs.items():
        path = tmp_path / f"{shard}.tsv"
        path.write_text("".join(format_result(i, {"text": f"t{i}"}) for i in indices))
        paths.append(str(path))
    merged = list(merge_sorted_outputs(paths))
    assert [index for index, _ in merged] == list(range(10))
    assert [json.loads(payload)["text"] for _, payload in merged] == [f"t{i}" for i in range(10)]


def test_checkpoint_recovery_drops_a_torn_last_line(tmp_path):
    results = tmp_path / "results.tsv"
    whole = format_result(4, {"text": "x"}) + format_result(1, {"text": "tab\there"})
    results.write_text(whole + '7\t{"text": "cut off')
    assert recover_checkpoint(str(results)) == {1, 4}
    assert results.read_text() == whole
    assert recover_checkpoint(str(tmp_path / "absent.tsv")) == set()


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with io.atomic_write(str(target)) as handle:
            handle.write("partial new content")
            raise RuntimeError("disk on fire")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_work_is_ordered_longest_outputs_first_and_shared_contexts_together_and_else_in_input_order():
    """Within each window: the longest possible outputs first, requests sharing a context (a few-shot block, a
    system prompt) side by side where the first of them stood, and nothing else moved, so a batch of unrelated
    requests reaches the engine in the order raw vLLM would batch it (in bfloat16, greedy texts depend on it)."""
    from batch_pipeline.shards.format import WorkItem
    from batch_pipeline.worker.runner import engine_order

    prompts = ["FEW-SHOT A\nq1", "other 1", "FEW-SHOT A\nq2", "other 2", "FEW-SHOT A\nq3", "other 3"]
    items = [WorkItem(index=i, kind="v1", request={"prompt": p, "max_new_tokens": 8}) for i, p in enumerate(prompts)]
    ordered = [item.index for item in engine_order(iter(items), window=4)]
    assert ordered[:4] == [0, 2, 1, 3]  # the first window, the shared block together where it first stood
    assert sorted(ordered) == list(range(6)) and set(ordered[4:]) == {4, 5}

    def chat(index: int, system: str, question: str, max_tokens: int = 16, n: int = 1) -> WorkItem:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return WorkItem(index=index, kind="chat", request={"messages": messages, "max_tokens": max_tokens, "n": n})

    chats = [
        chat(0, "B", "q0"),
        chat(1, "A", "q1"),
        chat(2, "B", "q2"),
        chat(3, "C", "q3", max_tokens=512),
        chat(4, "D", "q4", n=64),
        chat(5, "A", "q5"),
    ]
    assert [item.index for item in engine_order(iter(chats), window=10)] == [4, 3, 0, 2, 1, 5]
    unrelated = [chat(i, f"system {9 - i}", f"question {9 - i}") for i in range(10)]
    assert [item.index for item in engine_order(iter(unrelated), window=10)] == list(range(10))
