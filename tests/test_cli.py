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
