"""petctl-etcd over TLS with client-certificate auth, against a real etcd.

The etcd serves https only and requires a client certificate signed by the job's CA
(``--client-cert-auth``): a handler that completes a round there used our certificates, and
one without a certificate gets nowhere.
"""

from __future__ import annotations

import shutil
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from harness import Etcd, EtcdCerts, run_together
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from petctl_agent.rendezvous import BACKEND, Config, PetctlRendezvousHandler, create_handler
from petctl_agent.rendezvous import etcdv3 as v3

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


def _tls(certs: EtcdCerts, **kw: Any) -> Config:
    return Config(
        protocol="https", cacert=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key), **kw
    )


def _keys(e: Etcd, certs: EtcdCerts, prefix: str) -> list[str]:
    """Every key under ``prefix``, read with the client certificate (etcd v3)."""
    c = v3.Client(e.endpoint, "https", str(certs.ca), str(certs.client_cert), str(certs.client_key))
    return [kv.key for kv in c.range(prefix, prefix=True, keys_only=True).kvs]


def test_a_round_over_tls(tls_etcd: tuple[Etcd, EtcdCerts]) -> None:
    e, certs = tls_etcd
    run_id = f"tls-{uuid.uuid4().hex[:8]}"
    hs = [
        PetctlRendezvousHandler(run_id, e.endpoint, 2, 2, "127.0.0.1", config=_tls(certs, settle=0.1))
        for _ in range(2)
    ]
    res: dict[PetctlRendezvousHandler, Any] = {}

    def join(h: PetctlRendezvousHandler) -> None:
        try:
            res[h] = h.next_rendezvous()
        except Exception as ex:  # noqa: BLE001
            res[h] = ex

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in hs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sorted((i.rank, i.world_size) for i in res.values()) == [(0, 2), (1, 2)], res
        info = res[hs[0]]
        info.store.set("k", b"v")  # the agent-side store rides on our https client
        assert res[hs[1]].store.get("k") == b"v"
        assert len(_keys(e, certs, f"/petctl/rdzv/{run_id}/nodes")) == 2
    finally:
        for h in hs:
            h.leave()


def test_a_client_without_a_certificate_is_refused(tls_etcd: tuple[Etcd, EtcdCerts]) -> None:
    e, certs = tls_etcd
    run_id = f"tls-{uuid.uuid4().hex[:8]}"
    no_cert = Config(protocol="https", cacert=str(certs.ca), join_timeout=1.0)
    plain = Config(join_timeout=1.0)
    # the TLS handshake refuses the first (etcd's bad-certificate alert); the second is not TLS at all
    for cfg, why in (
        (no_cert, r"cannot register at etcd https://.*SSL"),
        (plain, "cannot register at etcd http://"),
    ):
        h = PetctlRendezvousHandler(run_id, e.endpoint, 1, 1, "127.0.0.1", config=cfg)
        with pytest.raises(RendezvousConnectionError, match=why):
            h.next_rendezvous()
    assert _keys(e, certs, f"/petctl/rdzv/{run_id}") == []


def test_tls_settings_are_checked(tmp_path: Path, tls_etcd: tuple[Etcd, EtcdCerts]) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("not read here")
    with pytest.raises(ValueError, match="use http or https"):
        Config(protocol="grpc")
    with pytest.raises(ValueError, match="key given without cert"):
        Config(protocol="https", key=str(pem))
    with pytest.raises(ValueError, match="add protocol=https"):
        Config(cacert=str(pem))
    with pytest.raises(ValueError, match=r"cert=.*missing.pem is not a file"):
        Config(protocol="https", cacert=str(pem), cert=str(tmp_path / "missing.pem"))
    # files that are not PEM certificates: one line at once, not a failure at the first request
    with pytest.raises(ValueError, match="etcd TLS files .* do not load"):
        PetctlRendezvousHandler("r", "127.0.0.1:2379", 1, 1, config=Config(protocol="https", cacert=str(pem)))
    # torchrun's --rdzv-conf reaches Config through the registry's creator
    _, certs = tls_etcd
    ca, cert, key = str(certs.ca), str(certs.client_cert), str(certs.client_key)
    params = RendezvousParameters(
        BACKEND, "127.0.0.1:2379", "r", 1, 1, "127.0.0.1", protocol="https", cacert=ca, cert=cert, key=key
    )
    h = create_handler(params)
    assert h.cfg.client_tls() == {"protocol": "https", "cacert": ca, "cert": cert, "key": key}
    assert h._etcd.scheme == "https"


ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"RANK={os.environ['RANK']} SUM={t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_over_tls(tls_etcd: tuple[Etcd, EtcdCerts], tmp_path: Path) -> None:
    """Plain ``torchrun`` (the backend comes from our entry point) with the TLS keys in --rdzv-conf."""
    e, certs = tls_etcd
    script = tmp_path / "train.py"
    script.write_text(ALL_REDUCE)
    conf = f"protocol=https,cacert={certs.ca},cert={certs.client_cert},key={certs.client_key},settle=0.2"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-backend", BACKEND,
        "--rdzv-endpoint", e.endpoint, "--rdzv-id", f"tr-{uuid.uuid4().hex[:8]}",
        "--local-addr", "127.0.0.1", "--rdzv-conf", conf, str(script),
    ]  # fmt: skip
    outs = run_together(cmd, 2, tmp_path)
    lines = sorted(line for out in outs for line in out.splitlines() if line.startswith("RANK="))
    assert lines == ["RANK=0 SUM=2", "RANK=1 SUM=2"], outs
