"""A headless Chromium driven over the Chrome DevTools Protocol on a pipe, for tests of HTML pages.

`--remote-debugging-pipe` makes Chromium read protocol commands from fd 3 and write replies and
events to fd 4, each a JSON message ended by a NUL byte. That needs no websocket client, no
webdriver and no port, and nothing here downloads a browser: it uses the one the system has
(Debian: `apt-get install chromium`). Every wait is bounded, so a stuck browser fails a test
instead of hanging it.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "chromium not installed: apt-get install chromium (Debian/Ubuntu), or put chromium on PATH"


def find_browser() -> str | None:
    """TPUREC_CHROMIUM if set, else the first of CANDIDATES on PATH."""
    chosen = os.environ.get("TPUREC_CHROMIUM")
    if chosen:
        return chosen
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page (a target attached in flat mode)."""

    def __init__(self, executable: str, timeout: float = 20.0):
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="tpurec-chromium-")
        self._log = open(os.path.join(self._profile, "stderr.log"), "w+b")  # noqa: SIM115 (closed in close())
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def as_fd_3_and_4():
            # Move both ends above 4 first: dup2 onto a number an end already holds would be a no-op
            # and keep its close-on-exec flag.
            a = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            executable,
            "--headless",
            "--no-sandbox",  # tests may run as root (CI containers), where the sandbox refuses to start
            "--disable-gpu",
            "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm; use /tmp instead
            "--disable-extensions",
            "--no-first-run",
            "--no-default-browser-check",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}",
            "about:blank",
        ]
        self._proc = subprocess.Popen(
            args,
            preexec_fn=as_fd_3_and_4,
            close_fds=False,  # fds 3 and 4 are made in preexec_fn; the other pipe ends are close-on-exec
            start_new_session=True,  # its renderer and helper processes share one group, ended together
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        os.close(cmd_r)
        os.close(out_w)
        self._messages: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0
        self._pending: list[dict] = []  # events read while waiting for a reply
        self.console_errors: list[str] = []
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable", session=True)
        except Exception:
            self.close()
            raise

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._out_r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._messages.put(None)  # the browser went away
                return
            buf += chunk
            *done, buf = buf.split(b"\0")
            for raw in done:
                self._messages.put(json.loads(raw))

    def _get(self, deadline: float) -> dict:
        left = deadline - time.monotonic()
        try:
            msg = self._messages.get(timeout=max(left, 0.001))
        except queue.Empty:
            raise BrowserError(f"no answer from chromium within {self.timeout} s{self._log_tail()}") from None
        if msg is None:
            raise BrowserError(f"chromium exited (code {self._proc.poll()}){self._log_tail()}")
        if "id" not in msg:
            self._note(msg)
        return msg

    def _note(self, event: dict) -> None:
        """Keep what counts as a console error: uncaught exceptions, console.error/assert, and the
        browser's own error log entries (failed loads, CSP violations)."""
        method, p = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.console_errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            self.console_errors.append(f"console.{p['type']}: {args}")
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.console_errors.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}".rstrip())

    def _log_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        tail = self._log.read()[-2000:].decode(errors="replace").strip()
        return f"; its output ends:\n{tail}" if tail else ""

    def call(self, method: str, params: dict | None = None, session: bool = False) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except OSError as e:
            raise BrowserError(f"cannot write to chromium ({e}){self._log_tail()}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._get(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply["result"]
            if "id" not in reply:
                self._pending.append(reply)

    def wait_event(self, method: str) -> dict:
        for i, event in enumerate(self._pending):
            if event.get("method") == method:
                return self._pending.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            event = self._get(deadline)
            if event.get("method") == method:
                return event

    def open(self, url: str) -> None:
        """Navigate the page and wait for its load event; console errors start afresh."""
        self._pending.clear()
        self.console_errors.clear()
        result = self.call("Page.navigate", {"url": url}, session=True)
        if result.get("errorText"):
            raise BrowserError(f"cannot open {url}: {result['errorText']}")
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable values only)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real left click (mouse events at the element's centre), as a user's."""
        box = self.evaluate(
            f"(function () {{ var e = document.querySelector({json.dumps(selector)});"
            " if (!e) return null; e.scrollIntoView({block: 'center', inline: 'center'});"
            " var r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise BrowserError(f"nothing matches {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            event = {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            self.call("Input.dispatchMouseEvent", event, session=True)

    def close(self) -> None:
        try:
            os.write(self._cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:  # helper processes left behind: the group this object started, by its id
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait(timeout=5)
        self._reader.join(timeout=5)
        os.close(self._cmd_w)
        os.close(self._out_r)
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)
