"""No raw service text reaches a user: every shape of boto error is one line (service, operation,
AWS's code and message, what to do), never an HTTP body, an XML or HTML page, or a Python repr; a
region or endpoint that cannot exist fails before any call. Against a real moto server over HTTP,
a server answering an HTML error page, and a port nothing listens on."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.config
import pytest

from petctl.errors import describe_aws_error
from petctl.gateway import session

RAW = ("<", "Traceback", "Error(", "botocore.", "HTTPConnection", "b'")


def one_clean_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert not any(r in lines[0] for r in RAW), lines[0]
    return lines[0]


@pytest.fixture
def one_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """No retries: a refused connection fails at once instead of after 8 backed-off attempts."""
    monkeypatch.setattr(session, "_RETRIES", botocore.config.Config(retries={"max_attempts": 1}))


@pytest.fixture
def html_server() -> Iterator[str]:
    """What a proxy in the way answers: HTTP 502 with an HTML page."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"
            self.send_response(502)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_moto_error_names_service_operation_code_and_message(aws: str, one_attempt: None) -> None:
    clients = session.Clients("us-east-1", endpoint_url=aws)
    with pytest.raises(Exception) as e:
        clients("cloudformation").describe_stacks(StackName="nope")
    assert one_clean_line(describe_aws_error(e.value)) == (
        "AWS cloudformation DescribeStacks failed: ValidationError: Stack with id nope does not exist"
    )


def test_moto_html_500_page_is_one_line(aws: str, one_attempt: None) -> None:
    """moto answers an operation it does not implement with a Werkzeug HTML 500 page, which botocore
    cannot parse: its text (HTML, a bytes repr) must not reach the user."""
    ec2 = session.Clients("us-east-1", endpoint_url=aws)("ec2")
    with pytest.raises(Exception) as e:
        ec2.describe_capacity_block_offerings(CapacityDurationHours=24)
    assert type(e.value).__name__ == "ResponseParserError" and "<html" in str(e.value).lower()
    line = one_clean_line(describe_aws_error(e.value))
    assert "not an AWS response (500 Internal Server Error)" in line and "AWS_ENDPOINT_URL" in line


def test_parameter_validation_is_one_line(aws: str) -> None:
    with pytest.raises(Exception) as e:
        session.Clients("us-east-1", endpoint_url=aws)("cloudformation").describe_stacks(StackName=5)
    assert one_clean_line(describe_aws_error(e.value)).startswith(
        "invalid AWS request: Invalid type for parameter StackName, value: 5"
    )


def test_cli_behind_an_html_error_page(run, html_server: str, monkeypatch, one_attempt: None) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", html_server)
    r = run("setup")
    assert r.exit_code == 1
    line = one_clean_line(r.output)
    assert line.startswith("Error: AWS sts GetCallerIdentity failed: 502: HTTP 502 Bad Gateway"), line


def test_cli_endpoint_that_refuses_connections(run, monkeypatch, one_attempt: None) -> None:
    port = closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    r = run("setup")
    assert r.exit_code == 1
    line = one_clean_line(r.output)
    assert f"cannot reach the AWS endpoint http://127.0.0.1:{port}/ (connection refused)" in line, line


@pytest.mark.parametrize("url", ["not a url", "127.0.0.1:5000", "ftp://127.0.0.1", "http://127.0.0.1:port"])
def test_cli_endpoint_that_is_not_a_url(run, monkeypatch, url: str, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    r = run("setup")
    assert r.exit_code == 2
    assert one_clean_line(r.output) == (
        f"Error: AWS_ENDPOINT_URL={url!r} is not an endpoint URL; use http(s)://HOST[:PORT] "
        "(e.g. http://127.0.0.1:5000), or unset it to reach AWS"
    )


@pytest.mark.parametrize("region", ["xx-nowhere-1", "us-east-9", "Frankfurt"])
def test_cli_region_that_does_not_exist_fails_before_any_call(run, monkeypatch, region: str) -> None:
    # Nothing listens there: a call would fail with "cannot reach", not with the region's line.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    r = run("--region", region, "setup")
    assert r.exit_code == 2
    line = one_clean_line(r.output)
    assert line.startswith(f"Error: region {region!r} does not exist"), line
    assert "us-east-1" in line or "us-east-2" in line, line
    assert "e.g." in line and "cannot reach" not in line


def test_every_region_botocore_knows_is_accepted() -> None:
    s = boto3.session.Session()
    known = session.known_regions(s)
    assert {"us-east-1", "eu-central-1", "ap-southeast-2", "cn-north-1", "us-gov-west-1"} <= set(known)
    for region in known:
        session.check_region(s, region)
