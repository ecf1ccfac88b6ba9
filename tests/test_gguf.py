"""GGUF import: files written by the gguf package's own writer (tests/gguf_writer.py) in each
supported type convert to checkpoints with the logits of the weights the file holds; broken
files are one line; Ollama / LM Studio stores are found and never written to."""

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
import gguf_writer  # noqa: E402
from mlxspec.errors import InvalidCheckpointError, ModelNotFoundError  # noqa: E402
from mlxspec.models.gguf import convert_gguf  # noqa: E402

PROMPT = [5, 17, 42, 99, 200, 311, 7, 8, 64, 128]


def _logits(folder, float32=True):
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder))
    if float32:
        model.set_dtype(mx.float32)
    return np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))


def _reference(tmp_path, source, decoded):
    """SOURCE with its weights replaced by what the GGUF holds (float32): the exact target."""
    import mlx.core as mx

    ref = tmp_path / "reference"
    ref.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ref / name).write_bytes((source / name).read_bytes())
    mx.save_safetensors(str(ref / "model.safetensors"), {k: mx.array(v) for k, v in decoded.items()})
    return ref


@pytest.fixture(scope="module")
def sources(tmp_path_factory, shared_tokenizer):
    out = {}
    for model_type in ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"):
        config = gguf_writer.model_config(model_type, 512)
        out[model_type] = gguf_writer.random_checkpoint(
            tmp_path_factory.mktemp(model_type), config, shared_tokenizer, seed=len(out))
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_f32_gguf_round_trips_to_the_safetensors_logits(tmp_path, sources, model_type):
    source = sources[model_type]
    gguf_writer.write_gguf(source, tmp_path / "m.gguf", "F32")
    result = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert result.model_type == model_type and result.kept_quantized == 0
    np.testing.assert_allclose(_logits(tmp_path / "out"), _logits(source), atol=2e-4, rtol=1e-4)
    from transformers import AutoTokenizer

    text = "Hello, World! déjà vu 12345 <|im_end|> def f(x):\n    return x"
    ours, theirs = AutoTokenizer.from_pretrained(tmp_path / "out"), AutoTokenizer.from_pretrained(source)
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_quantized_gguf_keeps_its_quantization_exactly(tmp_path, sources, model_type, qtype):
    source = sources[model_type]
    decoded = gguf_writer.write_gguf(source, tmp_path / "m.gguf", qtype)
    result = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if qtype == "F16":
        assert "quantization" not in config
    else:
        assert config["quantization"]["bits"] == (8 if qtype == "Q8_0" else 4)
        assert config["quantization"]["group_size"] == 32
        assert result.kept_quantized > 0 and result.requantized == 0 and not result.notes
    if qtype != "F16":  # a quantized file's float tensors (norms) are stored in float16, as MLX computes
        decoded = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 1 else v for k, v in decoded.items()}
    ours = _logits(tmp_path / "out")
    np.testing.assert_allclose(ours, _logits(_reference(tmp_path, source, decoded)), atol=2e-3, rtol=1e-3)
    # and near the unquantized source: the quantization error, nothing more
    correlation = np.corrcoef(ours.ravel(), _logits(source).ravel())[0, 1]
    assert correlation > (0.99 if qtype in ("F16", "Q8_0") else 0.8)


def _q4k_gguf(tmp_path, source):
    """SOURCE's 2-D weights replaced by random (well-scaled) Q4_K / Q6_K blocks: gguf cannot
    write K-quants, but any block bytes are a valid tensor. Returns the decoded weights."""
    import gguf
    import mlx.core as mx

    rng = np.random.default_rng(3)
    decoded = {}
    for name, value in mx.load(str(source / "model.safetensors")).items():
        if value.ndim != 2:
            continue
        qtype = gguf.GGMLQuantizationType.Q6_K if "down_proj" in name else gguf.GGMLQuantizationType.Q4_K
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = value.shape
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        scale = np.full((rows, cols // block), 0.02 / np.sqrt(cols), np.float16).view(np.uint8)
        for offset in ([0, 2] if qtype == gguf.GGMLQuantizationType.Q4_K else [208]):
            raw[..., offset:offset + 2] = scale.reshape(rows, cols // block, 2)
        decoded[name] = (raw.reshape(rows, -1), qtype)
    return decoded


def test_k_quants_are_dequantized_and_requantized_with_a_note(tmp_path, shared_tokenizer):
    """Q4_K / Q6_K (Ollama's Q4_K_M mix): decoded with gguf's reference decoder (mx.load's Q4_K
    decoding is wrong) and re-quantized to MLX 4 / 8-bit; the logits follow the file's weights."""
    import gguf
    from gguf.quants import dequantize

    config = gguf_writer.model_config("qwen3", 512, hidden=256, intermediate=256)
    source = gguf_writer.random_checkpoint(tmp_path / "src", config, shared_tokenizer, seed=5)
    blocks = _q4k_gguf(tmp_path, source)
    writer_file = tmp_path / "k.gguf"
    full = gguf_writer.write_gguf(source, tmp_path / "f32.gguf", "F32")
    # rewrite with the K-quant blocks for every 2-D tensor
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2)
    writer = gguf.GGUFWriter(str(writer_file), "qwen3")
    reader = gguf.GGUFReader(str(tmp_path / "f32.gguf"))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    decoded = dict(full)
    for name, value in sorted(full.items()):
        stem, _, suffix = name.rpartition(".")
        target = f"{names.get_name(stem)}.{suffix}"
        if name in blocks:
            raw, qtype = blocks[name]
            writer.add_tensor(target, raw, raw_dtype=qtype)
            decoded[name] = dequantize(raw, qtype).reshape(value.shape)
        else:
            writer.add_tensor(target, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    result = convert_gguf(writer_file, tmp_path / "out")
    assert result.requantized == len(blocks) and result.kept_quantized == 0
    assert any("Q4_K" in note and "Q6_K" in note and "re-quantized" in note for note in result.notes)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    ours = _logits(tmp_path / "out")
    ref = _logits(_reference(tmp_path, source, decoded))
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.98


def _tiny_gguf(tmp_path, sources, qtype="Q4_0"):
    gguf_writer.write_gguf(sources["qwen3"], tmp_path / "m.gguf", qtype)
    return tmp_path / "m.gguf"


def test_truncated_gguf_is_one_line(tmp_path, sources):
    data = _tiny_gguf(tmp_path, sources).read_bytes()
    for cut, expected in ((len(data) - 100, "truncated or corrupt"), (2000, "truncated"), (3, "not a GGUF")):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(InvalidCheckpointError, match=expected) as err:
            convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")
        assert "\n" not in str(err.value)


def test_lying_gguf_is_one_line(tmp_path, sources):
    """A header claiming a huge string, or a tensor placed past the end of the file."""
    data = bytearray(_tiny_gguf(tmp_path, sources).read_bytes())
    lying = bytearray(data)
    lying[24:32] = (1 << 40).to_bytes(8, "little")  # the first key's length
    (tmp_path / "lie.gguf").write_bytes(lying)
    with pytest.raises(InvalidCheckpointError, match="claims"):
        convert_gguf(tmp_path / "lie.gguf", tmp_path / "out")
    from mlxspec.models.gguf_file import read_header

    info = read_header(tmp_path / "m.gguf").tensors["token_embd.weight"]
    # the tensor's offset field: find it in the header (name, dims, type, then the offset)
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 16 + 4
    offset = int.from_bytes(data[at:at + 8], "little")
    assert info.offset - offset > 0
    data[at:at + 8] = (offset + len(data)).to_bytes(8, "little")
    (tmp_path / "lie2.gguf").write_bytes(data)
    with pytest.raises(InvalidCheckpointError, match="token_embd.weight.*ends at byte"):
        convert_gguf(tmp_path / "lie2.gguf", tmp_path / "out")


def test_unsupported_architecture_is_one_line(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidCheckpointError, match=r"'phi3' model; GGUF import supports llama, qwen2"):
        convert_gguf(tmp_path / "phi.gguf", tmp_path / "out")


def test_cli_convert_and_run_a_gguf(tmp_path, sources):
    gguf_file = _tiny_gguf(tmp_path, sources, "Q8_0")
    env = {"MLXSPEC_GGUF_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    cli = [sys.executable, "-m", "mlxspec"]
    done = subprocess.run(cli + ["convert", str(gguf_file), str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "converted m.gguf (qwen3:" in done.stdout and "tensors kept quantized" in done.stdout
    bad = subprocess.run(cli + ["convert", str(gguf_file), str(tmp_path / "o2"), "--q-bits", "4"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --q-bits does not apply to a GGUF source: its quantization is kept"]
    run = subprocess.run(cli + ["run", str(gguf_file), "hello", "--max-tokens", "4", "--drafter", "none",
                                "--temp", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1  # converted once into the cache
    missing = subprocess.run(cli + ["run", str(tmp_path / "nope.gguf")], capture_output=True, text=True,
                             env=env, timeout=60)
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


# -- Ollama and LM Studio stores -------------------------------------------------------------


def _ollama_store(root, name, tag, blob: bytes):
    import hashlib

    digest = hashlib.sha256(blob).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(blob)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
              {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(blob)}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def _snapshot(root):
    return {p: p.stat().st_mtime_ns for p in root.rglob("*")}


def test_ollama_store_lists_and_runs_read_only(tmp_path, sources, monkeypatch):
    from mlxspec.models import stores
    from mlxspec.models.loader import is_model_ref, resolve_model

    store = tmp_path / "ollama"
    _ollama_store(store, "tiny", "q4", _tiny_gguf(tmp_path, sources).read_bytes())
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "cache"))
    before = _snapshot(store)
    assert [m.ref for m in stores.list_ollama()] == ["ollama:tiny:q4"]
    assert is_model_ref("ollama:tiny:q4") and not is_model_ref("ollama:tiny")  # tag latest: absent
    folder, name, _ = resolve_model("ollama:tiny:q4")
    assert name == "ollama:tiny:q4" and (folder / "model.safetensors").is_file()
    assert str(folder).startswith(str(tmp_path / "cache"))
    assert _snapshot(store) == before  # nothing written into Ollama's store
    with pytest.raises(ModelNotFoundError, match="ollama:other:latest is not in Ollama's store"):
        resolve_model("ollama:other")


def test_cli_list_ollama_and_lmstudio(tmp_path, sources):
    gguf_file = _tiny_gguf(tmp_path, sources)
    _ollama_store(tmp_path / "ollama", "tiny", "latest", gguf_file.read_bytes())
    lm = tmp_path / "lmstudio" / "someone" / "tiny-GGUF"
    lm.mkdir(parents=True)
    (lm / "tiny.Q4_0.gguf").write_bytes(gguf_file.read_bytes())
    env = {"OLLAMA_MODELS": str(tmp_path / "ollama"), "MLXSPEC_LMSTUDIO_MODELS": str(tmp_path / "lmstudio"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "mlxspec", "list", "--ollama", "--lmstudio", "--json"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {r["model"]: r for r in json.loads(done.stdout)}
    assert set(rows) == {"ollama:tiny:latest", "lmstudio:someone/tiny-GGUF/tiny.Q4_0.gguf"}
    assert all(r["architecture"] == "qwen3" and r["quantization"] == "Q4_0" for r in rows.values())
    import os

    from mlxspec.models.stores import resolve_lmstudio

    os.environ["MLXSPEC_LMSTUDIO_MODELS"] = str(tmp_path / "lmstudio")
    try:
        assert resolve_lmstudio("someone/tiny-GGUF").name == "tiny.Q4_0.gguf"
    finally:
        del os.environ["MLXSPEC_LMSTUDIO_MODELS"]
    empty = subprocess.run([sys.executable, "-m", "mlxspec", "list", "--ollama"], capture_output=True, text=True,
                           env={**env, "OLLAMA_MODELS": str(tmp_path / "none")}, timeout=60)
    assert empty.returncode == 0 and "no GGUF models in" in empty.stderr


def test_demo_run_says_how_to_get_a_real_model(tmp_path):
    """The toy stays the offline default (SmolLM2 would grow the wheel ~70x: 98 MB against 1.4 MB);
    a run on it names the one command that gets a real model, and the GGUF routes."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLXSPEC_TUNE_DIR": str(tmp_path / "tune")}
    done = subprocess.run([sys.executable, "-m", "mlxspec", "run", "hello", "--max-tokens", "2", "--drafter", "none"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "`mlxspec run qwen3-0.6b --yes`" in done.stderr and "`mlxspec run FILE.gguf`" in done.stderr


def test_sentencepiece_vocabulary_rebuilds_the_tokenizer(tmp_path):
    """tokenizer.ggml.model 'llama' (SentencePiece BPE with byte fallback: Llama 2, Mistral,
    Gemma): merges come back from the scores and encode as the source tokenizer does."""
    from tokenizers import SentencePieceBPETokenizer
    from tokenizers import Tokenizer as HFTokenizer

    import tiny
    from mlxspec.models.gguf_tokenizer import write_tokenizer

    source = SentencePieceBPETokenizer(add_prefix_space=True)
    source.train_from_iterator(tiny.builtin_corpus(), vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                               show_progress=False)
    vocab = source.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    n_bytes = 256
    tokens += [f"<0x{b:02X}>" for b in range(n_bytes)]
    types = [3, 3, 3] + [1] * (len(vocab) - 3) + [6] * n_bytes
    scores = [0.0, 0.0, 0.0] + [-float(i) for i in range(3, len(vocab))] + [0.0] * n_bytes
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True}
    write_tokenizer(metadata, tmp_path)
    rebuilt = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ("The quick brown fox jumps over the lazy dog.", "Speculative decoding lets a small model guess",
                 "日本 😀 ok"):
        expected = source.encode(text).tokens
        got = rebuilt.encode(text)
        assert got.tokens[0] == "<s>"  # add_bos_token
        if all(ord(c) < 128 for c in text):
            assert got.tokens[1:] == expected
        else:  # characters outside the vocabulary fall back to their UTF-8 bytes
            assert any(t.startswith("<0x") for t in got.tokens)
        assert rebuilt.decode(got.ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_decoders_match_the_gguf_reference(type_name):
    """mlxspec's numpy decoders against the gguf package's (llama.cpp's own Python) on random
    blocks; their f16 scale fields set to finite values."""
    import gguf
    from gguf.quants import dequantize

    from mlxspec.models.gguf_decode import decode

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = 3, 2
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    f16_fields = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                  "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[type_name]
    for at in f16_fields:
        values = rng.uniform(-0.05, 0.05, size=(rows, blocks)).astype(np.float16)
        raw[..., at:at + 2] = values.view(np.uint8).reshape(rows, blocks, 2)
    raw = raw.reshape(rows, blocks * size)
    expected = dequantize(raw, qtype)
    np.testing.assert_array_equal(decode(raw.ravel(), type_name, (rows, blocks * block)), expected)
