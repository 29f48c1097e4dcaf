"""A real browser for the tests: Debian's ``chromium``, headless, offline, driven from the command line.

Importable as ``browser`` (pytest puts tests/ on sys.path). :func:`find` returns the browser or None
(the tests skip with :data:`MISSING`); :func:`load` opens a page file once for its console and DOM
(with an optional probe script appended to a copy of the page) and once for a screenshot.
:func:`png_pixels` decodes the screenshot with the standard library.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MISSING = (
    "no headless browser: install Debian's chromium (apt-get install -y chromium; CI's .ci/run does) "
    "or set PETCTL_BROWSER to a chromium binary"
)
#: Offline and quiet: the machine's network is closed, and a fresh profile per run.
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
)  # fmt: skip
# What a page's console prints shows up in chromium's log as `…:CONSOLE:12] "text", source: …`
# (older builds: `CONSOLE(12)`).
_CONSOLE = re.compile(r"CONSOLE[:(]\d+\)?\]? (.*)")


def find() -> str | None:
    """The chromium binary: $PETCTL_BROWSER, else Debian's (the real binary, not its shell
    wrapper), else chromium/chromium-browser/google-chrome on PATH."""
    if os.environ.get("PETCTL_BROWSER"):
        return os.environ["PETCTL_BROWSER"]
    if os.access("/usr/lib/chromium/chromium", os.X_OK):
        return "/usr/lib/chromium/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@dataclass
class Loaded:
    dom: str  # the DOM after load, serialized
    console: list[str]  # every console message of the page (it has no scripts: any is a fault)
    screenshot: Path


def _run(binary: str, work: Path, name: str, args: list[str], url: str) -> subprocess.CompletedProcess:
    cmd = [binary, *FLAGS, f"--user-data-dir={work / ('profile-' + name)}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=work)


def load(
    binary: str, page: Path, work: Path, probe: str = "", size: tuple[int, int] = (1200, 1400)
) -> Loaded:
    """Open ``page`` (a file) headless: the DOM and console of a copy with ``probe`` (a script, run
    after load) appended, and a screenshot of the page itself at ``size``."""
    probed = work / f"probed-{page.name}"
    text = page.read_text(encoding="utf-8")
    probed.write_text(text.replace("</body>", f"<script>{probe}</script></body>") if probe else text)
    window = f"--window-size={size[0]},{size[1]}"
    dom = _run(binary, work, "dom", ["--dump-dom", window], probed.as_uri())
    if dom.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom exited {dom.returncode}: {dom.stderr[-2000:]}")
    shot = work / f"{page.stem}.png"
    res = _run(binary, work, "shot", [f"--screenshot={shot}", window], page.as_uri())
    if res.returncode != 0 or not shot.is_file():
        raise RuntimeError(f"chromium --screenshot exited {res.returncode}: {res.stderr[-2000:]}")
    console = [m.group(1) for m in map(_CONSOLE.search, (dom.stderr + res.stderr).splitlines()) if m]
    return Loaded(dom=dom.stdout, console=console, screenshot=shot)


def png_pixels(path: Path) -> tuple[int, int, Counter]:
    """Width, height and a count of each (r, g, b) of an 8-bit RGB/RGBA, non-interlaced PNG (what
    chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, color, _, _, interlace = head
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {head}"
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, counts, i = bytearray(stride), Counter(), 0
    for _ in range(height):
        kind, line = raw[i], bytearray(raw[i + 1 : i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        counts.update(zip(line[0::bpp], line[1::bpp], line[2::bpp], strict=True))
        prev = line
    return width, height, counts


def rgb(hex_color: str) -> tuple[int, int, int]:
    h = hex_color.lstrip("#")
    if len(h) == 3:
        h = "".join(ch * 2 for ch in h)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)
