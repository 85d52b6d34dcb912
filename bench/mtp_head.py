"""A multi-token-prediction head trained briefly for a model that ships none, on its own greedy
outputs, and written into a copy of its folder under a checkpoint's MTP names: so that
``mlxpipe bench mtp`` (and the tests) can show the MTP machinery with drafts that are often
right. Not a way to make production heads: minutes on a CPU, a few hundred steps.

The head is the model's family's MTP layer (``shards/models/mtp.py``: for the default
model a llama block): the norms, the projection of the token's embedding and the
model's hidden state, one decoder block, the output norm, with the model's own
embedding and output head, frozen. Its data: for each prompt, the prompt and the
model's greedy continuation; its target at position i the token at i + 2, from the
hidden state at i and the token at i + 1, all positions of a sequence at once (a causal
mask), as the last stage runs it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlxpipe.shards.models import mtp, mtp_layout

# Chat prompts the head learns from (the bench measures on others).
TRAIN_PROMPTS = [
    "Explain how a rainbow forms.", "What is photosynthesis?", "Describe the water cycle in simple terms.",
    "Why do we have seasons on Earth?", "How does a bicycle stay upright?", "What causes thunder?",
    "Write a short story about a lost cat.", "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?", "How do airplanes fly?",
    "Explain gravity to a child.", "What are the planets of the solar system?", "How do bees make honey?",
    "Why is the ocean salty?", "Describe how a volcano erupts.", "What is a black hole?",
    "How does the heart pump blood?", "Write a haiku about autumn.", "What is machine learning?",
    "Explain what a computer program is.", "How do plants grow from seeds?", "Why do leaves change color?",
    "What is the moon made of?", "How does electricity reach our homes?", "Describe a day at the beach.",
    "What makes a good friend?", "How do fish breathe underwater?", "Why do cats purr?",
    "Explain how clouds form.", "What is the tallest mountain in the world?", "How does a refrigerator work?",
    "Give a recipe for a simple salad.", "What is the history of the bicycle?", "How do birds migrate?",
    "What is an atom?", "Explain why the sky is dark at night.", "How does a compass work?",
    "Write a short poem about the city.", "What are the benefits of exercise?", "How do vaccines work?",
]


def greedy(model, prompt: Sequence[int], n: int, eos: Sequence[int], record=None) -> List[int]:
    """The model's greedy continuation of ``prompt`` (mlx-lm's ``generate_step``); with
    ``record`` (a tap on the model's final norm, ``mtp._Record``) the hidden states the
    MTP head takes are kept there as the model computes them (``features``)."""
    from mlx_lm.generate import generate_step

    out = []
    if record is not None:
        record.clear()
    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=n):
        out.append(int(token))
        if token in eos:
            break
    return out


def features(record, positions: int) -> mx.array:
    """The hidden states of the first ``positions`` positions [positions, D] from what
    ``record`` kept while ``greedy`` ran: the prompt's prefill and each decode step in
    order (the states a forward over the whole sequence gives, from the KV cache;
    ``generate_step`` may run one step past the last token kept: cut off)."""
    h = mx.concatenate([c[0] for c in record.hidden()], axis=0)[:positions]
    mx.eval(h)
    record.clear()
    return h


def _dense(module: nn.Module) -> mx.array:
    """A (maybe quantized) linear or embedding's weight [out, in], at float32."""
    if hasattr(module, "scales"):
        w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    else:
        w = module.weight
    w = w.astype(mx.float32)
    mx.eval(w)
    return w


def _loss(layer: mtp.MtpLayer, family: mtp.Family, embed, head, h: mx.array, seq: mx.array,
          at: Optional[mx.array] = None) -> mx.array:
    """Cross-entropy of the head's guesses of ``seq[i + 2]`` from ``h[i]`` and ``seq[i + 1]``, at the
    positions ``at`` (default: all; the output head over the vocabulary is most of a step's cost)."""
    e = embed(seq[None, 1:-1])
    if family.zero_first:
        e = e * (mx.arange(e.shape[1]) > 0)[None, :, None].astype(e.dtype)
    z = layer(e, h[None, : seq.shape[0] - 2].astype(e.dtype), None)[0]
    targets = seq[2:]
    if at is not None:
        z, targets = z[at], targets[at]
    return nn.losses.cross_entropy(head(z).astype(mx.float32), targets, reduction="mean")


def train(model_dir: Path, out: Path, prompts: Optional[Sequence[List[int]]] = None, tokens: int = 96,
          steps: int = 300, lr: float = 1e-3, seed: int = 0, layout: str = "mtp", positions: int = 64,
          progress: Callable[[str], None] = lambda line: None) -> dict:
    """Train an MTP head for the model at ``model_dir`` on its greedy continuations of ``prompts``
    (token ids; default: ``TRAIN_PROMPTS`` through its chat template), ``positions`` of one answer a
    step, and write ``out``: the folder's
    files linked, the head in ``model-mtp.safetensors`` under ``layout``'s names
    (``mtp_layout.py``), ``num_nextn_predict_layers`` in its config. Returns what it did."""
    from mlx_lm.utils import load_model, load_tokenizer

    t0 = time.monotonic()
    model, config = load_model(Path(model_dir), get_model_classes=mtp.without_mtp)
    tok = load_tokenizer(Path(model_dir))
    kind = mtp.model_type(model)
    family = mtp.FAMILIES[kind]
    if prompts is None:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in TRAIN_PROMPTS]
    inner = mtp._inner(model)
    record = mtp._Record(family.normed)
    mtp._tap(inner.norm, record)
    data = []
    for i, p in enumerate(prompts):  # each answer and, as it is generated, the hidden states the head takes
        seq = list(p) + greedy(model, p, tokens, tok.eos_token_ids, record)
        if len(seq) > 3:
            data.append((features(record, len(seq) - 1), mx.array(seq)))
        progress(f"greedy continuations: {i + 1} of {len(prompts)}")
    mx.random.seed(seed)
    module = __import__(type(model).__module__, fromlist=["_"])
    layer = mtp.MtpLayer(family.block(module, model.args, 0), int(model.args.hidden_size),
                         float(getattr(model.args, "rms_norm_eps", 1e-6)), family.embed_first)
    layer.set_dtype(mx.float32)
    layer.out_norm.weight = inner.norm.weight.astype(mx.float32)  # (logits at the model's own scale from the start)
    embed = inner.embed_tokens
    weight = _dense(model.lm_head if "lm_head" in model else inner.embed_tokens)
    head = lambda z: z @ weight.T  # noqa: E731 - the output head, frozen, dequantized once (its gradient is z's)
    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps), weight_decay=0.0)
    step = nn.value_and_grad(layer, lambda h, s, at: _loss(layer, family, embed, head, h, s, at))
    rng = random.Random(seed)
    losses = []
    for i in range(steps):
        h, s = data[rng.randrange(len(data))]
        at = sorted(rng.sample(range(len(s) - 2), min(positions, len(s) - 2)))
        loss, grads = step(h, s, mx.array(at))
        optimizer.update(layer, grads)
        mx.eval(layer.parameters(), optimizer.state, loss)
        losses.append(loss.item())
        if (i + 1) % 25 == 0:
            progress(f"step {i + 1} of {steps}: loss {sum(losses[-25:]) / 25:.3f}")
    _write(Path(model_dir), Path(out), layer, layout, int(config["num_hidden_layers"]))
    return {"sequences": len(data), "positions": sum(len(s) for _, s in data), "steps": steps,
            "first_loss": round(sum(losses[:25]) / max(len(losses[:25]), 1), 3),
            "last_loss": round(sum(losses[-25:]) / max(len(losses[-25:]), 1), 3),
            "seconds": round(time.monotonic() - t0, 1)}


def _write(model_dir: Path, out: Path, layer: mtp.MtpLayer, layout: str, num_layers: int) -> None:
    """``model_dir``'s files linked into ``out``, the head beside them, the config saying so."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model-mtp.safetensors", "model.safetensors.index.json") \
                and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    tensors = {}
    for key, value in tree_flatten(layer.parameters()):
        role, rest = key.split(".", 1)
        name = mtp_layout.Name(-1 if layout == "mtp" and role != "block" else 0, role, rest)
        tensors[mtp_layout.checkpoint_name(layout, num_layers, name)] = value.astype(mx.bfloat16)
    mx.save_safetensors(str(out / "model-mtp.safetensors"), tensors, metadata={"format": "mlx"})
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        (out / index.name).write_text(json.dumps(data, indent=2))
