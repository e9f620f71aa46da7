"""What the frontend shares with every request's flow: the registry view, the router, the
worker channels, and the migration limits from ``FrontendConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.router import Router


@dataclass
class Routing:
    """What the frontend shares with every request: registry view, router, channels, how many
    times a request may move to another decode worker, and how long it waits for one when none
    is left (``FrontendConfig.max_migrations`` and ``migration_wait_s``)."""

    view: RegistryView
    router: Router
    channels: WorkerChannels
    max_migrations: int = 2
    migration_wait_s: float = 30.0
