"""pdserve: disaggregated prefill/decode LLM serving."""

from pdserve.engine.llm import LLM, CompletionOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"
