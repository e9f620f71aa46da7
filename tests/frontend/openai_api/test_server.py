"""The HTTP server's start-up: what it loads before the first request instead of during it."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter, so that nothing imported the backend before.
_PROGRAM = """
import asyncio, sys
from starlette.applications import Starlette
from pdserve.frontend.openai_api.server import HttpServer

async def main():
    server = HttpServer(Starlette())
    await server.start("127.0.0.1", 0)
    loaded = "anyio._backends._asyncio" in sys.modules
    await server.stop()
    print(loaded)

asyncio.run(main())
"""


def test_start_loads_anyios_backend_before_any_request():
    done = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True"
