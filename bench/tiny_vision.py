"""Small random-weight vision-language models built from mlx-vlm's own classes, saved as
the folders mlx-vlm loads: config, weights (tower and language model), a tokenizer with
the family's image tokens, its chat template and its processor's configuration.

Three families, each with its own way of putting an image into the prompt:
``qwen2_5_vl`` (a window-attention tower, a variable number of tokens per image and
three-axis rotary positions), ``gemma3`` (SigLIP, a fixed 16 tokens per image between
begin and end markers, sliding-window layers) and ``mistral3`` (Pixtral, rows of image
tokens broken by ``[IMG_BREAK]``). The tokenizer is the default model's with the
family's markers added; the language models are widened as ``tiny.py`` widens mlx-lm's
(``_widen``), so that greedy tokens vary and depend on the image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

FAMILIES = ("qwen2_5_vl", "gemma3", "mistral3")
LAYERS = 4
HIDDEN = 64
EMBED = {"gemma3": 0.05}  # the embedding's std (Gemma scales it by the square root of the width)

_IMAGE_PART = "content['type'] == 'image' or 'image' in content or 'image_url' in content"


def _template(turn_open: str, turn_close: str, image: str, assistant: str, bos: str = "",
              system: str = "") -> str:
    """A chat template that renders text and image parts in order (as the families' own do)."""
    first = (f"{{% if loop.first and message['role'] != 'system' %}}{system}{{% endif %}}" if system else "")
    return (
        f"{bos}{{% for message in messages %}}{first}{turn_open}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        f"{{% if {_IMAGE_PART} %}}{image}"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        f"{turn_close}{{% endfor %}}{{% if add_generation_prompt %}}{assistant}{{% endif %}}")


SPEC: Dict[str, dict] = {
    "qwen2_5_vl": {
        "tokens": ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        "template": _template("<|im_start|>{{ message['role'] }}\n", "<|im_end|>\n",
                              "<|vision_start|><|image_pad|><|vision_end|>", "<|im_start|>assistant\n",
                              system="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"),
    },
    "gemma3": {
        "tokens": ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"],
        "template": _template("<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n",
                              "<end_of_turn>\n", "<start_of_image>", "<start_of_turn>model\n", bos="<|endoftext|>"),
        "special": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                    "image_token": "<image_soft_token>"},
    },
    "mistral3": {
        "tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"],
        "template": _template("{% if message['role'] == 'user' %}[INST]{% endif %}",
                              "{% if message['role'] == 'user' %}[/INST]{% else %}<|endoftext|>{% endif %}",
                              "[IMG]", "", bos="<|im_start|>"),
    },
}


def _tokenizer(out: Path, family: str, tokenizer_from: Path) -> Dict[str, int]:
    """The default model's tokenizer with the family's markers added (special tokens), and
    its chat template; returns marker -> id."""
    from tokenizers import AddedToken, Tokenizer

    spec = SPEC[family]
    tok = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["tokens"]])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((tokenizer_from / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config["chat_template"] = spec["template"]
    if "special" in spec:
        config["extra_special_tokens"] = spec["special"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return {t: tok.token_to_id(t) for t in spec["tokens"]}


def _padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def tiny_config(family: str, ids: Dict[str, int], vocab: int) -> dict:
    """The family's config at toy size (a language model of ``LAYERS`` blocks)."""
    text = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": vocab,
            "max_position_embeddings": 4096}
    if family == "qwen2_5_vl":
        # Heads of 32 (a quantized KV cache groups 32 values at least), three rotary sections over its 16 pairs.
        return {"model_type": family, "architectures": ["Qwen2_5_VLForConditionalGeneration"], **text,
                "num_attention_heads": 2, "num_key_value_heads": 1,
                "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
                "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1,
                "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                "vision_token_id": ids["<|vision_pad|>"],
                "vision_config": {"model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                                  "out_hidden_size": HIDDEN, "num_heads": 2, "patch_size": 14,
                                  "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                  "window_size": 56, "fullatt_block_indexes": [1], "in_channels": 3}}
    if family == "gemma3":
        return {"model_type": family, "architectures": ["Gemma3ForConditionalGeneration"],
                "image_token_index": ids["<image_soft_token>"], "boi_token_index": ids["<start_of_image>"],
                "eoi_token_index": ids["<end_of_image>"], "mm_tokens_per_image": 16,
                "pad_token_id": vocab - 1,
                "eos_token_id": [2, ids["<end_of_turn>"]], "hidden_size": HIDDEN, "vocab_size": vocab,
                "text_config": {"model_type": "gemma3_text", **text, "head_dim": 16, "query_pre_attn_scalar": 16,
                                "sliding_window": 24, "sliding_window_pattern": 2, "mm_tokens_per_image": 16,
                                "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0},
                "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                                  "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 8,
                                  "image_size": 64, "layer_norm_eps": 1e-6}}
    if family == "mistral3":
        return {"model_type": family, "architectures": ["Mistral3ForConditionalGeneration"],
                "image_token_index": ids["[IMG]"], "spatial_merge_size": 2, "vision_feature_layer": -1,
                "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "eos_token_id": 2,
                "text_config": {"model_type": "mistral", **text, "head_dim": 16, "rope_theta": 1000000.0,
                                "tie_word_embeddings": False},
                "vision_config": {"model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 32,
                                  "head_dim": 16, "intermediate_size": 64, "num_attention_heads": 2,
                                  "image_size": 112, "patch_size": 14, "rope_theta": 10000.0}}
    raise ValueError(f"no tiny {family}: one of {', '.join(FAMILIES)}")


def _preprocessor(family: str) -> dict:
    clip = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    if family == "qwen2_5_vl":
        return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
                "max_pixels": 168 * 168, **clip}
    if family == "gemma3":
        return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "size": {"height": 64, "width": 64}, "do_pan_and_scan": False, "do_resize": True,
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "resample": 2,
                "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_convert_rgb": True}
    return {"image_processor_type": "PixtralImageProcessor", "processor_class": "Mistral3Processor",
            "size": {"longest_edge": 112}, "patch_size": 14, "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "resample": 3, "do_convert_rgb": True, **clip}


def build(family: str, out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny ``family`` folder at ``out``, with the tokenizer of ``tokenizer_from`` (the
    default model's folder) and the family's markers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from mlxpipe.bench.tiny import _widen

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out, family, Path(tokenizer_from))
    vocab = _padded(max(ids.values()) + 1)
    config = tiny_config(family, ids, vocab)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor(family), indent=1))
    if family == "gemma3":  # tokens per image, as its processor writes them
        (out / "processor_config.json").write_text(json.dumps({"image_seq_length": 16}))
    arch, _ = get_model_and_args(config)
    built = dict(config)
    built.setdefault("text_config", {})
    model_config = update_module_configs(arch.ModelConfig.from_dict(built), arch, built, ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    _widen(model.language_model, vocab, EMBED.get(family, 1.0))
    for _, m in model.named_modules():  # a projector mlx starts at ones: random, so images differ
        if hasattr(m, "mm_input_projection_weight"):
            m.mm_input_projection_weight = mx.random.normal(m.mm_input_projection_weight.shape) * 0.5
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def image_tokens(family: str) -> List[str]:
    """The markers a family's prompt holds around and for its images."""
    return list(SPEC[family]["tokens"][:3])
