"""Kueue, in a cluster: the example Kueue objects (k8s/kueue/kueue.yaml) validated offline against Kueue's
published CRD schemas (tests/fixtures/kueue_crds/, v0.19.2) and the rules its webhooks add; and the shard
pods of a team the tenants file gives a `kueue_queue`, as Kueue's pod integration expects them.

What Kueue wants of a plain pod (site/content/en/docs/tasks/run/plain_pods.md and
pkg/controller/jobs/pod/pod_webhook.go at v0.19.2): the label `kueue.x-k8s.io/queue-name` naming a
LocalQueue of its namespace, and nothing else of Kueue's. Its webhook adds the `kueue.x-k8s.io/managed`
label, a finalizer and the `kueue.x-k8s.io/admission` scheduling gate, which it removes on admission."""

import copy
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import dagster as dg
import jsonschema
import kubernetes_validate
import pytest
import yaml
from dagster_k8s.pipes import build_pod_body
from kubernetes.client import ApiClient
from kubernetes.utils.quantity import parse_quantity

from batch_pipeline.launch.k8s import DEFAULT_GPU_NODE_SELECTORS, KUEUE_QUEUE_LABEL, MIG_RESOURCES, K8sShardLauncher
from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError, owner_team
from tests.conftest import MODEL
from tests.launch.test_k8s_pods import KUBERNETES_VERSION, LAUNCHER, NOW, _task

REPO = Path(__file__).resolve().parents[2]
KUEUE_MANIFESTS = REPO / "k8s" / "kueue" / "kueue.yaml"
CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "kueue_crds"
KUEUE_PREFIX = "kueue.x-k8s.io/"
# What Kueue's pod webhook adds to a pod it manages (pkg/controller/jobs/pod/constants/constants.go).
ADMISSION_GATE = "kueue.x-k8s.io/admission"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
POD_GROUP_KEYS = ("kueue.x-k8s.io/pod-group-name", "kueue.x-k8s.io/pod-group-total-count")
# A DNS-1123 subdomain: what Kueue's webhook requires of the queue-name label (ValidateQueueName).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
TENANTS = """\
tenants:
  team-a: {weight: 2, kueue_queue: team-a}
  team-b: {kueue_queue: team-b}
  team-c: {}
"""


# ---- validating Kueue objects as the API server and Kueue's webhooks would ---------------------------


def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> (the version's openAPIV3Schema, the CRD's scope), from the vendored CRDs."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]
        for version in spec["versions"]:
            key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
            found[key] = {"schema": version["schema"]["openAPIV3Schema"], "scope": spec["scope"]}
    return found


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused. A CRD's structural schema does not say
    `additionalProperties: false`, yet the API server prunes every field it does not list (and `kubectl
    apply`'s server-side field validation, Strict, refuses them): so every object schema that lists its
    `properties`, says nothing of `additionalProperties` and is not `x-kubernetes-preserve-unknown-fields`
    gets `additionalProperties: false`. Maps (`additionalProperties: {...}`) and free objects
    (`metadata: {type: object}`) stay as they are."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties", "definitions"):
            for child in (node.get(key) or {}).values():
                walk(child)
        for key in ("items", "additionalProperties", "not"):
            walk(node.get(key))
        for key in ("anyOf", "allOf", "oneOf"):
            walk(node.get(key))

    walk(schema)
    return schema


def _webhook_problems(obj: dict[str, Any]) -> list[str]:
    """What Kueue's validating webhooks and the CRDs' CEL rules (x-kubernetes-validations, which JSON
    Schema cannot run) refuse, for the fields k8s/kueue/kueue.yaml uses: pkg/webhooks/clusterqueue_webhook.go
    and common.go at v0.19.2. Quantities are never negative (nominalQuota, borrowingLimit, lendingLimit, a
    fairSharing weight; a non-zero weight is above 1e-9); lendingLimit is at most nominalQuota; borrowing
    and lending limits need a cohort; each flavor lists the group's coveredResources, in order; no
    resource and no flavor is in two groups."""
    problems: list[str] = []
    spec = obj.get("spec") or {}
    weight = (spec.get("fairSharing") or {}).get("weight")
    if weight is not None:
        value = parse_quantity(weight)
        if value < 0:
            problems.append(f"spec.fairSharing.weight: {weight} must be non-negative")
        elif 0 < value <= parse_quantity("1n"):
            problems.append(f"spec.fairSharing.weight: {weight}: when not 0, weight must be > 10e-9")
    if obj.get("kind") != "ClusterQueue":
        return problems
    seen_resources: set[str] = set()
    seen_flavors: set[str] = set()
    for i, group in enumerate(spec.get("resourceGroups") or []):
        covered = group.get("coveredResources") or []
        for name in covered:
            if name in seen_resources:
                problems.append(f"spec.resourceGroups[{i}]: resource {name} is in two groups")
            seen_resources.add(name)
        for j, flavor in enumerate(group.get("flavors") or []):
            where = f"spec.resourceGroups[{i}].flavors[{j}]"
            if flavor.get("name") in seen_flavors:
                problems.append(f"{where}: flavor {flavor.get('name')} is in two groups")
            seen_flavors.add(flavor.get("name"))
            quotas = flavor.get("resources") or []
            if [quota.get("name") for quota in quotas] != list(covered):
                problems.append(f"{where}.resources: must list the group's coveredResources {covered}, in order")
            for k, quota in enumerate(quotas):
                for field in ("nominalQuota", "borrowingLimit", "lendingLimit"):
                    if field in quota and parse_quantity(quota[field]) < 0:
                        problems.append(f"{where}.resources[{k}].{field}: {quota[field]} must be non-negative")
                    if field != "nominalQuota" and field in quota and not spec.get("cohortName"):
                        problems.append(f"{where}.resources[{k}].{field}: must be nil when cohort is empty")
                lending = quota.get("lendingLimit")
                if lending is not None and parse_quantity(lending) > parse_quantity(quota["nominalQuota"]):
                    problems.append(f"{where}.resources[{k}].lendingLimit: must be at most nominalQuota")
    return problems


def kueue_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server (with Kueue's CRDs and webhooks installed) would refuse `obj`; [] when it would
    take it. The schema is the openAPIV3Schema of the CRD version `obj`'s apiVersion names."""
    crd = _crds().get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is None:
        return [f"no Kueue CRD serves {obj.get('apiVersion')} {obj.get('kind')}"]
    validator = jsonschema.Draft4Validator(strict(crd["schema"]))  # OpenAPI v3.0 schemas are draft 4's
    problems = [
        f"{'.'.join(str(part) for part in error.absolute_path) or '(root)'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda error: list(map(str, error.absolute_path)))
    ]
    metadata = obj.get("metadata") or {}
    unknown = set(metadata) - {"name", "namespace", "labels", "annotations"}
    if unknown:
        problems.append(f"metadata: unexpected {sorted(unknown)}")
    if not isinstance(metadata.get("name"), str) or not jsonschema.Draft4Validator(
        {"pattern": DNS_SUBDOMAIN, "maxLength": 253}
    ).is_valid(metadata["name"]):
        problems.append(f"metadata.name: {metadata.get('name')!r} is not a DNS-1123 subdomain")
    if (crd["scope"] == "Namespaced") != ("namespace" in metadata):
        problems.append(
            f"metadata.namespace: a {crd['scope']} object {'has' if 'namespace' in metadata else 'lacks'} one"
        )
    # The API server checks the schema before it calls validating webhooks: they see valid objects only.
    return problems or _webhook_problems(obj)


def _kueue_objects() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(KUEUE_MANIFESTS.read_text()) if doc]


def _of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in _kueue_objects() if obj["kind"] == kind}


def _namespace() -> str:
    (namespace,) = [doc for doc in yaml.safe_load_all((REPO / "k8s" / "namespace.yaml").read_text()) if doc]
    return namespace["metadata"]["name"]


def test_every_kueue_object_in_k8s_is_valid_against_kueues_crds_and_webhooks():
    objects = _kueue_objects()
    assert {obj["kind"] for obj in objects} == {"ResourceFlavor", "ClusterQueue", "LocalQueue"}
    for obj in objects:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2"  # the served, stored version of v0.19
        assert kueue_problems(obj) == [], (obj["kind"], obj["metadata"]["name"])


def test_a_resource_flavor_per_gpu_type_labelled_as_the_launcher_selects_its_nodes():
    flavors = _of_kind("ResourceFlavor")
    gpu_flavors = {name: flavor for name, flavor in flavors.items() if (flavor.get("spec") or {}).get("nodeLabels")}
    assert set(gpu_flavors) == set(DEFAULT_GPU_NODE_SELECTORS)
    for gpu_type, selector in DEFAULT_GPU_NODE_SELECTORS.items():
        assert gpu_flavors[gpu_type]["spec"]["nodeLabels"] == selector, gpu_type
    assert set(flavors) - set(gpu_flavors) == {"default-flavor"}  # cpu, memory, storage: any node


def test_a_cluster_queue_per_team_in_one_cohort_with_weights_and_borrowing_limits_and_a_local_queue_each():
    cluster_queues, local_queues, flavors = _of_kind("ClusterQueue"), _of_kind("LocalQueue"), _of_kind("ResourceFlavor")
    assert len(cluster_queues) == 2
    assert len({queue["spec"]["cohortName"] for queue in cluster_queues.values()}) == 1
    weights = {name: parse_quantity(queue["spec"]["fairSharing"]["weight"]) for name, queue in cluster_queues.items()}
    assert weights == {"batch-team-a": 2, "batch-team-b": 1}  # the tenants' weights (docs/operations/tenants.md)
    for name, queue in cluster_queues.items():
        assert queue["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": _namespace()}}
        for group in queue["spec"]["resourceGroups"]:
            for flavor in group["flavors"]:
                assert flavor["name"] in flavors, (name, flavor["name"])
                assert all("borrowingLimit" in quota for quota in flavor["resources"]), (name, flavor["name"])
    assert {queue["metadata"]["namespace"] for queue in local_queues.values()} == {_namespace()}
    assert {name: queue["spec"]["clusterQueue"] for name, queue in local_queues.items()} == {
        "team-a": "batch-team-a",
        "team-b": "batch-team-b",
    }


# Where batch-team-a lists its quota of A100 80GB GPUs, and of memory.
A100E_QUOTA = ["spec", "resourceGroups", 1, "flavors", 0, "resources", 0]
MEMORY_QUOTA = ["spec", "resourceGroups", 0, "flavors", 0, "resources", 1]
BROKEN = {
    "an unknown field of a quota": ("batch-team-a", A100E_QUOTA, "quota", 4),
    "v1beta1's cohort, gone from v1beta2": ("batch-team-a", ["spec"], "cohort", "batch-gpus"),
    "an unknown field of the spec": ("team-a", ["spec"], "queue", "team-a"),
    "an unknown field of a flavor": ("nvidia-tesla-t4", ["spec"], "nodeSelector", {"a": "b"}),
    "a negative weight": ("batch-team-a", ["spec", "fairSharing"], "weight", -1),
    "a negative weight as a string": ("batch-team-a", ["spec", "fairSharing"], "weight", "-0.5"),
    "a weight too small to count": ("batch-team-a", ["spec", "fairSharing"], "weight", "1n"),
    "a negative quota": ("batch-team-a", A100E_QUOTA, "nominalQuota", -8),
    "a negative borrowing limit": ("batch-team-a", A100E_QUOTA, "borrowingLimit", "-1"),
    "a lending limit above the quota": ("batch-team-a", A100E_QUOTA, "lendingLimit", 100),
    "a quota of another resource than the group's": ("batch-team-a", A100E_QUOTA, "name", "nvidia.com/gpus"),
    "not a quantity": ("batch-team-a", MEMORY_QUOTA, "nominalQuota", "lots"),
    "an unknown queueing strategy": ("batch-team-a", ["spec"], "queueingStrategy", "Fair"),
    "a borrowing limit without a cohort": ("batch-team-a", ["spec"], "cohortName", None),
    "a cluster-wide object in a namespace": ("batch-team-a", ["metadata"], "namespace", "batch"),
    "a local queue outside any namespace": ("team-a", ["metadata"], "namespace", None),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_the_validator_refuses_a_broken_kueue_object(case):
    """The validator can fail: each of these edits of a valid object makes it refuse that object."""
    name, path, field, value = BROKEN[case]
    obj = copy.deepcopy(next(obj for obj in _kueue_objects() if obj["metadata"]["name"] == name))
    assert kueue_problems(obj) == []
    node = obj
    for part in path:
        node = node[part]
    if value is None:
        del node[field]
    else:
        node[field] = value
    assert kueue_problems(obj), case


def test_strict_refuses_unknown_fields_where_properties_are_listed_and_keeps_maps_and_free_objects():
    schema = strict(
        {
            "type": "object",
            "properties": {
                "metadata": {"type": "object"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True},
                "items": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}},
            },
        }
    )
    validator = jsonschema.Draft4Validator(schema)
    assert validator.is_valid({"metadata": {"any": 1}, "labels": {"k": "v"}, "free": {"b": 1}, "items": [{"a": "x"}]})
    assert not validator.is_valid({"other": 1})
    assert not validator.is_valid({"items": [{"b": "x"}]})
    assert not validator.is_valid({"labels": {"k": 1}})


# ---- the shard pods, as Kueue's pod integration takes them ------------------------------------------


@pytest.fixture
def queued_launcher(tmp_path) -> K8sShardLauncher:
    """The launcher of a deployment whose tenants file gives team-a and team-b a `kueue_queue`."""
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return LAUNCHER.model_copy(update={"tenants_file": str(path)})


def _pod(owner: str | None, task=None, launcher=LAUNCHER) -> dict:
    """The pod the launcher hands the Pipes client for a job that `owner` holds in the job store (None: no
    record), the team plan_shards reads from it on the task, as the API server receives the pod and
    validated strictly (as tests/launch/test_k8s_pods.py's)."""
    task = task or _task({"gpus": 1, "gpu_type": "nvidia-ampere-a100e"})
    task = dataclasses.replace(task, owner_team=owner_team(owner) if owner is not None else None)
    meta, spec = launcher.pod_overrides(task, now=NOW, run_id="5c1e8b1a")
    pod = build_pod_body(
        pod_name="batch-0123abcd-shard-002",
        image=None,
        command=None,
        env_vars={},
        base_pod_meta=meta,
        base_pod_spec=spec,
    )
    body = {"apiVersion": "v1", "kind": "Pod", **ApiClient().sanitize_for_serialization(pod)}
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    return body


def _admitting_flavors(pod: dict, cluster_queue: dict) -> dict[str, str]:
    """resource -> the flavor Kueue's flavor assigner gives the pod's request of it in `cluster_queue`
    (pkg/scheduler/flavorassigner/flavorassigner.go): the first flavor of the resource's group whose
    nodeLabels the pod's nodeSelector (on the flavor's label keys) matches, with nominal quota plus
    borrowing limit for the whole request. A resource of no group is missing (Kueue's default
    BlockUndeclared leaves such a pod pending for ever)."""
    flavors = _of_kind("ResourceFlavor")
    requests: dict[str, Any] = {}
    for container in pod["spec"]["containers"]:
        resources = container.get("resources") or {}
        # an unset request is the limit (the API server's defaulting, before Kueue sees the pod)
        for resource, value in {**resources.get("limits", {}), **resources.get("requests", {})}.items():
            requests[resource] = requests.get(resource, 0) + parse_quantity(value)
    selector = pod["spec"].get("nodeSelector") or {}
    chosen = {}
    for resource, amount in requests.items():
        groups = [group for group in cluster_queue["spec"]["resourceGroups"] if resource in group["coveredResources"]]
        chosen[resource] = "missing"
        for group in groups:
            for flavor in group["flavors"]:
                labels = (flavors[flavor["name"]].get("spec") or {}).get("nodeLabels") or {}
                if any(selector.get(key, value) != value for key, value in labels.items()):
                    continue
                quota = next(quota for quota in flavor["resources"] if quota["name"] == resource)
                if parse_quantity(quota["nominalQuota"]) + parse_quantity(quota.get("borrowingLimit", 0)) >= amount:
                    chosen[resource] = flavor["name"]
                    break
    return chosen


def pod_problems(pod: dict, namespace: str, queue: str) -> list[str]:
    """Why the pod is not one Kueue's pod integration queues in `queue` and can admit ([] when it is)."""
    labels = pod["metadata"].get("labels") or {}
    annotations = pod["metadata"].get("annotations") or {}
    problems = []
    if labels.get(KUEUE_QUEUE_LABEL) != queue:
        problems.append(f"label {KUEUE_QUEUE_LABEL} is {labels.get(KUEUE_QUEUE_LABEL)!r}, not {queue!r}")
    elif not jsonschema.Draft4Validator({"pattern": DNS_SUBDOMAIN, "maxLength": 63}).is_valid(queue):
        problems.append(f"label {KUEUE_QUEUE_LABEL}: {queue!r} is not a DNS-1123 subdomain")
    # Kueue's webhook adds these; a pod carrying them itself is gated where no Kueue ungates it, or refused
    if pod["spec"].get("schedulingGates"):
        problems.append(f"scheduling gates {pod['spec']['schedulingGates']}: Kueue's webhook adds its own")
    others = sorted(key for key in {**labels, **annotations} if key.startswith(KUEUE_PREFIX))
    others = [key for key in others if key != KUEUE_QUEUE_LABEL]
    if others:
        problems.append(f"Kueue's own keys {others}: its webhook sets them (a pod group is admitted whole)")
    local_queues = {(q["metadata"]["namespace"], name): q for name, q in _of_kind("LocalQueue").items()}
    if (namespace, queue) not in local_queues:
        return [*problems, f"no LocalQueue {queue} in namespace {namespace} in k8s/kueue/kueue.yaml"]
    cluster_queue = _of_kind("ClusterQueue")[local_queues[(namespace, queue)]["spec"]["clusterQueue"]]
    for resource, flavor in _admitting_flavors(pod, cluster_queue).items():
        if flavor == "missing":
            problems.append(f"{resource}: no flavor of {cluster_queue['metadata']['name']} admits the pod's request")
    return problems


def test_a_teams_shard_pod_names_its_kueue_queue_from_the_tenants_file(queued_launcher):
    for team in ("team-a", "team-b"):
        pod = _pod(f"team:{team}", launcher=queued_launcher)
        assert pod["metadata"]["labels"][KUEUE_QUEUE_LABEL] == team
        assert pod_problems(pod, LAUNCHER.namespace, team) == []
        assert "schedulingGates" not in pod["spec"]  # the webhook adds the gate


def test_the_checks_fail_on_a_pod_with_no_queue_label(queued_launcher):
    """A team without kueue_queue (and a job of no team: an admin's, the launchpad's) gets no label, and
    the pod checks say so: they can fail."""
    for owner in ("team:team-c", "admins", "dagster", "team:no-such-team", None):
        pod = _pod(owner, launcher=queued_launcher)
        assert not any(key.startswith(KUEUE_PREFIX) for key in pod["metadata"]["labels"]), owner
        assert pod_problems(pod, LAUNCHER.namespace, "team-c") != [], owner
    pod = _pod("team:team-a", launcher=queued_launcher)
    assert pod_problems(pod, LAUNCHER.namespace, "team-b") != []  # another team's queue
    assert pod_problems(pod, "default", "team-a") != []  # no such LocalQueue in that namespace
    gated = copy.deepcopy(pod)
    gated["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
    assert pod_problems(gated, LAUNCHER.namespace, "team-a") != []


def test_without_a_tenants_file_no_pod_is_queued():
    assert KUEUE_QUEUE_LABEL not in _pod("team:team-a")["metadata"]["labels"]


def test_request_labels_never_set_a_kueue_key(queued_launcher):
    """A request's labels become pod labels under batch-pipeline.io/ only: the queue is the operator's
    choice, never the team's (another team's quota, or none at all)."""
    labels = {
        KUEUE_QUEUE_LABEL: "team-b",
        MANAGED_LABEL: "false",
        POD_GROUP_KEYS[0]: "group",
        "kueue.x-k8s.io/priority-class": "high",
    }
    task = _task({"gpus": 1, "gpu_type": "nvidia-tesla-t4"}, labels=labels)
    pod = _pod("team:team-a", task, launcher=queued_launcher)
    kueue_keys = {key: value for key, value in pod["metadata"]["labels"].items() if key.startswith(KUEUE_PREFIX)}
    assert kueue_keys == {KUEUE_QUEUE_LABEL: "team-a"}
    assert pod["metadata"]["labels"]["batch-pipeline.io/kueue.x-k8s.io-queue-name"] == "team-b"  # renamed, inert
    pod = _pod("team:team-c", task, launcher=queued_launcher)
    assert not any(key.startswith(KUEUE_PREFIX) for key in pod["metadata"]["labels"])


TEAM_KEYS = {"team-a": "key-of-team-a", "admins": "key-of-the-admins"}


@pytest.fixture
def kueue_tenants(tmp_path, monkeypatch):
    """A deployment's tenants file (BATCH_PIPELINE_TENANTS, its path) giving team-a and team-b a
    `kueue_queue`, team-a a key (TEAM_KEYS) and the admins theirs."""
    digest = {name: hashlib.sha256(key.encode()).hexdigest() for name, key in TEAM_KEYS.items()}
    (tmp_path / "team-a").mkdir()
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        f"  team-a: {{kueue_queue: team-a, api_keys_sha256: [{digest['team-a']}], data_roots: [{tmp_path}/team-a]}}\n"
        "  team-b: {kueue_queue: team-b}\n"
        f"admins:\n  api_keys_sha256: [{digest['admins']}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(path))
    return path


def test_a_planned_shard_names_the_team_that_owns_the_job_in_the_store_whatever_its_labels_say(
    tmp_path, kueue_tenants, tenants_api
):
    """The trust rule behind the queue: plan_shards puts on each task the team the job store holds as the
    job's owner (the key's team), never the team a request's labels name; an admin's job is of no team."""
    from batch_pipeline.pipeline.definitions import batch_completions_job
    from batch_pipeline.pipeline.runs import launch_key
    from batch_pipeline.pipeline.sensors import run_request_for

    service = tenants_api.app.state.job_service
    planned = {}
    for who, key in TEAM_KEYS.items():
        body = {
            "output_data_path": str(tmp_path / "team-a" / f"{who}.json"),
            "model_config": {"model": MODEL},
            "labels": {"team": "team-b", KUEUE_QUEUE_LABEL: "team-b"},
            "content": {"prompts": ["a", "b"], "max_new_tokens": 2, "temperature": 0},
        }
        made = tenants_api.post("/v2/batch-completions", json=body, headers={"x-api-key": key})
        assert made.status_code == 200, made.text
        request = run_request_for(service.store.get(made.json()["job_id"]), None, launch_key(service.instance))
        with dg.execute_job(
            dg.reconstructable(batch_completions_job),
            instance=service.instance,
            run_config=request.run_config,
            tags=request.tags,
            op_selection=["validate_input", "plan_shards"],
        ) as result:
            planned[who] = list(result.output_for_node("plan_shards", "shards").values())
    assert [task.owner_team for task in planned["team-a"]] == ["team-a"]
    assert [task.owner_team for task in planned["admins"]] == [None]
    launcher = LAUNCHER.model_copy(update={"tenants_file": str(kueue_tenants)})
    assert [launcher.kueue_queue_for(task) for task in planned["team-a"] + planned["admins"]] == ["team-a", None]


def _maxima() -> dict[str, str]:
    """The deployment's BATCH_PIPELINE_MAX_* (k8s/values.yaml's code location, which builds the pods)."""
    values = yaml.safe_load((REPO / "k8s" / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    return {item["name"]: item["value"] for item in deployment["env"] if item["name"].startswith("BATCH_PIPELINE_MAX_")}


@pytest.mark.parametrize("gpu_type", list(DEFAULT_GPU_NODE_SELECTORS))
def test_the_largest_shard_pod_of_each_gpu_type_takes_its_flavors_quota_in_each_teams_queue(gpu_type, queued_launcher):
    """Every resource a shard pod asks for is covered, and its GPUs come from its gpu_type's flavor, even
    for the largest pod the shipped maxima let through: otherwise Kueue never admits it."""
    maxima = _maxima()
    bounds = {name.removeprefix("BATCH_PIPELINE_MAX_").lower(): value for name, value in maxima.items()}
    launcher = queued_launcher.model_copy(update={"max_hardware": bounds})
    hardware = {
        "gpus": int(maxima["BATCH_PIPELINE_MAX_GPUS"]),
        "gpu_type": gpu_type,
        "cpus": int(maxima["BATCH_PIPELINE_MAX_CPUS"]),
        "memory": maxima["BATCH_PIPELINE_MAX_MEMORY"],
        "storage": maxima["BATCH_PIPELINE_MAX_STORAGE"],
    }
    gpu_resource = MIG_RESOURCES.get(gpu_type, "nvidia.com/gpu")
    for team in ("team-a", "team-b"):
        pod = _pod(f"team:{team}", _task(hardware), launcher=launcher)
        assert pod_problems(pod, LAUNCHER.namespace, team) == []
        queue = _of_kind("ClusterQueue")[_of_kind("LocalQueue")[team]["spec"]["clusterQueue"]]
        chosen = _admitting_flavors(pod, queue)
        assert chosen == {
            gpu_resource: gpu_type,
            "cpu": "default-flavor",
            "memory": "default-flavor",
            "ephemeral-storage": "default-flavor",
        }


def test_a_pod_as_kueues_webhook_leaves_it_is_still_a_valid_pod(queued_launcher):
    """Kueue adds its gate, label and finalizer to the pod the launcher built; the result is a pod the
    API server takes (the Pod Security levels and the run account's admission policy see no difference)."""
    pod = _pod("team:team-a", launcher=queued_launcher)
    pod["metadata"]["labels"][MANAGED_LABEL] = "true"
    pod["metadata"]["finalizers"] = [MANAGED_LABEL]
    pod["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


# ---- the tenants file's kueue_queue -------------------------------------------------------------------


def test_kueue_queue_is_an_optional_dns_label_like_a_team_name(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    teams = Tenants.load(str(path)).teams
    assert {name: team.config.kueue_queue for name, team in teams.items()} == {
        "team-a": "team-a",
        "team-b": "team-b",
        "team-c": None,
    }
    for wrong in ("Team-A", "team_a", "-a", "a" * 64, "a.b"):
        path.write_text(f"tenants:\n  team-a:\n    kueue_queue: {wrong!r}\n")
        with pytest.raises(TenantsFileError, match=r"line 3: tenants\.team-a\.kueue_queue"):
            Tenants.load(str(path))
