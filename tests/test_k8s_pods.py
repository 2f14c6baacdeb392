"""The pod each shard runs in on Kubernetes, built from the request and validated strictly against the
Kubernetes API schema (kubernetes-validate); dagster-k8s's Pipes client builds the final pod body."""

import re
from pathlib import Path

import kubernetes_validate
import pytest
from dagster_k8s.pipes import build_pod_body
from kubernetes.client import ApiClient

from batch_pipeline.launch.k8s import InvalidHardware, K8sShardLauncher
from batch_pipeline.settings import variable_names
from batch_pipeline.shards import ShardSpec, ShardTask

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
    """The pod as the API server receives it, validated strictly against that version's schema."""
    meta, spec = launcher.pod_overrides(task, now=NOW, run_id=run_id)
    pod = build_pod_body(
        pod_name="batch-0123abcd-shard-002",
        image=launcher.image,
        command=["python", "-m", "batch_pipeline.worker"],
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


def test_a_pod_over_the_deployments_maxima_is_refused_even_when_its_size_was_inferred(monkeypatch):
    from batch_pipeline.launch.k8s import infer_hardware

    monkeypatch.setenv("BATCH_PIPELINE_MAX_GPUS", "4")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "512Gi")
    inferred, _ = infer_hardware({"gpu_type": "nvidia-ampere-a100e"}, 400 * 2**30, "nvidia-ampere-a100e", 1)
    with pytest.raises(InvalidHardware, match="^gpus: 16 is more than this deployment's maximum of 4"):
        LAUNCHER.pod_overrides(_task(inferred), now=NOW)
    with pytest.raises(InvalidHardware, match="^memory: 600Gi is more than this deployment's maximum of 512Gi"):
        LAUNCHER.pod_overrides(_task({"gpus": 1, "memory": "600Gi"}), now=NOW)


def test_a_gpu_type_the_deployment_does_not_map_is_refused():
    launcher = K8sShardLauncher(image="i", gpu_node_selectors={"nvidia-tesla-t4": {"gpu": "t4"}})
    with pytest.raises(InvalidHardware, match="^gpu_type: 'nvidia-hopper-h100'"):
        launcher.pod_overrides(_task({"gpu_type": "nvidia-hopper-h100"}), now=NOW)


def test_a_deployment_chooses_the_kubernetes_launcher_by_its_environment(monkeypatch):
    from batch_pipeline.launch import LocalShardLauncher
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    assert isinstance(shard_launcher_from_environment(), LocalShardLauncher)
    monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", "k8s")
    monkeypatch.setenv("BATCH_PIPELINE_WORKER_IMAGE", "registry.example/worker:2")
    monkeypatch.setenv("BATCH_PIPELINE_K8S_NAMESPACE", "batch")
    launcher = shard_launcher_from_environment()
    assert isinstance(launcher, K8sShardLauncher)
    assert (launcher.image, launcher.namespace) == ("registry.example/worker:2", "batch")


def test_every_kubernetes_object_in_k8s_is_valid_and_the_helm_values_name_our_settings():
    import yaml

    repo = Path(__file__).resolve().parents[1]
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
    }
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    values = yaml.safe_load((repo / "k8s" / "values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
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

    assert engine_spread_over_gpus(_task(), {"gpus": 4}).model_config == {"model": "m", "tensor_parallel_size": 4}
    assert engine_spread_over_gpus(_task(), {"gpus": 1}).model_config == {"model": "m"}
    chosen = ShardTask(**{**_task().__dict__, "model_config": {"model": "m", "pipeline_parallel_size": 2}})
    assert engine_spread_over_gpus(chosen, {"gpus": 4}).model_config == {"model": "m", "pipeline_parallel_size": 2}


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
    assert _mounts(pod) == {"/tmp": "emptyDir", "/home/worker": "emptyDir"}


def test_shard_pods_carry_the_label_the_network_policy_selects():
    import yaml

    repo = Path(__file__).resolve().parents[1]
    policy = yaml.safe_load((repo / "k8s" / "network-policy.yaml").read_text())
    # a request's own label of that name cannot take a pod out of the policy
    for task in (_task(labels={"component": "mine"}), _tool_task()):
        labels = _pod(LAUNCHER, task)["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


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
    import yaml

    policy = yaml.safe_load((Path(__file__).resolve().parents[1] / "k8s" / "network-policy.yaml").read_text())
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


REPO = Path(__file__).resolve().parents[1]
API_KEYS_SECRET = "batch-pipeline-api-keys"


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
    (api,) = [obj for obj in objects if obj["kind"] == "Deployment"]
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


def test_each_service_account_has_only_the_rights_its_pods_use():
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
    assert _run_pod(values)["serviceAccountName"] == run_account
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
    assert {"batch-pipeline-worker", "batch-pipeline-api"}.isdisjoint(rights)
    # the charts would otherwise make accounts of their own, with Roles granting pods and jobs to every pod
    for chart in (values, values["dagster-user-deployments"]):
        assert chart["serviceAccount"]["create"] is False and chart["rbacEnabled"] is False


def _run_pod(values: dict) -> dict:
    """The pod of a run's Job, built by dagster-k8s exactly as K8sRunLauncher does: its own config from the
    chart values, merged with the code location's container context (the chart's
    `dagsterUserDeployments.k8sContainerContext`, included in launched runs by default)."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, construct_dagster_k8s_job

    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    run_config_keys = {"containerConfig": "container_config", "podSpecConfig": "pod_spec_config"}
    dagster_account, code_location_account = _service_accounts(values)
    launcher_context = K8sContainerContext(
        service_account_name=dagster_account,  # the chart's instance config
        env_secrets=[secret["name"] for secret in launcher.get("envSecrets", [])],
        volumes=launcher.get("volumes", []),
        volume_mounts=launcher.get("volumeMounts", []),
        security_context=launcher.get("securityContext"),
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(
            {run_config_keys[key]: value for key, value in launcher.get("runK8sConfig", {}).items()}
        ),
    )
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    code_location_context = K8sContainerContext.create_from_config(
        {
            "k8s": {
                "image_pull_policy": deployment["image"]["pullPolicy"],
                "env_config_maps": [f"dagster-{deployment['name']}-user-env"],
                "env_secrets": [secret["name"] for secret in deployment.get("envSecrets", [])],
                "volume_mounts": deployment.get("volumeMounts", []),
                "volumes": deployment.get("volumes", []),
                "namespace": "batch",
                "service_account_name": code_location_account,
                "run_k8s_config": {"pod_spec_config": {"automount_service_account_token": True}},
            }
        }
    )
    context = launcher_context.merge(code_location_context)
    job_config = DagsterK8sJobConfig(
        job_image="registry.example/batch-pipeline:latest",
        dagster_home="/opt/dagster/dagster_home",
        instance_config_map="dagster-instance",
        postgres_password_secret="dagster-postgresql-secret",
    )
    job = construct_dagster_k8s_job(
        job_config,
        ["dagster", "api", "execute_run", "{}"],
        "dagster-run-0123",
        context.run_k8s_config,
        pod_name="dagster-run-0123",
        component="run_worker",
    )
    body = ApiClient().sanitize_for_serialization(job)
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
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
CHART_K8S_RUN_LAUNCHER_KEYS = {
    "image",
    "imagePullPolicy",
    "jobNamespace",
    "loadInclusterConfig",
    "kubeconfigFile",
    "envConfigMaps",
    "envSecrets",
    "envVars",
    "volumeMounts",
    "volumes",
    "labels",
    "failPodOnRunFailure",
    "resources",
    "schedulerName",
    "securityContext",
    "runK8sConfig",
}
CHART_RUN_K8S_CONFIG_KEYS = {
    "containerConfig",
    "podSpecConfig",
    "podTemplateSpecMetadata",
    "jobSpecConfig",
    "jobMetadata",
}
CHART_SERVICE_ACCOUNT_KEYS = {"create", "name", "annotations"}


def test_every_dagster_pod_of_ours_runs_locked_down_and_gets_no_api_keys():
    values = _values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert set(deployment) <= CHART_USER_DEPLOYMENT_KEYS and set(launcher) <= CHART_K8S_RUN_LAUNCHER_KEYS
    assert set(launcher["runK8sConfig"]) <= CHART_RUN_K8S_CONFIG_KEYS
    assert (
        set(values["serviceAccount"]) | set(values["dagster-user-deployments"]["serviceAccount"])
        <= CHART_SERVICE_ACCOUNT_KEYS
    )
    # each run's pod, as dagster-k8s builds it from these values
    run_pod = _run_pod(values)
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
    secrets = [
        secret["name"]
        for secret in deployment["envSecrets"] + values["runLauncher"]["config"]["k8sRunLauncher"]["envSecrets"]
    ]
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
