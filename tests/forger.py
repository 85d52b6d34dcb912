"""Forged DNS-SD announcements, and listeners that count who connects: what a stranger on
the link does to a head that discovers its nodes (tests/test_discovery.py).

    python tests/forger.py '{"listen": ["10.0.0.9:47001"], "announce": [{"instance": "x",
        "addresses": ["10.0.0.9"], "port": 47001, "txt": {"cid": "...", "mem": "abc"}}]}'

Prints ``ready`` once every listener is bound and every announcement registered, then
``accept HOST:PORT`` for each connection a listener accepts (held open, never answered, so
that a caller waits out its own deadline). Runs until its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys


async def main(spec: dict) -> None:
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    held = []

    def counter(where: str):
        async def accepted(reader, writer):
            print(f"accept {where}", flush=True)
            held.append(writer)
            await reader.read()  # until the caller hangs up

        return accepted

    servers = []
    for where in spec.get("listen", []):
        host, _, port = where.rpartition(":")
        servers.append(await asyncio.start_server(counter(where), host, int(port)))
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    infos = [AsyncServiceInfo("_mlxpipe._tcp.local.", f"{a['instance']}._mlxpipe._tcp.local.", port=a["port"],
                              properties={k: v.encode("utf-8", "surrogateescape") for k, v in a["txt"].items()},
                              addresses=[socket.inet_aton(h) for h in a["addresses"]],
                              server=f"forged{i}.local.", host_ttl=15, other_ttl=15)
             for i, a in enumerate(spec.get("announce", []))]
    await asyncio.gather(*[await zc.async_register_service(info, allow_name_change=True) for info in infos])
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await zc.async_close()
    for s in servers:
        s.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
