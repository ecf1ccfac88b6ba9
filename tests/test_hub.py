"""`mlxspec pull / list / rm` against a fake hub on 127.0.0.1 (tests/fake_hub.py); no real network."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fake_hub import FakeHub
from mlxspec import cli, hub

REPO = "tiny-org/tiny-qwen3"


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import socket

    import huggingface_hub.constants as constants

    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):  # every request must go to the fake hub
        if host not in ("127.0.0.1", "localhost"):
            raise OSError(f"test tried to reach {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("MLXSPEC_GGUF_CACHE", str(tmp_path / "gguf_cache"))  # `list` shows its conversions too
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "MLXSPEC_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub froze these at import: keep them pointing at the fake hub / tmp cache too
    # (not constants.ENDPOINT: hf_hub_url swaps that prefix for the endpoint argument)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    yield server
    server.stop()


def invoke(*args, input=None):
    return CliRunner().invoke(cli.app, [str(a) for a in args], input=input)


def one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    text = result.stderr.strip() if hasattr(result, "stderr") else result.output.strip()
    assert text.count("\n") == 0 and text.startswith("error:"), text
    return text


def cached_blob_bytes(path: Path, name: str) -> bytes:
    return (path / name).read_bytes()


def test_pull_then_run_by_repo_id(fake_hub, tiny_qwen3):
    fake_hub.add_folder(REPO, tiny_qwen3, extra={"README.md": b"# not downloaded\n",
                                                  "pytorch_model.bin": b"x" * 100})
    result = invoke("pull", REPO)
    assert result.exit_code == 0, result.output
    assert REPO in result.stdout and "downloaded" in result.stdout
    snapshot = next((Path(hub.hf_cache_dir()) / "models--tiny-org--tiny-qwen3" / "snapshots").iterdir())
    assert {p.name for p in snapshot.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not (snapshot / "README.md").exists() and not (snapshot / "pytorch_model.bin").exists()
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()

    again = invoke("pull", REPO)
    assert again.exit_code == 0 and "already in the cache" in again.stdout
    assert len(fake_hub.gets("model.safetensors")) == 1

    run = invoke("run", REPO, "hello", "--max-tokens", "4", "--no-stats", "--json")
    assert run.exit_code == 0, run.output
    assert len(json.loads(run.stdout)["tokens"]) >= 1


def test_revision_pinning(fake_hub, tiny_qwen3):
    first = fake_hub.add_folder(REPO, tiny_qwen3, extra={"notes.txt": b"v1"}, revision="v1")
    fake_hub.add_folder(REPO, tiny_qwen3, extra={"notes.txt": b"version two"}, revision="main")
    assert invoke("pull", REPO, "--revision", "v1").exit_code == 0
    assert invoke("pull", REPO).exit_code == 0
    root = Path(hub.hf_cache_dir()) / "models--tiny-org--tiny-qwen3"
    assert (root / "refs" / "v1").read_text() == first
    assert (root / "snapshots" / first / "notes.txt").read_bytes() == b"v1"
    main = (root / "refs" / "main").read_text()
    assert main != first and (root / "snapshots" / main / "notes.txt").read_bytes() == b"version two"
    missing = invoke("pull", REPO, "--revision", "nope")
    assert "revision 'nope' not found" in one_line_error(missing)


def test_resume_within_a_pull_uses_range(fake_hub, tiny_qwen3, monkeypatch):
    import huggingface_hub.constants as constants

    # chunks smaller than the file, so part of it is on disk when the connection drops
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    fake_hub.add_folder(REPO, tiny_qwen3)
    fake_hub.cut_once.add("model.safetensors")  # first GET stops half-way, connection dropped
    result = invoke("pull", REPO)
    assert result.exit_code == 0, result.output
    gets = fake_hub.gets("model.safetensors")
    assert len(gets) == 2 and "range" not in gets[0] and gets[1]["range"].startswith("bytes=")
    assert gets[1]["range"] != "bytes=0-"
    path = hub.pull(REPO).path
    assert (path / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()


def test_interrupted_pull_finishes_on_the_next_one(fake_hub, tiny_qwen3):
    fake_hub.add_folder(REPO, tiny_qwen3)
    fake_hub.fail_once.add("model.safetensors")
    failed = invoke("pull", REPO)
    assert "run the same command again to resume" in one_line_error(failed)
    result = invoke("pull", REPO)
    assert result.exit_code == 0, result.output
    path = hub.pull(REPO).path
    assert (path / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()
    assert len(fake_hub.gets("tokenizer.json")) == 1  # files done before the failure are kept


def test_repo_not_found(fake_hub):
    assert "repo 'nobody/nothing' not found" in one_line_error(invoke("pull", "nobody/nothing"))


def test_gated_repo_needs_token(fake_hub, tiny_qwen3, monkeypatch):
    fake_hub.add_folder(REPO, tiny_qwen3, gated=True)
    message = one_line_error(invoke("pull", REPO))
    assert "gated" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    assert invoke("pull", REPO).exit_code == 0


def test_offline_and_not_cached(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = one_line_error(invoke("pull", REPO))
    assert "offline" in message and "HF_HUB_OFFLINE" in message
    assert not fake_hub.requests


def test_offline_and_cached(fake_hub, tiny_qwen3, monkeypatch):
    fake_hub.add_folder(REPO, tiny_qwen3)
    assert invoke("pull", REPO).exit_code == 0
    n = len(fake_hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("pull", REPO)
    assert result.exit_code == 0 and "already in the cache" in result.stdout
    assert len(fake_hub.requests) == n


def test_not_a_checkpoint(fake_hub):
    fake_hub.add_files("org/dataset-like", {"README.md": b"hi", "data.csv": b"a,b\n"})
    assert "no config.json" in one_line_error(invoke("pull", "org/dataset-like"))
    fake_hub.add_files("org/bin-only", {"config.json": b'{"model_type": "llama"}', "pytorch_model.bin": b"x"})
    assert "no safetensors" in one_line_error(invoke("pull", "org/bin-only"))


def test_unsupported_architecture(fake_hub):
    fake_hub.add_files("org/weird", {"config.json": b'{"model_type": "no_such_arch"}',
                                     "model.safetensors": b"x" * 1000})
    message = one_line_error(invoke("pull", "org/weird"))
    assert "no_such_arch" in message and "cannot load" in message
    assert not fake_hub.gets("model.safetensors")  # refused before the weights moved


def test_pull_a_drafter_without_a_tokenizer(fake_hub, tiny_qwen3, tmp_path):
    """A DFlash drafter (z-lab layout: config.json, model.safetensors, its remote code; no
    tokenizer) and a Gemma-4 assistant pull as models do, and say how they are used."""
    import tiny_dflash

    drafter = tiny_dflash.write_dflash_checkpoint(tmp_path / "drafter", tiny_qwen3)
    fake_hub.add_folder("z-lab/tiny-qwen3-DFlash-b16", drafter, extra={"dflash.py": b"# remote code\n"})
    result = invoke("pull", "z-lab/tiny-qwen3-DFlash-b16")
    assert result.exit_code == 0, result.output
    assert "is a DFlash drafter, not a model" in result.stderr
    assert "--draft-model z-lab/tiny-qwen3-DFlash-b16" in result.stderr
    config = tiny_dflash.dflash_config(tiny_dflash.target_text_config(tiny_qwen3))
    del config["model_type"]  # a drafter's model_type is not mlx-lm's to load: not checked
    fake_hub.add_files("other/no-type-DFlash", {"config.json": json.dumps(config).encode(),
                                                "model.safetensors": (drafter / "model.safetensors").read_bytes()})
    fake_hub.add_files("google/tiny-assistant", {"config.json": b'{"model_type": "gemma4_assistant"}',
                                                 "model.safetensors": b"x" * 100})
    for repo in ("other/no-type-DFlash", "google/tiny-assistant"):
        result = invoke("pull", repo)
        assert result.exit_code == 0, result.output
    rows = {row["repo_id"]: row for row in json.loads(invoke("list", "--json").stdout)}
    assert rows["z-lab/tiny-qwen3-DFlash-b16"]["drafter"] == "dflash"
    assert rows["other/no-type-DFlash"]["drafter"] == "dflash"
    assert rows["google/tiny-assistant"]["drafter"] == "assistant"
    assert "Gemma-4 assistant" in invoke("list").stdout


def test_disk_full(fake_hub, tiny_qwen3, monkeypatch):
    import errno

    import huggingface_hub.file_download as fd

    fake_hub.add_folder(REPO, tiny_qwen3)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fd, "http_get", full)
    assert "disk full" in one_line_error(invoke("pull", REPO))


def test_list_json_and_rm(fake_hub, tiny_qwen3, tiny_qwen3_5, tmp_path):
    assert json.loads(invoke("list", "--json").stdout) == []
    fake_hub.add_folder(REPO, tiny_qwen3)
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    for p in tiny_qwen3.iterdir():
        (quantized / p.name).write_bytes(p.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization"] = {"bits": 4, "group_size": 64}
    (quantized / "config.json").write_text(json.dumps(config))
    fake_hub.add_folder("tiny-org/quantized", quantized)
    fake_hub.add_folder("tiny-org/with-mtp", tiny_qwen3_5)
    for repo in (REPO, "tiny-org/quantized", "tiny-org/with-mtp"):
        result = invoke("pull", repo)
        assert result.exit_code == 0, result.output

    rows = {row["repo_id"]: row for row in json.loads(invoke("list", "--json").stdout)}
    assert set(rows) == {REPO, "tiny-org/quantized", "tiny-org/with-mtp"}
    plain = rows[REPO]
    assert plain["architecture"] == "qwen3" and plain["quantization"] is None and plain["mtp"] is False
    assert plain["drafter"] is None
    assert plain["size_bytes"] > (tiny_qwen3 / "model.safetensors").stat().st_size
    assert isinstance(plain["context_length"], int)
    assert rows["tiny-org/quantized"]["quantization"] == {"bits": 4, "group_size": 64}
    mtp = rows["tiny-org/with-mtp"]
    assert mtp["architecture"] == "qwen3_5" and mtp["mtp"] is True and isinstance(mtp["context_length"], int)

    table = invoke("list")
    assert table.exit_code == 0 and REPO in table.stdout

    no_tty = invoke("rm", REPO)
    assert "--yes" in one_line_error(no_tty)
    removed = invoke("rm", REPO, "--yes")
    assert removed.exit_code == 0 and "freed" in removed.stdout
    assert REPO not in {row["repo_id"] for row in json.loads(invoke("list", "--json").stdout)}
    assert not (Path(hub.hf_cache_dir()) / "models--tiny-org--tiny-qwen3").exists()
    assert "not in the Hugging Face cache" in one_line_error(invoke("rm", REPO, "--yes"))


def test_catalog_aliases():
    entries = hub.catalog()
    assert 5 <= len(entries) <= 20
    assert hub.resolve_alias("qwen3.6-27b") == entries["qwen3.6-27b"].repo
    assert hub.resolve_alias("QWEN3-0.6B") == "mlx-community/Qwen3-0.6B-4bit"
    assert hub.resolve_alias("org/not-an-alias") is None
    for entry in entries.values():
        assert "/" in entry.repo and "unverified" in entry.note
        assert entry.draft is None or hub.resolve_alias(entry.draft)


def test_pull_alias(fake_hub, tiny_qwen3, monkeypatch):
    monkeypatch.setattr(hub, "catalog", lambda: {"tiny": hub.CatalogEntry("tiny", REPO)})
    fake_hub.add_folder(REPO, tiny_qwen3)
    result = invoke("pull", "tiny")
    assert result.exit_code == 0 and REPO in result.stdout


def test_ctrl_c_mid_file_resumes_from_the_bytes_on_disk(fake_hub, tiny_qwen3, monkeypatch):
    """Ctrl-C halfway through a file leaves its bytes on disk; the next pull asks only for the rest."""
    import huggingface_hub.constants as constants
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    fake_hub.add_folder(REPO, tiny_qwen3)
    size = (tiny_qwen3 / "model.safetensors").stat().st_size
    real_http_get = fd.http_get

    class StopHalfway:
        def __init__(self, out):
            self.out, self.written = out, 0

        def write(self, data):
            self.out.write(data)
            self.written += len(data)
            if self.written >= size // 2:
                raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.out, name)

    def interrupted(url, out, **kw):
        if kw.get("displayed_filename") == "model.safetensors":
            out = StopHalfway(out)
        return real_http_get(url, out, **kw)

    monkeypatch.setattr(fd, "http_get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(REPO)
    monkeypatch.setattr(fd, "http_get", real_http_get)
    result = invoke("pull", REPO)
    assert result.exit_code == 0, result.output
    resumed = fake_hub.gets("model.safetensors")[-1]
    assert int(resumed["range"].split("=")[1].split("-")[0]) >= size // 2  # not from zero
    path = hub.pull(REPO).path
    assert (path / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()
