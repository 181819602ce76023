"""``llmesh up``'s TLS flags are checked before anything starts: a bad
combination or a bad file is one line on stderr and exit status 2; the
server kit's ``--tls-cert --tls-key --tls-ca`` go together. In process, no
mesh is started."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli.main import main as llmesh
from services.common import tls_certs
from services.common.server import add_server_arguments, server_config_from_args


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tls_certs.IngressCerts:
    return tls_certs.write_self_signed(tmp_path_factory.mktemp("certs"), ["0.0.0.0", "mesh.lan"])


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert llmesh(["up", "--run-dir", "/nonexistent/never-made", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmesh: "), err
    assert not Path("/nonexistent/never-made").exists()
    return err


def test_bad_tls_flag_combinations_exit_2_with_one_line(
        certs: tls_certs.IngressCerts, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    cert, key = str(certs.server.cert), str(certs.server.key)
    assert "--tls-cert needs --tls-key" in _refused(["--tls-cert", cert], capsys)
    assert "--tls-key needs --tls-cert" in _refused(["--tls-key", key], capsys)
    assert "not both" in _refused(["--tls-cert", cert, "--tls-key", key, "--tls-self-signed"],
                                  capsys)
    assert "--plaintext-port" in _refused(["--plaintext-port", "0"], capsys)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert "no PEM certificate" in _refused(["--tls-cert", str(garbage), "--tls-key", key],
                                            capsys)
    assert "not a PEM private key" in _refused(["--tls-cert", cert, "--tls-key", str(garbage)],
                                               capsys)
    assert "cannot read" in _refused(["--tls-cert", str(tmp_path / "absent.crt"),
                                      "--tls-key", key], capsys)
    other = tls_certs.write_mesh_pki(tmp_path / "other", ["x"]).pairs["x"]
    assert "does not match" in _refused(["--tls-cert", cert, "--tls-key", str(other.key)],
                                        capsys)


def test_self_signed_certificate_names_loopback_and_the_host(
        certs: tls_certs.IngressCerts) -> None:
    leaf = tls_certs.check_key_pair(certs.server.cert, certs.server.key)
    sans = leaf.extensions.get_extension_for_class(tls_certs.x509.SubjectAlternativeName).value
    names = {str(v) for v in sans.get_values_for_type(tls_certs.x509.DNSName)}
    addresses = {str(v) for v in sans.get_values_for_type(tls_certs.x509.IPAddress)}
    assert names == {"localhost", "mesh.lan"} and addresses == {"127.0.0.1", "::1"}
    assert certs.server.key.stat().st_mode & 0o077 == 0  # the key is the owner's only


def test_server_kit_tls_flags_go_together(certs: tls_certs.IngressCerts,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    both = ["--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key)]
    with pytest.raises(SystemExit) as exited:
        server_config_from_args("router", parser.parse_args(both))
    assert exited.value.code == 2 and "missing --tls-ca" in capsys.readouterr().err
    config = server_config_from_args("router", parser.parse_args([*both, "--tls-ca",
                                                                  str(certs.ca)]))
    assert config.tls is not None and config.tls.ca == certs.ca
    assert server_config_from_args("router", parser.parse_args([])).tls is None
