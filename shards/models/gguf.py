"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

The quantized tensors are kept exactly as ``mx.load`` returns them (MLX affine
quantization, group size 32, with the bits of each tensor as it was stored:
Q4_0/Q4_1 become 4-bit, Q8_0 8-bit); only names and the row order of the
query and key projections change. The tokenizer is rebuilt from the GGUF
metadata with the ``tokenizers`` library, so the folder loads with plain
``mlx_lm.load`` and needs nothing from a model hub.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx

logger = logging.getLogger(__name__)

# GGUF tensor names -> mlx-lm llama names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp's pre-tokenizer names -> the regex split it applies before BPE.
_PRETOKENIZERS = {"smollm", "gpt-2", "default"}


def _scalar(meta: dict, key: str):
    if key not in meta:
        raise ValueError(f"GGUF metadata has no {key!r}")
    v = meta[key]
    return v.item() if isinstance(v, mx.array) else v


def mlx_name(gguf_name: str) -> str:
    """Map one GGUF tensor name (``blk.3.attn_q.scales``) to mlx-lm's."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> half-split RoPE).

    llama.cpp stores each head's rows as (pair, half) so that its interleaved
    rotary embedding works; mlx-lm's llama (like Hugging Face's) rotates the two
    halves of a head. Rows are output features, and quantization groups run along
    the input dimension, so reordering the rows of the packed weight, its scales
    and its biases together is exact.
    """
    rows = x.shape[0]
    head_dim = rows // n_heads
    return (
        x.reshape(n_heads, head_dim // 2, 2, *x.shape[1:])
        .swapaxes(1, 2)
        .reshape(x.shape)
    )


def build_config(meta: dict, tensors: Dict[str, mx.array]) -> dict:
    """mlx-lm ``config.json`` for a llama GGUF, with per-tensor quantization."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"only llama-architecture GGUF files can be converted, this one is {arch!r}"
        )
    hidden = int(_scalar(meta, "llama.embedding_length"))
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv"))
        if "llama.attention.head_count_kv" in meta
        else n_heads,
        "head_dim": hidden // n_heads,
        # float32 in the file: keep the decimal value it was written from.
        "rms_norm_eps": float(f'{_scalar(meta, "llama.attention.layer_norm_rms_epsilon"):.7g}'),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base"))
        if "llama.rope.freq_base" in meta
        else 10000.0,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    # Quantization: the most common (group_size, bits) is the default; every
    # tensor stored otherwise (e.g. an 8-bit embedding) gets its own entry, the
    # way mlx-lm writes mixed-precision models.
    per_module = {}
    for name, scales in tensors.items():
        if not name.endswith(".scales"):
            continue
        base = name[: -len(".scales")]
        packed = tensors[f"{base}.weight"]
        group_size = 32
        in_dims = scales.shape[-1] * group_size
        bits = packed.shape[-1] * 32 // in_dims
        per_module[mlx_name(base + ".weight")[: -len(".weight")]] = {
            "group_size": group_size,
            "bits": bits,
        }
    if per_module:
        counts: Dict[tuple, int] = {}
        for q in per_module.values():
            key = (q["group_size"], q["bits"])
            counts[key] = counts.get(key, 0) + 1
        group_size, bits = max(counts, key=counts.get)
        quant = {"group_size": group_size, "bits": bits}
        for module, q in sorted(per_module.items()):
            if (q["group_size"], q["bits"]) != (group_size, bits):
                quant[module] = q
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def build_tokenizer_files(meta: dict, out: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` from GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRETOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
        # llama.cpp's smollm pre-tokenizer splits every digit on its own first.
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (GGUF token type 3) are special: never split, skippable.
    from tokenizers import AddedToken

    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == 3
    ]
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))

    def token_at(key: str) -> Optional[str]:
        if key not in meta:
            return None
        return tokens[int(_scalar(meta, key))]

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token"))
        if "tokenizer.ggml.add_bos_token" in meta
        else False,
        "add_prefix_space": False,
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "additional_special_tokens": [t.content for t in specials],
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def convert_gguf(
    gguf_path: Path,
    out: Path,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out``.

    ``progress(done, total)`` is called as tensors are converted.
    """
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    config = build_config(meta, tensors)
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]

    # Written under a name of our own, renamed into place at the end: an
    # interrupted conversion leaves no half model, and two processes converting
    # at once (nodes sharing a cache) do not trip over each other.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    tmp.mkdir(parents=True, exist_ok=True)
    converted: Dict[str, mx.array] = {}
    names = sorted(tensors)
    for i, name in enumerate(names):
        x = tensors[name]
        if ".attn_q." in name:
            x = unpermute_rows(x, n_heads)
        elif ".attn_k." in name:
            x = unpermute_rows(x, n_kv)
        converted[mlx_name(name)] = x
        if progress:
            progress(i + 1, len(names))
    mx.save_safetensors(str(tmp / "model.safetensors"), converted, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    build_tokenizer_files(meta, tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp)
    logger.info("converted %s -> %s (%d tensors)", gguf_path, out, len(converted))
    return out
