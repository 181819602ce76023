"""The mesh launcher and ``llmesh up``, with stand-ins for the four services.

The stand-ins run on the real server kit (port files, health, reflection,
SIGTERM drain) and the router stand-in serves the real public proto, so what
is checked here is the launcher's part: start order and arguments, health
waiting, Envoy in front, failure handling and that nothing outlives stop.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from cli_helpers import FAKE_SERVICE, alive, fake_commands, wait_all_dead

from llmesh.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from services.cli.envoy_config import REPO_ROOT
from services.cli.mesh import (
    Mesh,
    MeshProgress,
    MeshStartError,
    ModelSpec,
    PortInUseError,
    engine_cpu_share,
)


def _generate(address: str, prompt: str) -> list[generation_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return list(stub.Generate(generation_pb2.GenerateRequest(prompt=prompt), timeout=10))


def _argv(mesh: Mesh, name: str) -> list[str]:
    return json.loads(Path(f"{mesh.services[name].port_file}.argv.json").read_text())


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def test_mesh_starts_in_order_serves_and_stops(tmp_path: Path) -> None:
    events: list[MeshProgress] = []
    mesh = Mesh(
        ingress_port=0, admin_port=0, run_dir=tmp_path, num_engines=2,
        model_path="/models/tiny.gguf", redis_url="redis://127.0.0.1:1/0",
        # 2.5 s: the engines must still be loading once the router (which also binds
        # its OpenAI HTTP port, importing aiohttp) has bound, even on a busy machine.
        engine_args=["--load-seconds", "2.5"], router_args=["--max-tokens-cap", "99"],
        stream_idle_timeout_s=42, commands=fake_commands(),
    )
    with mesh.start(events.append):
        assert list(mesh.services) == ["tokenizer", "cache", "engine-0", "engine-1", "router"]
        # The router got every backend's real address.
        router_argv = _argv(mesh, "router")
        assert _flag_values(router_argv, "--tokenizer") == [mesh.services["tokenizer"].grpc_address]
        assert _flag_values(router_argv, "--cache") == [mesh.services["cache"].grpc_address]
        assert _flag_values(router_argv, "--engine") == [e.grpc_address for e in mesh.engines]
        assert _flag_values(router_argv, "--max-tokens-cap") == ["99"]
        # Matching idle limits: the router's session limit is Envoy's idle timeout,
        # and Envoy's timer is off for the generation routes.
        assert _flag_values(router_argv, "--stream-idle-timeout") == ["42"]
        envoy_config = yaml.safe_load((tmp_path / "envoy.yaml").read_text())
        hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0][
            "filters"][0]["typed_config"]
        assert hcm["stream_idle_timeout"] == "42s"
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        # gRPC generation methods, then the OpenAI paths (the router's HTTP port,
        # /tokenize, /detokenize and /v1/embeddings included), then "/".
        assert [r["route"].get("idle_timeout") for r in routes] == ["0s"] * 10 + [None]
        assert _flag_values(router_argv, "--openai-port") == ["0"]
        assert mesh.router.extra_ports["openai_port"] > 0
        assert _flag_values(_argv(mesh, "tokenizer"), "--model-path") == ["/models/tiny.gguf"]
        assert _flag_values(_argv(mesh, "engine-1"), "--model-path") == ["/models/tiny.gguf"]
        assert _flag_values(_argv(mesh, "cache"), "--redis-url") == ["redis://127.0.0.1:1/0"]
        for name, service in mesh.services.items():
            assert _flag_values(_argv(mesh, name), "--port") == ["0"]
            assert service.grpc_port and service.metrics_port and service.metrics_port > 0
            assert service.log_path == tmp_path / f"{name}.log"

        stages = [e.stage for e in events]
        assert stages[0] == "spawned" and stages[-1] == "ready"
        assert stages.index("serving") < stages.index("envoy") < stages.index("ready")
        loading = [e for e in events if e.stage == "loading"]
        engines = {"engine-0", "engine-1"}
        assert loading and engines <= set(loading[0].waiting)
        assert set(loading[-1].waiting) <= engines
        assert mesh.startup_seconds is not None and mesh.startup_seconds >= 2.5

        # Traffic flows client → Envoy → router.
        responses = _generate(mesh.ingress_address, "through the mesh")
        assert "".join(r.text for r in responses) == "through the mesh "
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert mesh.envoy is not None and mesh.envoy.config_path == tmp_path / "envoy.yaml"
        assert mesh.http_url == f"http://{mesh.ingress_address}"
        assert mesh.admin_url.startswith("http://127.0.0.1:")
        pids = mesh.pids()
        assert set(pids) == {*mesh.services, "envoy"}
        assert all(alive(pid) for pid in pids.values())
        assert mesh.exited() == {}
    assert wait_all_dead(pids.values(), timeout_s=1.0) == []
    assert mesh.exited().keys() == pids.keys()


def test_retrieval_starts_the_retriever_tells_the_router_and_routes_it_on_the_ingress(
        tmp_path: Path) -> None:
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path, retrieval=True,
                retriever_args=["--index", "exact"], commands=fake_commands())
    with mesh.start():
        assert list(mesh.services) == ["tokenizer", "cache", "retriever", "engine-0", "router"]
        retriever = mesh.services["retriever"]
        assert _flag_values(_argv(mesh, "router"), "--retriever-address") == [
            retriever.grpc_address]
        assert _flag_values(_argv(mesh, "retriever"), "--data-dir") == [
            str(tmp_path.resolve() / "retriever")]
        assert _flag_values(_argv(mesh, "retriever"), "--index") == ["exact"]
        with grpc.insecure_channel(mesh.ingress_address) as channel:
            listed = retriever_pb2_grpc.RetrieverServiceStub(channel).ListCollections(
                retriever_pb2.ListCollectionsRequest(), timeout=10)
        assert [c.name for c in listed.collections] == ["fake-collection"]
        # Reflection through the ingress (answered by the router) lists the
        # retriever's API too, and describes it.
        listed_services = subprocess.run(
            ["grpcurl", "-plaintext", mesh.ingress_address, "list"], capture_output=True,
            text=True, timeout=30, check=True).stdout.split()
        assert {"llmesh.v1.GenerationService", "llmesh.v1.RetrieverService"} <= set(
            listed_services)
        methods = subprocess.run(
            ["grpcurl", "-plaintext", mesh.ingress_address, "list",
             "llmesh.v1.RetrieverService"], capture_output=True, text=True, timeout=30,
            check=True).stdout.split()
        assert "llmesh.v1.RetrieverService.Query" in methods


def test_the_router_restarts_with_other_flags_on_its_ports_behind_the_same_envoy(
        tmp_path: Path) -> None:
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path,
                router_args=["--max-tokens-cap", "99"], commands=fake_commands())
    with mesh.start():
        old = mesh.router
        old_pid, ports = old.pid, (old.grpc_port, old.metrics_port, dict(old.extra_ports))
        engine_pid = mesh.engines[0].pid
        router = mesh.restart_router(["--max-tokens-cap", "7"])
        assert router is mesh.router and router.pid != old_pid
        assert wait_all_dead([old_pid], timeout_s=5.0) == []
        assert (router.grpc_port, router.metrics_port, router.extra_ports) == ports
        argv = _argv(mesh, "router")
        assert _flag_values(argv, "--max-tokens-cap") == ["7"]
        assert _flag_values(argv, "--engine") == [mesh.engines[0].grpc_address]
        assert mesh.engines[0].pid == engine_pid  # the engines were not touched
        responses = _generate(mesh.ingress_address, "through the restarted router")
        assert "".join(r.text for r in responses) == "through the restarted router "


def test_without_envoy_clients_call_the_router_directly(tmp_path: Path) -> None:
    events: list[MeshProgress] = []
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path, with_envoy=False,
                commands=fake_commands())
    with mesh.start(events.append):
        assert mesh.envoy is None and not (tmp_path / "envoy.yaml").exists()
        assert mesh.ingress_address == mesh.router.grpc_address
        responses = _generate(mesh.ingress_address, "straight to the router")
        assert "".join(r.text for r in responses) == "straight to the router "
        assert [e.stage for e in events][-1] == "ready" and "envoy" not in {
            e.stage for e in events}
        pids = mesh.pids()
        assert set(pids) == set(mesh.services)
    assert wait_all_dead(pids.values(), timeout_s=1.0) == []


def test_several_models_each_get_a_tokenizer_and_engines_and_one_router_pool(
        tmp_path: Path) -> None:
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path, num_engines=2,
                models=[ModelSpec("chat", "/models/chat.gguf"),
                        ModelSpec("base", "/models/base")],  # a checkpoint directory
                commands=fake_commands())
    with mesh.start():
        assert list(mesh.services) == ["tokenizer", "tokenizer-base", "cache", "engine-0",
                                       "engine-1", "engine-base-0", "engine-base-1", "router"]
        for name, model, path in [("tokenizer", "chat", "/models/chat.gguf"),
                                  ("tokenizer-base", "base", "/models/base")]:
            argv = _argv(mesh, name)
            assert _flag_values(argv, "--model-path") == [path]
            assert _flag_values(argv, "--model-name") == [model]
        for name, model, path in [("engine-1", "chat", "/models/chat.gguf"),
                                  ("engine-base-0", "base", "/models/base")]:
            argv = _argv(mesh, name)
            assert _flag_values(argv, "--served-model-name") == [model]
            assert _flag_values(argv, "--model-path") == [path]
            assert _flag_values(argv, "--replica-id")[0].endswith(name)
            assert _flag_values(argv, "--num-threads") == [
                str(engine_cpu_share(4))]  # four engines share the CPUs
        router_argv = _argv(mesh, "router")
        address = {name: s.grpc_address for name, s in mesh.services.items()}
        assert _flag_values(router_argv, "--tokenizer") == [address["tokenizer"]]
        assert _flag_values(router_argv, "--engine") == [address["engine-0"],
                                                         address["engine-1"]]
        assert _flag_values(router_argv, "--model-pool") == [
            f"{address['tokenizer-base']}={address['engine-base-0']},{address['engine-base-1']}"]


def test_model_specs_are_checked() -> None:
    assert ModelSpec.parse("gemma-3.270m=/m/g.gguf") == ModelSpec("gemma-3.270m", "/m/g.gguf")
    for bad in ["nopath", "=x.gguf", "a b=x.gguf", "x=", "-x=y"]:
        with pytest.raises(ValueError):
            ModelSpec.parse(bad)
    with pytest.raises(ValueError, match="not both"):
        Mesh(model_path="/m", models=[ModelSpec("a", "/m")])
    with pytest.raises(ValueError, match="its own name"):
        Mesh(models=[ModelSpec("a", "/m"), ModelSpec("a", "/n")])


def test_failed_start_names_the_service_quotes_its_log_and_stops_the_rest(tmp_path: Path) -> None:
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path,
                commands=fake_commands(engine=["--load-seconds", "0.5", "--fail-start"]))
    with pytest.raises(MeshStartError) as caught:
        mesh.start()
    message = str(caught.value)
    # The reason leads, from the service's start_failed line, whatever its
    # shutdown logged after it (QA: a CancelledError traceback hid it).
    assert message.startswith("engine-0 exited with code 1 while starting: "
                              "RuntimeError: fake start failure; full log:")
    assert str(tmp_path / "engine-0.log") in message
    assert "fake start failure: the model file is unreadable" in message
    assert mesh.envoy is None
    pids = mesh.pids()
    assert {"tokenizer", "cache", "engine-0"} <= set(pids)
    assert wait_all_dead(pids.values(), timeout_s=1.0) == []


def test_a_service_that_dies_before_writing_a_line_is_said_to_have_written_nothing(
        tmp_path: Path) -> None:
    """QA: an engine that died before its first log line (here: exits at
    once) got an empty ``--- last lines ---`` section; the failure now says
    that it wrote nothing to its log, naming the file."""
    commands = fake_commands()
    commands["engine"] = [sys.executable, "-c", "raise SystemExit(3)"]
    mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path, commands=commands)
    with pytest.raises(MeshStartError) as caught:
        mesh.start()
    log = tmp_path / "engine-0.log"
    assert str(caught.value) == (f"engine-0 exited with code 3 while starting; "
                                 f"it wrote nothing to its log {log}")
    assert wait_all_dead(mesh.pids().values(), timeout_s=1.0) == []


def test_a_restarted_service_that_writes_nothing_is_told_apart_from_the_earlier_lines(
        tmp_path: Path) -> None:
    """QA: an engine restarted by the launcher that died before its first
    line was said to have "written nothing to its log", while that (appended)
    file held the earlier process's lines. The excerpt covers this process's
    part only and says what the lines above it are."""
    with Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path,
              commands=fake_commands()).start() as mesh:
        engine = mesh.services["engine-0"]
        engine.argv = [sys.executable, "-c", "raise SystemExit(3)"]
        with pytest.raises(MeshStartError) as caught:
            mesh.restart("engine-0")
        earlier = engine.log_path.read_bytes()  # the first process's, to its last line
        lines = earlier.count(b"\n")
        assert lines > 0 and earlier.endswith(b"\n")
        assert str(caught.value) == (
            f"engine-0 exited with code 3 while starting; it wrote nothing to its log "
            f"{engine.log_path} (the {lines} line(s) there are an earlier "
            "process's)")
        engine.argv = [sys.executable, "-c", "print('the second one says this'); "
                                               "raise SystemExit(4)"]
        with pytest.raises(MeshStartError) as caught:
            mesh.restart("engine-0")
        assert str(caught.value) == (
            f"engine-0 exited with code 4 while starting; full log: {engine.log_path} (its "
            f"lines start at line {lines + 1}; those above are an earlier "
            "process's)\n--- last lines ---\nthe second one says this")


def test_taken_ingress_port_fails_fast_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mesh = Mesh(ingress_port=port, admin_port=0, run_dir=tmp_path, commands=fake_commands())
        started = time.monotonic()
        with pytest.raises(PortInUseError) as caught:
            mesh.start()
    assert time.monotonic() - started < 1.0
    assert caught.value.what == "ingress" and caught.value.port == port
    assert str(caught.value) == (
        f"ingress port 127.0.0.1:{port} is already in use by another process")
    assert mesh.pids() == {}


def test_a_refused_start_leaves_no_empty_run_dir_behind() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        mesh = Mesh(ingress_port=taken.getsockname()[1], admin_port=0, commands=fake_commands())
        made = Path(mesh.run_dir)
        assert made.is_dir() and made.name.startswith("llmesh-")
        with pytest.raises(PortInUseError):
            mesh.start()
    assert not made.exists()


def test_taken_admin_port_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError) as caught:
            Mesh(ingress_port=0, admin_port=port, run_dir=tmp_path,
                 commands=fake_commands()).start()
    assert caught.value.what == "admin"


def test_killed_parent_takes_its_children_along(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL (no cleanup code runs) leaves nothing behind."""
    script = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(FAKE_SERVICE.parent)!r})
        from cli_helpers import fake_commands
        from services.cli.mesh import Mesh
        mesh = Mesh(ingress_port=0, admin_port=0, run_dir={str(tmp_path)!r},
                    commands=fake_commands()).start()
        print(json.dumps(mesh.pids()), flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert len(pids) == 5 and all(alive(pid) for pid in pids.values())
    finally:
        launcher.kill()
        launcher.wait()
    assert wait_all_dead(pids.values(), timeout_s=15.0) == []


def _start_up(tmp_path: Path, *extra: str,
              preexec_fn: Callable[[], object] | None = None,
              env: dict[str, str] | None = None,
              ) -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--admin-port", "0",
         "--ops-port", "0", "--run-dir", str(tmp_path), *extra],
        cwd=REPO_ROOT, env=env or _up_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C stops everything"):
            return process, lines
    process.kill()
    stderr = process.stderr.read() if process.stderr else ""
    raise AssertionError(f"llmesh up did not come up: {lines} {stderr}")


def _up_pids(tmp_path: Path, lines: list[str]) -> list[int]:
    pids = [json.loads(p.read_text())["pid"] for p in tmp_path.glob("*.json")
            if not p.name.endswith(".argv.json")]
    envoy = next(re.search(r"pid (\d+)", line) for line in lines
                 if line.strip().startswith("envoy"))
    assert envoy is not None
    return [*pids, int(envoy.group(1))]


def test_llmesh_up_prints_working_commands_and_stops_on_sigterm(tmp_path: Path) -> None:
    process, lines = _start_up(tmp_path)
    try:
        assert lines[0].startswith("llmesh is up in ")
        found = re.search(r"on (127\.0\.0\.1:\d+)$", lines[0])
        assert found is not None
        address = found.group(1)
        examples = [line.strip() for line in lines[lines.index("Try:") + 1:-1]]
        assert [e.split()[0] for e in examples] == ["llmesh", "grpcurl", "curl", "curl", "curl"]
        pids = _up_pids(tmp_path, lines)
        assert len(pids) == 5 and all(alive(pid) for pid in pids)

        # Every printed line works as written (the stand-in echoes the question).
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        env = {**os.environ, "PATH": path}
        outputs = [subprocess.run(line, shell=True, capture_output=True, text=True, timeout=30,
                                  env=env, check=True) for line in examples]
        assert outputs[0].stdout == "What is the capital of France? \n"
        assert "finish=stop" in outputs[0].stderr
        assert address in examples[1] and '"text": "capital "' in outputs[1].stdout
        array = json.loads(outputs[2].stdout)
        assert "".join(m.get("text", "") for m in array) == "What is the capital of France? "
        assert json.loads(outputs[3].stdout)["data"][0]["id"] == "fake-model"
        assert "data: [DONE]" in outputs[4].stdout and '"capital "' in outputs[4].stdout

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert process.stderr is not None
    stderr = process.stderr.read()
    assert "llmesh: stopping..." in stderr and "llmesh: stopped" in stderr
    assert wait_all_dead(pids, timeout_s=5.0) == []


def test_llmesh_up_stops_on_ctrl_c(tmp_path: Path) -> None:
    process, lines = _start_up(tmp_path)
    pids = _up_pids(tmp_path, lines)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    assert wait_all_dead(pids, timeout_s=5.0) == []


def test_llmesh_up_stops_on_sigint_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    """``llmesh up &`` in a non-interactive shell script inherits SIGINT ignored."""
    process, lines = _start_up(
        tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        pids = _up_pids(tmp_path, lines)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_all_dead(pids, timeout_s=5.0) == []


def test_llmesh_up_reports_taken_port_with_the_flag_to_change(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--admin-port", "0",
             "--ops-port", "0", "--run-dir", str(tmp_path)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 2
    assert f"ingress port 127.0.0.1:{port} is already in use" in result.stderr
    assert "--port / LLMESH_PORT" in result.stderr
    assert not list(tmp_path.glob("*.log"))


def _up_env(**extra: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for role, command in fake_commands(**extra).items():
        env[f"LLMESH_{role.upper()}_COMMAND"] = shlex.join(command)
    return env


def test_llmesh_up_sigterm_while_models_load_stops_everything(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--admin-port", "0",
         "--ops-port", "0", "--run-dir", str(tmp_path)],
        cwd=REPO_ROOT, env=_up_env(engine=["--load-seconds", "30"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "waiting for engine-0 to load" in line:
                break
        pids = [json.loads(p.read_text())["pid"] for p in tmp_path.glob("*.json")
                if not p.name.endswith(".argv.json")]
        assert len(pids) == 4 and all(alive(pid) for pid in pids)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 15
    finally:
        if process.poll() is None:
            process.kill()
    assert "llmesh: stopping..." in process.stderr.read()
    assert wait_all_dead(pids, timeout_s=5.0) == []
    assert not (tmp_path / "envoy.yaml").exists()


def test_llmesh_up_restarts_a_service_that_dies_and_stops_on_a_crash_loop(
        tmp_path: Path) -> None:
    process, lines = _start_up(tmp_path)
    try:
        assert process.stderr is not None
        port_file = tmp_path / "engine-0.json"
        first = json.loads(port_file.read_text())
        pids = [first["pid"]]
        for _ in range(2):
            os.kill(pids[-1], signal.SIGKILL)
            for line in process.stderr:
                if "engine-0 is SERVING again" in line:
                    break
            again = json.loads(port_file.read_text())
            assert again["grpc_port"] == first["grpc_port"]  # where the router looks
            assert again["pid"] != pids[-1] and alive(again["pid"])
            pids.append(again["pid"])
        os.kill(pids[-1], signal.SIGKILL)  # the third death within a minute
        assert process.wait(timeout=30) == 1
        assert "engine-0 died 3 times in 60 s; stopping" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_llmesh_up_tries_again_a_service_killed_while_it_restarts(tmp_path: Path) -> None:
    """QA: an engine killed while it restarted (loading its model) stopped the
    whole mesh ("did not start again") after two deaths; a failed start now
    counts as one more death and the launcher tries again."""
    process, _ = _start_up(tmp_path, env=_up_env(engine=["--load-seconds", "1.5"]))
    deadline = time.monotonic() + 60
    try:
        assert process.stderr is not None
        port_file = tmp_path / "engine-0.json"
        first = json.loads(port_file.read_text())["pid"]
        os.kill(first, signal.SIGKILL)
        for line in process.stderr:
            if "restarting engine-0" in line:
                break
        loading = first
        while loading == first:  # the restarted engine, still loading its model
            assert time.monotonic() < deadline and process.poll() is None
            try:
                loading = json.loads(port_file.read_text()).get("pid", first)
            except (OSError, ValueError):  # being rewritten
                pass
            time.sleep(0.02)
        os.kill(loading, signal.SIGKILL)
        said = []
        for line in process.stderr:
            said.append(line)
            if "engine-0 is SERVING again" in line or "stopping" in line:
                break
        assert "did not start again" in "".join(said) and "trying once more" in "".join(said)
        # The failure quotes the killed replacement's log lines, not the first
        # process's, which the same (appended) file holds first (QA).
        text = "".join(said)
        failure = text[text.index("did not start again"):text.index("trying once more")]
        assert "--- last lines ---" in failure and f'"pid": {first}' not in failure, failure
        assert "engine-0 is SERVING again" in said[-1]
        again = json.loads(port_file.read_text())["pid"]
        assert again not in (first, loading) and alive(again) and process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()


def test_llmesh_up_exits_when_a_service_dies(tmp_path: Path) -> None:
    process, lines = _start_up(tmp_path, "--no-restart")
    try:
        pids = _up_pids(tmp_path, lines)
        engine_pid = json.loads((tmp_path / "engine-0.json").read_text())["pid"]
        os.kill(engine_pid, signal.SIGKILL)
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
    assert process.stderr is not None
    assert f"engine-0 exited with code -9; stopping (logs in {tmp_path})" in process.stderr.read()
    assert wait_all_dead(pids, timeout_s=5.0) == []
