"""The per-job certificate authority that secures a job's etcd client traffic.

``run_job`` calls :func:`make_job_tls` once per job and uploads each object to
``s3://<bucket>/petctl/jobs/<job>/tls/<name>``; the job's instances fetch only what their role
needs (the rendezvous instance ``ca.pem`` and ``ca.key``, a worker ``ca.pem``, ``client.pem`` and
``client.key``: cfn_templates/iam_roles.yaml.j2). The rendezvous instance signs its own server
certificate at boot with ``openssl`` for the ENI address it serves on (which only exists once the
job stack does), then deletes the CA key from its disk.

Choices:

* **EC P-256** keys: every party speaks it (etcd's Go TLS, OpenSSL on Amazon Linux 2023, Python's
  ``ssl`` under python-etcd and urllib3), and a key is made in microseconds, so ``run_job`` stays
  fast.
* **365 days** of validity for the CA and the client certificate. Jobs run for days, weeks at most,
  and nothing renews a certificate during a job: an expiry mid-job would stop every rendezvous.
  The exposure is bounded by the job instead: each job has its own CA, trusted only by that job's
  etcd, and ``kill_job`` deletes the objects and the etcd that trusted them.
* ``notBefore`` one hour back, so a laptop whose clock runs ahead does not issue certificates
  the instances consider not yet valid.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Every object :func:`make_job_tls` returns, in upload order.
NAMES = ("ca.pem", "ca.key", "client.pem", "client.key")
#: What each role's instances fetch (and all their IAM role may read under ``tls/``).
RDZV_OBJECTS = ("ca.pem", "ca.key")
WORKER_OBJECTS = ("ca.pem", "client.pem", "client.key")

VALIDITY = datetime.timedelta(days=365)
CLOCK_SKEW = datetime.timedelta(hours=1)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "petctl"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


#: Every flag of X.509 keyUsage, as :class:`cryptography.x509.KeyUsage` names them.
_KEY_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


def _key_usage(*usages: str) -> x509.KeyUsage:
    """A keyUsage with only ``usages`` on (cryptography wants all nine flags spelled out; a name
    that is not one of them is a TypeError)."""
    return x509.KeyUsage(**(dict.fromkeys(_KEY_USAGES, False) | dict.fromkeys(usages, True)))


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    start: datetime.datetime,
    end: datetime.datetime,
) -> x509.CertificateBuilder:
    """A certificate of ``key`` for ``subject``, issued by ``issuer``, valid from ``start`` to ``end``."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )


def make_job_tls(job: str) -> dict[str, bytes]:
    """A new CA for job ``job`` and a client certificate it signed, as PEM bytes.

    Returns:
        ``{"ca.pem", "ca.key", "client.pem", "client.key"}``: the CA certificate (CA:TRUE,
        path length 0, keyCertSign) and its key, and a client certificate (extendedKeyUsage
        clientAuth only, CN ``petctl-<job>-worker``) and its key. Keys are unencrypted PKCS#8:
        they are protected by S3 (SSE, the job's IAM roles) and by 0600 root files on the
        instances.
    """
    if not job:
        raise ValueError("make_job_tls needs the job name")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - CLOCK_SKEW, now + VALIDITY

    ca_key = _key()
    ca_name = _name(f"petctl {job} etcd CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        _builder(ca_name, ca_name, ca_key, start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage("key_cert_sign", "crl_sign"), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    client_key = _key()
    client = (
        _builder(_name(f"petctl-{job}-worker"), ca_name, client_key, start, end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage("digital_signature"), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(client_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return {
        "ca.pem": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": _key_pem(ca_key),
        "client.pem": client.public_bytes(serialization.Encoding.PEM),
        "client.key": _key_pem(client_key),
    }
