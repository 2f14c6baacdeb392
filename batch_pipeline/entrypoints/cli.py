"""`batch-pipeline`: submit batch jobs to the API and follow them, run one on this machine without a server,
and list the built-in models.

The API commands read the server's URL and key from --url / --api-key or BATCH_PIPELINE_URL /
BATCH_PIPELINE_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from batch_pipeline.core.process import exit_without_teardown
from batch_pipeline.core.settings import SettingsError, client_settings, settings

FINISHED = ("completed", "failed", "cancelled")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="batch-pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="the API's base URL (default $BATCH_PIPELINE_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="an API key (default $BATCH_PIPELINE_API_KEY)")
    commands = parser.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", help="submit a request file, or a prompts file with flags")
    dry_run = commands.add_parser(
        "dry-run", help="check and tokenize a request as `submit` would send it, and estimate it; create nothing"
    )
    for parser_of_request in (submit, dry_run):
        parser_of_request.add_argument(
            "request", type=Path, nargs="?", help="a v1 or v2 batch completions request (JSON)"
        )
        parser_of_request.add_argument(
            "--prompts", type=Path, help="a text file of prompts, one per line, instead of a request"
        )
        parser_of_request.add_argument("--model", help="with --prompts: model_config.model")
        parser_of_request.add_argument("--output", help="with --prompts: output_data_path (as the server sees it)")
        parser_of_request.add_argument("--max-new-tokens", type=int, default=64)
        parser_of_request.add_argument("--temperature", type=float, default=0.0)
        parser_of_request.add_argument("--data-parallelism", type=int, default=1)
        parser_of_request.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--api", choices=("v1", "v2"), default="v2", help="the route to submit to (default v2)")
    submit.add_argument("--idempotency-key", help="submitting again with the same key returns the same job")
    submit.add_argument("--wait", action="store_true", help="then follow the job as `wait` does")
    resume = commands.add_parser("resume", help="run a failed or cancelled job again on what it has not finished")
    resume.add_argument("job_id")
    resume.add_argument("--idempotency-key", help="resuming again with the same key returns the same resume")
    priority = commands.add_parser("priority", help="set a queued job's priority (lowest..highest, or -20..20)")
    priority.add_argument("job_id")
    priority.add_argument("priority")
    usage = commands.add_parser("usage", help="your team's usage per UTC day (an admin key: every team's)")
    usage.add_argument("--since", help="a date or RFC 3339 datetime (default: 30 UTC days back)")
    usage.add_argument("--until", help="a date or RFC 3339 datetime (default: now)")

    status = commands.add_parser("status", help="show a job")
    status.add_argument("job_id")
    status.add_argument("--json", action="store_true", help="the job object as the API returns it")
    listing = commands.add_parser("list", help="list jobs")
    listing.add_argument("--status", choices=("queued", "running", "completed", "failed", "cancelled"))
    listing.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    listing.add_argument("--limit", type=int, default=100, help="at most this many jobs, newest first (default 100)")
    listing.add_argument("--team", help="an admin key: that team's jobs alone (each job's owner is shown to admins)")
    cancel = commands.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    wait = commands.add_parser("wait", help="follow a job to its end with a progress bar")
    wait.add_argument("job_id")
    wait.add_argument("--timeout", type=float, help="give up after this many seconds")
    wait.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default 2)")

    run = commands.add_parser("run", help="run a request JSON file as a Dagster job on this machine, no server")
    run.add_argument("request", type=Path, help="a v1 or v2 batch completions request (JSON)")
    run.add_argument("--show", type=int, default=3, help="completions to print (default 3)")
    run.add_argument("--team", help="the team that owns the job (required where the deployment has a tenants file)")
    models = commands.add_parser("models", help="list the built-in model catalog")
    models.add_argument("--prepare", metavar="NAME", help="convert a catalog model into the cache now")
    args = parser.parse_args(argv)
    # `run` and `models` work as the service does, with its settings; the others are the API's clients.
    read_settings = settings if args.command in ("run", "models") else client_settings
    try:
        read_settings()
    except SettingsError as exc:
        parser.error(str(exc))
    if args.command == "models":
        return _prepare(args.prepare) if args.prepare else _models()
    if args.command == "run":
        if why := _no_dagster_home():
            parser.error(why)
        code = _run(args.request, args.show, args.team)
        if argv is None:  # the command line's own process: nothing runs after this
            from batch_pipeline.pipeline import step_server

            # The run's events and the job's row are committed, and the resource tracker exits as its pipe
            # closes; teardown took ~0.6-1.6 s after the last line (2 cores), and so did the step server's.
            step_server.kill()
            exit_without_teardown(code)
        return code
    from batch_pipeline.entrypoints.client import ApiError, BatchClient

    client = BatchClient(args.url, args.api_key)
    try:
        return API_COMMANDS[args.command](client, args, parser)
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()


def _submit(client, args, parser) -> int:
    request = _request_of(args, parser)
    if request is None:
        return 2
    job_id = client.create(request, api=args.api, idempotency_key=args.idempotency_key)["job_id"]
    print(job_id)
    if args.wait:
        return _follow(client, job_id, timeout=None, interval=2.0)
    return 0


def _dry_run(client, args, parser) -> int:
    request = _request_of(args, parser)
    if request is None:
        return 2
    answer = client.dry_run(request)
    print(
        f"{answer['num_requests']} requests, {answer['prompt_tokens']} prompt tokens, at most "
        f"{answer['max_output_tokens']} output tokens (context {answer['context_length']})"
    )
    for problem in answer["cannot_run"]:
        print(f"cannot run: request {problem['index']}: {problem['message']}")
    if answer["num_cut_at_context"]:
        print(f"{answer['num_cut_at_context']} requests stop at the context")
    if estimate := answer.get("estimate"):
        # an embeddings job reads its prompts; any other generates its output
        pooled = estimate.get("prompt_tokens_per_s")
        rate = f"{pooled} prompt tokens/s" if pooled else f"{estimate['completion_tokens_per_s']} tokens/s"
        print(
            f"estimate: {estimate['wall_s']:.0f} s wall on {estimate['workers']} workers: an engine start of "
            f"{estimate.get('engine_start_s', 0):.0f} s, then {rate} each (from {estimate['from_jobs']} jobs)"
        )
    else:
        print(answer.get("no_history") or "no estimate")
    return 1 if answer["num_cannot_run"] else 0


def _request_of(args, parser) -> dict | None:
    """The request a `submit` or `dry-run` sends: a request file, or one made of --prompts and its flags."""
    if (args.request is None) == (args.prompts is None):
        parser.error(f"{args.command}: give a request file or --prompts, not both")
    labels = _labels(args.label, parser)
    if args.prompts is not None:
        if not (args.model and args.output):
            parser.error(f"{args.command} --prompts: --model and --output are required")
        prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
        request: dict = {
            "output_data_path": args.output,
            "model_config": {"model": args.model},
            "data_parallelism": args.data_parallelism,
            "content": {"prompts": prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        }
    else:
        try:
            request = json.loads(args.request.read_text())
        except json.JSONDecodeError as exc:
            print(f"{args.request}: not JSON: line {exc.lineno} column {exc.colno}: {exc.msg}", file=sys.stderr)
            return None
    if labels:
        request["labels"] = {**request.get("labels", {}), **labels}
    return request


def _resume(client, args, parser) -> int:
    job = client.resume(args.job_id, args.idempotency_key)
    print(f"{job['job_id']} {job['status']} (resume {(job.get('metadata') or {}).get('resume_count', '?')})")
    return 0


def _priority(client, args, parser) -> int:
    job = client.set_priority(args.job_id, args.priority)
    read_as = (job.get("metadata") or {}).get("priority_read_as", args.priority)
    if job["success"]:
        print(f"{args.job_id} priority {read_as}")
        return 0
    print(f"{args.job_id}: its priority was not changed: it is {job['status']}, past queued", file=sys.stderr)
    return 1


def _usage(client, args, parser) -> int:
    report = client.usage(args.since, args.until)
    print(f"{'team':20} {'jobs':>6} {'requests':>9} {'prompt tok':>11} {'output tok':>11} {'gpu s':>9}  stored bytes")
    for team in report["teams"]:
        print(
            f"{team['team']:20} {team['jobs']:>6} {team['requests']:>9} {team['prompt_tokens']:>11} "
            f"{team['completion_tokens']:>11} {team['gpu_seconds']:>9.1f}  {team['stored_bytes_now']}"
        )
    print(f"from {report['since']} until {report['until']}", file=sys.stderr)
    return 0


def _status(client, args, parser) -> int:
    job = client.get(args.job_id)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    metadata = job.get("metadata") or {}
    print(f"{job['job_id']}  {job['status']}  model {job['model_config']['model']}  created {job['created_at']}")
    if "phase" in metadata:  # where a job that has not ended is: starting engine, generating n/N, ...
        print(f"phase: {metadata['phase']}")
    if "requests_total" in metadata:
        print(f"progress: {metadata['requests_done']}/{metadata['requests_total']} requests")
    if "num_requests" in metadata:
        print(
            f"results: {metadata['num_requests']} requests ({metadata.get('num_errors', 0)} errors), "
            f"{metadata.get('completion_tokens')} completion tokens, "
            f"{metadata.get('completion_tokens_per_s')} tokens/s per worker while generating"
        )
    if "failure_reason" in metadata:
        print(f"failure: {metadata['failure_reason']}")
    print(f"output: {job['output_data_path']}")
    return 0


def _list(client, args, parser) -> int:
    if args.limit < 1:
        parser.error("--limit must be at least 1")
    jobs = client.list(args.status, _labels(args.label, parser), args.limit, team=args.team)
    for job in jobs:
        metadata = job.get("metadata") or {}
        done = f"{metadata['requests_done']}/{metadata['requests_total']}" if "requests_total" in metadata else "-"
        owner = f" {metadata['owner']}" if "owner" in metadata else ""  # admin keys only
        print(
            f"{job['job_id']:40} {job['status']:10} {done:>13} {job['model_config']['model']:28} {job['created_at']}"
            f"{owner}"
        )
    if not jobs:
        print("no jobs", file=sys.stderr)
    return 0


def _cancel(client, args, parser) -> int:
    answer = client.cancel(args.job_id)
    if answer["success"]:
        print(f"{args.job_id} cancelled")
        return 0
    print(f"{args.job_id} was not cancelled: {answer.get('reason') or 'it had already finished'}", file=sys.stderr)
    return 1


def _wait(client, args, parser) -> int:
    return _follow(client, args.job_id, args.timeout, args.interval)


def _follow(client, job_id: str, timeout: float | None, interval: float) -> int:
    """Poll the job until it ends, drawing prompts done/total, tokens/s and the ETA."""
    import time

    from tqdm import tqdm

    started = time.monotonic()
    # No requests/s: the bar counts from where it first saw the job, and what was done before that (all of
    # it, for a job that had ended) would read as done in its first moment ("282 req/s").
    bar = tqdm(
        desc=job_id,
        unit="req",
        dynamic_ncols=True,
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
    )
    last_tokens, last_time = None, started
    seen = False
    try:
        while True:
            job = client.get(job_id)
            metadata = job.get("metadata") or {}
            if "requests_total" in metadata:
                bar.total = int(metadata["requests_total"])
                bar.n = int(metadata["requests_done"])
                if not seen:  # the ETA from the progress watched, not from what was done before
                    bar.initial, seen = bar.n, True
            now = time.monotonic()
            tokens = int(metadata.get("completion_tokens_generated", 0))
            postfix = {"status": metadata.get("phase", job["status"])}  # "starting engine", not just "running"
            if last_tokens is not None and now > last_time:
                postfix["tokens/s"] = f"{(tokens - last_tokens) / (now - last_time):.0f}"
            last_tokens, last_time = tokens, now
            bar.set_postfix(postfix, refresh=False)
            bar.refresh()
            if job["status"] in FINISHED:
                break
            if timeout is not None and now - started > timeout:
                print(f"\n{job_id} still {job['status']} after {timeout:.0f}s", file=sys.stderr)
                return 3
            time.sleep(interval)
    finally:
        bar.close()
    print(f"{job_id} {job['status']}")
    if "failure_reason" in metadata:
        print(f"failure: {metadata['failure_reason']}", file=sys.stderr)
    if "num_requests" in metadata:
        print(
            f"{metadata['num_requests']} requests ({metadata.get('num_errors', 0)} errors), "
            f"{metadata.get('completion_tokens')} completion tokens at {metadata.get('completion_tokens_per_s')}"
            f" tokens/s per worker while generating -> {job['output_data_path']}"
        )
    return 0 if job["status"] == "completed" else 1


def _labels(pairs: list[str], parser) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--label {pair!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


API_COMMANDS = {
    "submit": _submit,
    "dry-run": _dry_run,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "resume": _resume,
    "priority": _priority,
    "wait": _wait,
    "usage": _usage,
}


def _models() -> int:
    from batch_pipeline.models.catalog import CATALOG, cache_dir

    for entry in CATALOG.values():
        prepared = (cache_dir() / entry.name / "config.json").exists()
        print(f"{entry.name:28} {entry.description} ({'prepared' if prepared else 'not yet prepared'})")
    return 0


def _prepare(name: str) -> int:
    import time

    from batch_pipeline.models.catalog import CATALOG, prepare_catalog_model

    if name not in CATALOG:
        print(f"unknown catalog model {name!r}; known: {', '.join(CATALOG)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    path = prepare_catalog_model(CATALOG[name])
    print(f"{name}: {path} ({time.monotonic() - started:.1f}s)")
    return 0


def _no_dagster_home() -> str | None:
    """Why `run` has no Dagster instance to run in, or None: DAGSTER_HOME, else the checkout's dagster_home/
    (as `make run` and `serve` use), set for the rest of the command."""
    if os.environ.get("DAGSTER_HOME"):
        return None
    checkout = Path(__file__).resolve().parents[2] / "dagster_home"
    if (checkout / "dagster.yaml").is_file():
        os.environ["DAGSTER_HOME"] = str(checkout)
        return None
    return (
        "DAGSTER_HOME is not set: point it at a directory for the Dagster instance "
        "(`export DAGSTER_HOME=$PWD/dagster_home` in the repository, whose dagster.yaml `make run` uses)"
    )


def _run(path: Path, show: int, team: str | None = None) -> int:
    from batch_pipeline.launch.kinds import LAUNCHER_KINDS
    from batch_pipeline.launch.standby import StartedStandby

    # Before the standby worker and the step server: they keep this environment.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # A shard worker importing vLLM while the run starts, validates and plans, for a launcher that hands it the
    # shard (launch/standby.py); one that runs shards elsewhere (pods) would leave it idle.
    standby = None
    if LAUNCHER_KINDS[settings().shard_launcher].takes_standby:
        try:
            standby = StartedStandby.start()
        except OSError as exc:  # no temporary directory, no process: the shard's worker starts as it would have
            print(f"running without a worker started ahead: {exc}", file=sys.stderr)
    try:
        return _run_request(path, show, team)
    finally:
        if standby is not None:
            standby.stop()


def _run_request(path: Path, show: int, team: str | None = None) -> int:
    from batch_pipeline.pipeline import step_server

    step_server.start()  # its imports (~2 s) run beside this process's own instead of at the first step
    import dagster as dg

    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.contract.records import describe_validation_error
    from batch_pipeline.pipeline.execute import execute_request
    from batch_pipeline.pipeline.job import metadata_path

    try:
        request = CreateBatchCompletionsV2Request.model_validate_json(path.read_text())
    except ValidationError as exc:
        print(f"{path}: invalid request: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    request = _with_absolute_local_paths(request)
    instance = dg.DagsterInstance.get()
    result = execute_request(request, instance, log_level="INFO", team=team)
    if not result.success:
        failures = [event for event in result.all_events if event.is_step_failure]
        for event in failures:
            error = event.step_failure_data.error
            print(
                f"step {event.step_key} failed: {error.message.strip() if error else 'unknown error'}", file=sys.stderr
            )
        print(f"run {result.run_id} failed", file=sys.stderr)
        return 1
    with open(metadata_path(request.output_data_path)) as handle:
        metadata = json.load(handle)
    with open(request.output_data_path) as handle:
        outputs = json.load(handle)
    print(f"\nrun {result.run_id} succeeded")
    print(f"output:   {request.output_data_path}")
    print(f"metadata: {metadata_path(request.output_data_path)}")
    print(
        f"{metadata['num_requests']} requests ({metadata['num_errors']} errors) in {len(metadata['shards'])} "
        f"shard{'s' if len(metadata['shards']) != 1 else ''}, "
        f"{metadata['prompt_tokens']} prompt + {metadata['completion_tokens']} completion tokens, "
        f"{metadata['wall_s']:.1f}s wall, {metadata['completion_tokens_per_s']} completion tokens/s per worker "
        "while generating"
    )
    plan = metadata["data_parallelism"]
    if plan["reason"]:
        print(f"{plan['used']} of the {plan['requested']} shards asked: {plan['reason']}")
    if metadata["num_deduplicated"]:
        print(f"{metadata['num_deduplicated']} requests repeated an earlier deterministic one and share its output")
    if metadata["num_cut_from_longer"]:
        print(
            f"{metadata['num_cut_from_longer']} deterministic requests were answered by the same request's generation "
            "at a larger output limit"
        )
    for reason in sorted({shard["dtype_reason"] for shard in metadata["shards"] if shard.get("dtype_reason")}):
        print(f"computed in {metadata['dtype']}: {reason}")
    for index, output in enumerate(outputs[:show]):
        text = output.get("text") if "text" in output else json.dumps(output)
        print(f"[{index}] {text.strip()[:200]!r}")
    return 0


def _with_absolute_local_paths(request):
    """Relative paths in a request file mean relative to where the command runs, not to a step process."""
    from batch_pipeline.core import io

    updates = {
        field: str(Path(value).resolve())
        for field in ("input_data_path", "output_data_path")
        if (value := getattr(request, field)) and io.is_local(value) and "://" not in value
    }
    return request.model_copy(update=updates)


if __name__ == "__main__":
    sys.exit(main())
