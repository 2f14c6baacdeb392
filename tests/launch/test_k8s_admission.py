"""What the Kubernetes deployment admits: the pods the run account may create and delete
(k8s/admission-policy.yaml, its CEL rules evaluated with cel-python against the pods the shard launcher
really builds), the namespace's Pod Security level, what a run's `dagster-k8s/config` tag may set on its
pod (dagster-k8s's own allowlist check, on the run launcher the chart values configure), and the sizes a
request may ask for under the shipped manifests' environment.

No API server runs here: `admission` below evaluates the policies as the API server's admission does
(matchConstraints, matchConditions, variables, validations; failurePolicy Fail), which the assertions on
the policies' shape keep honest."""

import copy
import json
from pathlib import Path

import celpy
import pytest
import yaml
from celpy import celtypes

from batch_pipeline.launch.k8s import SANDBOX_CAPABILITIES, InvalidHardware, K8sShardLauncher
from tests.launch.test_k8s_pods import _dagster_run, _pod, _run_launcher, _task, _tool_task, _values

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "batch"
RUN_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:batch-pipeline-run"
DAEMON_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:batch-pipeline"
# A run's pod, as dagster-k8s's K8sRunLauncher names its Job (dagster-run-<run id>) and the Job its pod; and
# the code server's, as the chart's Deployment names it. Both run as the run account.
RUN_POD = "dagster-run-5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91-x7k2p"
CODE_SERVER_POD = "dagster-dagster-user-deployments-batch-pipeline-7d9f8c6b5-q2w8r"


def _documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((REPO / "k8s" / name).read_text()) if doc]


def _location_env() -> dict[str, str]:
    (deployment,) = _values()["dagster-user-deployments"]["deployments"]
    return {item["name"]: item["value"] for item in deployment["env"]}


def _api_env() -> dict[str, str]:
    (api,) = [doc for doc in _documents("api.yaml") if doc["kind"] == "Deployment"]
    (container,) = api["spec"]["template"]["spec"]["containers"]
    return {item["name"]: item["value"] for item in container["env"] if "value" in item}


@pytest.fixture
def deployed_launcher(monkeypatch) -> K8sShardLauncher:
    """The shard launcher as the code location makes it from the shipped environment (k8s/values.yaml)."""
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    for name, value in _location_env().items():
        monkeypatch.setenv(name, value)
    launcher = shard_launcher_from_environment()
    assert isinstance(launcher, K8sShardLauncher)
    return launcher


def _changed(launcher: K8sShardLauncher, **fields) -> K8sShardLauncher:
    """The launcher with some of its deployment fields changed, as a run config overriding them would."""
    return launcher.model_copy(update=fields)


class Admission:
    """The admission policies of k8s/admission-policy.yaml as the API server applies them to a request on
    pods: each bound policy whose matchConstraints and matchConditions match the request evaluates its
    variables, then its validations; a false validation denies with its message, and so does one that
    cannot be evaluated (failurePolicy Fail)."""

    def __init__(self, documents: list[dict]) -> None:
        self.policies = {
            doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "ValidatingAdmissionPolicy"
        }
        self.bound = [
            doc["spec"]["policyName"]
            for doc in documents
            if doc["kind"] == "ValidatingAdmissionPolicyBinding" and "Deny" in doc["spec"]["validationActions"]
        ]
        self.environment = celpy.Environment()

    def _evaluate(self, expression: str, activation: dict):
        return self.environment.program(self.environment.compile(expression)).evaluate(activation)

    def denials(
        self, operation: str, pod: dict, username: str = RUN_ACCOUNT, caller_pod: str | None = RUN_POD
    ) -> list[str]:
        """`caller_pod`: the pod the caller's token is bound to (its user's extra, as the API server's
        authenticator sets it); None for a token bound to none."""
        user: dict = {"username": username}
        if caller_pod is not None:
            user["extra"] = {"authentication.kubernetes.io/pod-name": [caller_pod]}
        request = {"operation": operation, "namespace": NAMESPACE, "userInfo": user}
        activation = {
            "request": celpy.json_to_cel(request),
            "object": celpy.json_to_cel(pod if operation != "DELETE" else None),
            "oldObject": celpy.json_to_cel(pod if operation == "DELETE" else None),
        }
        denied = []
        for name in self.bound:
            spec = self.policies[name]["spec"]
            assert spec["failurePolicy"] == "Fail"
            if not any(
                operation in rule["operations"] and "pods" in rule["resources"] and "" in rule["apiGroups"]
                for rule in spec["matchConstraints"]["resourceRules"]
            ):
                continue
            if not all(self._evaluate(c["expression"], activation) for c in spec.get("matchConditions", [])):
                continue
            try:
                variables: dict = {}
                for variable in spec.get("variables", []):
                    variables[celtypes.StringType(variable["name"])] = self._evaluate(
                        variable["expression"], {**activation, "variables": celtypes.MapType(variables)}
                    )
                scope = {**activation, "variables": celtypes.MapType(variables)}
                for validation in spec["validations"]:
                    try:
                        allowed = self._evaluate(validation["expression"], scope)
                    except celpy.CELEvalError as exc:
                        allowed = exc
                    if not (isinstance(allowed, celtypes.BoolType) and allowed):
                        denied.append(validation["message"])
            except celpy.CELEvalError as exc:
                denied.append(f"{name}: {exc}")
        return denied


ADMISSION = Admission(_documents("admission-policy.yaml"))


def _admitted(pod: dict, username: str = RUN_ACCOUNT) -> bool:
    return ADMISSION.denials("CREATE", pod, username) == []


def test_the_policies_bind_the_run_account_that_creates_shard_pods():
    """The account the policies name is the one k8s/rbac.yaml lets create pods, and the one each run's pod
    runs as (the run launcher's config)."""
    rbac = _documents("rbac.yaml")
    (binding,) = [
        doc for doc in rbac if doc["kind"] == "RoleBinding" and doc["roleRef"]["name"] == "batch-pipeline-shard-pods"
    ]
    (subject,) = binding["subjects"]
    assert f"system:serviceaccount:{subject['namespace']}:{subject['name']}" == RUN_ACCOUNT
    run_launcher = _values()["runLauncher"]["config"]["customRunLauncher"]["config"]
    assert run_launcher["service_account_name"] == subject["name"]
    assert sorted(ADMISSION.bound) == sorted(ADMISSION.policies)  # every policy is enforced


@pytest.mark.parametrize(
    "task",
    [
        _task(),
        _task({"gpus": 2, "gpu_type": "nvidia-ampere-a100e", "cpus": 8, "memory": "80Gi", "storage": 200}),
        _task({"gpus": 1, "gpu_type": "nvidia-hopper-h100-1g20gb"}, labels={"team": "search/ranking"}),
        _tool_task(),
    ],
    ids=["plain", "gpus", "mig", "tool_config"],
)
def test_every_shard_pod_the_deployment_builds_is_admitted(deployed_launcher, task):
    pod = _pod(deployed_launcher, task, run_id="5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91")
    assert ADMISSION.denials("CREATE", pod) == []


def _edited(pod: dict, edit) -> dict:
    changed = copy.deepcopy(pod)
    edit(changed)
    return changed


def _container(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


HOSTILE_EDITS = {
    "privileged": lambda pod: _container(pod)["securityContext"].update(privileged=True),
    "privilege escalation": lambda pod: _container(pod)["securityContext"].update(allowPrivilegeEscalation=True),
    "a capability beyond the sandbox's": lambda pod: _container(pod)["securityContext"]["capabilities"].update(
        add=["SYS_ADMIN"]
    ),
    "another image": lambda pod: _container(pod).update(image="docker.io/library/busybox:1.36"),
    "another image, by prefix": lambda pod: _container(pod).update(
        image="registry.example/batch-pipeline-worker-debug:1"
    ),
    "an init container of another image": lambda pod: pod["spec"].update(
        initContainers=[{**_container(pod), "name": "init", "image": "docker.io/library/busybox:1.36"}]
    ),
    "a Secret's key in its env": lambda pod: _container(pod)["env"].append(
        {
            "name": "KEYS",
            "valueFrom": {"secretKeyRef": {"name": "batch-pipeline-api-keys", "key": "BATCH_PIPELINE_API_KEYS"}},
        }
    ),
    "a Secret volume": lambda pod: pod["spec"]["volumes"].append(
        {"name": "db", "secret": {"secretName": "batch-pipeline"}}
    ),
    "a hostPath volume": lambda pod: pod["spec"]["volumes"].append({"name": "node", "hostPath": {"path": "/"}}),
    "the host's network": lambda pod: pod["spec"].update(hostNetwork=True),
    "the host's PIDs": lambda pod: pod["spec"].update(hostPID=True),
    "a host port": lambda pod: _container(pod).update(ports=[{"containerPort": 80, "hostPort": 80}]),
    "a node of its choice": lambda pod: pod["spec"].update(nodeName="control-plane-0"),
    "a service account token": lambda pod: pod["spec"].update(automountServiceAccountToken=True),
    "no seccomp profile": lambda pod: pod["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "a writable root": lambda pod: _container(pod)["securityContext"].update(readOnlyRootFilesystem=False),
    "out of the shard workers' NetworkPolicy": lambda pod: pod["metadata"]["labels"].pop("batch-pipeline.io/component"),
    "the daemon's label (Postgres admits it)": lambda pod: pod["metadata"]["labels"].update(component="dagster-daemon"),
    # the gate's label: the read-only webserver admits its pods without a key
    "the Dagster UI gate's label": lambda pod: pod["metadata"]["labels"].update(
        {"app.kubernetes.io/name": "batch-pipeline-dagster-ui"}
    ),
    "the API's label (Postgres admits it)": lambda pod: pod["metadata"]["labels"].update(
        {"app.kubernetes.io/name": "batch-pipeline-api"}
    ),
    "no cpu limit": lambda pod: _container(pod)["resources"]["limits"].pop("cpu"),
    "no memory limit": lambda pod: _container(pod)["resources"]["limits"].pop("memory"),
    "no resources at all": lambda pod: _container(pod).pop("resources"),
    "an init container without limits": lambda pod: pod["spec"].update(
        initContainers=[{**_container(pod), "name": "init", "resources": {}}]
    ),
    "a second container": lambda pod: pod["spec"]["containers"].append({**_container(pod), "name": "second"}),
    "more GPUs than the maximum": lambda pod: _container(pod)["resources"]["limits"].update({"nvidia.com/gpu": "9"}),
    "more MIG slices than the maximum": lambda pod: _container(pod)["resources"].update(
        limits={**_container(pod)["resources"]["limits"], "nvidia.com/mig-1g.20gb": "64"},
        requests={**_container(pod)["resources"]["requests"], "nvidia.com/mig-1g.20gb": "64"},
    ),
    "a resource no integer counts": lambda pod: _container(pod)["resources"]["limits"].update({"hugepages-2Mi": "1Gi"}),
}


@pytest.mark.parametrize("edit", HOSTILE_EDITS.values(), ids=HOSTILE_EDITS.keys())
def test_a_pod_of_the_run_account_beyond_a_shard_pod_is_denied(deployed_launcher, edit):
    for task in (_task({"gpus": 1}), _tool_task()):
        pod = _pod(deployed_launcher, task)
        assert _admitted(pod)
        assert len(ADMISSION.denials("CREATE", _edited(pod, edit))) == 1  # by its rule, not by an evaluation error


@pytest.mark.parametrize("account", ["batch-pipeline", "batch-pipeline-run", "default"])
def test_a_shard_pod_under_another_service_account_is_denied(deployed_launcher, account):
    """Another account's token in a pod is its rights: the daemon's launches Jobs, the run account's creates pods."""
    pod = _pod(_changed(deployed_launcher, service_account_name=account), _task())
    assert ADMISSION.denials("CREATE", pod) == ["the pod runs as batch-pipeline-worker, with no service account token"]


@pytest.mark.parametrize("secret", ["batch-pipeline", "batch-pipeline-api-keys", "dagster-postgresql-secret"])
def test_a_shard_pod_given_a_secret_nobody_listed_is_denied(deployed_launcher, secret):
    pod = _pod(_changed(deployed_launcher, env_secrets=[secret]), _task())
    assert ADMISSION.denials("CREATE", pod) == ["only the listed Secrets"]


def test_a_secret_the_operator_lists_reaches_shard_pods_and_no_other(deployed_launcher):
    documents = _documents("admission-policy.yaml")
    (policy,) = [
        doc
        for doc in documents
        if doc["kind"] == "ValidatingAdmissionPolicy"
        and doc["metadata"]["name"] == "batch-pipeline-run-account-creates-shard-pods"
    ]
    (listed,) = [variable for variable in policy["spec"]["variables"] if variable["name"] == "allowedSecrets"]
    assert listed["expression"] == "[]"  # as shipped: the shard pods get no Secret
    listed["expression"] = "['hf-token']"  # the operator's edit the manifest's comment describes
    admission = Admission(documents)
    assert admission.denials("CREATE", _pod(_changed(deployed_launcher, env_secrets=["hf-token"]), _task())) == []
    other = _pod(_changed(deployed_launcher, env_secrets=["hf-token", "batch-pipeline"]), _task())
    assert admission.denials("CREATE", other) == ["only the listed Secrets"]


def test_the_policies_hold_the_run_account_alone(deployed_launcher):
    """Other accounts' pods are RBAC's business (no other account may create pods): the policy neither
    breaks the chart's own pods nor stands in for RBAC."""
    privileged = _edited(_pod(deployed_launcher, _task()), HOSTILE_EDITS["privileged"])
    assert not _admitted(privileged)
    assert _admitted(privileged, username=DAEMON_ACCOUNT)


def test_the_run_account_deletes_shard_pods_and_no_other(deployed_launcher):
    shard_pod = _pod(deployed_launcher, _task())
    assert ADMISSION.denials("DELETE", shard_pod) == []
    (api,) = [doc for doc in _documents("api.yaml") if doc["kind"] == "Deployment"]
    api_pod = {"metadata": {"name": "batch-pipeline-api-1", **api["spec"]["template"]["metadata"]}, "spec": {}}
    webserver = {"metadata": {"name": "dagster-webserver-1", "labels": {"component": "dagster-webserver"}}}
    for pod in (api_pod, webserver, {"metadata": {"name": "unlabelled"}}):
        assert ADMISSION.denials("DELETE", pod) == ["the run account deletes shard pods only"], pod


# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards): the capabilities
# each level lets a container add.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}


def test_the_namespace_enforces_the_strictest_pod_security_level_tool_shards_meet(deployed_launcher):
    (namespace,) = _documents("namespace.yaml")
    labels = namespace["metadata"]["labels"]
    assert namespace["metadata"]["name"] == NAMESPACE
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
    # a tool_config shard's worker: uid 0 and the sandbox's capabilities, within baseline, past restricted
    tool_pod = _pod(deployed_launcher, _tool_task())
    added = set(_container(tool_pod)["securityContext"]["capabilities"]["add"])
    assert added == set(SANDBOX_CAPABILITIES) and added <= BASELINE_CAPABILITIES
    assert not added <= RESTRICTED_CAPABILITIES and tool_pod["spec"]["securityContext"]["runAsNonRoot"] is False
    # every other shard pod meets restricted: non-root, nothing added
    plain = _pod(deployed_launcher, _task({"gpus": 1}))
    assert plain["spec"]["securityContext"]["runAsNonRoot"] is True
    assert "add" not in _container(plain)["securityContext"]["capabilities"]


def _k8s_config_tag(config: dict) -> dict[str, str]:
    return {"dagster-k8s/config": json.dumps(config)}


REFUSED_RUN_TAGS = {
    "image": {"container_config": {"image": "docker.io/library/busybox:1.36"}},
    "command": {"container_config": {"command": ["sh", "-c", "id"]}},
    "env": {"container_config": {"env": [{"name": "BATCH_PIPELINE_WORKER_IMAGE", "value": "evil:1"}]}},
    "envFrom a Secret": {"container_config": {"env_from": [{"secret_ref": {"name": "batch-pipeline-api-keys"}}]}},
    "privileged": {"container_config": {"security_context": {"privileged": True}}},
    "a hostPath volume": {"pod_spec_config": {"volumes": [{"name": "node", "host_path": {"path": "/"}}]}},
    "a service account": {"pod_spec_config": {"service_account_name": "batch-pipeline"}},
    "the host network": {"pod_spec_config": {"host_network": True}},
    "tolerations": {"pod_spec_config": {"tolerations": [{"operator": "Exists"}]}},
    "labels": {"pod_template_spec_metadata": {"labels": {"component": "dagster-daemon"}}},
    "annotations": {"pod_template_spec_metadata": {"annotations": {"sidecar.istio.io/inject": "false"}}},
}


@pytest.mark.parametrize("config", REFUSED_RUN_TAGS.values(), ids=REFUSED_RUN_TAGS.keys())
def test_a_runs_k8s_config_tag_beyond_its_resources_is_refused_at_launch(tmp_path, config):
    values = _values()
    launcher = _run_launcher(values, tmp_path)
    with pytest.raises(Exception, match="violated the allowed list"):
        launcher.get_container_context_for_run(_dagster_run(values, tags=_k8s_config_tag(config)))


def test_a_runs_k8s_config_tag_may_size_its_pod_and_change_nothing_else(tmp_path):
    from tests.launch.test_k8s_pods import _run_pod

    values = _values()
    resources = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    plain, sized = (
        _run_pod(values, tmp_path),
        _run_pod(values, tmp_path, tags=_k8s_config_tag({"container_config": {"resources": resources}})),
    )
    assert sized["containers"][0]["resources"] == resources
    sized["containers"][0].pop("resources")
    plain["containers"][0].pop("resources", None)
    assert sized == plain


def test_the_code_locations_config_stays_out_of_launched_runs_which_would_refuse_it(tmp_path):
    """The chart's default passes the code location's k8s config to its runs as user-defined config, which
    the allowlist refuses (its Secrets, volumes, account): every run would fail to launch."""
    from tests.launch.test_k8s_pods import _code_location_container_context

    values = _values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert deployment["includeConfigInLaunchedRuns"] == {"enabled": False}
    launcher = _run_launcher(values, tmp_path)
    with pytest.raises(Exception, match="violated the allowed list"):
        launcher.get_container_context_for_run(
            _dagster_run(values, container_context=_code_location_container_context(values))
        )


MAXIMA = (
    "BATCH_PIPELINE_MAX_GPUS",
    "BATCH_PIPELINE_MAX_CPUS",
    "BATCH_PIPELINE_MAX_MEMORY",
    "BATCH_PIPELINE_MAX_STORAGE",
    "BATCH_PIPELINE_MAX_SHARDS_PER_JOB",
)


def test_the_shipped_manifests_bound_what_a_request_may_ask_for(monkeypatch):
    from batch_pipeline.admission.hardware import hardware_refusals
    from batch_pipeline.admission.policy import AdmissionPolicy
    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.core.settings import settings
    from batch_pipeline.pipeline.definitions import shard_launcher_from_environment

    api_env, location_env = _api_env(), _location_env()
    assert {name: api_env.get(name) for name in MAXIMA} == {name: location_env.get(name) for name in MAXIMA}
    for name in MAXIMA:
        assert api_env.get(name), f"{name} is not set in k8s/api.yaml"
        monkeypatch.setenv(name, api_env[name])
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "output_data_path": "s3://bucket/out.json",
            "model_config": {"model": "llama-3-8b"},
            "content": {"prompts": ["x"], "max_new_tokens": 4, "temperature": 0.0},
            "gpus": 1000000,
            "cpus": 100000,
            "memory": "100Ti",
            "storage": "100Pi",
        }
    )
    # what the API's submission check refuses (a 422 naming each field), its policy read as the API reads it
    assert dict(hardware_refusals(request, AdmissionPolicy.of_deployment(settings()).hardware_maxima)) == {
        "gpus": f"1000000 is more than this deployment's maximum of {api_env['BATCH_PIPELINE_MAX_GPUS']}",
        "cpus": f"100000 is more than this deployment's maximum of {api_env['BATCH_PIPELINE_MAX_CPUS']}",
        "memory": f"100Ti is more than this deployment's maximum of {api_env['BATCH_PIPELINE_MAX_MEMORY']}",
        "storage": f"100Pi is more than this deployment's maximum of {api_env['BATCH_PIPELINE_MAX_STORAGE']}",
    }
    # and the code location's launcher, as its definitions build it, on the pod it would build
    monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", "k8s")
    monkeypatch.setenv("BATCH_PIPELINE_WORKER_IMAGE", "i")
    with pytest.raises(InvalidHardware, match="^gpus: 1000000 is more than"):
        shard_launcher_from_environment().pod_overrides(_task({"gpus": 1000000}))
    # and the engine arguments, set the same in both
    engine = sorted(name for name in api_env if name.startswith("BATCH_PIPELINE_MAX_") and name not in MAXIMA)
    assert engine and {name: api_env[name] for name in engine} == {name: location_env.get(name) for name in engine}
    for name in engine:
        monkeypatch.setenv(name, api_env[name])
    from batch_pipeline.admission.hardware import engine_argument_refusals

    huge = request.model_cfg.model_copy(update={"num_gpu_blocks_override": 2**40, "max_num_seqs": 10**6})
    policy = AdmissionPolicy.of_deployment(settings())
    assert {field for field, _ in engine_argument_refusals(huge, policy.engine_maxima, policy.max_gpus)} == {
        "model_config.num_gpu_blocks_override",
        "model_config.max_num_seqs",
    }


def test_the_policys_gpu_bound_is_the_deployments(deployed_launcher):
    """The creation policy's `maxGpus` is BATCH_PIPELINE_MAX_GPUS as shipped: a pod of the maximum is
    admitted, one GPU more is not."""
    (policy,) = [
        doc
        for doc in _documents("admission-policy.yaml")
        if doc["kind"] == "ValidatingAdmissionPolicy"
        and doc["metadata"]["name"] == "batch-pipeline-run-account-creates-shard-pods"
    ]
    (bound,) = [variable for variable in policy["spec"]["variables"] if variable["name"] == "maxGpus"]
    maximum = int(_location_env()["BATCH_PIPELINE_MAX_GPUS"])
    assert int(bound["expression"]) == maximum
    pod = _pod(deployed_launcher, _task({"gpus": maximum, "gpu_type": "nvidia-ampere-a100e"}))
    assert ADMISSION.denials("CREATE", pod) == []
    _container(pod)["resources"]["limits"]["nvidia.com/gpu"] = str(maximum + 1)
    assert ADMISSION.denials("CREATE", pod) == ["no more GPUs than the deployment's maximum (BATCH_PIPELINE_MAX_GPUS)"]


@pytest.mark.parametrize("caller", [CODE_SERVER_POD, None], ids=["the code server", "a token bound to no pod"])
def test_only_a_runs_pod_creates_or_deletes_shard_pods(deployed_launcher, caller):
    """The code server holds the run account too, and never starts or stops a shard: its token (or one
    bound to no pod) neither creates nor deletes one."""
    pod = _pod(deployed_launcher, _task())
    assert ADMISSION.denials("CREATE", pod) == ADMISSION.denials("DELETE", pod) == []
    assert ADMISSION.denials("CREATE", pod, caller_pod=caller) == [
        "only a run's pod (the token bound to it) creates shard pods, not the code server"
    ]
    assert ADMISSION.denials("DELETE", pod, caller_pod=caller) == [
        "only a run's pod (the token bound to it) deletes shard pods, not the code server"
    ]


def test_the_run_pods_dagster_k8s_launches_are_named_as_the_policies_expect():
    from dagster_k8s.job import get_job_name_from_run_id

    # a run's pod is its Job's, named <job>-<suffix> by the Job controller; a resumed run's Job too
    assert RUN_POD.startswith(get_job_name_from_run_id("5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91") + "-")
    assert get_job_name_from_run_id("5c1e8b1a-3f0d-4f5e-9c43-0f8d2a6b7e91", 1).startswith("dagster-run-")
