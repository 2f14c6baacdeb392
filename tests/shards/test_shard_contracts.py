"""What a shard worker reports back is checked where the orchestrator reads it: a report of another shape
fails the shard's step naming the field, not the steps that read it later."""

import json
import pickle

import dagster as dg
import pytest

from batch_pipeline.launch.base import ShardResult, worker_failure, worker_stats
from batch_pipeline.launch.k8s import PodHardware
from batch_pipeline.shards.format import ShardSpec
from batch_pipeline.shards.protocol import (
    FailureMessage,
    ProgressMessage,
    ShardStats,
    ShardTask,
    StatsMessage,
    read_worker_message,
    worker_message_payload,
)


@pytest.fixture
def task() -> ShardTask:
    shard = ShardSpec(shard_index=3, directory="/work/job/shards/003", item_count=2, prompt_count=2)
    return ShardTask(shard=shard, model_config={"model": "m"}, job_id="batch-1")


def _stats(**changes) -> dict:
    stats = ShardStats(shard_index=3, items=2)
    stats.generated += 2
    stats.errors += 1
    stats.dtype = "float32"
    return json.loads(json.dumps(stats.to_dict() | changes))


def _report(**changes) -> dict:
    """Stats as the worker sends them through Pipes: a stats message, as JSON."""
    return {"kind": "stats", "stats": _stats(**changes)}


def _sent(message) -> dict:
    return json.loads(json.dumps(worker_message_payload(message)))


def test_stats_round_trip_through_the_report(task):
    report = _report()
    stats = worker_stats(task, [_sent(ProgressMessage({"requests_done": 1})), report])
    assert stats == ShardStats.from_dict(report["stats"]) and stats.to_dict() == report["stats"]
    assert (stats.generated, stats.errors, stats.dtype) == (2, 1, "float32")


@pytest.mark.parametrize(
    ("report", "named"),
    [
        ({"kind": "stats", "stats": {k: v for k, v in _stats().items() if k != "items"}}, "items: Field required"),
        # a field with a default is required too: its default would hide the rename
        ({"kind": "stats", "stats": {"error_count" if k == "errors" else k: v for k, v in _stats().items()}}, "errors"),
        (
            {"kind": "stats", "stats": {"error_count" if k == "errors" else k: v for k, v in _stats().items()}},
            "error_count",
        ),
        (_stats(), "discriminator 'kind'"),  # the stats of a release that sent them bare
        ({"kind": "statistics", "stats": _stats()}, "'statistics'"),
        ({"kind": "progress", "figures": {"requests_done": "many"}}, "figures.requests_done"),
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


def test_a_worker_that_ends_on_progress_or_a_failure_did_not_report_its_stats(task):
    with pytest.raises(dg.Failure, match="shard 3: the worker's last message was its progress, not its stats"):
        worker_stats(task, [_sent(ProgressMessage({"requests_done": 1}))])
    with pytest.raises(dg.Failure, match="its failure, not its stats"):
        worker_stats(task, [_sent(FailureMessage("disk full"))])


def test_each_message_kind_reads_back_as_sent_and_the_failure_is_the_last_reason_given():
    stats = ShardStats.from_dict(_stats())
    for message in (ProgressMessage({"requests_done": 2}), FailureMessage("OSError: disk full"), StatsMessage(stats)):
        assert read_worker_message(_sent(message)) == message
    reports = [_sent(FailureMessage("first")), _sent(ProgressMessage({})), _sent(FailureMessage("last")), None]
    assert worker_failure(reports) == "last"
    assert worker_failure([_sent(ProgressMessage({})), {"failure": "a bare key of no release"}]) is None


def test_no_report_at_all_fails_naming_the_shard(task):
    with pytest.raises(dg.Failure, match="shard 3: the worker exited without reporting its stats"):
        worker_stats(task, [])


def test_a_shard_result_pickles_and_its_metadata_entry_is_the_stats_and_the_pod(task):
    stats = ShardStats.from_dict(_stats())
    local = ShardResult(task=task, stats=stats)
    assert pickle.loads(pickle.dumps(local)) == local  # as Dagster's IO manager passes it between steps
    assert local.metadata_entry() == stats.to_dict()
    pod = ShardResult(task=task, stats=stats, where=PodHardware(hardware={"gpus": 1}, inferred=None))
    assert pickle.loads(pickle.dumps(pod)) == pod
    assert list(pod.metadata_entry()) == [*stats.to_dict(), "pod_hardware", "pod_hardware_inferred"]
    assert pod.metadata_entry()["pod_hardware"] == {"gpus": 1}


def test_a_result_an_older_release_pickled_comes_back_with_its_pod(task):
    """Dagster keeps run_shard's outputs pickled: a run re-executed after an upgrade reads results whose pod
    an older release kept in a field of its own, of a class in launch.base."""
    stats = ShardStats.from_dict(_stats())
    pod = PodHardware(hardware={"gpus": 2}, inferred="inferred gpus 2")

    class OlderResult:  # what such a pickle holds: the classes by their names, and the fields as they were
        def __reduce_ex__(self, protocol):
            return object.__new__, (ShardResult,), {"task": task, "stats": stats, "pod": pod}

    # protocol 0 names each class as `module\nname\n`: the pod's class where the older release had it
    pickled = pickle.dumps(OlderResult(), protocol=0)
    older = pickled.replace(b"batch_pipeline.launch.k8s\nPodHardware\n", b"batch_pipeline.launch.base\nPodHardware\n")
    assert older != pickled
    unpickled = pickle.loads(older)
    assert unpickled == ShardResult(task=task, stats=stats, where=pod)
    assert unpickled.metadata_entry()["pod_hardware_inferred"] == "inferred gpus 2"


def test_a_failed_pods_reason_is_the_workers_own_from_its_last_pipes_lines():
    """dagster-k8s's error quotes the pod's last log lines; the worker's failure message is among them."""
    from batch_pipeline.launch.k8s import _worker_failure

    line = json.dumps(
        {
            "__dagster_pipes_version": "0.1",
            "method": "report_custom_message",
            "params": {"payload": _sent(FailureMessage("OSError: [Errno 28] No space left on device"))},
        }
    )
    pod_error = f"Pod failed.\nlast lines:\n2026-12-01T00:00:00Z {line}\nTraceback (most recent call last): ..."
    assert _worker_failure(pod_error) == "OSError: [Errno 28] No space left on device"
    assert _worker_failure("Pod failed: OOMKilled") is None


def test_a_task_an_older_release_pickled_comes_back_in_its_contract_types(task):
    """Dagster keeps plan_shards' outputs pickled: a run re-executed after an upgrade reads tasks whose
    parts an older release kept as dicts, and the Kubernetes launcher reads them as models."""
    from batch_pipeline.contract import BatchCompletionsModelConfig, ToolConfig

    # a release before owner_team (the job's team): its task is of no team's queue
    state = {name: value for name, value in task.__dict__.items() if name != "owner_team"} | {
        "model_config": {"model": "m", "trust_remote_code": False, "tensor_parallel_size": None},
        "hardware": {"gpus": 2, "memory": "16Gi"},
        "tool_config": {"name": "code_evaluator", "max_iterations": 3},
    }

    class OlderTask:  # what such a pickle holds: the class by its name, and the fields as they were
        def __reduce_ex__(self, protocol):
            return object.__new__, (ShardTask,), state

    unpickled = pickle.loads(pickle.dumps(OlderTask()))
    assert isinstance(unpickled.model_config, BatchCompletionsModelConfig) and unpickled.model_config.model == "m"
    assert isinstance(unpickled.tool_config, ToolConfig) and unpickled.tool_config.max_iterations == 3
    assert unpickled.hardware == {"gpus": 2, "memory": "16Gi"} and unpickled.shard == task.shard
    assert unpickled.owner_team is None
    assert pickle.loads(pickle.dumps(unpickled)) == unpickled


# The keys of a completed job's metadata file, in order, as docs/jobs.md describes them (and a resumed job's).
COMPLETED_KEYS = [
    "job_id",
    "dagster_run_id",
    "model",
    "output_data_path",
    "num_requests",
    "num_errors",
    "prompt_tokens",
    "completion_tokens",
    "wall_s",
    "completion_tokens_per_s",
    "completion_tokens_per_wall_s",
    "engine_start_s",
    "merge_s",
    "finished_at",
    "data_parallelism",
    "num_deduplicated",
    "num_cut_from_longer",
    "dtype",
    "tool_config",
    "shards",
]
RESUME_KEYS = [
    "resumed_from",
    "resumed_from_run_id",
    "resume_requests_kept",
    "resume_requests_generated",
    "resume_completion_tokens_kept",
    "resume_completion_tokens_generated",
]


def _completed_metadata(task):
    from datetime import UTC, datetime

    from batch_pipeline.shards.metadata import DataParallelism, JobMetadata, ShardEntry

    stats = ShardStats.from_dict(_stats())
    pod = ShardResult(task=task, stats=stats, where=PodHardware(hardware={"gpus": 1}, inferred="gpu_type: the default"))
    return JobMetadata(
        job_id="batch-1",
        dagster_run_id="run-1",
        model="m",
        output_data_path="/data/out.json",
        num_requests=2,
        num_errors=1,
        prompt_tokens=10,
        completion_tokens=7,
        wall_s=3.5,
        completion_tokens_per_s=2.0,
        completion_tokens_per_wall_s=2.0,
        engine_start_s=1.0,
        merge_s=0.01,
        finished_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        data_parallelism=DataParallelism(requested=2, used=1, reason="this deployment runs at most 1 shard workers"),
        num_deduplicated=0,
        num_cut_from_longer=0,
        dtype=None,  # a figure not known is written as null, not left out
        tool_config=None,
        shards=[
            ShardEntry.model_validate(ShardResult(task=task, stats=stats).metadata_entry()),
            ShardEntry.model_validate(pod.metadata_entry()),
        ],
    )


def test_a_completed_jobs_metadata_file_has_its_keys_and_reads_back_as_it_was_written(task):
    from batch_pipeline.shards.metadata import JobMetadata

    metadata = _completed_metadata(task)
    written = json.loads(metadata.to_json())
    assert list(written) == COMPLETED_KEYS
    assert written["finished_at"] == "2026-01-02T03:04:05.678901+00:00"  # isoformat, as it always was
    assert written["dtype"] is None and written["tool_config"] is None
    reason = "this deployment runs at most 1 shard workers"
    assert written["data_parallelism"] == {"requested": 2, "used": 1, "reason": reason}
    # Each shard's entry is flat: the stats, then the pod's fields where a launcher sized one.
    local, pod = written["shards"]
    assert local == ShardStats.from_dict(_stats()).to_dict()
    assert list(pod) == [*local, "pod_hardware", "pod_hardware_inferred"] and pod["pod_hardware"] == {"gpus": 1}
    again = JobMetadata.from_json(metadata.to_json())
    assert again == metadata and again.to_json() == metadata.to_json()
    assert again.shards is not None and again.shards[1].pod_hardware_inferred == "gpu_type: the default"


def test_a_shard_entry_of_another_shape_is_refused_naming_the_field(task):
    from pydantic import ValidationError

    from batch_pipeline.shards.metadata import ShardEntry

    with pytest.raises(ValidationError, match="renamed"):
        ShardEntry.model_validate(ShardStats.from_dict(_stats()).to_dict() | {"renamed": 1})


def test_a_stopped_runs_metadata_file_is_the_summary_its_row_keeps_and_reads_back_the_same():
    from batch_pipeline.shards.metadata import JobMetadata
    from batch_pipeline.store.results import JobResults

    results = JobResults(
        job_id="batch-1",
        dagster_run_id="run-1",
        status="cancelled",
        num_requests=4,
        num_finished=1,
        num_unfinished=3,
        reason="the job was cancelled",
    )
    metadata = JobMetadata.model_validate(results.model_dump(exclude_none=True))
    written = json.loads(metadata.to_json())
    assert written == results.model_dump(exclude_none=True)  # no completed run's key, not even as null
    assert JobMetadata.from_json(metadata.to_json()).to_json() == metadata.to_json()


class _Resumed:
    """A job's resume as the job store knows it (a JobRecord's fields)."""

    def __init__(self, resume_count=1, requests_kept=3, completion_tokens_kept=30):
        self.resume_count = resume_count
        self.resumed_from = "cancelled"
        self.resumed_from_run_id = "run-0"
        self.requests_kept = requests_kept
        self.completion_tokens_kept = completion_tokens_kept


def test_the_resume_figures_are_what_was_kept_and_what_was_generated_since_never_below_zero():
    from batch_pipeline.shards.metadata import ResumeFigures, resume_figures

    assert resume_figures(_Resumed(resume_count=None), 5, 50) is None  # never resumed
    assert resume_figures(_Resumed(requests_kept=None), 5, 50) is None  # its run has not counted the checkpoints
    assert resume_figures(_Resumed(), 5, 50) == ResumeFigures(
        resume_requests_kept=3,
        resume_requests_generated=2,
        resume_completion_tokens_kept=30,
        resume_completion_tokens_generated=20,
    )
    # Tokens not all counted yet (running, or a stopped run): no tokens generated to tell.
    assert resume_figures(_Resumed(), 4, None).resume_completion_tokens_generated is None
    # Requests gone from a changed input took their kept results with them.
    shrunk = resume_figures(_Resumed(requests_kept=3, completion_tokens_kept=None), 2, 0)
    assert (shrunk.resume_requests_generated, shrunk.resume_completion_tokens_kept) == (0, 0)
    assert shrunk.resume_completion_tokens_generated == 0


def test_a_resumed_jobs_metadata_file_adds_the_resume_figures_and_reads_back_the_same(task):
    from batch_pipeline.shards.metadata import JobMetadata

    metadata = _completed_metadata(task)
    assert metadata.with_resume(_Resumed(resume_count=None), 2, 7) == metadata
    resumed = metadata.with_resume(_Resumed(requests_kept=1, completion_tokens_kept=3), 2, 7)
    written = json.loads(resumed.to_json())
    assert list(written) == COMPLETED_KEYS + RESUME_KEYS
    assert [written[key] for key in RESUME_KEYS] == ["cancelled", "run-0", 1, 1, 3, 4]
    assert JobMetadata.from_json(resumed.to_json()).to_json() == resumed.to_json()
