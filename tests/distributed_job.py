"""One process of a sharded run for tests/test_distributed.py (started by ``mlx.launch``, or
in the test's own process for the single-process reference): for each job, loads its target
(and draft) with ``mlxspec.load`` and generates its cases; writes what each gave to
OUT/rank<r>.json (OUT/single.json when not launched).

    python distributed_job.py OUT JOBS_JSON

JOBS_JSON: [{"target", "draft", "cases": [case, ...]}, ...]; a case is {"id", "prompt",
"drafter", "temperature", "seed", "max_tokens", "tree"?}. "seed": "rank" gives each rank its own
seed (a planted divergence: the rank check must stop it). A result is {"tokens": [...], ...}
(and "text") or {"error": "<type>: <message>"}.
"""

import json
import sys
from pathlib import Path


def run(out: Path, jobs: list[dict]) -> dict:
    import mlxspec
    from mlxspec.errors import MlxspecError

    results, rank = {}, None
    for job in jobs:
        spec = mlxspec.load(job["target"], draft_model=job.get("draft"))
        group = spec.target.group
        rank = group.rank() if group is not None else None
        for case in job["cases"]:
            seed = rank if case.get("seed") == "rank" else case.get("seed")
            try:
                result = spec.generate(case["prompt"], raw=True, drafter=case["drafter"],
                                       temperature=case["temperature"], seed=seed, max_tokens=case["max_tokens"],
                                       tree=case.get("tree", "default"))
                results[case["id"]] = {"tokens": result.tokens, "text": result.text, "drafter": result.stats.drafter,
                                       "tree_steps": result.stats.tree_steps, "drafted": result.stats.drafted,
                                       "accepted": result.stats.accepted, "sharded": group is not None}
            except MlxspecError as err:
                results[case["id"]] = {"error": f"{type(err).__name__}: {err}"}
    name = "single" if rank is None else f"rank{rank}"
    (out / f"{name}.json").write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    run(Path(sys.argv[1]), json.loads(sys.argv[2]))
