"""The code_evaluator sandbox against hostile code, run directly: each case contained, the calling
process unharmed, nothing left running, nothing of the host touched."""

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from batch_pipeline.worker.sandbox import Sandbox, SandboxLimits
from tests.conftest import sandbox_processes

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=3), slots=2)


def sandbox_dirs() -> set[str]:
    return {name for name in os.listdir("/tmp") if name.startswith(("batch-pipeline-sandbox-", "batch-pipeline-exec-"))}


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    before = sandbox_dirs()
    yield
    assert not sandbox_processes()
    assert sandbox_dirs() <= before


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


def test_a_fork_bomb_is_contained(sandbox):
    result = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2)
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
    result = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
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


def test_parallel_executions_use_every_slot():
    sandbox = Sandbox(SandboxLimits(timeout_s=10), slots=2)
    results: list = []
    started = time.monotonic()
    threads = [threading.Thread(target=lambda: results.append(sandbox.run("import time; time.sleep(1.5); print('ok')")))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.output for r in results] == ["ok\n"] * 4
    assert 3.0 <= time.monotonic() - started < 5.5  # two at a time: two rounds, not four, not one


def test_without_namespaces_the_uid_and_limits_still_contain(monkeypatch):
    # Some clusters refuse unshare: this forces that case here.
    monkeypatch.setattr(Sandbox, "_probe_namespaces", lambda self: False)
    sandbox = Sandbox(SandboxLimits(timeout_s=2), slots=1)
    assert sandbox.isolation.network.startswith("NOT isolated")
    assert sandbox.run("print(6 * 7)").output == "42\n"
    assert sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass").timed_out
    leftover = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('parent exits')"
    assert sandbox.run(leftover).output == "parent exits\n"
    if ROOT:
        assert not sandbox_processes()  # the detached child went with its uid
