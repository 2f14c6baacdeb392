"""The code_evaluator sandbox against hostile code, run directly: each case contained, the calling
process unharmed, nothing left running, nothing of the host touched.

Most cases run in two modes: with everything this machine allows (namespaces, a cgroup), and bare, as
in a Kubernetes pod that refuses `unshare` and has no writable cgroup (both forced here), where the
operator has allowed code with the worker's network (BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK); without that,
the sandbox refuses (tested below with the pod's real capabilities)."""

import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from batch_pipeline.worker.sandbox import (
    SANDBOX_UID_BASE,
    SANDBOX_UIDS,
    CgroupParents,
    Sandbox,
    SandboxLimits,
    SandboxSettings,
)
from tests.conftest import sandbox_processes

ROOT = os.geteuid() == 0
# Code runs only where the sandbox can give it a uid of its own: elsewhere it refuses (tested below, as root).
needs_root = pytest.mark.skipif(not ROOT, reason="the sandbox runs code only in a root worker")
REPO = Path(__file__).resolve().parents[2]
# What the Kubernetes pods of tool_config shards keep (k8s/ drops every other capability).
POD_CAPABILITIES = ["chown", "dac_override", "fowner", "kill", "setuid", "setgid"]
# The operator's opt-in to code with the worker's network where no network namespace can be made.
NETWORK_ALLOWED = SandboxSettings(allow_network=True)


def bare(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in most pods: the kernel refuses unshare and no cgroup can be made."""
    monkeypatch.setattr(Sandbox, "_probe_namespaces", lambda self: False)
    monkeypatch.setattr(Sandbox, "_probe_cgroups", lambda self: None, raising=False)


@pytest.fixture(scope="module", params=["everything allowed", "bare"])
def make_sandbox(request):
    """Sandboxes of one mode."""
    if not ROOT:
        pytest.skip("the sandbox runs code only in a root worker")
    with pytest.MonkeyPatch.context() as monkeypatch:
        if request.param == "bare":
            bare(monkeypatch)
        yield lambda limits=SandboxLimits(timeout_s=3), slots=2: Sandbox(limits, slots, NETWORK_ALLOWED)


@pytest.fixture(scope="module")
def sandbox(make_sandbox):
    return make_sandbox()


def sandbox_dirs() -> set[str]:
    return {name for name in os.listdir("/tmp") if name.startswith(("batch-pipeline-sandbox-", "batch-pipeline-exec-"))}


def sandbox_cgroups() -> set[str]:
    parents = CgroupParents.find() if ROOT else None
    directories = {parents.memory, parents.pids} - {None} if parents else set()
    return {name for d in directories for name in os.listdir(d) if name.startswith("batch-pipeline-sandbox-")}


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    before, cgroups_before = sandbox_dirs(), sandbox_cgroups()
    yield
    assert not sandbox_processes()
    assert sandbox_dirs() <= before
    assert sandbox_cgroups() <= cgroups_before


def test_output_and_errors_come_back(sandbox):
    assert sandbox.run("print(123 * 456)").feedback() == "56088\n"
    failed = sandbox.run("print('partial')\nprint(undefined_name)")
    assert not failed.ok
    assert failed.feedback().startswith("partial\nNameError: name 'undefined_name' is not defined")


def test_an_infinite_loop_is_stopped_at_the_wall_clock_limit(sandbox):
    started = time.monotonic()
    result = sandbox.run("while True: pass", timeout_s=2)
    assert result.timed_out and "TimeoutError" in result.error
    assert time.monotonic() - started < 6


def test_a_sleeping_process_tree_is_killed_whole(sandbox):
    # A child that leaves the session and outlives its parent would escape a process-group kill.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\ntime.sleep(1000)"
    result = sandbox.run(code, timeout_s=1)
    assert result.timed_out


@pytest.mark.slow
def test_a_fork_bomb_is_contained(sandbox):
    result = sandbox.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2
    )
    assert result.timed_out
    assert sandbox.run("print('still works')").output == "still works\n"


def test_a_10_gb_allocation_fails_inside_the_sandbox(sandbox):
    result = sandbox.run("x = bytearray(10 * 2**30)\nprint(len(x))")
    assert result.error == "MemoryError"


def test_a_gigabyte_of_output_is_cut_off(sandbox):
    result = sandbox.run("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)")
    assert result.output.endswith("[output truncated to 8192 characters]")
    assert len(result.output) < 9000
    assert "File too large" in result.error  # the file-size limit stopped it long before 1 GB


@pytest.mark.skipif(not ROOT, reason="file ownership protects the job's files when the sandbox runs as its own uid")
def test_writing_outside_its_directory_fails(sandbox, tmp_path):
    job_file = tmp_path / "output.json"
    job_file.write_text("the job's output")
    for target in (job_file, Path.home() / ".cache" / "planted", Path("/etc/planted")):
        result = sandbox.run(f"open({str(target)!r}, 'w').write('x')")
        assert "PermissionError" in result.error, result
    assert job_file.read_text() == "the job's output"
    assert not Path("/etc/planted").exists() and not (Path.home() / ".cache" / "planted").exists()
    own = sandbox.run("open('scratch.txt', 'w').write('mine'); print(open('scratch.txt').read())")
    assert own.output == "mine\n"  # its own working directory is writable


def test_the_worker_environment_is_out_of_reach(sandbox, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_TEST_SECRET", "s3cr3t-value")
    result = sandbox.run(
        "import os\nprint(sorted(os.environ))\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError as exc:\n        print(type(exc).__name__)\n"
        f"print(open('/proc/{os.getpid()}/environ').read())"
    )
    assert "s3cr3t-value" not in result.output + (result.error or "")
    assert "BATCH_PIPELINE" not in result.output
    assert not result.ok  # the worker's own /proc entry cannot be opened


def test_no_network(sandbox):
    if not sandbox.isolation.network.startswith("no network"):
        pytest.skip(f"this kernel gives no network namespace: {sandbox.isolation.network}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(4)
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True).start()
    port = listener.getsockname()[1]
    result = sandbox.run(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    )
    assert "connected" not in result.output and result.error
    resolved = sandbox.run("import socket\nprint(socket.gethostbyname('pypi.org'))")
    assert resolved.error and "gaierror" in resolved.error
    time.sleep(0.2)
    assert accepted in ([], [None])


def _accept(listener: socket.socket):
    try:
        return listener.accept()
    except OSError:
        return None


@pytest.mark.slow
@needs_root
def test_parallel_executions_use_every_slot():
    sandbox = Sandbox(SandboxLimits(timeout_s=20), slots=2, settings=NETWORK_ALLOWED)  # in either mode
    results: list = []
    # Each execution says when its code ran; from that, how many ran at once (no wall-clock bound: the
    # machine may be loaded).
    code = "import time; start = time.time(); time.sleep(3); print(start, time.time())"
    threads = [threading.Thread(target=lambda: results.append(sandbox.run(code))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans = [tuple(map(float, r.output.split())) for r in results]
    assert len(spans) == 4 and all(r.ok for r in results)
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    assert most == 2  # two at a time: both slots used, never more


@needs_root
def test_without_namespaces_the_uid_and_limits_still_contain(monkeypatch):
    # Some clusters refuse unshare: this forces that case here, where the operator allowed the network.
    monkeypatch.setattr(Sandbox, "_probe_namespaces", lambda self: False)
    sandbox = Sandbox(SandboxLimits(timeout_s=2), slots=1, settings=NETWORK_ALLOWED)
    assert sandbox.isolation.network.startswith("NOT isolated")
    assert sandbox.run("print(6 * 7)").output == "42\n"
    assert sandbox.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    ).timed_out
    leftover = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('parent exits')"
    assert sandbox.run(leftover).output == "parent exits\n"
    assert not sandbox_processes()  # the detached child went with its uid


# A child that leaves the session and outlives its parent, findable by the name it runs under.
DETACHED = (
    "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', [{marker!r}, '1000'])\n"
    "print('parent exits')"
)


def processes_named(name: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0] == name.encode():
                found.append(int(entry))
        except OSError:
            pass
    return found


def shared_directory() -> Path:
    """A directory anyone may enter (unlike pytest's tmp_path), so only a file's own mode protects it."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    path.chmod(0o755)
    return path


@pytest.mark.skipif(not ROOT, reason="a uid of its own needs a root worker")
def test_the_code_runs_as_its_slot_uid_in_every_mode(sandbox):
    """Without namespaces as with them: not root, no groups, no capabilities; root's private files,
    private directories and processes out of reach; nothing of it left alive."""
    shared = shared_directory()
    try:
        secret = shared / "secret"
        secret.write_text("root's secret")
        secret.chmod(0o600)
        private = shared / "private"
        private.mkdir(mode=0o700)
        result = sandbox.run(
            "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            f"for attempt in (lambda: open({str(secret)!r}).read(), lambda: open({str(private / 'planted')!r}, 'w'),\n"
            f"                lambda: open('/proc/{os.getpid()}/environ').read(), lambda: os.kill({os.getpid()}, 0)):\n"
            "    try:\n        print('DONE', attempt())\n"
            "    except OSError as exc:\n        print(type(exc).__name__)\n"
        )
        lines = result.output.splitlines()
        assert lines[0] in {f"{uid} {uid} []" for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UIDS)}, (
            result
        )
        assert lines[1] == "0000000000000000"
        assert "DONE" not in result.output and "root's secret" not in result.output, result
        assert not (private / "planted").exists()
        assert sandbox.isolation.user.startswith(f"uids {SANDBOX_UID_BASE}-{SANDBOX_UID_BASE + SANDBOX_UIDS - 1}")
        marker = f"sandbox-detached-{os.getpid()}"
        assert sandbox.run(DETACHED.format(marker=marker)).ok
        assert not processes_named(marker)
    finally:
        subprocess.run(["rm", "-rf", str(shared)], check=True)


TEMPORARY_LEFTOVERS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
marker = {marker!r}
for directory in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock'):
    if os.access(directory, os.W_OK):
        open(f'{{directory}}/{{marker}}', 'w').write('left behind')
os.makedirs(f'/tmp/{{marker}}-tree/deeper')
open(f'/tmp/{{marker}}-tree/deeper/file', 'w').write('left behind')
os.chmod(f'/tmp/{{marker}}-tree/deeper', 0)
os.chmod(f'/tmp/{{marker}}-tree', 0)
segment = libc.shmget(0x62706970, 4096, 0o1000 | 0o600)  # IPC_CREAT: a System V segment outlives its process
print('shm', segment >= 0)
queue = ctypes.CDLL('librt.so.1', use_errno=True).mq_open(f'/{{marker}}'.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
print('mqueue', queue >= 0)
"""

FIND_LEFTOVERS = """
import ctypes, os
print('shm', ctypes.CDLL(None).shmget(0x62706970, 0, 0) >= 0)
print('mqueue', ctypes.CDLL('librt.so.1').mq_open(b'/{marker}', os.O_RDONLY) >= 0)
"""


@pytest.mark.skipif(not ROOT, reason="what the code leaves is found by its uid")
def test_nothing_an_execution_leaves_in_shared_places_survives_it(make_sandbox):
    """Files in the system's temporary directories and shared memory, System V and POSIX IPC objects:
    gone before the slot runs code again."""
    marker = f"sandbox-leftover-{os.getpid()}-{time.monotonic_ns()}"
    one_slot = make_sandbox(slots=1)
    first = one_slot.run(TEMPORARY_LEFTOVERS.format(marker=marker))
    assert first.ok, first
    for directory in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        assert not os.path.lexists(f"{directory}/{marker}"), directory
    assert not os.path.lexists(f"/tmp/{marker}-tree")
    second = one_slot.run(FIND_LEFTOVERS.format(marker=marker))
    assert second.output == "shm False\nmqueue False\n", (first, second)


ALLOCATE_IN_THREE_CHILDREN = """
import os, time
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (500 * 2**20)  # written, so resident: each child well under the 1 GiB limit
        time.sleep(2)
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print('all three held 500 MB' if statuses == [0, 0, 0] else f'children ended with {statuses}')
"""


@pytest.mark.skipif(not ROOT, reason="the total is counted per slot uid or cgroup")
def test_the_memory_limit_holds_for_all_processes_together(make_sandbox):
    limited = make_sandbox(SandboxLimits(timeout_s=20, memory_bytes=2**30), slots=1)
    result = limited.run(ALLOCATE_IN_THREE_CHILDREN)
    assert "all three held" not in result.output, (result, limited.isolation)
    assert result.error.startswith("MemoryError"), result
    assert not result.timed_out
    assert "together" in limited.isolation.memory
    assert limited.run("print(len(b'x' * (500 * 2**20)))").output == f"{500 * 2**20}\n"  # one alone is fine


def run_python(script: str, *, as_: list[str], python: str = sys.executable) -> subprocess.CompletedProcess:
    """`script` in a new Python under setpriv (a reduced capability set or another uid), from the repo."""
    return subprocess.run(
        ["setpriv", *as_, python, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )


# As a pod with `capabilities: {drop: [ALL], add: [...]}` and `allowPrivilegeEscalation: false` runs its process.
POD = [f"--bounding-set=-all,{','.join('+' + cap for cap in POD_CAPABILITIES)}", "--inh-caps=-all", "--no-new-privs"]


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="runs a root process with a reduced capability set")
def test_with_only_the_pod_capabilities_the_sandbox_holds():
    """Root with CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETUID, SETGID only, as tool_config shard pods run, where
    the operator allowed the network: no namespaces there, yet the code runs as its slot uid, within its
    limits, and leaves nothing."""
    shared = shared_directory()
    try:
        secret = shared / "secret"
        secret.write_text("root's secret")
        secret.chmod(0o600)
        marker = f"sandbox-pod-{os.getpid()}-{time.monotonic_ns()}"
        script = f"""
import json, os
from batch_pipeline.worker.sandbox import Sandbox, SandboxLimits
from tests.worker.test_sandbox import ALLOCATE_IN_THREE_CHILDREN, DETACHED, NETWORK_ALLOWED, TEMPORARY_LEFTOVERS
sandbox = Sandbox(SandboxLimits(timeout_s=20, memory_bytes=2**30), slots=1, settings=NETWORK_ALLOWED)
runs = [sandbox.run(code) for code in (
    "import os; print(os.getuid())",
    "print(open({str(secret)!r}).read())",
    TEMPORARY_LEFTOVERS.format(marker={marker!r}),
    DETACHED.format(marker={marker!r}),
    "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
    ALLOCATE_IN_THREE_CHILDREN,
)]
print(json.dumps({{"isolation": sandbox.isolation.to_dict(), "runs": [[r.output, r.error] for r in runs]}}))
"""
        done = run_python(script, as_=POD)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout.splitlines()[-1])
        uid, secret_read, leftovers, detached, fork_bomb, memory = report["runs"]
        assert int(uid[0]) in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UIDS) and uid[1] is None
        assert "PermissionError" in secret_read[1]
        assert leftovers[1] is None, leftovers
        assert not any(os.path.lexists(f"{d}/{marker}") for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"))
        assert detached == ["parent exits\n", None] and not processes_named(marker)
        assert "TimeoutError" in fork_bomb[1]
        assert memory[1].startswith("MemoryError") and "all three held" not in memory[0], memory
        assert report["isolation"]["user"].startswith(f"uids {SANDBOX_UID_BASE}-")
        assert report["isolation"]["network"].startswith("NOT isolated")  # unshare needs CAP_SYS_ADMIN
    finally:
        subprocess.run(["rm", "-rf", str(shared)], check=True)


REFUSES = """
import sys
try:
    sandbox = Sandbox()
except SandboxUnavailable as exc:
    print('refused:', exc)
    sys.exit(0)
print('ran as', sandbox.run('import os; print(os.getuid())').output, sandbox.isolation)
"""


@pytest.mark.skipif(not ROOT, reason="needs root to take the capability away or to become another user")
@pytest.mark.parametrize("worker", ["root without CAP_SETUID", "not root"])
def test_where_no_uid_switch_is_possible_the_sandbox_refuses_to_run_code(worker):
    if worker == "not root":  # the system's Python, and the sandbox module alone: nobody cannot read the venv
        script = (
            "import importlib.util, sys\nspec = importlib.util.spec_from_file_location('sandbox', "
            f"{str(REPO / 'batch_pipeline/worker/sandbox.py')!r})\nmodule = importlib.util.module_from_spec(spec)\n"
            "sys.modules['sandbox'] = module\nspec.loader.exec_module(module)\n"
            "Sandbox, SandboxUnavailable = module.Sandbox, getattr(module, 'SandboxUnavailable', ())\n" + REFUSES
        )
        done = run_python(script, as_=["--reuid=65534", "--regid=65534", "--clear-groups"], python="/usr/bin/python3")
    else:
        script = "from batch_pipeline.worker.sandbox import Sandbox, SandboxUnavailable\n" + REFUSES
        done = run_python(script, as_=["--bounding-set=-setuid,-setgid"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: tool_config"), done.stdout
    assert "uid" in done.stdout


REACH_LOOPBACK = """
import sys
from batch_pipeline.worker.sandbox import Sandbox, SandboxLimits, SandboxSettings, SandboxUnavailable
try:
    sandbox = Sandbox(SandboxLimits(timeout_s=20), slots=1, settings=SandboxSettings(allow_network={allowed}))
except SandboxUnavailable as exc:
    print('refused:', exc)
    sys.exit(0)
result = sandbox.run("import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\\nprint('connected')")
print('ran:', result.output, result.error, sandbox.isolation.network)
"""


@pytest.mark.skipif(not ROOT, reason="runs a root process with the pod's capability set")
def test_without_a_network_namespace_the_sandbox_refuses_unless_the_operator_allowed_it():
    """A worker without CAP_SYS_ADMIN (Docker's default, a Kubernetes pod): the kernel really refuses
    `unshare`, and code that ran anyway reached a service on the worker's loopback (the Dagster UI's
    place). Without the operator's opt-in the sandbox runs nothing; with it, the code does reach it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        refused = run_python(REACH_LOOPBACK.format(allowed=False, port=port), as_=POD)
        assert refused.returncode == 0, refused.stderr
        assert refused.stdout.startswith("refused: tool_config"), refused.stdout
        assert "network namespace" in refused.stdout and "BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK=1" in refused.stdout
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected
        allowed = run_python(REACH_LOOPBACK.format(allowed=True, port=port), as_=POD)
        assert allowed.stdout.startswith("ran: connected"), (allowed.stdout, allowed.stderr)
        assert "NOT isolated" in allowed.stdout
    finally:
        listener.close()


def run_worker(task_path: Path, as_: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", *as_, sys.executable, "-m", "batch_pipeline.worker", "--task", str(task_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=env,
    )


@pytest.mark.slow  # the shard worker's own process, under capsh, for each case
@pytest.mark.skipif(not ROOT, reason="needs root to take the capabilities away")
@pytest.mark.parametrize(
    ("worker", "capabilities", "why"),
    [
        ("root without CAP_SETUID", ["--bounding-set=-setuid,-setgid"], "cannot switch to an unprivileged uid"),
        ("a pod without CAP_SYS_ADMIN", POD, "no network namespace"),
    ],
)
def test_where_the_sandbox_cannot_hold_each_tool_config_request_says_why(tmp_path, worker, capabilities, why):
    """The worker itself, with the kernel's real refusal: no engine starts (the model does not exist, so
    one would fail the shard), each request gets an error entry naming tool_config and what the operator
    can do, the shard's stats say so, and its checkpoint is private (0600)."""
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.protocol import ShardTask
    from batch_pipeline.shards.records import work_items

    (shard,) = write_shards(
        work_items([("content", {"prompts": ["x", "y"], "max_new_tokens": 4, "temperature": 0.0})]),
        1,
        str(tmp_path / "job"),
    )
    task = ShardTask(shard=shard, model_config={"model": "no-such-model"}, tool_config={"name": "code_evaluator"})
    (tmp_path / "task.json").write_text(json.dumps(task.to_dict()))
    environment = {k: v for k, v in os.environ.items() if k != "BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK"}
    done = run_worker(tmp_path / "task.json", capabilities, environment)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.splitlines()[-1])
    assert stats["errors"] == 2 and why in stats["sandbox"]["refused"]
    entries = [json.loads(line.split("\t", 1)[1]) for line in Path(shard.output_path).read_text().splitlines()]
    assert len(entries) == 2
    for entry in entries:
        error = entry["error"]
        assert (error["param"], error["code"]) == ("tool_config", "tool_unavailable")
        assert error["message"].startswith("tool_config: ") and why in error["message"], error
        assert "submit the job without tool_config" in error["message"]
    assert Path(shard.results_path).stat().st_mode & 0o777 == 0o600
    if worker.startswith("a pod"):
        # The operator's opt-in, read by the worker's entry point: the sandbox holds, the engine is built
        # (and fails: there is no such model).
        (tmp_path / "job").rename(tmp_path / "first")
        (shard,) = write_shards(
            work_items([("content", {"prompts": ["x"], "max_new_tokens": 4, "temperature": 0.0})]),
            1,
            str(tmp_path / "job"),
        )
        opted_in = {**environment, "BATCH_PIPELINE_SANDBOX_ALLOW_NETWORK": "1", "HF_HUB_OFFLINE": "1"}
        done = run_worker(tmp_path / "task.json", capabilities, opted_in)
        assert done.returncode != 0
        assert "in build_llm" in done.stderr and "sandbox refuses" not in done.stderr, done.stderr[-3000:]


def test_a_jobs_files_are_private(tmp_path):
    """A job's work dir and shard dirs are 0700 and its shard inputs 0600, even under a directory others
    may enter: neither the sandbox's uids nor other local users can read another job's prompts."""
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.records import work_items

    base = shared_directory()
    try:
        work_dir = base / "job-1"
        (shard,) = write_shards(
            work_items([("content", {"prompts": ["secret prompt"], "max_new_tokens": 4, "temperature": 0.0})]),
            1,
            str(work_dir),
        )
        for directory in (work_dir, work_dir / "shards", Path(shard.directory)):
            assert directory.stat().st_mode & 0o777 == 0o700, directory
        assert Path(shard.input_path).stat().st_mode & 0o777 == 0o600
        if ROOT:
            # in whichever mode the module's sandboxes are (the bare one's patch may still be in force)
            sandbox = Sandbox(SandboxLimits(timeout_s=5), slots=1, settings=NETWORK_ALLOWED)
            result = sandbox.run(f"print(open({shard.input_path!r}).read())")
            assert "secret prompt" not in result.output and "PermissionError" in result.error
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


TWO_WORKERS = """
import sys, time
from batch_pipeline.worker.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(timeout_s=20), slots=1)
time.sleep(float(sys.argv[1]))
result = sandbox.run(sys.argv[2])
print(repr((result.output, result.error)))
"""


@needs_root
def test_executions_of_two_workers_on_one_machine_never_share_a_uid():
    """Each execution ends by killing every process of its uid and removing that uid's files: two workers
    (shards side by side) that both ran their first slot as the same uid killed each other's code."""
    slow = subprocess.Popen(
        [sys.executable, "-c", TWO_WORKERS, "0", "import os, time\ntime.sleep(3)\nprint('slept', os.getuid())"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    quick = subprocess.run(
        [sys.executable, "-c", TWO_WORKERS, "1", "import os\nprint('quick', os.getuid())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    slow_out, slow_err = slow.communicate(timeout=120)
    slow_output, slow_error = ast.literal_eval(slow_out.splitlines()[-1])
    quick_output, quick_error = ast.literal_eval(quick.stdout.splitlines()[-1])
    assert slow_error is None and slow_output.startswith("slept "), (slow_out, slow_err)
    assert quick_error is None and quick_output.startswith("quick "), quick.stdout
    assert slow_output.split()[1] != quick_output.split()[1]  # each ran as a uid of its own
