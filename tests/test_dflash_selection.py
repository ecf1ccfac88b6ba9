"""Choosing a DFlash drafter: recognised by its config as --draft-model, found beside its target
(a sibling folder <target>-DFlash*, or a cached repo <any org>/<target name>-DFlash*), picked by
``auto`` and the ``dflash`` preset, refused as a target, shown by `mlxspec list`."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tiny_dflash
from mlxspec import cli, hardware, hub, presets
from mlxspec.errors import UsageError
from test_loader import fake_hf_cache

GiB = 1 << 30
BIG_MAC = hardware.Profile(os="macOS", chip="Apple M4 Pro", memory_bytes=48 * GiB,
                           working_set_bytes=40 * GiB, bandwidth_gbs=273.0)
PROMPT = "abc abc abc abc abc abc"


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_qwen3, tiny_qwen3_draft):
    """Qwen3-Tiny and, beside it, Qwen3-Tiny-DFlash-b8 (its drafter) and Qwen3-Tiny-DFlash-b16
    (a drafter made for another, narrower target: passed over although it sorts first)."""
    folder = tmp_path_factory.mktemp("dflash_pair")
    target = Path(shutil.copytree(tiny_qwen3, folder / "Qwen3-Tiny"))
    drafter = tiny_dflash.write_dflash_checkpoint(folder / "Qwen3-Tiny-DFlash-b8", target, block_size=8)
    tiny_dflash.write_dflash_checkpoint(folder / "Qwen3-Tiny-DFlash-b16", tiny_qwen3_draft, block_size=16)
    return target, drafter


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No user config or drafter settings, an empty offline Hugging Face cache."""
    monkeypatch.setenv("MLXSPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("MLXSPEC_DRAFTER", "MLXSPEC_DEFAULT_MODEL", "MLXSPEC_PRESET", "MLXSPEC_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hub"


@pytest.fixture
def cache(isolated, pair, tiny_qwen3_draft):
    """The pair as cached repos of other orgs, plus a quantized-looking copy of the target and a
    DFlash drafter for another target under the same name."""
    target, drafter = pair
    fake_hf_cache(isolated, "tiny-org/Qwen3-Tiny", target)
    fake_hf_cache(isolated, "mlx-community/Qwen3-Tiny-4bit", target)
    other = tiny_dflash.write_dflash_checkpoint(isolated.parent / "other-dflash", tiny_qwen3_draft)
    fake_hf_cache(isolated, "someone/Qwen3-Tiny-DFlash", other)  # made for another target
    return fake_hf_cache(isolated, "z-lab/Qwen3-Tiny-DFlash-b8", drafter)


def invoke(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_found_beside_a_local_target(pair):
    target, drafter = pair
    caps = presets.model_caps(str(target))
    assert caps.draft_kind == "dflash" and caps.draft_found == str(drafter.resolve())
    assert caps.draft_name == "Qwen3-Tiny-DFlash-b8" and not caps.draft_is_assistant  # not the -b16 one
    preset, reasons = presets.choose(BIG_MAC, caps)
    assert preset.name == "dflash" and reasons[0].startswith("DFlash drafter Qwen3-Tiny-DFlash-b8 found beside")
    assert presets.model_caps(str(target), look_beside=()).draft_name is None

    plan = presets.plan_run(None, str(target), "auto", None)  # no preset: the engine's auto
    assert plan.draft_model == str(drafter.resolve()) and plan.drafter == "auto"
    assert "drafting with the DFlash drafter Qwen3-Tiny-DFlash-b8 found beside the target" in plan.notes
    plan = presets.plan_run("auto", str(target), "auto", None)
    assert plan.draft_model == str(drafter.resolve()) and "preset auto -> dflash" in plan.notes[-1]
    plan = presets.plan_run("dflash", str(target), "auto", None)
    assert (plan.drafter, plan.draft_model) == ("dflash", str(drafter.resolve()))
    assert plan.stream_options == {"gates": True, "max_depth": 15}
    assert presets.plan_run(None, str(target), "pld", None).draft_model is None  # not asked for


def test_a_found_drafter_that_does_not_fit_is_not_used(pair, monkeypatch):
    target, _ = pair
    caps = presets.model_caps(str(target))
    small = hardware.Profile(os="Linux", memory_bytes=caps.model_bytes)
    monkeypatch.setattr(hardware, "detect", lambda fast=False: small)
    plan = presets.plan_run(None, str(target), "auto", None)
    assert plan.draft_model is None
    assert any("DFlash drafter Qwen3-Tiny-DFlash-b8 found beside the target is not used" in n for n in plan.notes)
    plan = presets.plan_run("auto", str(target), "auto", None)
    assert plan.draft_model is None and "preset auto -> pld" in plan.notes[-1]
    with pytest.raises(presets.DoesNotFitError):
        presets.plan_run("dflash", str(target), "auto", None)


def test_auto_order_given_draft_model_then_dflash_then_mtp(pair, tiny_qwen3_draft):
    target, drafter = pair
    given = presets.model_caps(str(target), str(tiny_qwen3_draft))  # a given draft model wins
    assert given.draft_kind == "model" and presets.choose(BIG_MAC, given)[0].name == "draft"
    plan = presets.plan_run("auto", str(target), "auto", str(tiny_qwen3_draft))
    assert plan.draft_model == str(tiny_qwen3_draft) and "preset auto -> draft" in plan.notes[-1]
    given = presets.model_caps(str(target), str(drafter))  # a DFlash drafter given
    assert given.draft_kind == "dflash" and not given.draft_found
    preset, reasons = presets.choose(BIG_MAC, given)
    assert preset.name == "dflash" and "DFlash drafter" in reasons[0] and "given" in reasons[0]
    with_head = presets.ModelCaps(name="m", draft_name="d", draft_kind="dflash", has_mtp_head=True)
    assert presets.choose(BIG_MAC, with_head)[0].name == "dflash"  # before the MTP head


def test_found_in_the_cache_under_another_org(cache):
    for target in ("tiny-org/Qwen3-Tiny", "mlx-community/Qwen3-Tiny-4bit"):
        caps = presets.model_caps(target)
        assert caps.draft_kind == "dflash" and caps.draft_name == "z-lab/Qwen3-Tiny-DFlash-b8", target
        assert caps.draft_found == str(cache)  # not someone/Qwen3-Tiny-DFlash: made for another target
        plan = presets.plan_run(None, target, "dflash", None, drafter_given=True)
        assert plan.draft_model == str(cache) and plan.drafter == "dflash"
        assert any("DFlash drafter z-lab/Qwen3-Tiny-DFlash-b8 found beside" in n for n in plan.notes)
    assert presets.dflash_names("mlx-community/Qwen3-8B-MLX-4bit") == ("qwen3-8b-mlx-4bit-dflash", "qwen3-8b-dflash")


def test_preset_dflash_needs_one(pair, tiny_llama, tiny_qwen3, tiny_qwen3_draft):
    target, drafter = pair
    with pytest.raises(UsageError, match=r"needs a DFlash drafter .*`mlxspec pull z-lab/"):
        presets.resolve("dflash", BIG_MAC, presets.model_caps(str(tiny_llama)))
    with pytest.raises(UsageError, match="is a draft model"):
        presets.resolve("dflash", BIG_MAC, presets.model_caps(str(target), str(tiny_qwen3_draft)))
    with pytest.raises(UsageError, match="use --preset dflash"):
        presets.resolve("draft", BIG_MAC, presets.model_caps(str(target), str(drafter)))
    line = one_line_error(invoke("run", tiny_qwen3, "hi", "--preset", "dflash"), 2)
    assert "--preset dflash needs a DFlash drafter" in line and "mlxspec pull z-lab/" in line
    assert "--draft-model" in line


def test_run_drafts_with_dflash_given_or_found(pair):
    target, drafter = pair
    common = [PROMPT, "--raw", "-n", "16", "--temp", "0", "--json", "--no-stats"]
    plain = invoke("run", target, *common, "--drafter", "none")
    assert plain.exit_code == 0, plain.output
    given = invoke("run", target, *common, "--draft-model", drafter)
    assert given.exit_code == 0, given.output
    out = json.loads(given.stdout)
    # this random drafter never agrees: checked on trial (probes), it never got to a verify
    assert out["stats"]["drafter"] == "dflash" and out["stats"]["probes"] > 0
    assert out["tokens"] == json.loads(plain.stdout)["tokens"]
    found = invoke("run", target, *common)  # none given: the one beside the target
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout)["stats"]["drafter"] == "dflash"
    assert "drafting with the DFlash drafter Qwen3-Tiny-DFlash-b8 found beside the target" in found.stderr


def test_a_drafter_given_as_the_model_is_one_line(pair):
    _, drafter = pair
    for args in (("run", drafter, "hi"), ("profile", drafter)):
        line = one_line_error(invoke(*args), 2)
        assert "Qwen3-Tiny-DFlash-b8 is a DFlash drafter, not a model: use it as --draft-model for its target" in line


def test_a_drafter_of_the_wrong_kind_is_one_line(pair, tiny_qwen3_draft):
    target, drafter = pair
    line = one_line_error(invoke("run", target, "hi", "--drafter", "dflash", "--draft-model", tiny_qwen3_draft), 2)
    assert "--drafter dflash needs --draft-model pointing at a DFlash drafter" in line
    line = one_line_error(invoke("run", target, "hi", "--drafter", "draft", "--draft-model", drafter), 2)
    assert "the draft model is a DFlash drafter: use --drafter dflash" in line


def test_list_marks_the_drafter(cache):
    rows = {row["repo_id"]: row for row in json.loads(invoke("list", "--json").stdout)}
    assert rows["z-lab/Qwen3-Tiny-DFlash-b8"]["drafter"] == "dflash"
    assert rows["tiny-org/Qwen3-Tiny"]["drafter"] is None
    table = invoke("list")
    assert table.exit_code == 0, table.output
    line = next(x for x in table.stdout.splitlines() if x.startswith("z-lab/"))  # the name may be cut
    assert "DFlash drafter" in line
    line = next(x for x in table.stdout.splitlines() if x.startswith("tiny-org/"))
    assert "DFlash" not in line


def test_the_config_check_agrees_with_the_loader(pair):
    from mlxspec.models.dflash_config import is_dflash_config

    _, drafter = pair
    configs = [json.loads((drafter / "config.json").read_text()), {"model_type": "qwen3"},
               {"architectures": ["DFlashDraftModel"]}, {"dflash_config": {}, "model_type": "llama"},
               {"architectures": ["Qwen3ForCausalLM"], "dflash_config": None}]
    for config in configs:
        assert (hub.drafter_kind(config) == "dflash") == is_dflash_config(config), config
    assert hub.drafter_kind({"model_type": "gemma4_assistant"}) == "assistant" and hub.drafter_kind(None) is None



def test_run_with_trees_is_plain_decoding_and_says_so(pair):
    target, drafter = pair
    common = [PROMPT, "--raw", "-n", "16", "--temp", "0", "--json", "--no-stats", "--draft-model", drafter]
    plain = json.loads(invoke("run", target, *common, "--drafter", "none").stdout)
    for tree in ("6", "auto", "0"):
        result = invoke("run", target, *common, "--tree", tree, "--depth", "3")
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["tokens"] == plain["tokens"]
        if tree == "6":
            assert out["stats"]["tree_steps"] > 0 and out["stats"]["tree_nodes"] >= 6 * out["stats"]["tree_steps"] - 6
        if tree == "0":
            assert out["stats"]["tree_steps"] == 0
    for bad in ("x", "33", "-1"):
        line = one_line_error(invoke("run", target, "hi", "--tree", bad), 2)
        assert "--tree must be auto or a node count from 0 to 32" in line


def test_the_api_refuses_a_drafter_as_the_model_and_a_wrong_kind(pair, tiny_qwen3_draft):
    import mlxspec
    from mlxspec.errors import UsageError

    target, drafter = pair
    with pytest.raises(UsageError, match="is a drafter, not a model"):
        mlxspec.load(str(drafter))
    spec = mlxspec.load(str(target), draft_model=str(tiny_qwen3_draft))
    with pytest.raises(UsageError, match="the draft model is a draft model: use --drafter draft"):
        spec.generate("hi", drafter="dflash", max_tokens=4)
    with pytest.raises(UsageError, match="tree must be"):
        spec.generate("hi", tree=99, max_tokens=4)


def test_the_server_takes_a_tree_per_request_and_refuses_a_bad_one(pair):
    from fastapi.testclient import TestClient

    import mlxspec
    from mlxspec.server.app import create_app
    from mlxspec.server.common import Settings

    target, drafter = pair
    spec = mlxspec.load(str(target), draft_model=str(drafter))
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0}
    with TestClient(create_app(spec, Settings(model_name="tiny"))) as client:
        plain = client.post("/v1/chat/completions", json={**body, "speculation": {"drafter": "none"}}).json()
        tree = client.post("/v1/chat/completions",
                           json={**body, "speculation": {"drafter": "dflash", "depth": 3, "tree": 6}}).json()
        assert tree["choices"][0]["message"] == plain["choices"][0]["message"]
        assert tree["usage"]["speculation"]["drafter"] == "dflash" and tree["usage"]["speculation"]["tree_steps"] > 0
        for bad in (33, -1, "many", True):
            r = client.post("/v1/chat/completions", json={**body, "speculation": {"tree": bad}})
            assert r.status_code == 400 and "speculation.tree" in r.text
        r = client.post("/api/chat", json={"model": "tiny", "messages": body["messages"], "stream": False,
                                           "options": {"temperature": 0, "num_predict": 8},
                                           "speculation": {"drafter": "dflash", "tree": "auto"}})
        assert r.status_code == 200, r.text
