"""A plan's hits as its job answers them (issue 49), without an engine: the planner holds where each hit's
output is, not the output (a job of large cached outputs plans in bounded memory), a hit's output gets an
id and a creation time of this job's, and a payload that turns bad after the lookup is generated."""

from __future__ import annotations

import functools
import json
import time
import tracemalloc

from batch_pipeline.pipeline.result_cache import keep_results, lookup_in, payload_path
from batch_pipeline.shards.format import RESULTS_FILE, WorkItem, read_work_items
from batch_pipeline.shards.planning import PlanningSettings, write_shards
from batch_pipeline.shards.records import ItemSize
from batch_pipeline.shards.replanning import write_job_shards
from batch_pipeline.shards.result_cache import CacheIdentity, with_cache_hits
from batch_pipeline.store.result_cache import ResultCacheStore

IDENTITY = CacheIdentity(owner="team:a", model="m", weights_digest="w1", engine='{"dtype": "float32"}')


def greedy(index: int) -> WorkItem:
    return WorkItem(index, "completion", {"prompt": f"document {index}", "max_tokens": 4096, "temperature": 0})


def computed_job(tmp_path, items: list[WorkItem], outputs: list[dict], job_id: str = "job-1"):
    """A completed shard of `job_id` that computed `outputs`, kept in the team's cache."""
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    shard = tmp_path / job_id / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "input.jsonl").write_text("".join(work.to_line() + "\n" for work in items))
    with open(shard / "output.tsv", "w", encoding="utf-8") as handle:
        for work, output in zip(items, outputs):
            handle.write(f"{work.index}\t{json.dumps(output, ensure_ascii=False)}\n")
    assert keep_results(store, IDENTITY, job_id, [str(shard)], str(tmp_path / "cache")) == len(items)
    return store


def planned_results(work_dir) -> dict[int, dict]:
    lines = (work_dir / "shards" / "000" / RESULTS_FILE).read_text(encoding="utf-8").splitlines()
    return {int(index): json.loads(payload) for index, _, payload in (line.partition("\t") for line in lines)}


def test_a_plan_of_hits_with_large_outputs_holds_their_locations_not_their_outputs(tmp_path):
    count, text_size = 600, 32_000  # long completions: ~19 MB of outputs in all
    items = [greedy(i) for i in range(count)]
    usage = {"prompt_tokens": 3, "completion_tokens": 4096}
    outputs = [{"choices": [{"text": f"{i} " + "x" * text_size}], "usage": usage} for i in range(count)]
    store = computed_job(tmp_path, items, outputs)
    del outputs
    hits = functools.partial(with_cache_hits, identity=IDENTITY, lookup=lookup_in(store, "team:a"))
    # Several shards and a least number of tokens each: the plan reads ahead to count them, hits and all.
    settings = PlanningSettings(max_shards=None, min_tokens_per_shard=1)
    work_dir = tmp_path / "job-2"

    tracemalloc.start()
    try:
        sized = ((greedy(i), ItemSize(1, 4099)) for i in range(count))
        planned = write_job_shards(sized, str(work_dir), None, 4, settings, tool_loop=False, cache_hits=hits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert sum(shard.cached_count for shard in planned.shards) == count
    assert peak < count * text_size / 8, f"planning held {peak} bytes"


def test_a_hit_gets_an_id_of_its_own_and_says_when_this_job_answered_it(tmp_path):
    items = [
        WorkItem(0, "completion", {"prompt": "a", "max_tokens": 4, "temperature": 0}),
        WorkItem(1, "chat", {"messages": [{"role": "user", "content": "b"}], "temperature": 0}),
        WorkItem(2, "responses", {"input": "c", "temperature": 0}),
        WorkItem(3, "embeddings", {"input": "d"}),
    ]
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    call = {"id": "chatcmpl-tool-0123456789abcdef", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    response_usage = {"input_tokens": 2, "output_tokens": 1, "total_tokens": 3}
    outputs = [
        {"id": "cmpl-aaaaaaaaaaaa-0", "object": "text_completion", "created": 1000, "choices": [{"text": "x"}]},
        {
            "id": "chatcmpl-aaaaaaaaaaaa-1",
            "object": "chat.completion",
            "created": 1000,
            "choices": [{"message": message}],
        },
        {
            "id": "resp_aaaaaaaaaaaa-2",
            "object": "response",
            "created_at": 1000,
            "output": [{"type": "message", "id": "msg_aaaaaaaaaaaa-2", "content": [{"text": "z"}]}],
        },
        {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}], "model": "m"},
    ]
    for output in outputs:
        output["usage"] = response_usage if output["object"] == "response" else usage
    store = computed_job(tmp_path, items, outputs)
    hits = functools.partial(with_cache_hits, identity=IDENTITY, lookup=lookup_in(store, "team:a"))
    settings = PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    # The later job's requests are at other indexes: the cache answers by request, not by position.
    later = [WorkItem(work.index + 5, work.kind, work.request) for work in items]
    before = int(time.time())
    answers = []
    for job in ("job-2", "job-3"):
        sized = iter([(work, ItemSize(1, 5)) for work in later])
        write_job_shards(sized, str(tmp_path / job), None, 1, settings, tool_loop=False, cache_hits=hits)
        answers.append(planned_results(tmp_path / job))

    for answered in answers:
        assert sorted(answered) == [5, 6, 7, 8]
        for work, computed in zip(later, outputs):
            entry = answered[work.index]
            assert entry["cached_from_job_id"] == "job-1"
            if "id" in computed:  # made as the worker makes one: the kind's prefix, a token, the index last
                prefix = computed["id"].split("aaaaaaaaaaaa")[0]
                assert entry["id"].startswith(prefix) and entry["id"].endswith(f"-{work.index}")
                assert entry["id"] != computed["id"]
            stamp = "created_at" if "created_at" in computed else "created" if "created" in computed else None
            if stamp is not None:
                assert entry[stamp] >= before
            same = {"id", "created", "created_at", "cached_from_job_id", "usage", "choices", "output"}
            assert {k: v for k, v in entry.items() if k not in same} == {
                k: v for k, v in computed.items() if k not in same
            }
        completion, chat, response, embedding = (answered[work.index] for work in later)
        assert completion["choices"] == outputs[0]["choices"]
        (new_call,) = chat["choices"][0]["message"]["tool_calls"]
        assert new_call["id"].startswith("chatcmpl-tool-") and new_call["id"] != call["id"]
        assert {**new_call, "id": call["id"]} == call
        assert response["output"][0]["id"] == "msg_" + response["id"].removeprefix("resp_")
        assert embedding["data"] == outputs[3]["data"] and "id" not in embedding
    # Two later jobs answered from the same entries: no id of one repeats in the other.
    ids = [entry["id"] for answered in answers for entry in answered.values() if "id" in entry]
    assert len(ids) == len(set(ids)) == 6


def test_a_payload_replaced_after_the_lookup_is_generated_when_the_plan_writes_it(tmp_path):
    items = [greedy(i) for i in range(3)]
    outputs = [
        {"choices": [{"text": f"answer {i}"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}} for i in range(3)
    ]
    store = computed_job(tmp_path, items, outputs)
    marked = list(
        with_cache_hits([(work, ItemSize(1, 10 + work.index)) for work in items], IDENTITY, lookup_in(store, "team:a"))
    )
    assert all(work.cached is not None for work, _ in marked)
    path = payload_path(str(tmp_path / "cache"), "team:a", "job-1")
    lines = open(path, "rb").read().split(b"\n")
    lines[1] = b"[" + b" " * (len(lines[1]) - 2) + b"]"  # JSON, of the same length, but no output
    with open(path, "wb") as handle:
        handle.write(b"\n".join(lines))

    (shard,) = write_shards(marked, 1, str(tmp_path / "job-2"))

    assert (shard.item_count, shard.cached_count, shard.estimated_tokens) == (3, 2, 11)
    assert [work.index for work in read_work_items(shard.input_path)] == [0, 1, 2]
    assert sorted(planned_results(tmp_path / "job-2")) == [0, 2]
