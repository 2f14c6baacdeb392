"""A plan's hits as its job answers them (issue 49), without an engine: the planner holds where each hit's
output is, not the output (a job of large cached outputs plans in bounded memory), and a payload that
turns bad after the lookup is generated."""

from __future__ import annotations

import functools
import json
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
