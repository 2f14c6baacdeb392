"""The environment of a process the service starts to do a team's work: a shard worker (launched, or started
ahead as a standby) and the dry run's checking process. Each is built from an allow-list, never passed on
whole: the service's own environment may hold every team's webhook secrets (the variables the tenants file's
`secret_env` names), the API keys and the job store's password, and these processes run what a team sent (a
model, a chat template, with `trust_remote_code` the model's own Python). The code_evaluator sandbox's
environment is smaller still, and built from nothing (worker/sandbox.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from batch_pipeline.core.settings import ENV_PREFIX

# The system's and Python's: where programs, libraries, home, locale, time zone, temporary files and
# certificates are, and how to reach the network through a proxy.
_NAMES = {
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "TMP",
    "TEMP",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",  # vLLM's CPU backend preloads tcmalloc and Intel's OpenMP
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "TOKENIZERS_PARALLELISM",
}
# The engine's and its libraries' (threads, devices, caches, offline mode, the model hub's token).
_PREFIXES = (
    "LC_",
    "XDG_",
    "PYTHON",
    "VLLM_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "NUMEXPR_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "TRITON_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DAGSTER_PIPES_",
)
# Object-store credentials and endpoints (s3fs reads AWS_*; fsspec its FSSPEC_<PROTOCOL>_* defaults): only
# for a process that reads s3:// data. They open every team's prefix, not one team's.
OBJECT_STORE_PREFIXES = ("AWS_", "FSSPEC_")
# The BATCH_PIPELINE_* settings these processes read (core/settings.py): the shard worker's own, where
# catalog models are kept, and where a standby worker waits (a directory of `batch-pipeline run`).
WORKER_SETTINGS = tuple(
    ENV_PREFIX + name.upper()
    for name in (
        "checkpoint_upload_s",
        "sandbox_uid_base",
        "sandbox_uids",
        "sandbox_memory_mb",
        "sandbox_python",
        "sandbox_allow_network",
        "model_cache",
        "standby_worker",
    )
)


def child_environment(environment: Mapping[str, str], object_store: bool) -> dict[str, str]:
    """What of `environment` a worker or dry-run child gets: the allow-listed variables, the object store's
    credentials only with `object_store`. Nothing else: no API key, webhook secret or database URL."""
    prefixes = _PREFIXES + OBJECT_STORE_PREFIXES if object_store else _PREFIXES
    return {
        name: value
        for name, value in environment.items()
        if name in _NAMES or name in WORKER_SETTINGS or name.startswith(prefixes)
    }


def worker_settings(environment: Mapping[str, str]) -> dict[str, str]:
    """The shard worker's own settings among `environment`: what a pod, which gets no other variable of the
    service's, is given (the standby's directory is local to `batch-pipeline run`, and left out)."""
    return {
        name: environment[name]
        for name in WORKER_SETTINGS
        if name in environment and name != ENV_PREFIX + "STANDBY_WORKER"
    }
