"""What a shard worker reports back is checked where the orchestrator reads it: a report of another shape
fails the shard's step naming the field, not the steps that read it later."""

import json
import pickle

import dagster as dg
import pytest

from batch_pipeline.launch.base import PodHardware, ShardResult, worker_stats
from batch_pipeline.shards.format import ShardSpec
from batch_pipeline.shards.protocol import ShardStats, ShardTask


@pytest.fixture
def task() -> ShardTask:
    shard = ShardSpec(shard_index=3, directory="/work/job/shards/003", item_count=2, prompt_count=2)
    return ShardTask(shard=shard, model_config={"model": "m"}, job_id="batch-1")


def _report(**changes) -> dict:
    """Stats as the worker sends them through Pipes: JSON."""
    stats = ShardStats(shard_index=3, items=2)
    stats.generated += 2
    stats.errors += 1
    stats.dtype = "float32"
    return json.loads(json.dumps(stats.to_dict() | changes))


def test_stats_round_trip_through_the_report(task):
    report = _report()
    stats = worker_stats(task, [{"progress": {}}, report])
    assert stats == ShardStats.from_dict(report) and stats.to_dict() == report
    assert (stats.generated, stats.errors, stats.dtype) == (2, 1, "float32")


@pytest.mark.parametrize(
    ("report", "named"),
    [
        ({k: v for k, v in _report().items() if k != "items"}, "items: Field required"),
        # a field with a default is required too: its default would hide the rename
        ({"error_count" if k == "errors" else k: v for k, v in _report().items()}, "errors: Field required"),
        ({"error_count" if k == "errors" else k: v for k, v in _report().items()}, "error_count"),
        (_report(completion_tokens="many"), "completion_tokens: Input should be a valid integer"),
        (_report(sandbox=["not", "a", "mapping"]), "sandbox: Input should be a valid dictionary"),
    ],
)
def test_a_report_of_another_shape_fails_the_step_naming_shard_and_field(task, report, named):
    with pytest.raises(dg.Failure) as failure:
        worker_stats(task, [report])
    assert failure.value.description.startswith("shard 3: ")
    assert named in failure.value.description
    assert not failure.value.allow_retries  # the same worker would report the same again


def test_no_report_at_all_fails_naming_the_shard(task):
    with pytest.raises(dg.Failure, match="shard 3: the worker exited without reporting its stats"):
        worker_stats(task, [])


def test_a_shard_result_pickles_and_its_metadata_entry_is_the_stats_and_the_pod(task):
    stats = ShardStats.from_dict(_report())
    local = ShardResult(task=task, stats=stats)
    assert pickle.loads(pickle.dumps(local)) == local  # as Dagster's IO manager passes it between steps
    assert local.metadata_entry() == stats.to_dict()
    pod = ShardResult(task=task, stats=stats, pod=PodHardware(hardware={"gpus": 1}, inferred=None))
    assert list(pod.metadata_entry()) == [*stats.to_dict(), "pod_hardware", "pod_hardware_inferred"]
    assert pod.metadata_entry()["pod_hardware"] == {"gpus": 1}
