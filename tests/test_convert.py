"""`mlxspec convert`: mlx-lm's conversion of the trunk, plus the MTP head it would drop."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import tiny
import tiny_mtp
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import MlxspecError, UsageError
from mlxspec.models.convert import SIDECAR, convert_checkpoint
from mlxspec.models.mtp import load_mtp_head
from mlxspec.models.mtp.weights import find_mtp_weights

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):\n    return a + b\n\ndef"
N = 32


def _load(path):
    model, tok, config = mlx_lm.load(str(path), return_config=True)
    return model, tok, load_mtp_head(model, path, config)


def _greedy(model, prompt, n=N):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def _head_logits(head, hidden_size):
    hidden = mx.random.normal((5, hidden_size), key=mx.random.key(0))
    tokens = mx.array([3, 4, 5, 6, 7], mx.uint32)
    logits, _ = head.step(tokens, hidden, head.make_cache())
    return logits


def _mtp_output(model, head, prompt, depth=2):
    dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=depth, gates=False)
    return [t for toks, _ in dec.generate(prompt, max_tokens=N) for t in toks]


def _cli(*args, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    env.pop("MLXSPEC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "mlxspec", "convert", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def _cli_here(capsys, monkeypatch, *args):
    """`mlxspec convert ARGS` in this process, through the console script's own entry point
    (cli.main: its exit codes, its one-line errors), as _cli's environment has it. Each test
    keeps one run through a real process (_cli), as test_cli_source_without_head does; the rest
    here save a process start (mlx and mlxspec imported again) each."""
    from mlxspec.cli import main

    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLXSPEC_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["mlxspec", "convert", *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, code, out, err)


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def source(tiny_qwen3_5):
    return _load(tiny_qwen3_5)


@pytest.fixture(scope="module")
def converted(tiny_qwen3_5, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "fp32"
    result = convert_checkpoint(str(tiny_qwen3_5), out)
    return out, result


def test_unquantized_conversion_is_exact(tiny_qwen3_5, source, converted):
    out, result = converted
    assert result.head_kept and result.head_layers == 1 and result.head_tensors == 15
    assert result.head_bits is None and result.q_bits is None and result.dtype == "float32"
    assert (out / SIDECAR).is_file() and not any(out.parent.glob(".*partial*"))
    config = json.loads((out / "config.json").read_text())
    assert config["mlxspec"]["mtp_sidecar"] == SIDECAR and config["mlxspec"]["mtp_bits"] is None
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    # the sidecar holds mlx-convention norms (+1 once), which find_mtp_weights leaves alone
    found = find_mtp_weights(out, config)
    assert not found.norms_shifted and found.source == SIDECAR

    src_model, tok, src_head = source
    model, _, head = _load(out)
    assert head is not None and len(head.module.layers) == len(src_head.module.layers)
    prompt = tok.encode(PROMPT)
    # the trunk: mlx-lm's converted norms are not shifted again on load
    assert _greedy(model, prompt) == _greedy(src_model, prompt)
    hidden_size = src_model.args.text_config["hidden_size"]
    want = _head_logits(src_head, hidden_size)
    got = _head_logits(head, hidden_size)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    assert _mtp_output(model, head, prompt) == _greedy(src_model, prompt)


def test_quantized_conversion_loads_and_drafts_exactly(tiny_qwen3_5, source, tmp_path):
    out = tmp_path / "q4"
    result = convert_checkpoint(str(tiny_qwen3_5), out, q_bits=4, q_group_size=32)
    assert result.head_kept and result.q_bits == 4 and result.head_bits == 4
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["mlxspec"] == {"mtp_sidecar": SIDECAR, "mtp_family": "qwen3_5", "mtp_num_layers": 1,
                                 "mtp_bits": 4, "mtp_group_size": 32}
    model, tok, head = _load(out)
    assert head is not None and len(head.module.layers) == len(source[2].module.layers)
    assert isinstance(model.language_model.lm_head, nn.QuantizedLinear)
    fc = head.module.fc
    assert isinstance(fc, nn.QuantizedLinear) and (fc.bits, fc.group_size) == (4, 32)
    assert isinstance(head.module.norm, nn.RMSNorm)
    assert abs(float(mx.median(head.module.norm.weight).item()) - 1) < 0.5
    prompt = tok.encode(PROMPT)
    assert _mtp_output(model, head, prompt) == _greedy(model, prompt)


def test_unquantized_head_with_a_quantized_trunk(tiny_qwen3_5, tmp_path):
    out = tmp_path / "q4h"
    result = convert_checkpoint(str(tiny_qwen3_5), out, q_bits=4, q_group_size=32, mtp_bits=0)
    assert result.head_bits is None and result.head_tensors == 15
    model, _, head = _load(out)
    assert isinstance(head.module.fc, nn.Linear) and not isinstance(head.module.fc, nn.QuantizedLinear)


def test_moe_head_is_stacked_and_quantized(shared_tokenizer, tmp_path):
    src = tiny.write_checkpoint(tmp_path / "moe", "qwen3_5_moe", tokenizer=shared_tokenizer, seed=7)
    _, _, src_head = _load(src)
    fp = tmp_path / "moe_fp"
    convert_checkpoint(str(src), fp)
    model, tok, head = _load(fp)
    hidden_size = model.args.text_config["hidden_size"]
    assert mx.allclose(_head_logits(head, hidden_size), _head_logits(src_head, hidden_size), atol=1e-4).item()

    q = tmp_path / "moe_q4"
    convert_checkpoint(str(src), q, q_bits=4, q_group_size=32)
    keys = mx.load(str(q / SIDECAR)).keys()
    assert "mtp.layers.0.mlp.switch_mlp.gate_proj.scales" in keys
    assert "mtp.layers.0.mlp.gate.weight" in keys and "mtp.layers.0.mlp.gate.scales" not in keys
    model, tok, head = _load(q)
    prompt = tok.encode(PROMPT)
    assert _mtp_output(model, head, prompt) == _greedy(model, prompt)

    # Qwen3-Next stores the head's experts one by one: they are stacked into switch_mlp
    split = tmp_path / "moe_split"
    shutil.copytree(src, split)
    weights = dict(mx.load(str(split / "model.safetensors")))
    p = "mtp.layers.0.mlp.experts."
    gate_up, down = weights.pop(p + "gate_up_proj"), weights.pop(p + "down_proj")
    mid = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        weights.update({f"{p}{e}.gate_proj.weight": gate_up[e, :mid], f"{p}{e}.up_proj.weight": gate_up[e, mid:],
                        f"{p}{e}.down_proj.weight": down[e]})
    mx.save_safetensors(str(split / "model.safetensors"), weights, metadata={"format": "pt"})
    split_out = tmp_path / "moe_split_out"
    convert_checkpoint(str(split), split_out)
    model, _, head = _load(split_out)
    assert mx.allclose(_head_logits(head, hidden_size), _head_logits(src_head, hidden_size), atol=1e-4).item()


def test_source_with_a_quantized_head(tiny_qwen3_5, source, tmp_path):
    """An MLX source whose head is quantized: dequantized, or kept at the source's quantization."""
    src = tmp_path / "qsrc"
    shutil.copytree(tiny_qwen3_5, src)
    tiny_mtp.quantize_mtp(src, bits=8, group_size=32)
    _, _, src_head = _load(src)
    hidden_size = source[0].args.text_config["hidden_size"]
    want = _head_logits(src_head, hidden_size)
    for name, options in (("plain", {}), ("q8", {"mtp_bits": 8, "q_group_size": 32})):
        convert_checkpoint(str(src), tmp_path / name, **options)
        _, _, head = _load(tmp_path / name)
        assert mx.allclose(_head_logits(head, hidden_size), want, atol=1e-4, rtol=1e-4).item(), name
    with pytest.raises(UsageError, match="already quantized"):
        convert_checkpoint(str(src), tmp_path / "q4", q_bits=4, q_group_size=32)
    with pytest.raises(UsageError, match="quantized at 8 bits"):
        convert_checkpoint(str(src), tmp_path / "h4", mtp_bits=4, q_group_size=32)


def test_nextn_head_is_copied(tmp_path):
    """GLM / DeepSeek NextN layers go to the sidecar as stored, under their own names."""
    src = tiny_mtp.write_nextn_checkpoint(tmp_path / "glm", "glm4_moe")
    out = tmp_path / "glm_q4"
    result = convert_checkpoint(str(src), out, q_bits=4, q_group_size=32)
    assert result.head_family == "nextn" and result.head_bits is None
    assert any("copied as stored" in note for note in result.notes)
    mlx_lm.load(str(out))
    configs = [json.loads((p / "config.json").read_text()) for p in (src, out)]
    before, after = (find_mtp_weights(p, c) for p, c in zip((src, out), configs))
    assert after.source == SIDECAR and after.num_layers == before.num_layers == 1
    assert after.tensors.keys() == before.tensors.keys()
    assert all(mx.array_equal(after.tensors[k], before.tensors[k]).item() for k in before.tensors)


def test_cli_summary_and_existing_output(tiny_qwen3_5, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    proc = _cli(tiny_qwen3_5, out, "--q-bits", "4", "--q-group-size", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = proc.stdout.strip().splitlines()
    assert len(summary) == 1
    assert str(out) in summary[0] and "MTP head kept" in summary[0] and "15 tensors" not in summary[0]
    assert "1 layer" in summary[0] and "4-bit" in summary[0] and "B," in summary[0]

    before = sorted(p.name for p in out.iterdir())
    again = _cli_here(capsys, monkeypatch, tiny_qwen3_5, out)
    _assert_one_line_error(again, "not empty", "--force")
    assert sorted(p.name for p in out.iterdir()) == before
    # a failed --force run leaves the existing output alone
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    (broken / "model.safetensors").write_bytes(b"")
    _assert_one_line_error(_cli_here(capsys, monkeypatch, broken, out, "--force"), "no_such_arch")
    assert sorted(p.name for p in out.iterdir()) == before

    forced = _cli_here(capsys, monkeypatch, tiny_qwen3_5, out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "15 tensors, unquantized" in forced.stdout
    assert not any(tmp_path.glob(".*partial*"))


def test_cli_source_without_head(tiny_qwen3, tmp_path):
    out = tmp_path / "trunk"
    proc = _cli(tiny_qwen3, out)
    assert proc.returncode == 0, proc.stderr
    assert "no MTP head found; converted the trunk only" in proc.stderr
    assert "no MTP head" in proc.stdout and str(out) in proc.stdout
    assert not (out / SIDECAR).exists()
    model, tok = mlx_lm.load(str(out))
    src, _ = mlx_lm.load(str(tiny_qwen3))
    prompt = tok.encode(PROMPT)
    assert _greedy(model, prompt, 8) == _greedy(src, prompt, 8)


def test_cli_bad_inputs(tmp_path, tiny_qwen3_5, capsys, monkeypatch):
    _assert_one_line_error(_cli(tmp_path / "missing", tmp_path / "o1"), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_one_line_error(_cli_here(capsys, monkeypatch, empty, tmp_path / "o2"), "no config.json")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_qwen3_5, odd)
    config = json.loads((odd / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (odd / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(_cli_here(capsys, monkeypatch, odd, tmp_path / "o3"), "no_such_arch", "does not support")
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))


def test_option_checks(tiny_qwen3_5, tmp_path):
    with pytest.raises(UsageError, match="--q-bits"):
        convert_checkpoint(str(tiny_qwen3_5), tmp_path / "a", q_bits=7)
    with pytest.raises(UsageError, match="--q-group-size"):
        convert_checkpoint(str(tiny_qwen3_5), tmp_path / "a", q_bits=4, q_group_size=48)
    with pytest.raises(UsageError, match="--dtype"):
        convert_checkpoint(str(tiny_qwen3_5), tmp_path / "a", dtype="int8")
    with pytest.raises(UsageError, match="--mtp-bits"):
        convert_checkpoint(str(tiny_qwen3_5), tmp_path / "a", q_bits=4, mtp_bits=8)
    with pytest.raises(MlxspecError, match="overwrite the source"):
        convert_checkpoint(str(tiny_qwen3_5), tiny_qwen3_5.parent, force=True)
    assert not (tmp_path / "a").exists()
