"""Build benchmarks/workloads/*.jsonl from the held-out file sample (never trained on).

    python scripts/make_workloads.py [--sample benchmarks/heldout_sample.tar.gz] [--out benchmarks/workloads]

Each line: {"id", "prompt", "max_tokens", "source"}. Prompts are raw text for the base mini
models (no chat template):
  echo        a held-out code snippet, then the edit marker: the model re-emits the snippet
              (the agent edit pattern; training had 10% such documents, on other files)
  completion  a held-out code file cut at a line boundary: the model continues it
  novel       held-out prose (.rst/.txt/.md: training read .py only): drafts mostly fail
  toolcall    a JSON tool-call transcript over held-out paths, repeated keys, cut mid-call
Deterministic: the same sample gives the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mini_corpus import EDIT_MARKER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 8
MAX_PROMPT_TOKENS = 600


def _read_sample(path: Path) -> tuple[list[dict], dict[str, str]]:
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read().decode("utf-8") for m in tar.getmembers() if m.isfile()}
    return json.loads(files.pop("heldout/index.json")), files


def _cut(text: str, chars: int) -> str:
    """TEXT's first CHARS characters, ending at a line end."""
    head = text[:chars]
    cut = head.rfind("\n")
    return head[: cut + 1] if cut > chars // 3 else head


def _code_files(index, files):
    return [(e, files[e["file"]]) for e in index if e["file"].endswith(".py")]


def echo(index, files, rng):
    picks = [(e, _cut(t, 1500)) for e, t in _code_files(index, files) if len(t) >= 1500]
    return [{"prompt": s + EDIT_MARKER, "max_tokens": 256, "source": e["source"]} for e, s in picks]


def completion(index, files, rng):
    out = []
    for e, text in _code_files(index, files):
        if len(text) >= 3000:
            out.append({"prompt": _cut(text, 1200), "max_tokens": 256, "source": e["source"]})
    return out


def novel(index, files, rng):
    prose = [(e, files[e["file"]]) for e in index if not e["file"].endswith(".py")]
    return [{"prompt": _cut(t, 1000), "max_tokens": 256, "source": e["source"]}
            for e, t in prose if len(t) >= 1500]


def toolcall(index, files, rng):
    paths = [e["source"].split("/", 1)[1] for e in index if e["file"].endswith(".py")]
    out = []
    for i in range(PROMPTS * 2):
        lines = []
        for path in rng.sample(paths, 4):
            start = rng.randrange(1, 200)
            lines.append(json.dumps({"type": "tool_call", "name": "read_file",
                                     "arguments": {"path": path, "start_line": start, "end_line": start + 40}}))
            lines.append(json.dumps({"type": "tool_result", "name": "read_file",
                                     "content": {"path": path, "lines": 40, "ok": True}}))
        prompt = "\n".join(lines) + '\n{"type": "tool_call", "name": "'
        out.append({"prompt": prompt, "max_tokens": 256, "source": "synthetic over held-out paths"})
    return out


WORKLOADS = {"echo": echo, "completion": completion, "novel": novel, "toolcall": toolcall}


def build(sample: Path, out: Path, tokenizer: Path, seed: int = 0) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    index, files = _read_sample(sample)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, make in WORKLOADS.items():
        rng = random.Random(f"{seed}-{name}")
        rows = [r for r in make(index, files, rng) if len(tok.encode(r["prompt"]).ids) <= MAX_PROMPT_TOKENS]
        rng.shuffle(rows)
        rows = rows[:PROMPTS]
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps({"id": f"{name}-{i}", **row}, ensure_ascii=False) + "\n")
        counts[name] = len(rows)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=Path, default=ROOT / "benchmarks/heldout_sample.tar.gz")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/workloads")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "benchmarks/models/mini-hybrid")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(build(a.sample, a.out, a.tokenizer, a.seed)))


if __name__ == "__main__":
    main()
