"""The API key from ``KVMESH_API_KEY``, as vLLM takes ``VLLM_API_KEY``: kept out of `ps`, shell
history and manifests, and never shown by a config's repr. Served end to end through it:
test_serve_cli.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.cluster.config import API_KEY_ENV, ServeConfig
from kvmesh.cluster.serve_app import application, build_app
from kvmesh.cluster.serve_flags import add_serve_args, config_from_args


def _config(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_a_config_never_shows_its_key() -> None:
    config = ServeConfig(model="tiny-random", api_key="s3cret")
    assert "s3cret" not in repr(config) and "s3cret" not in str(config)
    assert config.api_key == "s3cret" and config.to_dict()["api_key"] == "s3cret"


def test_the_key_comes_from_the_environment_unless_a_setting_names_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _config().api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _config().api_key == "from-env"
    assert _config("--api-key", "from-flag").api_key == "from-flag"
    (tmp_path / "serve.yaml").write_text("api_key: from-file\n")
    assert _config("--config", str(tmp_path / "serve.yaml")).api_key == "from-file"


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_key_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, blank: str
) -> None:
    """Rather than serve without the key the variable was meant to hold."""
    monkeypatch.setenv(API_KEY_ENV, blank)
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} is set but empty"):
        _config()


def test_an_app_built_from_args_takes_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RayService's serveConfigV2 builds the app from its args (``build_app``): the key
    reaches the ingress from the pods' environment (a Secret), not from the manifest."""
    monkeypatch.setenv(API_KEY_ENV, "from-secret")
    ingress = build_app({"model": "tiny-random"})._bound_deployment
    assert ingress.name == "KvmeshServer"
    assert ingress.init_args[0]["api_key"] == "from-secret"
    named = build_app({"model": "tiny-random", "api_key": "from-args"})._bound_deployment
    assert named.init_args[0]["api_key"] == "from-args"


def test_a_config_given_in_python_is_served_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``deploy(config)`` (the Python API, `kvmesh demo`) serves exactly its config: a key in
    the caller's environment must not lock out a demo whose own client sends none."""
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    ingress = application(ServeConfig(model="tiny-random"))._bound_deployment
    assert ingress.init_args[0]["api_key"] is None
