"""A minimal Chrome DevTools Protocol client on the standard library, for the report's browser test.

It launches a headless chromium with a throw-away profile, finds the DevTools port in the
profile's ``DevToolsActivePort`` file, opens the page target's websocket (RFC 6455 handshake and
framing, client frames masked) and sends JSON commands, keeping the events it receives.
Written here rather than adding a websocket dependency: the test needs ~100 lines of it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from urllib.parse import urlparse

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps", "--disable-extensions", "--mute-audio"]


def find_browser() -> str | None:
    """Path of a chromium-like browser: $ATTNLAB_CHROMIUM, else the first of BROWSERS on PATH."""
    explicit = os.environ.get("ATTNLAB_CHROMIUM")
    return explicit or next((p for p in map(shutil.which, BROWSERS) if p), None)


class WebSocket:
    """Blocking text websocket client (enough for CDP: text frames, ping/pong, close)."""

    def __init__(self, url: str, timeout: float):
        parts = urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake refused: {head[:80]!r}")

    def send(self, text: str, opcode: int = 0x1) -> None:
        payload = text.encode() if isinstance(text, str) else text
        n = len(payload)
        header = bytes([0x80 | opcode])
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("websocket closed")
            data += chunk
        return data

    def recv(self) -> str:
        """The next complete text message (answers pings, joins fragments)."""
        message = b""
        while True:
            first, second = self._exact(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            mask = self._exact(4) if second & 0x80 else None
            payload = self._exact(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            opcode = first & 0x0F
            if opcode == 0x9:
                self.send(payload, opcode=0xA)
                continue
            if opcode == 0x8:
                raise ConnectionError("websocket closed by the browser")
            message += payload
            if first & 0x80:
                return message.decode()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Browser:
    """A headless chromium and a CDP session on its first page. Use as a context manager."""

    def __init__(self, path: str, *, timeout: float = 20.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="attnlab-chromium-")
        self.proc = subprocess.Popen([path, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # its own process group, killed as one
        self.events: list[dict] = []
        self._next_id = 0
        try:
            self.ws = WebSocket(self._page_url(), timeout)
        except BaseException:
            self.close()
            raise

    def _page_url(self) -> str:
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with status {self.proc.returncode}")
            if os.path.exists(port_file):
                with open(port_file) as handle:  # closed at once: an open file warns under -W error
                    lines = handle.read().split()
                if lines:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list", timeout=5) as r:
                            pages = [t for t in json.load(r) if t["type"] == "page"]
                        if pages:
                            return pages[0]["webSocketDebuggerUrl"]
                    except OSError:
                        pass
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open DevTools within {self.timeout} s")

    def send(self, method: str, **params) -> dict:
        """Run one CDP command and return its result (events seen meanwhile are kept)."""
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)
        raise TimeoutError(f"{method}: no answer within {self.timeout} s")

    def wait_for(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for message in self.events:
                if message.get("method") == event:
                    return message
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(f"no {event} within {self.timeout} s")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                self.send("Browser.close")
            except Exception:  # noqa: BLE001 - the browser may already be gone; we kill it below
                pass
            ws.close()
        try:
            self.proc.wait(timeout=5)  # Browser.close lets chromium shut its helpers down itself
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of its process group (renderer, zygote, crashpad) is killed
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_page(browser: Browser, path) -> float:
    """Load the file ``path`` with the Runtime, Log, Network and Page events on and wait for its
    first frame; returns the seconds it took (navigation to painted). Events start empty."""
    for domain in ("Runtime", "Log", "Network", "Page"):
        browser.send(f"{domain}.enable")
    browser.events.clear()
    started = time.perf_counter()
    browser.send("Page.navigate", url=path.as_uri())
    browser.wait_for("Page.loadEventFired")
    browser.evaluate("new Promise(r => requestAnimationFrame(() => r(true)))")
    return time.perf_counter() - started


def page_errors(events: list[dict]) -> list[dict]:
    """Exceptions, console errors and assertions, and error log entries among the events."""
    return [e for e in events if e.get("method") == "Runtime.exceptionThrown"
            or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
            or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]


def requested_urls(events: list[dict]) -> list[str]:
    """Every URL the page asked for, in order (the page itself first)."""
    return [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
