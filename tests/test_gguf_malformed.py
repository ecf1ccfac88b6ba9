"""GGUF files whose metadata contradicts their tensors (issue 33): each is refused in one line
naming the key and the numbers that disagree, before anything is written: no output folder,
no staging folder, no cache entry. Built by rewriting a small valid llama file (tests/gguf_writer.py)
with the gguf package, or by patching its header bytes where the writer refuses (duplicates)."""

import struct
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
import gguf_writer  # noqa: E402
from mlxspec.errors import InvalidCheckpointError, UsageError  # noqa: E402
from mlxspec.models.gguf import convert_gguf  # noqa: E402
from mlxspec.models.gguf_cache import cached_conversion  # noqa: E402

KEY_LENGTH = "llama.attention.key_length"


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory, shared_tokenizer):
    """llama, hidden 64, 2 blocks, 4 heads (2 kv) of 16, F32."""
    folder = tmp_path_factory.mktemp("valid")
    config = gguf_writer.model_config("llama", 512)
    source = gguf_writer.random_checkpoint(folder / "src", config, shared_tokenizer)
    gguf_writer.write_gguf(source, folder / "m.gguf", "F32")
    return folder / "m.gguf"


def _rewrite(source, out, metadata=None, drop=(), replace=None):
    """SOURCE copied to OUT with METADATA keys set (None: removed), tensors in DROP left out and
    those in REPLACE given new data."""
    import gguf

    metadata, replace = metadata or {}, replace or {}
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in metadata:
            continue
        vtype = field.types[0]
        sub = {"sub_type": field.types[-1]} if vtype == gguf.GGUFValueType.ARRAY else {}
        writer.add_key_value(field.name, field.contents(), vtype, **sub)
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int) and value >= 1 << 32:
            writer.add_uint64(key, value)
        elif value is not None:
            writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            data = replace.get(tensor.name, np.array(tensor.data))
            writer.add_tensor(tensor.name, data, raw_shape=data.shape if data.size == 0 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _refused(tmp_path, gguf_file, expected, error=InvalidCheckpointError):
    """Converting GGUF_FILE fails with one line matching EXPECTED and leaves nothing beside it."""
    before = set(tmp_path.iterdir())
    with pytest.raises(error, match=expected) as err:
        convert_gguf(gguf_file, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert set(tmp_path.iterdir()) == before  # no out/, no .out.partial-PID
    return str(err.value)


METADATA_CASES = {
    "block_count 3000": ({"llama.block_count": 3000}, (),
                         r"llama\.block_count is 3,000 but the file holds tensors for 2 blocks"),
    "block_count 100000": ({"llama.block_count": 100_000}, (), r"block_count is 100,000 but .* 2 blocks"),
    "block_count 1": ({"llama.block_count": 1}, (), r"block_count is 1 but the file holds tensors for 2 blocks"),
    "missing block tensor": ({}, ("blk.1.ffn_up.weight",), r"block 1 has no tensor blk\.1\.ffn_up\.weight"),
    "head_count 7": ({"llama.attention.head_count": 7, KEY_LENGTH: None}, (),
                     r"head_count 7 does not divide llama\.embedding_length 64"),
    "head_count 7, head size 16": ({"llama.attention.head_count": 7}, (),
                                   r"head_count_kv 2 does not divide llama\.attention\.head_count 7"),
    "head_count 8, head size 16": ({"llama.attention.head_count": 8}, (),
                                   r"'blk\.0\.attn_output\.weight' is 64 x 64 but .*head_count 8 x head size 16.* "
                                   r"implies 64 x 128"),
    "head_count_kv 0": ({"llama.attention.head_count_kv": 0}, (), r"head_count_kv 0; it must be a positive"),
    "head_count_kv 3": ({"llama.attention.head_count_kv": 3}, (),
                        r"head_count_kv 3 does not divide llama\.attention\.head_count 4"),
    "odd head size": ({KEY_LENGTH: 15}, (), r"head size of 15 .*even"),
    "embedding_length 96": ({"llama.embedding_length": 96}, (),
                            r"attn_k\.weight' is 32 x 64 but .*embedding_length 96\) implies 32 x 96"),
    "feed_forward_length 100": ({"llama.feed_forward_length": 100}, (),
                                r"'blk\.0\.ffn_down\.weight' is 64 x 128 .*feed_forward_length 100.* implies 64 x 100"),
    "no output_norm": ({}, ("output_norm.weight",), r"has no output_norm\.weight tensor"),
    # values the config takes as they are: zero or absurd context, a vocabulary that disagrees
    "context_length 0": ({"llama.context_length": 0}, (),
                         r"llama\.context_length 0; it must be a number of tokens from 1 to 16,777,216"),
    "context_length 2**32-1": ({"llama.context_length": (1 << 32) - 1}, (), r"context_length 4294967295; it must"),
    "context_length 2**40": ({"llama.context_length": 1 << 40}, (), r"context_length 1099511627776; it must"),
    "sliding_window 0": ({"llama.attention.sliding_window": 0}, (), r"sliding_window 0; it must be a number"),
    "rope.freq_base 0": ({"llama.rope.freq_base": 0.0}, (), r"llama\.rope\.freq_base 0\.0; it must be a positive"),
    "rms epsilon nan": ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, (),
                        r"layer_norm_rms_epsilon nan; it must be a number between 0 and 1"),
    "vocab_size 1000": ({"llama.vocab_size": 1000}, (),
                        r"llama\.vocab_size 1000 but tensor 'token_embd\.weight' has 512 rows"),
    "tokens 500": ({"tokenizer.ggml.tokens": [f"t{i}" for i in range(500)]}, (),
                   r"the tokenizer has 500 tokens \(tokenizer\.ggml\.tokens\) but tensor 'token_embd\.weight' "
                   r"has 512 rows"),
    "token_type 10": ({"tokenizer.ggml.token_type": [1] * 10}, (), r"tokenizer\.ggml\.token_type of 10 values for 512"),
    "eos id 1000000": ({"tokenizer.ggml.eos_token_id": 1_000_000}, (),
                       r"tokenizer\.ggml\.eos_token_id 1000000, not a token of its 512"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_contradicting_the_tensors_is_one_line(tmp_path, valid_gguf, case):
    metadata, drop, expected = METADATA_CASES[case]
    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", metadata, drop)
    _refused(tmp_path, bad, expected)


def test_output_rows_other_than_the_embeddings_are_one_line(tmp_path, valid_gguf):
    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", replace={"output.weight": np.zeros((500, 64), np.float32)})
    _refused(tmp_path, bad, r"'output\.weight' has 500 rows \(tokens\) but 'token_embd\.weight' has 512")


def test_run_of_a_huge_context_length_leaves_no_cache_entry(tmp_path, valid_gguf, monkeypatch):
    """A lying context_length is refused before anything is converted, not clamped and kept."""
    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", {"llama.context_length": 1 << 40})
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidCheckpointError, match="context_length 1099511627776"):
        cached_conversion(bad)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("shape", [(0, 64), (1 << 40, 0)])
def test_zero_size_tensor_is_one_line(tmp_path, valid_gguf, shape):
    """An empty tensor has no bytes to check against the file, whatever its other dimension."""
    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", replace={"blk.1.attn_v.weight": np.zeros(shape, np.float32)})
    _refused(tmp_path, bad, r"tensor 'blk\.1\.attn_v\.weight' has a zero-size dimension")


def test_duplicate_tensor_name_is_one_line(tmp_path, valid_gguf):
    data = valid_gguf.read_bytes()
    original, twin = b"blk.1.attn_q.weight", b"blk.0.attn_q.weight"
    assert data.count(original) == 1
    (tmp_path / "bad.gguf").write_bytes(data.replace(original, twin))
    _refused(tmp_path, tmp_path / "bad.gguf", r"names tensor 'blk\.0\.attn_q\.weight' twice")


def test_deeply_nested_metadata_arrays_are_one_line(tmp_path):
    """5,000 arrays each holding the next: refused while reading, not a RecursionError."""
    key = b"general.nested"
    depth = 5000
    body = (struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0))
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + body
    (tmp_path / "nested.gguf").write_bytes(header)
    _refused(tmp_path, tmp_path / "nested.gguf", r"metadata arrays nested more than \d+ deep")


def test_item_count_past_the_end_of_the_file_is_one_line(tmp_path):
    """A count below the global ceiling but larger than the bytes left: a lie, refused at once."""
    key = b"general.list"
    body = struct.pack("<IIQ", 9, 9, 1 << 20)  # a million arrays, in a file of a few dozen bytes
    (tmp_path / "short.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
                                          + struct.pack("<Q", len(key)) + key + body)
    _refused(tmp_path, tmp_path / "short.gguf", r"metadata array claims 1,048,576 items")


@pytest.mark.parametrize("length", [300, 250])
def test_too_long_output_name_is_one_line(tmp_path, valid_gguf, length):
    """300 bytes: the file system refuses the name itself; 250: it refuses the staging folder's."""
    with pytest.raises(UsageError, match=r"output path has a name of \d+ bytes") as err:
        convert_gguf(valid_gguf, tmp_path / ("a" * length))
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_too_long_gguf_name_for_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidCheckpointError, match="cannot use GGUF file .*too long"):
        cached_conversion(tmp_path / ("a" * 300 + ".gguf"))


def test_too_long_gguf_cache_path_is_one_line(tmp_path, valid_gguf, monkeypatch):
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / ("c" * 300)))
    with pytest.raises(UsageError, match=r"cannot use the GGUF cache .*MLXSPEC_GGUF_CACHE.*too long") as err:
        cached_conversion(valid_gguf)
    assert "\n" not in str(err.value)


def test_run_of_a_lying_file_leaves_no_cache_entry(tmp_path, valid_gguf, monkeypatch):
    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", {"llama.block_count": 20_000})
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidCheckpointError, match="block_count is 20,000"):
        cached_conversion(bad)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_cli_convert_of_a_lying_file_exits_non_zero_in_one_line(tmp_path, valid_gguf, monkeypatch, capsys):
    from mlxspec.cli import main

    bad = _rewrite(valid_gguf, tmp_path / "bad.gguf", {"llama.attention.head_count_kv": 0})
    monkeypatch.setattr(sys, "argv", ["mlxspec", "convert", str(bad), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "head_count_kv 0" in lines[0]
    assert "internal error" not in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
