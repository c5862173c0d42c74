"""The `kvmesh` command line."""

from __future__ import annotations

import argparse

from kvmesh import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="An LLM serving cluster on Ray whose workers share paged KV blocks.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the demo")
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="a synthetic multi-request trace through one block pool (no model)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvmesh.cluster.trace_demo import TraceConfig, run_trace

        run_trace(TraceConfig())
        return 0
    parser.print_help()
    return 0
