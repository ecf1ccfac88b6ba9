"""Finding and loading models: local folders, the default/demo model, the HF cache, bad input."""

import json
import shutil

import pytest

from mlxspec.errors import InvalidCheckpointError, MlxspecError, ModelNotFoundError
from mlxspec.models.loader import is_model_ref, load_model, resolve_model


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path, monkeypatch):
    """No user config, no default model and an empty offline HF cache unless a test sets them."""
    monkeypatch.delenv("MLXSPEC_DEFAULT_MODEL", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def one_line_error(exc_type, ref) -> str:
    with pytest.raises(exc_type) as info:
        load_model(ref)
    message = str(info.value)
    assert message and "\n" not in message and len(message) < 400
    return message


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def fake_hf_cache(hub, repo_id, checkpoint, commit="0123456789abcdef0123456789abcdef01234567"):
    """Lay out CHECKPOINT as huggingface_hub stores a downloaded repo."""
    repo_dir = hub / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo_dir / "snapshots" / commit)
    return repo_dir / "snapshots" / commit


def test_local_folder_loads(tiny_llama):
    path, name, is_demo = resolve_model(str(tiny_llama))
    assert path == tiny_llama.resolve() and name == tiny_llama.name and not is_demo
    loaded = load_model(str(tiny_llama))
    assert loaded.path == tiny_llama.resolve() and not loaded.is_demo
    assert loaded.config["model_type"] == "llama"
    assert loaded.vocab_size == 512
    assert loaded.tokenizer.encode("hello")


def test_no_model_means_the_demo():
    demo = pytest.importorskip("mlxspec.models.demo")
    path, name, is_demo = resolve_model(None)
    assert is_demo and name == demo.DEMO_NAME
    assert path == demo.demo_model_path()
    assert resolve_model(demo.DEMO_NAME)[2]


def test_default_model_from_env(tiny_llama, monkeypatch):
    monkeypatch.setenv("MLXSPEC_DEFAULT_MODEL", str(tiny_llama))
    assert resolve_model(None) == (tiny_llama.resolve(), tiny_llama.name, False)


def test_default_model_from_config_file(tiny_qwen3, tmp_path):
    config = tmp_path / "config" / "mlxspec" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"default_model = {json.dumps(str(tiny_qwen3))}\n")
    assert resolve_model(None)[0] == tiny_qwen3.resolve()


def test_bad_config_file_is_one_line(tmp_path):
    config = tmp_path / "config" / "mlxspec" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("default_model = \n")
    with pytest.raises(MlxspecError, match="config file"):
        resolve_model(None)


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_cached_repo_id(tiny_llama, tmp_path, monkeypatch, variable):
    if variable == "HF_HOME":  # the hub cache is then $HF_HOME/hub
        monkeypatch.delenv("HF_HUB_CACHE")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hub = tmp_path / "hub" if variable == "HF_HUB_CACHE" else tmp_path / "hf-home" / "hub"
    snapshot = fake_hf_cache(hub, "someorg/tiny-llama", tiny_llama)
    assert resolve_model("someorg/tiny-llama") == (snapshot, "someorg/tiny-llama", False)
    assert is_model_ref("someorg/tiny-llama")
    loaded = load_model("someorg/tiny-llama")
    assert loaded.name == "someorg/tiny-llama" and loaded.vocab_size == 512


def test_missing_model(tmp_path):
    message = one_line_error(ModelNotFoundError, "someorg/not-downloaded")
    assert "someorg/not-downloaded" in message and "Hugging Face cache" in message
    assert str(tmp_path / "hub") in message
    one_line_error(ModelNotFoundError, str(tmp_path / "no" / "such" / "folder"))
    assert not is_model_ref("Write a haiku about the sea")
    assert not is_model_ref("someorg/not-downloaded")


def test_folder_without_config(tiny_llama, tmp_path):
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "config.json").unlink()
    assert "config.json" in one_line_error(InvalidCheckpointError, str(folder))


@pytest.mark.parametrize("config_text, expected", [
    ('{"hidden_size": 64}', "model_type"),
    ("{not json", "not valid JSON"),
    ('{"model_type": "no_such_architecture"}', "no_such_architecture"),
])
def test_bad_config(tiny_llama, tmp_path, config_text, expected):
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "config.json").write_text(config_text)
    assert expected in one_line_error(InvalidCheckpointError, str(folder))


def test_no_weights(tiny_llama, tmp_path):
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    assert "safetensors" in one_line_error(InvalidCheckpointError, str(folder))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_broken_safetensors(tiny_llama, tmp_path, damage):
    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 8)
    assert "cannot load model" in one_line_error(InvalidCheckpointError, str(folder))


def test_missing_tensor(tiny_llama, tmp_path):
    import mlx.core as mx

    folder = copy_checkpoint(tiny_llama, tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    dropped = sorted(k for k in weights if "layers.1." in k)[0]
    del weights[dropped]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    message = one_line_error(InvalidCheckpointError, str(folder))
    assert "Missing" in message and dropped in message


def test_a_16_bit_checkpoint_computes_in_float32_on_the_cpu(tmp_path, shared_tokenizer):
    """MLX's CPU kernels run float16/bfloat16 (quantized matmuls above all) many times slower:
    on the CPU the loader casts the floating weights, quantization scales and biases included,
    to float32; packed quantized weights stay as they are. (On a GPU the checkpoint's own type
    is kept.)"""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import tiny
    from mlxspec.models.convert import convert_checkpoint

    source = tiny.write_checkpoint(tmp_path / "f16", "qwen3", tokenizer=shared_tokenizer, seed=1, dtype="float16")
    convert_checkpoint(str(source), tmp_path / "q4", q_bits=4)
    for folder in (source, tmp_path / "q4"):
        dtypes = {v.dtype for _, v in tree_flatten(load_model(str(folder)).model.parameters())}
        assert mx.float16 not in dtypes and mx.float32 in dtypes, (folder.name, dtypes)
    assert mx.uint32 in dtypes  # the quantized one keeps its packed weights


def test_a_gguf_path_the_system_refuses_is_one_line(tmp_path, monkeypatch):
    """A name past the file system's limit (or an Ollama store folder with one) raises OSError
    from is_file(): a ModelNotFoundError naming it, not an internal error."""
    with pytest.raises(ModelNotFoundError, match="cannot read"):
        load_model(str(tmp_path / ("x" * 300 + ".gguf")))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / ("o" * 300)))
    with pytest.raises(ModelNotFoundError, match="cannot read"):
        load_model("ollama:smollm2:135m")


@pytest.mark.parametrize("sharded", [False, True])
def test_kernels_go_into_a_shard_as_into_a_whole_model(tiny_llama, monkeypatch, sharded):
    """The CUDA kernels work on a rank's own heads and rows (a sharded layer's all-sum stays
    mlx's): a shard gets them too, or its verifies pay MLX's per-key-length attention graphs."""
    from mlx_lm.utils import load

    from mlxspec import kernels
    from mlxspec.models import sharding

    installed = []
    monkeypatch.setattr(kernels, "install", lambda model: installed.append(model) or {})
    monkeypatch.setattr(sharding, "load_sharded", lambda path, name, group: load(str(path), return_config=True))
    loaded = load_model(str(tiny_llama), group=object() if sharded else None)
    assert installed == [loaded.model]
