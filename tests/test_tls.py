"""HTTPS settings: the key and certificate checked before Serve gets them, each broken pair
named in one clear error. Served over HTTPS end to end: test_serve_cli.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import deploy
from kvmesh.cluster.tls import check_tls_files


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cert.pem and key.pem (a pair), other-key.pem (another cert's key), junk.pem, and
    encrypted-key.pem (key.pem under a passphrase)."""
    d = tmp_path_factory.mktemp("pems")
    ca = trustme.CA()
    server, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(d / "key.pem")
    server.cert_chain_pems[0].write_to_path(d / "cert.pem")
    other.private_key_pem.write_to_path(d / "other-key.pem")
    (d / "junk.pem").write_text("not a certificate\n")
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(server.private_key_pem.bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pass"),
    )
    (d / "encrypted-key.pem").write_bytes(encrypted)
    return d


def _config(pems: Path, cert: str, key: str) -> ServeConfig:
    return ServeConfig(
        model="tiny-random", ssl_certfile=str(pems / cert), ssl_keyfile=str(pems / key)
    )


def test_a_matching_pair_loads(pems: Path) -> None:
    check_tls_files(_config(pems, "cert.pem", "key.pem"))
    config = _config(pems, "cert.pem", "key.pem")
    assert config.base_url.startswith("https://") and config.http_options["ssl_certfile"]
    assert ServeConfig().base_url.startswith("http://")
    assert "ssl_certfile" not in ServeConfig().http_options


@pytest.mark.parametrize(
    ("cert", "key", "message"),
    [
        ("missing.pem", "key.pem", r"ssl_certfile: .*missing\.pem is not a file"),
        ("cert.pem", "missing.pem", r"ssl_keyfile: .*missing\.pem is not a file"),
        (".", "key.pem", r"ssl_certfile: .* is not a file"),
        ("cert.pem", "other-key.pem", "the key does not match the certificate"),
        ("junk.pem", "key.pem", "not a PEM certificate chain and its private key"),
        ("cert.pem", "junk.pem", "not a PEM certificate chain and its private key"),
        ("key.pem", "cert.pem", "not a PEM certificate chain and its private key"),
        ("cert.pem", "encrypted-key.pem", "the key is encrypted"),
    ],
)
def test_a_broken_pair_is_one_clear_error(pems: Path, cert: str, key: str, message: str) -> None:
    """Also from ``deploy``, before it touches Serve (no Ray runs in this test): Serve's
    proxy would otherwise fail on them and be started again and again."""
    config = _config(pems, cert, key)
    with pytest.raises(ValueError, match=message):
        check_tls_files(config)
    with pytest.raises(ValueError, match=message):
        deploy(config)


def test_half_a_pair_or_a_blank_path_is_refused() -> None:
    with pytest.raises(ValueError, match="give both for HTTPS, or neither"):
        ServeConfig(ssl_certfile="cert.pem")
    with pytest.raises(ValueError, match="ssl_keyfile: must be a file"):
        ServeConfig(ssl_certfile="cert.pem", ssl_keyfile="")


def test_kvmesh_serve_refuses_a_broken_pair_before_starting_ray(pems: Path) -> None:
    """One line, rc 2, in about the time of an import: no local Ray is started for it."""
    cmd = [sys.executable, "-m", "kvmesh.cluster", "serve", "--model", "tiny-random",
           "--address", "local", "--ssl-certfile", str(pems / "cert.pem"),
           "--ssl-keyfile", str(pems / "other-key.pem")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        f"kvmesh: error: ssl_certfile {pems / 'cert.pem'}, ssl_keyfile "
        f"{pems / 'other-key.pem'}: the key does not match the certificate"
    ]
