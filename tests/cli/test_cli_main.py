"""``llmesh generate`` / ``llmesh models`` against a real Envoy and a stand-in
router, and the request the CLI builds from its flags."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from llmesh.v1 import common_pb2
from services.cli import main as cli
from services.cli.mesh import EnvoyProcess, child_env
from services.engine import host_memory
from services.engine.tensorrt_llm_backend import availability


def _request(*argv: str):
    args = cli.build_parser().parse_args(["generate", *argv])
    return cli._request(args)


def test_grpc_target_accepts_urls() -> None:
    assert cli.grpc_target("127.0.0.1:8080") == "127.0.0.1:8080"
    assert cli.grpc_target("http://localhost:9000/") == "localhost:9000"


def test_generate_sends_chat_by_default() -> None:
    request = _request("Why is the sky blue?")
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("user", "Why is the sky blue?")]
    assert request.priority == common_pb2.PRIORITY_INTERACTIVE
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        assert not request.sampling.HasField(name), name


def test_generate_raw_system_and_sampling_flags() -> None:
    request = _request("Once upon", "--raw", "--max-tokens", "7", "--temperature", "0",
                       "--seed", "3", "--stop", "\n\n", "--stop", "END", "--batch")
    assert request.WhichOneof("input") == "prompt" and request.prompt == "Once upon"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.max_tokens == 7 and request.sampling.seed == 3
    assert list(request.sampling.stop) == ["\n\n", "END"]
    assert request.priority == common_pb2.PRIORITY_BATCH
    chat = _request("Hi", "--system", "Be brief.")
    assert [(m.role, m.content) for m in chat.chat.messages] == [("system", "Be brief."),
                                                                ("user", "Hi")]


def test_url_and_ports_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMESH_URL", "10.0.0.1:1234")
    monkeypatch.setenv("LLMESH_PORT", "18080")
    monkeypatch.setenv("LLMESH_ADMIN_PORT", "19901")
    parser = cli.build_parser()
    assert cli.mesh_address(parser.parse_args(["generate", "x"]).url) == "10.0.0.1:1234"
    assert cli.mesh_address(parser.parse_args(["models"]).url) == "10.0.0.1:1234"
    up = parser.parse_args(["up"])
    assert (up.port, up.admin_port, up.host) == (18080, 19901, "127.0.0.1")


def test_the_mesh_address_is_url_then_llmesh_url_then_llmesh_port_then_8080() -> None:
    assert cli.mesh_address(None, {}) == "127.0.0.1:8080"
    assert cli.mesh_address(None, {"LLMESH_PORT": "18080"}) == "127.0.0.1:18080"
    both = {"LLMESH_PORT": "18080", "LLMESH_URL": "http://10.0.0.1:1234/"}
    assert cli.mesh_address(None, both) == "10.0.0.1:1234"
    assert cli.mesh_address("h:1", both) == "h:1"
    assert cli.mesh_address("h:1", {"LLMESH_PORT": "abc"}) == "h:1"  # not read
    with pytest.raises(ValueError, match=r"^LLMESH_PORT: port must be an integer, got 'abc'"):
        cli.mesh_address(None, {"LLMESH_PORT": "abc"})
    with pytest.raises(ValueError, match=r"^LLMESH_PORT: port must be in \[1, 65535\], got 0"):
        cli.mesh_address(None, {"LLMESH_PORT": "0"})


def test_the_help_states_the_address_precedence(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "models"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert ("without it: LLMESH_URL, else 127.0.0.1:LLMESH_PORT (as for `llmesh up`), "
                "else 127.0.0.1:8080") in text
        assert "export LLMESH_API_KEY=<key>" in text  # a keyed mesh's users find it here


def test_generate_goes_to_llmesh_port_without_a_url(
        envoy: EnvoyProcess, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LLMESH_URL", raising=False)
    monkeypatch.setenv("LLMESH_PORT", str(envoy.ingress_port))
    assert cli.main(["generate", "--raw", "found by port"]) == 0
    assert capsys.readouterr().out == "found by port \n"
    assert cli.main(["models"]) == 0
    assert "fake-model" in capsys.readouterr().out
    monkeypatch.setenv("LLMESH_PORT", "abc")
    assert cli.main(["generate", "x"]) == 2
    assert capsys.readouterr().err == (
        "llmesh: LLMESH_PORT: port must be an integer, got 'abc' (or give the mesh address "
        "with --url / LLMESH_URL)\n")


def test_bypass_cache_flag_sets_the_field() -> None:
    assert not _request("Hi").bypass_cache
    assert _request("Hi", "--bypass-cache").bypass_cache


def test_a_cache_replay_says_so_and_reports_no_speed(
        envoy: EnvoyProcess, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--url", envoy.ingress_address, "--raw", "cacheable: one two three"]
    assert cli.main(argv) == 0
    generated = capsys.readouterr().err
    assert "ttft_ms=" in generated and "tokens_per_s=" in generated
    assert "response_cache" not in generated and "replayed" not in generated

    assert cli.main(argv) == 0
    out, replayed = capsys.readouterr()
    assert out == "cacheable: one two three \n"
    summary, note = replayed.splitlines()
    assert summary.startswith("[finish=stop prompt_tokens=4 completion_tokens=4 ")
    assert " response_cache=replay total_ms=" in summary
    assert "tokens_per_s" not in summary and "ttft_ms" not in summary
    assert note == ("llmesh: replayed from the response cache, not generated (no speed to "
                    "report); --bypass-cache generates it anew")

    assert cli.main([*argv, "--bypass-cache"]) == 0
    fresh = capsys.readouterr().err
    assert "tokens_per_s=" in fresh and "replayed" not in fresh


def test_client_examples_name_the_address() -> None:
    lines = cli.client_examples("127.0.0.1:8080")
    assert lines[0] == "llmesh generate 'What is the capital of France?'"
    other = cli.client_examples("127.0.0.1:18080")
    assert other[0].startswith("llmesh generate --url 127.0.0.1:18080 ")
    assert other[1].endswith("127.0.0.1:18080 llmesh.v1.GenerationService/Generate")
    assert "http://127.0.0.1:18080/v1/generate" in other[2]


def test_client_examples_send_the_api_key_when_the_mesh_wants_one() -> None:
    lines = cli.client_examples("127.0.0.1:8080", api_keys=True)
    assert lines[0].startswith("export LLMESH_API_KEY=")
    for line in lines:  # each pastes into a shell as it is
        assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0, line
    assert lines[1].startswith("llmesh generate ")  # reads LLMESH_API_KEY itself
    for line in lines[2:]:
        assert '-H "authorization: Bearer $LLMESH_API_KEY"' in line, line
    assert not any("LLMESH_API_KEY" in line for line in cli.client_examples("127.0.0.1:8080"))


def test_generate_streams_text_and_summarises_on_stderr(
        envoy: EnvoyProcess, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--url", envoy.ingress_address, "--max-tokens", "2",
                     "three little words"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "three little \n"
    assert err.startswith("[finish=length prompt_tokens=3 completion_tokens=2 "
                          "cached_prompt_tokens=0 ttft_ms=")
    assert "request_id=" in err


def test_generate_error_exits_1_with_the_status(
        envoy: EnvoyProcess, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--url", envoy.ingress_address, "--raw", "fail"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err == "llmesh: INVALID_ARGUMENT: prompt: fail was asked for\n"


def test_generate_without_a_mesh_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = cli.main(["generate", "--url", f"127.0.0.1:{port}", "--timeout", "5", "hi"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("llmesh: UNAVAILABLE: ")
    assert f"(is `llmesh up` running on 127.0.0.1:{port}?)" in err


def test_generate_piped_to_head_stops_quietly_and_cancels(envoy: EnvoyProcess) -> None:
    """``llmesh generate ... | head -c 5``: head leaves after the first word;
    the next write fails (EPIPE), and the CLI cancels the stream and exits
    141 with nothing on stderr (it had been a BrokenPipeError traceback)."""
    words = " ".join(f"w{i}" for i in range(40))  # 0.25 s a word: 10 s in all
    command = (f"set -o pipefail; {sys.executable} -m services.cli generate --raw "
               f"--url {envoy.ingress_address} 'sleep:0.25 {words}' | head -c 5")
    began = time.monotonic()
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          env=child_env(), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (141, "w0 w1", "")
    assert time.monotonic() - began < 8  # left at head's exit, not at the stream's end


def test_models_table_and_json(envoy: EnvoyProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "--url", envoy.ingress_address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["MODEL", "CONTEXT", "MAX_TOKENS", "CHAT"]
    assert table[1].split() == ["fake-model", "2048", "256", "yes"]
    assert cli.main(["models", "--json", "--url", envoy.ingress_address]) == 0
    assert '"id": "fake-model"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--seed", "-1", "x"], "--seed: seed must be in [0, 18446744073709551615]"),
        (["generate", "--seed", str(2**64), "x"], "--seed: seed must be in"),
        (["generate", "--max-tokens", "99999999999", "x"], "--max-tokens: count must be in"),
        (["generate", "--max-tokens", "0", "x"], "--max-tokens: count must be in [1,"),
        (["generate", "--top-k", "-3", "x"], "--top-k: count must be in [0,"),
        (["up", "--port", "99999"], "--port: port must be in [0, 65535], got 99999"),
        (["up", "--admin-port", "http"], "--admin-port: port must be an integer, got 'http'"),
    ],
)
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_port_in_the_environment_breaks_only_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLMESH_PORT", "abc")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    with pytest.raises(SystemExit) as exited:
        cli.main(["up"])
    assert exited.value.code == 2
    # QA: the refusal named only --port, which the user had not typed.
    assert ("argument --port: LLMESH_PORT='abc': port must be an integer, got 'abc'"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("name", "value", "line"), [
    ("LLMESH_PORT", "abc", "argument --port: LLMESH_PORT='abc': port must be an integer, "
     "got 'abc'"),
    ("LLMESH_ADMIN_PORT", "70000", "argument --admin-port: LLMESH_ADMIN_PORT='70000': port "
     "must be in [0, 65535], got 70000"),
])
def test_up_names_a_bad_port_variable_and_its_value(
        name: str, value: str, line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA: ``LLMESH_PORT=abc llmesh up`` was refused naming ``--port`` only."""
    monkeypatch.setattr("services.cli.mesh.Mesh", None)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--run-dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"llmesh up: error: {line}\n") and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(name, "0")  # a good value is still read
    assert getattr(cli.build_parser().parse_args(["up"]), name[7:].lower()) == 0


@pytest.mark.parametrize(("name", "value", "line"), [
    ("LLMESH_LOG_LEVEL", "FOO",  # every service died with a KeyError traceback
     "LLMESH_LOG_LEVEL='FOO': choose one of debug, info, warning, error, critical"),
    ("LLMESH_ENGINE_COMMAND", 'python -m "services.engine',  # a traceback in llmesh up
     "LLMESH_ENGINE_COMMAND='python -m \"services.engine': No closing quotation "
     "(shell quoting)"),
    ("LLMESH_ROUTER_COMMAND", "  ", "LLMESH_ROUTER_COMMAND='  ': names no command"),
    ("LLMESH_ENGINE_COMMAND", "/nonexistent/bin --x",  # QA: a traceback after 2 services
     "LLMESH_ENGINE_COMMAND='/nonexistent/bin --x': no such program: /nonexistent/bin"),
    ("LLMESH_MODEL_PATH", "NOWHERE", "the engines would refuse to start: "
     "LLMESH_MODEL_PATH='NOWHERE': no GGUF file or checkpoint directory at NOWHERE"),
    ("LLMESH_ENGINE_MAX_NUM_SEQS", "0", "LLMESH_ENGINE_MAX_NUM_SEQS='0': must be in "
     "[1, 16384], got 0"),
], ids=["log-level", "command-quote", "command-empty", "command-missing", "model-path",
        "engine-variable"])
def test_up_refuses_a_bad_variable_naming_it_and_its_value_before_starting(
        name: str, value: str, line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA: the services ``llmesh up`` starts read these variables; a bad one
    was a traceback (in llmesh up, or in every service's log after the mesh
    had started) or a refusal that did not name it. Exit 2, one line."""
    nowhere = str(tmp_path / "none.gguf")
    value, line = value.replace("NOWHERE", nowhere), line.replace("NOWHERE", nowhere)
    assert _up_refused([], {name: value}, tmp_path, capsys, monkeypatch) == f"llmesh: {line}\n"


@pytest.mark.parametrize(("env", "line"), [
    ({"LLMESH_CACERT": "NOWHERE"},  # named --cacert, which was not given
     "LLMESH_CACERT='NOWHERE': cannot read it (No such file or directory)"),
    ({"LLMESH_URL": "http://"},  # UNKNOWN: Failed to create channel to ''
     "LLMESH_URL='http://': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_URL": "mesh host:8080"},
     "LLMESH_URL='mesh host:8080': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_URL": "127.0.0.1:73616"},  # QA: dialled port 8080 (73616 - 65536)
     "LLMESH_URL='127.0.0.1:73616': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_URL": "127.0.0.1:notaport"},  # UNAVAILABLE: errors resolving
     "LLMESH_URL='127.0.0.1:notaport': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_URL": "ftp://127.0.0.1:8080"},  # UNAVAILABLE: errors resolving
     "LLMESH_URL='ftp://127.0.0.1:8080': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_URL": "[::1"},  # an UnboundLocalError traceback
     "LLMESH_URL='[::1': expected host:port, http://host:port or https://host:port (port 1-65535)"),
    ({"LLMESH_API_KEY": "secret\nkey"},  # INTERNAL: Invalid metadata, a C-core log line
     "LLMESH_API_KEY: a key is printable ASCII without spaces (as `llmesh keys new` mints "
     "them); this one is not (not shown)"),
], ids=["cacert", "url-empty", "url-space", "url-port-range", "url-port-text", "url-scheme", "url-bracket",
        "api-key"])
def test_generate_and_models_refuse_a_bad_variable_naming_it(
        env: dict[str, str], line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA: each was refused naming a flag the user had not given, or failed the
    call with a gRPC status that did not say where the value came from."""
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("NOWHERE", str(tmp_path / "ca.pem")))
    line = line.replace("NOWHERE", str(tmp_path / "ca.pem"))
    for argv in (["generate", "x"], ["models"]):
        assert cli.main(argv) == 2
        assert capsys.readouterr() == ("", f"llmesh: {line}\n")


@pytest.mark.parametrize("timeout", ["0", "-1", "soon"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(
        timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--timeout", timeout, "hi"])
    assert exit_info.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_up_refuses_an_absent_tensorrt_llm_in_one_line_before_starting(
        tmp_path, capsys, monkeypatch) -> None:
    # As on a host without it (CI), wherever the test runs.
    monkeypatch.setattr(availability, "tensorrt_llm_installed", lambda: False)
    run_dir = tmp_path / "run"
    for argv in (["--backend", "tensorrt_llm"], ["--engine-arg=--backend=tensorrt_llm"]):
        assert cli.main(["up", "--run-dir", str(run_dir), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs TensorRT-LLM" in err and "pip install" in err
    monkeypatch.setenv("LLMESH_ENGINE_BACKEND", "tensorrt_llm")
    assert cli.main(["up", "--run-dir", str(run_dir)]) == 2
    assert "needs TensorRT-LLM" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing started


@pytest.mark.parametrize(("argv", "env", "flags"), [
    # each engine's 1 GiB cache + 1 GiB tier fits in the 3 GiB; two do not
    (["--engines", "2", "--engine-arg=--kv-offload-bytes=1GiB"], {},
     f"2 engine(s) x (--kv-cache-bytes {1 << 30} + --kv-offload-bytes {1 << 30})"),
    (["--engines", "3"], {"LLMESH_ENGINE_KV_CACHE_BYTES": "1.5GiB"},
     f"3 engine(s) x (--kv-cache-bytes {3 << 29})"),
])
def test_up_refuses_engines_whose_kv_memory_together_exceeds_mem_available(
        argv: list[str], env: dict[str, str], flags: str, tmp_path, capsys,
        monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "available_host_memory_bytes", lambda: 3 << 30)
    err = _up_refused(argv, env, tmp_path, capsys, monkeypatch)
    assert err.startswith(f"llmesh: {flags} = ")
    assert f"exceed the {3 << 30} bytes (3.00 GiB) available on this host (MemAvailable)" in err


def _up_refused(argv: list[str], env: dict[str, str], tmp_path, capsys,
                monkeypatch) -> str:
    """``llmesh up ARGV`` with ``env``: exit 2 with one line (returned), before
    anything started."""
    def start(*args, **kwargs):
        raise AssertionError("the mesh was started")

    monkeypatch.setattr("services.cli.mesh.Mesh", start)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    assert cli.main(["up", "--run-dir", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert not run_dir.exists()
    return err


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--engine-arg=--kv-cache-bytes=1PiB"], {}, "--engine-arg: argument --kv-cache-bytes: "),
    (["--engine-arg=--kv-offload-bytes=-5GiB"], {}, "--engine-arg: argument --kv-offload-bytes: "),
    ([], {"LLMESH_ENGINE_KV_CACHE_BYTES": "1PiB"}, "LLMESH_ENGINE_KV_CACHE_BYTES='1PiB': "),
])
def test_up_refuses_a_kv_size_that_does_not_parse_before_starting(
        argv: list[str], env: dict[str, str], named: str, tmp_path, capsys,
        monkeypatch) -> None:
    """QA, issue 31: such sizes passed the host-memory check and each engine
    failed later; now the engines' own parser refuses them up front."""
    err = _up_refused(argv, env, tmp_path, capsys, monkeypatch)
    assert err.startswith(f"llmesh: {named}expected a size like ")
    assert "(units KiB MiB GiB TiB, KB MB GB TB)" in err


#: How ``llmesh up`` leads an engine's start-up refusal.
ENGINES_REFUSE = "llmesh: the engines would refuse to start: "


@pytest.mark.parametrize(("argv", "env", "reason"), [
    (["--engine-arg=--ngram-min=5", "--engine-arg=--ngram-max=2"], {},
     "need 1 <= ngram_min <= ngram_max, got 5 and 2"),
    ([], {"LLMESH_ENGINE_NGRAM_MIN": "5", "LLMESH_ENGINE_NGRAM_MAX": "2"},
     "need 1 <= ngram_min <= ngram_max, got 5 and 2"),
    (["--engine-arg=--num-speculative-tokens=999"], {},
     "num_speculative_tokens must be in [1, "),
    (["--engine-arg=--suffix-max-match=1"], {}, "suffix max_match must be at least 2, got 1"),
    (["--engine-arg=--kv-offload-dir=/tmp"], {},
     "--kv-offload-dir needs --kv-offload-bytes (the tier's size)"),
    (["--engine-arg=--kv-offload-bytes=1MiB", "--engine-arg=--no-enable-prefix-caching"], {},
     "--kv-offload-bytes needs prefix caching (--enable-prefix-caching)"),
    (["--dtype", "bfloat16", "--quantization", "int4"], {},
     "--quantization int4 runs bf16 projections on an fp32 residual stream"),
    (["--engine-arg=--speculative-method=eagle3"], {},
     "--speculative-method eagle3 is implemented by the tensorrt_llm backend only"),
    (["--model-path", "NOWHERE/m.gguf"], {}, "no GGUF file or checkpoint directory at NOWHERE"),
], ids=["ngram-flags", "ngram-env", "spec-tokens", "suffix", "offload-dir",
        "offload-no-prefix-cache", "quantization-dtype", "eagle3-on-torch", "model-path"])
def test_up_refuses_what_the_engine_would_refuse_at_start_before_starting(
        argv: list[str], env: dict[str, str], reason: str, tmp_path, capsys,
        monkeypatch) -> None:
    """QA: cross-field engine checks (``--ngram-min`` above ``--ngram-max``, a
    speculative token count out of bounds, a second KV tier without its size)
    failed only in the engine's log, after the other services had started;
    ``llmesh up`` now runs the engine's own start checks first (exit 2)."""
    argv = [arg.replace("NOWHERE", str(tmp_path / "none")) for arg in argv]
    reason = reason.replace("NOWHERE", str(tmp_path / "none"))
    err = _up_refused(argv, env, tmp_path, capsys, monkeypatch)
    assert err.startswith(ENGINES_REFUSE + reason), err


def test_up_refuses_an_engine_option_in_the_engines_own_words(tmp_path, capsys,
                                                               monkeypatch) -> None:
    """One definition of each rule: ``llmesh up`` prints the line that
    ``python -m services.engine`` prints for the same flags."""
    flags = ["--ngram-min", "5", "--ngram-max", "2"]
    engine = subprocess.run([sys.executable, "-m", "services.engine", *flags],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert engine.returncode == 2
    prefix = "python -m services.engine: error: "
    assert engine.stderr.startswith(prefix) and engine.stderr.count("\n") == 1, engine.stderr
    err = _up_refused([f"--engine-arg={flag}" for flag in flags], {}, tmp_path, capsys,
                      monkeypatch)
    assert err == ENGINES_REFUSE + engine.stderr.removeprefix(prefix)


@pytest.mark.parametrize(("argv", "line"), [
    (["--router-arg=--max-queued-requests=-1"],
     "--router-arg: argument --max-queued-requests: must be >= 0, got -1"),
    (["--router-arg=--max-queued-requests", "--router-arg=many"],
     "--router-arg: argument --max-queued-requests: expected a whole number >= 0, got 'many'"),
    (["--router-arg=--no-such-flag"], "--router-arg: unrecognized arguments: --no-such-flag"),
    (["--retrieval", "--retriever-arg=--default-top-k=0"],
     "--retriever-arg: need 1 <= --default-top-k <= --max-top-k"),
    (["--retrieval", "--retriever-arg=--batch-size=0"],
     "--retriever-arg: argument --batch-size: must be >= 1, got 0"),
    (["--retriever-arg=--batch-size=8"],  # QA: checked, then silently ignored
     "--retriever-arg needs --retrieval (no retriever is started without it)"),
    (["--engine-arg=--no-such-flag"], "--engine-arg: unrecognized arguments: --no-such-flag"),
    # QA (stop 43): each started the mesh and failed later, or never.
    (["--engine-arg=--max-num-seqs=99999999999999999999"],  # the engine grew to 24 GB
     "--engine-arg: argument --max-num-seqs/--max-batch-size: must be in [1, 16384], "
     "got 99999999999999999999"),
    (["--router-arg=--startup-timeout=-1"],
     "--router-arg: argument --startup-timeout: must be a number > 0, got -1"),
    (["--router-arg=--log-level=FOO"],  # a KeyError traceback in the router
     "--router-arg: argument --log-level: invalid choice: 'foo' (choose from 'debug', "
     "'info', 'warning', 'error', 'critical')"),
], ids=["router-negative", "router-not-a-number", "router-unknown", "retriever-top-k",
        "retriever-batch", "retriever-without-retrieval", "engine-unknown",
        "engine-huge-size", "router-timeout", "router-log-level"])
def test_up_refuses_a_pass_through_flag_the_service_would_refuse_before_starting(
        argv: list[str], line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA, issue 35: ``--router-arg=--max-queued-requests=-1`` failed only when
    the router started, after the other services; now the service's own
    parser and configuration refuse it up front, in one line naming the flag."""
    assert _up_refused(argv, {}, tmp_path, capsys, monkeypatch) == f"llmesh: {line}\n"


@pytest.mark.parametrize(("argv", "line"), [
    (["--router-arg=--port=5"], "--router-arg: --port is set by llmesh up itself; "),
    (["--router-arg=--metrics-p", "--router-arg=7"],  # an abbreviation, as argparse takes it
     "--router-arg: --metrics-port is set by llmesh up itself; "),
    (["--router-arg=--engine=127.0.0.1:9"], "--router-arg: --engine is set by llmesh up itself; "),
    (["--engine-arg=--replica-id=x"], "--engine-arg: --replica-id is set by llmesh up itself; "),
    (["--retrieval", "--retriever-arg=--data-dir=/tmp"],
     "--retriever-arg: --data-dir is set by llmesh up itself; "),
    (["--retrieval", "--router-arg=--api-keys=KEYS"],  # QA: the retriever stayed on the ingress
     "--router-arg: --api-keys is set by llmesh up itself; use up's --api-keys"),
], ids=["router-port", "router-abbreviated", "router-engine", "engine-replica-id",
        "retriever-data-dir", "router-api-keys"])
def test_up_refuses_a_pass_through_flag_that_it_sets_itself(
        argv: list[str], line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA: ``--router-arg=--port=5`` was accepted and overrode the port the
    launcher had chosen; such a flag is refused before anything starts, naming
    where it is set instead. Flags the launcher leaves to the user pass."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: []\n")
    argv = [arg.replace("KEYS", str(keys)) for arg in argv]
    assert _up_refused(argv, {}, tmp_path, capsys, monkeypatch).startswith(f"llmesh: {line}")


@pytest.mark.parametrize(("flag", "prog"), [("--engine-arg", "services.engine"),
                                          ("--router-arg", "services.router")])
def test_up_pass_through_help_prints_that_services_help(flag: str, prog: str, capsys,
                                                         monkeypatch) -> None:
    """QA: ``--engine-arg=--help`` was refused as an unknown flag where
    ``--router-arg=--help`` printed the router's help; both print their own."""
    monkeypatch.setattr("services.cli.mesh.Mesh", None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", f"{flag}=--help"])
    assert exit_.value.code == 0
    assert f"usage: python -m {prog}" in capsys.readouterr().out


def test_up_reads_the_api_key_file_before_starting(tmp_path, capsys, monkeypatch) -> None:
    """QA: a key file that does not parse stopped the router only after the
    tokenizer and the engines had started; now ``up`` refuses it first."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: [\n")
    assert (_up_refused(["--api-keys", str(keys)], {}, tmp_path, capsys, monkeypatch)
            == f"llmesh: --api-keys: {keys}: not valid YAML or JSON (line 2)\n")


def test_up_refuses_a_repeated_model_name_or_a_missing_file_before_starting(
        tmp_path, capsys) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert cli.main(["up", "--model", f"a={gguf}", "--model", f"a={gguf}"]) == 2
    assert "each --model needs its own NAME" in capsys.readouterr().err
    assert cli.main(["up", "--model", f"a={gguf}", "--model", f"b={tmp_path}/no.gguf"]) == 2
    assert "no GGUF file or checkpoint directory (with config.json) at" in capsys.readouterr().err
    assert cli.main(["up", "--model", f"a={gguf}", "--model", f"b={tmp_path}"]) == 2  # no config
    assert f"checkpoint directory (with config.json) at {tmp_path}" in capsys.readouterr().err
    assert cli.main(["up", "--model", f"a={gguf}", "--model-path", str(gguf)]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("with_keys", [False, True])
def test_up_routes_the_retriever_on_the_ingress_only_without_api_keys(
        with_keys: bool, tmp_path, monkeypatch) -> None:
    """QA, issue 35: with --api-keys anyone reached the retriever's API (create,
    ingest, delete) through Envoy without a key; the retriever checks none, so
    with keys on its API stays at its own address."""
    made: list[dict] = []

    def record(*args, **kwargs):
        made.append(kwargs)
        raise SystemExit(3)

    monkeypatch.setattr("services.cli.mesh.Mesh", record)
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: []\n")
    argv = ["up", "--run-dir", str(tmp_path / "run"), "--retrieval",
            *(["--api-keys", str(keys)] if with_keys else [])]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert made and made[0]["retrieval"] is True
    assert made[0]["retriever_on_ingress"] is (not with_keys)


@pytest.mark.parametrize(("flag", "line"), [
    ("--start-timeout=-5", "argument --start-timeout: must be a number > 0, got -5"),
    ("--drain-seconds=nan", "argument --drain-seconds: must be a finite number >= 0, got nan"),
    ("--stream-idle-timeout=-1",
     "argument --stream-idle-timeout: must be a finite number >= 0, got -1"),
])
def test_up_refuses_its_own_bad_times_before_starting(
        flag: str, line: str, tmp_path, capsys, monkeypatch) -> None:
    """QA (stop 43): ``--start-timeout=-5`` started the mesh and failed with
    "did not bind a port within -5 s"; ``--stream-idle-timeout=-1`` failed in
    the router with its whole usage; ``--drain-seconds=nan`` was taken."""
    def start(*args, **kwargs):
        raise AssertionError("the mesh was started")

    monkeypatch.setattr("services.cli.mesh.Mesh", start)
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--run-dir", str(tmp_path / "run"), flag])
    assert exited.value.code == 2
    assert line in capsys.readouterr().err
