"""The app served as ``make run`` serves it, and headless chromium to drive it (the ``app`` section and the browser
tests both use these)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvviz.runtime.allocator import ENVIRONMENT as MEMORY_KEEPING_ENVIRONMENT
from kvviz.runtime.settings import child_environment

ROOT = Path(__file__).resolve().parents[2]
# The page's root before its first script run, while one is under way, or while a rerun waits for it.
RUNNING = ('[data-testid="stApp"]:is([data-test-script-state="initial"], [data-test-script-state="running"], '
           '[data-test-script-state="rerunRequested"])')
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    """Debian's chromium (``make browser`` installs it), or None."""
    return shutil.which("chromium") or (None if not Path("/usr/bin/chromium").exists() else "/usr/bin/chromium")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServedApp:
    """A running ``streamlit run app.py``: where to reach it and its process id (for checks on the process)."""

    url: str
    pid: int

    def cpu_seconds(self) -> float:
        """CPU seconds the server process has used so far, every thread counted (user and system)."""
        return process_cpu_seconds(self.pid)

    def kernel_seconds(self) -> float:
        """CPU seconds the kernel has spent for the server so far (mostly its page faults)."""
        return process_times(self.pid).system


class ProcessTimes(NamedTuple):
    """CPU seconds a process has used so far, every thread counted: in its own code, and in the kernel for it."""

    user: float
    system: float


def process_times(pid: int) -> ProcessTimes:
    """Process ``pid``'s :class:`ProcessTimes`; zeros once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ProcessTimes(0.0, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    return ProcessTimes(int(fields[11]) / tick, int(fields[12]) / tick)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, every thread counted (user and system); 0 once it is gone."""
    return sum(process_times(pid))


def browser_cpu_seconds() -> float:
    """CPU seconds the chromium processes on this machine have used so far (what a browser on the server's own
    cores takes from the model while it draws the page)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = stat.read_text().strip()
        except OSError:
            continue
        if name.startswith(("chrom", "headless_shell")):
            total += process_cpu_seconds(int(stat.parent.name))
    return total


@contextlib.contextmanager
def served_app(log_path: Path, env: dict[str, str] | None = None, startup: float = 90) -> Iterator[ServedApp]:
    """``streamlit run app.py`` as ``make run`` serves it (the baked .streamlit/config.toml, and the environment that
    keeps the memory its runs free: glibc's arena cap, protobuf in pure Python), on a free loopback port, until the
    block ends."""
    port = _free_port()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.address",
             "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=child_environment({"TOKENIZERS_PARALLELISM": "false", **MEMORY_KEEPING_ENVIRONMENT, **(env or {})}),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                        break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"streamlit did not start; see {log_path}") from None
                    time.sleep(0.5)
            yield ServedApp(url, process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def script_done(page, timeout: float, poll: float = 0.1) -> None:
    """Wait (at most ``timeout`` seconds, looking every ``poll``) until the page's script run has finished, as the
    page's root says (``data-test-script-state``, what Streamlit's own browser tests read; the header that showed a
    running indicator is off)."""
    deadline = time.monotonic() + timeout
    while page.locator(RUNNING).count() and time.monotonic() < deadline:
        page.wait_for_timeout(poll * 1000)


def settle(page, timeout: float = 600, pause: float = 0.3) -> None:
    """Wait until the page's script run finished (:func:`script_done`), ``pause`` seconds before looking (a run may
    not have started yet) and after (the last elements drawn)."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=timeout * 1000)
    page.wait_for_timeout(pause * 1000)
    script_done(page, timeout - pause)
    page.wait_for_timeout(pause * 1000)


# Records when the page's DOM last changed (any element, attribute or text): what "drawn" means for a page whose
# charts draw after the script ends (Plotly, the data grid), which no single locator can wait for.
_WATCH_CHANGES = """() => { window.__kvvizChanged = performance.now();
  new MutationObserver(() => { window.__kvvizChanged = performance.now(); })
    .observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true}); }"""


def watch_changes(page) -> float:
    """Start recording the page's last DOM change; returns the page's clock now (milliseconds)."""
    page.evaluate(_WATCH_CHANGES)
    return page.evaluate("() => performance.now()")


# Resolves with the page's clock when ``text`` first shows, looking only when the DOM changes: the exact moment it
# was drawn, and no work on the cores the timed run shares (Playwright's own waits poll the page many times a second:
# chromium took 0.1-0.4 CPU s per 10 s of waiting).
_TEXT_SHOWN = """([text, timeout]) => new Promise((resolve, reject) => {
  const shown = () => document.body.textContent.includes(text);
  if (shown()) { resolve(performance.now()); return; }
  const watcher = new MutationObserver(() => {
    if (shown()) { watcher.disconnect(); resolve(performance.now()); } });
  watcher.observe(document.body, {subtree: true, childList: true, characterData: true});
  setTimeout(() => { watcher.disconnect(); reject(new Error(`"${text}" not shown within ${timeout} ms`)); }, timeout);
})"""


def text_shown(page, text: str, timeout: float) -> float:
    """Wait (at most ``timeout`` seconds) until ``text`` is on the page without polling it; returns the page's clock
    (milliseconds, as :func:`watch_changes`) when it first showed."""
    return page.evaluate(_TEXT_SHOWN, [text, timeout * 1000])


def last_change(page, since: float, quiet: float = 1.5, timeout: float = 600) -> float:
    """Seconds from ``since`` (the page's clock, :func:`watch_changes`) until the page last changed, once its script
    run has finished and nothing has changed for ``quiet`` seconds."""
    script_done(page, timeout, poll=0.05)
    deadline = time.monotonic() + timeout
    while page.evaluate("() => performance.now() - window.__kvvizChanged") < quiet * 1000:
        if time.monotonic() > deadline:
            break
        page.wait_for_timeout(100)
    return (page.evaluate("() => window.__kvvizChanged") - since) / 1000
