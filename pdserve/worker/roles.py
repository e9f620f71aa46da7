"""The service each worker role runs."""

from pdserve.discovery.registry import Role
from pdserve.worker.decode import DecodeService
from pdserve.worker.prefill import PrefillService

SERVICES = {Role.PREFILL: PrefillService, Role.DECODE: DecodeService}
