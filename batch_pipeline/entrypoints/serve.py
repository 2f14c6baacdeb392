"""`make serve`: the API, the Dagster webserver, the Dagster daemon and the webhook delivery process,
stopped together on Ctrl-C.

python -m batch_pipeline.entrypoints.serve [--host 127.0.0.1] [--port 8000] [--dagster-port 3000]

The Dagster UI is for operators: it asks for an operator key (an admin key of the tenants file, or the key
made in $DAGSTER_HOME/operator.key) before it shows or does anything (batch_pipeline/entrypoints/dagster_ui.py).
It listens on loopback whatever `--host` says; reach it from elsewhere through an SSH tunnel.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from batch_pipeline.core.settings import ENV_PREFIX, Settings, SettingsError, settings
from batch_pipeline.entrypoints.dagster_ui import OPERATOR_KEY_FILE, operator_key
from batch_pipeline.pipeline.service_paths import secure_service_paths
from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError, tenants_at
from batch_pipeline.webhooks.delivery import WebhookSecretError, check_webhook_secrets

REPO = Path(__file__).resolve().parents[2]
# The Dagster UI's address: loopback only (see the module docstring).
DAGSTER_UI_HOST = "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batch_pipeline.entrypoints.serve", description=__doc__)
    try:  # before the three services start: one message naming the variable instead of three tracebacks
        configured = settings()
    except SettingsError as exc:
        parser.error(str(exc))
    parser.add_argument("--host", default=configured.host)
    parser.add_argument("--port", type=int, default=configured.port)
    parser.add_argument("--dagster-port", type=int, default=int(os.environ.get("DAGSTER_WEBSERVER_PORT", "3000")))
    parser.add_argument("--workspace", default=str(REPO / "workspace.yaml"))
    parser.add_argument(
        "--daemon-log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("DAGSTER_HOME", str(REPO / "dagster_home"))
    for host, port, option in (
        (args.host, args.port, "--port"),
        (DAGSTER_UI_HOST, args.dagster_port, "--dagster-port"),
    ):
        if not _can_listen(host, port):
            parser.error(f"port {port} on {host} is taken: pass {option} with a free port")
    try:
        secure_service_paths(configured)
        registry = tenants_at(configured.tenants)
        check_webhook_secrets(registry)  # a webhook's missing secret is named now, not when a job ends
    except (TenantsFileError, WebhookSecretError) as exc:
        parser.error(str(exc))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _create_storage(configured)
    pool_directory = _start_engine_pool(configured)
    operator_key(os.environ["DAGSTER_HOME"])  # made now, so that the line below can point at it
    bin_dir = Path(sys.executable).parent
    commands = {
        "api": api_command(args.host, args.port),
        "dagster-webserver": dagster_ui_command(args.workspace, args.dagster_port),
        # Warnings up: at info, each sensor's every skipped tick was half of the console; the UI keeps them.
        "dagster-daemon": [
            str(bin_dir / "dagster-daemon"),
            "run",
            "-w",
            args.workspace,
            "--log-level",
            args.daemon_log_level,
        ],
        # Webhook delivery in a process of its own: a receiver that is down or slow never holds a sensor
        # tick, a run or the API (batch_pipeline/webhooks/delivery.py).
        "webhooks": webhooks_command(),
    }
    environments = service_environments(dict(os.environ), registry)
    processes = {
        name: subprocess.Popen(command, start_new_session=True, env=environments[name])
        for name, command in commands.items()
    }
    key_file = Path(os.environ["DAGSTER_HOME"]) / OPERATOR_KEY_FILE
    print(
        f"API on http://{args.host}:{args.port}  Dagster UI on http://{DAGSTER_UI_HOST}:{args.dagster_port} "
        f"(operators: any user name, the password in {key_file} or an admin key)  "
        f"(DAGSTER_HOME={os.environ['DAGSTER_HOME']}); Ctrl-C stops all",
        flush=True,
    )

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    failed = False
    while not stopping:
        exited = [name for name, process in processes.items() if process.poll() is not None]
        if exited:
            # A service that stops by itself (a busy port, a bad workspace) fails the whole command.
            print(f"{', '.join(exited)} exited; stopping the rest", file=sys.stderr, flush=True)
            failed = True
            break
        time.sleep(0.5)
    _stop_all(processes)
    if pool_directory:  # its waiting workers see it gone and leave
        shutil.rmtree(pool_directory, ignore_errors=True)
    return 1 if failed else 0


def _start_engine_pool(configured: Settings) -> str:
    """The directory of this deployment's warm engine pool (launch/pool.py), named to the services that
    launch shards: one per start, so that no worker of an earlier start (another release's) is reused."""
    if configured.shard_launcher != "local" or configured.engine_pool_workers < 1:
        return ""
    from batch_pipeline.launch.pool import make_pool_directory

    directory = make_pool_directory()
    os.environ[ENV_PREFIX + "ENGINE_POOL_DIR"] = directory
    return directory


# Variables holding the API's keys: the API reads them, no other service.
API_KEY_VARIABLES = ("BATCH_PIPELINE_API_KEYS",)


def service_environments(environment: dict[str, str], registry: Tenants | None) -> dict[str, dict[str, str]]:
    """Each service's environment: webhook secrets (the tenants file's `secret_env` names) for the webhook
    process alone, the API's keys for the API alone. The Dagster processes run every team's jobs and start
    their workers; what they do not hold, no step or worker can leak."""
    webhook_secrets = {
        config.secret_env for team in (registry.teams.values() if registry else ()) for config in team.config.webhooks
    }

    def without(names: set[str] | tuple[str, ...]) -> dict[str, str]:
        return {name: value for name, value in environment.items() if name not in names}

    dagster = without(webhook_secrets | set(API_KEY_VARIABLES))
    return {
        "api": without(webhook_secrets),
        "dagster-webserver": dagster,
        "dagster-daemon": dagster,
        "webhooks": without(API_KEY_VARIABLES),
    }


def dagster_ui_command(workspace: str, port: int) -> list[str]:
    """The Dagster webserver, behind the operators' login, on loopback."""
    return [
        sys.executable,
        "-m",
        "batch_pipeline.entrypoints.dagster_ui",
        "-w",
        workspace,
        "--host",
        DAGSTER_UI_HOST,
        "--port",
        str(port),
    ]


def webhooks_command() -> list[str]:
    """The webhook delivery process's command line; k8s/webhooks.yaml's pod runs the same."""
    return [sys.executable, "-m", "batch_pipeline.webhooks"]


def api_command(host: str, port: int) -> list[str]:
    """The API's uvicorn command line. Its HTTP protocol is uvicorn's own plus a bound on the time a client
    takes to send a request's head (BATCH_PIPELINE_HEADER_TIMEOUT_S): uvicorn has none, and a client
    sending a header a minute would hold its connection for ever."""
    return [
        str(Path(sys.executable).parent / "uvicorn"),
        "--factory",
        "batch_pipeline.api.app:create_app",
        "--http",
        "batch_pipeline.api.limits:HTTPProtocolWithHeadTimeout",
        "--host",
        host,
        "--port",
        str(port),
    ]


def _can_listen(host: str, port: int) -> bool:
    """Whether a service could listen on host:port now: asked before any of them starts, so that a taken port
    is one line naming the option that moves it, not a service's traceback after the others have started."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError:
        return False
    return True


def _create_storage(configured: Settings) -> None:
    """Create the instance's and the job store's databases once, here: left to the three services, a new
    DAGSTER_HOME had them racing to create the same SQLite files, and one died of 'database is locked'."""
    import dagster as dg

    from batch_pipeline.store.jobs import JobStore

    dg.DagsterInstance.get().dispose()
    JobStore(configured.job_store_url).engine.dispose()


def _stop_all(processes: dict[str, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
