"""Turns a scheduled batch into model inputs, runs the model, returns the logits to sample.

Inputs are built with numpy on the host and moved to the device once per step. In a
tensor-parallel group its leader (tensor-parallel rank 0) plans each step and sends the plan
(``StepPlan``) to the other ranks, which run the same batch on their share of the model
(``follow``). Data-parallel ranks each run their own batches; before each step their leaders
agree whether anyone has tokens, and a rank without any takes part in the expert-parallel
exchanges with an empty batch (an ``idle`` plan to its tensor-parallel ranks). The leader
sends a plan only after that agreement, so its ranks learn the agreed rebalance with it.

On a single rank, requests that become ready for a decode token while the model runs may join
the run at a layer boundary (``execute``'s ``joiners``; ``DecoderModel.forward`` says how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.step_plan import StepPlan, array
from pdserve.kernels.backend import AttentionMetadata
from pdserve.model.kv_cache import KVCache
from pdserve.model.nn.base import DecoderModel, LateTokens
from pdserve.model.nn.eplb import rebalance


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] index of the last token of each request that samples
    sampling_requests: list[Request]  # the R requests, in row order
    rebalance: bool = False  # re-place the experts after this step
    # (request, tokens) in row order; requests that join the run mid-way are added here.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    plan: StepPlan | None = None  # a tensor-parallel leader's, for its other ranks


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        kv: KVCacheManager | None,
        device: torch.device,
        parallel: ParallelState = SINGLE_RANK,
    ) -> None:
        """``kv`` is the leader's block tables (None on the other tensor-parallel ranks)."""
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = device
        self.parallel = parallel
        self.block_size = kv_cache.spec.block_size
        self.num_model_steps = 0  # steps this rank took part in: the same count on every rank
        # Data-parallel ranks leave together: each says whether it stays, at every step.
        self.staying = True
        self.group_staying = True  # whether any rank stayed, as of the last step
        self.rebalance_requested = False  # a leader: re-place the experts after the next step

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInputs:
        """``scheduled`` must list single-token requests first (the scheduler's order)."""
        plan, sampling = self.plan(scheduled)
        inputs = self.inputs(plan)
        inputs.sampling_requests = sampling
        inputs.scheduled = list(scheduled)
        if self.parallel.tp_size > 1:
            inputs.plan = plan
        return inputs

    def plan(self, scheduled: list[tuple[Request, int]]) -> tuple[StepPlan, list[Request]]:
        bs = self.block_size
        num_tokens = sum(n for _, n in scheduled)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        assert self.kv is not None  # rank 0 plans
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
        plan = StepPlan(
            input_ids=input_ids.tobytes(),
            positions=positions.tobytes(),
            slot_mapping=slots.tobytes(),
            block_tables=block_tables.tobytes(),
            table_width=block_tables.shape[1],
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=num_decodes,
            sample_rows=np.asarray(sample_rows, dtype=np.int64).tobytes(),
            rebalance=self.rebalance_requested,
        )
        return plan, sampling

    def inputs(self, plan: StepPlan) -> ModelInputs:
        """The device tensors of ``plan`` (``sampling_requests`` left empty)."""
        query_start = np.zeros(len(plan.query_lens) + 1, dtype=np.int32)
        query_start[1:] = np.cumsum(plan.query_lens)
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(array(plan.slot_mapping, np.int64)),
            block_tables=to(array(plan.block_tables, np.int32).reshape(len(plan.seq_lens), plan.table_width)),
            seq_lens=to(np.asarray(plan.seq_lens, dtype=np.int32)),
            query_start_loc=to(query_start),
            seq_lens_list=plan.seq_lens,
            query_lens_list=plan.query_lens,
            num_decodes=plan.num_decodes,
            block_size=self.block_size,
        )
        return ModelInputs(
            input_ids=to(array(plan.input_ids, np.int64)),
            positions=to(array(plan.positions, np.int64)),
            meta=meta,
            sample_rows=to(array(plan.sample_rows, np.int64)),
            sampling_requests=[],
            rebalance=plan.rebalance,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def execute(self, inputs: ModelInputs, joiners: Callable[[], list[Request]] | None = None) -> torch.Tensor:
        """Logits [R, vocab] (float32) for the requests that sample this step.

        ``joiners`` (single rank only), asked at each layer boundary: running requests that
        need one decode token and were not scheduled, each with a slot for it. They join the
        run there, and ``inputs`` is updated to the step as it ran (its scheduled requests,
        rows and sampling requests include them).
        """
        rebalance = inputs.rebalance
        if self.parallel.dp_size > 1 and self.parallel.is_tp_leader:
            rebalance = self._agree(inputs.input_ids.shape[0])[1]  # this rank has tokens: every rank steps
        if inputs.plan is not None:
            self.parallel.plans.send(msgspec.structs.replace(inputs.plan, rebalance=rebalance))
        late = None
        if joiners is not None and self.parallel.world_size == 1:
            late = self._late_join(inputs, joiners)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, late, sample_rows=inputs.sample_rows
        )
        logits = self.model.compute_logits(hidden)
        self._stepped(rebalance)
        return logits

    def _late_join(
        self, inputs: ModelInputs, joiners: Callable[[], list[Request]]
    ) -> Callable[[int], LateTokens | None]:
        def late(index: int) -> LateTokens | None:
            joining = [(request, 1) for request in joiners()]
            if not joining:
                return None
            # Decodes lead a batch: the newcomers go right after the step's decode rows.
            at = inputs.meta.num_decodes
            scheduled = inputs.scheduled[:at] + joining + inputs.scheduled[at:]
            theirs = self.inputs(self.plan(joining)[0])
            plan, sampling = self.plan(scheduled)
            merged = self.inputs(plan)
            inputs.input_ids, inputs.positions, inputs.meta = merged.input_ids, merged.positions, merged.meta
            inputs.sample_rows, inputs.sampling_requests, inputs.scheduled = merged.sample_rows, sampling, scheduled
            return LateTokens(
                input_ids=theirs.input_ids,
                positions=theirs.positions,
                meta=theirs.meta,
                merged_meta=merged.meta,
                insert_at=at,
                sample_rows=merged.sample_rows,
            )

        return late

    def idle(self) -> bool:
        """A step with nothing scheduled here: with data-parallel ranks, step with them if any
        of them has tokens. Returns whether any rank ran the model."""
        if self.parallel.dp_size > 1:
            busy, rebalance = self._agree(0)
            if busy:
                if self.parallel.tp_size > 1:
                    self.parallel.plans.send(StepPlan(idle=True, rebalance=rebalance))
                self.model.idle_forward()
                self._stepped(rebalance)
                return True
        return False

    def _agree(self, num_tokens: int) -> tuple[bool, bool]:
        """Data-parallel leaders: whether any rank has tokens this step, and whether any asked
        for a rebalance; notes whether any stays."""
        busy, staying, rebalance = self.parallel.max_over_group(
            [num_tokens, int(self.staying), int(self.rebalance_requested)]
        )
        self.group_staying = bool(staying)
        return busy > 0, bool(rebalance)

    def _stepped(self, rebalance_now: bool) -> None:
        """Count a model step; after it, rebalance the experts when asked to (on any rank) or
        every ``eplb_interval_steps`` steps."""
        self.num_model_steps += 1
        interval = self.parallel.config.eplb_interval_steps
        if rebalance_now or (interval and self.num_model_steps % interval == 0):
            rebalance(self.model, self.parallel)
            self.rebalance_requested = False

    def follow(self) -> None:
        """Tensor-parallel ranks but the leader: run every step it plans, until it says stop."""
        while True:
            plan = self.parallel.plans.receive(StepPlan)
            if plan.stop:
                return
            if plan.idle:
                self.model.idle_forward()
                self._stepped(plan.rebalance)
            else:
                self.execute(self.inputs(plan))

    def stop_followers(self) -> None:
        """The leader: tell the other tensor-parallel ranks that no more steps come."""
        if self.parallel.tp_size > 1:
            self.parallel.plans.send(StepPlan(stop=True))
