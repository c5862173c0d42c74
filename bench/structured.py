"""Structured outputs: what the grammar's mask costs a decode step, and what it buys.

One engine (smollm2 by default), ``--batch`` chat requests asking for a person as JSON,
decoding together: the same requests free and held to a JSON schema, alternating for
``--rounds`` rounds in one run (this box's noise moves a single round by more than the
mask costs). Reported: the median over rounds of each round's median step while all of them
decode (ms), the constrained step's extra per request, how many answers parse as JSON the
schema allows, and the first answer of each. One JSON line.

    .venv/bin/python bench/structured.py [--batch 8] [--rounds 5] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jsonschema
import torch

from kvmesh import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun"]


def run(llm: LLM, chats: list[Any], params: SamplingParams) -> dict[str, Any]:
    """Every request queued at once; the step times while all of them decode."""
    engine = llm.engine
    ids = [engine.add_request(llm.chat_prompt(c), params) for c in chats]
    texts: dict[str, str] = {}
    steps: list[float] = []
    while engine.has_unfinished():
        full = engine.last_batch_size == len(chats)
        t = time.perf_counter()
        deltas = engine.step()
        if full and engine.last_batch_size == len(chats):
            steps.append(time.perf_counter() - t)
        for d in deltas:
            if d.output is not None:
                texts[d.request_id] = d.output.text
    answers = [texts[i] for i in ids]
    valid = 0
    for a in answers:
        try:
            jsonschema.validate(json.loads(a), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"step_ms": 1e3 * statistics.median(steps[1:]), "valid": valid, "first": answers[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, kv_cache_memory="256MiB", progress=False)
    chats = [
        [{"role": "user", "content": f"Describe {NAMES[i % len(NAMES)]}, a person, as JSON."}]
        for i in range(args.batch)
    ]
    base = {"max_tokens": args.max_tokens, "temperature": 0}
    held_kw = {**base, "structured_outputs": {"json": SCHEMA}}
    run(llm, chats[:1], SamplingParams(**held_kw))  # warm up
    rounds = [
        (run(llm, chats, SamplingParams(**base)), run(llm, chats, SamplingParams(**held_kw)))
        for _ in range(args.rounds)
    ]
    free_ms = statistics.median(f["step_ms"] for f, _ in rounds)
    held_ms = statistics.median(h["step_ms"] for _, h in rounds)
    free, held = rounds[0]
    print(
        json.dumps(
            {
                "bench": "structured",
                "model": args.model,
                "batch": args.batch,
                "rounds": args.rounds,
                "free_step_ms": round(free_ms, 2),
                "schema_step_ms": round(held_ms, 2),
                "mask_ms_per_request": round((held_ms - free_ms) / args.batch, 3),
                "free_valid": free["valid"],
                "schema_valid": held["valid"],
                "requests": args.batch,
                "free_first": free["first"],
                "schema_first": held["first"],
            }
        )
    )


if __name__ == "__main__":
    main()
