"""A payload file of the result cache (issue 49) replaced or cut under its index: a miss, never a failed plan
nor a wrong answer, whatever its text (multibyte UTF-8 included)."""

from __future__ import annotations

import json

from batch_pipeline.pipeline.result_cache import keep_results, lookup_in, payload_path
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.result_cache import CacheIdentity
from batch_pipeline.store.result_cache import ResultCacheStore

CPU = '{"dtype": "float32"}'


def test_a_payload_file_replaced_under_its_index_is_a_miss_never_a_failure(tmp_path):
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    identity = CacheIdentity("team:a", "m", "w1", CPU)
    shard = tmp_path / "work" / "shards" / "000"
    shard.mkdir(parents=True)
    items = [WorkItem(i, "completion", {"prompt": f"p{i}", "max_tokens": 4, "temperature": 0}) for i in range(2)]
    (shard / "input.jsonl").write_text("".join(work.to_line() + "\n" for work in items))
    usage = {"prompt_tokens": 2, "completion_tokens": 1}
    outputs = [{"choices": [{"text": f" é{i}"}], "usage": usage} for i in range(2)]  # multibyte text
    lines = [f"{i}\t{json.dumps(output, ensure_ascii=False)}\n" for i, output in enumerate(outputs)]
    (shard / "output.tsv").write_text("".join(lines), encoding="utf-8")
    cache_dir = str(tmp_path / "cache")
    assert keep_results(store, identity, "job-1", [str(shard)], cache_dir) == 2
    keys = [identity.key(work) for work in items]
    path = payload_path(cache_dir, "team:a", "job-1")
    lines = open(path, "rb").read().split(b"\n")
    # The first line replaced by JSON that is no object, of the same length; the second kept as it was.
    lines[0] = b'"' + b"x" * (len(lines[0]) - 2) + b'"'
    with open(path, "wb") as handle:
        handle.write(b"\n".join(lines))
    found = lookup_in(store, "team:a")(keys)
    assert keys[0] not in found and json.loads(found[keys[1]].output)["choices"] == outputs[1]["choices"]
    # Cut short: a miss too.
    with open(path, "wb") as handle:
        handle.write(b"\n".join(lines)[:-5])
    assert lookup_in(store, "team:a")(keys) == {}
