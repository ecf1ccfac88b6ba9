"""One process of a sharded run for tests/test_distributed.py (started by ``mlx.launch``, or
in the test's own process for the single-process reference): for each job, loads its target
(and draft) with ``mlxspec.load`` and generates its cases; writes what each gave to
OUT/rank<r>.json (OUT/single.json when not launched).

    python distributed_job.py OUT JOBS_JSON

JOBS_JSON: [{"target", "draft", "env"?, "cases": [case, ...]}, ...] ("env": variables set while
the job runs, e.g. MLXSPEC_MTP_HEAD); a case is {"id", "prompt",
"drafter", "temperature", "seed", "max_tokens", "tree"?, "depth"?}. "seed": "rank" gives each rank its own
seed (a planted divergence: the rank check must stop it). A result is {"tokens": [...], ...}
(and "text") or {"error": "<type>: <message>"}.
"""

import json
import os
import sys
from pathlib import Path


def run(out: Path, jobs: list[dict]) -> dict:
    import mlxspec
    from mlxspec.errors import MlxspecError

    results, rank = {}, None
    for job in jobs:
        saved = {name: os.environ.get(name) for name in job.get("env", {})}
        os.environ.update(job.get("env", {}))
        spec = mlxspec.load(job["target"], draft_model=job.get("draft"))
        group = spec.target.group
        rank = group.rank() if group is not None else None
        for case in job["cases"]:
            seed = rank if case.get("seed") == "rank" else case.get("seed")
            try:
                result = spec.generate(case["prompt"], raw=True, drafter=case["drafter"],
                                       temperature=case["temperature"], seed=seed, max_tokens=case["max_tokens"],
                                       tree=case.get("tree", "default"), depth=case.get("depth"))
                results[case["id"]] = {"tokens": result.tokens, "text": result.text, "drafter": result.stats.drafter,
                                       "tree_steps": result.stats.tree_steps, "drafted": result.stats.drafted,
                                       "accepted": result.stats.accepted, "sharded": group is not None}
                shared = spec._shared  # a sharded run's measured costs (rank 0's), None until measured
                results[case["id"]].update(cost_model=result.stats.cost_model, curve=None if shared is None else {
                    "verify": shared.cost.curve, "plain": shared.cost.plain, "draft": shared.draft_cost})
                if case["drafter"] == "mtp":  # the bytes of the head this rank holds (all of it, or its part)
                    results[case["id"]]["head_nbytes"] = spec.mtp_head()[0].nbytes
            except MlxspecError as err:
                results[case["id"]] = {"error": f"{type(err).__name__}: {err}"}
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    name = "single" if rank is None else f"rank{rank}"
    (out / f"{name}.json").write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    run(Path(sys.argv[1]), json.loads(sys.argv[2]))
