"""Every mlx-lm architecture at toy size: random-weight model folders built from
mlx-lm's own ``Model``/``ModelArgs``, for the coverage matrix (``mlxpipe bench
models``, ``tests/test_models.py``).

A config is the ``TINY`` values that the type's ``ModelArgs`` takes, then that
type's entry of ``OVERRIDES`` (the one table of what differs); types whose
``ModelArgs`` wraps a ``text_config`` get the same inside it. Weights are
mlx's own init with the embedding, norms and routers widened, so that greedy
tokens vary (``build`` checks it).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.shards.models.layers import layer_list

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LAYERS = 6      # every stage of a 2- or 3-stage split holds two or three
WINDOW = 24     # sliding windows: shorter than the test prompts, longer than a prefix block + drafts
TIED_GAIN = 4.0  # blocks' linear weights, times this where the output head is the embedding

TINY = dict(
    hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=49152, rms_norm_eps=1e-5, layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5, norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_bias=False, use_conv_bias=True,
    conv_bias=True, hidden_act="silu",
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, n_group=1, topk_group=1,
    routed_scaling_factor=1.0,
    # latent attention
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # windows and state-space layers
    sliding_window=WINDOW, state_size=16, ssm_state_size=16, conv_kernel=4,
    # GPT-2 style names
    n_embd=64, n_layer=LAYERS, n_head=4, n_ctx=1024, n_positions=1024, n_inner=128, d_model=64,
    n_layers=LAYERS, n_heads=4, num_layers=LAYERS, partial_rotary_factor=0.5, rotary_pct=0.5,
    rotary_emb_base=10000.0,
)


def _pattern(*kinds: str) -> List[str]:
    """``LAYERS`` layer kinds, repeating ``kinds``."""
    return [kinds[i % len(kinds)] for i in range(LAYERS)]


SLIDING = _pattern("sliding_attention", "sliding_attention", "full_attention")
LINEAR = ["linear_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention",
          "linear_attention"]

ROPE_L4 = dict(rope_theta=10000.0, rope_type="default", llama_4_scaling_beta=0.1,
               original_max_position_embeddings=4096)

# What each type needs beyond TINY (``_embed``: the embedding's std, ``_seed``: the
# random weights', where the defaults make a model repeat itself). For a type that wraps a text model,
# ``TEXT_OVERRIDES`` says what goes inside its ``text_config`` (TINY is there too).
OVERRIDES: Dict[str, dict] = {
    "gemma2": dict(_embed=0.05),
    "glm4": dict(_seed=1),
    "deepseek_v2": dict(n_group=1, topk_group=1, rope_scaling=dict(factor=1.0, type="yarn")),
    "minicpm3": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0,
                     rope_scaling=dict(original_max_position_embeddings=4096, short_factor=1.0, long_factor=1.0)),
    "ministral3": dict(rope_parameters=ROPE_L4),
    "mistral4": dict(rope_parameters=ROPE_L4),
    "mellum": dict(layer_types=SLIDING, rope_parameters=dict(sliding_attention=dict(rope_theta=10000.0),
                                                             full_attention=dict(rope_theta=10000.0))),
    "hunyuan": dict(moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=True,
                    cla_share_factor=2, moe_intermediate_size=32, rope_scaling=dict(alpha=1.0, factor=1.0,
                                                                                     type="dynamic")),
    # Gemma 4's larger models share no keys and values across layers; the small ones' shared layers
    # can be cut from their sources only where no stage boundary falls between them.
    "gemma4_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=16, global_head_dim=32,
                        vocab_size_per_layer_input=TINY["vocab_size"], layer_types=SLIDING),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=128, moe_topk=2,
                          expert_ffn_hidden_size=32, zero_expert_num=2, mla_scale_q_lora=True,
                          mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2,
                                mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2),
    # mlx-lm's plamo3 masks a window of window_size + 1 over a rotating cache of window_size, so
    # its tokens depend on how a prompt is cut into chunks: a window no test sequence fills.
    "plamo3": dict(sliding_window=4096),
    "phixtral": dict(num_vocab=49152, model_dim=64, num_heads=4, num_layers=LAYERS, rotary_dim=8),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=128, gegelu_limit=20.0,
                      blocksparse_block_size=32, blocksparse_num_local_blocks=2, blocksparse_vert_stride=2,
                      mup_width_multiplier=1.0, mup_embedding_multiplier=1.0),
    "spark2_5": dict(hidden_act="gelu",
                     rope_parameters=dict(sliding_attention=dict(rope_theta=10000.0, rope_type="default"),
                                          full_attention=dict(rope_theta=10000.0, rope_type="default"))),
    "stablelm": dict(use_qkv_bias=False),
    "afm7": dict(hidden_dim=64, num_kv_reuse_layers=2, num_heads=4, num_kv_heads=2),
    "afmoe": dict(layer_types=SLIDING, num_dense_layers=1, mup_enabled=False),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window_layers=[0, 2, 3, 5], conv_window=2),
    "bailing_hybrid": dict(layer_group_size=3, group_norm_size=1, head_dim=16),
    "bailing_moe_linear": dict(layer_group_size=3, group_norm_size=1, head_dim=16),
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0)),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    # mlx-lm reads the pattern, transformers (the tokenizer's AutoConfig) the layer types.
    "exaone4": dict(rope_scaling=None, sliding_window_pattern="LLG", layer_types=SLIDING),
    "exaone_moe": dict(layer_types=SLIDING, is_moe_layer=[False] + [True] * (LAYERS - 1)),
    "gear": dict(layer_types=SLIDING),
    "glm4_moe": dict(rope_scaling=None, use_qk_norm=True),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=8, topk_method="noaux_tc",
                        scoring_func="sigmoid", rope_parameters=dict(rope_theta=10000.0, rope_type="default")),
    "gptj": dict(rotary_dim=8),
    "granite": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                    residual_multiplier=1.0),
    "granitemoe": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                       residual_multiplier=1.0),
    "granitemoehybrid": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                             residual_multiplier=1.0, layer_types=_pattern("mamba", "mamba", "attention"),
                             mamba_n_heads=4, mamba_d_head=32, mamba_proj_bias=False, mamba_d_state=16,
                             mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, shared_intermediate_size=64),
    "jamba": dict(attn_layer_offset=2, attn_layer_period=3, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_conv=4, mamba_d_state=16, mamba_expand=2),
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4],
                                                head_dim=16, num_heads=4, short_conv_kernel_size=4),
                        model_max_length=4096, first_k_dense_replace=1, num_experts_per_token=2),
    "lfm2": dict(conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, layer_types=_pattern("conv", "conv", "full_attention")),
    "lfm2_moe": dict(conv_L_cache=3, use_expert_bias=True, num_dense_layers=1,
                     layer_types=_pattern("conv", "conv", "full_attention")),
    "lille-130m": dict(block_size=1024, n_kv_heads=2),
    "llama4_text": dict(intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0, 1, 1], use_qk_norm=True,
                        attention_chunk_size=16, interleave_moe_layer_step=2, num_local_experts=4),
    "mamba": dict(time_step_rank=4),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, time_step_limit=(0.0, float("inf")), time_step_rank=4,
                   intermediate_size=128),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[0, 1, 1, 0, 1, 1], moe_layer_freq=[0] + [1] * (LAYERS - 1),
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                          sliding_window_size=WINDOW, topk_method="noaux_tc", scoring_func="sigmoid",
                          layernorm_epsilon=1e-5, swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
                          partial_rotary_factor=1),
    "minicpm": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0),
    "minimax": dict(shared_intermediate_size=64, rotary_dim=8),
    "nemotron-nas": dict(block_configs=[
        dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=2.0)),
        dict(attention=dict(no_op=True), ffn=dict(ffn_mult=2.0)),
        dict(attention=dict(n_heads_in_group=4), ffn=dict(no_op=True)),
        dict(attention=dict(replace_with_linear=True), ffn=dict(ffn_mult=1.5)),
        dict(attention=dict(n_heads_in_group=2), ffn=dict(replace_with_linear=True)),
        dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=2.0))]),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, n_groups=1,
                       hybrid_override_pattern=["M", "-", "*", "M", "E", "M"], moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2),
    "olmo_hybrid": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                        layer_types=LINEAR),
    "openelm": dict(num_transformer_layers=LAYERS, model_dim=64, ffn_dim_divisor=16,
                    num_query_heads=[4] * LAYERS, num_kv_heads=[2] * LAYERS, ffn_multipliers=[2.0] * LAYERS),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(kv_channels=16),
    "qwen3_next": dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
                       shared_expert_intermediate_size=64),
    "recurrent_gemma": dict(conv1d_width=4, logits_soft_cap=30.0, attention_window_size=WINDOW,
                            block_types=["recurrent", "recurrent", "attention"]),
    "rwkv7": dict(head_dim=16, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "step3p5": dict(num_attention_groups=2, layer_types=SLIDING, moe_num_experts=4, moe_top_k=2,
                    share_expert_dim=32, moe_layers_enum="1,2,3,4,5"),
}

# Wrappers of a text model (their ModelArgs takes ``text_config``): the text
# model's own type where the wrapper reads it, and what differs inside.
TEXT_OVERRIDES: Dict[str, dict] = {
    "gemma3": dict(model_type="gemma3_text"),
    "gemma3n": dict(model_type="gemma3n_text"),
    "gemma4": dict(OVERRIDES["gemma4_text"], model_type="gemma4_text"),
    "gemma3n": dict(model_type="gemma3n_text", num_kv_shared_layers=2, vocab_size_per_layer_input=TINY["vocab_size"],
                    rope_local_base_freq=10000.0, final_logit_softcapping=30.0, layer_types=SLIDING,
                    activation_sparsity_pattern=[0.0] * LAYERS, hidden_size_per_layer_input=16,
                    altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
                    laurel_rank=8),
    "muse_spark": dict(post_norm_eps=1e-5, rope_parameters=dict(rope_theta=10000.0), layer_types=SLIDING,
                       layer_rope_theta=[10000.0] * LAYERS, final_logit_softcapping=30.0, output_multiplier=1.0,
                       moe_hidden_size=32, num_shared_experts=0, mlp_layer_types=["sparse"] * LAYERS),
    "kimi_k25": dict(model_type="deepseek_v3"),
    "kimi_k3": dict(OVERRIDES["kimi_linear"], model_type="kimi_linear", hidden_act="situ", q_lora_rank=32,
                    num_experts_per_token=2, routed_expert_hidden_size=32),
    "kimi_vl": dict(model_type="deepseek_v3"),
    "lfm2-vl": dict(OVERRIDES["lfm2"], model_type="lfm2"),
    "llama4": dict(OVERRIDES["llama4_text"], model_type="llama4_text", rope_scaling=None, num_experts_per_tok=1),
    "mistral3": dict(model_type="ministral3", **OVERRIDES["ministral3"]),
    "pixtral": dict(model_type="llama"),
    "qwen2_vl": dict(model_type="qwen2"),
    "qwen3_5": dict(OVERRIDES["qwen3_next"], model_type="qwen3_5"),
    "qwen3_5_moe": dict(OVERRIDES["qwen3_next"], model_type="qwen3_5_moe"),
    "qwen3_vl": dict(model_type="qwen3"),
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe_text"),
    "prism_hadamard_qwen35": dict(OVERRIDES["qwen3_next"], model_type="qwen3_5"),
    "minimax_m3_vl": dict(model_type="minimax_m3_vl", num_local_experts=4, moe_layer_freq=[1] * LAYERS,
                          dense_intermediate_size=128, shared_intermediate_size=64, rotary_dim=8),
}


# Long-context machinery as the real configs carry it, at toy size (tests/test_long_context.py):
# DeepSeek-V3's YaRN (x40 from 4,096, mscale and mscale_all_dim as in its config), Llama 3.1's
# "llama3" scaling, Gemma 3's 512-token windows beside a linearly scaled global layer, Qwen3-Next's
# linear attention beside full attention with a partial rotary. On MLX's CPU backend a layer of
# full attention over 32k positions costs about 20 CPU-seconds a head whatever its width, so each
# has one head and as few full-attention layers as a split needs: two layers of them where every
# layer is one (split in 2), one beside two cheap ones otherwise (split in 3). Head dimensions of
# 32, so that KV groups of 32 quantize them (mlx quantizes groups of 32, 64 or 128).
_LONG = dict(num_attention_heads=1, num_key_value_heads=1, head_dim=32)
LONG_CONTEXT: Dict[str, dict] = {
    "deepseek_v3": dict(_LONG, num_hidden_layers=2, max_position_embeddings=163840, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "llama": dict(_LONG, num_hidden_layers=2, max_position_embeddings=131072, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)),
    "gemma3_text": dict(_LONG, num_hidden_layers=3, max_position_embeddings=131072, sliding_window=512,
                        sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        query_pre_attn_scalar=32, rope_scaling=dict(rope_type="linear", factor=8.0)),
    "qwen3_next": dict(_LONG, num_hidden_layers=3, full_attention_interval=3, max_position_embeddings=262144,
                       rope_theta=10000000.0, partial_rotary_factor=0.25),
}


def _not_here() -> Dict[str, str]:
    out = {
        "olmo": "mlx-lm's olmo needs the ai2-olmo package (hf_olmo), not installed",
        "phi3small": "mlx-lm crashes (segmentation fault) in its block-sparse attention on the CPU",
        "prism_hadamard_qwen35": "a pack of 2-bit weights with a folded Hadamard rotation, made by its own "
                                 "tool; it runs as qwen3_5 does",
    }
    if not mx.metal.is_available():
        out["bitnet"] = "mlx-lm's bitnet kernels need Metal"
        out["muse_spark"] = "mlx-lm's muse_spark kernels need Metal"
    return out


# Types mlx-lm itself cannot run on this machine, or that have no toy version, and why.
NOT_HERE: Dict[str, str] = _not_here()


def cache_kinds(model_type: str) -> str:
    """The kinds of cache a type's model makes, as letters: P positional, R rotating
    window, S state arrays, L a list of caches, C a model's own class."""
    from mlx_lm.models import cache as mc

    try:
        model, _ = make_model(model_type)
    except Exception:  # noqa: BLE001 - a type whose toy config does not build
        return "?"
    made = model.make_cache() if hasattr(model, "make_cache") else [mc.KVCache()]
    letter = {mc.KVCache: "P", mc.QuantizedKVCache: "P", mc.RotatingKVCache: "R", mc.ArraysCache: "S",
              mc.CacheList: "L", mc.ChunkedKVCache: "P"}
    return "".join(sorted({letter.get(type(c), "C") for c in made}))


def model_types() -> List[str]:
    """Every model type the installed mlx-lm ships (a module with ``Model`` and ``ModelArgs``)."""
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    found = []
    for f in sorted(folder.glob("*.py")):
        src = f.read_text()
        if re.search(r"^class Model\(", src, re.M) and re.search(r"^class ModelArgs", src, re.M):
            found.append(f.stem)
    return found


def _module(model_type: str):
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def _overrides(model_type: str) -> dict:
    return {k: v for k, v in OVERRIDES.get(model_type, {}).items() if not k.startswith("_")}


def tiny_config(model_type: str, extra: Optional[dict] = None) -> dict:
    """The toy config of ``model_type``: what its ModelArgs takes of TINY, its overrides,
    and ``extra`` (a variant: say, Gemma 4 with layers that share keys and values, or a
    ``LONG_CONTEXT`` entry; for a model with a text part, it goes there too)."""
    args = _module(model_type).ModelArgs
    fields = {f.name for f in dataclasses.fields(args)}
    if "text_config" in fields:
        text = dict(TINY, **TEXT_OVERRIDES.get(model_type, {}), **(extra or {}))
        return dict({k: v for k, v in TINY.items() if k in fields}, model_type=model_type, text_config=text,
                    **_overrides(model_type)) | (extra or {})
    config = {k: v for k, v in TINY.items() if k in fields}
    config.update(model_type=model_type, **_overrides(model_type))
    return config | (extra or {})


def _widen(model: nn.Module, vocab: int, embed: float) -> None:
    """Weights whose greedy tokens vary: a normal embedding (std ``embed``), jittered
    norms, routers that choose experts apart, an output head mlx starts at zero made
    random; where the logits come from the embedding (tied), blocks strong enough
    that the next token is not the last one again."""
    from mlx.utils import tree_flatten, tree_unflatten

    tied = not any(isinstance(m, nn.Linear) and m.weight.shape[0] == vocab for _, m in model.named_modules())
    zeros = [(k, v) for k, v in tree_flatten(model.parameters())
             if v.ndim == 2 and v.shape[0] == vocab and not mx.any(v).item()]
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.1) for k, v in zeros]))
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m.weight.shape[0] >= 1000:
            m.weight = mx.random.normal(m.weight.shape) * embed
        elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)) and getattr(m, "weight", None) is not None:
            m.weight = m.weight + 0.1 * mx.random.normal(m.weight.shape)
        elif path.rsplit(".", 1)[-1] in ("gate", "router") and isinstance(m, nn.Linear):
            m.weight = mx.random.normal(m.weight.shape) * 0.5
    if tied:
        for block in layer_list(model):
            for _, m in block.named_modules():
                if isinstance(m, nn.Linear):
                    m.weight = m.weight * TIED_GAIN


def make_model(model_type: str, seed: int = 0, extra: Optional[dict] = None) -> Tuple[nn.Module, dict]:
    """mlx-lm's ``Model`` of ``tiny_config(model_type, extra)`` with widened random weights."""
    config = tiny_config(model_type, extra)
    module = _module(model_type)
    mx.random.seed(OVERRIDES.get(model_type, {}).get("_seed", seed))
    model = module.Model(module.ModelArgs.from_dict(config))
    _widen(model, TINY["vocab_size"], OVERRIDES.get(model_type, {}).get("_embed", 1.0))
    mx.eval(model.parameters())
    return model, config


def build(model_type: str, out: Path, tokenizer_from: Path, seed: int = 0, weights: bool = True,
          extra: Optional[dict] = None) -> Path:
    """A tiny ``model_type`` folder at ``out`` (weights as mlx-lm saves them, the config, and
    the tokenizer of ``tokenizer_from``); without ``weights``, the config only. ``extra``:
    config entries over the toy ones (``LONG_CONTEXT``)."""
    from mlx_lm.utils import save_model

    out.mkdir(parents=True, exist_ok=True)
    if weights:
        model, config = make_model(model_type, seed, extra)
        save_model(out, model)
    else:
        config = dict(tiny_config(model_type, extra), num_hidden_layers=LAYERS)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out
