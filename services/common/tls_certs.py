"""TLS certificates for the mesh: a private CA, server and client certificates,
and the checks ``llmesh up`` runs on the files it is given.

Built on the ``cryptography`` library (X.509 builder, EC P-256 keys, SHA-256
signatures), in the shape of its "Creating a self-signed certificate" and
"Creating a certificate signing request" tutorials (cryptography.io, x509).

* :func:`issue_ca` makes a CA (``basicConstraints CA:TRUE``, ``keyCertSign``).
* :func:`issue_leaf` makes a certificate signed by a CA for a server, a
  client or both (``extendedKeyUsage``), with DNS and IP subject alternative
  names: gRPC, Envoy and ``urllib`` verify the name against the SANs, never
  the common name.
* :func:`write_self_signed` writes a CA and a server certificate for the
  ingress (``llmesh up --tls-self-signed``); :func:`write_mesh_pki` a mesh CA
  and one certificate per internal service (``--internal-mtls``).
* :func:`check_key_pair` reads a cert/key pair given on the command line and
  raises :class:`TlsFileError` with one line saying what is wrong.

Files are PEM; private keys are PKCS#8, unencrypted, mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Validity of the certificates issued here (days). Long enough for a dev mesh.
VALIDITY_DAYS = 365
#: The names every certificate issued here covers (loopback clients).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: Addresses that mean "every interface": never a name a client dials.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class TlsFileError(ValueError):
    """A certificate or key file is missing, unreadable, not PEM, or the key
    does not belong to the certificate; the message is one line naming the file."""


@dataclass(frozen=True)
class KeyPair:
    """Where one certificate and its key are (PEM files).

    Attributes:
      cert: the certificate (for a leaf signed by a CA, the leaf alone).
      key: its private key (PKCS#8).
    """

    cert: Path
    key: Path


@dataclass(frozen=True)
class Issued:
    """An issued certificate in memory (for the next issue or for writing)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def issue_ca(common_name: str = "llmesh CA") -> Issued:
    """A self-signed CA certificate with a new EC P-256 key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def san_entries(names: Iterable[str]) -> list[x509.GeneralName]:
    """Subject alternative names: an IP literal as an IP address, anything else
    as a DNS name; wildcard bind addresses and duplicates are left out."""
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(n.strip("[]") for n in names):
        if name in WILDCARD_HOSTS:
            continue
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def issue_leaf(ca: Issued, common_name: str, names: Iterable[str], *,
               server: bool = True, client: bool = False) -> Issued:
    """A certificate for ``names`` (SANs) signed by ``ca``.

    Args:
      server, client: the extended key usages (TLS server / TLS client auth).

    Raises:
      ValueError: no usable name (only wildcards) and ``server`` set.
    """
    sans = san_entries(names)
    if server and not sans:
        raise ValueError(f"a server certificate for {common_name!r} needs a name or address")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(ca.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False, crl_sign=False,
            content_commitment=False, data_encipherment=False, key_agreement=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                       critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def write_cert(path: Path, cert: x509.Certificate) -> Path:
    """Writes ``cert`` as PEM; returns ``path``."""
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    """Writes ``key`` as unencrypted PKCS#8 PEM, readable by the owner only."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def write_pair(folder: Path, stem: str, issued: Issued) -> KeyPair:
    """Writes ``folder/stem.crt`` and ``folder/stem.key``."""
    folder.mkdir(parents=True, exist_ok=True)
    return KeyPair(write_cert(folder / f"{stem}.crt", issued.cert),
                   write_key(folder / f"{stem}.key", issued.key))


@dataclass(frozen=True)
class IngressCerts:
    """What :func:`write_self_signed` wrote: ``ca`` (give it to clients:
    ``grpcurl -cacert``, ``llmesh generate --cacert``) and the server pair."""

    ca: Path
    server: KeyPair


def write_self_signed(folder: Path, hosts: Iterable[str] = ()) -> IngressCerts:
    """A new CA and an ingress server certificate for :data:`LOOPBACK_NAMES`
    plus ``hosts`` (wildcards skipped), as ``folder/ca.crt`` and
    ``folder/server.{crt,key}`` (the CA key is not kept: nothing else is issued
    under it)."""
    ca = issue_ca("llmesh ingress CA")
    server = issue_leaf(ca, "llmesh ingress", [*LOOPBACK_NAMES, *hosts])
    folder.mkdir(parents=True, exist_ok=True)
    return IngressCerts(write_cert(folder / "ca.crt", ca.cert),
                        write_pair(folder, "server", server))


@dataclass(frozen=True)
class MeshPki:
    """The internal mTLS material :func:`write_mesh_pki` wrote.

    Attributes:
      ca: the mesh CA certificate every service trusts (servers require client
        certificates it signed; clients verify servers against it).
      pairs: name (``envoy``, ``router``, ``engine-0``...) → its certificate,
        valid as TLS server and client, for :data:`LOOPBACK_NAMES` and the
        service host.
    """

    ca: Path
    pairs: dict[str, KeyPair]


def write_mesh_pki(folder: Path, names: Iterable[str], hosts: Iterable[str] = ()) -> MeshPki:
    """A mesh CA (``folder/mesh-ca.crt``) and one server+client certificate per
    name (``folder/<name>.{crt,key}``) for :data:`LOOPBACK_NAMES` and ``hosts``."""
    ca = issue_ca("llmesh mesh CA")
    folder.mkdir(parents=True, exist_ok=True)
    sans = [*LOOPBACK_NAMES, *hosts]
    pairs = {name: write_pair(folder, name, issue_leaf(ca, name, sans, client=True))
             for name in names}
    return MeshPki(write_cert(folder / "mesh-ca.crt", ca.cert), pairs)


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsFileError(f"{what} {path}: cannot read it ({error.strerror})") from None


def load_certificates(path: Path, what: str = "certificate") -> list[x509.Certificate]:
    """The PEM certificates in ``path`` (a chain or a CA bundle), first one first.

    Raises:
      TlsFileError: unreadable, or no PEM certificate in it.
    """
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TlsFileError(f"{what} {path}: no PEM certificate in it "
                           "(expected -----BEGIN CERTIFICATE-----)")
    return certs


def check_key_pair(cert_path: Path, key_path: Path) -> x509.Certificate:
    """Checks a certificate and key given on the command line; returns the
    (leaf) certificate.

    Raises:
      TlsFileError: either file unreadable or not PEM, an encrypted key, or a
        key that does not belong to the certificate.
    """
    leaf = load_certificates(cert_path, "--tls-cert")[0]
    data = _read(key_path, "--tls-key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise TlsFileError(f"--tls-key {key_path}: the key is encrypted; give an "
                           "unencrypted PEM key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsFileError(f"--tls-key {key_path}: not a PEM private key "
                           "(expected -----BEGIN PRIVATE KEY-----)") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.PEM, public)
            != leaf.public_key().public_bytes(serialization.Encoding.PEM, public)):
        raise TlsFileError(f"--tls-key {key_path} does not match the certificate in "
                           f"--tls-cert {cert_path}")
    return leaf
