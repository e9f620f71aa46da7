"""A data-parallel group is one failure domain to the router (``pdserve.frontend.groups``), on
hand-made registry entries: a request that failed on a rank never goes to a sibling, a group
missing a rank or draining one gets nothing new, and the ranks of whole groups share the load."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from pdserve.discovery.registry import WorkerEntry
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.groups import available, incomplete_groups, siblings
from pdserve.frontend.router import NoWorker, Router
from tests.frontend.test_router import entry


def rank(worker_id: str, role: str, group_id: str, group_rank: int, size: int = 2, **load: int) -> WorkerEntry:
    """Rank ``group_rank`` of the data-parallel group ``group_id`` of ``size`` ranks."""
    return msgspec.structs.replace(
        entry(worker_id, role, **load), group_id=group_id, group_size=size, group_rank=group_rank
    )


def test_migration_never_picks_a_sibling_of_the_failed_rank():
    router = Router(RouterConfig(), seed=0)
    # The failed group's other rank is idle and would win on load alone.
    a0, a1 = rank("a", "decode", "a", 0, running=4), rank("a-dp1", "decode", "a", 1)
    other = entry("b", "decode", running=6, kv_blocks_used=60)
    assert router.choose_decode([a0, a1, other]).worker_id == "a-dp1"
    for failed in ("a", "a-dp1"):  # either rank, still registered
        assert router.choose_decode([a0, a1, other], exclude=[failed]).worker_id == "b"
    assert router.choose_decode([a1, other], exclude=["a"]).worker_id == "b"  # rank 0 already gone
    assert router.choose_decode([a0, other], exclude=["a-dp1"]).worker_id == "b"  # rank 1 already gone
    with pytest.raises(NoWorker):  # no other group: wait for one rather than go to a sibling
        router.choose_decode([a0, a1], exclude=["a-dp1"])


def test_a_prefill_retry_never_picks_a_sibling_of_the_failed_rank():
    router = Router(RouterConfig(disaggregation="always"), seed=0)
    p0, p1 = rank("p", "prefill", "p", 0), rank("p-dp1", "prefill", "p", 1)
    other = entry("q", "prefill", queued_prefill_tokens=500)
    prompt = list(range(20))
    assert router.choose_prefill([p0, p1, other], prompt).worker.group_id == "p"
    assert router.choose_prefill([p0, p1, other], prompt, exclude=["p"]).worker.worker_id == "q"
    with pytest.raises(NoWorker):
        router.choose_prefill([p0, p1], prompt, exclude=["p"])


def test_an_incomplete_group_gets_no_new_requests():
    router = Router(RouterConfig(disaggregation="always"), seed=0)
    busy = entry("b", "decode", running=7, kv_blocks_used=90)
    alone = rank("a", "decode", "a", 0)  # its other rank is not (or no longer) registered
    assert incomplete_groups([alone, busy]) == {"a"}
    assert router.choose_decode([alone, busy]).worker_id == "b"
    draining = [rank("c", "decode", "c", 0), rank("c-dp1", "decode", "c", 1)]
    draining[1] = msgspec.structs.replace(draining[1], draining=True)  # a stop reached the group
    assert incomplete_groups([*draining, busy]) == {"c"}
    assert router.choose_decode([*draining, busy]).worker_id == "b"
    with pytest.raises(NoWorker):
        router.choose_decode([alone, *draining])
    p0 = rank("p", "prefill", "p", 0, size=3)
    p1 = rank("p-dp1", "prefill", "p", 1, size=3)
    with pytest.raises(NoWorker):  # two of its three ranks: still starting, or failing
        router.choose_prefill([p0, p1], list(range(20)))


def test_routing_balances_over_the_ranks_of_whole_groups_as_over_any_workers():
    router = Router(RouterConfig(), seed=0)
    workers = [rank("a", "decode", "a", 0), rank("a-dp1", "decode", "a", 1), entry("s", "decode")]
    assert incomplete_groups(workers) == set()
    assert available(workers) == workers
    chosen = Counter()
    for _ in range(6):
        worker = router.choose_decode(workers)
        router.decode_started(worker)
        chosen[worker.worker_id] += 1
    assert chosen == {"a": 2, "a-dp1": 2, "s": 2}  # each rank by its own load


def test_siblings_are_the_failed_workers_groups_and_a_worker_alone_is_its_own():
    workers = [rank("a", "decode", "a", 0), rank("a-dp1", "decode", "a", 1), entry("b", "decode")]
    assert siblings(workers, ["a-dp1"]) == {"a", "a-dp1"}
    assert siblings(workers, ["b"]) == {"b"}
    assert siblings(workers, ["gone"]) == {"gone"}
    assert siblings(workers[1:], ["a"]) == {"a", "a-dp1"}  # rank 0's id is its group's
