"""Shard workers as Kubernetes pods, through dagster-k8s's Pipes client.

The pod is sized by the request: `gpus` → `nvidia.com/gpu` (or the MIG slice of `gpu_type`), `gpu_type` →
a node selector, `cpus`/`memory`/`storage` → requests and limits, the job's deadline →
`activeDeadlineSeconds`, labels → pod labels (under `batch-pipeline.io/`), the job's team's `kueue_queue` in
the tenants file → the Kueue queue the pod waits in. Image, namespace, service account, tolerations, env and
secrets come from the deployment's config. Every pod runs with no capabilities, no privilege escalation,
the runtime's seccomp profile, a read-only root filesystem and no service account token; as the image's
non-root user, except the shards of a `tool_config` job (see `pod_security` and `TOOL_SCRATCH_MODES`).
Nothing a run's tags or config hold reaches the pod: `PipesK8sClient` builds it from these fields alone
(dagster-k8s reads the `dagster-k8s/config` tag for run pods, never for Pipes pods). `PipesK8sClient` rather
than `execute_k8s_job`: the worker already speaks Pipes (progress lines, stats), and the client follows the
pod and reads its log stream.

A shard's pod outlives the run worker that launched it; before launching its own, a shard step stops every
pod still working on the same job and shard (see `stop_earlier_shard_pods`), so one worker at a time writes
the shard's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from batch_pipeline.admission.hardware import InvalidHardware, hardware_maxima, hardware_problems, kubernetes_quantity
from batch_pipeline.launch.base import (
    ForwardsProgress,
    ProgressCallback,
    ShardLauncher,
    ShardResult,
    raise_if_past_deadline,
    worker_failure,
    worker_stats,
)
from batch_pipeline.launch.kinds import KUBERNETES
from batch_pipeline.shards.protocol import ShardTask

# NVIDIA GPU feature discovery's product label, per GPU type of the spec; MIG types also name their slice.
DEFAULT_GPU_NODE_SELECTORS: dict[str, dict[str, str]] = {
    "nvidia-tesla-t4": {"nvidia.com/gpu.product": "Tesla-T4"},
    "nvidia-ampere-a10": {"nvidia.com/gpu.product": "NVIDIA-A10"},
    "nvidia-ampere-a100": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
    "nvidia-ampere-a100e": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
    "nvidia-hopper-h100": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "nvidia-hopper-h100-1g20gb": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "nvidia-hopper-h100-3g40gb": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
}
MIG_RESOURCES = {
    "nvidia-hopper-h100-1g20gb": "nvidia.com/mig-1g.20gb",
    "nvidia-hopper-h100-3g40gb": "nvidia.com/mig-3g.40gb",
}
# GPU memory per device (GiB), to size a shard whose request names no GPU count.
GPU_MEMORY_GIB = {
    "nvidia-tesla-t4": 16,
    "nvidia-ampere-a10": 24,
    "nvidia-ampere-a100": 40,
    "nvidia-ampere-a100e": 80,
    "nvidia-hopper-h100": 80,
    "nvidia-hopper-h100-1g20gb": 20,
    "nvidia-hopper-h100-3g40gb": 40,
}
# Weights take this share of GPU memory at most: the rest is KV cache, activations and CUDA graphs.
WEIGHTS_SHARE_OF_GPU = 0.6
LABEL_PREFIX = "batch-pipeline.io/"
# What k8s/network-policy.yaml selects: every shard pod carries it.
SHARD_POD_LABELS = {LABEL_PREFIX + "component": "shard-worker"}
# The image's non-root user and its home (k8s/worker.Dockerfile); caches live under the home.
WORKER_UID = 10001
WORKER_HOME = "/home/worker"
# The code_evaluator's sandbox runs model-written code under a uid of its own per slot and removes what it
# left: switching uids, and owning and killing what those uids made, takes exactly these.
SANDBOX_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETUID", "SETGID")
# With a read-only root filesystem, the only places the worker writes (the synced weights, vLLM's and
# torch's caches, temp files), on the node's disk and counted in the pod's ephemeral-storage.
SCRATCH_MOUNTS = {"tmp": "/tmp", "home": WORKER_HOME}
WORKER_COMMAND = ["python", "-m", "batch_pipeline.worker"]
# A tool_config pod's scratch, whose emptyDirs the kubelet makes 0777: the sandbox's uids share /tmp, so it
# is sticky (no uid renames or removes another's files); the worker's home (caches, synced weights) is the
# worker's alone; and the worker's temp dir (TMPDIR: the sandbox's uid leases, each execution's code and
# captures, its working directory) is one the sandboxed uids may pass through to their own working
# directory but neither list nor write. An init container sets the modes before the worker starts.
WORKER_TMPDIR = "/var/lib/batch-pipeline/tmp"
TOOL_SCRATCH_MOUNTS = {**SCRATCH_MOUNTS, "worker-tmp": WORKER_TMPDIR}
TOOL_SCRATCH_MODES = {"/tmp": 0o1777, WORKER_HOME: 0o700, WORKER_TMPDIR: 0o711}
# The init container's program: chmod PATH MODE (octal) for each pair of arguments.
SET_MODES = "import os, sys; [os.chmod(path, int(mode, 8)) for path, mode in zip(sys.argv[1::2], sys.argv[2::2])]"
JOB_ID_LABEL = LABEL_PREFIX + "job-id"
SHARD_LABEL = LABEL_PREFIX + "shard"
# The Dagster run that launched the pod: says whose an earlier pod of the same shard was.
RUN_ID_LABEL = LABEL_PREFIX + "run-id"
# Kueue's pod integration (kueue.sigs.k8s.io/docs/tasks/run/plain_pods, v0.19): a plain pod names its
# LocalQueue in this label, and that is all it carries. Kueue's pod webhook adds the rest when it creates
# the pod (the `kueue.x-k8s.io/managed` label, a finalizer, and the `kueue.x-k8s.io/admission` scheduling
# gate, which Kueue removes once the pod's workload is admitted); and only in the namespaces its
# Configuration manages (`managedJobsNamespaceSelector`). The launcher adds no gate itself: where Kueue
# does not manage the namespace nobody would remove it, and the shard would wait forever. Each shard is a
# workload of its own, no pod group: a group is admitted whole, and its failed pods are not replaced.
# Request labels never reach this key: they are renamed under LABEL_PREFIX (`label_key`).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def infer_hardware(
    requested: dict[str, Any], weights_bytes: int | None, default_gpu_type: str, default_gpus: int
) -> tuple[dict[str, Any], str | None]:
    """The request's hardware with what it left out filled in from the model's size, and a sentence saying
    what was chosen (None when the request named it all)."""
    hardware = dict(requested)
    chosen = []
    if hardware.get("gpu_type") is None:
        hardware["gpu_type"] = default_gpu_type
        chosen.append(f"gpu_type {default_gpu_type} (the deployment's default)")
    if hardware.get("gpus") is None:
        if weights_bytes:
            per_gpu = GPU_MEMORY_GIB[hardware["gpu_type"]] * 2**30 * WEIGHTS_SHARE_OF_GPU
            gpus = max(1, math.ceil(weights_bytes / per_gpu))
            gpus = 1 << (gpus - 1).bit_length()  # tensor parallelism wants a power of two
            chosen.append(f"gpus {gpus} for {weights_bytes / 2**30:.1f} GiB of weights")
        else:
            gpus = default_gpus
            chosen.append(f"gpus {gpus} (weights not listable, the deployment's default)")
        hardware["gpus"] = gpus
    if weights_bytes and hardware.get("memory") is None:
        hardware["memory"] = f"{math.ceil(weights_bytes * 1.5 / 2**30) + 8}Gi"  # load buffers + the runtime
        chosen.append(f"memory {hardware['memory']}")
    if weights_bytes and hardware.get("storage") is None:
        hardware["storage"] = f"{math.ceil(weights_bytes * 1.2 / 2**30) + 10}Gi"  # the synced weights + scratch
        chosen.append(f"storage {hardware['storage']}")
    return hardware, ("inferred " + ", ".join(chosen)) if chosen else None


@dataclasses.dataclass(frozen=True)
class PodHardware:
    """What a shard's pod was sized to, and a sentence saying what of it was inferred (None: all asked for):
    the shard's `pod_hardware` and `pod_hardware_inferred` in the job's metadata file."""

    hardware: dict[str, Any]
    inferred: str | None

    def metadata_entry(self) -> dict[str, Any]:
        return {"pod_hardware": self.hardware, "pod_hardware_inferred": self.inferred}


def pod_security(task: ShardTask) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) securityContext of a shard: the image's non-root user with every capability
    dropped; a `tool_config` job's worker as uid 0 with only the sandbox's capabilities, so that it can
    run the model's code as unprivileged uids of its own."""
    seccomp = {"type": "RuntimeDefault"}
    if task.tool_config is None:
        pod = {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID, "seccompProfile": seccomp}
        capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    else:
        pod = {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0, "seccompProfile": seccomp}
        capabilities = {"drop": ["ALL"], "add": list(SANDBOX_CAPABILITIES)}
    container = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }
    return pod, container


def pod_resources(hardware: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(limits, requests) of the worker's container for `hardware` with its `gpus` filled in: its GPUs (the
    MIG slice of its gpu_type, else whole GPUs) as limits alone; cpus, memory and storage each requested as
    much as they are limited to."""
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if hardware["gpus"]:
        limits[MIG_RESOURCES.get(hardware.get("gpu_type") or "", "nvidia.com/gpu")] = str(hardware["gpus"])
    for field, resource in (("cpus", "cpu"), ("memory", "memory"), ("storage", "ephemeral-storage")):
        if hardware.get(field) is not None:
            requests[resource] = limits[resource] = kubernetes_quantity(field, hardware[field])[0]
    return limits, requests


def label_value(value: str) -> str:
    """A valid label value: at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)


def label_key(key: str) -> str:
    name = label_value(key) or "label"
    return LABEL_PREFIX + name


class K8sShardLauncher(ShardLauncher):
    """Each shard worker in its own pod, sized by the request."""

    kind = KUBERNETES

    image: str = Field(description="The worker image (this package on a vLLM base image).")
    namespace: str = Field(default="default", description="Where the shard pods run.")
    service_account_name: str | None = Field(default=None, description="The pods' service account.")
    image_pull_policy: str = Field(default="IfNotPresent")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")
    env_secrets: list[str] = Field(default_factory=list, description="Secrets whose keys become env vars.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations (GPU taints).")
    gpu_node_selectors: dict[str, dict[str, str]] = Field(
        default_factory=lambda: dict(DEFAULT_GPU_NODE_SELECTORS),
        description="Node labels per gpu_type of the spec.",
    )
    default_gpus: int = Field(default=1, description="GPUs of a shard when neither request nor weights say.")
    # No default, as the admission policy has none: a launcher built by hand names the bounds it leaves open.
    max_hardware: dict[str, str] = Field(
        description="The deployment's bound per hardware field as written (BATCH_PIPELINE_MAX_GPUS, _CPUS, "
        "_MEMORY, _STORAGE): no pod is sized past one, what was inferred from the weights included.",
    )
    tenants_file: str = Field(
        description="The tenants file (BATCH_PIPELINE_TENANTS) whose teams' `kueue_queue` their shard pods are "
        "queued in; empty: no teams, no queue label.",
    )
    default_gpu_type: str = Field(default="nvidia-ampere-a100e", description="gpu_type of a request naming none.")
    # Every pod carries cpu and memory limits (the admission policy refuses one without): an unbounded pod may
    # take its node's cores and memory from the other teams' shards beside it.
    default_cpus: str = Field(
        default="8", description="cpus of a shard whose request names none (BATCH_PIPELINE_K8S_DEFAULT_CPUS)."
    )
    default_memory: str = Field(
        default="64Gi",
        description="memory of a shard whose request names none and whose weights say nothing "
        "(BATCH_PIPELINE_K8S_DEFAULT_MEMORY).",
    )
    kubeconfig_file: str | None = Field(default=None, description="Outside the cluster: the kubeconfig to use.")
    poll_interval_s: float = Field(default=10.0, description="How often the pod's state is read.")
    earlier_pod_stop_timeout_s: float = Field(
        default=120.0,
        description="How long a shard step waits for an earlier pod of its shard (a dead run's) to be gone "
        "before failing rather than running beside it; above the pods' 30 s termination grace.",
    )
    # (the tenants file it was read from, each team's kueue_queue): see _kueue_queues
    _kueue_queues_read: tuple[str, dict[str, str]] | None = PrivateAttr(default=None)

    def hardware_for(self, task: ShardTask) -> tuple[dict[str, Any], str | None]:
        from batch_pipeline.models.catalog import weights_bytes

        size = weights_bytes(task.model_config.model, task.model_config.checkpoint_path)
        return infer_hardware(dict(task.hardware), size, self.default_gpu_type, self.default_gpus)

    def shard_charge(self, task: ShardTask) -> float:
        """The shard's pod's limits, what it could use: its GPUs, else its CPUs (requests equal limits; the
        deployment's default where the request names none, as the pod gets)."""
        hardware, _ = self.hardware_for(task)
        gpus = hardware.get("gpus")
        gpus = self.default_gpus if gpus is None else gpus
        if gpus:
            return float(gpus)
        try:
            return float(kubernetes_quantity("cpus", self.with_default_limits(hardware)["cpus"])[1])
        except InvalidHardware as exc:
            raise dg.Failure(str(exc), allow_retries=False) from None

    def pod_overrides(
        self,
        task: ShardTask,
        now: float | None = None,
        hardware: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metadata, spec) of the shard's pod, to which the Pipes client adds only its name, its common
        labels and the Pipes bootstrap environment; a pod of a team with a `kueue_queue` waits in that Kueue
        LocalQueue (`kueue_queue_for`). Raises InvalidHardware naming the field, for sizes no pod can carry
        or over the deployment's maxima (what was inferred from the weights too)."""
        hardware = self.bounded_hardware(dict(task.hardware) if hardware is None else hardware)
        limits, requests = pod_resources(hardware)
        pod_security_context, container_security_context = pod_security(task)
        scratch = SCRATCH_MOUNTS if task.tool_config is None else TOOL_SCRATCH_MOUNTS
        mounts = [{"name": name, "mountPath": path} for name, path in scratch.items()]
        container = self._worker_container(task, limits, requests, container_security_context, mounts)
        spec: dict[str, Any] = {
            "containers": [container],
            "restartPolicy": "Never",
            "securityContext": pod_security_context,
            "volumes": [{"name": name, "emptyDir": {}} for name in scratch],
            # the worker never calls the Kubernetes API (Pipes reads its log from outside), nor needs the
            # namespace's services as variables
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
        }
        if task.tool_config is not None:
            spec["initContainers"] = [self._scratch_modes_container(mounts, limits)]
        spec |= self._node_placement(hardware.get("gpu_type"))
        if task.deadline is not None:
            spec["activeDeadlineSeconds"] = max(1, int(task.deadline - (now or time.time())))
        return {"labels": self.pod_labels(task, run_id)}, spec

    def bounded_hardware(self, hardware: dict[str, Any]) -> dict[str, Any]:
        """The hardware a pod is sized to: the deployment's defaults where it names none (`gpus` too), held
        to the deployment's maxima. Raises InvalidHardware naming the first field no pod can carry."""
        hardware = self.with_default_limits(hardware)
        if hardware.get("gpus") is None:
            hardware["gpus"] = self.default_gpus
        problems = hardware_problems(hardware, hardware_maxima(self.max_hardware))
        if problems:
            field, why = problems[0]
            raise InvalidHardware(f"{field}: {why}")
        return hardware

    def _worker_container(
        self,
        task: ShardTask,
        limits: dict[str, str],
        requests: dict[str, str],
        security_context: dict[str, Any],
        mounts: list[dict[str, str]],
    ) -> dict[str, Any]:
        """The worker's container: this deployment's image running the worker, sized and locked down."""
        container: dict[str, Any] = {
            "name": "dagster-pipes-execution",
            "image": self.image,
            "command": list(WORKER_COMMAND),
            "imagePullPolicy": self.image_pull_policy,
            "resources": {"limits": limits, **({"requests": requests} if requests else {})},
            "securityContext": security_context,
            "volumeMounts": mounts,
        }
        if self.env_secrets:
            container["envFrom"] = [{"secretRef": {"name": name}} for name in self.env_secrets]
        if task.tool_config is not None:
            container["env"] = [{"name": "TMPDIR", "value": WORKER_TMPDIR}]  # where the sandbox's leases go
        return container

    def _node_placement(self, gpu_type: str | None) -> dict[str, Any]:
        """Where the pod may run and as whom: its gpu_type's nodes, the deployment's tolerations and service
        account. Raises InvalidHardware for a gpu_type this deployment maps to no nodes."""
        placement: dict[str, Any] = {}
        if gpu_type is not None:
            if gpu_type not in self.gpu_node_selectors:
                raise InvalidHardware(f"gpu_type: {gpu_type!r} has no node selector in this deployment")
            placement["nodeSelector"] = dict(self.gpu_node_selectors[gpu_type])
        if self.tolerations:
            placement["tolerations"] = list(self.tolerations)
        if self.service_account_name:
            placement["serviceAccountName"] = self.service_account_name
        return placement

    def pod_labels(self, task: ShardTask, run_id: str | None = None) -> dict[str, str]:
        """The request's labels under LABEL_PREFIX, then ours over them: the network policy's, the shard's,
        the run's, and the Kueue queue of the job's team (`kueue_queue_for`)."""
        labels = {label_key(key): label_value(value) for key, value in task.labels.items()}
        labels.update(SHARD_POD_LABELS)
        labels.update(shard_pod_selector(task))
        if run_id is not None:
            labels[RUN_ID_LABEL] = label_value(run_id)
        if (queue := self.kueue_queue_for(task)) is not None:
            labels[KUEUE_QUEUE_LABEL] = queue
        return labels

    def with_default_limits(self, hardware: dict[str, Any]) -> dict[str, Any]:
        """The hardware with the deployment's cpus and memory where it names none, each at most the
        deployment's maximum. Raises InvalidHardware naming the setting for a default no pod can carry."""
        maxima = hardware_maxima(self.max_hardware)
        filled = dict(hardware)
        for field, default in (("cpus", self.default_cpus), ("memory", self.default_memory)):
            if filled.get(field) is None:
                value = kubernetes_quantity(field, default)
                bound = maxima.get(field)
                filled[field] = bound[0] if bound is not None and bound[1] < value[1] else value[0]
        return filled

    def kueue_queue_for(self, task: ShardTask) -> str | None:
        """The Kueue LocalQueue of the job's shard pods: the `kueue_queue` the operator's tenants file gives
        the job's team (`ShardTask.owner_team`, which the pipeline reads from the job store, never from the
        request or the run's tags, which the team itself writes); None for a job of no team (an admin's, the
        launchpad's) or a team with none."""
        return None if task.owner_team is None else self._kueue_queues().get(task.owner_team)

    def _kueue_queues(self) -> dict[str, str]:
        """Each team's `kueue_queue` in the tenants file, read once by this launcher rather than per pod."""
        from batch_pipeline.tenancy.tenants import tenants_at

        # Kept with the path it was read from: a copy of the launcher naming another file reads that one.
        if self._kueue_queues_read is None or self._kueue_queues_read[0] != self.tenants_file:
            registry = tenants_at(self.tenants_file)
            teams = registry.teams if registry is not None else {}
            queues = {name: team.config.kueue_queue for name, team in teams.items() if team.config.kueue_queue}
            self._kueue_queues_read = (self.tenants_file, queues)
        return self._kueue_queues_read[1]

    def _scratch_modes_container(self, mounts: list[dict[str, str]], limits: dict[str, str]) -> dict[str, Any]:
        """Sets TOOL_SCRATCH_MODES on the emptyDirs. As uid 0, their owner, it needs no capability; bounded as
        the worker is (a pod's containers all carry limits), by no more than it."""
        modes = [part for path, mode in TOOL_SCRATCH_MODES.items() for part in (path, f"{mode:o}")]
        bounded = {name: value for name, value in limits.items() if name in ("cpu", "memory")}
        return {
            "name": "scratch-modes",
            "image": self.image,
            "command": ["python", "-I", "-c", SET_MODES, *modes],
            "imagePullPolicy": self.image_pull_policy,
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "privileged": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": mounts,
            "resources": {"limits": bounded, "requests": dict(bounded)},
        }

    def _kubernetes_api(self) -> Any:
        """The core API client, configured as the Pipes client configures its own."""
        import kubernetes
        from dagster_k8s.client import DagsterKubernetesClient

        if self.kubeconfig_file:
            kubernetes.config.load_kube_config(config_file=self.kubeconfig_file)
        else:
            kubernetes.config.load_incluster_config()
        return DagsterKubernetesClient.production_client().core_api

    def worker_image(self) -> str:
        return self.image

    def step_modules(self) -> list[str]:
        """The Kubernetes client and dagster-k8s (~0.7 s and more to import), which each shard step uses,
        and validate_input's quantity parser wherever the operator bounds cpus, memory or storage (the
        shipped k8s config does)."""
        return ["kubernetes", "dagster_k8s"]

    def stop_earlier_shard_pods(self, context: dg.OpExecutionContext, task: ShardTask) -> list[str]:
        """Delete every pod still on this job and shard, and wait until they are gone; their names.

        Such a pod was left by a run worker that died (its retry or re-execution is this run) or by an
        earlier attempt of this step whose process died: it would otherwise generate the same requests
        and write the same checkpoint as the pod this step is about to start. Fails, retryably, when
        one is not gone within `earlier_pod_stop_timeout_s`."""
        from kubernetes.client.rest import ApiException

        core_api = self._kubernetes_api()
        selector = ",".join(f"{key}={value}" for key, value in shard_pod_selector(task).items())
        index = task.shard.shard_index
        stopping = core_api.list_namespaced_pod(self.namespace, label_selector=selector).items
        for pod in stopping:
            try:
                core_api.delete_namespaced_pod(pod.metadata.name, self.namespace)
            except ApiException as exc:
                if exc.status != 404:  # 404: it went by itself meanwhile
                    raise
            run = (pod.metadata.labels or {}).get(RUN_ID_LABEL) or "unlabelled"
            phase = pod.status.phase if pod.status else "unknown"
            context.log.warning(
                f"shard {index}: stopping pod {pod.metadata.name} (run {run}, {phase}), "
                "still on this shard, before starting this run's"
            )
        stopped = sorted(pod.metadata.name for pod in stopping)
        left, give_up_at = set(stopped), time.monotonic() + self.earlier_pod_stop_timeout_s
        while left:
            time.sleep(1.0)
            left &= {
                pod.metadata.name for pod in core_api.list_namespaced_pod(self.namespace, label_selector=selector).items
            }
            if left and time.monotonic() > give_up_at:
                raise dg.Failure(
                    f"shard {index}: earlier pods of this shard still not gone after "
                    f"{self.earlier_pod_stop_timeout_s:.0f} s: {', '.join(sorted(left))}; "
                    "not starting another beside them"
                )
        if stopped:
            context.log.info(f"shard {index}: stopped earlier pods {', '.join(stopped)}")
        return stopped

    def run_shard(
        self, context: dg.OpExecutionContext, task: ShardTask, on_progress: ProgressCallback | None = None
    ) -> ShardResult:
        from dagster_k8s import PipesK8sClient
        from dagster_k8s.pipes import PipesK8sPodLogsMessageReader

        class PodLogsMessageReader(ForwardsProgress, PipesK8sPodLogsMessageReader):
            pass

        reader = PodLogsMessageReader()
        reader.on_progress = on_progress

        hardware, inferred = self.hardware_for(task)
        if inferred:
            context.log.info(f"shard {task.shard.shard_index}: {inferred}")
        task = engine_spread_over_gpus(task, hardware)
        try:
            meta, spec = self.pod_overrides(task, hardware=hardware, run_id=context.run_id)
        except InvalidHardware as exc:
            raise dg.Failure(str(exc), allow_retries=False) from None
        self.stop_earlier_shard_pods(context, task)
        try:
            client = PipesK8sClient(
                env=self.env,
                kubeconfig_file=self.kubeconfig_file,
                load_incluster_config=not self.kubeconfig_file,
                poll_interval=self.poll_interval_s,
                message_reader=reader,
            )
            completed = client.run(
                context=context,
                namespace=self.namespace,
                base_pod_meta=meta,
                base_pod_spec=spec,
                extras={"task": task.to_dict()},
            )
        except Exception as exc:  # the pod failed (Dagster's error type for it is not public API)
            raise_if_past_deadline(task)
            reason = _worker_failure(str(exc)) or str(exc).strip().splitlines()[0]
            raise dg.Failure(f"shard {task.shard.shard_index}: the worker failed: {reason}") from None
        stats = worker_stats(task, completed.get_custom_messages())
        return ShardResult(task=task, stats=stats, where=PodHardware(hardware=hardware, inferred=inferred))


def shard_pod_selector(task: ShardTask) -> dict[str, str]:
    """The labels every pod of this job and shard carries, whichever run launched it."""
    return {JOB_ID_LABEL: label_value(task.job_id), SHARD_LABEL: str(task.shard.shard_index)}


def engine_spread_over_gpus(task: ShardTask, hardware: dict[str, Any]) -> ShardTask:
    """A pod with several GPUs runs one engine over all of them (tensor parallelism), unless the request
    chose its own parallelism."""
    config = task.model_config
    gpus = hardware.get("gpus") or 0
    if gpus <= 1 or config.tensor_parallel_size or config.pipeline_parallel_size:
        return task
    return dataclasses.replace(task, model_config=config.model_copy(update={"tensor_parallel_size": gpus}))


def _worker_failure(pod_error: str) -> str | None:
    """The worker's own reason, from its last Pipes report among the pod's last log lines (which the
    client's error quotes)."""
    for line in reversed(pod_error.splitlines()):
        start = line.find('{"__dagster_pipes_version"')
        if start < 0:
            continue
        try:
            message = json.loads(line[start:])
        except ValueError:
            continue
        if message.get("method") == "report_custom_message" and (
            reason := worker_failure([(message.get("params") or {}).get("payload")])
        ):
            return reason
    return None
