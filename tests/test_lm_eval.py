"""lm-evaluation-harness itself against a real 2-stage server: its ``local-completions``
model on a multiple-choice task in both of its modes (token ids; text with ``echo``),
and ``local-chat-completions`` on a generation task, each equal to the same task
scored by mlx-lm in this process. The task is written here (a JSONL and a task
YAML for ``--include_path``); no dataset hub is asked for anything."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.extended  # lm-evaluation-harness runs: CI's second run (`pytest -m extended`)

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is installed by the test extra (`pip install -e '.[test]'`)")

MULTIPLE_CHOICE = [
    ("The sky on a clear day is", ["blue", "green", "loud"], 0),
    ("Two plus two equals", ["four", "seven", "purple"], 0),
    ("The opposite of hot is", ["cold", "tall", "fast"], 0),
    ("Paris is the capital of", ["Japan", "France", "Brazil"], 1),
    ("A cow says", ["meow", "quack", "moo"], 2),
]
GENERATION = [
    ("What is the capital of France? Answer with one word.", "Paris"),
    ("What color is the sky on a clear day? Answer with one word.", "Blue"),
    ("How many legs does a spider have? Answer with a number.", "8"),
]
STOPS = ["\n", "."]
GEN_TOKENS = 8
LAST_WORD = r"(\w+)$"  # the answer is the reply's last word (a regex filter of the task)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two tasks in a folder lm-eval reads with --include_path: ``mlxpipe_mc`` (loglikelihood,
    accuracy) and ``mlxpipe_gen`` (greedy generation, exact match)."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(d / "mc.jsonl", "w") as f:
        for q, choices, gold in MULTIPLE_CHOICE:
            f.write(json.dumps({"question": q, "choices": choices, "answer": gold}) + "\n")
    with open(d / "gen.jsonl", "w") as f:
        for q, a in GENERATION:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    (d / "mc.yaml").write_text(f"""task: mlxpipe_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (d / "gen.yaml").write_text(f"""task: mlxpipe_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(STOPS)}
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
filter_list:
  - name: last_word
    filter:
      - function: regex
        regex_pattern: '{LAST_WORD}'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return d


def _lm_eval(tmp_path, task_dir, task: str, model: str, args: str, *extra: str):
    """Run ``python -m lm_eval`` offline; (its aggregate for the task, its logged samples)."""
    out = tmp_path / f"out-{task}-{len(list(tmp_path.iterdir()))}"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args,
                          "--tasks", task, "--include_path", str(task_dir), "--output_path", str(out),
                          "--log_samples", *extra], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return (json.loads(results.read_text())["results"][task],
            sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"]))


@pytest.fixture(scope="module")
def mlx_lm(default_model):
    from mlx_lm import load

    return load(str(default_model))


def _loglikelihood(mlx_lm, context: str, continuation: str) -> float:
    """mlx-lm's log-likelihood of ``continuation`` after ``context``, the pair tokenized
    as lm-eval does (trailing spaces move to the continuation; the whole is encoded and
    split after the context's tokens)."""
    import mlx.core as mx

    model, tok = mlx_lm
    n = len(context) - len(context.rstrip())
    context, continuation = context[: len(context) - n], context[len(context) - n:] + continuation
    ctx, whole = tok.encode(context), tok.encode(context + continuation)
    logits = model(mx.array(whole)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(lp[p - 1, whole[p]].item() for p in range(len(ctx), len(whole)))


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text-echo"])
def test_multiple_choice_through_local_completions_equals_mlx_lm(default_server, default_model, mlx_lm, task_dir,
                                                                 tmp_path, tokenized):
    args = (f"model=default,base_url={default_server.base_url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={default_model},tokenized_requests={tokenized},max_retries=1")
    agg, samples = _lm_eval(tmp_path, task_dir, "mlxpipe_mc", "local-completions", args)
    assert len(samples) == len(MULTIPLE_CHOICE)
    right = 0
    for s in samples:
        want = [_loglikelihood(mlx_lm, a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        got = [float(r[0][0]) for r in s["resps"]]  # (logged as text)
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-3, (got, want)
        choice = max(range(len(want)), key=want.__getitem__)
        assert max(range(len(got)), key=got.__getitem__) == choice  # the same answer, item by item
        right += choice == MULTIPLE_CHOICE[s["doc_id"]][2]
    assert agg["acc,none"] == pytest.approx(right / len(samples))


def test_generation_through_local_chat_completions_equals_mlx_lm(default_server, mlx_lm, task_dir, tmp_path):
    from mlx_lm import generate

    model, tok = mlx_lm
    args = f"model=default,base_url={default_server.base_url}/chat/completions,max_retries=1"
    agg, samples = _lm_eval(tmp_path, task_dir, "mlxpipe_gen", "local-chat-completions", args,
                            "--apply_chat_template")
    assert len(samples) == len(GENERATION)
    right = 0
    for s in samples:
        (chat,) = s["arguments"]["gen_args_0"]["arg_0"]  # the messages, as JSON text
        text = generate(model, tok, prompt=tok.apply_chat_template(json.loads(chat), add_generation_prompt=True),
                        max_tokens=GEN_TOKENS)
        for stop in STOPS:
            text = text.split(stop)[0]
        assert s["resps"] == [[text]]  # greedy text equal, item by item
        word = re.search(LAST_WORD, text)
        right += (word.group(1) if word else None) == GENERATION[s["doc_id"]][1]
    assert 0 < agg["exact_match,last_word"] == pytest.approx(right / len(samples))


def test_bench_quality_scores_a_task_of_ones_own_through_a_running_server(default_server, default_model, mlx_lm,
                                                                         task_dir, tmp_path):
    out = tmp_path / "quality.json"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "bench", "quality", "--task",
                          str(task_dir / "mc.yaml"), "--url", default_server.base_url, "--model", str(default_model),
                          "--limit", "2", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mlxpipe_mc through mlxpipe serve" in run.stdout
    (row,) = json.loads(out.read_text())["rows"]
    right = 0
    for q, choices, gold in MULTIPLE_CHOICE[:2]:
        scores = [_loglikelihood(mlx_lm, q, " " + c) for c in choices]
        right += max(range(len(scores)), key=scores.__getitem__) == gold
    assert row["setting"] == "served" and row["metrics"] == {"acc,none": right / 2}
