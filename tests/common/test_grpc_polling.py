"""``services.common.grpc_polling``: every service's process reads its sockets
on the grpc.aio poller thread (GRPC_EXPERIMENTS set before grpc loads), an
operator's setting wins, and a program that imported grpc already is left as
it is. Each case runs in a fresh interpreter: pytest's has grpc loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.grpc_polling import EXPERIMENTS_ENV, THREAD_POOL_READS

REPO = Path(__file__).resolve().parents[2]
OFF = ",".join(f"-{name}" for name in THREAD_POOL_READS)


def _python(code: str, **env: str) -> str:
    """Runs ``code`` in a fresh interpreter (no GRPC_EXPERIMENTS unless given);
    returns its stdout."""
    base = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
        timeout=60,
        env={**base, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'services' / 'gen'}", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


#: Every Python gRPC service: ``python -m services.ROLE``.
SERVICE_ROLES = ("cache", "engine", "retriever", "router", "tokenizer")


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_each_service_process_reads_on_the_poller_thread(role: str) -> None:
    # `python -m services.ROLE` (here with --help, which exits after parsing,
    # every module imported): the variable is set, so read_on_poller() ran
    # before grpc was imported (after, it sets nothing) and gRPC core reads it.
    out = _python(
        "import os, runpy, sys\n"
        f"sys.argv = ['services.{role}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('services.{role}', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('|' + os.environ.get({EXPERIMENTS_ENV!r}, 'unset'))\n")
    assert out.rsplit("|", 1)[1] == OFF


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_importing_a_service_main_changes_nothing(role: str) -> None:
    # `llmesh up --engine-arg=--help` (or a router flag's check) imports
    # build_parser: its process (and the services it starts) decide for
    # themselves.
    out = _python(f"import os, services.{role}.__main__\n"
                  f"print(os.environ.get({EXPERIMENTS_ENV!r}, 'unset'))")
    assert out == "unset"


def test_an_operator_setting_wins_and_late_calls_do_nothing() -> None:
    out = _python(
        "import os\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ['GRPC_EXPERIMENTS'])\n",
        GRPC_EXPERIMENTS="event_engine_fork")
    assert out == "False event_engine_fork"
    out = _python(
        "import os, grpc\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ.get('GRPC_EXPERIMENTS', 'unset'))\n")
    assert out == "False unset"
    out = _python(
        "import os\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ['GRPC_EXPERIMENTS'])\n")
    assert out == f"True {OFF}"


def test_grpc_still_resolves_a_name_through_a_nameserver() -> None:
    # The router's --tokenizer and --cache are names in Kubernetes
    # (deploy/k8s/base/router.yaml), resolved by gRPC's own DNS resolver
    # (c-ares, asking the pod's nameserver): it still answers with the
    # EventEngine endpoints off. Here a nameserver the test controls.
    out = _python(
        "import asyncio\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "assert read_on_poller()\n"
        "import grpc\n"
        "from grpc_health.v1 import health, health_pb2, health_pb2_grpc\n"
        "from tests.router.dns_stub import DnsStub\n"
        "async def main():\n"
        "    dns = DnsStub()\n"
        "    dns.records['tokenizer.llmesh.test'] = ['127.0.0.1']\n"
        "    server = grpc.aio.server()\n"
        "    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)\n"
        "    port = server.add_insecure_port('127.0.0.1:0')\n"
        "    await server.start()\n"
        "    target = f'dns://{dns.address}/tokenizer.llmesh.test:{port}'\n"
        "    async with grpc.aio.insecure_channel(target) as channel:\n"
        "        answer = await health_pb2_grpc.HealthStub(channel).Check(\n"
        "            health_pb2.HealthCheckRequest(), timeout=10)\n"
        "    print(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status),\n"
        "          dns.queries > 0)\n"
        "    await server.stop(None)\n"
        "    dns.stop()\n"
        "asyncio.run(main())\n")
    assert out == "SERVING True"
