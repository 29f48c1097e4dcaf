"""A per-instance EC2 instance metadata service (IMDSv2); it also carries the daemon's control API.

One HTTP server on 127.0.0.1 serves every instance under its own prefix::

    PUT  /<instance-id>/latest/api/token            X-aws-ec2-metadata-token-ttl-seconds: 1..21600
    GET  /<instance-id>/latest/meta-data/...        X-aws-ec2-metadata-token: <token>
    GET  /<instance-id>/latest/dynamic/instance-identity/document

A token is only valid for the instance it was issued for. Without a valid token
a GET is answered ``401`` (IMDSv2 required, as the job template configures).

Requests under ``/_control/`` go to the control API (:mod:`petctl.local.control`) once their
``X-Petctl-Control-Token`` header matches its token; and, for each instance's ``systemctl`` shim (``X-Petctl-Systemd-Token``: that instance's token)::

    POST /<instance-id>/_petctl/systemd/start/<unit>
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

from petctl.local.environment import ACCOUNT_ID, CONTROL_TOKEN_HEADER

if TYPE_CHECKING:
    from petctl.local.instance import Instance

log = logging.getLogger("petctl.local.imds")

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SYSTEMD_TOKEN_HEADER = "X-Petctl-Systemd-Token"


class Instances(Protocol):
    """What the IMDS server needs of the reconciler."""

    def get(self, instance_id: str) -> Instance: ...

    def systemd_start(self, instance_id: str, unit: str, token: str) -> tuple[int, dict[str, Any]]: ...

    def os_shutdown(
        self, instance_id: str, token: str, minutes: float | None
    ) -> tuple[int, dict[str, Any]]: ...


class Control(Protocol):
    """What the IMDS server needs of the control API (:class:`petctl.local.control.ControlApi`)."""

    token: str

    def handle(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]: ...


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class ImdsServer:
    """Serves IMDS views of the reconciler's instances, and routes control requests.

    ``instances`` is set once the reconciler exists (it needs this server's URL first).
    """

    def __init__(self, region: str, control: Control, port: int = 0) -> None:
        self.region = region
        self.control = control
        self.instances: Instances | None = None
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (instance id, expiry)
        self._tokens_lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"imds": self})
        self.httpd = _Server(("127.0.0.1", port), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="imds", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reconciler(self) -> Instances:
        if self.instances is None:
            raise LookupError("the local cloud is still starting")
        return self.instances

    def lookup(self, instance_id: str) -> Instance:
        return self.reconciler().get(instance_id)

    # ---------------------------------------------------------------- tokens

    def issue_token(self, instance_id: str, ttl: int) -> str:
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._tokens_lock:
            self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
            self._tokens[token] = (instance_id, now + ttl)
        return token

    def token_valid(self, instance_id: str, token: str | None) -> bool:
        if not token:
            return False
        with self._tokens_lock:
            entry = self._tokens.get(token)
        return bool(entry and entry[0] == instance_id and entry[1] > time.monotonic())

    # ---------------------------------------------------------------- metadata

    def metadata(self, rec: Instance, path: str) -> tuple[int, str]:
        """(status, body) of ``/latest/<path>`` for one instance."""
        region = self.region
        path = path.strip("/")
        md: dict[str, str | None] = {
            "meta-data/instance-id": rec.instance_id,
            "meta-data/local-ipv4": rec.private_ip,
            "meta-data/local-hostname": "ip-" + rec.private_ip.replace(".", "-") + ".ec2.internal",
            "meta-data/instance-type": rec.instance_type,
            "meta-data/ami-id": rec.image_id,
            "meta-data/placement/availability-zone": rec.az,
            "meta-data/placement/region": region,
            # Every instance (the agents' contract): InService outside a group too.
            "meta-data/autoscaling/target-lifecycle-state": rec.lifecycle,
            "meta-data/spot/instance-action": json.dumps(rec.spot_action) if rec.spot_action else None,
            "meta-data/tags/instance": "\n".join(sorted(rec.tags)),
        }
        for key, value in rec.tags.items():
            md[f"meta-data/tags/instance/{key}"] = value
        if path in md:
            value = md[path]
            return (200, value) if value is not None else (404, "Not Found")
        if path == "dynamic/instance-identity/document":
            doc = {
                "accountId": ACCOUNT_ID,
                "architecture": "x86_64",
                "availabilityZone": rec.az,
                "imageId": rec.image_id,
                "instanceId": rec.instance_id,
                "instanceType": rec.instance_type,
                "privateIp": rec.private_ip,
                "region": region,
                "version": "2017-09-30",
            }
            return 200, json.dumps(doc, indent=2)
        # Directory listings: the next path component of every key under ``path``.
        prefix = path + "/" if path else ""
        children = []
        for key, value in md.items():
            if value is None or not key.startswith(prefix) or key.startswith("meta-data/tags/instance/"):
                continue
            rest = key[len(prefix) :]
            child = rest.split("/", 1)[0] + ("/" if "/" in rest else "")
            if child not in children:
                children.append(child)
        if path in ("", "meta-data") or children:
            if path == "":
                children = ["meta-data", "dynamic"]
            return 200, "\n".join(children)
        return 404, "Not Found"


class _Handler(BaseHTTPRequestHandler):
    imds: ImdsServer
    protocol_version = "HTTP/1.1"
    server_version = "petctl-local-imds"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, body: str, content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        url = urlsplit(self.path)
        path = url.path
        if path.startswith("/_control/"):
            given = self.headers.get(CONTROL_TOKEN_HEADER) or ""
            if not hmac.compare_digest(given, self.imds.control.token):
                self._send(403, json.dumps({"error": "missing or wrong control token"}), "application/json")
                return
            try:
                status, body = self.imds.control.handle(method, path, parse_qs(url.query))
            except Exception as e:  # noqa: BLE001 - report, do not kill the server thread
                log.exception("control request %s %s failed", method, path)
                status, body = 500, {"error": f"{type(e).__name__}: {e}"}
            self._send(status, json.dumps(body, default=str), "application/json")
            return
        parts = path.lstrip("/").split("/", 2)  # <instance-id>, "latest", rest
        if len(parts) == 3 and parts[1] == "_petctl" and method == "POST":
            self._systemd(parts[0], parts[2], parse_qs(url.query))
            return
        if len(parts) < 2 or parts[1] != "latest":
            self._send(404, "Not Found")
            return
        instance_id, rest = parts[0], parts[2] if len(parts) > 2 else ""
        try:
            rec = self.imds.lookup(instance_id)
        except LookupError:
            self._send(404, "Not Found")
            return
        if rest == "api/token":
            if method != "PUT":
                self._send(405, "Method Not Allowed")
                return
            try:
                ttl = int(self.headers.get(TOKEN_TTL_HEADER) or "")
            except ValueError:
                ttl = 0
            if not 1 <= ttl <= 21600:
                self._send(400, "Bad Request")
                return
            self._send(200, self.imds.issue_token(instance_id, ttl))
            return
        if method != "GET":
            self._send(405, "Method Not Allowed")
            return
        if not self.imds.token_valid(instance_id, self.headers.get(TOKEN_HEADER)):
            self._send(401, "Unauthorized")
            return
        status, body = self.imds.metadata(rec, rest)
        self._send(status, body)

    def _systemd(self, instance_id: str, rest: str, query: dict[str, list[str]]) -> None:
        """``POST /<instance-id>/_petctl/systemd/start/<unit>`` from the instance's systemctl shim,
        ``…/systemd/shutdown?minutes=N`` (or ``?cancel=1``) from its shutdown shim (header
        ``X-Petctl-Systemd-Token``: the instance's own token, in its boot environment)."""
        action, _, unit = rest.partition("/start/")
        token = self.headers.get(SYSTEMD_TOKEN_HEADER) or ""
        if rest != "systemd/shutdown" and (action != "systemd" or not unit):
            self._send(404, json.dumps({"error": f"unknown request {rest}"}), "application/json")
            return
        try:
            if rest == "systemd/shutdown":
                minutes = None if query.get("cancel") else float(query.get("minutes", ["1"])[0])
                status, body = self.imds.reconciler().os_shutdown(instance_id, token, minutes)
            else:
                status, body = self.imds.reconciler().systemd_start(instance_id, unit, token)
        except LookupError as e:
            status, body = 404, {"error": str(e.args[0] if e.args else e)}
        except Exception as e:  # noqa: BLE001 - report, do not kill the server thread
            log.exception("systemd request %s on %s failed", rest, instance_id)
            status, body = 500, {"error": f"{type(e).__name__}: {e}"}
        self._send(status, json.dumps(body, default=str), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._route("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")
