"""The settings: every BATCH_PIPELINE_* variable the package reads is documented in one object and in the
table of docs/operations/settings.md, and a value the service cannot use stops it at start-up naming the
variable."""

import re
from pathlib import Path

import pytest

from batch_pipeline.core.settings import SettingsError, settings, settings_table, variable_names

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "batch_pipeline"
SETTINGS_PAGE = REPO / "docs" / "operations" / "settings.md"
# Whole names only: `BATCH_PIPELINE_MAX_*` in prose names a family, not a variable.
VARIABLE = re.compile(r"\bBATCH_PIPELINE_[A-Z0-9_]*[A-Z0-9]\b")


def test_the_settings_pages_table_is_the_generators_output():
    page = SETTINGS_PAGE.read_text()
    table = page.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert table == settings_table(), (
        "docs/operations/settings.md's table differs from the settings: run `python -m batch_pipeline.core.settings` "
        "and paste its output between <!-- settings:begin --> and <!-- settings:end -->"
    )


def test_every_variable_the_package_names_is_a_documented_setting():
    named = {
        (name, str(path.relative_to(REPO)))
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "settings.py"
        for name in VARIABLE.findall(path.read_text())
    }
    assert named, "the pattern finds the package's variables"
    undocumented = sorted(pair for pair in named if pair[0] not in variable_names())
    assert not undocumented, (
        f"add these to batch_pipeline/core/settings.py (and docs/operations/settings.md's table): {undocumented}"
    )


def test_a_bad_value_stops_the_api_at_start_naming_the_variable(monkeypatch):
    from batch_pipeline.api.app import create_app

    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", "abc")
    with pytest.raises(SettingsError, match=r"^BATCH_PIPELINE_SENSOR_INTERVAL_S: must be a valid integer.*got 'abc'$"):
        create_app(service=object())


def test_each_bad_value_is_named_in_one_error(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_MEMORY", "lots")
    monkeypatch.setenv("BATCH_PIPELINE_DEDUPLICATE", "maybe")
    with pytest.raises(SettingsError) as raised:
        settings()
    message = str(raised.value)
    assert "BATCH_PIPELINE_MAX_MEMORY: must be a positive Kubernetes quantity" in message
    assert "got 'lots'" in message
    assert "BATCH_PIPELINE_DEDUPLICATE: must be a valid boolean" in message


def test_a_k8s_launcher_without_an_image_is_named(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_SHARD_LAUNCHER", "k8s")
    monkeypatch.delenv("BATCH_PIPELINE_WORKER_IMAGE", raising=False)
    with pytest.raises(SettingsError, match="BATCH_PIPELINE_WORKER_IMAGE: must be set"):
        settings()


def test_values_are_read_when_asked_for_as_they_always_were(monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", " 5 ")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "")  # empty: unset
    monkeypatch.setenv("BATCH_PIPELINE_DEDUPLICATE", "0")
    monkeypatch.setenv("BATCH_PIPELINE_ALLOWED_PROTOCOLS", "")  # empty: no protocol at all
    monkeypatch.setenv("batch_pipeline_port", "1")  # names are case-sensitive
    monkeypatch.delenv("BATCH_PIPELINE_PORT", raising=False)
    read = settings()
    assert (read.sensor_interval_s, read.max_shards_per_job, read.deduplicate) == (5, None, False)
    assert (read.allowed_protocols, read.port) == ("", 8000)
    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", "7")
    assert settings().sensor_interval_s == 7
