"""The result cache's key, the plan's use of hits, and the index's isolation by team (issue 49), without an
engine: what decides a deterministic request's output is in its key, a hit is planned as a checkpointed
result that weighs nothing, and a team's lookups find only its own entries."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from batch_pipeline.pipeline.result_cache import keep_results, lookup_in
from batch_pipeline.shards.format import RESULTS_FILE, CachedResult, WorkItem, read_work_items
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.records import ItemSize
from batch_pipeline.shards.result_cache import CacheIdentity, with_cache_hits
from batch_pipeline.store.result_cache import ResultCacheStore

IDENTITY = CacheIdentity(owner="team:a", model="m", weights_digest="w1", engine='{"dtype": "float32"}')
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def item(index: int = 0, kind: str = "completion", **request) -> WorkItem:
    return WorkItem(index=index, kind=kind, request=request or dict(GREEDY))


def cached_hit(directory, output: str, job_id: str = "job-1") -> CachedResult:
    """Where a lookup finds `output`: the only line of a payload file of `job_id`'s."""
    path = directory / f"{job_id}.jsonl"
    path.write_text(output + "\n", encoding="utf-8")
    return CachedResult(str(path), 0, len(output.encode()), job_id, 5, 1)


@pytest.mark.parametrize(
    "changed",
    [
        replace(IDENTITY, owner="team:b"),
        replace(IDENTITY, model="other"),
        replace(IDENTITY, weights_digest="w2"),
        replace(IDENTITY, engine='{"dtype": "bfloat16"}'),
        replace(IDENTITY, engine='{"block_size": 64, "dtype": "float32"}'),
    ],
)
def test_the_team_the_model_its_weights_and_the_engine_are_in_the_key(changed):
    assert changed.key(item()) != IDENTITY.key(item())


@pytest.mark.parametrize(
    "request_fields",
    [
        {**GREEDY, "max_tokens": 9},
        {**GREEDY, "prompt": "The capital of Spain is"},
        {**GREEDY, "logprobs": 2},
        {**GREEDY, "stop": ["."]},
        {**GREEDY, "temperature": 0.5, "seed": 1},
    ],
)
def test_every_field_of_the_request_is_in_the_key(request_fields):
    assert IDENTITY.key(item(**request_fields)) not in (None, IDENTITY.key(item()))


def test_a_seed_decides_a_samples_key_and_no_seed_means_no_key():
    sampled = {**GREEDY, "temperature": 0.8}
    assert IDENTITY.key(item(**sampled)) is None
    assert IDENTITY.key(item(**sampled, seed=1)) != IDENTITY.key(item(**sampled, seed=2))
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    assert IDENTITY.key(item(kind="chat", **chat)) != IDENTITY.key(item(kind="chat", **chat, chat_template_kwargs={}))


def test_a_hit_is_planned_as_a_checkpointed_result_weighing_nothing(tmp_path):
    output = json.dumps({"choices": [{"text": " Paris"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    hit = cached_hit(tmp_path, output)
    items = [(item(0), ItemSize(1, 13)), (item(1, prompt="other", max_tokens=8, temperature=0), ItemSize(1, 11))]
    asked: list[list[str]] = []

    def lookup(keys):
        asked.append(keys)
        return {IDENTITY.key(items[0][0]): hit}

    marked = list(with_cache_hits(items, IDENTITY, lookup))
    shards = write_shards(marked, 1, str(tmp_path))

    assert len(asked) == 1 and len(asked[0]) == 2  # one lookup for the batch
    assert marked[0][1].tokens == 0 and marked[1][1].tokens == 11
    (shard,) = shards
    assert (shard.item_count, shard.cached_count, shard.estimated_tokens) == (2, 1, 11)
    assert [work.index for work in read_work_items(shard.input_path)] == [0, 1]
    index, _, payload = (tmp_path / "shards" / "000" / RESULTS_FILE).read_text().rstrip("\n").partition("\t")
    entry = json.loads(payload)
    assert (index, entry["cached_from_job_id"], entry["usage"]["prompt_tokens_details"]) == (
        "0",
        "job-1",
        {"cached_tokens": 5},
    )


def test_a_teams_lookup_finds_only_its_own_results(tmp_path):
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    shard = tmp_path / "work" / "shards" / "000"
    shard.mkdir(parents=True)
    work = item(0)
    (shard / "input.jsonl").write_text(work.to_line() + "\n")
    output = {"choices": [{"text": " Paris"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    (shard / "output.tsv").write_text(f"0\t{json.dumps(output)}\n")

    assert keep_results(store, IDENTITY, "job-1", [str(shard)], str(tmp_path / "cache")) == 1
    key_a = IDENTITY.key(work)
    found = lookup_in(store, "team:a")([key_a])
    assert found[key_a].job_id == "job-1" and found[key_a].payload_length == len(json.dumps(output))
    # Team b's lookup of team a's very key finds nothing, nor does its own key of the same request.
    assert lookup_in(store, "team:b")([key_a, replace(IDENTITY, owner="team:b").key(work)]) == {}
    assert store.figures("team:a").entries == 1 and store.figures("team:b").entries == 0
    # New weights for the model: the old ones' results are dropped with their file.
    assert keep_results(store, replace(IDENTITY, weights_digest="w2"), "job-2", [str(shard)], str(tmp_path / "cache"))
    assert store.figures("team:a").entries == 1
    assert lookup_in(store, "team:a")([key_a]) == {}


def test_only_a_jobs_first_plan_looks_up_the_cache_and_its_later_runs_keep_the_hits_it_checkpointed(tmp_path):
    """A retry or a resume writes the shards of the plan its first run recorded, over that run's shards:
    its hits are already checkpointed results there, and a lookup now could answer a request otherwise
    than the plan its shards follow."""
    import functools

    from batch_pipeline.shards.planning import PlanningSettings, RecordedPlan
    from batch_pipeline.shards.replanning import write_job_shards

    output = json.dumps({"choices": [{"text": " Paris"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    hit = cached_hit(tmp_path, output)
    asked: list[list[str]] = []

    def lookup(keys):
        asked.append(keys)
        return {IDENTITY.key(item(0)): hit}

    def items():
        other = item(1, prompt="other", max_tokens=8, temperature=0)
        return iter([(item(0), ItemSize(1, 13)), (other, ItemSize(1, 11))])

    hits = functools.partial(with_cache_hits, identity=IDENTITY, lookup=lookup)
    settings = PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    work_dir = str(tmp_path / "job")
    first = write_job_shards(items(), work_dir, None, 1, settings, tool_loop=False, cache_hits=hits)
    assert len(asked) == 1 and [shard.cached_count for shard in first.shards] == [1]
    checkpoint = tmp_path / "job" / "shards" / "000" / RESULTS_FILE
    checkpointed = checkpoint.read_text()

    recorded = RecordedPlan.from_json(first.recorded.to_json())
    for kept in (recorded, None):  # a resume of the recorded plan; a retry of a run that died before recording it
        again = write_job_shards(items(), work_dir, kept, 1, settings, tool_loop=False, cache_hits=hits)
        assert len(asked) == 1  # no lookup
        assert sum(shard.item_count for shard in again.shards) == 2
        assert checkpoint.read_text() == checkpointed  # the first plan's hit, kept as a checkpointed result
