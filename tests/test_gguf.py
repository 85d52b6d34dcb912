"""The embedded default model's conversion: names, RoPE row order, config, tokenizer."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxpipe.shards.models import gguf
from mlxpipe.shards.models.store import ModelNotFound, resolve_model


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert script, which wrote the GGUF's Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 18), (3, 64, 72), (4, 8, 2)])
def test_unpermute_undoes_llama_cpp_permutation(n_heads, head_dim, cols):
    w = mx.random.normal((n_heads * head_dim, cols))
    assert mx.array_equal(gguf.unpermute_rows(_llama_cpp_permute(w, n_heads), n_heads), w).item()


def test_names():
    assert gguf.mlx_name("blk.7.attn_q.scales") == "model.layers.7.self_attn.q_proj.scales"
    assert gguf.mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf.mlx_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        gguf.mlx_name("blk.0.ssm_conv.weight")


def test_converted_folder(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    # 4-bit by default, the embedding kept at the 8 bits the GGUF stored it in.
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    weights = mx.load(str(default_model / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == mx.uint32 and q.shape == (576, 576 * 4 // 32)


def test_tokenizer_from_gguf_metadata(default_model):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model)
    text = "Hello, world! 12345 ünïcödé ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("2024") == [tok.convert_tokens_to_ids(d) for d in "2024"]  # digits split
    assert tok.encode("<|im_start|>user") [0] == 1  # special tokens stay whole
    assert tok.eos_token_ids == {2}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_model_says_what_was_looked_for(tmp_path):
    with pytest.raises(ModelNotFound) as info:
        resolve_model("nobody/no-such-model")
    msg = str(info.value)
    assert "nobody/no-such-model" in msg and "Hugging Face" in msg and "a model folder at" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
