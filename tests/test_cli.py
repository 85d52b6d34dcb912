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


def _commands():
    from mlxpipe.server.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


def test_help_lists_every_command(capsys):
    from mlxpipe.server.cli.main import main

    out = mlxpipe("--help")
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ") and line.split()}
    commands = _commands()
    assert len(commands) >= 10 and listed >= set(commands), set(commands) - listed
    for cmd in commands:  # each command's own help (in this process: 11 interpreters would take 20 s)
        with pytest.raises(SystemExit) as info:
            main([cmd, "--help"])
        assert info.value.code == 0, cmd
        assert capsys.readouterr().out.startswith(f"usage: mlxpipe {cmd}"), cmd


def test_every_option_has_help():
    import argparse

    from mlxpipe.server.cli import build_parser

    missing = []

    def walk(parser, path):
        if hasattr(parser, "_load"):
            parser._load()  # a command's options are added when it is used
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            elif not action.help:
                missing.append(" ".join(path + [action.option_strings[0] if action.option_strings else action.dest]))

    walk(build_parser(), ["mlxpipe"])
    assert not missing, missing


@pytest.fixture
def busy_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield str(s.getsockname()[1])


def _files(tmp_path):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "keys").write_text("# a key and its fields a line\nkey-one role=operator\nkey-two rol=user\n")
    return {"EMPTY": str(tmp_path / "empty"), "MISSING": str(tmp_path / "missing"), "KEYFILE": str(tmp_path / "keys")}


BAD_ARGUMENTS = [
    (["serve", "--stages", "0"], "argument --stages: must be at least 1"),
    (["generate", "--stages", "-1", "hi"], "argument --stages: must be at least 1"),
    (["generate", "--max-tokens", "-1", "hi"], "argument --max-tokens: must be at least 1"),
    (["serve", "--port", "99999"], "argument --port: a port is 0 to 65535"),
    (["serve", "--max-batch", "0"], "argument --max-batch: must be at least 1"),
    (["serve", "--prompt-ratio", "-1"], "argument --prompt-ratio: must be 0 or more, got -1"),
    (["serve", "--kv-bits", "3"], "argument --kv-bits: invalid choice: 3 (choose from 16, 8, 4)"),
    (["serve", "--quantized-kv-start", "-1"], "argument --quantized-kv-start: must be 0 or more, got -1"),
    # It used to pass, and fail at the first Load with "Value out of range" (a uint32 on the wire).
    (["serve", "--quantized-kv-start", "4294967296"], "argument --quantized-kv-start: must be at most 4294967295"),
    (["node", "--kv-group-size", "48"], "argument --kv-group-size: invalid choice: 48"),
    # The port is taken before the model is looked for, let alone loaded.
    (["serve", "--model", "nobody/not-here", "--port", "BUSY"], "cannot listen on 127.0.0.1:BUSY"),
    (["serve", "--api-key-file", "EMPTY"], "--api-key-file EMPTY is empty"),
    (["serve", "--api-key-file", "MISSING"], "--api-key-file MISSING: No such file"),
    (["serve", "--api-key-file", "KEYFILE"], "API key 2: 'rol=user' is not a field"),
    (["serve", "--secret-file", "EMPTY", "--nodes", "127.0.0.1:1"], "--secret-file EMPTY is empty"),
    (["node", "--secret-file", "EMPTY"], "--secret-file EMPTY is empty"),
    (["node", "--secret-file", "MISSING"], "--secret-file MISSING: No such file"),
    (["generate", "--stages", "1", "--draft-model", "MISSING", "hi"], "--draft-model: model 'MISSING' not found"),
]


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors_before_anything_loads(args, message, tmp_path, busy_port):
    names = _files(tmp_path) | {"BUSY": busy_port}
    fill = lambda text: next((text.replace(k, v) for k, v in names.items() if k in text), text)  # noqa: E731
    out = mlxpipe(*map(fill, args), timeout=60)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and fill(message) in errors[0], out.stderr
    assert "Traceback" not in out.stderr


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


def test_the_suite_runs_in_a_home_of_its_own(default_model):
    """Profiles and received weights from earlier runs used to change planned
    splits: the suite wrote into the user's ~/.cache/mlxpipe."""
    import os
    import tempfile
    from pathlib import Path

    from mlxpipe.shards.models.store import mlxpipe_home

    home = mlxpipe_home()
    assert Path(os.environ["MLXPIPE_HOME"]) == home and home.is_relative_to(tempfile.gettempdir())
    assert home != Path(os.environ["MLXPIPE_SHARED_HOME"])
    assert default_model.parent.parent == home and not default_model.is_symlink()


def test_certs_makes_a_ca_and_certificates_that_verify(tmp_path):
    out = mlxpipe("certs", str(tmp_path / "pki"), "--node", "n1=127.0.0.1,localhost", "--client", "head", timeout=60)
    assert out.returncode == 0, out.stderr
    pki = tmp_path / "pki"
    for name in ("ca.pem", "n1.pem", "n1-key.pem", "head.pem", "head-key.pem"):
        assert (pki / name).stat().st_size > 0, name
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    for cert in ("n1.pem", "head.pem"):  # signed by the CA (raises if not)
        x509.load_pem_x509_certificate((pki / cert).read_bytes()).verify_directly_issued_by(ca)
    assert mlxpipe("certs", str(tmp_path / "none")).returncode == 2  # nothing named: a one-line error


def test_pull_prints_the_default_models_folder(default_model):
    out = mlxpipe("pull", "--quiet", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(default_model)


@pytest.mark.extended  # (bench soak: a minute of kills)
def test_bench_soak_kills_a_stage_and_every_answer_holds(dsv3_model, tmp_path):
    """A short `mlxpipe bench soak`: answers equal the undisturbed run's, no 5xx."""
    import json

    report = tmp_path / "soak.json"
    out = mlxpipe("bench", "soak", "--model", str(dsv3_model), "--duration", "10", "--clients", "3",
                  "--kill-every", "4", "--kill-stages", "0", "--prompts", "4", "--max-tokens", "8",
                  "--disconnect", "0.3", "--json", str(report), timeout=240)
    assert out.returncode == 0, out.stderr
    r = json.loads(report.read_text())
    assert r["finished"] > 0 and r["mismatched"] == 0 and r["server_errors"] == 0 and r["error_events"] == 0
    assert [stage for _, stage in r["kills"]] == [0, 0]
    assert all(v is not None for v in r["rss_end"].values()), r["rss_end"]
