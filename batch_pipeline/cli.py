"""`batch-pipeline`: run a batch job on this machine, and list the built-in models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batch-pipeline")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a request JSON file as a Dagster job on this machine")
    run.add_argument("request", type=Path, help="a v1 or v2 batch completions request (JSON)")
    run.add_argument("--show", type=int, default=3, help="completions to print (default 3)")
    models = commands.add_parser("models", help="list the built-in model catalog")
    models.add_argument("--prepare", metavar="NAME", help="convert a catalog model into the cache now")
    args = parser.parse_args(argv)
    if args.command == "models":
        return _prepare(args.prepare) if args.prepare else _models()
    return _run(args.request, args.show)


def _models() -> int:
    from batch_pipeline.models import CATALOG, cache_dir

    for entry in CATALOG.values():
        prepared = (cache_dir() / entry.name / "config.json").exists()
        print(f"{entry.name:28} {entry.description} ({'prepared' if prepared else 'not yet prepared'})")
    return 0


def _prepare(name: str) -> int:
    import time

    from batch_pipeline.models import CATALOG, prepare_catalog_model

    if name not in CATALOG:
        print(f"unknown catalog model {name!r}; known: {', '.join(CATALOG)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    path = prepare_catalog_model(CATALOG[name])
    print(f"{name}: {path} ({time.monotonic() - started:.1f}s)")
    return 0


def _run(path: Path, show: int) -> int:
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
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    instance = dg.DagsterInstance.get()
    result = execute_request(request, instance, log_level="INFO")
    if not result.success:
        failures = [event for event in result.all_events if event.is_step_failure]
        for event in failures:
            error = event.step_failure_data.error
            print(f"step {event.step_key} failed: {error.message.strip() if error else 'unknown error'}", file=sys.stderr)
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
        f"{metadata['num_requests']} requests ({metadata['num_errors']} errors) in {len(metadata['shards'])} shards, "
        f"{metadata['prompt_tokens']} prompt + {metadata['completion_tokens']} completion tokens, "
        f"{metadata['wall_s']:.1f}s wall, {metadata['completion_tokens_per_s']} completion tokens/s"
    )
    for index, output in enumerate(outputs[:show]):
        text = output.get("text") if "text" in output else json.dumps(output)
        print(f"[{index}] {text.strip()[:200]!r}")
    return 0


def _with_absolute_local_paths(request):
    """Relative paths in a request file mean relative to where the command runs, not to a step process."""
    from batch_pipeline import io

    updates = {
        field: str(Path(value).resolve())
        for field in ("input_data_path", "output_data_path")
        if (value := getattr(request, field)) and io.is_local(value) and "://" not in value
    }
    return request.model_copy(update=updates)


if __name__ == "__main__":
    sys.exit(main())
