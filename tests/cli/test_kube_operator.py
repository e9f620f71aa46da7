"""``pdserve operator`` without the k8s extra: one line naming the install command, exit code 2."""

from __future__ import annotations

import subprocess
import sys

# sys.modules[name] = None makes `import name` fail as if the package were not installed.
WITHOUT_K8S = """
import sys
sys.modules["kopf"] = None
sys.modules["kubernetes"] = None
from pdserve.cli import main
sys.exit(main(["operator", "--metrics-port=-1", "--health-port=-1"]))
"""


def test_the_operator_without_the_k8s_extra_names_the_install_command() -> None:
    result = subprocess.run([sys.executable, "-c", WITHOUT_K8S], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "pdserve operator: error: the operator needs the 'kopf' package, in pdserve's k8s extra: "
        "pip install 'pdserve[k8s]'"
    ]
