"""Worker groups as the router sees them: one failure domain over several registry entries.

A data-parallel group registers each rank as a worker of its own (its endpoint, load, lease
and KV geometry), and names the group on each entry: ``group_id`` (rank 0's worker id),
``group_size`` (its ranks). Its ranks step in lockstep, so one rank's death fails them all,
and the group restarts as a whole. A worker with no ``group_id`` is a group of one.

The rules the router applies to every choice of a worker for a request (a first try, a
prefill retry, a migration):

- A group with a failed worker is failed: none of its workers is chosen to replace the failed
  one (``siblings``). The failed worker's group is known from its entry while it is still
  registered, or from its id when it was rank 0; a failed rank that has already left the
  registry leaves its group incomplete, which the next rule covers.
- An incomplete group gets no new requests: one with fewer registered ranks than its
  ``group_size`` (failing, or still starting), or with any rank draining (stopping as a whole).
  Requests in flight on it go on; nothing here touches them.
- The ranks of complete groups are candidates like any worker: routing balances over them by
  each rank's own load.

Imports nothing but the registry's entry type.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from pdserve.discovery.registry import WorkerEntry


def group_of(worker: WorkerEntry) -> str:
    """The failure domain ``worker`` belongs to: its group's id, or its own for a worker alone."""
    return worker.group_id or worker.worker_id


def siblings(workers: Iterable[WorkerEntry], failed_ids: Iterable[str]) -> set[str]:
    """The ids of ``workers`` in the group of any of ``failed_ids``, those failed included."""
    failed = set(failed_ids)
    workers = list(workers)
    failed_groups = failed | {group_of(w) for w in workers if w.worker_id in failed}
    return failed | {w.worker_id for w in workers if group_of(w) in failed_groups}


def incomplete_groups(workers: Iterable[WorkerEntry]) -> set[str]:
    """The groups (``group_of``) of ``workers`` that must get no new requests: fewer ranks
    registered than their size, or a rank draining."""
    ranks: defaultdict[str, set[str]] = defaultdict(set)
    size: dict[str, int] = {}
    draining: set[str] = set()
    for w in workers:
        group = group_of(w)
        ranks[group].add(w.worker_id)
        size[group] = max(size.get(group, 1), w.group_size)
        if w.draining:
            draining.add(group)
    return draining | {group for group, ids in ranks.items() if len(ids) < size[group]}


def available(workers: Sequence[WorkerEntry], exclude: Iterable[str] = ()) -> list[WorkerEntry]:
    """The workers that may take a new request: not draining, of a complete group, and not of
    the group of any worker in ``exclude`` (those that failed the request)."""
    avoided = siblings(workers, exclude)
    incomplete = incomplete_groups(workers)
    return [w for w in workers if w.worker_id not in avoided and group_of(w) not in incomplete]
