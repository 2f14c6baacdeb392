"""Holes found by attacking the result cache (issue 49), without an engine: what decides an output but was
outside its key (where the shards compute, a tokenizer of its own, model files copied with their mtimes),
a payload file replaced under its index, and a job whose runs planned under different identities."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from batch_pipeline.admission.paths import PathPolicy
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract.model_config import BatchCompletionsModelConfig
from batch_pipeline.models.weights import weights_digest
from batch_pipeline.pipeline.result_cache import (
    job_cache,
    keep_results,
    lookup_in,
    payload_path,
    planned_identity,
    record_planned_identity,
    shard_machine,
)
from batch_pipeline.shards.format import RESULTS_FILE, WorkItem
from batch_pipeline.shards.planning import write_shards
from batch_pipeline.shards.records import ItemSize
from batch_pipeline.shards.result_cache import CacheIdentity, with_cache_hits
from batch_pipeline.store.result_cache import ResultCacheStore

POLICY = AdmissionPolicy(
    paths=PathPolicy(frozenset({"file"}), ()),
    tenants_file="",
    allow_remote_code=False,
    hardware_maxima={},
    engine_maxima={},
)
CPU = shard_machine("local", None, {})


def model_files(directory):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (directory / "model.safetensors").write_bytes(b"weights-1")
    return directory


def identity_of(store, model_config, machine=CPU):
    cache = job_cache(True, "team:a", "on", False, model_config, POLICY, store, machine)
    return cache.identity


def test_a_gpu_shards_results_never_answer_a_cpu_job(tmp_path):
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    config = BatchCompletionsModelConfig(model=str(model_files(tmp_path / "model")))
    work = WorkItem(0, "completion", {"prompt": "hi", "max_tokens": 4, "temperature": 0})
    on_cpu = identity_of(store, config)
    others = [
        identity_of(store, config, shard_machine("local", None, {"gpus": 1})),
        identity_of(store, config, shard_machine("local", None, {"gpus": 1, "gpu_type": "nvidia-h100"})),
        identity_of(store, config, shard_machine("local", None, {"cpus": 8})),
        identity_of(store, config, shard_machine("k8s", "worker:1", {})),
        identity_of(store, config, shard_machine("k8s", "worker:2", {})),
    ]
    keys = {on_cpu.key(work), *(other.key(work) for other in others)}
    assert len(keys) == 1 + len(others)


def test_a_tokenizer_of_its_own_is_part_of_the_models_identity(tmp_path):
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    model = model_files(tmp_path / "model")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": 1}')
    config = BatchCompletionsModelConfig(model=str(model), tokenizer=str(tokenizer))
    before = identity_of(store, config)
    (tokenizer / "tokenizer.json").write_text('{"version": 2, "added": "x"}')
    after = identity_of(store, config)
    assert before is not None and after is not None and before.weights_digest != after.weights_digest
    # A tokenizer whose files are elsewhere (a hub id) cannot be checked: the job takes no part.
    assert identity_of(store, config.model_copy(update={"tokenizer": "org/tokenizer"})) is None


def test_model_files_copied_with_their_sizes_and_mtimes_are_digested_again(tmp_path):
    store = ResultCacheStore(f"sqlite:///{tmp_path}/jobs.db")
    model = model_files(tmp_path / "model")
    weights = model / "model.safetensors"
    first = identity_of(store, BatchCompletionsModelConfig(model=str(model)))
    stat = weights.stat()
    # New weights of the same size, copied keeping the old file's mtime (cp -p, rsync -a, tar).
    replacement = tmp_path / "new.safetensors"
    replacement.write_bytes(b"weights-2")
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, weights)
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    second = identity_of(store, BatchCompletionsModelConfig(model=str(model)))
    assert second.weights_digest == weights_digest(model) != first.weights_digest


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
    lookup = lookup_in(store, "team:a")
    # The lookup sees the index and the file's size; the replaced line is found out as the plan writes it.
    planned = write_shards(
        with_cache_hits([(work, ItemSize(1, 7)) for work in items], identity, lookup), 1, str(tmp_path)
    )
    (shard_spec,) = planned
    assert (shard_spec.item_count, shard_spec.cached_count, shard_spec.estimated_tokens) == (2, 1, 7)
    results = (tmp_path / "shards" / "000" / RESULTS_FILE).read_text(encoding="utf-8").splitlines()
    assert [line.partition("\t")[0] for line in results] == ["1"]  # request 0 is generated
    assert json.loads(results[0].partition("\t")[2])["choices"] == outputs[1]["choices"]
    # Cut short: a miss at the lookup.
    with open(path, "wb") as handle:
        handle.write(b"\n".join(lines)[:-5])
    assert keys[1] not in lookup(keys)


def test_a_job_whose_runs_planned_under_different_identities_keeps_nothing(tmp_path):
    identity = CacheIdentity("team:a", "m", "w1", CPU)
    work_dir = str(tmp_path)
    assert planned_identity(work_dir) is None
    record_planned_identity(work_dir, identity)
    record_planned_identity(work_dir, identity)  # a resume under the same one
    assert planned_identity(work_dir) == identity
    record_planned_identity(work_dir, replace(identity, weights_digest="w2"))  # the weights changed between runs
    assert planned_identity(work_dir) is None
    record_planned_identity(work_dir, identity)
    assert planned_identity(work_dir) is None
