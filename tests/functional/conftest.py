"""A real moto server over HTTP on 127.0.0.1, shared by the functional tests and reset between them."""

from __future__ import annotations

import http.server
import json
import os
import threading
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    from petctl.local import moto_patches

    # The local cloud's patches make moto refuse/answer what AWS does (moto_patches docstring),
    # so these tests fail the way AWS would.
    moto_patches.apply()
    # port 0: the server binds a free port itself (a port picked first and bound a moment later
    # can be taken in between; then make_server raised in moto's thread and start() waited forever)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    yield url
    server.stop()


class Releases(http.server.BaseHTTPRequestHandler):
    """etcd's release files as ``setup`` downloads them (petctl/infra/etcd_copy.py): ``files``,
    by path, set by a test; anything else is a 404 (a mirror without the file)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def release_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Releases)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def aws(moto_url: str, release_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Empty moto state, boto3 pointed at it, a fresh PETCTL_HOME, and etcd's release files
    (none unless a test puts some in ``Releases.files``) on 127.0.0.1, never GitHub."""
    req = urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    Releases.files = {}
    monkeypatch.setenv("PETCTL_ETCD_RELEASE_BASE", release_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return moto_url


@pytest.fixture
def run(aws: str):
    """Invoke the CLI; returns (exit_code, stdout, stderr)."""
    from petctl.cli import cli

    def _run(*args: str, input: str | None = None):
        runner = CliRunner()
        result = runner.invoke(cli, list(args), input=input, catch_exceptions=True)
        return result

    return _run


@pytest.fixture
def profile_data(aws: str):
    """Read a saved profile file back."""

    def _read(name: str = "default") -> dict:
        return json.loads((Path(os.environ["PETCTL_HOME"]) / "profiles" / f"{name}.json").read_text())

    return _read


@pytest.fixture
def wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in wheel to upload (building the real one is tested in test_dist.py)."""
    w = tmp_path / "petctl-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("petctl/__init__.py", "")
    monkeypatch.setenv("PETCTL_DIST", str(w))
    return w


@pytest.fixture
def ready(run, wheel: Path, tmp_path: Path) -> Path:
    """The base stack made; returns a training script to submit."""
    r = run("setup")
    assert r.exit_code == 0, r.output
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    return script
