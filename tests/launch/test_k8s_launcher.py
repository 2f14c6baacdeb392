"""The Kubernetes launcher through a whole job: dagster-k8s's Pipes client creates each shard's pod, follows
it to completion and reads the worker's Pipes messages from its log stream; a failed pod fails its shard.
The Kubernetes API is the one test double here (tests/k8s_stand_in.py, named as such); the job, the
worker and vLLM are real."""

import json

import pytest

from tests.conftest import MODEL, step_failure_messages
from tests.k8s_stand_in import StandInKubernetes

pytestmark = pytest.mark.slow


@pytest.fixture
def kubernetes(tmp_path, monkeypatch):
    stand_in = StandInKubernetes(tmp_path)
    for key, value in {
        "BATCH_PIPELINE_SHARD_LAUNCHER": "k8s",
        "BATCH_PIPELINE_WORKER_IMAGE": "registry.example/w:1",
        "BATCH_PIPELINE_K8S_NAMESPACE": "batch",
        "BATCH_PIPELINE_KUBECONFIG": str(stand_in.kubeconfig),
        "BATCH_PIPELINE_K8S_POLL_INTERVAL_S": "0.5",
    }.items():
        monkeypatch.setenv(key, value)
    yield stand_in
    stand_in.stop()


def test_each_shard_runs_in_the_pod_built_for_it_and_reports_through_its_log(
    run_job, dagster_home, kubernetes, tmp_path
):
    output = tmp_path / "out.json"
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "data_parallelism": 2,
            "gpus": 1,
            "gpu_type": "nvidia-tesla-t4",
            "memory": "8Gi",
            "labels": {"team": "search/ranking"},
            "content": {
                "prompts": ["The capital of France is", "Water boils at"],
                "max_new_tokens": 4,
                "temperature": 0.0,
            },
        }
    )
    assert result.success, step_failure_messages(result)
    assert len(json.loads(output.read_text())) == 2
    assert len(kubernetes.created) == 2 and kubernetes.pods == {}  # both pods created, and deleted when done
    for pod in kubernetes.created:
        (container,) = pod["spec"]["containers"]
        assert container["image"] == "registry.example/w:1"
        # storage was left out: the catalog model's weights (a quarter GiB) and scratch
        assert container["resources"]["limits"] == {
            "nvidia.com/gpu": "1",
            "cpu": "8",  # the deployment's default: no pod is unbounded
            "memory": "8Gi",
            "ephemeral-storage": "11Gi",
        }
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4"}
        assert pod["metadata"]["labels"]["batch-pipeline.io/team"] == "search-ranking"
        # as the image's non-root user, with no capabilities and no service account token
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert pod["spec"]["automountServiceAccountToken"] is False
    shards = sorted(pod["metadata"]["labels"]["batch-pipeline.io/shard"] for pod in kubernetes.created)
    assert shards == ["0", "1"]
    # the workers' progress and stats came back through Pipes, from the pods' logs
    logs = [entry.user_message for entry in dagster_home.all_logs(result.run_id)]
    assert any("progress 1/1 requests" in message for message in logs)
    metadata = json.loads((tmp_path / "out.json.metadata.json").read_text())
    assert [shard["items"] for shard in metadata["shards"]] == [1, 1]
    assert [shard["pod_hardware_inferred"] for shard in metadata["shards"]] == ["inferred storage 11Gi"] * 2


def test_a_failed_pod_fails_its_shard_with_the_workers_reason(run_job, kubernetes, tmp_path):
    result = run_job(
        {
            "output_data_path": str(tmp_path / "out.json"),
            "model_config": {"model": str(tmp_path / "no-model")},
            "content": {"prompts": ["x"], "max_new_tokens": 2, "temperature": 0.0},
        }
    )
    assert not result.success
    assert len(kubernetes.created) == 3  # the first pod and the retry policy's two
    # the reason the API and the UI show: the worker's own, read back from the failed pod's log
    (failure,) = [e.step_failure_data.user_failure_data.description for e in result.all_events if e.is_step_failure]
    assert failure.startswith("shard 0: the worker failed: ") and "no-model" in failure, failure


def _sleeping_pod(name: str, job_id: str, shard: int, run_id: str) -> dict:
    """A shard pod as an earlier run's step launched it, still working: its worker a long sleep."""
    labels = {
        "batch-pipeline.io/component": "shard-worker",
        "batch-pipeline.io/job-id": job_id,
        "batch-pipeline.io/shard": str(shard),
        "batch-pipeline.io/run-id": run_id,
    }
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {"name": "dagster-pipes-execution", "image": "registry.example/w:1", "command": ["sleep", "600"]}
            ],
        },
    }


def test_a_pod_left_on_the_shard_by_a_dead_run_is_stopped_before_the_new_one_starts(
    run_job, dagster_home, kubernetes, tokenizer, tmp_path
):
    # what a killed run worker leaves behind: its shard's pod, still running (and one of another job)
    kubernetes.create_pod(_sleeping_pod("dagster-deadrun-shard-0", "orphan-job", 0, "dead-run"))
    kubernetes.create_pod(_sleeping_pod("dagster-otherjob-shard-0", "other-job", 0, "other-run"))
    orphan, other = kubernetes.pods["dagster-deadrun-shard-0"], kubernetes.pods["dagster-otherjob-shard-0"]
    output = tmp_path / "out.json"
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "gpus": 1,
            "gpu_type": "nvidia-tesla-t4",
            "content": {"prompts": prompts, "max_new_tokens": 4, "temperature": 0.0},
        },
        job_id="orphan-job",
    )
    assert result.success, step_failure_messages(result)
    # the orphan was stopped (SIGTERM, or SIGKILL once its grace ran out), and gone before this run's pod of
    # the shard was created
    assert orphan.process.returncode is not None, "the dead run's pod still runs beside the new one"
    (new_pod,) = [
        pod for pod in kubernetes.created if pod["metadata"]["labels"].get("batch-pipeline.io/run-id") == result.run_id
    ]
    new = new_pod["metadata"]["name"]
    events = kubernetes.events
    assert events.index(("gone", orphan.name)) < events.index(("created", new)), events
    # another job's pod of the same shard index is none of this step's business
    assert other.process.poll() is None and other.name in kubernetes.pods
    assert ("deleting", other.name) not in events
    logs = [entry.user_message for entry in dagster_home.all_logs(result.run_id)]
    assert any("stopping pod dagster-deadrun-shard-0 (run dead-run, Running)" in message for message in logs), logs
    # and the job's output is whole: one answer per prompt, in order
    outputs = json.loads(output.read_text())
    assert len(outputs) == len(prompts)
    for prompt, answer in zip(prompts, outputs):
        assert answer["num_prompt_tokens"] == len(tokenizer(prompt).input_ids) and answer["text"], answer
