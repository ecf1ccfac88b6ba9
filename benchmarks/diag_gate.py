"""Why does a drafter's gate switch off? One prompt, gates on and off, the engine's own stats
(cost model, gate events, acceptance per position) and decode tok/s.

    python benchmarks/diag_gate.py benchmarks/models/mini-attn --drafter mtp --workload completion
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.api import load  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--draft-model")
ap.add_argument("--drafter", default="mtp")
ap.add_argument("--workload", default="completion")
ap.add_argument("--tokens", type=int, default=256)
a = ap.parse_args()
spec = load(a.model, draft_model=a.draft_model)
spec.astype("float32")
print("verify cost curve", {n: round(v, 3) for n, v in sorted(spec.verify_cost().curve.items())})
head = spec.mtp_head()[0]
if head is not None and a.drafter == "mtp":
    from mlxspec.engine.cache import model_nbytes
    from mlxspec.engine.drafters.mtp import MTPDrafter
    print("mtp cost_per_token", round(MTPDrafter(head, model_nbytes(spec.target.model)).cost_per_token, 3))
prompt = json.loads(Path(f"benchmarks/workloads/{a.workload}.jsonl").read_text().splitlines()[0])["prompt"]
for gates in (True, False, True):
    for depth in ((None,) if gates else (1, 2, 3)):
        t = time.perf_counter()
        r = spec.generate(prompt, max_tokens=a.tokens, temperature=0, raw=True, drafter=a.drafter,
                          gates=gates, depth=depth)
        dt = time.perf_counter() - t
        s = r.stats.to_dict()
        keep = {k: s.get(k) for k in ("acceptance", "drafted", "accepted", "mean_depth", "position_acceptance",
                                      "cost_model", "gate_events", "decode_tps", "tokens_per_second")}
        print(json.dumps({"gates": gates, "depth": depth, "wall_tps": round(len(r.tokens) / dt, 1), **keep})[:1500])
base = time.perf_counter()
r = spec.generate(prompt, max_tokens=a.tokens, temperature=0, raw=True, drafter="none")
print("none wall tps", round(len(r.tokens) / (time.perf_counter() - base), 1))
