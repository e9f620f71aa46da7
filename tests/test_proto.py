"""The committed generated code of proto/pdserve/v1 must be what scripts/gen_proto.sh makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        cwd=ROOT,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "pdserve/v1").iterdir()}
    committed = {p.name: p.read_bytes() for p in (ROOT / "pdserve/v1").iterdir() if p.name in fresh}
    assert fresh, "gen_proto.sh generated nothing"
    stale = sorted(name for name in fresh if committed.get(name) != fresh[name])
    assert not stale, f"pdserve/v1 is stale ({', '.join(stale)}): run scripts/gen_proto.sh and commit"
