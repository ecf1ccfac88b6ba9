"""GGUF conversions in mlxspec's cache (issue 33): one per file content (a path, a copy and the
ollama: name of the same blob share it; a second run does not hash the file again; folders of
earlier versions are taken over), listed by `mlxspec list` with their sources and removed by
`mlxspec rm` by name, path or ollama: name; Ollama names given without their prefix or tag
say what there is."""

import hashlib
import json
import shutil

import pytest
from typer.testing import CliRunner

pytest.importorskip("gguf")
import gguf_writer  # noqa: E402
from mlxspec import cli  # noqa: E402
from mlxspec.errors import ModelNotFoundError  # noqa: E402
from mlxspec.models import gguf_cache  # noqa: E402
from mlxspec.models.gguf_cache import SOURCE_FILE, cached_conversion, list_conversions  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, shared_tokenizer):
    folder = tmp_path_factory.mktemp("tiny_gguf")
    config = gguf_writer.model_config("qwen3", 512)
    source = gguf_writer.random_checkpoint(folder / "src", config, shared_tokenizer, seed=3)
    gguf_writer.write_gguf(source, folder / "tiny.Q4_0.gguf", "Q4_0")
    return folder / "tiny.Q4_0.gguf"


def ollama_store(root, name, tags, blob: bytes):
    digest = hashlib.sha256(blob).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(blob)
    for tag in tags:
        manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
        manifest.parent.mkdir(parents=True, exist_ok=True)
        layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                   "size": len(blob)}]
        manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return root / "blobs" / f"sha256-{digest}"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty GGUF cache, Hugging Face cache and Ollama store under TMP_PATH."""
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLXSPEC_DEFAULT_MODEL", raising=False)
    return tmp_path


def invoke(*args, input=None):
    """The command in a 200-column terminal: the consoles (cached per process, so an earlier
    test in this worker may have fixed their width) are made anew for it, and after it."""
    from mlxspec.cli import console

    for made in (console.stdout_console, console.stderr_console):
        made.cache_clear()
    try:
        return CliRunner().invoke(cli.app, [str(a) for a in args], input=input, env={"COLUMNS": "200"})
    finally:
        for made in (console.stdout_console, console.stderr_console):
            made.cache_clear()


def one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def no_conversion(*args, **kwargs):
    raise AssertionError("converted again")


# -- converted once per content ---------------------------------------------------------------


def test_a_path_a_copy_and_the_ollama_blob_share_one_conversion(env, tiny_gguf, monkeypatch):
    from mlxspec.models.loader import resolve_model

    local = env / "models" / "tiny.Q4_0.gguf"
    local.parent.mkdir()
    shutil.copyfile(tiny_gguf, local)
    ollama_store(env / "ollama", "tiny", ["q4"], tiny_gguf.read_bytes())
    folder, name, _ = resolve_model(str(local))
    assert name == "tiny.Q4_0.gguf"
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert folder.name == f"tiny.Q4_0-{digest[:16]}"
    monkeypatch.setattr("mlxspec.models.gguf.convert_gguf", no_conversion)
    assert resolve_model("ollama:tiny:q4")[0] == folder  # the same bytes: not converted again
    copy = env / "copy.gguf"
    shutil.copyfile(tiny_gguf, copy)
    assert resolve_model(str(copy))[0] == folder
    assert [p.name for p in (env / "cache").iterdir() if not p.name.startswith(".")] == [folder.name]
    record = json.loads((folder / SOURCE_FILE).read_text())
    assert record["sha256"] == digest
    assert record["sources"] == [str(local.resolve()), "ollama:tiny:q4", str(copy.resolve())]
    assert record["converted"].endswith("+00:00")


def test_a_second_run_does_not_hash_the_file_again(env, tiny_gguf, monkeypatch):
    local = env / "tiny.gguf"
    shutil.copyfile(tiny_gguf, local)
    steps = []
    folder = cached_conversion(local, on_step=steps.append)
    assert steps[0] == "hashing tiny.gguf"

    def no_hashing(*args):
        raise AssertionError("hashed again")

    monkeypatch.setattr(gguf_cache, "hash_file", no_hashing)
    monkeypatch.setattr("mlxspec.models.gguf.convert_gguf", no_conversion)
    assert cached_conversion(local) == folder  # the memo: same size and modification time
    local.write_bytes(local.read_bytes() + b"\0")  # a changed file is hashed (and converted) again
    with pytest.raises(AssertionError, match="hashed again"):
        cached_conversion(local)


def test_an_ollama_blob_is_not_hashed(env, tiny_gguf, monkeypatch):
    ollama_store(env / "ollama", "tiny", ["latest"], tiny_gguf.read_bytes())
    monkeypatch.setattr(gguf_cache, "hash_file", no_conversion)
    from mlxspec.models.loader import resolve_model

    folder, name, _ = resolve_model("ollama:tiny")
    assert name == "ollama:tiny" and folder.name.startswith("tiny-latest-")
    assert json.loads((folder / SOURCE_FILE).read_text())["sources"] == ["ollama:tiny:latest"]


def test_a_folder_of_an_earlier_version_is_taken_over(env, tiny_gguf, monkeypatch):
    """Before content keys the folder was <stem>-<sha256(path, size, mtime)[:16]>: it is renamed
    to the content key the first time its file runs again, not converted a second time."""
    from mlxspec.models.gguf import convert_gguf

    local = env / "old.gguf"
    shutil.copyfile(tiny_gguf, local)
    stat = local.resolve().stat()
    key = hashlib.sha256(f"{local.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    old = env / "cache" / f"old-{key}"
    convert_gguf(local, old)
    (old / "marker").write_text("x")
    listed = list_conversions()  # listed before it is taken over, with the name config.json keeps
    assert [(c.name, c.source, c.sources) for c in listed] == [(old.name, "old.gguf", [])]
    monkeypatch.setattr("mlxspec.models.gguf.convert_gguf", no_conversion)
    folder = cached_conversion(local)
    assert folder.name == f"old-{hashlib.sha256(local.read_bytes()).hexdigest()[:16]}"
    assert (folder / "marker").is_file() and not old.exists()
    assert json.loads((folder / SOURCE_FILE).read_text())["sources"] == [str(local.resolve())]


# -- mlxspec list and mlxspec rm ---------------------------------------------------------------


def test_list_shows_conversions_with_their_sources(env, tiny_gguf):
    from mlxspec.models.loader import resolve_model

    ollama_store(env / "ollama", "tiny", ["q4"], tiny_gguf.read_bytes())
    folder = resolve_model(str(tiny_gguf))[0]
    resolve_model("ollama:tiny:q4")
    rows = json.loads(invoke("list", "--json").stdout)
    assert len(rows) == 1
    row = rows[0]
    assert row["kind"] == "gguf" and row["name"] == folder.name and row["path"] == str(folder)
    assert row["source"] == str(tiny_gguf.resolve()) and row["sources"] == [str(tiny_gguf.resolve()),
                                                                            "ollama:tiny:q4"]
    assert row["architecture"] == "qwen3" and row["quantization"] == {"bits": 4, "group_size": 32}
    assert row["size_bytes"] > 0 and row["converted"] and row["sha256"]
    table = invoke("list")
    assert table.exit_code == 0, table.output
    assert folder.name in table.stdout and "ollama:tiny:q4" in table.stdout and "qwen3" in table.stdout
    assert "GGUF conversions" in table.stdout and "SOURCE" in table.stdout and "CONVERTED" in table.stdout


@pytest.mark.parametrize("how", ["path", "ollama", "name", "folder", "path of a removed file"])
def test_rm_removes_a_conversion(env, tiny_gguf, how):
    from mlxspec.models.loader import resolve_model

    local = env / "tiny.gguf"
    shutil.copyfile(tiny_gguf, local)
    blob = ollama_store(env / "ollama", "tiny", ["q4", "q8"], tiny_gguf.read_bytes())
    folder = resolve_model(str(local))[0]
    ref = {"path": str(local), "ollama": "ollama:tiny:q8", "name": folder.name, "folder": f"{folder}/",
           "path of a removed file": str(local)}[how]
    if how == "path of a removed file":
        local.unlink()
    no_tty = invoke("rm", ref)
    assert "needs confirmation: pass --yes" in one_line_error(no_tty) and folder.is_dir()
    removed = invoke("rm", ref, "--yes")
    assert removed.exit_code == 0, removed.output
    assert f"removed the GGUF conversion {folder.name}" in removed.stdout and "freed" in removed.stdout
    assert not folder.exists() and blob.is_file()  # the store is not touched
    assert how == "path of a removed file" or local.is_file()
    assert json.loads(invoke("list", "--json").stdout) == []
    again = one_line_error(invoke("rm", ref, "--yes"))
    if how not in ("name", "folder"):
        assert "no conversion of" in again and "mlxspec list" in again


# -- Ollama names -----------------------------------------------------------------------------


def test_rm_completes_conversion_names_and_their_store_names(env, tiny_gguf):
    """Shell completion for `rm` offers what `list` shows of the GGUF cache (run and list offer
    models to load, where a conversion is reached by its GGUF file or store name)."""
    from mlxspec.cli.console import complete_model, complete_removable
    from mlxspec.models.loader import resolve_model

    ollama_store(env / "ollama", "tiny", ["q4"], tiny_gguf.read_bytes())
    folder = resolve_model("ollama:tiny:q4")[0]
    assert complete_removable("") == complete_model("") + [folder.name, "ollama:tiny:q4"]
    assert complete_removable("oll") == ["ollama:tiny:q4"] and complete_removable("tiny")[0] == folder.name


def test_an_ollama_name_without_its_prefix_says_so(env, tiny_gguf):
    from mlxspec.models.loader import is_model_ref, resolve_model

    ollama_store(env / "ollama", "smollm2", ["135m"], tiny_gguf.read_bytes())
    with pytest.raises(ModelNotFoundError, match=r"did you mean ollama:smollm2:135m\?") as err:
        resolve_model("smollm2:135m")
    assert "\n" not in str(err.value)
    assert is_model_ref("smollm2:135m")  # a model, not a prompt for the default model
    assert not is_model_ref("smollm2:7b") and not is_model_ref("hello")
    for args in (["run", "smollm2:135m"], ["run", "smollm2:135m", "hi"], ["run", "-m", "smollm2:135m", "hi"]):
        line = one_line_error(invoke(*args, "--max-tokens", "1", input="hi"))  # the lone one reads stdin
        assert "did you mean ollama:smollm2:135m?" in line, (args, line)
    assert not (env / "cache").exists() or list((env / "cache").iterdir()) == []  # nothing converted


def test_an_ollama_name_without_a_latest_tag_lists_its_tags(env, tiny_gguf):
    from mlxspec.models.loader import resolve_model

    ollama_store(env / "ollama", "tiny", ["q8_0", "q4_k_m"], tiny_gguf.read_bytes())
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("ollama:tiny")
    assert "ollama:tiny:latest is not in Ollama's store" in str(err.value)
    assert "ollama:tiny has the tags q4_k_m, q8_0" in str(err.value)
    assert "`mlxspec run ollama:tiny:q4_k_m`" in str(err.value)
    line = one_line_error(invoke("run", "ollama:tiny", "hi", "--max-tokens", "1"))
    assert "has the tags q4_k_m, q8_0" in line
    with pytest.raises(ModelNotFoundError, match=r"ollama:other:latest is not in Ollama's store .*list --ollama"):
        resolve_model("ollama:other")


def test_convert_dtype_applies_to_a_gguf(smollm2_gguf, tmp_path):
    """`convert FILE.gguf --dtype float32`: every floating tensor, quantization scales too, in
    float32 (what MLX's CPU computes fastest); quantized weights stay as stored."""
    import mlx.core as mx
    from typer.testing import CliRunner

    from mlxspec import cli

    out = tmp_path / "f32"
    result = CliRunner().invoke(cli.app, ["convert", str(smollm2_gguf), str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    tensors = {}
    for file in out.glob("*.safetensors"):
        tensors.update(mx.load(str(file)))
    floats = {str(v.dtype) for v in tensors.values() if mx.issubdtype(v.dtype, mx.floating)}
    assert floats == {"mlx.core.float32"}
    assert any(k.endswith(".scales") for k in tensors) and any(v.dtype == mx.uint32 for v in tensors.values())
    bad = CliRunner().invoke(cli.app, ["convert", str(smollm2_gguf), str(tmp_path / "x"), "--dtype", "float64"])
    assert bad.exit_code != 0 and "--dtype must be one of" in bad.output
