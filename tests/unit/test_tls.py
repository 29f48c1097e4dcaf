"""The per-job etcd CA (petctl/tls.py) and the rendezvous boot's own signing step: the chain
verifies (cryptography and the real openssl), the usages and SANs are what etcd and its clients
check, and a TLS handshake with client certificates works only within one job."""

from __future__ import annotations

import datetime
import ipaddress
import re
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from petctl import templates, tls

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None or shutil.which("bash") is None, reason="no openssl/bash")


@pytest.fixture(scope="module")
def objects() -> dict[str, bytes]:
    return tls.make_job_tls("train-1")


def _cert(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


def test_objects_and_keys(objects: dict[str, bytes]) -> None:
    assert tuple(objects) == tls.NAMES
    assert set(tls.RDZV_OBJECTS) | set(tls.WORKER_OBJECTS) == set(tls.NAMES)
    assert "ca.key" not in tls.WORKER_OBJECTS and "client.key" not in tls.RDZV_OBJECTS
    for cert_name, key_name in (("ca.pem", "ca.key"), ("client.pem", "client.key")):
        key = serialization.load_pem_private_key(objects[key_name], password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert objects[key_name].startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
        assert key.public_key() == _cert(objects[cert_name]).public_key()


def test_ca_and_client_certificate(objects: dict[str, bytes]) -> None:
    ca, client = _cert(objects["ca.pem"]), _cert(objects["client.pem"])
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    ca.verify_directly_issued_by(ca)  # self-signed
    client.verify_directly_issued_by(ca)
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "petctl-train-1-worker"
    assert not client.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # never a server certificate
    now = datetime.datetime.now(datetime.timezone.utc)
    for cert in (ca, client):
        assert cert.not_valid_before_utc <= now - datetime.timedelta(minutes=30)  # a clock ahead
        assert cert.not_valid_after_utc - now > datetime.timedelta(days=300)  # outlives any job


def test_each_job_has_its_own_ca(objects: dict[str, bytes]) -> None:
    other = tls.make_job_tls("train-2")
    assert other["ca.pem"] != objects["ca.pem"]
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises ValueError or InvalidSignature
        _cert(other["client.pem"]).verify_directly_issued_by(_cert(objects["ca.pem"]))
    with pytest.raises(ValueError):
        tls.make_job_tls("")


def _write(directory: Path, objects: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in objects.items():
        (directory / name).write_bytes(data)


def _openssl_verify(directory: Path, cert: str, purpose: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OPENSSL, "verify", "-purpose", purpose, "-CAfile", str(directory / "ca.pem"), str(directory / cert)],
        capture_output=True,
        text=True,
    )


@needs_openssl
def test_openssl_verifies_the_client_chain(tmp_path: Path, objects: dict[str, bytes]) -> None:
    _write(tmp_path, objects)
    assert _openssl_verify(tmp_path, "client.pem", "sslclient").returncode == 0
    assert _openssl_verify(tmp_path, "client.pem", "sslserver").returncode != 0  # clientAuth only


def _rdzv_tls_step(etc: Path, source: Path) -> str:
    """The rendezvous boot script's TLS step, as rendered, run against local files: from
    ``TLS=/etc/petctl/tls`` to the ``umask 022`` that ends it, with ``aws s3 cp`` copying from
    ``source`` and ``/etc`` moved under ``etc``."""
    data = templates.load_template(templates.render_job())
    script = data["Resources"]["RdzvLaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"]
    text = script["Fn::Base64"]["Fn::Sub"]
    start = text.index("TLS=/etc/petctl/tls")
    step = text[start : text.index("umask 022\n", start) + len("umask 022\n")]
    step = re.sub(r"\$\{JobName\}", "train-1", step).replace("/etc/", f"{etc}/")
    assert "${" not in step
    prelude = (
        "set -Eeuo pipefail\n"
        "ENI_IP=10.0.0.10 REGION=us-east-1 JOB_URL=s3://bucket/petctl/jobs/train-1\n"
        'retry() { "$@"; }\n'
        f'aws() {{ cp "{source}/$(basename "$6")" "$7"; }}\n'
    )
    return prelude + step


def _handshake(server: Path, client: tuple[Path, Path] | None, ca: Path) -> str:
    """One TLS connection to 127.0.0.1 (server requiring client certificates); returns what the
    server read, or raises the client's ssl error."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server / "server.pem", server / "server.key")
    server_ctx.load_verify_locations(ca)
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # etcd --client-cert-auth
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[str] = []

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                got.append(s.recv(16).decode())
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(ca))
    if client:
        client_ctx.load_cert_chain(*client)
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"ping")
                s.recv(1)  # TLS 1.3: the server's verdict on the client certificate arrives here
    except (ssl.SSLError, ConnectionResetError) as e:
        raise ssl.SSLError(str(e)) from e
    finally:
        thread.join(10)
        listener.close()
    return got[0] if got else ""


@needs_openssl
def test_rdzv_boot_signs_its_server_certificate_and_drops_the_ca_key(
    tmp_path: Path, objects: dict[str, bytes]
) -> None:
    source = tmp_path / "s3"
    _write(source, {k: objects[k] for k in tls.RDZV_OBJECTS})
    etc = tmp_path / "etc"
    step = _rdzv_tls_step(etc, source)
    result = subprocess.run(["bash", "-c", step], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    d = etc / "petctl" / "tls"
    assert {p.name for p in d.iterdir()} == {"ca.pem", "check.key", "check.pem", "server.key", "server.pem"}
    assert d.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in d.iterdir())

    server = _cert((d / "server.pem").read_bytes())
    server.verify_directly_issued_by(_cert(objects["ca.pem"]))
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.10"),
        ipaddress.ip_address("127.0.0.1"),
    ]
    # clientAuth as well: etcd's gRPC gateway dials etcd itself with the server certificate
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    ]
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert _openssl_verify(d, "server.pem", "sslserver").returncode == 0
    assert _openssl_verify(d, "check.pem", "sslclient").returncode == 0
    assert _openssl_verify(d, "check.pem", "sslserver").returncode != 0

    # etcd's handshake: the job's worker certificate is accepted, no certificate or another job's
    # is refused, and a client of another job does not trust this server.
    worker = tmp_path / "worker"
    _write(worker, objects)
    ca = worker / "ca.pem"
    assert _handshake(d, (worker / "client.pem", worker / "client.key"), ca) == "ping"
    with pytest.raises(ssl.SSLError):
        _handshake(d, None, ca)
    stranger = tmp_path / "stranger"
    _write(stranger, tls.make_job_tls("train-2"))
    with pytest.raises(ssl.SSLError):
        _handshake(d, (stranger / "client.pem", stranger / "client.key"), ca)
    with pytest.raises(ssl.SSLError):
        _handshake(d, (worker / "client.pem", worker / "client.key"), stranger / "ca.pem")
