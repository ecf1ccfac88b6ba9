"""Proof that a process runs stock mlx-lm: what :func:`mlxspec.kernels.install` would have
changed, read back from the live process.

``kernels.install`` changes mlx-lm in three ways, all process-wide or model-wide: it rebinds
``gated_delta_update`` in mlx-lm's Qwen3.5 / Qwen3-Next modules, rebinds
``scaled_dot_product_attention`` in every mlx-lm model module a model's layers come from, and
swaps the class of eligible quantized layers. :func:`evidence` checks each, plus anything else of
mlxspec's bound into an ``mlx`` / ``mlx_lm`` module:

- ``kernels_imported``: no ``mlxspec.kernels*`` module was ever imported in the process;
- ``originals``: each function ``kernels.install`` replaces, as the mlx-lm module that calls it
  sees it now, is defined by mlx-lm (``__module__``, ``__qualname__``) and its code object equals
  the one compiled afresh from that mlx-lm module's source file (a fresh import, without running
  it);
- ``foreign_bindings``: no attribute of any loaded ``mlx*`` / ``mlx_lm*`` module is a function or
  class defined in mlxspec;
- ``foreign_layers``: no layer of the models run is of a class defined in mlxspec, except the
  bench's scripting (``scripted_layers``: the scripted target's body and head, which the baseline
  and mlxspec's engines both run: the outputs must follow the script for both).

Imports only the standard library: the stock process imports it before anything of mlx-lm's runs.
"""

from __future__ import annotations

import importlib
import sys

# (module whose callers use it, attribute): what kernels.install rebinds by name
GDN_USERS = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")
SDPA = "scaled_dot_product_attention"
SCRIPTING = "mlxspec.bench.scripted"  # the scripted target's classes: the bench's, not kernels


def _ours(obj) -> bool:
    name = getattr(obj, "__module__", None) or ""
    return name == "mlxspec" or name.startswith("mlxspec.")


def _find_code(code, name: str, line: int):
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            if const.co_name == name and const.co_firstlineno == line:
                return const
            found = _find_code(const, name, line)
            if found is not None:
                return found
    return None


def fresh_code(fn):
    """``fn``'s code object compiled afresh from the source file of the module that defines it
    (None if it cannot be found there)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    code = getattr(fn, "__code__", None)
    if not path or code is None:
        return None
    with open(path, encoding="utf-8") as f:
        compiled = compile(f.read(), path, "exec", dont_inherit=True)
    return _find_code(compiled, code.co_name, code.co_firstlineno)


def check_original(module_name: str, attr: str) -> dict:
    """Where ``module_name.attr`` points now, and whether that is mlx-lm's own function."""
    live = getattr(sys.modules[module_name], attr)
    defined_in = getattr(live, "__module__", None) or ""
    qualname = getattr(live, "__qualname__", "?")
    owner = sys.modules.get(defined_in)
    original = (defined_in.startswith("mlx_lm.") and getattr(owner, qualname, None) is live
                and fresh_code(live) == getattr(live, "__code__", None))
    return {"name": f"{module_name}.{attr}", "module": defined_in, "qualname": qualname, "original": original}


def originals() -> list[dict]:
    """:func:`check_original` of every function ``kernels.install`` replaces: the GatedDeltaNet
    recurrence in its users (imported here if needed) and the attention in every loaded mlx-lm
    model module that imported it."""
    out = []
    for name in GDN_USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an mlx-lm without the model: nothing there to replace
            continue
        if getattr(module, "gated_delta_update", None) is not None:
            out.append(check_original(name, "gated_delta_update"))
    for name in sorted(sys.modules):
        if name.startswith("mlx_lm.models.") and getattr(sys.modules[name], SDPA, None) is not None:
            out.append(check_original(name, SDPA))
    return out


def foreign_bindings() -> list[str]:
    """"module.attr -> defining module.qualname" for every mlxspec function or class bound in a
    loaded mlx / mlx_lm module."""
    out = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name in ("mlx", "mlx_lm") or name.startswith(("mlx.", "mlx_lm."))):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and _ours(value):
                out.append(f"{name}.{attr} -> {value.__module__}.{getattr(value, '__qualname__', '?')}")
    return out


def layer_classes(models) -> tuple[list[str], list[str]]:
    """(mlxspec classes among the models' layers other than the bench's scripting, the scripting
    classes), each "path: module.class"."""
    foreign, scripting = [], []
    for model in models:
        for path, module in model.named_modules():
            cls = type(module)
            if _ours(cls):
                entry = f"{path or '.'}: {cls.__module__}.{cls.__qualname__}"
                (scripting if cls.__module__ == SCRIPTING else foreign).append(entry)
    return foreign, scripting


def evidence(models=()) -> dict:
    """The checks above, with ``stock`` true only when every one passes."""
    loaded = sorted(m for m in sys.modules if m == "mlxspec" or m.startswith("mlxspec."))
    kernels = [m for m in loaded if m == "mlxspec.kernels" or m.startswith("mlxspec.kernels.")]
    checked = originals()
    bindings = foreign_bindings()
    foreign, scripting = layer_classes(models)
    stock = not kernels and not bindings and not foreign and all(c["original"] for c in checked)
    return {"stock": stock, "kernels_imported": kernels, "originals": checked,
            "foreign_bindings": bindings, "foreign_layers": foreign, "scripted_layers": scripting,
            "mlxspec_modules": loaded}


def failures(ev: dict) -> list[str]:
    """Why ``ev`` is not stock, one line each (empty when it is)."""
    out = [f"imported {m}" for m in ev["kernels_imported"]]
    out += [f"{c['name']} is {c['module']}.{c['qualname']}, not mlx-lm's own" for c in ev["originals"]
            if not c["original"]]
    out += [f"bound: {b}" for b in ev["foreign_bindings"]]
    out += [f"layer {f}" for f in ev["foreign_layers"]]
    return out
