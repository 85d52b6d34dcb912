"""Vision-language models through the pipeline: greedy tokens equal single-process
mlx-vlm's on the same weights (tiny random-weight Qwen2.5-VL, Gemma 3 and Mistral 3,
built by ``bench/tiny_vision.py``), with one and two images, beside a text-only
stream, and again from the prefix cache; another image behind the same placeholder
text is no hit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import run_async

pytest.importorskip("mlx_vlm")

from mlxpipe.bench.tiny_vision import FAMILIES, build  # noqa: E402
from mlxpipe.server.cluster.assembly import Cluster  # noqa: E402
from mlxpipe.server.config import ClusterConfig  # noqa: E402
from mlxpipe.server.core.streams import collect  # noqa: E402

NEW_TOKENS = 12
QUESTION = "What is in these images? Describe them."


def picture(seed: int, size=(100, 120)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def chat(images: int, question: str = QUESTION) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}] + [{"type": "image"}] * images
             + [{"type": "text", "text": question}]}]


@pytest.fixture(scope="session")
def vision_models(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("vision")
    return {f: build(f, root / f, default_model) for f in FAMILIES}


class Reference:
    """mlx-vlm in this process: its prompt ids, and its greedy tokens (``generate_step``)."""

    def __init__(self, path: Path):
        from mlx_vlm import load

        self.model, self.processor = load(str(path))

    def ids(self, messages, images) -> list:
        from mlx_vlm.utils import prepare_inputs

        text = self.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prepare_inputs(self.processor, images=images or None, prompts=[text])

    def tokens(self, messages, images, n: int = NEW_TOKENS, **kw) -> list:
        from mlx_vlm.generate.ar import generate_step

        inputs = self.ids(messages, images)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        steps = generate_step(inputs["input_ids"], self.model, inputs.get("pixel_values"), inputs.get("attention_mask"),
                              temperature=0.0, **extra, **kw)
        return [t for (t, _), _ in zip(steps, range(n))]


async def _prompt(cluster, messages, images):
    """The prompt as the API makes it: the template, each image's marker expanded by the
    processor, tokenized by the head; and its media (the tower's rows, positions)."""
    vision = cluster.vision
    text = cluster.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expanded = vision.expand(text, images) if images else None
    ids = cluster.tokenizer.encode(expanded.text if expanded else text, add_special_tokens=False)
    return ids, (await vision.media(ids, expanded) if expanded else None)


async def _run(path: Path, stages: int, cases, other_image):
    """Greedy tokens of ``cases`` ((messages, images)) run together, then the first again and
    the first's text with ``other_image``; with each stream's cached prompt tokens."""
    async with Cluster(ClusterConfig(model=str(path), stages=stages, chunk_size=8)) as cluster:
        assert cluster.vision is not None and cluster.model_facts()["vision"]

        async def run(batch):
            made = [await _prompt(cluster, m, ims) for m, ims in batch]
            streams = [cluster.engine.submit(ids, NEW_TOKENS, media=media) for ids, media in made]
            outs = await asyncio.gather(*map(collect, streams))
            return [[t.id for t in o] for o in outs], [s.cached_tokens for s in streams], [ids for ids, _ in made]

        first = await run(cases)
        again = await run([cases[0]])
        other = await run([(cases[0][0], [other_image])])
        await cluster.engine.drain()
        return first, again, other


def _check_family(family: str, path: Path, stages: int):
    ref = Reference(path)
    cases = [(chat(1), [picture(1)]), (chat(2), [picture(2), picture(3, (60, 90))]),
             ([{"role": "user", "content": "Tell me about the sea."}], [])]
    # Another image, new to this session's prefix caches (their disk tiers outlive a run).
    fresh = picture(1000 + 10 * FAMILIES.index(family) + stages)
    (outs, _, ids), (again, cached, _), (other, other_cached, other_ids) = run_async(_run(path, stages, cases, fresh))
    for (messages, images), got, mine in zip(cases, outs, ids):
        assert mine == ref.ids(messages, images)["input_ids"][0].tolist()  # mlx-vlm's prompt, token for token
        assert got == ref.tokens(messages, images), (family, stages, len(images))
    assert again[0] == outs[0]
    cfg = ref.model.config
    image_token = next(v for v in (getattr(cfg, "image_token_id", None), getattr(cfg, "image_token_index", None))
                       if v is not None)
    first_image, last_image = (ids[0].index(image_token), len(ids[0]) - ids[0][::-1].index(image_token))
    assert cached[0] >= last_image  # the same image: its blocks are hits
    assert other_ids[0] == ids[0]  # the same placeholder tokens ...
    assert other_cached[0] <= first_image  # ... another image: no hit past where it starts
    assert other[0] == ref.tokens(cases[0][0], [fresh])
    assert other[0] != outs[0]  # the image matters


def test_greedy_tokens_equal_mlx_vlm(vision_models):
    """The default run's case (about 20 s): Qwen2.5-VL, whose positions are its own, on 2 stages."""
    _check_family("qwen2_5_vl", vision_models["qwen2_5_vl"], 2)


@pytest.mark.extended
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_mlx_vlm_every_family(family, stages, vision_models):
    if (family, stages) == ("qwen2_5_vl", 2):
        pytest.skip("the default run's case")
    _check_family(family, vision_models[family], stages)


def test_media_gives_each_chunk_its_rows_and_positions():
    """A sequence's images (``core/media.py``), cut by chunks as frames carry them: the rows of
    the placeholder positions a chunk holds (an image may span chunks, a chunk two images),
    positions past the prompt shifted, and the content of each block's images."""
    from mlxpipe.server.core.media import ImageRows, Media

    def image(tag: int, n: int) -> ImageRows:  # row i of image ``tag``: 4 bytes [tag, i, tag, i]
        return ImageRows(bytes([tag]), n, b"".join(bytes([tag, i, tag, i]) for i in range(n)), "float32", 1)

    media = Media(at=[2, 3, 4, 7, 8], images=[image(1, 3), image(2, 2)],
                  positions=[[0, 1, 2, 2, 2, 5, 6, 7, 7, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], shift=-3)
    at, data, dtype, width = media.rows(3, 8)
    assert at == [0, 1, 4] and data == bytes([1, 1, 1, 1, 1, 2, 1, 2, 2, 0, 2, 0]) and (dtype, width) == ("float32", 1)
    assert media.rows(5, 7) == ([], b"", "", 0)
    assert media.positions_of(8, 12) == [7, 9, 7, 8, 8, 9, 7, 8]  # both axes of [8, 12): two past the prompt (10)
    assert media.marks(4) == {0: b"\x01", 1: b"\x01\x02", 2: b"\x02"}
    with pytest.raises(ValueError):
        Media(at=[1, 2], images=[image(1, 3)])


class _Oracle:
    """Drafts the reference's next tokens, every fourth one wrong (so some are taken back)."""

    def __init__(self, expected):
        self.expected, self.calls = list(expected), 0

    def prepare(self, tokens):
        pass

    def propose(self, tokens, k, confirmed):
        n = len(tokens)
        if list(tokens) != self.expected[:n]:
            return []
        self.calls += 1
        out = self.expected[n:n + k]
        return out[:-1] + [out[-1] + 1] if out and self.calls % 4 == 0 else out

    def close(self):
        pass


@pytest.mark.extended
def test_an_image_through_drafts_and_a_lost_stage(vision_models):
    """One Qwen2.5-VL stream with an image verifies drafts (VERIFY frames after the image,
    their positions shifted by its grid; some drafts wrong, so positions are taken back);
    stage 1 is killed with drafts in flight; the replay (the image's rows sent again from
    the head) gives mlx-vlm's tokens."""
    import os
    import signal

    from test_faults import FAST

    path, n = vision_models["qwen2_5_vl"], 40
    messages, images = chat(1), [picture(5)]
    expected = Reference(path).tokens(messages, images, n)

    async def main():
        cfg = ClusterConfig(model=str(path), stages=2, chunk_size=8, supervision=FAST)
        async with Cluster(cfg) as cluster:
            drafts = cluster.engine.scheduler.drafts
            ids, media = await _prompt(cluster, messages, images)
            assert media.shift != 0  # positions after the image are not the tokens' offsets
            cluster.engine.scheduler.speculator.drafters = lambda seq: _Oracle(ids + expected)
            got, at = [], None
            async for t in cluster.engine.submit(ids, n, media=media):
                got.append(t.id)
                if at is None and drafts.accepted >= 4 and cluster.engine.scheduler.solo:
                    at = len(got)
                    os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
            return got, at, drafts, cluster.engine.stats.recoveries

    got, at, drafts, recoveries = run_async(main(), timeout=300)
    assert at is not None and at < n - 8, "the fault must land while speculating"
    assert recoveries == 1 and drafts.accepted >= 4 and drafts.judged > drafts.accepted
    assert got == expected


@pytest.mark.extended
def test_an_image_with_a_quantized_kv_cache(vision_models):
    """``--kv-bits 8`` from the first position: a two-image prompt gives mlx-vlm's tokens with the
    same KV bits."""
    from mlxpipe.server.core.streams import collect

    path = vision_models["qwen2_5_vl"]
    messages, images = chat(2), [picture(6), picture(7, (60, 90))]

    async def main():
        cfg = ClusterConfig(model=str(path), stages=2, chunk_size=8, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
        async with Cluster(cfg) as cluster:
            ids, media = await _prompt(cluster, messages, images)
            return [t.id for t in await collect(cluster.engine.submit(ids, NEW_TOKENS, media=media))]

    got = run_async(main(), timeout=300)
    assert got == Reference(path).tokens(messages, images, kv_bits=8, kv_group_size=32, quantized_kv_start=0)


@pytest.mark.extended
def test_quantized_on_load_and_streamed_to_nodes(vision_models, tmp_path):
    """`--bits 4` over two nodes that lack the model: the head quantizes the language model's
    units (the tower stays its own, as mlx-vlm's convert keeps it) and streams each node its
    layers; the tokens are mlx-vlm's on `mlx_vlm.convert -q --q-bits 4` of the same folder."""
    import importlib
    import tempfile

    from conftest import SECRET, node_process

    from mlxpipe.proto.rpc import Security

    src = vision_models["qwen2_5_vl"]
    converted = tmp_path / "q4"
    importlib.import_module("mlx_vlm.convert").convert(str(src), str(converted), quantize=True, q_bits=4,
                                                       q_group_size=64)
    messages, images = chat(2), [picture(8), picture(9, (60, 90))]
    empty = tmp_path / "models"
    empty.mkdir()
    home = Path(tempfile.mkdtemp(prefix="mlxpipe-node-home-", dir=tmp_path))
    nodes = [node_process(home, "--models-dir", str(empty)) for _ in range(2)]
    try:
        assert all(address for _, address in nodes)

        async def main():
            cfg = ClusterConfig(model=str(src), nodes=[a for _, a in nodes], split="even", bits="4", chunk_size=8,
                                security=Security(secret=SECRET))
            async with Cluster(cfg) as cluster:
                ids, media = await _prompt(cluster, messages, images)
                got = [t.id for t in await collect(cluster.engine.submit(ids, NEW_TOKENS, media=media))]
                return got, [st.weights_sent for st in cluster.pipeline.stages]

        got, sent = run_async(main(), timeout=600)
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()
    assert all(sent)  # each node received its layers
    received = sorted(p.name for p in (home / "received").rglob("*.safetensors"))
    assert received and not any("vision" in name for name in received)  # no stage needs the tower
    assert got == Reference(converted).tokens(messages, images)
