"""HTTPS for Serve's HTTP proxies: the key and certificate checked before Serve gets them."""

from __future__ import annotations

import ssl
from pathlib import Path

from kvmesh.cluster.config import ServeConfig


def check_tls_files(config: ServeConfig) -> None:
    """Load ``ssl_certfile`` and ``ssl_keyfile`` as a server would; a ValueError naming the
    setting and the reason otherwise (missing, not PEM, a key that does not match the
    certificate, a key with a passphrase). Without this, Serve's proxy fails to start on
    them, and Serve starts it again and again while the app waits for it."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return
    for name in ("ssl_certfile", "ssl_keyfile"):
        path = getattr(config, name)
        if not Path(path).is_file():
            raise ValueError(f"{name}: {path} is not a file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key would ask for its passphrase on the terminal: refuse it instead.
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, password=_no_password)
    except ssl.SSLError as e:
        why = "the key does not match the certificate"
        if e.reason != "KEY_VALUES_MISMATCH":
            why = "they are not a PEM certificate chain and its private key"
        raise ValueError(
            f"ssl_certfile {config.ssl_certfile}, ssl_keyfile {config.ssl_keyfile}: {why}"
        ) from None
    except OSError as e:
        raise ValueError(f"ssl_certfile, ssl_keyfile: cannot read them ({e.strerror})") from None


def _no_password() -> bytes:
    raise ValueError("ssl_keyfile: the key is encrypted; give an unencrypted key")
