"""A real redis-server for tests: started on a free 127.0.0.1 port, persistence off, stopped by the test."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
needs_redis_server = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server not found: install the Debian package redis-server (scripts/setup.sh does)",
)


class RedisServer:
    """A redis-server process on a free 127.0.0.1 port, its files in `root`, persistence off."""

    def __init__(self, root: Path, maxmemory: str = "0") -> None:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # another process may take the free port before the server binds it
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.proc = subprocess.Popen(
                [
                    REDIS_SERVER,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(root),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--maxmemory",
                    maxmemory,
                    "--maxmemory-policy",
                    "allkeys-lru",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
        raise RuntimeError("redis-server did not start on a free port in 5 tries")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                return self.client().ping()
            except redis.ConnectionError:
                time.sleep(0.02)
        return False

    def kill(self) -> None:
        """`kill -9`: the server goes away mid-whatever, as a crashed or partitioned one would."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
