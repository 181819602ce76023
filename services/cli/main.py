"""The ``llmesh`` command: start a mesh, stream a completion, list models.

``llmesh up``            starts tokenizer, cache, engine(s), router and Envoy,
                         prints how to call them, runs until Ctrl-C/SIGTERM.
``llmesh generate TEXT`` streams a completion through Envoy (chat by default).
``llmesh models``        lists the served models.
``llmesh bench``         measures TTFT, TPOT, ITL, latency and throughput of llmesh
                         or an OpenAI-compatible server (``services.bench``).
``llmesh keys new``      mints an API key for a tenant: the key once on stdout, the
                         entry for the key file (its SHA-256 only) after it;
                         ``llmesh keys hash`` hashes a key read from stdin.

``generate`` and ``models`` send ``LLMESH_API_KEY`` (when set) as
``authorization: Bearer``; ``up --api-keys FILE`` turns keys on at the router,
and a SIGHUP to ``llmesh up`` reloads the file (it is passed to the router).

Exit codes: 0 ok; 1 the call or the mesh failed (message on stderr, with the
gRPC status name); 2 bad usage or a port already in use (a bad value in an
``LLMESH_*`` variable is bad usage: the refusal names the variable and the
value); 130 interrupted ``generate``; 141 stdout's reader went away
(``llmesh generate ... | head -1``: the stream is cancelled, nothing more is
printed, as a Unix tool that SIGPIPE ends).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.broken_pipe import leave_quietly
from services.common.cli_args import (
    env_checked,
    env_default,
    env_refusal,
    non_negative_float,
    positive_float,
)
from services.common.tracing import otlp_endpoint
from services.router.cascade.flags import add_arguments as add_cascade_arguments
from services.router.cascade.flags import problem as cascade_problem
from services.router.cascade.flags import router_args as cascade_router_args
from services.router.history.flags import add_history_arguments
from services.router.history.flags import problem as history_problem
from services.router.history.flags import router_flags as history_router_args

if TYPE_CHECKING:
    from services.cli.mesh import MeshProgress
    from services.engine.config import EngineConfig

DEFAULT_URL = "127.0.0.1:8080"
EXAMPLE_QUESTION = "What is the capital of France?"
ROLES = ("tokenizer", "cache", "retriever", "engine", "router")


def _positive_seconds(text: str) -> float:
    """A deadline in seconds, > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _ranged_int(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[low, high]`` (a usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be in [{low}, {high}], got {value}")
        return value
    parse.__name__ = what
    return parse


def _model_spec(text: str):  # -> services.cli.mesh.ModelSpec
    """``NAME=PATH`` (argparse type of ``llmesh up --model``)."""
    from services.cli.mesh import ModelSpec

    try:
        return ModelSpec.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_port = _ranged_int(0, 65535, "port")
_int32_positive = _ranged_int(1, 2**31 - 1, "count")
_int32_non_negative = _ranged_int(0, 2**31 - 1, "count")
_uint64 = _ranged_int(0, 2**64 - 1, "seed")


def grpc_target(url: str) -> str:
    """``host:port`` from ``host:port``, ``http://host:port/`` or ``https://host:port/``."""
    for scheme in ("http://", "https://", "grpc://"):
        url = url.removeprefix(scheme)
    return url.rstrip("/")


def client_credentials(url: str | None, cacert: str | None,
                       environ: Mapping[str, str] | None = None):  # -> ChannelCredentials | None
    """TLS credentials for ``llmesh generate`` / ``models``, or None (cleartext).

    TLS when the address (``--url``, else ``LLMESH_URL``) starts with
    ``https://`` or a CA is given (``--cacert``, else ``LLMESH_CACERT``, e.g.
    ``RUN_DIR/tls/ca.crt`` that ``llmesh up --tls-self-signed`` prints); the
    server is verified against that CA, else the system roots.

    Raises:
      ValueError: the CA file cannot be read (one line naming it, and
        ``LLMESH_CACERT`` with its value when the file came from there).
    """
    import grpc

    env = os.environ if environ is None else environ
    address = url or env.get("LLMESH_URL") or ""
    from_env = not cacert and bool(env.get("LLMESH_CACERT"))
    cacert = cacert or env.get("LLMESH_CACERT") or None
    if not (address.startswith("https://") or cacert):
        return None
    roots = None
    if cacert:
        try:
            with open(cacert, "rb") as file:
                roots = file.read()
        except OSError as error:
            why = f"cannot read it ({error.strerror})"
            raise ValueError(env_refusal("LLMESH_CACERT", cacert, why) if from_env
                             else f"--cacert {cacert}: {why}") from None
    return grpc.ssl_channel_credentials(root_certificates=roots)


_client_port = _ranged_int(1, 65535, "port")


def mesh_address(url: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The address ``llmesh generate`` / ``models`` call, ``host:port``: ``--url``
    (``url``), else ``LLMESH_URL``, else ``127.0.0.1:$LLMESH_PORT`` (the port
    ``llmesh up`` binds its ingress to), else :data:`DEFAULT_URL`.

    Raises:
      ValueError: ``LLMESH_PORT`` is used and is not a port in [1, 65535];
        ``--url`` or ``LLMESH_URL`` holds no address (``http://``, a space).
    """
    env = os.environ if environ is None else environ
    if url:
        return _checked_target(url, "--url")
    if env.get("LLMESH_URL"):
        return _checked_target(env["LLMESH_URL"], "LLMESH_URL")
    port = env.get("LLMESH_PORT")
    if not port:
        return DEFAULT_URL
    try:
        return f"127.0.0.1:{_client_port(port)}"
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"LLMESH_PORT: {error} (or give the mesh address with --url / "
                         "LLMESH_URL)") from None


def _checked_target(url: str, source: str) -> str:
    """:func:`grpc_target` of ``url``, which came from ``source`` (``--url``
    or ``LLMESH_URL``).

    Raises:
      ValueError: no host in it, a space, another scheme, or a port that is
        not an integer in [1, 65535] (gRPC would fail the call with an
        INTERNAL or UNAVAILABLE that does not say where the address came
        from, or dial the port modulo 65,536).
    """
    target = grpc_target(url)
    if target and not any(char.isspace() for char in target) and "://" not in target:
        try:  # urlsplit: an unclosed IPv6 bracket; .port: text or a port over 65535
            parts = urllib.parse.urlsplit(f"//{target}")
            host, port = parts.hostname, parts.port
        except ValueError:
            host, port = None, None
        if host and (port is None or 1 <= port <= 65535):
            return target
    why = "expected host:port, http://host:port or https://host:port (port 1-65535)"
    raise ValueError(f"--url {url!r}: {why}" if source == "--url"
                     else env_refusal(source, url, why))


def client_examples(address: str, question: str = EXAMPLE_QUESTION, *, tls: bool = False,
                    cacert: str | None = None, api_keys: bool = False) -> list[str]:
    """Shell lines that call a mesh at ``address`` (``host:port``), as printed
    by ``llmesh up``: the llmesh CLI, grpcurl (gRPC, via reflection), curl
    (JSON through Envoy's transcoder; the reply is one JSON array) and curl to
    the OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``).
    ``tls``: the ingress speaks TLS (``https://``; ``cacert`` is the CA file
    the clients are told to trust, None: the system roots). ``api_keys``: the
    mesh wants a key; the lines send ``$LLMESH_API_KEY`` (the llmesh CLI reads
    that variable itself) after a line that says to set it."""
    openai_body = json.dumps(
        {"messages": [{"role": "user", "content": question}], "max_tokens": 64,
         "stream": True}, separators=(",", ":"))
    body = json.dumps(
        {"chat": {"messages": [{"role": "user", "content": question}]},
         "sampling": {"max_tokens": 64}},
        separators=(",", ":"),
    )
    scheme = "https" if tls else "http"
    ca = f" --cacert {shlex.quote(cacert)}" if tls and cacert else ""
    if tls:
        url_flag = f" --url https://{address}{ca}"
        grpcurl = f"grpcurl -cacert {shlex.quote(cacert)}" if cacert else "grpcurl"
    else:
        url_flag = "" if address == DEFAULT_URL else f" --url {address}"
        grpcurl = "grpcurl -plaintext"
    key = ' -H "authorization: Bearer $LLMESH_API_KEY"' if api_keys else ""
    return [
        *(["export LLMESH_API_KEY='<your key>'  # one of the --api-keys file's (llmesh keys new)"]
          if api_keys else []),
        f"llmesh generate{url_flag} {shlex.quote(question)}",
        f"{grpcurl}{key} -d {shlex.quote(body)} {address} "
        "llmesh.v1.GenerationService/Generate",
        f"curl{ca}{key} -sN -X POST {scheme}://{address}/v1/generate "
        f"-H 'content-type: application/json' -d {shlex.quote(body)}",
        f"curl{ca}{key} -s {scheme}://{address}/v1/models",
        f"curl{ca}{key} -sN {scheme}://{address}/v1/chat/completions "
        f"-H 'content-type: application/json' -d {shlex.quote(openai_body)}",
    ]


# -- llmesh up ---------------------------------------------------------------


class _ProgressPrinter:
    """Prints mesh start progress to stderr; 'loading' only on change or every 5 s."""

    def __init__(self) -> None:
        self._last_waiting: tuple[str, ...] | None = None
        self._last_print = 0.0

    def __call__(self, event: MeshProgress) -> None:
        if event.stage == "loading":
            changed = event.waiting != self._last_waiting
            if not changed and event.elapsed_s - self._last_print < 5.0:
                return
            self._last_waiting = event.waiting
            message = (f"waiting for {', '.join(event.waiting)} to load "
                       f"({event.elapsed_s:.0f} s)")
        else:
            message = event.message
        self._last_print = event.elapsed_s
        print(f"llmesh: [{event.elapsed_s:5.1f}s] {message}", file=sys.stderr, flush=True)


def _role_commands() -> dict[str, list[str]]:
    """``LLMESH_<ROLE>_COMMAND`` overrides (shell-split), e.g. to profile one service.

    Raises:
      ValueError: a value the shell could not split either (an unclosed
        quote), one that splits into nothing, or one whose program does not
        exist (a name looked up in PATH, a path relative to the checkout);
        the message names the variable and its value.
    """
    commands = {}
    for role in ROLES:
        variable = f"LLMESH_{role.upper()}_COMMAND"
        value = os.environ.get(variable)
        if not value:
            continue
        try:
            commands[role] = shlex.split(value)
        except ValueError as error:  # shlex's "No closing quotation"
            raise ValueError(env_refusal(variable, value, f"{error} (shell quoting)")) from None
        if not commands[role]:
            raise ValueError(env_refusal(variable, value, "names no command"))
        from services.cli.mesh import REPO_ROOT, program_found
        if not program_found(commands[role][0], REPO_ROOT, os.environ.get("PATH")):
            raise ValueError(env_refusal(variable, value,
                                         f"no such program: {commands[role][0]}"))
    return commands


def _environment_problem() -> str | None:
    """What the mesh's services would refuse in the environment they inherit
    from ``llmesh up``, in one line naming the variable and its value (None:
    nothing): ``LLMESH_LOG_LEVEL`` (every service's ``--log-level``
    default) and ``LLMESH_<ROLE>_COMMAND``. (``LLMESH_PORT`` and
    ``LLMESH_ADMIN_PORT`` are up's own flags' defaults; ``LLMESH_ENGINE_*``
    and ``LLMESH_MODEL_PATH``: :func:`_engine_problem`.)"""
    from services.common.logging import LOG_LEVEL_ENV, log_level

    try:
        log_level(env_default(LOG_LEVEL_ENV, "info"))
        _role_commands()
    except (argparse.ArgumentTypeError, ValueError) as error:
        return str(error)
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _forward_to_router(mesh: object, signum: int) -> None:
    """Passes a signal (SIGHUP: reload the API key file) to the router process."""
    router = getattr(mesh, "services", {}).get("router")
    if router is not None and router.process is not None and router.process.poll() is None:
        os.kill(router.pid, signum)


def cmd_up(args: argparse.Namespace) -> int:
    """Runs the mesh until Ctrl-C/SIGTERM (a service that dies is started again,
    see :func:`_supervise`)."""
    from services.cli.mesh import Mesh, MeshStartError, PortInUseError

    engine_args = list(args.engine_arg)
    for flag in ("backend", "device", "dtype", "quantization"):
        if getattr(args, flag):
            engine_args += [f"--{flag}", getattr(args, flag)]
    router_args = _router_args(args)
    problem = (_environment_problem() or _up_problem(args, engine_args)
               or _pass_through_problem(router_args, list(args.retriever_arg))
               or _launcher_owned_problem(args))
    if problem:
        print(f"llmesh: {problem}", file=sys.stderr)
        return 2
    mesh = Mesh(
        ingress_host=args.host, ingress_port=args.port, admin_port=args.admin_port,
        model_path=args.model_path, models=args.models, redis_url=args.redis_url,
        run_dir=args.run_dir,
        num_engines=args.engines, engine_args=engine_args, router_args=router_args,
        retrieval=args.retrieval, retriever_args=list(args.retriever_arg),
        # The retriever checks no keys: with them on, its API is not on the ingress.
        retriever_on_ingress=args.api_keys is None,
        drain_seconds=args.drain_seconds, start_timeout_s=args.start_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout, commands=_role_commands(),
        ops_port=args.ops_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_self_signed=args.tls_self_signed, plaintext_port=args.plaintext_port,
        internal_mtls=args.internal_mtls, otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    # Both explicitly: a launcher started in the background of a non-interactive
    # shell (``llmesh up &``) inherits SIGINT ignored, which Python keeps.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGHUP, lambda signum, frame: _forward_to_router(mesh, signum))
    try:
        try:
            mesh.start(_ProgressPrinter())
        except PortInUseError as error:
            flag = {"ingress": "--port / LLMESH_PORT", "ops": "--ops-port",
                    "plaintext": "--plaintext-port"}.get(error.what,
                                                          "--admin-port / LLMESH_ADMIN_PORT")
            print(f"llmesh: {error}; choose another with {flag} (0 picks a free one)",
                  file=sys.stderr)
            return 2
        except MeshStartError as error:
            print(f"llmesh: start failed: {error}", file=sys.stderr)
            return 1
        _print_ready(mesh, api_keys=args.api_keys is not None)
        return _supervise(mesh, restart=args.restart)
    except KeyboardInterrupt:
        print("\nllmesh: stopping...", file=sys.stderr, flush=True)
        return 0
    finally:
        mesh.stop()
        if mesh.envoy is not None:
            print("llmesh: stopped", file=sys.stderr, flush=True)


def _up_problem(args: argparse.Namespace, engine_args: list[str]) -> str | None:
    """The first problem with ``llmesh up``'s flags (checked before any service
    starts), None when there is none."""
    from services.common.checkpoint import is_checkpoint_dir

    backend = _engine_backend(engine_args) or os.environ.get("LLMESH_ENGINE_BACKEND")
    if backend == "tensorrt_llm":
        from services.engine.tensorrt_llm_backend.availability import (
            INSTALL_HINT,
            tensorrt_llm_installed,
        )
        if not tensorrt_llm_installed():
            return INSTALL_HINT
    if args.models and args.model_path:
        return "give --model NAME=PATH (repeatable) or --model-path, not both"
    if len({m.name for m in args.models}) != len(args.models):
        return f"each --model needs its own NAME, got {[m.name for m in args.models]}"
    missing = [m.path for m in args.models
               if not (os.path.isfile(m.path) or is_checkpoint_dir(m.path))]
    if missing:
        return ("--model: no GGUF file or checkpoint directory (with config.json) "
                f"at {missing[0]}")
    problem = tls_flag_problem(args)
    if problem:
        return problem
    if args.api_keys is not None:
        from services.router.api_keys import KeyFileError, load_key_table
        if not os.path.isfile(args.api_keys):
            return f"--api-keys: no file at {args.api_keys}"
        try:  # as the router reads it, before anything starts (no key in the message)
            load_key_table(args.api_keys)
        except KeyFileError as err:
            return f"--api-keys: {err}"
    if args.retriever_arg and not args.retrieval:
        return "--retriever-arg needs --retrieval (no retriever is started without it)"
    problem = (cascade_problem(args, [m.name for m in args.models])
               or history_problem(args, [m.name for m in args.models]))
    if problem:
        return problem
    return _engine_problem(args, engine_args)


def _router_args(args: argparse.Namespace) -> list[str]:
    """The router's flags ``llmesh up`` adds to the ones the mesh sets:
    ``--router-arg``, then the cascade, history and API key flags."""
    router_args = [*args.router_arg, *cascade_router_args(args), *history_router_args(args)]
    if args.api_keys is not None:
        router_args += ["--api-keys", os.path.abspath(args.api_keys)]
    return router_args


def _pass_through_problem(router_args: list[str], retriever_args: list[str]) -> str | None:
    """What the router or the retriever would refuse in the flags ``llmesh
    up`` passes on to it (``--router-arg``, with the cascade, history and key
    flags; ``--retriever-arg``), checked with that service's own parser and
    configuration before anything starts: one line naming the flag, None
    when there is none. (The engines' flags: :func:`_engine_problem`.)"""
    from services.retriever.__main__ import pass_through_problem as retriever_problem
    from services.router.__main__ import pass_through_problem as router_problem

    problem = router_problem(router_args)
    if problem:
        return f"--router-arg: {problem}"
    problem = retriever_problem(retriever_args) if retriever_args else None
    return f"--retriever-arg: {problem}" if problem else None


#: Flags ``llmesh up`` sets on the services itself, each with where the user
#: sets it instead: passing one through (``--router-arg=--port=5``) would
#: break the wiring (a port file the launcher waits on, the upstream
#: addresses, the mesh's certificates, one replica id per engine).
_OWNED_EVERYWHERE = {
    "host": "the services listen where Envoy reaches them; the ingress: up's --host",
    "port": "each service gets a free port; the ingress: up's --port",
    "metrics_port": "each service gets a free one; `llmesh up` prints them when ready",
    "port_file": "the launcher reads it to find the service",
    "drain_seconds": "up's --drain-seconds",
    "tls_cert": "up's --internal-mtls issues each service's certificate",
    "tls_key": "up's --internal-mtls issues each service's certificate",
    "tls_ca": "up's --internal-mtls issues each service's certificate",
    "otlp_traces_endpoint": "up's --otlp-traces-endpoint",
}
_OWNED_BY_ROLE = {
    "router": {name: "the launcher wires the services itself; more engines: up's --engines"
               for name in ("tokenizer", "cache", "engine", "model_pool",
                            "retriever_address")}
    | {"openai_port": "the OpenAI API is on the ingress (up's --port)",
       "api_keys": "use up's --api-keys (it also keeps the retriever, which checks no "
                   "keys, off the ingress)"},
    "engine": {"model_path": "up's --model-path or --model NAME=PATH",
               "served_model_name": "up's --model NAME=PATH",
               "replica_id": "each engine gets its own, by which KV-aware routing tells them apart",
               "kv_events_target": "the engines publish to the mesh's cache service"},
    "retriever": {"data_dir": "it is RUN_DIR/retriever, see up's --run-dir"},
}


def _launcher_owned_problem(args: argparse.Namespace) -> str | None:
    """A flag in ``--engine-arg``, ``--router-arg`` or ``--retriever-arg``
    that ``llmesh up`` sets itself (resolved as the service's parser
    resolves it: ``--metrics-p=1`` is ``--metrics-port``): one line naming
    it and where to set it instead, None when there is none. Runs after the
    flags were checked with each service's parser."""
    from services.common.cli_args import CheckingParser, given_flags
    from services.engine.__main__ import build_parser as engine_parser
    from services.retriever.__main__ import build_parser as retriever_parser
    from services.router.__main__ import build_parser as router_parser

    for role, flag, argv, build in (("engine", "--engine-arg", args.engine_arg, engine_parser),
                                    ("router", "--router-arg", args.router_arg, router_parser),
                                    ("retriever", "--retriever-arg", args.retriever_arg,
                                     retriever_parser)):
        owned = _OWNED_EVERYWHERE | _OWNED_BY_ROLE[role]
        for dest, option in given_flags(build(CheckingParser), argv).items():
            if dest in owned:
                return f"{flag}: {option} is set by llmesh up itself; {owned[dest]}"
    return None


def _engine_problem(args: argparse.Namespace, engine_args: list[str]) -> str | None:
    """What every engine of ``llmesh up`` would refuse at its start, checked
    before anything starts, in one line (None: nothing): a flag or
    ``LLMESH_ENGINE_*`` variable its own parser refuses (``--kv-cache-bytes=1PiB``,
    an unknown flag; ``--engine-arg=--help`` prints the engine's help, as the
    router's does); an option or combination its backend refuses, with the
    engine's own message (:func:`services.engine.factory.check_backend_options`,
    for each model: ``--ngram-min`` above ``--ngram-max``, a speculative token
    count out of bounds, a ``--model-path`` that is no model); KV memory of
    all engines together beyond ``MemAvailable`` (:func:`_host_memory_problem`)."""
    from services.common.cli_args import ArgsRefused, CheckingParser
    from services.engine.__main__ import build_parser as engine_parser
    from services.engine.config import engine_config_from_args

    try:
        known = engine_parser(CheckingParser).parse_args(engine_args)
    except ArgsRefused as error:
        return f"--engine-arg: {error}"
    except ValueError as error:  # an LLMESH_ENGINE_* variable (it names itself)
        return str(error)
    config = engine_config_from_args(known)
    return (_backend_options_problem(config, [m.path for m in args.models] or [args.model_path])
            or _host_memory_problem(config, args.engines * max(1, len(args.models))))


def _backend_options_problem(config: EngineConfig, model_paths: Sequence[str | None]
                             ) -> str | None:
    """The engine's start-up refusal of ``config`` served with each of
    ``model_paths`` (None: the engine's default model), as
    ``python -m services.engine`` words it; None when it would start."""
    from services.engine.factory import check_backend_options

    for path in model_paths:
        try:
            check_backend_options(replace(config, model_path=None if path is None
                                          else Path(path)))
        except (ValueError, FileNotFoundError) as error:
            return f"the engines would refuse to start: {error}"
    return None


def _host_memory_problem(config: EngineConfig, num_engines: int) -> str | None:
    """Whether ``num_engines`` engines started with ``config`` would together
    fill more host memory with KV than ``MemAvailable``
    (:mod:`services.engine.host_memory`); each engine checks only itself
    when it starts."""
    from services.engine import host_memory

    try:
        host_memory.check_engines_host_memory(
            host_memory.host_kv_bytes(config), num_engines,
            host_memory.available_host_memory_bytes())
    except ValueError as error:
        return str(error)
    return None


def _engine_backend(engine_args: list[str]) -> str | None:
    """The ``--backend`` the engines will get (the last one given, as argparse
    takes it; ``--backend X`` or ``--backend=X``), or None (the engine's default)."""
    backend = None
    for index, arg in enumerate(engine_args):
        if arg == "--backend" and index + 1 < len(engine_args):
            backend = engine_args[index + 1]
        elif arg.startswith("--backend="):
            backend = arg.partition("=")[2]
    return backend


def tls_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``llmesh up``'s TLS flags, in one line (None: nothing),
    checked before anything starts: ``--tls-cert`` without ``--tls-key`` (or the
    reverse), with ``--tls-self-signed``, ``--plaintext-port`` without TLS, a
    file that cannot be read or holds no PEM, a key that is not the
    certificate's (:func:`services.common.tls_certs.check_key_pair`)."""
    from services.common.tls_certs import TlsFileError, check_key_pair

    if (args.tls_cert is None) != (args.tls_key is None):
        given, other = (("--tls-cert", "--tls-key") if args.tls_key is None
                        else ("--tls-key", "--tls-cert"))
        return f"{given} needs {other} too (or use --tls-self-signed)"
    if args.tls_self_signed and args.tls_cert is not None:
        return "give --tls-cert/--tls-key or --tls-self-signed, not both"
    if args.plaintext_port is not None and not (args.tls_self_signed or args.tls_cert):
        return "--plaintext-port is a cleartext port beside a TLS ingress: add --tls-cert/" \
               "--tls-key or --tls-self-signed (without TLS the ingress is cleartext already)"
    if args.tls_cert is not None:
        try:
            check_key_pair(args.tls_cert, args.tls_key)
        except TlsFileError as error:
            return str(error)
    return None


#: A service that dies this many times within RESTART_WINDOW_S seconds stops the mesh.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


def _supervise(mesh: object, *, restart: bool) -> int:
    """Waits on the mesh's children. A service (not Envoy) that exits is started
    again on its ports (``Mesh.restart``): the router takes a restarted engine
    back once it serves, and in-flight requests of a dead engine have already
    ended UNAVAILABLE. A service that fails to start again (killed while it
    starts, say) counts as one more death and is tried again. Envoy's exit,
    ``restart=False``, or a service dying ``MAX_RESTARTS`` times within
    ``RESTART_WINDOW_S`` stops the mesh. Returns the exit code (1)."""
    from services.cli.mesh import Mesh

    assert isinstance(mesh, Mesh)
    deaths = _Deaths()
    while True:
        dead = mesh.wait()
        what = ", ".join(f"{name} exited with code {code}" for name, code in dead.items())
        looping = [name for name in dead if deaths.add(name)]
        if not restart or "envoy" in dead or looping:
            if restart and looping and "envoy" not in dead:
                what += f"; {deaths.why(looping[0])}"
            print(f"llmesh: {what}; stopping (logs in {mesh.run_dir})",
                  file=sys.stderr, flush=True)
            return 1
        for name in dead:
            print(f"llmesh: {what}; restarting {name} (logs in {mesh.run_dir})",
                  file=sys.stderr, flush=True)
            if not _restart(mesh, name, deaths):
                return 1


class _Deaths:
    """Each service's exits within the last ``RESTART_WINDOW_S`` (monotonic s)."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}

    def add(self, name: str) -> bool:
        """Counts one exit of ``name``; True when it is its ``MAX_RESTARTS``-th
        within the window (a crash loop: stop)."""
        now = time.monotonic()
        times = [t for t in self._times.get(name, []) if now - t < RESTART_WINDOW_S]
        self._times[name] = [*times, now]
        return len(self._times[name]) >= MAX_RESTARTS

    @staticmethod
    def why(name: str) -> str:
        return f"{name} died {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f} s"


def _restart(mesh: object, name: str, deaths: _Deaths) -> bool:
    """Starts ``name`` again until it serves (True) or has failed
    ``MAX_RESTARTS`` times within the window, start failures included (False,
    after saying why)."""
    from services.cli.mesh import Mesh, MeshStartError

    assert isinstance(mesh, Mesh)
    while True:
        try:
            service = mesh.restart(name)
        except MeshStartError as error:
            if deaths.add(name):
                print(f"llmesh: {name} did not start again: {error}; {deaths.why(name)}; "
                      "stopping", file=sys.stderr, flush=True)
                return False
            print(f"llmesh: {name} did not start again: {error}; trying once more",
                  file=sys.stderr, flush=True)
            continue
        print(f"llmesh: {name} is SERVING again (pid {service.pid}, "
              f"{service.grpc_address})", file=sys.stderr, flush=True)
        return True


def _print_ready(mesh: object, *, api_keys: bool = False) -> None:
    from services.cli.mesh import Mesh

    assert isinstance(mesh, Mesh)
    lines = [
        f"llmesh is up in {mesh.startup_seconds:.1f} s: gRPC and HTTP/JSON on "
        f"{mesh.ingress_address}" + (" (TLS)" if mesh.tls else ""),
    ]
    if mesh.ca_path is not None:
        lines.append(f"  ca      {mesh.ca_path}  (clients: grpcurl -cacert / curl --cacert / "
                     f"export LLMESH_CACERT={mesh.ca_path})")
    if mesh.plaintext_address is not None:
        lines.append(f"  clear   {mesh.plaintext_address}  (cleartext listener, --plaintext-port)")
    if mesh.mesh_ca_path is not None:
        lines.append(f"  mtls    every internal gRPC hop; mesh CA {mesh.mesh_ca_path}")
    lines += [
        f"  ops     {mesh.ops_url}  (/stats/prometheus, /ready)",
        f"  admin   {mesh.admin_url}  (loopback only)",
        f"  logs    {mesh.run_dir}",
    ]
    for name, service in mesh.services.items():
        lines.append(f"  {name:<9} grpc {service.grpc_address}  metrics "
                     f"http://{service.metrics_address}/metrics  pid {service.pid}")
    assert mesh.envoy is not None
    lines.append(f"  {'envoy':<9} pid {mesh.envoy.pid}  config {mesh.envoy.config_path}")
    lines.append(f"  scrape    prometheus --config.file {mesh.prometheus_config}")
    lines.append("Try:")
    lines += [f"  {line}" for line in client_examples(
        mesh.ingress_address, tls=mesh.tls,
        cacert=None if mesh.ca_path is None else str(mesh.ca_path), api_keys=api_keys)]
    lines.append("Ctrl-C stops everything.")
    print("\n".join(lines), flush=True)


# -- llmesh generate / models ----------------------------------------------


def _request(args: argparse.Namespace):  # -> generation_pb2.GenerateRequest
    from llmesh.v1 import common_pb2, generation_pb2

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "seed": args.seed, "max_tokens": args.max_tokens,
    }
    request = generation_pb2.GenerateRequest(
        model=args.model,
        sampling=common_pb2.SamplingParams(
            **{k: v for k, v in sampling.items() if v is not None}, stop=args.stop
        ),
        priority=common_pb2.PRIORITY_BATCH if args.batch else common_pb2.PRIORITY_INTERACTIVE,
        bypass_cache=args.bypass_cache,
    )
    if args.raw:
        request.prompt = text
    else:
        if args.system:
            request.chat.messages.add(role="system", content=args.system)
        request.chat.messages.add(role="user", content=text)
    return request


def _rpc_error(error: object, target: str, args: argparse.Namespace) -> int:
    """Prints a failed call's status in one line, plus what to do about the
    usual causes; returns the exit code (1)."""
    import grpc

    assert isinstance(error, grpc.RpcError)
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    message = f"llmesh: {code.name}: {details}"
    hint = _rpc_error_hint(code.name, (details or "").lower(), target, args)
    print(message + (f"\n({hint})" if hint else ""), file=sys.stderr)
    return 1


def _rpc_error_hint(code: str, details: str, target: str, args: argparse.Namespace) -> str:
    """What to do about a failed call (``details`` in lower case); "" if nothing."""
    tls = (args.url or os.environ.get("LLMESH_URL") or "").startswith("https://")
    cacert = args.cacert or os.environ.get("LLMESH_CACERT")
    if code == "UNAUTHENTICATED":
        return ("the mesh wants an API key: export LLMESH_API_KEY=<key> (one of its "
                "--api-keys file's; llmesh keys new makes one)")
    if code != "UNAVAILABLE":
        return ""
    if "certificate_verify_failed" in details:
        if cacert:
            return (f"the CA in {cacert} did not sign the mesh's certificate: give the CA "
                    "`llmesh up` printed (RUN_DIR/tls/ca.crt with --tls-self-signed)")
        return ("the mesh's TLS certificate is not trusted: give its CA with --cacert or "
                "LLMESH_CACERT, e.g. RUN_DIR/tls/ca.crt of `llmesh up --tls-self-signed`")
    if not tls and "socket closed" in details:
        return (f"if the mesh on {target} serves TLS (`llmesh up --tls-*`), call it with "
                f"--url https://{target}")
    if "connect" in details:
        return f"is `llmesh up` running on {target}?"
    return ""


#: The line under the summary of an answer replayed from the response cache.
REPLAY_NOTE = ("llmesh: replayed from the response cache, not generated (no speed to "
               "report); --bypass-cache generates it anew")


def _summary(last, elapsed_s: float, ttft_s: float | None, chunks: int) -> str:
    """The stats line ``llmesh generate`` prints on stderr: ``[key=value ...]``.

    ``ttft_ms`` and ``tokens_per_s`` (completion tokens after the first over the
    time after the first text: 1 / vLLM's TPOT) describe a generation; an
    answer replayed from the response cache (``cached`` on the final message)
    says ``response_cache=replay`` instead, and :data:`REPLAY_NOTE` follows.
    """
    from llmesh.v1 import common_pb2

    reason = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    usage = last.usage
    parts = [
        f"finish={reason.lower()}",
        f"prompt_tokens={usage.prompt_tokens}",
        f"completion_tokens={usage.completion_tokens}",
        f"cached_prompt_tokens={usage.cached_prompt_tokens}",
    ]
    if last.matched_stop:
        parts.append(f"matched_stop={last.matched_stop!r}")
    if last.cached:
        parts.append("response_cache=replay")
    elif ttft_s is not None:
        parts.append(f"ttft_ms={ttft_s * 1000:.0f}")
        decode_s = elapsed_s - ttft_s
        if usage.completion_tokens > 1 and decode_s > 0:
            parts.append(f"tokens_per_s={(usage.completion_tokens - 1) / decode_s:.1f}")
    parts.append(f"total_ms={elapsed_s * 1000:.0f}")
    parts.append(f"request_id={last.request_id}")
    line = "[" + " ".join(parts) + "]"
    return f"{line}\n{REPLAY_NOTE}" if last.cached else line


def _connect(args: argparse.Namespace):  # -> tuple[str, grpc.Channel, metadata] | None
    """What ``llmesh generate`` / ``models`` call with: the mesh address
    (:func:`mesh_address`), a channel to it (TLS per
    :func:`client_credentials`) and the call metadata
    (:func:`api_key_metadata`); None after printing in one line why the
    flags or the environment cannot be used (the command exits 2)."""
    import grpc

    try:
        target = mesh_address(args.url)
        metadata = api_key_metadata()
        credentials = client_credentials(args.url, args.cacert)
    except ValueError as error:
        print(f"llmesh: {error}", file=sys.stderr)
        return None
    if credentials is None:
        return target, grpc.insecure_channel(target), metadata
    return target, grpc.secure_channel(target, credentials), metadata


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams one completion to stdout; summary on stderr."""
    import grpc

    from llmesh.v1 import generation_pb2_grpc

    connection = _connect(args)
    if connection is None:
        return 2
    target, channel, metadata = connection
    request = _request(args)
    with channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        started = time.monotonic()
        call = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        ttft_s, last, chunks, ends_newline = None, None, 0, True
        try:
            for response in call:
                if response.text:
                    if ttft_s is None:
                        ttft_s = time.monotonic() - started
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                    ends_newline = response.text.endswith("\n")
                    chunks += 1
                if response.finish_reason:
                    last = response
        except grpc.RpcError as error:
            if not ends_newline:
                sys.stdout.write("\n")
            return _rpc_error(error, target, args)
        except KeyboardInterrupt:
            call.cancel()
            sys.stdout.write("\n")
            print("llmesh: cancelled", file=sys.stderr)
            return 130
        except BrokenPipeError:  # stdout's reader left: no one reads the rest
            call.cancel()
            raise
        if not ends_newline:
            sys.stdout.write("\n")
        sys.stdout.flush()
        if last is not None:
            print(_summary(last, time.monotonic() - started, ttft_s, chunks), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Prints the served models (a table, or JSON with ``--json``)."""
    import grpc
    from google.protobuf import json_format

    from llmesh.v1 import generation_pb2, generation_pb2_grpc

    connection = _connect(args)
    if connection is None:
        return 2
    target, channel, metadata = connection
    with channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            reply = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=args.timeout,
                                    metadata=metadata)
        except grpc.RpcError as error:
            return _rpc_error(error, target, args)
    if args.json:
        print(json_format.MessageToJson(reply, preserving_proto_field_name=True))
        return 0
    print(f"{'MODEL':<32} {'CONTEXT':>8} {'MAX_TOKENS':>10} CHAT")
    for card in reply.models:
        print(f"{card.id:<32} {card.max_model_len:>8} {card.max_tokens_cap:>10} "
              f"{'yes' if card.chat else 'no'}")
    return 0


def cmd_keys_new(args: argparse.Namespace) -> int:
    """Mints a key: the key alone on stdout's first line (shown once: only its
    hash is kept), then the key-file entry to add."""
    from services.router.api_keys import hash_key, key_entry, mint_key, parse_key_table

    try:  # the same rule as the file's
        parse_key_table(json.dumps({"tenants": [{"id": args.tenant}]}))
    except ValueError as error:
        print(f"llmesh: --tenant: {str(error).split(': ', 2)[-1]}", file=sys.stderr)
        return 2
    key = mint_key()
    print(key)
    print(f"# The key above is shown once; the file keeps only its hash. Add to the "
          f"--api-keys file under `tenants:` (or add the hash to the keys of tenant "
          f"{args.tenant!r}), then send SIGHUP to the router:\n{key_entry(args.tenant, hash_key(key))}", end="")
    return 0


def cmd_keys_hash(args: argparse.Namespace) -> int:
    """Prints ``sha256:<hex>`` of the key on stdin (one line)."""
    from services.router.api_keys import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("llmesh: give the key on stdin", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def api_key_metadata(environ: Mapping[str, str] | None = None
                     ) -> tuple[tuple[str, str], ...] | None:
    """``authorization: Bearer $LLMESH_API_KEY`` when the variable is set
    (in ``environ``, default: the process environment).

    Raises:
      ValueError: the key holds a character a gRPC header value cannot
        carry (printable ASCII only; gRPC failed the call INTERNAL "Invalid
        metadata"); the message names the variable, never the key.
    """
    key = (os.environ if environ is None else environ).get("LLMESH_API_KEY")
    if not key:
        return None
    if not all(" " < char <= "~" for char in key):
        raise ValueError("LLMESH_API_KEY: a key is printable ASCII without spaces (as "
                         "`llmesh keys new` mints them); this one is not (not shown)")
    return (("authorization", f"Bearer {key}"),)


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs ``llmesh bench`` (``services.bench``)."""
    from services.bench.main import run

    return run(args)


# -- argument parsing --------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``llmesh`` argument parser (subcommands ``up``, ``generate``, ``models``, ``bench``)."""
    from services.bench.main import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="llmesh",
        description="llmesh: start a mesh, stream a completion, list models, benchmark.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser(
        "up", help="start the whole mesh behind Envoy and wait",
        description="Start tokenizer, cache, engine(s), router and Envoy; Ctrl-C stops them.",
        epilog="LLMESH_<ROLE>_COMMAND (ROLE: TOKENIZER, CACHE, ENGINE, ROUTER) replaces "
               "`python -m services.<role>` for that role, e.g. to run it under a profiler.",
    )
    up.add_argument("--host", default="127.0.0.1",
                    help="ingress bind address (default: %(default)s)")
    up.add_argument("--port", type=env_checked(_port), default=env_default("LLMESH_PORT", "8080"),
                    help="ingress port, gRPC + JSON; 0 = a free one (env LLMESH_PORT, "
                         "default: %(default)s)")
    up.add_argument("--admin-port", type=env_checked(_port),
                    default=env_default("LLMESH_ADMIN_PORT", "9901"),
                    help="Envoy admin port, always on 127.0.0.1 (env LLMESH_ADMIN_PORT, "
                         "default: %(default)s)")
    up.add_argument("--ops-port", type=_port, default=9902,
                    help="Envoy's read-only ops listener on --host: GET /stats/prometheus and "
                         "/ready only, for probes and Prometheus; 0 = a free one "
                         "(default: %(default)s)")
    up.add_argument("--tls-cert", default=None, metavar="FILE",
                    help="serve the ingress over TLS with this PEM certificate (chain); "
                         "needs --tls-key")
    up.add_argument("--tls-key", default=None, metavar="FILE",
                    help="the certificate's PEM private key (unencrypted)")
    up.add_argument("--tls-self-signed", action="store_true",
                    help="serve the ingress over TLS with a new CA and certificate for "
                         "localhost, 127.0.0.1, ::1 and --host, written to RUN_DIR/tls "
                         "(clients trust RUN_DIR/tls/ca.crt)")
    up.add_argument("--plaintext-port", type=_port, default=None,
                    help="with TLS, also a cleartext listener on this port (default: none)")
    up.add_argument("--internal-mtls", action="store_true",
                    help="mutual TLS on every gRPC hop inside the mesh (a mesh CA and one "
                         "certificate per service in RUN_DIR/mtls; default: cleartext on "
                         "loopback)")
    up.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT|URL",
                    type=otlp_endpoint,
                    help="every service exports OpenTelemetry traces over OTLP/gRPC to this "
                         "collector (docs/observability.md; default: "
                         "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT if set, else off)")
    up.add_argument("--model-path", default=None,
                    help="GGUF file or Hugging Face checkpoint directory for tokenizer and "
                         "engines (default: the services' default)")
    up.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    dest="models", type=_model_spec,
                    help="serve several models: repeat it; each gets its own tokenizer and "
                         "--engines engines, and requests choose by `model` (the first is "
                         "the default); not with --model-path")
    up.add_argument("--redis-url", default=None,
                    help="Redis for the cache service (default: its embedded store)")
    up.add_argument("--run-dir", default=None,
                    help="logs, port files and envoy.yaml (default: a new /tmp/llmesh-* dir)")
    up.add_argument("--engines", type=_int32_positive, default=1, help="engine replicas (default: 1)")
    up.add_argument("--backend", default=None, help="engine --backend (torch, tensorrt_llm)")
    up.add_argument("--device", default=None, help="engine --device (cpu, cuda, cuda:1)")
    up.add_argument("--dtype", default=None, help="engine --dtype (float32, bfloat16...)")
    up.add_argument("--quantization", default=None, choices=("auto", "none", "int8", "int4"),
                    help="engine --quantization (default auto: int4 for a Llama GGUF on the "
                         "CPU; none for other models, or when --dtype is not float32 or "
                         "--device is not the CPU)")
    up.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                    help="extra engine argument, repeatable: --engine-arg=--flag=value")
    add_cascade_arguments(up)
    up.add_argument("--retrieval", action="store_true",
                    help="also start the retriever service (collections kept in "
                         "RUN_DIR/retriever; give --run-dir to keep them across runs), "
                         "routed on the ingress as llmesh.v1.RetrieverService, except "
                         "with --api-keys (the retriever checks no keys: manage "
                         "collections at its own address, RUN_DIR/retriever.json)")
    up.add_argument("--retriever-arg", action="append", default=[], metavar="ARG",
                    help="extra retriever argument, repeatable: --retriever-arg=--index=exact")
    up.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="extra router argument, repeatable: --router-arg=--max-tokens-cap=512")
    add_history_arguments(up)
    up.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                    help="start a service that dies again on its ports, as a supervisor "
                         f"would (default); {MAX_RESTARTS} deaths within "
                         f"{RESTART_WINDOW_S:.0f} s, or Envoy's, stop the mesh")
    up.add_argument("--drain-seconds", type=non_negative_float, default=5.0,
                    help="seconds in-flight requests get on stop (default: %(default)s)")
    up.add_argument("--start-timeout", type=positive_float, default=600.0,
                    help="seconds the services get to load (default: %(default)s)")
    up.add_argument("--stream-idle-timeout", type=non_negative_float, default=300.0,
                    help="seconds a GenerateStream may idle between generations before the "
                         "router ends it (DEADLINE_EXCEEDED); Envoy's idle timeout for the "
                         "other calls (default: %(default)s)")
    up.add_argument("--api-keys", default=None, metavar="FILE",
                    help="API key file for the router (tenants, SHA-256 of their keys, "
                         "models, limits; docs/api-keys.md): calls then need a key; "
                         "SIGHUP to llmesh reloads it")
    up.set_defaults(func=cmd_up)

    keys = commands.add_parser(
        "keys", help="mint or hash API keys for --api-keys",
        description="API keys for the router's key file (docs/api-keys.md).")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    new_key = key_commands.add_parser(
        "new", help="mint a key: prints it once, then the file entry (its hash)")
    new_key.add_argument("--tenant", required=True, help="the tenant id the key maps to")
    new_key.set_defaults(func=cmd_keys_new)
    hash_key = key_commands.add_parser(
        "hash", help="print the file entry (sha256:...) of a key read from stdin")
    hash_key.set_defaults(func=cmd_keys_hash)

    url_help = (f"mesh address host:port, http://host:port or https://host:port (TLS); "
                f"without it: LLMESH_URL, else 127.0.0.1:LLMESH_PORT (as for `llmesh up`), "
                f"else {DEFAULT_URL}")
    cacert_help = ("CA file (PEM) that verifies a TLS mesh, e.g. RUN_DIR/tls/ca.crt of "
                   "`llmesh up --tls-self-signed`; implies TLS (env LLMESH_CACERT; "
                   "https:// without it: the system roots)")
    generate = commands.add_parser(
        "generate", help="stream a completion through Envoy",
        description="Streams a completion to stdout as it is generated; the finish reason, "
                    "token usage and latency go to stderr. A mesh started with --api-keys "
                    "wants a key: export LLMESH_API_KEY=<key> (sent as "
                    "authorization: Bearer).",
    )
    generate.add_argument("prompt", help="the question (a chat user message), or '-' for stdin")
    generate.add_argument("--raw", action="store_true",
                          help="send the text as a raw prompt, no chat template")
    generate.add_argument("--system", default=None, help="chat system message")
    generate.add_argument("--model", default="", help="model id (default: the mesh's default)")
    generate.add_argument("--max-tokens", type=_int32_positive, default=None)
    generate.add_argument("--temperature", type=float, default=None,
                          help="0 or unset: greedy")
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=_int32_non_negative, default=None)
    generate.add_argument("--seed", type=_uint64, default=None)
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop string, repeatable")
    generate.add_argument("--batch", action="store_true",
                          help="send as batch (not interactive) traffic")
    generate.add_argument("--bypass-cache", action="store_true",
                          help="do not answer from the response cache: generate anew (a "
                               "deterministic answer is still stored for the next call)")
    generate.add_argument("--timeout", type=_positive_seconds, default=None,
                          help="deadline in seconds (> 0)")
    generate.add_argument("--url", default=None, help=url_help)
    generate.add_argument("--cacert", default=None, metavar="FILE", help=cacert_help)
    generate.set_defaults(func=cmd_generate)

    models = commands.add_parser(
        "models", help="list the served models",
        description="Lists the served models. A mesh started with --api-keys wants a key: "
                    "export LLMESH_API_KEY=<key> (sent as authorization: Bearer).")
    models.add_argument("--json", action="store_true", help="print the reply as JSON")
    models.add_argument("--timeout", type=_positive_seconds, default=10.0,
                        help="deadline in seconds (> 0)")
    models.add_argument("--url", default=None, help=url_help)
    models.add_argument("--cacert", default=None, metavar="FILE", help=cacert_help)
    models.set_defaults(func=cmd_models)

    bench = commands.add_parser(
        "bench", help="benchmark llmesh or an OpenAI-compatible server",
        description="Measures TTFT, TPOT, ITL, e2e latency, throughput and goodput of llmesh "
                    "(gRPC) or an OpenAI-compatible HTTP server under a chosen load, in the "
                    "manner of `vllm bench serve` (docs/bench.md).",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llmesh`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.func in (cmd_generate, cmd_models):
        # Before grpc loads: its C core would print its own INFO lines (a TLS
        # handshake failure) above the one-line error the command gives.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe fails outside this try
    except BrokenPipeError:  # e.g. `llmesh generate ... | head -1`
        return leave_quietly()
    return code


if __name__ == "__main__":
    sys.exit(main())
