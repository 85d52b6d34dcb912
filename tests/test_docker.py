"""docker/: nothing here can build images (no container engine), so check that
the compose file parses and that its commands and ports match the CLI's."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mlxpipe.server.cli.main import build_parser

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def _dockerfile(name):
    text = (DOCKER / name).read_text()
    exposed = re.findall(r"^EXPOSE (\d+)", text, re.M)
    entry = eval(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))  # a JSON array literal
    cmd = eval(re.search(r"^CMD (.*)$", text, re.M).group(1))
    copies = re.findall(r"^COPY (.*) \S+$", text, re.M)
    return exposed, entry, cmd, [p for line in copies for p in line.split()]


def test_compose_head_and_two_nodes_match_the_cli():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"head", "node1", "node2"}
    parser = build_parser()
    secret = "/run/secrets/mlxpipe_secret"
    assert "mlxpipe_secret" in compose["secrets"]

    node_ports = {}
    for name in ("node1", "node2"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.node"
        args = parser.parse_args(["node", *svc["command"]])
        host, port = args.listen.rsplit(":", 1)
        assert host == "0.0.0.0" and port in svc["expose"]
        assert args.secret_file == secret and "mlxpipe_secret" in svc["secrets"]
        node_ports[name] = port

    head = services["head"]
    args = parser.parse_args(["serve", *head["command"]])
    assert args.nodes.split(",") == [f"{n}:{p}" for n, p in node_ports.items()]
    assert args.secret_file == secret and "mlxpipe_secret" in head["secrets"]
    published = [p.rsplit(":", 2) for p in head["ports"]]
    assert [(bind, outer, inner) for bind, outer, inner in published] == [("127.0.0.1", "8000", str(args.port))]
    assert args.host == "0.0.0.0"


def test_dockerfiles_run_the_commands_they_say():
    parser = build_parser()
    root = DOCKER.parent
    for name, command, port in (("Dockerfile.node", "node", "50051"), ("Dockerfile.head", "serve", "8000")):
        exposed, entry, cmd, copies = _dockerfile(name)
        assert entry == ["mlxpipe", command] and exposed == [port]
        args = parser.parse_args([command, *cmd])  # the default command parses
        assert str(getattr(args, "listen", f"x:{getattr(args, 'port', '')}")).endswith(port)
        for path in copies:
            assert (root / path).exists(), f"{name} copies {path}, which is not in the repository"
