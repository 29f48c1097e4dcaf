"""The instance's network as its boot script sees it: ``curl`` reaches the instance metadata
service and nothing else; ``ip`` lists the addresses moto has given the instance."""

from __future__ import annotations

import re
import shlex
import sys
import urllib.error
import urllib.request

from .base import Failed, Refused, client, env

IMDS_URL = "http://169.254.169.254"


def curl(args: list[str]) -> None:
    """``curl [-sSf] [-X M] [-H H]… URL`` to the instance metadata service only."""
    silent = show_errors = fail = False
    method, headers, urls = "GET", {}, []
    it = iter(args)
    for a in it:
        if a == "-X":
            method = next(it, "")
        elif a == "-H":
            name, _, value = next(it, "").partition(":")
            headers[name.strip()] = value.strip()
        elif re.fullmatch(r"-[sSf]+", a):
            silent |= "s" in a
            show_errors |= "S" in a
            fail |= "f" in a
        elif a.startswith("-"):
            raise Refused(f"option {a} not emulated (only -s -S -f -X -H)")
        else:
            urls.append(a)
    if len(urls) != 1:
        raise Refused(f"give exactly one URL, not {urls}")
    url = urls[0]
    if not (url == IMDS_URL or url.startswith(IMDS_URL + "/")):
        raise Refused(
            f"the local cloud reaches no host but the instance metadata service ({IMDS_URL}), not {url}"
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
