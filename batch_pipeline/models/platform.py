"""What a machine computes a model's numbers with: its CPU's features (whether it computes bfloat16
natively, which picks the dtype a model runs in when the request names none) and the inference libraries'
versions. The worker chooses its dtype by it; the result cache keys results by it."""

from __future__ import annotations

import functools
import importlib.metadata
import platform

# CPU flags of native bfloat16 arithmetic: x86 (AVX512-BF16, AMX) and Arm (FEAT_BF16).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache  # read once a process: engine_arguments and build_llm both ask
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of this machine's CPU (`flags` on x86, `Features` on Arm); empty if unknown."""
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def numerics_platform() -> str:
    """This machine's part in a model's numbers: its architecture, whether it computes bfloat16 natively,
    and the versions of vLLM and torch (read from their metadata: nothing is imported)."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    bf16 = "bf16" if cpu_flags() & BF16_FLAGS else "no-bf16"
    return f"{platform.machine()} {bf16} vllm {version('vllm')} torch {version('torch')}"
