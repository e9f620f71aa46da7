"""Which workers serve a request: the prefill worker (or none) and the decode worker.

- Decode: the least loaded by KV usage and occupancy (running and queued over the
  ``max_num_seqs`` in force).
- Prefill: among those whose KV heads can move to the decode worker (``kv_fit``), the
  cheapest by estimated work — the prompt tokens it would have to compute (its
  prefix-cache overlap counts for it) plus the prompt tokens already queued on it.
- Conditional disaggregation: a prompt whose uncached part is at most
  ``local_prefill_threshold_tokens``, or one arriving while every prefill worker is saturated,
  is prefilled on the decode worker; moving its KV would cost more than computing it there.
  ``always`` and ``off`` force either way. The model's live knobs, when stored, set the
  threshold in place of the config's.

Every choice is among the workers ``groups.available`` leaves: a data-parallel group is one
failure domain, so a request that failed on a rank never goes to its siblings, and a group
missing a rank or draining one gets nothing new.

Registry loads are up to a second old, so the router also counts what it dispatched itself
since, and takes the larger of the two.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.groups import available
from pdserve.frontend.kv_fit import KVMisfit, kv_misfit
from pdserve.frontend.prefix_index import PrefixIndex, block_hashes


class NoWorker(RuntimeError):
    """No worker of a role is available for the model."""


@dataclass(frozen=True)
class PrefillChoice:
    worker: WorkerEntry
    cached_tokens: int  # estimated prefix-cache overlap
    hashes: list[bytes]


class Router:
    def __init__(self, config: RouterConfig, seed: int | None = None) -> None:
        self.config = config
        self.prefix_index = PrefixIndex()
        self._random = random.Random(seed)
        self._requests: Counter[str] = Counter()  # dispatched and not finished, per worker
        self._prefill_tokens: Counter[str] = Counter()  # prompt tokens dispatched, not done

    # ---- decisions ----------------------------------------------------------------------------
    def choose_decode(self, workers: Sequence[WorkerEntry], exclude: Sequence[str] = ()) -> WorkerEntry:
        """The decode worker for a new request; never one of the group of a worker in ``exclude``."""
        candidates = available(workers, exclude)
        if not candidates:
            raise NoWorker(Role.DECODE)
        return min(candidates, key=lambda w: (self._decode_score(w), self._random.random()))

    def _decode_score(self, worker: WorkerEntry) -> float:
        load = worker.load
        busy = max(load.running + load.waiting, self._requests[worker.worker_id])
        return load.kv_usage + busy / max(load.max_num_seqs or worker.max_num_seqs, 1)

    def choose_prefill(
        self,
        workers: Sequence[WorkerEntry],
        token_ids: Sequence[int],
        exclude: Sequence[str] = (),
        knobs: Knobs | None = None,
        decode: WorkerEntry | None = None,
        cache_salt: str | None = None,
    ) -> PrefillChoice | None:
        """The prefill worker for the prompt, or None to prefill on the decode worker.

        ``knobs``: the model's live knobs, if any are stored. ``decode``: the decode worker the
        KV goes to: only prefill workers whose KV heads can move there are candidates
        (``kv_fit``); raises ``KVMisfit``, naming the sizes, when none of the others can.
        ``exclude``: workers that failed the request; their groups' workers are never chosen.
        ``cache_salt``: the request's prefix-cache salt; only blocks cached under it count.
        """
        mode = self.config.disaggregation
        if mode == "off":
            return None
        candidates = available(workers, exclude)
        if decode is not None and candidates:
            misfits = [reason for w in candidates if (reason := kv_misfit(w, decode)) is not None]
            if len(misfits) == len(candidates):
                raise KVMisfit(f"no prefill worker's KV can move to decode worker {decode.worker_id}: {misfits[0]}")
            candidates = [w for w in candidates if kv_misfit(w, decode) is None]
        if not candidates:
            if mode == "always":
                raise NoWorker(Role.PREFILL)
            return None
        hashes_by_size: dict[int, list[bytes]] = {}
        best: tuple[float, float, PrefillChoice] | None = None
        for worker in candidates:
            hashes = hashes_by_size.get(worker.block_size)
            if hashes is None:
                hashes = hashes_by_size[worker.block_size] = block_hashes(token_ids, worker.block_size, cache_salt)
            cached = min(self.prefix_index.overlap(worker.worker_id, hashes) * worker.block_size, len(token_ids) - 1)
            cost = len(token_ids) - cached + self._queued_tokens(worker)
            choice = PrefillChoice(worker, cached, hashes)
            key = (cost, self._random.random())
            if best is None or key < best[:2]:
                best = (*key, choice)
        assert best is not None
        choice = best[2]
        if mode == "conditional":
            uncached = len(token_ids) - choice.cached_tokens
            saturated = all(self._queued_tokens(w) >= self.config.prefill_saturation_tokens for w in candidates)
            threshold = (self.config if knobs is None else knobs).local_prefill_threshold_tokens
            if uncached <= threshold or saturated:
                return None
        return choice

    def _queued_tokens(self, worker: WorkerEntry) -> int:
        return max(worker.load.queued_prefill_tokens, self._prefill_tokens[worker.worker_id])

    # ---- bookkeeping --------------------------------------------------------------------------
    def prefill_started(self, choice: PrefillChoice, num_tokens: int) -> None:
        worker = choice.worker
        self.prefix_index.record(worker.worker_id, choice.hashes, worker.num_kv_blocks)
        self._prefill_tokens[worker.worker_id] += num_tokens - choice.cached_tokens

    def prefill_done(self, choice: PrefillChoice, num_tokens: int) -> None:
        self._prefill_tokens[choice.worker.worker_id] -= num_tokens - choice.cached_tokens
        if self._prefill_tokens[choice.worker.worker_id] <= 0:
            del self._prefill_tokens[choice.worker.worker_id]

    def decode_started(self, worker: WorkerEntry) -> None:
        self._requests[worker.worker_id] += 1

    def decode_done(self, worker: WorkerEntry) -> None:
        self._requests[worker.worker_id] -= 1
        if self._requests[worker.worker_id] <= 0:
            del self._requests[worker.worker_id]

    def forget(self, worker_id: str) -> None:
        """The worker left the registry."""
        self.prefix_index.forget(worker_id)
        self._requests.pop(worker_id, None)
        self._prefill_tokens.pop(worker_id, None)
