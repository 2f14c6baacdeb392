"""Requests the job refuses before any inference starts: each fails with a message naming the problem."""

import json

from tests.conftest import MODEL, step_failure_messages


def _request(tmp_path, **fields):
    return {"output_data_path": str(tmp_path / "out" / "output.json"), "model_config": {"model": MODEL}, **fields}


def test_malformed_input_file_fails_naming_the_line(run_job, tmp_path):
    path = tmp_path / "input.jsonl"
    good = {"prompts": ["a"], "max_new_tokens": 4, "temperature": 0.0}
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + '{"prompts": [oops]}\n')
    result = run_job(_request(tmp_path, input_data_path=str(path)))
    assert not result.success
    assert any(f"{path}: line 3, column" in message for message in step_failure_messages(result))
    assert not (tmp_path / "out" / "output.json").exists()


def test_wrong_type_in_an_element_fails_naming_element_and_field(run_job, tmp_path):
    path = tmp_path / "input.json"
    good = {"prompts": ["a"], "max_new_tokens": 4, "temperature": 0.0}
    path.write_text(json.dumps([good, good, {**good, "max_new_tokens": "many"}]))
    result = run_job(_request(tmp_path, input_data_path=str(path)))
    assert not result.success
    assert any("element 2: max_new_tokens" in message for message in step_failure_messages(result))


def test_missing_input_file_is_named(run_job, tmp_path):
    result = run_job(_request(tmp_path, input_data_path=str(tmp_path / "nowhere.json")))
    assert not result.success
    assert any("input_data_path: no file at" in message for message in step_failure_messages(result))


def test_empty_prompt_list_fails_clearly(run_job, tmp_path):
    result = run_job(_request(tmp_path, content={"prompts": [], "max_new_tokens": 4, "temperature": 0.0}))
    assert not result.success
    assert any("holds no prompts" in message for message in step_failure_messages(result))


def test_parts_this_deployment_cannot_serve_are_refused_naming_the_field(run_job, tmp_path):
    content = {"prompts": ["a"], "max_new_tokens": 4, "temperature": 0.0}
    result = run_job(_request(tmp_path, content=content, tool_config={"name": "shell"}, nodes_per_worker=2))
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "tool_config.name:" in message and "nodes_per_worker:" in message


def test_an_unwritable_output_location_fails_before_any_inference_naming_the_path(run_job, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the output directory should be")
    content = {"prompts": ["a"], "max_new_tokens": 4, "temperature": 0.0}
    output = blocker / "output.json"
    result = run_job({"output_data_path": str(output), "model_config": {"model": MODEL}, "content": content})
    assert not result.success
    (message,) = step_failure_messages(result)
    assert f"output_data_path: cannot write {output}" in message
    assert [e.step_key for e in result.all_events if e.is_step_failure] == ["validate_input"]

    directory = tmp_path / "a-directory.json"
    directory.mkdir()
    result = run_job({"output_data_path": str(directory), "model_config": {"model": MODEL}, "content": content})
    assert any("is a directory" in message for message in step_failure_messages(result))
