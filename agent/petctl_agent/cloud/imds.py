"""Minimal IMDSv2 client (stdlib only, short timeouts). The agent passes its base URL (``PETCTL_IMDS_URL``)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

from petctl_agent.settings import DEFAULT_IMDS_URL


class Imds:
    """IMDSv2: ``PUT /latest/api/token`` once, then token-authenticated GETs.

    ``get`` returns None for 404 and for an unreachable IMDS (so callers can poll
    it from a watcher thread without crashing the agent).
    """

    def __init__(
        self, base_url: str = DEFAULT_IMDS_URL, timeout: float = 2.0, token_ttl: int = 21600
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.token_ttl = token_ttl
        self._token: str | None = None
        self._token_expiry = 0.0
        self._lock = threading.Lock()

    def _get_token(self, refresh: bool = False) -> str:
        with self._lock:
            if refresh or self._token is None or time.monotonic() > self._token_expiry:
                req = urllib.request.Request(
                    f"{self.base_url}/latest/api/token",
                    method="PUT",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
                )
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    self._token = r.read().decode()
                self._token_expiry = time.monotonic() + self.token_ttl * 0.8
            return self._token

    def get(self, path: str) -> str | None:
        """GET ``/latest/<path>``; None when absent (404) or IMDS is unreachable."""
        url = f"{self.base_url}/latest/{path.lstrip('/')}"
        for attempt in range(2):
            try:
                req = urllib.request.Request(
                    url, headers={"X-aws-ec2-metadata-token": self._get_token(attempt > 0)}
                )
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 401 and attempt == 0:
                    continue  # token expired or IMDS restarted: fetch a new one
                return None
            except (urllib.error.URLError, OSError):
                return None
        return None

    def meta(self, key: str) -> str | None:
        return self.get(f"meta-data/{key}")

    def tag(self, key: str) -> str | None:
        return self.get(f"meta-data/tags/instance/{key}")
