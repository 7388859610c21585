"""``make container-check``: the classroom container as a teacher meets it, on this box (no registry, no GPU).

Starts a docker engine when none answers, builds the image on the local Debian base (``make container
CONTAINER_BASE=debian``), runs it as compose.yaml does (its non-root user, a models volume, the port, the settings
compose passes), waits for its HEALTHCHECK, drives Home, Compare and a lesson step in headless chromium from outside
the container, restarts it and checks that the stored comparison and the converted model came back from the volume,
then checks compose.yaml's two profiles, a bad setting, and that a server which stops answering is reported unhealthy.
Figures go to artifacts/container-check.json; the exit status is 1 when any check fails.

Containers here use the host's network (the engine runs without a bridge), so the server listens on ``PORT`` 8601
where compose would publish 8501. The check serves without warming (``KVVIZ_WARM=0``): warming every page and lesson
on a 2-core box takes minutes, is measured by ``make warm`` outside the container, and would hide the time to healthy
that the check reports; Compare and the lesson step it runs are stored in the volume the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvviz.bench import dom  # noqa: E402
from kvviz.bench.browser import CHROMIUM_ARGS, chromium_path, settle  # noqa: E402

IMAGE = "kvviz:cpu"
BASE = "kvviz-base:bookworm"
NAME = "kvviz-check"
VOLUME = "kvviz-check-models"
PORT = 8601
URL = f"http://127.0.0.1:{PORT}"
ARTIFACTS = ROOT / "artifacts"
REPORT = ARTIFACTS / "container-check.json"
# The fields (tests/test_deployment.py pins them); every boolean among them must be true.
FIELDS = ("image_bytes", "build_seconds", "healthy_seconds", "first_page_seconds", "compare_ok", "lesson_ok",
          "restart_kept_results", "non_root", "compose_valid", "bad_setting_named", "unhealthy_when_killed", "base")
AT_ONCE_SECONDS = 5.0  # a stored comparison shown within this long after Run is pressed came from the store


def sh(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, its output captured as text."""
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=timeout, **kwargs)


def docker(*args: str, **kwargs) -> str:
    return sh("docker", *args, **kwargs).stdout.strip()


def health(name: str = NAME) -> str:
    return docker("inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", name, check=False)


def wait_health(status: str, started: float, timeout: float = 300) -> float:
    """Seconds from ``started`` until the container's healthcheck reports ``status``."""
    while health() != status:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not {status} after {timeout:.0f} s: {docker('logs', '--tail', '30', NAME)}")
        time.sleep(0.25)
    return time.monotonic() - started


def ensure_compose() -> None:
    """Debian's docker-compose (1.29: profiles, GPU reservations) validates compose.yaml; installed when missing."""
    if sh("sh", "-c", "command -v docker-compose", check=False).returncode != 0 and os.geteuid() == 0:
        sh("sh", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose")


def compose_environment() -> tuple[bool, dict[str, str]]:
    """Whether ``docker-compose config`` accepts compose.yaml with and without the scaled profile, and the kvviz
    service's environment as compose resolves it (what the check then runs the container with)."""
    ensure_compose()
    plain = sh("docker-compose", "-f", "compose.yaml", "config", check=False, cwd=ROOT)
    scaled = sh("docker-compose", "-f", "compose.yaml", "--profile", "scaled", "config", check=False, cwd=ROOT)
    valid = plain.returncode == 0 and scaled.returncode == 0 and "proxy" in yaml.safe_load(scaled.stdout)["services"]
    if not valid:
        print(plain.stderr + scaled.stderr, file=sys.stderr)
        return False, {}
    environment = yaml.safe_load(plain.stdout)["services"]["kvviz"].get("environment") or {}
    return True, {key: str(value) for key, value in environment.items()}


def layers(image: str) -> list[dict]:
    """The image's layers, newest first: their size and the instruction that made them."""
    rows = docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image).splitlines()
    return [{"size": size, "created_by": created[:160]} for size, _, created in (row.partition("\t") for row in rows)]


def host_leftovers(image: str) -> list[str]:
    """What the image holds of this box's pip setup: its CA bundle (by content), pip configuration files, the build
    stage's folder, or this box's wheel folders where pip records where a package came from."""
    cert = sh(sys.executable, "-m", "pip", "config", "get", "global.cert", check=False).stdout.strip()
    cert = cert or os.environ.get("PIP_CERT", "")
    digest = hashlib.sha256(Path(cert).read_bytes()).hexdigest() if cert and Path(cert).is_file() else "-"
    script = f"""
for f in /etc/pip.conf /etc/xdg/pip /root/.config/pip /root/.pip /home/kvviz/.config/pip /tmp/pip /app/docker/pip
do [ -e "$f" ] && echo "$f"; done
find / -xdev -type f \\( -name '*.crt' -o -name '*.pem' \\) -exec sha256sum {{}} + 2>/dev/null | grep {digest}
cd /opt/kvviz/lib/python3*/site-packages && grep -lF -e /opt/wheels/ -e /tmp/pip/ -e /etc/xdg/pip \\
    /opt/kvviz/pyvenv.cfg ./*.dist-info/RECORD ./*.dist-info/direct_url.json 2>/dev/null
true"""
    found = docker("run", "--rm", "--network", "host", "--user", "0", "--entrypoint", "sh", image, "-c", script)
    return [line for line in found.splitlines() if line.strip()]


def files(path: str) -> dict[str, str]:
    """Files under ``path`` in the running container, with their modification times."""
    listing = docker("exec", NAME, "find", path, "-type", "f", "-printf", "%p %T@\n", check=False)
    return dict(line.rsplit(" ", 1) for line in listing.splitlines() if line)


def run_container(environment: dict[str, str]) -> float:
    """Start the image as compose would (its user, the models volume, the settings, the restart policy); seconds
    from ``docker run`` to healthy."""
    env = [arg for key, value in environment.items() for arg in ("-e", f"{key}={value}")]
    started = time.monotonic()
    docker("run", "-d", "--name", NAME, "--network", "host", "--restart", "unless-stopped",
           "-v", f"{VOLUME}:/models", *env, IMAGE)
    return wait_health("healthy", started)


def press(page, path: str, button: str, result: str) -> float:
    """Open ``path`` with its defaults and press its run ``button``; seconds from the press until ``result`` shows."""
    page.goto(f"{URL}{path}", timeout=120_000)
    run = page.get_by_role("button", name=button)
    run.wait_for(timeout=120_000)
    settle(page, 120)
    pressed = time.monotonic()
    run.click()
    page.get_by_text(result).wait_for(timeout=600_000)
    seconds = time.monotonic() - pressed
    settle(page, 120)
    return seconds


def press_compare(page) -> float:
    """Compare with its defaults: seconds from pressing Run to the result."""
    return press(page, "/Compare", "Run comparison", "configurations on")


def browse(first: bool, figures: dict) -> None:
    """Home, Compare and lesson step 1 in headless chromium (first visit), or Compare alone (after the restart)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            if not first:
                figures["restart_compare_seconds"] = round(press_compare(page), 2)
                return
            started = time.monotonic()
            page.goto(URL, timeout=120_000)
            page.get_by_text("Model card").first.wait_for(timeout=120_000)
            figures["first_page_seconds"] = round(time.monotonic() - started, 2)
            settle(page, 120)
            figures["home_ok"] = page.locator(dom.EXCEPTION).count() == 0

            figures["compare_seconds"] = round(press_compare(page), 2)
            body = page.inner_text("body")
            shown = re.search(r"(\d+) configurations on (\d+) prompt tokens", body)
            page.locator(dom.BUTTON_GROUP).get_by_text("Memory", exact=True).click()
            page.locator(dom.PLOT).first.wait_for(timeout=120_000)
            settle(page, 120)
            charts = page.locator(dom.PLOT).count()
            page.screenshot(path=str(ARTIFACTS / "container-compare.png"), full_page=True)
            figures["compare_ok"] = bool(shown and int(shown.group(1)) >= 2 and "Outputs" in body
                                         and "full" in body and charts >= 1
                                         and page.locator(dom.EXCEPTION).count() == 0)
            figures["compare_shown"] = shown.group(0) if shown else body[:300]
            figures["memory_charts"] = charts

            figures["lesson_seconds"] = round(press(page, "/Lessons?step=1", "Generate and measure",
                                                    "Measured at the end"), 2)
            body = page.inner_text("body")
            figures["lesson_ok"] = ("Reference: the full cache answers" in body
                                    and page.locator(dom.EXCEPTION).count() == 0)
        finally:
            browser.close()


def bad_setting() -> tuple[bool, float, list[str]]:
    """A container given KVVIZ_MAX_PROMPT_TOKENS=abc: whether it exited at once with one line naming the variable."""
    started = time.monotonic()
    result = sh("docker", "run", "--rm", "--network", "host", "-e", "KVVIZ_MAX_PROMPT_TOKENS=abc", IMAGE,
                check=False, timeout=120)
    seconds = time.monotonic() - started
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    named = result.returncode != 0 and len(lines) == 1 and "KVVIZ_MAX_PROMPT_TOKENS" in lines[0] and seconds < 60
    return named, seconds, lines


def hung_server() -> tuple[bool, float]:
    """Stop the server inside the container (SIGSTOP from the host: the container's PID 1 is the server, which
    ignores signals sent from inside, and a server that exits ends the container, which the restart policy brings
    back); whether the healthcheck then reports unhealthy, and how long it took."""
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", NAME))
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        return True, wait_health("unhealthy", started, timeout=120)
    except RuntimeError:
        return False, time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)


def remove() -> None:
    sh("docker", "rm", "-f", NAME, check=False)
    sh("docker", "volume", "rm", "-f", VOLUME, check=False)


def check(figures: dict) -> None:
    """Every part of the teacher's path, its figures put into ``figures`` as they come."""
    parts = figures["seconds"]
    started = time.monotonic()
    answers = shutil.which("docker") and sh("docker", "info", check=False).returncode == 0
    engine = "found" if answers else None
    engine = engine or sh(str(ROOT / "docker" / "engine.sh"), "start").stdout.strip()
    figures["engine"] = engine
    parts["engine"] = round(time.monotonic() - started, 1)
    try:
        started = time.monotonic()
        figures["compose_valid"], environment = compose_environment()
        parts["compose"] = round(time.monotonic() - started, 1)

        figures["base_reused"] = sh("docker", "image", "inspect", BASE, check=False).returncode == 0
        started = time.monotonic()
        with (ARTIFACTS / "container-build.log").open("w") as log:
            subprocess.run(["make", "container", "CONTAINER_BASE=debian", f"IMAGE={IMAGE}"], cwd=ROOT, check=True,
                           stdout=log, stderr=subprocess.STDOUT)
        figures["build_seconds"] = parts["build"] = round(time.monotonic() - started, 1)
        figures["image_bytes"] = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE))
        figures["layers"] = layers(IMAGE)
        started = time.monotonic()
        figures["host_leftovers"] = host_leftovers(IMAGE)
        parts["leftovers"] = round(time.monotonic() - started, 1)

        remove()
        environment = {**environment, "PORT": str(PORT), "KVVIZ_WARM": "0"}
        figures["healthy_seconds"] = parts["run_to_healthy"] = round(run_container(environment), 1)
        user = docker("exec", NAME, "id", "-u")
        figures["non_root"] = user != "0" and docker("image", "inspect", "-f", "{{.Config.User}}", IMAGE) == "10001"
        model_files = {p: t for p, t in files("/models/kvviz").items() if "/results/" not in p}
        started = time.monotonic()
        browse(True, figures)
        parts["browser"] = round(time.monotonic() - started, 1)

        stored = {p for p in files("/models/kvviz") if "/results/" in p}
        started = time.monotonic()
        sh("docker", "restart", NAME)
        figures["restart_healthy_seconds"] = round(wait_health("healthy", started), 1)
        browse(False, figures)
        parts["restart"] = round(time.monotonic() - started, 1)
        after = files("/models/kvviz")
        figures["model_converted_again"] = {p: t for p, t in after.items() if "/results/" not in p} != model_files
        figures["results_stored"] = len(stored)
        # the same results on the volume (a load marks its file used), shown at once: read, not run again
        figures["restart_kept_results"] = (bool(stored) and {p for p in after if "/results/" in p} == stored
                                           and figures["restart_compare_seconds"] <= AT_ONCE_SECONDS
                                           and not figures["model_converted_again"] and bool(model_files))

        figures["bad_setting_named"], seconds, figures["bad_setting_output"] = bad_setting()
        figures["bad_setting_seconds"] = parts["bad_setting"] = round(seconds, 1)
        figures["unhealthy_when_killed"], seconds = hung_server()
        figures["unhealthy_seconds"] = parts["unhealthy"] = round(seconds, 1)
    finally:
        remove()
        if engine == "started":
            sh(str(ROOT / "docker" / "engine.sh"), "stop")


def main() -> int:
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    figures: dict = {"base": BASE, "image": IMAGE, "warm": False, "seconds": {}}
    try:
        check(figures)
    except Exception as error:  # whatever stopped the check goes into its report, which then fails
        figures["error"] = f"{type(error).__name__}: {error}"[:2000]
        print(figures["error"], file=sys.stderr)
    figures["seconds"]["total"] = round(time.monotonic() - started, 1)
    REPORT.write_text(json.dumps(figures, indent=1) + "\n")
    failed = [f for f in FIELDS if f not in figures or figures[f] is False]
    failed += [f for f in ("host_leftovers", "error") if figures.get(f)]
    for field in FIELDS:
        print(f"{field:<24} {figures.get(field)}")
    print(f"{'seconds':<24} {figures['seconds']}")
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all checks true"
    print(f"written: {REPORT.relative_to(ROOT)}; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
