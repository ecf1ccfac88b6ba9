"""Measure the mini DFlash drafter (benchmarks/models/mini-attn-DFlash) against mini-attn's own
MTP head with mlxspec's engine (SpeculativeDecoder), on the held-out prompt sets of
benchmarks/workloads (cut from files the mini family never trained on).

  acceptance  greedy, gates off, fixed depths: per-position acceptance (Stats.position_drafted /
              position_accepted: a draft reaching position i, and positions 1..i all accepted),
              per workload and overall, and whether the output equals plain decoding's.
  speed       plain (drafter none) against each drafter configuration, interleaved (for each
              repetition, each prompt, each configuration) after one warm-up of each; decode
              rate = tokens after the first / time from the first token to the last, summed
              over a repetition's prompts; median and interquartile range over repetitions.

Models are cast to float32 (as `mlxspec bench --dtype float32` does), so the identity checks
are exact. On the GPU machine (MLX's CUDA backend staged, ../shared/device/README.md):

    python3 scripts/measure_dflash_mini.py acceptance --json OUT/mini_dflash_acceptance.json
    python3 scripts/measure_dflash_mini.py speed --json OUT/mini_dflash_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mlxspec.engine.speculate import SpeculativeDecoder  # noqa: E402
from mlxspec.models.loader import load_model  # noqa: E402
from mlxspec.models.mtp import load_mtp_head  # noqa: E402

MODELS = ROOT / "benchmarks" / "models"
WORKLOADS = ("completion", "echo", "toolcall", "novel")
# name: (drafter, depth, gates, tree); depth None with gates: the engine chooses, as `mlxspec run`
# does; tree 0: chains (per-position acceptance is a chain's), None: the engine's tree policy
ACCEPTANCE_CONFIGS = {"dflash-d7": ("dflash", 7, False, 0), "mtp-d7": ("mtp", 7, False, 0),
                      "mtp-d2": ("mtp", 2, False, 0), "dflash-d3": ("dflash", 3, False, 0),
                      "dflash-d3-tree8": ("dflash", 3, False, 8), "dflash-d7-tree16": ("dflash", 7, False, 16),
                      "dflash-d7-tree32": ("dflash", 7, False, 32)}
SPEED_CONFIGS = {"plain": ("none", None, False, 0), "dflash-d7": ("dflash", 7, False, 0),
                 "dflash-d3": ("dflash", 3, False, 0), "dflash-auto": ("dflash", None, True, 0),
                 "dflash-tree": ("dflash", None, True, None), "mtp-d2": ("mtp", 2, False, 0),
                 "mtp-auto": ("mtp", None, True, 0)}


def fp32(module) -> None:
    module.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                           module.parameters()))
    mx.eval(module.parameters())


def load(target: Path, drafter: Path):
    """(target LoadedModel, DFlash model, MTP head), all float32."""
    loaded = load_model(str(target))
    fp32(loaded.model)
    dflash = load_model(str(drafter)).model
    fp32(dflash)
    head = load_mtp_head(loaded.model, loaded.path, loaded.config)
    fp32(head.module)
    return loaded, dflash, head


def prompts(tokenizer, per_workload: int, workloads=WORKLOADS) -> list[tuple[str, list[int]]]:
    out = []
    for w in workloads:
        lines = (ROOT / "benchmarks" / "workloads" / f"{w}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        out += [(r["id"], tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in rows[:per_workload]]
    return out


def decoder(model, dflash, head, config: tuple) -> SpeculativeDecoder:
    drafter, depth, gates, tree = config
    extra = {"draft_model": dflash} if drafter == "dflash" else {"mtp_head": head} if drafter == "mtp" else {}
    return SpeculativeDecoder(model, drafter=drafter, depth=depth, gates=gates, tree=tree, **extra)


def run(dec: SpeculativeDecoder, prompt: list[int], n: int) -> dict:
    mx.synchronize()
    tokens, stamps, stats = [], [], None
    t0 = time.perf_counter()
    for toks, stats in dec.generate(prompt, max_tokens=n):
        if toks:
            stamps.append(time.perf_counter())
            tokens.extend(toks)
    return {"tokens": tokens, "ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "stats": stats}


# ---------------------------------------------------------------------------


def _positions(drafted: list[int], accepted: list[int]) -> dict:
    """Per position i: the share of drafts reaching i whose positions 1..i were all accepted, and
    the same given 1..i-1 accepted (conditional)."""
    rate = [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)]
    cond = [rate[0]] + [round(accepted[i] / accepted[i - 1], 4) if accepted[i - 1] else None
                        for i in range(1, len(accepted))]
    verifies = drafted[0] if drafted else 0
    return {"position_drafted": drafted, "position_accepted": accepted, "acceptance_by_position": rate,
            "conditional_by_position": cond, "drafted": sum(drafted), "accepted": sum(accepted),
            "verifies": verifies, "tokens_per_verify": round(1 + sum(accepted) / verifies, 4) if verifies else None}


def acceptance(loaded, dflash, head, per_workload: int, max_tokens: int, names=None) -> dict:
    model = loaded.model
    plain = decoder(model, dflash, head, SPEED_CONFIGS["plain"])
    result = {}
    items = prompts(loaded.tokenizer, per_workload)
    reference = {pid: run(plain, ids, max_tokens)["tokens"] for pid, ids in items}
    for name, config in ACCEPTANCE_CONFIGS.items():
        if names and name not in names:
            continue
        dec = decoder(model, dflash, head, config)
        by_workload: dict[str, tuple[list[int], list[int]]] = {}
        identical, trees = True, 0
        for pid, ids in items:
            r = run(dec, ids, max_tokens)
            identical &= r["tokens"] == reference[pid]
            trees += getattr(r["stats"], "tree_steps", 0)
            d, a = by_workload.setdefault(pid.split("-")[0], ([0] * config[1], [0] * config[1]))
            for i, (x, y) in enumerate(zip(r["stats"].position_drafted, r["stats"].position_accepted)):
                d[i] += x
                a[i] += y
        total = ([sum(v[0][i] for v in by_workload.values()) for i in range(config[1])],
                 [sum(v[1][i] for v in by_workload.values()) for i in range(config[1])])
        result[name] = {"drafter": config[0], "depth": config[1], "gates": config[2], "tree": config[3],
                        "identical_to_plain": identical, "tree_steps": trees, "all": _positions(*total),
                        "workloads": {w: _positions(*v) for w, v in by_workload.items()}}
        print(f"[acceptance] {name}: {result[name]['all']['acceptance_by_position']} identical={identical}",
              flush=True)
    return {"prompts": [pid for pid, _ in items], "max_tokens": max_tokens, "temperature": 0.0,
            "configs": result}


def speed(loaded, dflash, head, per_workload: int, max_tokens: int, reps: int) -> dict:
    model = loaded.model
    items = prompts(loaded.tokenizer, per_workload)
    decs = {name: decoder(model, dflash, head, cfg) for name, cfg in SPEED_CONFIGS.items()}
    for dec in decs.values():  # warm-up: kernels, allocator, the cost curves
        run(dec, items[0][1], min(64, max_tokens))
    per_rep = {name: [] for name in decs}
    runs, reference = [], {}
    for rep in range(reps):
        sums = {name: [0, 0.0] for name in decs}
        for pid, ids in items:
            for name, dec in decs.items():
                r = run(dec, ids, max_tokens)
                st = r["stats"]
                if name == "plain":
                    reference.setdefault(pid, r["tokens"])
                sums[name][0] += len(r["tokens"]) - 1
                sums[name][1] += r["decode_s"]
                runs.append({"rep": rep, "prompt": pid, "config": name, "generated": len(r["tokens"]),
                             "decode_s": round(r["decode_s"], 6), "ttft_s": round(r["ttft_s"], 6),
                             "drafted": st.drafted, "accepted": st.accepted, "verify_steps": st.verify_steps,
                             "tree_steps": getattr(st, "tree_steps", 0),
                             "identical": r["tokens"] == reference[pid]})
        for name, (n, s) in sums.items():
            per_rep[name].append(n / s)
        print(f"[speed] rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in per_rep.items()),
              flush=True)
    base = statistics.median(per_rep["plain"])
    summary = {}
    for name, tps in per_rep.items():
        q1, med, q3 = statistics.quantiles(tps, n=4, method="inclusive")
        own = [r for r in runs if r["config"] == name]
        drafted, accepted = sum(r["drafted"] for r in own), sum(r["accepted"] for r in own)
        drafter, depth, gates, tree = SPEED_CONFIGS[name]
        summary[name] = {"drafter": drafter, "depth": depth, "gates": gates, "tree": tree,
                         "tps_median": round(med, 2), "tps_q1": round(q1, 2), "tps_q3": round(q3, 2),
                         "speedup_median": round(med / base, 4), "tps_reps": [round(t, 2) for t in tps],
                         "acceptance": round(accepted / drafted, 4) if drafted else None,
                         "tree_steps": sum(r["tree_steps"] for r in own),
                         "identical": all(r["identical"] for r in own)}
    return {"prompts": [pid for pid, _ in items], "max_tokens": max_tokens, "reps": reps, "temperature": 0.0,
            "summary": summary, "runs": runs}


def environment() -> dict:
    import mlx_lm

    env = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
           "python": platform.python_version(), "platform": platform.platform(), "argv": sys.argv,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        env["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:  # older mlx: no device_info
        pass
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["acceptance", "speed"])
    ap.add_argument("--target", type=Path, default=MODELS / "mini-attn")
    ap.add_argument("--drafter", type=Path, default=MODELS / "mini-attn-DFlash")
    ap.add_argument("--prompts", type=int, help="prompts per workload (acceptance 4, speed 1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8, help="speed: repetitions")
    ap.add_argument("--configs", help="acceptance: comma-separated subset of " + ", ".join(ACCEPTANCE_CONFIGS))
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    loaded, dflash, head = load(a.target, a.drafter)
    if a.what == "acceptance":
        body = acceptance(loaded, dflash, head, a.prompts or 4, a.max_tokens, a.configs and a.configs.split(","))
    else:
        body = speed(loaded, dflash, head, a.prompts or 1, a.max_tokens, a.reps)
    out = {"kind": f"mini_dflash_{a.what}", "target": str(a.target.relative_to(ROOT) if a.target.is_relative_to(ROOT)
                                                             else a.target),
           "drafter": str(a.drafter.relative_to(ROOT) if a.drafter.is_relative_to(ROOT) else a.drafter),
           "dtype": "float32", "environment": environment(), **body}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"[{a.what}] wrote {a.json}", flush=True)


if __name__ == "__main__":
    main()
