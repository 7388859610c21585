"""The app served as a plain ``streamlit run app.py`` (``make run`` adds only flags), and headless chromium to drive
it (the ``app`` section and the browser tests both use these; Streamlit's selectors are in :mod:`kvviz.bench.dom`)."""

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

from kvviz.bench import dom
from kvviz.runtime.settings import child_environment

ROOT = Path(__file__).resolve().parents[2]
PROC = Path("/proc")  # the kernel's process table
SERVE_COMMAND = ("streamlit", "run", "app.py")  # what the bench starts, as a user would (plus flags)
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
    """A running ``streamlit run app.py``: where to reach it, its process id (for checks on the process) and the
    command line it was started with (the bench says how it started the server)."""

    url: str
    pid: int
    command: str = ""

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


def process_times(pid: int, proc: Path = PROC) -> ProcessTimes:
    """Process ``pid``'s :class:`ProcessTimes` (from ``proc``, the kernel's process table); zeros once it is gone."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ProcessTimes(0.0, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    return ProcessTimes(int(fields[11]) / tick, int(fields[12]) / tick)


def resident_bytes(pid: int, proc: Path = PROC) -> int:
    """Process ``pid``'s resident memory now (``VmRSS`` in the kernel's process table); 0 once it is gone."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, every thread counted (user and system); 0 once it is gone."""
    return sum(process_times(pid))


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """The processes ``pid`` started, and theirs, now running (read from ``proc``)."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def browser_cpu_seconds(launcher: int | None = None, proc: Path = PROC) -> float:
    """CPU seconds the chromium processes that ``launcher`` (this process by default) started, through Playwright's
    driver, have used so far: what the bench's browser on the server's own cores takes from the model while it draws
    the page. Other browsers on the machine (another engineer's, a CI job's) are not counted."""
    total = 0.0
    for pid in descendants(os.getpid() if launcher is None else launcher, proc):
        try:
            name = (proc / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(("chrom", "headless_shell")):
            total += sum(process_times(pid, proc))
    return total


@contextlib.contextmanager
def served_app(log_path: Path, env: dict[str, str] | None = None, startup: float = 90) -> Iterator[ServedApp]:
    """A plain ``streamlit run app.py`` (the baked .streamlit/config.toml; only flags for the port, address and
    headless mode, as ``make run`` adds them: :data:`SERVE_COMMAND`), on a free loopback port, until the block
    ends."""
    port = _free_port()
    with log_path.open("w") as log:
        command = ["python", "-m", *SERVE_COMMAND, "--server.port", str(port), "--server.address", "127.0.0.1",
                   "--server.headless", "true"]
        process = subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=child_environment(env or {}))
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
            yield ServedApp(url, process.pid, " ".join(command) + (
                "" if not env else " with " + " ".join(f"{name}={value}" for name, value in env.items())))
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
    while page.locator(dom.RUNNING).count() and time.monotonic() < deadline:
        page.wait_for_timeout(poll * 1000)


def settle(page, timeout: float = 600, pause: float = 0.3) -> None:
    """Wait until the page's script run finished (:func:`script_done`), ``pause`` seconds before looking (a run may
    not have started yet) and after (the last elements drawn)."""
    page.wait_for_selector(dom.APP, timeout=timeout * 1000)
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
