"""Webhook delivery latency: from a job's end to its signed webhook at the team's receiver, through `serve`.

    .venv/bin/python bench/webhooks.py [--events 40] [--burst 40] [--out PATH]

The whole deployment (`python -m batch_pipeline.entrypoints.serve`: API, Dagster webserver and daemon, the
webhook process) in a fresh DAGSTER_HOME, one team whose endpoint is a local receiver verifying each
delivery with the `standardwebhooks` library. A job's end is the cheapest real one: an OpenAI batch whose
input does not validate is stored ended (`batch.failed`), no run, no engine. Its end is the event's
`created_at` (written in the transaction that ends the job, read from GET .../webhooks); its arrival is the
receiver's clock (the same machine).
- sequential: `--events` batches, one at a time, each after the last one's webhook arrived;
- burst: `--burst` batches created back to back (the API's pace), then every webhook awaited.
Baseline in the same run: the bench's own signed POST of the same payload to the same receiver (the HTTP
and verification cost alone), so that what the outbox adds (the delivery loop's poll, the claim, the
store's writes) reads as the difference. p50 and p99 (and max) of each. Writes bench/results/webhooks-<time>.json.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from control_plane import clean_environment, machine, write_dagster_yaml
from served import start_serve, stop_serve
from standardwebhooks.webhooks import Webhook

from batch_pipeline.webhooks.delivery import signed_headers

REPO = Path(__file__).resolve().parents[1]

RESULTS = Path(__file__).parent / "results"
KEY = "bench-webhooks-key"
SECRET = "whsec_" + base64.b64encode(b"the bench's webhook secret").decode()
MODEL = "smollm2-135m-instruct"


class Receiver:
    def __init__(self) -> None:
        verifier = Webhook(SECRET)
        self.arrivals: dict[str, float] = {}  # webhook-id -> arrival (epoch seconds)
        self.rejected = 0
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                now = time.time()
                headers = {name.lower(): value for name, value in self.headers.items()}
                try:
                    verifier.verify(body, headers)
                except Exception:
                    receiver.rejected += 1
                    self.send_response(400)
                else:
                    with receiver.arrived:
                        receiver.arrivals.setdefault(headers["webhook-id"], now)
                        receiver.arrived.notify_all()
                    self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while len(self.arrivals) < count:
                if not self.arrived.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise SystemExit(f"{len(self.arrivals)} of {count} webhooks arrived in {timeout_s} s")


def invalid_batch(api: httpx.Client) -> str:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 9},
    }
    headers = {"authorization": f"Bearer {KEY}"}
    uploaded = api.post(
        "/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", (json.dumps(line) + "\n").encode(), "application/jsonl")},
    )
    uploaded.raise_for_status()
    body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = api.post("/v1/batches", headers=headers, json=body)
    created.raise_for_status()
    assert created.json()["status"] == "failed", created.text
    return created.json()["id"]


def latencies(api: httpx.Client, receiver: Receiver, batch_ids: list[str]) -> list[float]:
    """Seconds from each batch's end (its event's created_at) to its webhook's arrival."""
    out = []
    for batch_id in batch_ids:
        events = api.get(f"/v2/batch-completions/{batch_id}/webhooks", headers={"x-api-key": KEY}).json()["events"]
        [event] = events
        ended = datetime.fromisoformat(event["created_at"]).timestamp()
        out.append(receiver.arrivals[event["id"]] - ended)
    return out


def baseline(receiver: Receiver, count: int) -> list[float]:
    """The bench's own signed POSTs of an event's payload to the receiver: HTTP and verification alone."""
    signer = Webhook(SECRET)
    out = []
    with httpx.Client(timeout=10) as client:
        for index in range(count):
            event_id = f"evt_baseline_{index}"
            payload = json.dumps({"id": event_id, "object": "event", "type": "batch.failed", "data": {"id": "x"}})
            start = time.time()
            response = client.post(
                receiver.url, content=payload, headers=signed_headers(signer, event_id, payload, datetime.now(UTC))
            )
            assert response.status_code == 204, response.status_code
            out.append(receiver.arrivals[event_id] - start)
    return out


def summary(values: list[float]) -> dict:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "n": len(values),
        "p50_s": round(statistics.median(ordered), 4),
        "p99_s": round(pick(0.99), 4),
        "max_s": round(ordered[-1], 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--burst", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    receiver = Receiver()
    with tempfile.TemporaryDirectory(prefix="bench-webhooks-") as tmp:
        home = Path(tmp) / "dagster_home"
        home.mkdir()
        write_dagster_yaml(str(home), run_slots=1)
        root = Path(tmp) / "team"
        root.mkdir()
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(
            "tenants:\n  bench:\n"
            f"    api_keys_sha256: [{hashlib.sha256(KEY.encode()).hexdigest()}]\n"
            f"    data_roots: [{root}]\n"
            f"    webhooks: [{{url: '{receiver.url}', secret_env: BENCH_WEBHOOK_SECRET}}]\n"
        )
        env = clean_environment(
            str(home),
            BATCH_PIPELINE_TENANTS=str(tenants),
            BENCH_WEBHOOK_SECRET=SECRET,
            BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS="127.0.0.0/8",  # the receiver is on loopback
            BATCH_PIPELINE_SENSOR_INTERVAL_S="1",
        )
        serve, api = start_serve(home, env, REPO)
        try:
            invalid_batch(api)  # warm: the first upload and check import what they need
            receiver.wait_for(1)
            sequential = []
            for index in range(args.events):
                sequential.append(invalid_batch(api))
                receiver.wait_for(2 + index)
            burst = [invalid_batch(api) for _ in range(args.burst)]
            receiver.wait_for(1 + args.events + args.burst)
            results = {
                "benchmark": "webhooks",
                "time": datetime.now(UTC).isoformat(),
                "machine": machine(),
                "poll_interval_s": 0.5,
                "sequential": summary(latencies(api, receiver, sequential)),
                "burst": summary(latencies(api, receiver, burst)),
                "baseline_direct_post": summary(baseline(receiver, args.events)),
                "rejected_signatures": receiver.rejected,
            }
        finally:
            api.close()
            stop_serve(serve)
    print(json.dumps(results, indent=2))
    out = args.out or RESULTS / f"webhooks-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
