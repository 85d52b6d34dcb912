"""Small random-weight models built from mlx-lm's own classes, saved as mlx-lm folders.

Every architecture mlx-lm ships, at toy size, for the coverage matrix: ``mlxpipe.bench.tiny``.
"""

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


def _random_deepseek_v3(config: dict, seed: int):
    """mlx-lm's DeepSeek-V3 of ``config`` with random weights: (model, its ModelArgs)."""
    from mlx_lm.models import deepseek_v3

    mx.random.seed(seed)
    args = deepseek_v3.ModelArgs.from_dict(config)
    model = deepseek_v3.Model(args)
    # Random router weights and biases, so experts are actually chosen apart.
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape) * 0.5
            layer.mlp.gate.e_score_correction_bias = mx.random.normal((args.n_routed_experts,)) * 0.1
    # Larger embeddings than the default init, so tokens differ clearly.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    return model, args


def build_deepseek_v3(out: Path, tokenizer_from: Path, seed: int = 0, bits: int = 4) -> Path:
    """A tiny DeepSeek-V3 folder at ``out`` with the tokenizer of ``tokenizer_from``."""
    from mlx_lm.utils import save_model

    model, _ = _random_deepseek_v3(DSV3_CONFIG, seed)
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


# -- full-precision sources, in the layout Hugging Face ships them (what `--bits` quantizes) --

# The DeepSeek-V3 above, widened so that every projection's input is a multiple of 64:
# at mlx-lm's default group size every linear layer quantizes (a 32-wide one would stay
# bf16, and MLX's CPU gather_mm runs unquantized experts in float32 only).
DSV3_BF16_CONFIG = dict(DSV3_CONFIG, moe_intermediate_size=64, kv_lora_rank=64, qk_nope_head_dim=64,
                        architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16")
# Wider still, so that FP8's 128 x 128 blocks are several per matrix and some padded.
DSV3_FP8_CONFIG = dict(DSV3_BF16_CONFIG, hidden_size=256, intermediate_size=320, moe_intermediate_size=192,
                       kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64,
                       v_head_dim=64, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                           "quant_method": "fp8", "weight_block_size": [128, 128]})
LLAMA_BF16_CONFIG = {  # SmolLM2's shape, shrunk; tied embeddings
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def _jitter_norms(model: nn.Module) -> None:
    for _, m in model.named_modules():
        if isinstance(m, nn.RMSNorm):
            m.weight = 1.0 + 0.1 * mx.random.normal(m.weight.shape)


def _fp8_blocks(w: mx.array, block: int = 128):
    """DeepSeek-V3's FP8 form of ``w``: e4m3 bytes (uint8) and float32 ``weight_scale_inv``
    per 128 x 128 block, so that ``w ~= fp8 * scale_inv``."""
    w = w.astype(mx.float32)
    m, n = w.shape
    pm, pn = (-m) % block, (-n) % block
    blocks = mx.pad(w, ((0, pm), (0, pn))).reshape((m + pm) // block, block, (n + pn) // block, block)
    scale = mx.maximum(mx.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(m + pm, n + pn)[:m, :n]
    return mx.to_fp8(q), scale.astype(mx.float32)


def _save_labelled(path: Path, tensors: dict, fp8_names) -> None:
    """``mx.save_safetensors``, with the uint8 tensors in ``fp8_names`` labelled F8_E4M3 as in
    the real checkpoint (``mx.load`` reads them back as uint8)."""
    import struct

    mx.save_safetensors(str(path), tensors, metadata={"format": "pt"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for k in fp8_names:
        header[k]["dtype"] = "F8_E4M3"
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def _finish(out: Path, config: dict, tokenizer_from: Path) -> Path:
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def build_deepseek_v3_source(out: Path, tokenizer_from: Path, fp8: bool = False, seed: int = 0) -> Path:
    """A tiny full-precision DeepSeek-V3 in the Hugging Face layout (per-expert weights,
    ``kv_b_proj``, float32 ``e_score_correction_bias``): what mlx-lm's ``sanitize`` undoes.
    bf16, or with every projection in the layers FP8 + ``weight_scale_inv`` like the
    published checkpoint."""
    from mlx.utils import tree_flatten

    config = dict(DSV3_FP8_CONFIG if fp8 else DSV3_BF16_CONFIG)
    model, args = _random_deepseek_v3(config, seed)
    _jitter_norms(model)
    hf = {}
    heads, nope, vdim, rank = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
    for k, v in tree_flatten(model.parameters()):
        if ".self_attn.embed_q." in k or ".self_attn.unembed_out." in k:
            continue
        if ".mlp.switch_mlp." in k:  # [experts, out, in] -> experts.<e>.<proj>.weight
            for e in range(v.shape[0]):
                hf[k.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
            continue
        hf[k] = v
    for i in range(args.num_hidden_layers):
        hf[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = mx.random.uniform(
            -(rank ** -0.5), rank ** -0.5, (heads * (nope + vdim), rank))
    hf = {k: (v if "e_score_correction_bias" in k else v.astype(mx.bfloat16)) for k, v in hf.items()}
    fp8_names = []
    if fp8:  # the projections in the layers; router, norms, embedding and head stay bf16
        for k in list(hf):
            if ".layers." in k and (k.endswith("proj.weight") or k.endswith("kv_a_proj_with_mqa.weight")):
                hf[k], hf[k.replace(".weight", ".weight_scale_inv")] = _fp8_blocks(hf[k])
                fp8_names.append(k)
    else:
        config.pop("quantization_config", None)
    mx.eval(hf)
    out.mkdir(parents=True, exist_ok=True)
    _save_labelled(out / "model.safetensors", hf, fp8_names)
    return _finish(out, config, tokenizer_from)


def build_llama_source(out: Path, tokenizer_from: Path, seed: int = 0, dtype=mx.bfloat16, **overrides) -> Path:
    """A tiny full-precision SmolLM2-shaped llama (tied embeddings), any dtype on disk."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    config = dict(LLAMA_BF16_CONFIG, **overrides)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    _jitter_norms(model)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return _finish(out, config, tokenizer_from)


# A Qwen-style chat template with tools (JSON between <tool_call> markers: mlx-lm
# picks its json_tools parser) and thinking (<think> markers; the prompt opens a
# think block when enable_thinking is true).
CHAT_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call one or more functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>
{% endif %}{% endif %}"""

THINK_TOKENS = {13: "<think>", 14: "</think>"}  # two of SmolLM2's unused special tokens, renamed


def with_chat_template(out: Path, model: Path) -> Path:
    """``model`` (weights linked, not copied) with ``CHAT_TEMPLATE`` and think tokens."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name not in TOKENIZER_FILES:
            (out / f.name).symlink_to(f.resolve())
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for entry in tok["added_tokens"]:
        if entry["id"] in THINK_TOKENS:
            del vocab[entry["content"]]
            entry["content"], entry["special"] = THINK_TOKENS[entry["id"]], False
            vocab[entry["content"]] = entry["id"]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = [t for t in config.get("additional_special_tokens", [])
                                           if t not in ("<jupyter_code>", "<jupyter_output>")]
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# -- a model whose structure forbids some cuts ---------------------------------------------------

# Gemma 4 (6 layers: sliding, sliding, full, sliding, sliding, full) whose last two layers
# share keys and values: block 4 reads what block 3 computed, block 5 what block 2 did.
# No stage may start at layers 3, 4 or 5, so the even split of 2 stages ([0, 3) + [3, 6))
# and of 3 ([0, 2) + [2, 4) + [4, 6)) are both invalid; the valid cuts are 1 and 2.
GEMMA4_SHARED = dict(num_kv_shared_layers=2, num_experts=None)  # (as the published small ones: no MoE block)


def build_gemma4_shared(out: Path, tokenizer_from: Path) -> Path:
    """The tiny KV-sharing Gemma 4 above, with the tokenizer of ``tokenizer_from``."""
    from mlxpipe.bench import tiny

    return tiny.build("gemma4_text", out, tokenizer_from, extra=GEMMA4_SHARED)


# -- multi-token-prediction heads, written into a checkpoint under its own names -----------------

MTP_LAYOUTS = {"deepseek_v3": "layers", "mimo": "mtp_layers", "qwen3_next": "mtp", "glm4_moe": "layers"}


def add_mtp(model_dir: Path, out: Path, layers: int = 1, seed: int = 1, quantize: bool = False) -> Path:
    """``model_dir`` (its files linked, not copied) with random MTP layers written beside its
    weights, in ``model-mtp.safetensors``, under the checkpoint's own names in mlx's form (as a
    converter that kept them would write them; DeepSeek's layer with its copies of the embedding
    and head); ``quantize``: at the folder's own bits."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlxpipe.shards.models import mtp, mtp_layout

    model, config = load_model(model_dir, lazy=True)
    kind = mtp.model_type(model)
    layout, family = MTP_LAYOUTS[kind], mtp.FAMILIES[kind]
    module = __import__(type(model).__module__, fromlist=["_"])
    mx.random.seed(seed)
    tensors = {}
    num_layers = int(config["num_hidden_layers"])
    for i in range(layers):
        layer = mtp.MtpLayer(family.block(module, model.args, i), int(model.args.hidden_size), 1e-6,
                             family.embed_first)
        for _, m in layer.named_modules():
            if isinstance(m, nn.RMSNorm):
                m.weight = 1.0 + 0.1 * mx.random.normal(m.weight.shape)
            elif isinstance(m, nn.Linear) and m.weight.shape[0] < 64 and "gate" in type(m).__name__.lower():
                m.weight = mx.random.normal(m.weight.shape) * 0.5
        if quantize and "quantization" in config:
            q = config["quantization"]
            nn.quantize(layer, q["group_size"], q["bits"],
                        class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % q["group_size"] == 0
                        and not p.endswith("gate"))
        for key, value in tree_flatten(layer.parameters()):
            role, rest = key.split(".", 1)
            shared = layout == "mtp" and role != "block"
            if shared and i:
                continue
            tensors[mtp_layout.checkpoint_name(layout, num_layers, mtp_layout.Name(-1 if shared else i, role, rest))] = value
        if layout == "layers":  # DeepSeek's MTP layer carries the embedding and head again
            own = dict(tree_flatten(model.parameters()))
            for name in ("embed_tokens", "shared_head.head"):
                src = "model.embed_tokens" if name == "embed_tokens" else "lm_head"
                for k, v in own.items():
                    if k.startswith(src + "."):
                        tensors[f"model.layers.{num_layers + i}.{name}.{k[len(src) + 1:]}"] = v
    mx.eval(tensors)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    mx.save_safetensors(str(out / "model-mtp.safetensors"), tensors, metadata={"format": "mlx"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.setdefault("num_nextn_predict_layers", layers)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        (out / index.name).unlink()
        (out / index.name).write_text(json.dumps(data, indent=2))
    return out


def add_hf_mtp(source: Path, out: Path, seed: int = 2) -> Path:
    """A full-precision DeepSeek-V3 source (``build_deepseek_v3_source``: FP8 or bf16, Hugging Face's
    layout) with the layer after its last as the published checkpoint has it: its last layer's
    tensors again (per-expert, ``kv_b_proj``, FP8 with ``weight_scale_inv``), ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and copies of the embedding and head, in a file of its own."""
    config = json.loads((source / "config.json").read_text())
    n = int(config["num_hidden_layers"])
    weights = mx.load(str(source / "model.safetensors"))
    mx.random.seed(seed)
    h = int(config["hidden_size"])
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v for k, v in weights.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    extra.update({f"model.layers.{n}.enorm.weight": (1 + 0.1 * mx.random.normal((h,))).astype(mx.bfloat16),
                  f"model.layers.{n}.hnorm.weight": (1 + 0.1 * mx.random.normal((h,))).astype(mx.bfloat16),
                  f"model.layers.{n}.shared_head.norm.weight": mx.ones((h,), dtype=mx.bfloat16),
                  f"model.layers.{n}.eh_proj.weight": (mx.random.normal((h, 2 * h)) * (2 * h) ** -0.5).astype(mx.bfloat16),
                  f"model.layers.{n}.embed_tokens.weight": weights["model.embed_tokens.weight"],
                  f"model.layers.{n}.shared_head.head.weight": weights["lm_head.weight"]})
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    fp8 = [k for k in extra if k.replace(".weight", ".weight_scale_inv") in extra and extra[k].dtype == mx.uint8]
    _save_labelled(out / "model-mtp.safetensors", extra, fp8)
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1), indent=2))
    return out
