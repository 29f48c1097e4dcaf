"""The instance's network as its boot script sees it: ``curl`` reaches the instance metadata
service and nothing else; ``ip`` lists the addresses moto has given the instance."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import urllib.error
import urllib.request

from .base import Failed, Refused, client, env, inside_root, state_dir

IMDS_URL = "http://169.254.169.254"
#: The official etcd release tarballs (the rendezvous boot's download; petctl.templates.etcd).
ETCD_RELEASE_URL = re.compile(
    r"^https://github\.com/etcd-io/etcd/releases/download/v(\d+\.\d+\.\d+)/etcd-v\1-linux-(amd64|arm64)\.tar\.gz$"
)
#: Where the local cloud keeps its stand-in for them, under its state dir (petctl.local.etcd_release).
ETCD_RELEASE_TARBALL = "etcd-release/etcd-local.tar.gz"


def curl(args: list[str]) -> None:
    """``curl [-sSfL] [-X M] [-H H]… [-o FILE] URL`` to the instance metadata service, or the
    official etcd release URL, which the local cloud's stand-in tarball answers."""
    silent = show_errors = fail = False
    method, headers, urls, output = "GET", {}, [], None
    it = iter(args)
    for a in it:
        if a == "-X":
            method = next(it, "")
        elif a == "-H":
            name, _, value = next(it, "").partition(":")
            headers[name.strip()] = value.strip()
        elif a == "-o":
            output = inside_root(next(it, ""), "curl -o")
        elif re.fullmatch(r"-[sSfL]+", a):
            silent |= "s" in a
            show_errors |= "S" in a
            fail |= "f" in a
        elif a.startswith("-"):
            raise Refused(f"option {a} not emulated (only -s -S -f -L -X -H -o)")
        else:
            urls.append(a)
    if len(urls) != 1:
        raise Refused(f"give exactly one URL, not {urls}")
    url = urls[0]
    if ETCD_RELEASE_URL.match(url) and method == "GET":
        tarball = state_dir() / ETCD_RELEASE_TARBALL
        if not tarball.is_file():
            raise Failed("curl: (22) The requested URL returned error: 404" if show_errors else "", 22)
        if output is not None:
            shutil.copyfile(tarball, output)
        else:
            sys.stdout.buffer.write(tarball.read_bytes())
        return
    if not (url == IMDS_URL or url.startswith(IMDS_URL + "/")):
        raise Refused(
            f"the local cloud reaches no host but the instance metadata service ({IMDS_URL}) and the "
            f"etcd release (its package etcd stands in), not {url}"
        )
    if method not in ("GET", "PUT"):
        raise Refused(f"-X {method} not emulated (IMDS answers GET and PUT)")
    real = env("PETCTL_LOCAL_IMDS") + url[len(IMDS_URL) :]
    req = urllib.request.Request(real, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        if fail:
            raise Failed(
                f"curl: (22) The requested URL returned error: {e.code}" if show_errors else "", 22
            ) from e
        body = e.read()
    except (urllib.error.URLError, OSError) as e:
        raise Failed(f"curl: (7) Failed to connect: {e}" if show_errors or not silent else "", 7) from e
    if output is not None:
        output.write_bytes(body)
    else:
        sys.stdout.buffer.write(body)


def ip(args: list[str]) -> None:
    """``ip -4 -o addr show``: loopback, then every interface moto has attached to this instance
    (the primary one, and the rendezvous ENI once attached), in device order."""
    if sorted(args) != sorted(["-4", "-o", "addr", "show"]) or args[-2:] != ["addr", "show"]:
        raise Refused(f"only 'ip -4 -o addr show' is emulated, not: ip {shlex.join(args)}")
    ec2 = client("ec2")
    iid = env("PETCTL_LOCAL_INSTANCE_ID")
    enis = ec2.describe_network_interfaces(Filters=[{"Name": "attachment.instance-id", "Values": [iid]}])[
        "NetworkInterfaces"
    ]
    enis.sort(key=lambda e: int((e.get("Attachment") or {}).get("DeviceIndex") or 0))
    cidrs = {}
    subnets = sorted({e["SubnetId"] for e in enis})
    if subnets:
        cidrs = {s["SubnetId"]: s["CidrBlock"] for s in ec2.describe_subnets(SubnetIds=subnets)["Subnets"]}
    print("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever")
    for n, e in enumerate(enis):
        dev = f"ens{5 + n}"
        plen = cidrs.get(e["SubnetId"], "/24").rsplit("/", 1)[-1]
        print(
            f"{n + 2}: {dev}    inet {e['PrivateIpAddress']}/{plen} scope global dynamic {dev}\\"
            "       valid_lft 3600sec preferred_lft 3600sec"
        )
