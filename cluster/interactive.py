"""`kvmesh generate` and `kvmesh chat`: one engine in this process, tokens streamed."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvmesh import LLM, SamplingParams


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )


def _stream(llm: LLM, prompt: str | list[int], params: SamplingParams, out: TextIO) -> str:
    text = ""
    for delta in llm.stream([prompt], params):
        out.write(delta.text)
        out.flush()
        text += delta.text
    out.write("\n")
    return text


def generate(args: argparse.Namespace, out: TextIO = sys.stdout) -> None:
    params = _params(args)  # validate before the model loads
    if not args.prompt:
        raise ValueError("prompt: must not be empty")
    llm = LLM(args.model)
    _stream(llm, args.prompt, params, out)


def chat(args: argparse.Namespace, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    """Read user turns line by line until EOF or /exit; earlier turns hit the prefix cache."""
    params = _params(args)
    llm = LLM(args.model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = inp.isatty()
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = inp.readline()
        if not line or line.strip() == "/exit":
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        out.write("assistant> ")
        answer = _stream(llm, llm.chat_prompt(messages), params, out)
        messages.append({"role": "assistant", "content": answer})
