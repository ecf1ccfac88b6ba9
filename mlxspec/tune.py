"""``mlxspec tune``: measure this machine's costs and a model's acceptance, pick depths, store them.

What is stored, per (machine, model), as JSON under ``<user data dir>/mlxspec/tune/<machine>/<model>.json``:

* ``verify_cost``: cost of a target forward over n = 1..16 tokens, relative to one token;
* ``draft_cost``: cost of one draft step per drafter, in the same unit (prompt lookup: 0);
* ``acceptance``: per drafter and prompt kind, how often each draft position (1..8) was reached
  and accepted when drafting at a fixed depth 8 with the gates off (greedy);
* ``depth``: per drafter, the depth k maximizing E_k / (verify(k+1) + k * draft_cost), E_k from
  the gates' own :class:`~mlxspec.engine.gates.AcceptanceModel`, with the relative speed per depth.

``SpecModel.verify_cost()`` reads the stored curve (when there is one for this machine and model)
instead of measuring it again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

FORMAT_VERSION = 1
WIDTHS = tuple(range(1, 17))  # verify widths measured: every one of 1..16
TUNE_DEPTH = 8  # acceptance is measured drafting this many tokens per step
DATA_ENV = "MLXSPEC_TUNE_DIR"  # overrides the folder the results live in (tests, CI)


# -- keys and paths ------------------------------------------------------------------


def _slug(text: str, limit: int = 48) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.").lower()
    return slug[:limit] or "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "cpu"


def machine_info() -> dict:
    """Platform, CPU and (when MLX runs on one) GPU name of this machine."""
    import mlx.core as mx

    device = mx.default_device()
    gpu = None
    if device.type == mx.DeviceType.gpu:
        try:
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            gpu = str(info.get("device_name") or info.get("name") or "gpu")
        except Exception:  # backends differ in what they report
            gpu = "gpu"
    info = {"platform": f"{platform.system()}-{platform.machine()}", "cpu": _cpu_name(),
            "gpu": gpu, "device": "gpu" if gpu else "cpu"}
    info["key"] = _slug("_".join(x for x in (info["platform"], info["cpu"], gpu) if x), 96)
    return info


_MACHINE: dict | None = None


def machine_key() -> str:
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = machine_info()
    return _MACHINE["key"]


def model_info(loaded) -> dict:
    """Key of a loaded model: its folder's name + a hash of its resolved path and config."""
    path = Path(loaded.path).resolve()
    config = json.dumps(loaded.config, sort_keys=True, default=str)
    config_hash = hashlib.sha256(config.encode()).hexdigest()[:12]
    path_hash = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return {"key": f"{_slug(path.name)}-{path_hash}-{config_hash}", "name": loaded.name,
            "path": str(path), "config_hash": config_hash}


def tune_dir() -> Path:
    env = os.environ.get(DATA_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("mlxspec")) / "tune"


def result_path(loaded) -> Path:
    return tune_dir() / machine_key() / f"{model_info(loaded)['key']}.json"


def load_result(loaded) -> dict | None:
    """The stored tune result for this machine and model, or None (also for an unreadable one)."""
    try:
        path = result_path(loaded)
        if not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            return None
        return data
    except (OSError, ValueError):
        return None


def stored_cost(loaded):
    """The stored verify-cost curve as a measured :class:`CostModel`, or None."""
    from .engine.gates import CostModel

    data = load_result(loaded)
    try:
        curve = {int(n): float(c) for n, c in (data or {}).get("verify_cost", {}).items()}
    except (TypeError, ValueError, AttributeError):
        return None
    if not curve or 1 not in curve or any(c <= 0 for c in curve.values()):
        return None
    return CostModel(curve=curve, measured=True)


def stored_draft_cost(loaded, drafter: str, draft=None) -> float | None:
    """The stored cost of one draft step of ``drafter``, or None. A draft model's cost only
    counts when it was tuned with this same draft model."""
    data = load_result(loaded) or {}
    if drafter == "draft":
        tuned = data.get("draft_model") or {}
        if draft is None or tuned.get("key") != model_info(draft)["key"]:
            return None
    value = (data.get("draft_cost") or {}).get(drafter)
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


# -- prompts -------------------------------------------------------------------------

_CODE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file, or return the defaults."""
    path = Path(path)
    if not path.exists():
        return {"theme": "light", "font_size": 12, "autosave": True}
    with open(path) as f:
        return json.load(f)


def save_settings(path, settings):
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)


def update_setting(path, key, value):
    settings = load_settings(path)
    settings[key] = value
    save_settings(path, settings)
    return settings
'''

PROMPTS = {
    "code edit": ("Here is a Python file:\n\n```python\n" + _CODE + "```\n\n"
                  "Rename the function update_setting to set_setting everywhere and give the "
                  "default font_size the value 14. Reply with the whole updated file only."),
    "code completion": ("Complete this Python module: a function that parses a CSV line with "
                        "quoted fields, with a docstring and tests.\n\n```python\n"
                        "def parse_csv_line(line: str, sep: str = \",\") -> list[str]:\n"),
    "prose": ("Write a short essay about the history of lighthouses, how they work, and why "
              "some are still kept today."),
}


# -- measuring -----------------------------------------------------------------------


def _median_time(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _one_token_time(model, context: int, reps: int, vocab: int) -> float:
    """Median time of a 1-token forward over a warm cache of ``context`` tokens."""
    import mlx.core as mx

    from .engine.cache import ModelState

    state = ModelState(model)
    state.prefill([(7 * i) % vocab for i in range(context)])
    token = mx.array([3 % vocab], mx.uint32)

    def run():
        mx.eval(state.forward(token))
        state.rollback_to(context)
        state.commit()

    run()  # warm-up
    return _median_time(run, reps)


def draft_model_cost(target, draft, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One draft-model forward relative to one target forward (both 1 token, warm cache)."""
    t_target = _one_token_time(target, context, reps, vocab)
    return _one_token_time(draft, context, reps, vocab) / t_target


def mtp_cost(target, head, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One MTP head step relative to one target forward (1 token, warm caches)."""
    import mlx.core as mx

    from .engine.cache import ModelState

    state = ModelState(target, keep_hidden=True)
    tokens = [(7 * i) % vocab for i in range(context)]
    hidden = state.prefill(tokens)
    cache = head.make_cache()
    _, hid = head.step(mx.array(tokens[1:], mx.uint32), hidden[:-1], cache)
    mx.eval(hid)
    token = mx.array([5 % vocab], mx.uint32)
    last = hid[-1:]

    def run():
        mx.eval(head.step(token, last, cache, step=1))
        for c in cache:
            c.trim(1)

    run()
    return _median_time(run, reps) / _one_token_time(target, context, reps, vocab)


def acceptance(spec, drafter: str, prompt: str, max_tokens: int, cost=None) -> dict:
    """Run the engine at fixed depth TUNE_DEPTH, gates off, greedy; per-position counts."""
    from .engine.sampling import SamplingParams
    from .engine.speculate import SpeculativeDecoder

    head = spec.mtp_head()[0] if drafter == "mtp" else None
    decoder = SpeculativeDecoder(
        spec.target.model, draft_model=spec.draft.model if spec.draft else None, mtp_head=head,
        drafter=drafter, depth=TUNE_DEPTH, gates=False, cost=cost)
    ids = spec.encode(prompt)
    stats = None
    for _, stats in decoder.generate(ids, sampling=SamplingParams(), max_tokens=max_tokens,
                                     stop_tokens=set(spec.tokenizer.eos_token_ids)):
        pass
    drafted = list(stats.position_drafted) if stats else []
    accepted = list(stats.position_accepted) if stats else []
    drafted += [0] * (TUNE_DEPTH - len(drafted))
    accepted += [0] * (TUNE_DEPTH - len(accepted))
    return {"position_drafted": drafted[:TUNE_DEPTH], "position_accepted": accepted[:TUNE_DEPTH],
            "tokens": stats.generated_tokens if stats else 0,
            "ran": stats.drafter if stats else "none"}


def depth_speedups(drafted, accepted, cost, draft_cost: float, max_depth: int = TUNE_DEPTH) -> dict[int, float]:
    """Expected speed relative to plain decoding at each depth 1..max_depth (the gate's formula)."""
    from .engine.gates import SpeculationGate

    gate = SpeculationGate(SimpleNamespace(cost_per_token=draft_cost, uses_model=draft_cost > 0),
                           max_depth, cost)
    gate.model.reached = [float(x) for x in drafted[:max_depth]] + [0.0] * (max_depth - len(drafted))
    gate.model.accepted = [float(x) for x in accepted[:max_depth]] + [0.0] * (max_depth - len(accepted))
    return {k: gate.speedup(k) for k in range(1, max_depth + 1)}


def plan(spec) -> list[str]:
    """The drafters that can run with this SpecModel (pld always; draft, mtp when available)."""
    drafters = ["pld"]
    if spec.draft is not None:
        drafters.append("draft")
    if spec.mtp_head()[0] is not None:
        drafters.append("mtp")
    return drafters


def run_tune(spec, *, max_tokens: int = 96, reps: int = 3, context: int = 128,
             on_step: Callable[[str, int, int], None] | None = None, save: bool = True) -> dict:
    """Measure, choose depths and (with ``save``) store the result; returns it (see module doc)."""
    import mlx.core as mx

    from .engine.costs import measure_verify_cost

    drafters = plan(spec)
    total = 2 + len(drafters) * (1 + len(PROMPTS))
    done = 0

    def step(message: str):
        nonlocal done
        if on_step:
            on_step(message, done, total)
        done += 1

    vocab = spec.target.vocab_size
    step("verify cost (1..16 tokens)")
    cost = measure_verify_cost(spec.target.model, widths=WIDTHS, context=context, reps=reps, vocab=vocab)
    curve = {n: round(cost.curve[n], 4) for n in sorted(cost.curve)}

    draft_cost: dict[str, float] = {}
    acc: dict[str, dict] = {}
    for name in drafters:
        step(f"{name}: draft cost")
        if name == "pld":
            draft_cost[name] = 0.0
        elif name == "draft":
            draft_cost[name] = round(draft_model_cost(spec.target.model, spec.draft.model, vocab,
                                                      context, max(reps, 3)), 4)
        else:
            draft_cost[name] = round(mtp_cost(spec.target.model, spec.mtp_head()[0], vocab,
                                              context, max(reps, 3)), 4)
        acc[name] = {}
        for kind, prompt in PROMPTS.items():
            step(f"{name}: acceptance on {kind}")
            acc[name][kind] = acceptance(spec, name, prompt, max_tokens, cost)
            mx.clear_cache()

    step("choosing depths")
    depth: dict[str, dict] = {}
    for name in drafters:
        drafted = [sum(r["position_drafted"][i] for r in acc[name].values()) for i in range(TUNE_DEPTH)]
        accepted = [sum(r["position_accepted"][i] for r in acc[name].values()) for i in range(TUNE_DEPTH)]
        acc[name]["all"] = {"position_drafted": drafted, "position_accepted": accepted}
        for row in acc[name].values():
            row["rates"] = [round(a / d, 4) if d else None
                            for a, d in zip(row["position_accepted"], row["position_drafted"])]
        if not any(drafted):  # nothing to go on: the engine keeps its own default
            depth[name] = {"depth": None, "speedup": None, "speedups": {},
                           "note": "no drafts were made on the tune prompts"}
            continue
        speedups = depth_speedups(drafted, accepted, cost, draft_cost[name])
        best = max(speedups, key=lambda k: speedups[k])
        depth[name] = {"depth": best, "speedup": round(speedups[best], 4),
                       "speedups": {str(k): round(s, 4) for k, s in speedups.items()}}

    machine = dict(_MACHINE) if _MACHINE else machine_info()
    result = {
        "version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "model": model_info(spec.target),
        "draft_model": model_info(spec.draft) if spec.draft is not None else None,
        "mlx": _version("mlx"),
        "tune_depth": TUNE_DEPTH,
        "max_tokens": max_tokens,
        "verify_cost": {str(n): c for n, c in curve.items()},
        "draft_cost": draft_cost,
        "acceptance": acc,
        "depth": depth,
    }
    if save:
        path = result_path(spec.target)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
        result["path"] = str(path)
    step("done")
    return result


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


# -- showing ---------------------------------------------------------------------------

BARS = " ▏▎▍▌▋▊▉█"


def bar(value: float, top: float, width: int = 24) -> str:
    """A Unicode bar of ``value`` on a scale where ``top`` fills ``width`` cells."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(min(value / top, 1.0) * width * 8)
    return "█" * (eighths // 8) + (BARS[eighths % 8] if eighths % 8 else "")


def render(result: dict, console, chart: bool = True) -> None:
    """Rich tables of the result, and a bar chart of relative tok/s per depth."""
    from rich.table import Table

    costs = Table(title="verify cost (relative to 1 token)", title_justify="left")
    costs.add_column("tokens", justify="right")
    costs.add_column("cost", justify="right")
    for n, c in result["verify_cost"].items():
        costs.add_row(n, f"{c:.2f}")

    summary = Table(title="drafters", title_justify="left")
    for col in ("drafter", "draft cost", "accept/position (1..8)", "depth", "speed vs plain"):
        summary.add_column(col, justify="left" if col.startswith(("drafter", "accept")) else "right")
    for name, d in result["depth"].items():
        rates = result["acceptance"][name]["all"]["rates"]
        shown = " ".join("-" if r is None else f"{r:.2f}" for r in rates)
        summary.add_row(name, f"{result['draft_cost'][name]:.3f}", shown,
                        "-" if d["depth"] is None else str(d["depth"]),
                        "-" if d["speedup"] is None else f"{d['speedup']:.2f}x")
    console.print(costs)
    console.print(summary)
    if not chart:
        return
    for name, d in result["depth"].items():
        speedups = {int(k): v for k, v in d["speedups"].items()}
        if not speedups:
            console.print(f"[bold]{name}[/bold]: {d.get('note', 'no data')}")
            continue
        top = max(max(speedups.values()), 1.0)
        console.print(f"[bold]{name}[/bold]: relative tok/s by depth (plain = 1.00)")
        for k, s in speedups.items():
            mark = " ◀" if k == d["depth"] else ""
            console.print(f"  {k:>2} {s:5.2f} {bar(s, top)}{mark}", highlight=False)
