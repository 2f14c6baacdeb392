"""TEST DOUBLE: a stand-in for the Kubernetes API server and kubelet, the one part of production that
cannot run here.

It serves the pod endpoints dagster-k8s's Pipes client and the launcher call (create, list by name or by
equality-based label selector, read the log stream, delete) over real HTTP, and "runs" each pod by starting
its container's command as a local process with the pod's environment: so the real shard worker runs, and
its Pipes messages reach Dagster through the log stream exactly as from a pod. Deleting a running pod, as
on a cluster, marks it terminating, sends its process SIGTERM (SIGKILL after the grace period) and removes
the pod once the process is gone. Nothing of ours is replaced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse
from urllib.request import Request, urlopen


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# A pod's terminationGracePeriodSeconds when its spec names none, as in Kubernetes.
DEFAULT_GRACE_S = 30


def matches(selector: str, labels: dict) -> bool:
    """Equality-based label selector (`k=v,k2==v2`); any other operator is refused, not ignored."""
    for requirement in filter(None, selector.split(",")):
        key, op, value = requirement.partition("==") if "==" in requirement else requirement.partition("=")
        if not op or "!" in key:
            raise ValueError(f"unsupported label selector requirement {requirement!r}")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class StandInPod:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.name = body["metadata"]["name"]
        self.labels = body["metadata"].get("labels") or {}
        (container,) = body["spec"]["containers"]
        self.container = container
        command = [sys.executable if part == "python" else part for part in container["command"]]
        env = {**os.environ, **{item["name"]: item.get("value", "") for item in container.get("env", [])}}
        self.started_at = _now()
        self.lines: list[tuple[str, str]] = []
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.finished_at: str | None = None
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for raw in self.process.stdout:
            self.lines.append((_now(), raw.decode("utf-8", "replace").rstrip("\n")))
        self.process.wait()
        self.finished_at = _now()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def as_json(self) -> dict:
        if self.done:
            code = self.process.returncode
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": self.started_at,
                    "finishedAt": self.finished_at,
                }
            }
            phase = "Succeeded" if code == 0 else "Failed"
        else:
            state, phase = {"running": {"startedAt": self.started_at}}, "Running"
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": self.container["name"],
                    "ready": not self.done,
                    "restartCount": 0,
                    "state": state,
                    "image": self.container.get("image", ""),
                    "imageID": "",
                }
            ],
        }
        return {"apiVersion": "v1", "kind": "Pod", **self.body, "status": status}


class StandInKubernetes:
    """Serve on a free local port; `kubeconfig` is a file pointing a client at it."""

    def __init__(self, directory: Path) -> None:
        self.pods: dict[str, StandInPod] = {}
        self.created: list[dict] = []
        # ("created" | "deleting" | "gone", pod name), in order: what happened to which pod when
        self.events: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a streamed log ends when the connection closes

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.created.append(body)
                pod = stand_in.pods[body["metadata"]["name"]] = StandInPod(body)
                stand_in.events.append(("created", pod.name))
                self._json(201, pod.as_json())

            def do_DELETE(self) -> None:
                pod = stand_in.pods.get(urlparse(self.path).path.rsplit("/", 1)[-1])
                if pod is None:
                    self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
                    return
                if "deletionTimestamp" not in pod.body["metadata"]:
                    pod.body["metadata"]["deletionTimestamp"] = _now()
                    stand_in.events.append(("deleting", pod.name))
                    if pod.done:  # nothing to wait for: gone at once
                        stand_in._terminate(pod)
                    else:
                        threading.Thread(target=stand_in._terminate, args=(pod,), daemon=True).start()
                self._json(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {key: values[-1] for key, values in parse_qs(url.query).items()}
                parts = url.path.strip("/").split("/")  # api v1 namespaces NS pods [NAME [log]]
                if parts[-1] == "pods":
                    wanted = query.get("fieldSelector", "").removeprefix("metadata.name=")
                    try:
                        items = [
                            pod.as_json()
                            for name, pod in list(stand_in.pods.items())
                            if (not wanted or name == wanted) and matches(query.get("labelSelector", ""), pod.labels)
                        ]
                    except ValueError as exc:
                        self._json(
                            400,
                            {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "code": 400,
                                "message": str(exc),
                            },
                        )
                        return
                    self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
                elif parts[-1] == "log":
                    self._stream_log(stand_in.pods.get(parts[-2]), query)
                else:
                    pod = stand_in.pods.get(parts[-1])
                    if pod is None:
                        self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
                    else:
                        self._json(200, pod.as_json())

            def _stream_log(self, pod: StandInPod | None, query: dict) -> None:
                if pod is None:
                    self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                timestamps = query.get("timestamps", "").lower() == "true"
                follow = query.get("follow", "").lower() == "true"
                sent = 0
                if "tailLines" in query:
                    sent = max(0, len(pod.lines) - int(query["tailLines"]))
                while True:
                    finished = pod.done
                    for stamp, line in pod.lines[sent:]:
                        self.wfile.write(((f"{stamp} " if timestamps else "") + line + "\n").encode())
                        sent += 1
                    self.wfile.flush()
                    if not follow or (finished and sent >= len(pod.lines)):
                        return
                    time.sleep(0.1)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "stand-in",
                    "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                    "users": [{"name": "stand-in", "user": {"token": "stand-in"}}],
                    "contexts": [
                        {
                            "name": "stand-in",
                            "context": {"cluster": "stand-in", "user": "stand-in", "namespace": "batch"},
                        }
                    ],
                }
            )
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _terminate(self, pod: StandInPod) -> None:
        """What the kubelet does with a deleted pod: SIGTERM, SIGKILL after the grace period, then gone."""
        if not pod.done:
            pod.process.send_signal(signal.SIGTERM)
            try:
                pod.process.wait(timeout=pod.body["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait()
        self.pods.pop(pod.name, None)
        self.events.append(("gone", pod.name))

    def create_pod(self, body: dict) -> dict:
        """POST a pod through the HTTP API, as any client would; the pod as the server answered."""
        request = Request(
            f"{self.url}/api/v1/namespaces/batch/pods",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urlopen(request) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        for pod in list(self.pods.values()):
            if not pod.done:
                pod.process.kill()
        self.server.shutdown()
