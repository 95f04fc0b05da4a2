"""Open a page in headless Chromium and say whether every figure of it rendered (issue 82.3).

    python tools/headless_page.py results/index.html --out DIR [--shot docs/report.png --shot-of CSS]

Starts Debian's ``chromium`` (``CHROMIUM`` overrides the binary) with an empty profile and no network
services, drives it over the DevTools protocol (a small WebSocket client on the standard library: no
browser download, no package), opens the page and reports, as JSON on stdout:

* ``figures``: each ``<figure>``'s id, its drawing's box on the page, and the share of its screenshot's
  pixels that are not background (a figure rendered blank, or not at all, has none);
* ``console``: every console error, uncaught exception and browser log error while the page loaded;
* ``requests``: every request that was not for a ``file:`` or ``data:`` address (the page must need none).

Each figure's screenshot is kept in ``--out`` (DIR/figure-ID.png), with the top of the page (DIR/page.png).
``--shot PATH --shot-of CSS`` also saves the first element matching CSS (at most ``SHOT_HEIGHT`` pixels of
it), as docs/report.png is made. Exits 1 when a figure is blank or missing, or anything was logged as an
error or fetched; 2 when Chromium cannot be started.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--remote-debugging-port=0", "--window-size=1280,1000"]
START_SECONDS = 60
LOAD_SECONDS = 60
MIN_INK = 0.01  # a rendered figure has at least this share of non-background pixels
SHOT_HEIGHT = 1400


def chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    """One WebSocket (RFC 6455, client side) to a DevTools target: ``call`` a method, keeping the events."""

    def __init__(self, url: str):
        host, _, path = url.removeprefix("ws://").partition("/")
        name, port = host.split(":")
        self.sock = socket.create_connection((name, int(port)), timeout=LOAD_SECONDS)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += self.sock.recv(4096)
        if b" 101 " not in reply.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {reply[:200]!r}")
        self.buffer, self.events, self.next_id = reply.split(b"\r\n\r\n", 1)[1], [], 0

    def _exact(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("DevTools closed the WebSocket")
            self.buffer += chunk
        out, self.buffer = self.buffer[:count], self.buffer[count:]
        return out

    def _send(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        head = bytes([0x80 | opcode]) + (bytes([0x80 | size]) if size < 126 else bytes([0xFE]) + struct.pack(">H", size)
                                         if size < 1 << 16 else bytes([0xFF]) + struct.pack(">Q", size))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _message(self) -> dict:
        data = b""
        while True:
            first, second = self._exact(2)
            size = second & 0x7F
            size = struct.unpack(">H", self._exact(2))[0] if size == 126 else struct.unpack(">Q", self._exact(8))[0] \
                if size == 127 else size
            payload, opcode = self._exact(size), first & 0x0F
            if opcode == 9:  # ping
                self._send(10, payload)
                continue
            if opcode == 8:
                raise ConnectionError("DevTools closed the WebSocket")
            data += payload
            if first & 0x80:
                return json.loads(data)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self._send(1, json.dumps({"id": self.next_id, "method": method, "params": params}).encode())
        while True:
            message = self._message()
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {seconds} s")
            self.events.append(self._message())


def start(binary: str, profile: Path) -> tuple[subprocess.Popen, str]:
    """Chromium on an empty ``profile``, and its first page's DevTools WebSocket address."""
    process = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, port_file = time.monotonic() + START_SECONDS, profile / "DevToolsActivePort"
    while not port_file.is_file() or not port_file.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{binary} did not start: {process.stderr.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.1)
    port = port_file.read_text().split()[0]
    while True:  # on a loaded machine the list can answer empty, or without the page, for a moment after the port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=START_SECONDS) as answer:
                pages = [t for t in json.loads(answer.read()) if t["type"] == "page"]
        except (ValueError, OSError):
            pages = []
        if pages:
            return process, pages[0]["webSocketDebuggerUrl"]
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{binary} gave no page to drive within {START_SECONDS} s")
        time.sleep(0.2)


def ink(png: bytes) -> float:
    """The share of the image's pixels that differ from its most common colour (the background)."""
    from PIL import Image  # deferred: only the screenshots need it (matplotlib's dependency)

    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = image.getcolors(maxcolors=1 << 24)
    return 1 - max(c for c, _ in counts) / (image.width * image.height)


FIGURES = """JSON.stringify(Array.from(document.querySelectorAll('figure')).map(f => {
  const d = f.querySelector('svg, img, canvas'); const r = (d || f).getBoundingClientRect();
  return {id: f.id, drawing: !!d, x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; }))"""


def inspect(tab: DevTools, url: str, out: Path, shot: Path | None, shot_of: str | None) -> dict:
    for domain in ("Page", "Runtime", "Log", "Network"):
        tab.call(f"{domain}.enable")
    tab.call("Page.navigate", url=url)
    tab.wait_for("Page.loadEventFired", LOAD_SECONDS)
    figures = json.loads(tab.call("Runtime.evaluate", expression=FIGURES, returnByValue=True)["result"]["value"])
    for figure in figures:
        if figure["width"] < 1 or figure["height"] < 1:
            figure["ink"] = 0.0
            continue
        clip = {k: figure[k] for k in ("x", "y", "width", "height")} | {"scale": 1}
        png = base64.b64decode(tab.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"])
        (out / f"figure-{figure['id'] or len(list(out.glob('figure-*')))}.png").write_bytes(png)
        figure["ink"] = round(ink(png), 4)
    (out / "page.png").write_bytes(base64.b64decode(tab.call("Page.captureScreenshot", format="png")["data"]))
    if shot is not None:
        box = json.loads(tab.call("Runtime.evaluate", returnByValue=True, expression=(
            f"(() => {{ const r = document.querySelector({json.dumps(shot_of)}).getBoundingClientRect(); return "
            "JSON.stringify({x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}); })()"))["result"]["value"])
        clip = box | {"height": min(box["height"], SHOT_HEIGHT), "scale": 1}
        shot.write_bytes(base64.b64decode(tab.call("Page.captureScreenshot", format="png", clip=clip,
                                                   captureBeyondViewport=True)["data"]))
    console = [e["params"] for e in tab.events if e.get("method") == "Runtime.exceptionThrown"
               or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
               or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    requests = [e["params"]["request"]["url"] for e in tab.events if e.get("method") == "Network.requestWillBeSent"
                and not e["params"]["request"]["url"].startswith(("file:", "data:"))]
    return {"url": url, "figures": figures, "console": console, "requests": requests}


def failures(report: dict) -> list[str]:
    found = [f"figure {f['id']!r}: " + ("no drawing" if not f["drawing"] else f"blank ({f['ink']:.4f} of its pixels drawn)")
             for f in report["figures"] if not f["drawing"] or f["ink"] < MIN_INK]
    found += [f"console: {json.dumps(c)[:300]}" for c in report["console"]]
    found += [f"fetched {u}" for u in report["requests"]]
    return found + ([] if report["figures"] else ["no <figure> on the page"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the screenshots")
    parser.add_argument("--shot", type=Path, help="also save a screenshot of --shot-of here")
    parser.add_argument("--shot-of", default="section", help="CSS selector of the element --shot shows")
    args = parser.parse_args(argv)
    binary = chromium()
    if binary is None:
        print("no chromium on PATH (apt-get install chromium), nor CHROMIUM set", file=sys.stderr)
        return 2
    if not args.page.is_file():
        parser.error(f"{args.page}: no such page")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        try:
            process, address = start(binary, Path(profile))
        except (RuntimeError, OSError) as e:
            print(e, file=sys.stderr)
            return 2
        try:
            report = inspect(DevTools(address), args.page.resolve().as_uri(), args.out, args.shot, args.shot_of)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    report["failures"] = failures(report)
    print(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
