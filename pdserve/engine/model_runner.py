"""Turns a scheduled batch into model inputs, runs the model, returns the logits to sample.

Inputs are built with numpy on the host and moved to the device once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.models import DecoderModel
from pdserve.engine.request import Request
from pdserve.kernels.backend import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] index of the last token of each request that samples
    sampling_requests: list[Request]  # the R requests, in row order


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, kv: KVCacheManager, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = device
        self.block_size = kv_cache.spec.block_size

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInputs:
        """``scheduled`` must list single-token requests first (the scheduler's order)."""
        bs = self.block_size
        num_tokens = sum(n for _, n in scheduled)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        tables = [self.kv.block_table(r.request_id) for r, _ in scheduled]
        block_tables = np.zeros((len(scheduled), max(len(t) for t in tables)), dtype=np.int32)
        seq_lens, query_lens, sample_rows, sampling = [], [], [], []
        num_decodes = 0
        start = 0
        for i, ((request, n), table) in enumerate(zip(scheduled, tables)):
            first = request.num_computed_tokens
            end = first + n
            input_ids[start : start + n] = request.token_ids[first:end]
            pos = np.arange(first, end)
            positions[start : start + n] = pos
            table_np = np.asarray(table, dtype=np.int64)
            slots[start : start + n] = table_np[pos // bs] * bs + pos % bs
            block_tables[i, : len(table)] = table
            seq_lens.append(end)
            query_lens.append(n)
            if n == 1 and num_decodes == i:
                num_decodes += 1
            if end == request.num_tokens:  # caught up: this step yields its next token
                sample_rows.append(start + n - 1)
                sampling.append(request)
            start += n
        query_start = np.zeros(len(scheduled) + 1, dtype=np.int32)
        query_start[1:] = np.cumsum(query_lens)
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(slots),
            block_tables=to(block_tables),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            query_start_loc=to(query_start),
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
            num_decodes=num_decodes,
            block_size=bs,
        )
        return ModelInputs(
            input_ids=to(input_ids),
            positions=to(positions),
            meta=meta,
            sample_rows=to(np.asarray(sample_rows, dtype=np.int64)),
            sampling_requests=sampling,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [R, vocab] (float32) for the requests that sample this step."""
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        return self.model.compute_logits(hidden[inputs.sample_rows])
