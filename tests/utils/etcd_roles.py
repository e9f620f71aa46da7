"""etcd's own auth, set up the way README's Security section tells an operator to: a root user,
one role per pdserve component with the key ranges it needs, users bound to them, auth on.

Done over etcd's Auth gRPC API (aetcd's stubs): the etcdctl binary is not installed here.
"""

from __future__ import annotations

import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end

from pdserve.discovery.registry import ROOT
from pdserve.rpc.tls import ClientTLS, secure_or_insecure_channel

READ, WRITE, READWRITE = rpc.Permission.READ, rpc.Permission.WRITE, rpc.Permission.READWRITE

# role -> (permission, key prefix): what README: Security documents for each component.
ROLES = {
    "pdserve-worker": [(READWRITE, f"{ROOT}/workers/"), (READ, f"{ROOT}/knobs/")],
    "pdserve-frontend": [(READ, f"{ROOT}/workers/"), (READWRITE, f"{ROOT}/frontends/"), (READ, f"{ROOT}/knobs/")],
    "pdserve-planner": [(READ, f"{ROOT}/"), (READWRITE, f"{ROOT}/knobs/"), (READWRITE, f"{ROOT}/planner/")],
    "pdserve-operator": [(READ, f"{ROOT}/"), (READWRITE, f"{ROOT}/slo/"), (READWRITE, f"{ROOT}/knobs/")],
}


async def enable_auth(
    url_host_port: str, tls: ClientTLS | None, root_password: str, users: dict[str, tuple[str, str]]
) -> None:
    """Create ``ROLES``, ``users`` (name -> (password, role)) and root, then enable auth."""
    async with secure_or_insecure_channel(url_host_port, tls) as channel:
        auth = rpc.AuthStub(channel)
        for role, permissions in ROLES.items():
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=5)
            for permission, prefix in permissions:
                key = prefix.encode()
                perm = rpc.Permission(permType=permission, key=key, range_end=prefix_range_end(key))
                await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm), timeout=5)
        for name, (password, role) in {**users, "root": (root_password, "root")}.items():
            await auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), timeout=5)
            try:
                await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=role), timeout=5)
            except grpc.aio.AioRpcError as error:
                if role != "root":  # etcd 3.4 knows the root role without being told; others must exist
                    raise
                del error
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
