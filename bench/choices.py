"""n choices of one long prompt through Serve (3 tiny-random workers): how many prompt tokens
the choices computed, pulled and hit, per router. One JSON line per (router, n).

    .venv/bin/python bench/choices.py [kv_aware round_robin]
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai
import ray
from ray import serve

from tests.serve_helpers import redeploy, tiny_config

ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
prompt = [10 + (i * 7) % 300 for i in range(512)]
for router in sys.argv[1:] or ["kv_aware", "round_robin"]:
    config = tiny_config(workers=3, router=router)
    redeploy(config)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1", api_key="x", timeout=120, max_retries=0
    )
    for n in (1, 4, 8):
        p = [x + n for x in prompt]  # a fresh prompt per n
        t = time.perf_counter()
        r = client.completions.create(
            model=config.model_name, prompt=p, n=n, max_tokens=4, temperature=0
        )
        dt = time.perf_counter() - t
        kv = [c.model_extra.get("kvmesh") or r.model_extra["kvmesh"] for c in r.choices]
        print(
            json.dumps(
                {
                    "router": router,
                    "n": n,
                    "prompt_tokens": len(p),
                    "computed": sum(k["computed_tokens"] for k in kv),
                    "pulled": sum(k["pulled_tokens"] for k in kv),
                    "local": sum(k["local_hit_tokens"] for k in kv),
                    "workers": len({k["worker"] for k in kv}),
                    "s": round(dt, 2),
                }
            ),
            flush=True,
        )
serve.shutdown()
ray.shutdown()
