"""The commands a user types, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROMPT = "Why is the sky blue?"
MAX_TOKENS = 24


def mlxpipe(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", *args], capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def mlx_lm_text(default_model):
    from mlx_lm import generate, load

    model, tok = load(str(default_model))
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    return generate(model, tok, prompt=prompt, max_tokens=MAX_TOKENS)


def test_help_lists_every_command():
    out = mlxpipe("--help").stdout
    for cmd in ("pull", "node", "generate", "bench"):
        assert cmd in out


def test_generate_prints_what_mlx_lm_prints(default_model, mlx_lm_text):
    out = mlxpipe("generate", "--model", str(default_model), "--stages", "2", "--max-tokens",
                  str(MAX_TOKENS), PROMPT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == mlx_lm_text + "\n"


def test_generate_on_node_workers(default_model, mlx_lm_text, tmp_path):
    """`mlxpipe node` workers sharing a cluster secret, driven by a head that tells
    them model and layers; a head without the secret is refused."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-for-this-test-only")
    nodes = [subprocess.Popen([sys.executable, "-m", "mlxpipe.server.cli", "node", "--listen", "127.0.0.1:0",
                               "--secret-file", str(secret), "--log-level", "WARNING"],
                              stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        addresses = [n.stdout.readline().split()[-1] for n in nodes]
        assert all(a.startswith("127.0.0.1:") for a in addresses)
        out = mlxpipe("generate", "--model", "default", "--nodes", ",".join(addresses),
                      "--secret-file", str(secret), "--max-tokens", str(MAX_TOKENS), PROMPT)
        assert out.returncode == 0, out.stderr
        assert out.stdout == mlx_lm_text + "\n"
        refused = mlxpipe("generate", "--model", "default", "--nodes", ",".join(addresses), PROMPT)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    finally:
        for n in nodes:
            n.terminate()
            n.wait(timeout=10)


def test_unknown_model_is_a_clear_error():
    out = mlxpipe("generate", "--model", "nobody/nothing-here", "hello")
    assert out.returncode != 0
    assert "model 'nobody/nothing-here' not found; looked for" in out.stderr
    assert "Traceback" not in out.stderr
