"""Team B's request latency while team A floods the API with large bodies, this checkout vs. an earlier one.

python bench/api_flood.py [--before PATH] [--flood 48] [--body-mb 8.6] [--timeout-s 10] [--out PATH]

Each system is the API as `serve` runs it (the checkout's own `api_command`, else plain uvicorn), in a fresh
process and DAGSTER_HOME, on 127.0.0.1 only, with two API keys: two teams. Team A sends `--flood` valid
requests of `--body-mb` MiB at once; team B meanwhile sends GET, LIST and a small POST in turn, then the
same for `--after-rounds` rounds once A's flood is answered (the hang this measures outlived the flood).
Every request has a timeout (`--timeout-s` for B, `--flood-timeout-s` for A): a request not answered in it
counts as timed out, and its latency as the timeout (so a p99 of a system that hangs is a lower bound).
`--before` is another checkout (a `git worktree` of the commit before the change); without it, only this
checkout is measured. The ratios are after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
from control_plane import clean_environment, machine, percentile
from served import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
TEAM_A, TEAM_B = "bench-key-team-a", "bench-key-team-b"
MODEL = "smollm2-135m-instruct"  # the catalog's, named only: nothing runs (no daemon); no hub is read to check it
# Team B stops sending during the flood after this long, whatever A's requests are doing.
MOST_DURING_S = 120.0


def api_command(code_root: Path, port: int) -> list[str]:
    """The checkout's own command line for its API, where it has one (`serve.api_command`)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from batch_pipeline.entrypoints.serve import api_command; "
            f"print(json.dumps(api_command('127.0.0.1', {port})))",
        ],
        cwd=code_root,
        env={**os.environ, "PYTHONPATH": str(code_root)},
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        return json.loads(probe.stdout)
    uvicorn = str(Path(sys.executable).parent / "uvicorn")
    return [uvicorn, "--factory", "batch_pipeline.api.app:create_app", "--host", "127.0.0.1", "--port", str(port)]


def body(output: str, prompts: int, chars: int) -> dict:
    return {
        "output_data_path": output,
        "model_config": {"model": MODEL},
        "content": {"prompts": ["x" * chars] * prompts, "max_new_tokens": 1, "temperature": 0.0},
    }


def timed(call, timeout_s: float) -> tuple[float, str]:
    started = time.monotonic()
    try:
        status = str(call().status_code)
    except httpx.TimeoutException:
        return timeout_s, "timed out"
    except httpx.TransportError as exc:
        return time.monotonic() - started, type(exc).__name__
    return time.monotonic() - started, status


def team_b_round(client: httpx.Client, job_id: str, small: dict, timeout_s: float) -> list[tuple[str, float, str]]:
    calls = {
        "GET": lambda: client.get(f"/v2/batch-completions/{job_id}"),
        "LIST": lambda: client.get("/v2/batch-completions", params={"limit": 5}),
        "POST": lambda: client.post("/v2/batch-completions", json=small),
    }
    return [(name, *timed(call, timeout_s)) for name, call in calls.items()]


def latency(samples: list[tuple[str, float, str]]) -> dict:
    seconds = [s for _, s, _ in samples]
    if not seconds:
        return {"samples": 0}
    statuses: dict[str, int] = {}
    for _, _, status in samples:
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "samples": len(seconds),
        "p50_s": round(percentile(seconds, 0.5), 3),
        "p99_s": round(percentile(seconds, 0.99), 3),
        "max_s": round(max(seconds), 3),
        "statuses": statuses,
    }


def measure(system: str, code_root: Path, options: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-api-flood-{system}-") as home:
        Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        port = free_port()
        log = Path(home, "api.log")
        env = clean_environment(
            home,
            BATCH_PIPELINE_JOBS_DB=f"sqlite:///{home}/jobs.db",
            BATCH_PIPELINE_API_KEYS=f"{TEAM_A},{TEAM_B}",
            PYTHONPATH=str(code_root),
        )
        server = subprocess.Popen(
            api_command(code_root, port), cwd=code_root, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
        )
        try:
            return flood(server, log, f"http://127.0.0.1:{port}", home, options, system)
        finally:
            server.kill()  # a hung one never answers a polite stop
            server.wait()


def flood(server: subprocess.Popen, log: Path, url: str, home: str, options: argparse.Namespace, system: str) -> dict:
    output = str(Path(home, "out", "output.json"))
    large = json.dumps(body(output, int(options.body_mb * 2**20 / 1000), 1000)).encode()
    small = body(output, 1, 5)
    timeout_b = options.timeout_s
    with (
        httpx.Client(base_url=url, headers={"x-api-key": TEAM_B}, timeout=timeout_b) as team_b,
        httpx.Client(
            base_url=url,
            headers={"x-api-key": TEAM_A, "content-type": "application/json"},
            timeout=options.flood_timeout_s,
            limits=httpx.Limits(max_connections=options.flood),
        ) as team_a,
    ):
        wait_until_healthy(team_b, server, log, system)
        job_id = team_b.post("/v2/batch-completions", json=small).json()["job_id"]

        def rounds() -> list[tuple[str, float, str]]:
            return [
                sample for _ in range(options.after_rounds) for sample in team_b_round(team_b, job_id, small, timeout_b)
            ]

        idle = rounds()

        def flood_one(_: int) -> tuple[float, str]:
            return timed(lambda: team_a.post("/v2/batch-completions", content=large), options.flood_timeout_s)

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=options.flood) as pool:
            sent = [pool.submit(flood_one, i) for i in range(options.flood)]
            during: list[tuple[str, float, str]] = []
            while not all(f.done() for f in sent) and time.monotonic() - started < MOST_DURING_S:
                during += team_b_round(team_b, job_id, small, timeout_b)
            answers = [f.result() for f in sent]
        flood_s = time.monotonic() - started
        after = rounds()
        healthz = timed(lambda: team_b.get("/healthz"), timeout_b)
    statuses: dict[str, int] = {}
    for _, status in answers:
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "team_b_idle": latency(idle),
        "team_b_during": latency(during),
        "team_b_after": latency(after),
        "team_a": {"statuses": statuses, "max_s": round(max(s for s, _ in answers), 3), "flood_s": round(flood_s, 2)},
        "healthz_after": healthz[1],
    }


def ratios(after: dict, before: dict) -> dict:
    found = {}
    for phase in ("team_b_idle", "team_b_during", "team_b_after"):
        for figure in ("p50_s", "p99_s"):
            if before[phase].get(figure) and after[phase].get(figure) is not None:
                found[f"{phase} {figure}"] = round(after[phase][figure] / before[phase][figure], 3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="an earlier checkout (git worktree) to measure too")
    parser.add_argument("--flood", type=int, default=48, help="team A's large bodies at once")
    parser.add_argument("--body-mb", type=float, default=8.6, help="each of A's bodies, in MiB")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="team B's timeout per request")
    parser.add_argument("--flood-timeout-s", type=float, default=60.0, help="team A's timeout per request")
    parser.add_argument("--after-rounds", type=int, default=3, help="B's rounds before and after the flood")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "api_flood.json")
    options = parser.parse_args()
    systems = {"after": REPO} | ({"before": options.before.resolve()} if options.before else {})
    result: dict = {"machine": machine(), "at": datetime.now(UTC).isoformat(), "options": {}}
    result["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()}
    for system, code_root in systems.items():
        result[system] = measure(system, code_root, options)
        print(system, json.dumps(result[system]), flush=True)
    if "before" in result:
        result["ratios_after_over_before"] = ratios(result["after"], result["before"])
        print("ratios", json.dumps(result["ratios_after_over_before"]))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
