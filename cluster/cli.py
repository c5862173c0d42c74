"""The `kvmesh` command line."""

from __future__ import annotations

import argparse
import sys

from kvmesh import __version__
from kvmesh.cluster.launch import ClusterTaken, DeployFailed

DEFAULT_MODEL = "smollm2-135m"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="An LLM serving cluster on Ray whose workers share paged KV blocks.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="a local 3-worker cluster serving a multi-turn chat")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    kind = demo.add_mutually_exclusive_group()
    kind.add_argument(
        "--single",
        action="store_true",
        help="instead: one engine in this process, a follow-up that hits the prefix cache",
    )
    kind.add_argument(
        "--synthetic",
        action="store_true",
        help="instead: a synthetic multi-request trace through one block pool (no model)",
    )

    serve = sub.add_parser("serve", help="serve the OpenAI API on a Ray cluster")
    from kvmesh.cluster.serve_flags import add_serve_args

    add_serve_args(serve)

    for name, help_ in (("generate", "complete one prompt"), ("chat", "chat interactively")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", default=DEFAULT_MODEL, help="a known name, .gguf or HF dir")
        p.add_argument("--max-tokens", type=int, default=128 if name == "chat" else 64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        if name == "generate":
            p.add_argument("prompt")
        else:
            p.add_argument("--system", default=None, help="a system prompt")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo" and args.synthetic:
        from kvmesh.cluster.trace_demo import TraceConfig, run_trace

        run_trace(TraceConfig())
        return 0
    try:
        if args.command == "serve":
            from kvmesh.cluster.launch import serve_forever
            from kvmesh.cluster.serve_flags import config_from_args

            serve_forever(config_from_args(args), args.address, args.replace)
        elif args.command == "demo" and args.single:
            from kvmesh.cluster.engine_demo import run_demo

            run_demo(args.model)
        elif args.command == "demo":
            from kvmesh.cluster.demo import run_demo

            run_demo(args.model)
        elif args.command == "generate":
            from kvmesh.cluster.interactive import generate

            generate(args)
        else:
            from kvmesh.cluster.interactive import chat

            chat(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, DeployFailed, ClusterTaken) as e:  # no cluster; a failed app; taken
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    return 0
