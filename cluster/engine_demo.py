"""`kvmesh demo`: a real answer from the model, then a follow-up that reuses its prefix."""

from __future__ import annotations

from kvmesh import LLM, SamplingParams

SYSTEM = (
    "You are a concise assistant for engineers who run LLM inference clusters. "
    "Answer in two or three sentences."
)
TURNS = ["What is a KV cache?", "Why does reusing it across requests make serving faster?"]


def run_demo(model: str = "smollm2-135m") -> None:
    print(f"loading {model} ...")
    llm = LLM(model)
    # Warm up (first-call allocations, RoPE tables) so the TTFTs below compare like with like.
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    llm.engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=64, temperature=0)
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        out = llm.chat(messages, params)[0]
        messages.append({"role": "assistant", "content": out.text})
        m = out.metrics
        rows.append((turn, out, m))
        print(f"\nuser> {turn}\nassistant> {out.text.strip()}")
        print(
            f"  prompt {len(out.prompt_token_ids)} tokens: {m.num_local_hit_tokens} hit in the "
            f"prefix cache, {m.num_computed_tokens} computed; TTFT {m.ttft_s * 1000:.0f} ms"
        )
    first, second = rows[0][2], rows[1][2]
    print(
        f"\nThe follow-up reused {second.num_local_hit_tokens} prompt tokens of KV from the first "
        f"turn: TTFT {first.ttft_s * 1000:.0f} ms -> {second.ttft_s * 1000:.0f} ms."
    )
