"""Facts the engine works out as it starts: how much memory its KV cache gets, which tokens
are EOS, and the request that warms it up. Each is returned as a value; no config is written.
"""

from __future__ import annotations

import json

import torch

from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.model_config import ModelConfig
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.engine_config import EngineConfig

# The warm-up request: long enough to start every kernel a prompt step uses.
_WARM_UP_PROMPT_TOKENS = 64
WARM_UP_REQUEST_ID = "pdserve-warm-up"


def kv_budget(
    config: EngineConfig, spec: KVCacheSpec, device: torch.device, vocab_size: int, max_model_len: int
) -> int:
    """Bytes for the KV cache: ``kv_cache_memory`` if set; on a GPU, its free memory's share
    less a reserve for the largest step; on CPU, what ``max_num_seqs`` full contexts use, at
    most ``cpu_kv_cache_memory``."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Keep room for activations and logits of the largest step.
        reserve = 2**30 + config.max_num_batched_tokens * vocab_size * 4
        return max(int(free * config.gpu_memory_utilization) - reserve, spec.bytes_per_block)
    useful = config.max_num_seqs * (max_model_len + spec.block_size) * spec.bytes_per_token
    return min(config.cpu_kv_cache_memory, useful)


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json, else the tokenizer's."""
    ids: set[int] = set()
    sources = [config.hf.get("eos_token_id")]
    generation_file = config.path / "generation_config.json"
    if generation_file.is_file():
        try:
            sources.append(json.loads(generation_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{generation_file}: not valid JSON ({error})") from None
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def warm_up_prompt(max_model_len: int, num_blocks: int, block_size: int, vocab_size: int) -> list[int] | None:
    """The warm-up request's prompt: room left for its two generated tokens, and a block to
    spare; None when the cache is too small for any."""
    room = min(max_model_len, (num_blocks - 1) * block_size) - 2
    num_tokens = min(_WARM_UP_PROMPT_TOKENS, room)
    if num_tokens < 1:
        return None
    return [token % vocab_size for token in range(1, num_tokens + 1)]
