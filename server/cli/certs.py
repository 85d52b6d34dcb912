"""``mlxpipe certs``: a small cluster's certificate authority and certificates.

    mlxpipe certs ./pki --node mac1=mac1.local,192.168.1.10 --node mac2=mac2.local --client head

writes ``ca.pem`` (give it to every node and the head), ``ca-key.pem`` (keep
it offline), and ``NAME.pem`` + ``NAME-key.pem`` for each node (its server
certificate, valid for the host names and addresses listed; nodes also use it
as their client certificate toward the next stage) and for each client (the
head's client certificate, for nodes that demand mutual TLS).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import List, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_NAME = "mlxpipe cluster CA"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def make_ca(name: str = CA_NAME, days: int = 3650) -> Tuple[x509.Certificate, object]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca: x509.Certificate, ca_key, name: str, hosts: List[str], days: int = 825):
    """A certificate for ``name``, valid as a server for ``hosts`` and as a client."""
    key = _key()
    alt = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_cluster(out: Path, nodes: List[Tuple[str, List[str]]], clients: List[str],
                 ca_name: str = CA_NAME) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(ca_name)
    _write(out / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca-key.pem", _pem_key(ca_key), private=True)
    for name, hosts in nodes + [(c, []) for c in clients]:
        cert, key = issue(ca, ca_key, name, hosts)
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write(out / f"{name}-key.pem", _pem_key(key), private=True)


def add_arguments(p) -> None:
    p.add_argument("out", help="folder to write the certificates into")
    p.add_argument("--node", action="append", default=[], metavar="NAME=HOST[,HOST...]",
                   help="a node and the host names / IP addresses it is reached at (repeat per node)")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="a client certificate, e.g. for the head (repeat as needed)")


def run(args) -> int:
    nodes = []
    for spec in args.node:
        name, _, hosts = spec.partition("=")
        if not name or not hosts:
            raise ValueError(f"--node takes NAME=HOST[,HOST...], got {spec!r}")
        nodes.append((name, [h.strip() for h in hosts.split(",") if h.strip()]))
    if not nodes and not args.client:
        raise ValueError("name at least one --node or --client")
    make_cluster(Path(args.out), nodes, args.client)
    print(f"wrote ca.pem, ca-key.pem (keep it offline) and {len(nodes) + len(args.client)} certificates "
          f"to {args.out}")
    return 0
