"""The docs (README.md, docs/, and bench/README.md and bench/HISTORY.md, which the site shows) are tested: every
code block that is a command or a request runs here, or says why not with `<!-- not run: reason -->` on the line
before it.

A block's language says what it is:
- `sh` and `python`: commands. `curl` requests go to the real app in-process (an open API over a fresh Dagster
  instance and job store, as `make serve` runs it without keys); `batch-pipeline` synopsis lines are checked
  against the CLI's own parser (every option a line shows is one its command takes); the commands in CHEAP run
  in a subprocess; a `python` block runs with `openai.OpenAI` talking to the in-process app.
- `json`: a request body; it must validate as a v1 or v2 batch completions request or an OpenAI batch input line
  (the contract's own pydantic models).
- `text` (output, diagrams, trees) and `yaml` (files and objects, shown): neither; a `text` block that starts
  with a command fails.
A block without a language, or a command or request no test here can run and nobody marked, fails."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [REPO / "README.md", REPO / "bench" / "README.md", REPO / "bench" / "HISTORY.md", *(REPO / "docs").rglob("*.md")]
)
NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")
FENCE = re.compile(r"^(\s*)(`{3,})(\S*)\s*$")
# Commands cheap enough to run as they are, from the repository root with .venv/bin first on PATH.
CHEAP = ("python -m batch_pipeline.core.settings", "batch-pipeline --help", "batch-pipeline models")
COMMAND_WORDS = ("$ ", "make ", "curl ", "batch-pipeline ", "python ", "kubectl ", "helm ", "docker ", "pip ")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    not_run: str | None  # the reason, where marked

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line} ({self.language or 'no language'})"


def blocks(page: Path) -> list[Block]:
    found, lines, index = [], page.read_text().splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, language = opening.groups()
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == fence and lines[i].startswith(indent))
        before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marked = NOT_RUN.match(before)
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        found.append(Block(page, index + 1, language, body, marked.group(1) if marked else None))
        index = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def commands(text: str) -> list[str]:
    """A shell block's commands, comments and continuations resolved (a quoted argument may span lines)."""
    found, pending = [], ""
    for line in text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            found.append(shlex.join(words))
        pending = ""
    return found


def kind(block: Block) -> str:
    """How this file runs the block: curl, cli, cheap, python, json; else unrun."""
    if block.language == "json":
        return "json"
    if block.language == "python":
        return "python"
    if block.language == "sh":
        shown = commands(block.text)
        firsts = {shlex.split(command)[0] for command in shown}
        if firsts == {"curl"}:
            return "curl"
        if shown and all(command in CHEAP for command in shown):
            return "cheap"
        if firsts == {"batch-pipeline"}:
            return "cli"
    return "unrun"


def test_every_block_has_a_language_and_every_unrun_command_is_marked_with_a_reason():
    assert len(ALL) > 15, "the pages show no code"
    problems = []
    for block in ALL:
        if block.language not in ("sh", "python", "json", "text", "yaml"):
            problems.append(f"{block}: give it a language: sh, python, json (run or marked), text or yaml (shown)")
        elif block.language == "text" and block.text.lstrip().startswith(COMMAND_WORDS):
            problems.append(f"{block}: a command shown as text: make it sh, and run it here or mark it")
        elif block.language in ("sh", "python") and kind(block) == "unrun" and block.not_run is None:
            problems.append(
                f"{block}: a command no test runs: run it in tests/test_docs.py or mark it <!-- not run: why -->"
            )
        elif block.not_run is not None and block.language not in ("sh", "python", "json"):
            problems.append(f"{block}: marked not run, but a {block.language} block is never run")
    assert not problems, "\n".join(problems)


def run_blocks(*kinds: str) -> list:
    return [pytest.param(block, id=str(block)) for block in ALL if block.not_run is None and kind(block) in kinds]


def test_the_site_runs_and_marks_blocks_of_each_kind():
    run = [block for block in ALL if block.not_run is None and kind(block) != "unrun"]
    marked = [block for block in ALL if block.not_run is not None]
    assert {kind(block) for block in run} >= {"curl", "cli", "cheap", "python", "json"}, "a handler runs nothing"
    assert marked, "nothing is marked: the marker's pattern no longer matches"


# --- requests


@pytest.fixture
def open_api(deployment_factory):
    """The real app over a fresh instance and job store, with no keys: open, as `make serve` without keys."""
    from fastapi.testclient import TestClient

    from batch_pipeline.api.app import create_app
    from batch_pipeline.api.auth import ApiKeys

    deployment = deployment_factory()
    return TestClient(create_app(deployment.service, ApiKeys([])))


def top_level_keys(shown: str) -> list[str]:
    """The keys of a shown response's outer object (`...` and all)."""
    keys, depth = [], 0
    for match in re.finditer(r'[{}\[\]]|"([A-Za-z_]+)"\s*:', shown):
        token = match.group(0)
        depth += token in "{[" and 1 or token in "}]" and -1 or 0
        if match.group(1) and depth == 1:
            keys.append(match.group(1))
    return keys


@pytest.mark.parametrize("block", run_blocks("curl"))
def test_each_curl_request_gets_the_answer_the_page_shows(block, open_api):
    shown_after = re.findall(r"^# (\{.*)$", block.text, re.M)  # the answer shown under each request
    last_id = None
    for index, command in enumerate(commands(block.text)):
        words = shlex.split(command)
        method, headers, data, url = "GET", {}, None, None
        options = iter(words[1:])
        for word in options:
            if word == "-X":
                method = next(options)
            elif word == "-H":
                name, value = next(options).split(":", 1)
                headers[name.strip()] = value.strip()
            elif word == "-d":
                data, method = next(options), "POST" if method == "GET" else method
            elif not word.startswith("-"):
                url = word
        assert url, f"{block}: no URL in {command!r}"
        path = "/" + url.split("/", 1)[1]
        if last_id is not None:  # the id shown is an example's: the request names the job just made
            path = re.sub(r"batch-[0-9a-f]+\.\.\.", last_id, path)
        response = open_api.request(method, path, headers=headers, content=data)
        assert response.status_code == 200, f"{block}: {command}: {response.status_code} {response.text[:500]}"
        answer = response.json()
        last_id = answer.get("job_id", last_id)
        if index < len(shown_after):
            missing = [key for key in top_level_keys(shown_after[index]) if key not in answer]
            assert not missing, f"{block}: the answer to {command!r} lacks the keys the page shows: {missing}"


def json_request_models():
    from batch_pipeline.contract.openai_batch import BatchInputLine
    from batch_pipeline.contract.requests import CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request

    return (CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request, BatchInputLine)


@pytest.mark.parametrize("block", run_blocks("json"))
def test_each_json_request_validates_against_the_contract(block):
    from pydantic import ValidationError

    errors = []
    for model in json_request_models():
        try:
            model.model_validate_json(block.text)
            return
        except ValidationError as error:
            errors.append(f"{model.__name__}: {error}")
    pytest.fail(f"{block}: the request validates as none of the contract's requests:\n" + "\n".join(errors))


@pytest.mark.parametrize("block", run_blocks("python"))
def test_each_python_block_runs_against_the_app(block, open_api, tmp_path, monkeypatch):
    """Run with `openai.OpenAI` bound to the in-process app; a `requests.jsonl` it opens is the page's own
    example line (the page's json block that validates as an OpenAI batch input line)."""
    import openai

    from batch_pipeline.contract.openai_batch import BatchInputLine

    lines = [b.text for b in ALL if b.page == block.page and b.language == "json" and '"custom_id"' in b.text]
    for text in lines:
        BatchInputLine.model_validate_json(text)
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(json.loads(text)) + "\n" for text in lines))
    real = openai.OpenAI
    monkeypatch.setattr(openai, "OpenAI", lambda **kwargs: real(**kwargs, http_client=open_api, max_retries=0))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block.text, str(block), "exec"), namespace)  # the page's own example
    if "batch" in namespace:  # the example made a batch: it is queued as a job
        assert namespace["batch"].status == "in_progress", namespace["batch"]


# --- commands


@pytest.mark.parametrize("block", run_blocks("cheap"))
def test_each_cheap_command_runs(block):
    bin_dir = Path(sys.executable).parent
    for command in commands(block.text):
        done = subprocess.run(
            command,
            shell=True,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(Path.home())},
        )
        assert done.returncode == 0, f"{block}: {command}: {done.stderr[-2000:]}"
        if command == "python -m batch_pipeline.core.settings":  # it prints the table the page shows
            assert done.stdout.strip() in block.page.read_text(), f"{block}: the page's table is not what it prints"


def cli_help(arguments: list[str]) -> str:
    from batch_pipeline.entrypoints.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main([*arguments, "--help"])
    assert exited.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("block", run_blocks("cli"))
def test_each_cli_synopsis_line_is_a_command_with_the_options_it_shows(block):
    for command in commands(block.text):
        words = shlex.split(command)
        assert words[0] == "batch-pipeline", command
        sub = words[1]
        usage = cli_help([sub])
        unknown = [word for word in re.findall(r"(?<![\w-])--[a-z][a-z-]*", command) if word not in usage]
        assert not unknown, f"{block}: `batch-pipeline {sub}` takes no {unknown}"


def test_every_file_a_page_names_exists():
    """The files the pages name (`kubectl apply -f k8s/...`, `tests/test_x.py`, `deploy/...`) are in the tree;
    bench/results/ is what `make bench` writes, not in git, and `port-forward deploy/NAME` names a Deployment."""
    named = {
        (path.rstrip("/."), page.relative_to(REPO))
        for page in PAGES
        for path in re.findall(
            r"(?<![\w/.<-])((?:k8s|deploy|examples|tests|bench|docs)/[\w./-]*[\w/])",
            re.sub(r"port-forward \S+", "", page.read_text()),
        )
        if not path.startswith("bench/results")
    }
    assert len(named) > 20, "the pattern finds no file"
    missing = sorted(f"{page}: {path}" for path, page in named if not (REPO / path).exists())
    assert not missing, "the pages name files that are not there:\n" + "\n".join(missing)


def test_a_batch_input_line_shown_in_the_docs_is_one_line_as_its_file_needs():
    """A reader pastes it into a .jsonl file: a line split for the page makes a batch that fails."""
    split = [
        str(block)
        for block in ALL
        if block.language == "json" and '"custom_id"' in block.text and len(block.text.strip().splitlines()) > 1
    ]
    assert split == []


def test_no_page_points_at_documents_the_repository_does_not_hold():
    """The site's first line pointed at "the `spec/` documents", which a reader of the repository never finds."""
    pointing = [str(page.relative_to(REPO)) for page in PAGES if "the `spec/` documents" in page.read_text()]
    assert pointing == []


def test_the_batch_apis_endpoint_table_has_a_row_for_each_endpoint_of_the_registry_and_no_other():
    """A kind with an OpenAI url is a batch endpoint at once (contract/kinds); its row in the table is how a
    reader learns what its lines take and give."""
    from batch_pipeline.contract.kinds import BATCH_ENDPOINTS

    page = (REPO / "docs" / "openai-batch.md").read_text()
    rows = re.findall(r"^\s*\| `(/v1/[a-z/_]+)` \|", page, flags=re.MULTILINE)
    assert sorted(rows) == sorted(BATCH_ENDPOINTS), rows
