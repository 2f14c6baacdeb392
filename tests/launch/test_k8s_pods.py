"""The pod each shard runs in on Kubernetes, built from the request and validated strictly against the
Kubernetes API schema (kubernetes-validate); dagster-k8s's Pipes client builds the final pod body."""

import os
import re
import typing
from pathlib import Path

import kubernetes_validate
import pytest
from dagster_k8s.pipes import build_pod_body
from kubernetes.client import ApiClient

from batch_pipeline.core.settings import variable_names
from batch_pipeline.launch.k8s import InvalidHardware, K8sShardLauncher
from batch_pipeline.shards.format import ShardSpec
from batch_pipeline.shards.protocol import ShardTask

KUBERNETES_VERSION = "1.30"
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
NOW = 1_800_000_000.0


def _task(hardware=None, labels=None, deadline=NOW + 3600):
    shard = ShardSpec(shard_index=2, directory="s3://bucket/work/job/shards/002", item_count=10, prompt_count=10)
    return ShardTask(
        shard=shard,
        model_config={"model": "m"},
        shard_count=4,
        deadline=deadline,
        job_id="batch-0123abcd",
        hardware=hardware or {},
        labels=labels or {},
    )


def _pod(launcher, task, run_id=None) -> dict:
    """The pod as the API server receives it, validated strictly against that version's schema: what
    run_shard hands the Pipes client (the spec carries the image and the command)."""
    meta, spec = launcher.pod_overrides(task, now=NOW, run_id=run_id)
    pod = build_pod_body(
        pod_name="batch-0123abcd-shard-002",
        image=None,
        command=None,
        env_vars={"A": "b"},
        base_pod_meta=meta,
        base_pod_spec=spec,
    )
    # the typed endpoint (POST /api/v1/namespaces/NS/pods) implies these; the validator needs them said
    body = {"apiVersion": "v1", "kind": "Pod", **ApiClient().sanitize_for_serialization(pod)}
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    return body


LAUNCHER = K8sShardLauncher(
    image="registry.example/batch-pipeline-worker:1",
    max_hardware={},  # no bound, no teams: what each test adds
    tenants_file="",
    namespace="batch",
    service_account_name="batch-worker",
    env_secrets=["hf-token"],
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
)


@pytest.mark.parametrize(
    ("hardware", "resource", "count", "selector"),
    [
        ({"gpus": 2, "gpu_type": "nvidia-ampere-a100e"}, "nvidia.com/gpu", "2", "NVIDIA-A100-SXM4-80GB"),
        ({"gpus": 1, "gpu_type": "nvidia-tesla-t4"}, "nvidia.com/gpu", "1", "Tesla-T4"),
        ({"gpus": 1, "gpu_type": "nvidia-hopper-h100-1g20gb"}, "nvidia.com/mig-1g.20gb", "1", "NVIDIA-H100-80GB-HBM3"),
        ({"gpu_type": "nvidia-hopper-h100"}, "nvidia.com/gpu", "1", "NVIDIA-H100-80GB-HBM3"),  # gpus omitted: 1
        ({}, "nvidia.com/gpu", "1", None),
    ],
)
def test_gpus_and_gpu_type_become_limits_and_a_node_selector(hardware, resource, count, selector):
    pod = _pod(LAUNCHER, _task(hardware))
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"][resource] == count
    assert (pod["spec"].get("nodeSelector") or {}).get("nvidia.com/gpu.product") == selector


def test_cpus_memory_storage_deadline_account_tolerations_and_secrets_reach_the_pod():
    pod = _pod(LAUNCHER, _task({"gpus": 1, "cpus": 8, "memory": "40Gi", "storage": 100}))
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "40Gi", "ephemeral-storage": "100Gi"}
    assert container["resources"]["limits"]["memory"] == "40Gi"
    assert spec["activeDeadlineSeconds"] == 3600 and spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"] == "batch-worker"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container["envFrom"][0]["secretRef"]["name"] == "hf-token"
    assert container["image"] == "registry.example/batch-pipeline-worker:1"
    assert container["command"] == ["python", "-m", "batch_pipeline.worker"]


def test_labels_with_odd_characters_become_valid_pod_labels():
    labels = {"team": "search/ranking", "cost center": "ÉQUIPE #42", "x" * 80: "y" * 80, "empty": "---"}
    pod = _pod(LAUNCHER, _task(labels=labels), run_id="5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91")
    pod_labels = pod["metadata"]["labels"]
    assert pod_labels["batch-pipeline.io/team"] == "search-ranking"
    # what an earlier pod of the same shard is found by, and whose it was
    assert pod_labels["batch-pipeline.io/job-id"] == "batch-0123abcd"
    assert pod_labels["batch-pipeline.io/shard"] == "2"
    assert pod_labels["batch-pipeline.io/run-id"] == "5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91"
    for key, value in pod_labels.items():
        prefix, _, name = key.rpartition("/")
        assert LABEL_NAME.match(name) and len(name) <= 63, key
        assert LABEL_VALUE.match(value) and len(value) <= 63, value


@pytest.mark.parametrize(
    ("hardware", "field"),
    [({"memory": "lots"}, "memory:"), ({"cpus": -2}, "cpus:"), ({"storage": "0"}, "storage:"), ({"gpus": -1}, "gpus:")],
)
def test_hardware_no_pod_can_carry_is_refused_naming_the_field(hardware, field):
    with pytest.raises(InvalidHardware, match=f"^{field}"):
        LAUNCHER.pod_overrides(_task(hardware), now=NOW)


def test_a_pod_over_the_deployments_maxima_is_refused_even_when_its_size_was_inferred():
    from batch_pipeline.launch.k8s import infer_hardware

    bounded = K8sShardLauncher(image="i", max_hardware={"gpus": "4", "memory": "512Gi"}, tenants_file="")
    inferred, _ = infer_hardware({"gpu_type": "nvidia-ampere-a100e"}, 400 * 2**30, "nvidia-ampere-a100e", 1)
    with pytest.raises(InvalidHardware, match="^gpus: 16 is more than this deployment's maximum of 4"):
        bounded.pod_overrides(_task(inferred), now=NOW)
    with pytest.raises(InvalidHardware, match="^memory: 600Gi is more than this deployment's maximum of 512Gi"):
        bounded.pod_overrides(_task({"gpus": 1, "memory": "600Gi"}), now=NOW)
    LAUNCHER.pod_overrides(_task({"gpus": 1, "memory": "600Gi"}), now=NOW)  # a deployment with no maxima


def test_a_gpu_type_the_deployment_does_not_map_is_refused():
    launcher = K8sShardLauncher(
        image="i", gpu_node_selectors={"nvidia-tesla-t4": {"gpu": "t4"}}, max_hardware={}, tenants_file=""
    )
    with pytest.raises(InvalidHardware, match="^gpu_type: 'nvidia-hopper-h100'"):
        launcher.pod_overrides(_task({"gpu_type": "nvidia-hopper-h100"}), now=NOW)


def test_a_deployment_chooses_the_kubernetes_launcher_by_its_environment(monkeypatch):
    from batch_pipeline.launch.local import LocalShardLauncher
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    assert isinstance(shard_launcher_from_environment(), LocalShardLauncher)
    monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", "k8s")
    monkeypatch.setenv("BATCH_PIPELINE_WORKER_IMAGE", "registry.example/worker:2")
    monkeypatch.setenv("BATCH_PIPELINE_K8S_NAMESPACE", "batch")
    launcher = shard_launcher_from_environment()
    assert isinstance(launcher, K8sShardLauncher)
    assert (launcher.image, launcher.namespace) == ("registry.example/worker:2", "batch")


def test_each_launcher_says_its_kind_and_only_the_local_one_takes_a_worker_started_ahead(monkeypatch):
    """`batch-pipeline run` reads whether to start a standby worker from the kind the settings name, before
    it imports any launcher (which imports Dagster): the kind is the one the deployment's launcher says."""
    from batch_pipeline.core.settings import Settings, settings
    from batch_pipeline.launch.kinds import LAUNCHER_KINDS
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    assert set(LAUNCHER_KINDS) == set(typing.get_args(Settings.model_fields["shard_launcher"].annotation))
    monkeypatch.setenv("BATCH_PIPELINE_WORKER_IMAGE", "registry.example/worker:2")
    taken = {}
    for name in LAUNCHER_KINDS:
        monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", name)
        launcher = shard_launcher_from_environment()
        assert launcher.kind is LAUNCHER_KINDS[settings().shard_launcher]
        taken[name] = launcher.kind.takes_standby
    assert taken == {"local": True, "k8s": False}  # a pod's worker never runs on this machine


def test_every_shard_pod_of_the_largest_job_waits_at_once_while_local_workers_share_the_cores(monkeypatch):
    """Found in review (issue 30): the run worker held shard steps to its own core count whatever the
    launcher, so a run worker on 2 cores ran a data_parallelism 8 job's pods two at a time."""
    import dagster as dg

    from batch_pipeline.launch.local import LocalShardLauncher
    from batch_pipeline.pipeline.definitions import executor_config

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    pods = executor_config(K8sShardLauncher(image="registry.example/worker:2", max_hardware={}, tenants_file=""))
    assert pods["max_concurrent"] > 64 and "tag_concurrency_limits" not in pods  # data_parallelism <= 64
    # a deployment's own cap on shards caps the step processes the run worker forks
    unbounded = K8sShardLauncher(image="i", max_hardware={}, tenants_file="")
    assert executor_config(unbounded, max_shards_per_job=16)["max_concurrent"] == 17

    local = executor_config(LocalShardLauncher(concurrency=3))  # an operator's choice above the cores
    assert local["tag_concurrency_limits"] == [{"key": "batch_pipeline/step", "value": "shard", "limit": 3}]
    assert local["max_concurrent"] == 4
    assert executor_config(LocalShardLauncher())["tag_concurrency_limits"][0]["limit"] == 2

    # Each shard step of pods imports the Kubernetes client and dagster-k8s: the step server does so once.
    def preloaded(config):
        return config["start_method"]["forkserver"]["preload_modules"]

    assert {"kubernetes", "dagster_k8s"} <= set(preloaded(pods))
    assert not {"kubernetes", "dagster_k8s"} & set(preloaded(local))

    @dg.op
    def noop():
        pass

    @dg.job(executor_def=dg.multiprocess_executor)
    def probe():
        noop()

    for config in (pods, local):  # configs the executor takes
        dg.validate_run_config(probe, {"execution": {"config": config}})
    with pytest.raises(dg.DagsterInvalidConfigError):  # and this check would see one it does not
        dg.validate_run_config(probe, {"execution": {"config": {**pods, "max_concurrent": "all"}}})


def test_every_kubernetes_object_in_k8s_is_valid_and_the_helm_values_name_our_settings():
    import yaml

    repo = Path(__file__).resolve().parents[2]
    objects = [
        doc
        for path in sorted((repo / "k8s").glob("*.yaml"))
        if path.name != "values.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    assert {obj["kind"] for obj in objects} >= {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        "Namespace",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    values = yaml.safe_load((repo / "k8s" / "values.yaml").read_text())
    launcher = values["runLauncher"]["config"]["customRunLauncher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    assert env["BATCH_PIPELINE_SHARD_LAUNCHER"] == "k8s" and set(env) <= variable_names()
    role = next(
        obj for obj in objects if obj["kind"] == "Role" and obj["metadata"]["name"] == "batch-pipeline-shard-pods"
    )
    granted = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("pods", "create"), ("pods", "watch"), ("pods/log", "get"), ("pods", "delete")} <= granted


GIB = 2**30


@pytest.mark.parametrize(
    ("requested", "weights", "gpus", "says"),
    [
        ({"gpu_type": "nvidia-ampere-a100e"}, 16 * GIB, 1, "gpus 1 for 16.0 GiB of weights"),  # an 8B model in bf16
        ({"gpu_type": "nvidia-ampere-a100e"}, 140 * GIB, 4, "gpus 4 for 140.0 GiB"),  # 70B: 3 would do, 4 shards evenly
        ({"gpu_type": "nvidia-tesla-t4"}, 16 * GIB, 2, "gpus 2 for 16.0 GiB"),
        ({}, 16 * GIB, 1, "gpu_type nvidia-ampere-a100e (the deployment's default)"),
        ({"gpu_type": "nvidia-tesla-t4"}, None, 1, "gpus 1 (weights not listable, the deployment's default)"),
    ],
)
def test_missing_hardware_is_inferred_from_the_weights_and_said(requested, weights, gpus, says):
    from batch_pipeline.launch.k8s import infer_hardware

    hardware, inferred = infer_hardware(requested, weights, "nvidia-ampere-a100e", 1)
    assert hardware["gpus"] == gpus and says in inferred
    if weights:
        assert hardware["memory"] == f"{-(-weights * 3 // 2 // GIB) + 8}Gi"
    _pod(LAUNCHER, _task(hardware))  # whatever was inferred makes a valid pod


def test_hardware_the_request_names_is_kept_as_given():
    from batch_pipeline.launch.k8s import infer_hardware

    named = {"gpus": 3, "gpu_type": "nvidia-tesla-t4", "memory": "20Gi", "storage": 50, "cpus": 4}
    assert infer_hardware(named, 200 * GIB, "nvidia-ampere-a100e", 1) == (named, None)


def test_a_pod_with_several_gpus_runs_its_engine_over_all_of_them_unless_the_request_chose():
    from batch_pipeline.launch.k8s import engine_spread_over_gpus

    def parallelism(task: ShardTask) -> tuple[int | None, int | None]:
        return task.model_config.tensor_parallel_size, task.model_config.pipeline_parallel_size

    assert parallelism(engine_spread_over_gpus(_task(), {"gpus": 4})) == (4, None)
    assert parallelism(engine_spread_over_gpus(_task(), {"gpus": 1})) == (None, None)
    chosen = ShardTask(**{**_task().__dict__, "model_config": {"model": "m", "pipeline_parallel_size": 2}})
    assert parallelism(engine_spread_over_gpus(chosen, {"gpus": 4})) == (None, 2)


# What the sandbox needs to switch model-written code to its per-slot uids and clean up after it; nothing else.
SANDBOX_CAPABILITIES = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETUID", "SETGID"}


def _tool_task():
    return ShardTask(**{**_task().__dict__, "tool_config": {"name": "code_evaluator"}})


def _mounts(pod) -> dict[str, str]:
    """mount path -> the kind of volume behind it."""
    (container,) = pod["spec"]["containers"]
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
    return {
        mount["mountPath"]: next(k for k in volumes[mount["name"]] if k != "name")
        for mount in container.get("volumeMounts", [])
    }


def test_a_shard_pod_runs_non_root_with_no_capabilities_no_token_and_a_read_only_root():
    pod = _pod(LAUNCHER, _task({"gpus": 1}))
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in security or security["privileged"] is False
    # writable scratch only where the worker writes: temp files, and the caches under its home
    assert _mounts(pod) == {"/tmp": "emptyDir", "/home/worker": "emptyDir"}
    # a shard pod never talks to the Kubernetes API: no token in it
    assert spec["automountServiceAccountToken"] is False


def test_a_tool_shard_runs_as_root_with_only_the_capabilities_its_sandbox_needs():
    pod = _pod(LAUNCHER, _tool_task())
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    # the sandbox switches model-written code to per-slot uids: that takes uid 0 and these capabilities
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == SANDBOX_CAPABILITIES
    assert len(security["capabilities"]["add"]) == len(SANDBOX_CAPABILITIES)
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert spec["automountServiceAccountToken"] is False
    assert _mounts(pod) == {"/tmp": "emptyDir", "/home/worker": "emptyDir", "/var/lib/batch-pipeline/tmp": "emptyDir"}


# What the sandboxed code tries, as its slot's uid, in the pod's scratch: argv is the local stand-ins for
# /tmp, the worker's home, its TMPDIR, the uid-lease directory, a file the worker left in /tmp, and the
# execution's own working directory. Prints what each attempt did.
SANDBOXED_ATTEMPTS = """
import json, os, sys
tmp, home, worker_tmp, leases, workers_file, workdir = sys.argv[1:]
def attempt(action):
    try:
        action()
        return "done"
    except PermissionError:
        return "refused"
print(json.dumps({
    "rename the uid leases": attempt(lambda: os.rename(leases, leases + "-mine")),
    "plant a lease directory": attempt(lambda: os.mkdir(os.path.join(worker_tmp, "planted"))),
    "list the worker's temp dir": attempt(lambda: os.listdir(worker_tmp)),
    "write in the worker's home": attempt(lambda: open(os.path.join(home, "planted"), "w").close()),
    "move the worker's file in /tmp": attempt(lambda: os.rename(workers_file, workers_file + "-mine")),
    "write its own file in /tmp": attempt(lambda: open(os.path.join(tmp, "mine"), "w").close()),
    "write in its working directory": attempt(lambda: open(os.path.join(workdir, "mine"), "w").close()),
}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="plays the sandbox's uids against the pod's scratch")
def test_a_tool_shards_scratch_is_sticky_and_its_uid_leases_out_of_the_sandboxs_reach():
    """The tool pod's emptyDirs as the kubelet makes them (0777), its init container's own command run on
    them, the sandbox's uid leases made where the worker's TMPDIR puts them; then a sandboxed uid tries to
    take them over (as model-written code did: every later sandbox then failed)."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    from batch_pipeline.worker.sandbox import SANDBOX_UID_BASE, sandbox_python

    pod = _pod(LAUNCHER, _tool_task())
    (container,), (init,) = pod["spec"]["containers"], pod["spec"]["initContainers"]
    assert init["image"] == container["image"] and init["volumeMounts"] == container["volumeMounts"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # it owns the emptyDirs: chmod needs none
    worker_tmp = next(item["value"] for item in container["env"] if item["name"] == "TMPDIR")
    assert worker_tmp in _mounts(pod)
    root = Path(tempfile.mkdtemp(prefix="tool-pod-"))
    try:
        root.chmod(0o755)
        local = {path: root / path.strip("/").replace("/", "-") for path in _mounts(pod)}
        for directory in local.values():
            directory.mkdir()
            directory.chmod(0o777)
        command = [sys.executable if part == "python" else str(local.get(part, part)) for part in init["command"]]
        subprocess.run(command, check=True)
        assert {path: oct(directory.stat().st_mode & 0o7777) for path, directory in local.items()} == {
            "/tmp": "0o1777",
            "/home/worker": "0o700",
            worker_tmp: "0o711",
        }
        # the worker's sandbox, in the pod's environment: its leases and an execution's working directory
        made = subprocess.run(
            [
                sys.executable,
                "-c",
                "import os, tempfile; from batch_pipeline.worker.sandbox import UidLeases; "
                "print(UidLeases().directory); workdir = tempfile.mkdtemp(prefix='batch-pipeline-sandbox-'); "
                f"os.chown(workdir, {SANDBOX_UID_BASE}, {SANDBOX_UID_BASE}); print(workdir)",
            ],
            env={**os.environ, "TMPDIR": str(local[worker_tmp])},
            capture_output=True,
            text=True,
            check=True,
        )
        leases, workdir = made.stdout.split()
        assert Path(leases).parent == local[worker_tmp] and Path(workdir).parent == local[worker_tmp]
        workers_file = local["/tmp"] / "worker.lock"
        workers_file.touch()
        scratch = [local["/tmp"], local["/home/worker"], local[worker_tmp], leases, workers_file, workdir]
        tried = subprocess.run(
            [sandbox_python(), "-I", "-c", SANDBOXED_ATTEMPTS, *map(str, scratch)],
            user=SANDBOX_UID_BASE,
            group=SANDBOX_UID_BASE,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(tried.stdout) == {
            "rename the uid leases": "refused",
            "plant a lease directory": "refused",
            "list the worker's temp dir": "refused",
            "write in the worker's home": "refused",
            "move the worker's file in /tmp": "refused",
            "write its own file in /tmp": "done",
            "write in its working directory": "done",
        }
        assert Path(leases).is_dir()
    finally:
        shutil.rmtree(root)


def test_shard_pods_carry_the_label_the_network_policy_selects():

    policy = _network_policy("batch-pipeline-shard-workers")
    # a request's own label of that name cannot take a pod out of the policy
    for task in (_task(labels={"component": "mine"}), _tool_task()):
        labels = _pod(LAUNCHER, task)["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def _network_policy(name: str) -> dict:
    import yaml

    path = Path(__file__).resolve().parents[2] / "k8s" / "network-policy.yaml"
    (policy,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["metadata"]["name"] == name]
    return policy


def _egress_allowed(
    policy: dict,
    port: int,
    protocol: str = "TCP",
    ip: str | None = None,
    namespace: dict | None = None,
    pod: dict | None = None,
) -> bool:
    """Whether a NetworkPolicy lets its pods connect to an address (`ip`) or a pod (its namespace's and its
    own labels), as the API reference defines the rules; a pod is matched by selectors, not by ipBlock."""
    import ipaddress

    def selects(selector: dict | None, labels: dict | None) -> bool:
        return selector is None or (labels is not None and selector.get("matchLabels", {}).items() <= labels.items())

    def peer_matches(peer: dict) -> bool:
        if "ipBlock" in peer:
            if ip is None:
                return False
            address = ipaddress.ip_address(ip)
            block = peer["ipBlock"]
            inside = lambda cidr: (
                address.version == ipaddress.ip_network(cidr).version and address in ipaddress.ip_network(cidr)
            )  # noqa: E731
            return inside(block["cidr"]) and not any(inside(cidr) for cidr in block.get("except", []))
        return (
            pod is not None
            and selects(peer.get("namespaceSelector"), namespace)
            and selects(peer.get("podSelector"), pod)
        )

    for rule in policy["spec"]["egress"]:
        ports = rule.get("ports") or [{"protocol": protocol, "port": port}]
        if any(p.get("protocol", "TCP") == protocol and p.get("port") == port for p in ports):
            if not rule.get("to") or any(peer_matches(peer) for peer in rule["to"]):
                return True
    return False


def test_the_network_policy_lets_shard_workers_reach_dns_and_the_object_store_and_nothing_inside():
    policy = _network_policy("batch-pipeline-shard-workers")
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["ingress"] == []
    kube_system = {"kubernetes.io/metadata.name": "kube-system"}
    batch = {"kubernetes.io/metadata.name": "batch"}
    assert _egress_allowed(policy, 53, "UDP", namespace=kube_system, pod={"k8s-app": "kube-dns"})
    assert _egress_allowed(policy, 443, ip="52.216.8.1")  # S3
    assert _egress_allowed(policy, 443, ip="2600:1fa0::1")
    # the cloud metadata service (node credentials), over IPv4 and AWS's IPv6
    for port in (80, 443):
        assert not _egress_allowed(policy, port, ip="169.254.169.254")
        assert not _egress_allowed(policy, port, ip="fd00:ec2::254")
    # Postgres and the Dagster webserver, by pod and by their cluster addresses
    assert not _egress_allowed(policy, 5432, namespace=batch, pod={"app.kubernetes.io/name": "postgresql"})
    assert not _egress_allowed(policy, 80, namespace=batch, pod={"component": "dagster-webserver"})
    for address, port in (
        ("10.96.0.15", 5432),
        ("10.96.0.20", 80),
        ("10.96.0.20", 443),
        ("172.20.0.5", 443),
        ("192.168.1.10", 443),
        ("100.64.0.5", 443),
    ):
        assert not _egress_allowed(policy, port, ip=address), address
    assert not _egress_allowed(policy, 80, ip="52.216.8.1")  # plain HTTP to the outside neither


# The pods of the control plane, by the labels their makers give them: the Dagster chart's (helm/dagster
# templates: `component` on the webservers, the daemon and the code servers), dagster-k8s's on each run's
# pod, ours on the API's; and any other pod of the cluster.
CHART_POD_LABELS = {"app.kubernetes.io/name": "dagster", "app.kubernetes.io/instance": "dagster"}
CONTROL_PLANE_PODS = {
    "webserver": {**CHART_POD_LABELS, "component": "dagster-webserver"},
    "read-only webserver": {**CHART_POD_LABELS, "component": "dagster-webserver-read-only"},
    "daemon": {**CHART_POD_LABELS, "component": "dagster-daemon", "deployment": "daemon"},
    "code server": {
        "app.kubernetes.io/name": "dagster-user-deployments",
        "app.kubernetes.io/instance": "dagster",
        "component": "user-deployments",
        "deployment": "batch-pipeline",
    },
    "run": {
        "app.kubernetes.io/name": "dagster",
        "app.kubernetes.io/instance": "dagster",
        "app.kubernetes.io/part-of": "dagster",
        "app.kubernetes.io/component": "run_worker",
    },
    "API": {"app.kubernetes.io/name": "batch-pipeline-api"},
    "webhooks": {"app.kubernetes.io/name": "batch-pipeline-webhooks"},
    "Dagster UI gate": {"app.kubernetes.io/name": "batch-pipeline-dagster-ui"},
    "writable UI gate": {"app.kubernetes.io/name": "batch-pipeline-dagster-ui-write"},
    "postgres": {"app.kubernetes.io/name": "postgresql"},
    "other": {"app": "anything"},
}


def _ingress_allowed(policies: list[dict], to: dict, port: int, source: dict | None) -> bool:
    """Whether a pod labelled `to` admits a TCP connection on `port` from a pod labelled `source` in the
    same namespace (None: from outside the cluster), as the API reference defines it: a pod no Ingress
    policy selects admits everything; a selected one what any of their rules allows."""

    def selects(selector: dict, labels: dict | None) -> bool:
        return labels is not None and selector.get("matchLabels", {}).items() <= labels.items()

    selecting = [
        policy
        for policy in policies
        if "Ingress" in policy["spec"]["policyTypes"] and selects(policy["spec"]["podSelector"], to)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(
                set(peer) == {"podSelector"} and selects(peer["podSelector"], source) for peer in peers
            ):
                return True
    return False


def test_the_control_plane_admits_only_the_pods_that_need_it(tmp_path):
    import yaml

    policies = [doc for doc in yaml.safe_load_all((REPO / "k8s" / "network-policy.yaml").read_text()) if doc]
    pods = dict(CONTROL_PLANE_PODS)
    # the shard pod and the run pod with their real labels, as the launchers build them
    pods["shard"] = _pod(LAUNCHER, _task(labels={"component": "dagster-daemon"}))["metadata"]["labels"]
    run_labels = _run_pod_labels(_values(), tmp_path)
    assert CONTROL_PLANE_PODS["run"].items() <= run_labels.items()
    pods["run"] = run_labels

    def admitted(to: str, port: int) -> set:
        sources = {name for name, labels in pods.items() if _ingress_allowed(policies, pods[to], port, labels)}
        return sources | ({"outside"} if _ingress_allowed(policies, pods[to], port, None) else set())

    everyone = set(pods) | {"outside"}
    assert admitted("postgres", 5432) == {
        "webserver", "read-only webserver", "daemon", "code server", "run", "API", "webhooks"
    }  # fmt: skip
    assert admitted("webhooks", 80) == set()
    assert admitted("code server", 3030) == {"webserver", "read-only webserver", "daemon"}
    # the writable webserver: its gate alone, to which operators port-forward (never to the webserver)
    assert admitted("webserver", 80) == {"writable UI gate"}
    assert admitted("writable UI gate", 8080) == set()
    # every team's run configs and logs: the gate alone, which asks for an operator key first
    assert admitted("read-only webserver", 80) == {"Dagster UI gate"}
    assert admitted("Dagster UI gate", 8080) == everyone and admitted("Dagster UI gate", 80) == set()
    assert admitted("daemon", 80) == set()
    assert admitted("API", 8000) == everyone and admitted("API", 9000) == set()
    assert admitted("shard", 80) == set()
    # the read-only webserver is the chart's second webserver: the chart makes it only when asked
    assert _values()["dagsterWebserver"]["enableReadOnly"] is True


def _run_pod_labels(values: dict, tmp_path: Path) -> dict:
    """The labels of a run's pod as dagster-k8s's run launcher gives them."""
    from dagster_k8s.job import construct_dagster_k8s_job

    launcher = _run_launcher(values, tmp_path)
    context = launcher.get_container_context_for_run(_dagster_run(values))
    job = construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(job_image="i", run_launcher=launcher),
        args=[],
        job_name="dagster-run-0123abcd",
        pod_name="dagster-run-0123abcd",
        component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
    )
    return dict(job.spec.template.metadata.labels)


REPO = Path(__file__).resolve().parents[2]
API_KEYS_SECRET = "batch-pipeline-api-keys"
WEBHOOK_SECRETS = "batch-pipeline-webhook-secrets"
API, WEBHOOKS, GATE = "batch-pipeline-api", "batch-pipeline-webhooks", "batch-pipeline-dagster-ui"  # our Deployments


def _manifests() -> list[dict]:
    import yaml

    return [
        doc
        for path in sorted((REPO / "k8s").glob("*.yaml"))
        if path.name != "values.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _values() -> dict:
    import yaml

    return yaml.safe_load((REPO / "k8s" / "values.yaml").read_text())


def _service_accounts(values: dict) -> tuple[str, str]:
    """(the daemon's and webserver's, the code server's and its runs') accounts, as the chart's helpers
    `dagster.serviceAccountName` and `dagsterUserDeployments.serviceAccountName` choose them."""
    shared = values.get("global", {}).get("serviceAccountName")
    return (
        shared or values["serviceAccount"]["name"],
        shared or values["dagster-user-deployments"]["serviceAccount"]["name"],
    )


def _assert_locked_down(pod_spec: dict, container: dict) -> None:
    """Non-root, every capability dropped, no escalation, the runtime's seccomp profile, a read-only root
    with writable scratch for temp files and the home's caches."""
    pod_security, security = pod_spec["securityContext"], container["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] > 0
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert security["allowPrivilegeEscalation"] is False and security.get("privileged") is not True
    assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"] is True
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    assert len(volumes) == len(pod_spec["volumes"]), "a volume named twice"
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"] and "emptyDir" in mounts["/home/worker"]


def test_the_api_pod_runs_locked_down_with_a_service_account_of_its_own_with_no_rights_and_no_token():
    objects = _manifests()
    (api,) = [obj for obj in objects if obj["kind"] == "Deployment" and obj["metadata"]["name"] == API]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _assert_locked_down(pod, container)
    assert pod["automountServiceAccountToken"] is False
    account = pod["serviceAccountName"]
    (service_account,) = [
        obj for obj in objects if obj["kind"] == "ServiceAccount" and obj["metadata"]["name"] == account
    ]
    assert service_account["automountServiceAccountToken"] is False
    bound = {subject["name"] for obj in objects if obj["kind"] == "RoleBinding" for subject in obj["subjects"]}
    assert account not in bound
    # the API's keys reach the API alone
    assert {"secretRef": {"name": API_KEYS_SECRET}} in container["envFrom"]


@pytest.mark.parametrize(
    ("gate", "upstream", "component"),
    [
        (GATE, "http://dagster-webserver-read-only:80", "dagster-webserver-read-only"),
        (GATE + "-write", "http://dagster-webserver:80", "dagster-webserver"),
    ],
)
def test_the_dagster_ui_gate_runs_locked_down_with_the_tenants_file_only_and_reaches_the_webserver_only(
    gate, upstream, component
):
    """The cluster's Dagster UI is the read-only webserver behind the gate `serve` runs locally: the same
    module as a proxy, reading the tenants file's admin keys, with no token, no API keys, no webhook secrets,
    and out only to DNS and the read-only webserver."""
    objects = _manifests()
    deployments = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}
    pod = deployments[gate]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _assert_locked_down(pod, container)
    assert pod["automountServiceAccountToken"] is False
    (account,) = [
        obj
        for obj in objects
        if obj["kind"] == "ServiceAccount" and obj["metadata"]["name"] == pod["serviceAccountName"]
    ]
    assert account["automountServiceAccountToken"] is False
    bound = {subject["name"] for obj in objects if obj["kind"] == "RoleBinding" for subject in obj["subjects"]}
    assert account["metadata"]["name"] not in bound
    command = container["command"]
    assert command[:3] == ["python", "-m", "batch_pipeline.entrypoints.dagster_ui"]
    assert command[command.index("--upstream") + 1] == upstream
    assert "envFrom" not in container  # no Secret at all: the tenants file holds digests only
    assert _tenants_file(container["env"], pod["volumes"], container["volumeMounts"]) == "batch-pipeline-tenants"

    policy = _network_policy(gate)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    batch = {"kubernetes.io/metadata.name": "batch"}
    assert _egress_allowed(
        policy, 53, "UDP", namespace={"kubernetes.io/metadata.name": "kube-system"}, pod={"k8s-app": "kube-dns"}
    )
    assert _egress_allowed(policy, 80, namespace=batch, pod={"component": component})
    others = {"dagster-webserver", "dagster-webserver-read-only", "user-deployments", "dagster-daemon"} - {component}
    for other in others:
        assert not _egress_allowed(policy, 80, namespace=batch, pod={"component": other})
    assert not _egress_allowed(policy, 5432, namespace=batch, pod={"app.kubernetes.io/name": "postgresql"})
    for address in ("52.216.8.1", "169.254.169.254", "10.20.30.40"):
        assert not _egress_allowed(policy, 443, ip=address) and not _egress_allowed(policy, 80, ip=address)


def test_the_webhook_pod_runs_serves_process_locked_down_with_only_its_own_secrets_and_reaches_out_only():
    """What `serve` runs beside the API on one machine runs in a cluster as its own Deployment: no token, no
    Kubernetes rights, the webhook secrets (which no other pod gets) and not the API's keys, nothing
    reaching it, and out only DNS, Postgres and HTTP(S) to receivers, never the cloud metadata address."""
    from batch_pipeline.entrypoints.serve import webhooks_command

    objects = _manifests()
    deployments = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}
    pod = deployments[WEBHOOKS]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _assert_locked_down(pod, container)
    assert pod["automountServiceAccountToken"] is False and "ports" not in container
    (account,) = [
        obj
        for obj in objects
        if obj["kind"] == "ServiceAccount" and obj["metadata"]["name"] == pod["serviceAccountName"]
    ]
    assert account["automountServiceAccountToken"] is False
    assert container["command"][0] == "python" and container["command"][1:] == webhooks_command()[1:]
    assert {"secretRef": {"name": WEBHOOK_SECRETS}} in container["envFrom"]
    assert API_KEYS_SECRET not in str(container["envFrom"])
    (api_container,) = deployments[API]["spec"]["template"]["spec"]["containers"]
    assert WEBHOOK_SECRETS not in str(api_container["envFrom"])
    assert _tenants_file(container["env"], pod["volumes"], container["volumeMounts"]) == "batch-pipeline-tenants"

    policy = _network_policy(WEBHOOKS)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    assert policy["spec"]["ingress"] == []
    batch = {"kubernetes.io/metadata.name": "batch"}
    assert _egress_allowed(
        policy, 53, "UDP", namespace={"kubernetes.io/metadata.name": "kube-system"}, pod={"k8s-app": "kube-dns"}
    )
    assert _egress_allowed(policy, 5432, namespace=batch, pod={"app.kubernetes.io/name": "postgresql"})
    for address in ("52.216.8.1", "10.20.30.40", "2600:1fa0::1"):  # a receiver outside, or in the company's network
        assert _egress_allowed(policy, 443, ip=address) and _egress_allowed(policy, 80, ip=address)
    for address in ("169.254.169.254", "fd00:ec2::254", "127.0.0.1"):
        assert not _egress_allowed(policy, 80, ip=address) and not _egress_allowed(policy, 443, ip=address)
    assert not _egress_allowed(policy, 3030, namespace=batch, pod={"component": "user-deployments"})


def test_each_service_account_has_only_the_rights_its_pods_use(tmp_path):
    objects = _manifests()
    roles = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Role"}
    rights: dict[str, set] = {}
    for binding in (obj for obj in objects if obj["kind"] == "RoleBinding"):
        rules = roles[binding["roleRef"]["name"]]["rules"]
        for subject in binding["subjects"]:
            rights.setdefault(subject["name"], set()).update(
                (resource, verb) for rule in rules for resource in rule["resources"] for verb in rule["verbs"]
            )
    values = _values()
    dagster_account, run_account = _service_accounts(values)
    assert _run_pod(values, tmp_path)["serviceAccountName"] == run_account
    # a run's pod starts, follows and removes its shard pods (Dagster Pipes reads their logs), nothing else
    assert rights[run_account] == {("pods", verb) for verb in ("create", "get", "list", "watch", "delete")} | {
        ("pods/log", "get")
    }
    # the daemon launches each run as a Job, and watches and stops it
    assert {("jobs", "create"), ("jobs", "delete"), ("pods", "list")} <= rights[dagster_account]
    assert not any(verb == "create" and resource == "pods" for resource, verb in rights[dagster_account])
    # nobody reads secrets or holds wildcards; the shard workers and the API hold nothing
    for granted in rights.values():
        assert not any(resource in {"secrets", "*"} or verb == "*" for resource, verb in granted)
    assert {"batch-pipeline-worker", "batch-pipeline-api", "batch-pipeline-webhooks"}.isdisjoint(rights)
    # the charts would otherwise make accounts of their own, with Roles granting pods and jobs to every pod
    for chart in (values, values["dagster-user-deployments"]):
        assert chart["serviceAccount"]["create"] is False and chart["rbacEnabled"] is False


def _run_launcher(values: dict, tmp_path: Path):
    """dagster-k8s's K8sRunLauncher as the instance the chart renders makes it: the custom run launcher's
    config, checked against the launcher's own config schema. Only where it finds the cluster differs: a
    kubeconfig naming no reachable server (nothing here calls one)."""
    from dagster._config import process_config
    from dagster._core.definitions.definition_config_schema import convert_user_facing_definition_config_schema
    from dagster_k8s import K8sRunLauncher

    custom = values["runLauncher"]["config"]["customRunLauncher"]
    assert values["runLauncher"]["type"] == "CustomRunLauncher"
    assert (custom["module"], custom["class"]) == ("dagster_k8s", "K8sRunLauncher")
    schema = convert_user_facing_definition_config_schema(K8sRunLauncher.config_type()).config_type
    checked = process_config(schema, custom["config"])
    assert checked.success, checked.errors
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    config = {**checked.value, "load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}
    return K8sRunLauncher(**config)


def _dagster_run(values: dict, tags: dict | None = None, container_context: dict | None = None):
    """A run of the code location, as the daemon hands it to the run launcher: its code server's image, and
    the code location's container context only where the chart includes it in launched runs."""
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster._core.storage.dagster_run import DagsterRun

    (deployment,) = values["dagster-user-deployments"]["deployments"]
    image = f"{deployment['image']['repository']}:{deployment['image']['tag']}"
    if container_context is None and deployment.get("includeConfigInLaunchedRuns", {}).get("enabled", True):
        container_context = _code_location_container_context(values)
    origin = JobPythonOrigin(
        "batch_completions",
        RepositoryPythonOrigin(
            executable_path="python",
            code_pointer=ModuleCodePointer("batch_pipeline.pipeline.definitions", "defs", working_directory=None),
            container_image=image,
            container_context=container_context,
        ),
    )
    return DagsterRun(job_name="batch_completions", run_id="0123abcd", tags=tags or {}, job_code_origin=origin)


def _code_location_container_context(values: dict) -> dict:
    """What the chart's `dagsterUserDeployments.k8sContainerContext` gives the code server to pass on to
    its runs (with includeConfigInLaunchedRuns, the chart's default)."""
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    return {
        "k8s": {
            "image_pull_policy": deployment["image"]["pullPolicy"],
            "env_config_maps": [f"dagster-{deployment['name']}-user-env"],
            "env_secrets": [secret["name"] for secret in deployment.get("envSecrets", [])],
            "volume_mounts": deployment.get("volumeMounts", []),
            "volumes": deployment.get("volumes", []),
            "namespace": "batch",
            "service_account_name": values["dagster-user-deployments"]["serviceAccount"]["name"],
            "env": deployment.get("env", []),
        }
    }


def _run_pod(values: dict, tmp_path: Path, tags: dict | None = None) -> dict:
    """The pod of a run's Job, as the run launcher builds it (K8sRunLauncher._launch_k8s_job_with_args, up
    to the API call): the launcher's container context for the run, where dagster-k8s applies its
    allowlists, then the Job."""
    from dagster_k8s.job import construct_dagster_k8s_job

    launcher = _run_launcher(values, tmp_path)
    run = _dagster_run(values, tags)
    context = launcher.get_container_context_for_run(run)
    job_config = context.get_k8s_job_config(
        job_image=run.job_code_origin.repository_origin.container_image, run_launcher=launcher
    )
    job = construct_dagster_k8s_job(
        job_config=job_config,
        args=["dagster", "api", "execute_run", "{}"],
        job_name="dagster-run-0123abcd",
        pod_name="dagster-run-0123abcd",
        component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/job": "batch_completions", "dagster/run-id": run.run_id},
    )
    body = ApiClient().sanitize_for_serialization(job)
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    assert context.namespace == "batch"
    return body["spec"]["template"]["spec"]


# The properties the Dagster chart's values schema declares (helm/dagster/values.schema.json and the
# dagster-user-deployments subchart's, as of chart 1.13): for a user deployment a misspelt key would be
# silently ignored, and the chart refuses unknown ones in the run launcher's config.
CHART_USER_DEPLOYMENT_KEYS = {
    "name",
    "image",
    "dagsterApiGrpcArgs",
    "codeServerArgs",
    "includeConfigInLaunchedRuns",
    "deploymentNamespace",
    "port",
    "env",
    "envConfigMaps",
    "envSecrets",
    "annotations",
    "nodeSelector",
    "affinity",
    "tolerations",
    "podSecurityContext",
    "securityContext",
    "resources",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "labels",
    "volumeMounts",
    "volumes",
    "schedulerName",
    "initContainers",
    "sidecarContainers",
}
# The webserver's keys the chart reads (helm/dagster/templates/helpers/_deployment-webserver.tpl, _helpers.tpl).
CHART_WEBSERVER_KEYS = {
    "replicaCount",
    "image",
    "nameOverride",
    "pathPrefix",
    "service",
    "workspace",
    "env",
    "envConfigMaps",
    "envSecrets",
    "deploymentLabels",
    "labels",
    "annotations",
    "nodeSelector",
    "affinity",
    "tolerations",
    "podSecurityContext",
    "securityContext",
    "resources",
    "readinessProbe",
    "livenessProbe",
    "startupProbe",
    "enableReadOnly",
    "dbStatementTimeout",
    "dbPoolRecycle",
    "logLevel",
    "schedulerName",
    "volumeMounts",
    "volumes",
    "initContainerResources",
    "extraContainers",
    "extraPrependedInitContainers",
    "checkDbReadyInitContainer",
}
CHART_SERVICE_ACCOUNT_KEYS = {"create", "name", "annotations"}


def test_every_dagster_pod_of_ours_runs_locked_down_and_gets_no_api_keys(tmp_path):
    values = _values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert set(deployment) <= CHART_USER_DEPLOYMENT_KEYS
    assert set(values["dagsterWebserver"]) <= CHART_WEBSERVER_KEYS
    assert (
        set(values["serviceAccount"]) | set(values["dagster-user-deployments"]["serviceAccount"])
        <= CHART_SERVICE_ACCOUNT_KEYS
    )
    # each run's pod, as dagster-k8s builds it from these values
    run_pod = _run_pod(values, tmp_path)
    (run_container,) = run_pod["containers"]
    _assert_locked_down(run_pod, run_container)
    # the code server: the chart puts these keys in its Deployment's pod and container as they are
    code_server = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "code-server"},
        "spec": {
            "selector": {"matchLabels": {"app": "code-server"}},
            "template": {
                "metadata": {"labels": {"app": "code-server"}},
                "spec": {
                    "securityContext": deployment["podSecurityContext"],
                    "volumes": deployment["volumes"],
                    "containers": [
                        {
                            "name": "code-server",
                            "image": "i",
                            "securityContext": deployment["securityContext"],
                            "volumeMounts": deployment["volumeMounts"],
                        }
                    ],
                },
            },
        },
    }
    kubernetes_validate.validate(code_server, KUBERNETES_VERSION, strict=True)
    pod = code_server["spec"]["template"]["spec"]
    _assert_locked_down(pod, pod["containers"][0])
    run_launcher = values["runLauncher"]["config"]["customRunLauncher"]["config"]
    secrets = [secret["name"] for secret in deployment["envSecrets"]] + run_launcher["env_secrets"]
    assert API_KEYS_SECRET not in secrets
    assert not any(API_KEYS_SECRET in str(source) for source in run_container.get("envFrom", []))
    # Dagster's telemetry would write under DAGSTER_HOME, on the read-only root
    assert values["telemetry"]["enabled"] is False


def test_the_worker_image_runs_as_the_non_root_user_the_pods_name():
    from batch_pipeline.launch.k8s import WORKER_HOME, WORKER_UID

    lines = [
        line.split(None, 1)
        for line in (REPO / "k8s" / "worker.Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    instructions = [(word.upper(), rest.strip()) for word, rest in lines]
    users = [i for i, (word, _) in enumerate(instructions) if word == "USER"]
    assert users, "no USER: the image runs as root"
    assert instructions[users[-1]][1] == f"{WORKER_UID}:{WORKER_UID}"
    assert all(word != "RUN" for word, _ in instructions[users[-1] :])
    assert ("ENV", f"HOME={WORKER_HOME}") in instructions


def test_the_api_pod_runs_uvicorn_as_serve_does_with_the_head_timeout():
    """uvicorn alone never times out a request's head (a slowloris holds its connection for ever): the API
    pod runs the same command line as `make serve`, with the protocol that does."""
    from batch_pipeline.entrypoints.serve import api_command

    (api,) = [obj for obj in _manifests() if obj["kind"] == "Deployment" and obj["metadata"]["name"] == API]
    (container,) = api["spec"]["template"]["spec"]["containers"]
    assert container["command"][0] == "uvicorn"
    assert container["command"][1:] == api_command("0.0.0.0", 8000)[1:]


def _tenants_file(env: list[dict], volumes: list[dict], mounts: list[dict]) -> str | None:
    """The ConfigMap whose file BATCH_PIPELINE_TENANTS names in a container, or None."""
    (path,) = [item["value"] for item in env if item["name"] == "BATCH_PIPELINE_TENANTS"] or [None]
    if path is None:
        return None
    (mount,) = [m for m in mounts if path.startswith(m.get("mountPath", m.get("mount_path", "")).rstrip("/") + "/")]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    config_map = volume.get("configMap") or volume.get("config_map")
    return config_map["name"]


def test_the_api_the_code_location_and_every_run_read_the_same_tenants_file(tmp_path):
    """A job is held to its team's roots when it is submitted (the API) and again when its run starts and
    opens its files (the code location's runs): all three read one tenants file."""
    (api,) = [obj for obj in _manifests() if obj["kind"] == "Deployment" and obj["metadata"]["name"] == API]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    values = _values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    run_pod = _run_pod(values, tmp_path)
    (run_container,) = run_pod["containers"]
    found = {
        "api": _tenants_file(container["env"], pod["volumes"], container["volumeMounts"]),
        "code location": _tenants_file(deployment["env"], deployment["volumes"], deployment["volumeMounts"]),
        "run": _tenants_file(run_container["env"], run_pod["volumes"], run_container["volumeMounts"]),
    }
    assert set(found.values()) == {"batch-pipeline-tenants"}, found


@pytest.mark.parametrize("tool", [False, True], ids=["plain", "tool_config"])
def test_a_request_naming_no_cpus_or_memory_gets_the_deployments_limits(tool):
    """A pod without limits may take its node's cores and memory from the other teams' shards beside it:
    every container (the tool_config pod's init container too) carries the deployment's default, at most its
    maximum."""
    task = _tool_task() if tool else _task()
    assert "cpus" not in task.hardware and "memory" not in task.hardware
    launcher = LAUNCHER.model_copy(update={"default_cpus": "6", "default_memory": "48Gi"})
    pod = _pod(launcher, task)
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    assert len(containers) == (2 if tool else 1)
    for container in containers:
        assert {name: container["resources"]["limits"][name] for name in ("cpu", "memory")} == {
            "cpu": "6",
            "memory": "48Gi",
        }
    bounded = launcher.model_copy(update={"max_hardware": {"cpus": "4", "memory": "32Gi"}})
    limits = _pod(bounded, task)["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == ("4", "32Gi")
    # what the request names wins
    named = _pod(launcher, _task({"cpus": 2, "memory": "3Gi"}))["spec"]["containers"][0]["resources"]["limits"]
    assert (named["cpu"], named["memory"]) == ("2", "3Gi")
