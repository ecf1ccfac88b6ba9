"""The mini model family's corpus: Python source found on this machine, split by file.

Sources: the standard library and every site-packages directory of the running ``python3``.
Files are de-duplicated by content and split by a hash of their content, so a file and its
copies always land on the same side: about 1 in 50 is held out and never trained on. The
benchmark prompts (benchmarks/workloads/) are cut from held-out files only, and prose for the
"novel text" workload comes from .txt/.md/.rst files, which training never reads (it reads
.py only).

Part of scripts/train_mini.py (see its docstring for the command); no MLX needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import site
import sys
import sysconfig
import tarfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import PAD_TOKEN, train_tokenizer  # noqa: E402  (numpy-only module)

HELD_OUT_EVERY = 50  # one file in this many (by content hash) is held out
MIN_BYTES, MAX_BYTES = 256, 256 * 1024
PROSE_SUFFIXES = (".txt", ".md", ".rst")
EDIT_MARKER = "\n# --- edited copy ---\n"  # the echo/edit document format (see edit_document)
IDENT = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")


def source_roots() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
        if Path(p).is_dir():
            roots.append(Path(p))
    out: list[Path] = []
    for r in roots:
        r = r.resolve()
        if not any(r == o or o in r.parents for o in out):
            out = [o for o in out if r not in o.parents] + [r]
    return sorted(out)


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def is_held_out(digest: str) -> bool:
    return int(digest[:8], 16) % HELD_OUT_EVERY == 0


def collect(roots: list[Path], suffixes: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(relative path, digest, text) of unique UTF-8 files with SUFFIXES, sorted by path."""
    seen: set[str] = set()
    files = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix not in suffixes or not path.is_file() or path.is_symlink():
                continue
            try:
                size = path.stat().st_size
                if not MIN_BYTES <= size <= MAX_BYTES:
                    continue
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = _digest(data)
            if digest in seen or "\x00" in text:
                continue
            seen.add(digest)
            files.append((f"{root.name}/{path.relative_to(root)}", digest, text))
    return files


def edit_document(text: str, rng: random.Random, max_chars: int = 1500) -> str | None:
    """SNIPPET + marker + the snippet again with one identifier renamed: what an agent's edit of
    a file looks like. Teaches the model to copy (as real chat models do on edit requests)."""
    snippet = text[:max_chars]
    cut = snippet.rfind("\n")
    snippet = snippet[: cut + 1] if cut > 200 else snippet
    names = sorted({m for m in IDENT.findall(snippet) if snippet.count(m) >= 2})
    if not names:
        return None
    old = rng.choice(names)
    new = rng.choice([old + "_new", "new_" + old, old.rstrip("s") + "_value", old.upper()])
    edited = re.sub(rf"\b{re.escape(old)}\b", new, snippet)
    return snippet + EDIT_MARKER + edited


def split_code(code: list, max_train_mb: float, edit_fraction: float, rng: random.Random) -> tuple[list, list, list]:
    """The training files (shuffled, up to MAX_TRAIN_MB), the held-out ones, and edited copies
    of about EDIT_FRACTION of the training files; RNG is advanced as build() always did."""
    train = [f for f in code if not is_held_out(f[1])]
    held = [f for f in code if is_held_out(f[1])]
    rng.shuffle(train)
    budget, kept = max_train_mb * 1e6, []
    for f in train:
        if budget <= 0:
            break
        kept.append(f)
        budget -= len(f[2])
    edits = [d for f in kept if rng.random() < edit_fraction for d in [edit_document(f[2], rng)] if d]
    return kept, held, edits


def encode_documents(tok, texts: list[str], eos: int, path: Path) -> np.ndarray:
    """TEXTS tokenized (no special tokens), each followed by EOS, written to PATH as uint16."""
    ids: list[int] = []
    for i in range(0, len(texts), 2048):
        for enc in tok.encode_batch(texts[i : i + 2048], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(path)
    return arr


def build(work: Path, vocab_size: int, max_train_mb: float, edit_fraction: float, seed: int) -> dict:
    """Collect, split, train the tokenizer, tokenize: writes WORK/{tokenizer,train.bin,heldout.bin,...}."""
    from tokenizers import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    roots = source_roots()
    code = collect(roots, (".py",))
    prose = collect(roots, PROSE_SUFFIXES)
    rng = random.Random(seed)
    kept, held, edits = split_code(code, max_train_mb, edit_fraction, rng)
    # Tokenizer: trained on a slice of the training side only.
    sample = [t for _, _, t in kept[:4000]]
    train_tokenizer(sample, vocab_size, work / "tokenizer")
    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id(PAD_TOKEN)  # <|endoftext|> separates documents, as in Qwen pretraining

    docs = [t for _, _, t in kept] + edits
    rng.shuffle(docs)
    n_train = len(encode_documents(tok, docs, eos, work / "train.bin"))
    n_held = len(encode_documents(tok, [t for _, _, t in held], eos, work / "heldout.bin"))
    manifest = {
        "roots": [str(r) for r in roots], "python": sys.version.split()[0],
        "code_files": len(code), "prose_files": len(prose), "train_files_used": len(kept),
        "train_mb": round(sum(len(f[2]) for f in kept) / 1e6, 1), "edit_documents": len(edits),
        "heldout_files": len(held), "train_tokens": n_train, "heldout_tokens": n_held,
        "vocab_size": tok.get_vocab_size(), "held_out_rule": f"sha1(content) % {HELD_OUT_EVERY} == 0",
        "seed": seed,
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2))
    _pack_heldout(work / "heldout_sample.tar.gz", held, prose, rng)
    return manifest


def _pack_heldout(path: Path, held, prose, rng: random.Random, n_code: int = 80, n_prose: int = 40) -> None:
    """A sample of held-out files for building workloads on machines without this corpus."""
    code = [f for f in held if 2000 <= len(f[2]) <= 40000]
    text = [f for f in prose if 1500 <= len(f[2]) <= 40000 and not f[0].endswith("LICENSE.txt")]
    picks = rng.sample(code, min(n_code, len(code))) + rng.sample(text, min(n_prose, len(text)))
    index = []
    with tarfile.open(path, "w:gz") as tar:
        for i, (rel, digest, body) in enumerate(picks):
            name = f"heldout/{i:03d}{Path(rel).suffix}"
            data = body.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            index.append({"file": name, "source": rel, "sha1": digest})
        data = json.dumps(index, indent=1).encode()
        info = tarfile.TarInfo("heldout/index.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
