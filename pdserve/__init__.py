"""pdserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.offline.llm import LLM, CompletionOutput
    from pdserve.types.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported on first use, so that commands that never run a model (the operator CLI, the
    # frontend) do not pay torch's import time.
    if name in ("LLM", "CompletionOutput"):
        from pdserve.offline import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from pdserve.types.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
