"""The service's own files, kept from its tenants: checked by each process that serves (the API, the code
location, `serve`) before it serves.

Dagster creates its SQLite databases and step outputs 0644 in DAGSTER_HOME: every team's run configs,
paths and chat templates, readable by any other local user, the code_evaluator sandbox's uids included.
DAGSTER_HOME is made 0700 instead, which keeps everyone else out of all of it whatever its files' modes.
With a tenants file, no service path may lie inside a team's data roots, where that team could read or
replace every team's jobs.
"""

from __future__ import annotations

import os

from sqlalchemy.engine import make_url

from batch_pipeline.core.settings import Settings
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.tenancy.tenants import tenants_at


def secure_service_paths(configured: Settings) -> None:
    """Make DAGSTER_HOME private to the service's user, and raise TenantsFileError when a service path lies
    inside a team's data roots (or the tenants file is wrong): the paths and tenants file of the settings
    the process composes its deployment from."""
    home = os.path.abspath(configured.dagster_home)
    os.makedirs(home, mode=0o700, exist_ok=True)
    if os.stat(home).st_uid == os.geteuid():  # a home another user gave us is theirs to set
        os.chmod(home, 0o700)
    registry = tenants_at(configured.tenants)
    if registry is None:
        return
    paths = {
        "DAGSTER_HOME": home,
        "the work dir (BATCH_PIPELINE_WORK_DIR)": JobStorage(work_dir_base=configured.work_dir_base).base(),
    }
    store = make_url(configured.job_store_url)
    if store.get_backend_name() == "sqlite" and store.database:
        paths["the job store (BATCH_PIPELINE_JOBS_DB)"] = store.database
    registry.check_service_paths(paths)
