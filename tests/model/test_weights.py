"""Weight loading: what stays resident after the model is built."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from pdserve.model.weights import Checkpoint


def _rss_file_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_close_drops_the_read_pages_and_views_still_read_the_file(tmp_path):
    weight = torch.randn(4096, 4096)  # 64 MiB
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path, device=torch.device("cpu"), dtype=torch.float32, show_progress=False)
    view = ckpt.get("w", (4096, 4096))
    before = _rss_file_mib()
    assert torch.equal(view, weight)  # reads every page
    assert _rss_file_mib() - before > 48
    ckpt.close()
    assert _rss_file_mib() - before < 16, "the mapped pages should have left the resident set"
    assert torch.equal(view, weight), "a view still reads the file's values after close"
