"""pdserve on a real one-node Kubernetes cluster: the image built here, the chart installed, and
pods that serve, scale and heal (scripts/k8s_cluster.sh, scripts/k8s_scenarios.py).

The cluster needs root and the packages scripts/setup.sh installs; when it cannot be built
these tests fail with the reason, never skip. Its first build (Kubernetes' node binaries and
the images) takes several minutes; later runs reuse the per-machine cache.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "k8s_cluster.sh"
STATE = Path("/var/lib/pdserve-k8s")
UP_TIMEOUT_S = 3600  # a cold build of the node binaries and the images included
SCENARIOS_TIMEOUT_S = 1800

# The whole module, a cold build of the node binaries and images included, under one deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S + SCENARIOS_TIMEOUT_S + 600)]


def cluster(command: str, timeout_s: float = UP_TIMEOUT_S) -> str:
    """``k8s_cluster.sh COMMAND``'s last line; fails with its output when it fails."""
    done = subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        pytest.fail(
            f"k8s_cluster.sh {command} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def machine() -> dict[str, object]:
    """What the cluster must not leave behind: namespaces, mounts, files and processes."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return {
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "mounts": sorted(line.split()[4] for line in mounts),
        "etc_netns": os.path.exists("/etc/netns/pdserve-k8s"),
        "state": STATE.exists(),
        "models": os.path.exists("/var/lib/pdserve/models"),
        "cgroups": sorted(glob.glob("/sys/fs/cgroup/*/k8s.io")),
        "processes": sorted(
            line
            for line in processes.splitlines()
            if str(STATE) in line or "/opt/pdserve/bin/pdserve" in line or line.strip() == "/pause"
        ),
    }


@pytest.fixture(scope="module")
def kubeconfig() -> Iterator[str]:
    """A cluster, up for the module; on the way, ``up`` then ``down`` once more, so that the
    module runs up/down twice and checks both times that the machine is as it was."""
    if os.geteuid() != 0:
        pytest.fail("the Kubernetes cluster tests need root (network namespaces, mounts, containerd)")
    if STATE.exists():
        cluster("down")  # what an interrupted run left
    before = machine()
    assert Path(cluster("up")).is_file()
    assert machine() != before
    cluster("down")
    assert machine() == before
    path = cluster("up")
    yield path
    cluster("down")
    assert machine() == before


def test_scenarios(kubeconfig: str) -> None:
    """Every scenario; uninstall and namespaced last (they remove the chart and install it again)."""
    names = [
        "serve",
        "scale",
        "kill-decode",
        "roll",
        "etcd-restart",
        "planner",
        "secured",
        "group",
        "uninstall",
        "namespaced",
    ]
    done = subprocess.run(
        ["bash", str(CLUSTER), "exec", sys.executable, str(REPO / "scripts" / "k8s_scenarios.py"), "--json", *names],
        capture_output=True,
        text=True,
        timeout=SCENARIOS_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(results) == names
    print(json.dumps(results, indent=1))
