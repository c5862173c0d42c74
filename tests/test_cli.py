import subprocess
import sys

from kvmesh import __version__
from kvmesh.cluster.trace_demo import TraceConfig, run_trace


def kvmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster", *args], capture_output=True, text=True
    )


def test_version_and_help() -> None:
    out = kvmesh("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvmesh {__version__}"
    out = kvmesh("--help")
    assert out.returncode == 0 and "demo" in out.stdout


def test_unknown_command_is_refused() -> None:
    out = kvmesh("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_synthetic_trace_hits_evicts_and_loads() -> None:
    lines: list[str] = []
    totals = run_trace(TraceConfig(), out=lines.append)
    assert totals["requests"] == 12 and len(lines) == 14
    # Every request after the first shares at least the system prompt's full blocks.
    assert totals["local_hit_tokens"] >= 11 * 48
    # The pool is too small for everything: blocks are evicted and some come back by load.
    assert totals["evictions"] > 0 and totals["loaded_tokens"] > 0
    assert totals["connector_hits_loaded"] * 8 == totals["loaded_tokens"]
    assert totals["connector_evicted_blocks"] == totals["evictions"]


def test_a_setting_named_twice_in_the_yaml_is_refused(tmp_path) -> None:
    """PyYAML keeps the last of two equal keys; a settings file that names one twice (or
    once with dashes and once with underscores) is refused before anything starts."""
    for text, name in (("workers: 1\nworkers: 3\n", "'workers' is set twice"),
                       ("max-workers: 2\nmax_workers: 3\n", "sets max_workers twice")):  # fmt: skip
        config = tmp_path / "serve.yaml"
        config.write_text(text)
        out = kvmesh("serve", "--config", str(config), "--address", "127.0.0.1:1")
        assert out.returncode == 2 and name in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_a_settings_file_that_is_not_yaml_text_is_named(tmp_path) -> None:
    """Bytes that are not UTF-8 and text that is not YAML: one line naming the file (and the
    byte, or the line), before anything starts."""
    for data, said in (
        (b"model: tiny-random\n# " + b"x" * 20000 + b"\nworkers: \xff\n", "byte 20031"),
        (b"model: [tiny\n", 'in "{path}", line 1, column 8'),
    ):
        config = tmp_path / "serve.yaml"
        config.write_bytes(data)
        out = kvmesh("serve", "--config", str(config), "--address", "127.0.0.1:1")
        assert out.returncode == 2, out.stderr
        assert f"kvmesh: error: config: {config} is not" in out.stderr, out.stderr
        assert said.format(path=config) in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "<unicode string>" not in out.stderr


def test_paths_in_serve_settings_are_this_shells(tmp_path, monkeypatch) -> None:
    """Ray starts workers and proxies in the directory their node's `ray start` ran in, not
    this shell's: before, `kvmesh serve --address ... --disk-cache-dir kv` made `kv` there
    (measured: a driver in one directory, a head started in another; the worker's cwd was
    the head's), and a relative model or TLS file passed the CLI's checks here and was
    missing there. Now they are made absolute where they were typed; the name clients send
    stays the model as given."""
    import argparse

    from kvmesh.cluster.serve_flags import add_serve_args, config_from_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "serve.yaml").write_text("ssl_keyfile: k.pem\nssl_certfile: c.pem\n")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    argv = ["--config", "serve.yaml", "--disk-cache-dir", "kv", "--model", "m.gguf"]
    config = config_from_args(p.parse_args(argv))
    assert config.disk_cache_dir == str(tmp_path / "kv")
    assert (config.ssl_keyfile, config.ssl_certfile) == (
        str(tmp_path / "k.pem"),
        str(tmp_path / "c.pem"),
    )
    assert config.model == str(tmp_path / "m.gguf") and config.model_name == "m.gguf"
    known = config_from_args(p.parse_args(["--model", "tiny-random", "--disk-cache-dir", "/kv"]))
    assert (known.model, known.model_name, known.disk_cache_dir) == ("tiny-random",) * 2 + ("/kv",)
