"""The scaling connector of ``pdserve up --autoscale``: worker processes on this machine."""

from __future__ import annotations

import asyncio
import logging

from pdserve.discovery.registry import Role
from pdserve.launch.local_cluster import LocalCluster
from pdserve.planner.scaling import ScalingConnector

logger = logging.getLogger(__name__)


class LocalConnector(ScalingConnector):
    """Starts and drains ``LocalCluster`` workers.

    ``scale`` returns at once, as the interface asks: starting a worker takes seconds (the
    model loads) and draining one waits for its requests, and the planner must not stall
    meanwhile. Scalings run one after another in a task this connector owns; ``close``
    waits for the one under way.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._wanted: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    async def current(self) -> tuple[int, int]:
        if self._wanted is not None:
            return self._wanted
        return len(self.cluster.workers[Role.PREFILL]), len(self.cluster.workers[Role.DECODE])

    async def scale(self, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 1:
            raise ValueError(f"need prefill >= 0 and decode >= 1, got prefill={prefill}, decode={decode}")
        self._wanted = (prefill, decode)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._converge(), name="local scaling")

    async def _converge(self) -> None:
        # Re-read the wish after each pass: a newer decision may have come in meanwhile.
        while self._wanted is not None:
            wanted = self._wanted
            try:
                await self.cluster.scale(*wanted)
            except Exception:
                logger.exception("could not scale to %d prefill + %d decode workers", *wanted)
                self._wanted = None
                return
            logger.info("scaled to %d prefill + %d decode workers", *wanted)
            if self._wanted == wanted:
                self._wanted = None

    async def close(self) -> None:
        """Let the scaling under way finish (the cluster's own stop then drains everything)."""
        if self._task is not None:
            self._wanted = None
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
