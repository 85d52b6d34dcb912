"""Small random-weight models built from mlx-lm's own classes, saved as mlx-lm folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

# DeepSeek-V3's architecture at toy size: MLA attention, one dense layer then
# MoE layers with shared experts and grouped top-k routing, 4-bit weights.
DSV3_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "qk_nope_head_dim": 32,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_deepseek_v3(out: Path, tokenizer_from: Path, seed: int = 0, bits: int = 4) -> Path:
    """A tiny DeepSeek-V3 folder at ``out`` with the tokenizer of ``tokenizer_from``."""
    from mlx_lm.models import deepseek_v3
    from mlx_lm.utils import save_model

    mx.random.seed(seed)
    args = deepseek_v3.ModelArgs.from_dict(DSV3_CONFIG)
    model = deepseek_v3.Model(args)
    # Random router weights and biases, so experts are actually chosen apart.
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape) * 0.5
            layer.mlp.gate.e_score_correction_bias = mx.random.normal((args.n_routed_experts,)) * 0.1
    # Larger embeddings than the default init, so tokens differ clearly.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    nn.quantize(model, group_size=32, bits=bits,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and "gate" != p.rsplit(".", 1)[-1])
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    config = dict(DSV3_CONFIG)
    config["quantization"] = {"group_size": 32, "bits": bits}
    config["quantization_config"] = config["quantization"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def tensor_bytes(path: Path, predicate) -> int:
    """Bytes of the tensors in a model folder whose names satisfy ``predicate``."""
    total = 0
    for f in path.glob("*.safetensors"):
        for name, arr in mx.load(str(f)).items():
            if predicate(name):
                total += arr.nbytes
    return total
