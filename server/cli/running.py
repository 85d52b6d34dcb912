"""Where the running head is, for the client commands (``status``, ``nodes``).

``mlxpipe serve`` writes ``$MLXPIPE_HOME/serve.json`` (its URL and pid) once it
listens and removes it when it stops. A client asks, in order: its ``--url``,
``$MLXPIPE_URL`` (set by hand, so it beats what was found), that file (when its
pid is still alive: a killed server leaves a stale one), then the default port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

from mlxpipe.shards.models.store import mlxpipe_home

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"


def state_file() -> Path:
    return mlxpipe_home() / "serve.json"


def reachable(host: str, port: int) -> str:
    """``http://host:port`` as a client connects to it (a wildcard address means this machine)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def announced(url: str) -> Iterator[None]:
    """The state file says ``url`` while the block runs (the last server started wins;
    each removes only its own)."""
    path, pid = state_file(), os.getpid()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".serve.{pid}.json")
        tmp.write_text(json.dumps({"url": url, "pid": pid}))
        tmp.replace(path)
    except OSError as err:  # a read-only home: status then needs --url
        logger.warning("could not write %s: %s", path, err)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == pid:
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def announced_url() -> Optional[str]:
    """The URL in the state file, if the server that wrote it still runs."""
    try:
        state = json.loads(state_file().read_text())
        url, pid = state["url"], int(state["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url if _alive(pid) else None


def head_url(given: Optional[str]) -> str:
    """The head a client command asks: ``given`` (--url), $MLXPIPE_URL, the state file, the default."""
    return given or os.environ.get("MLXPIPE_URL") or announced_url() or DEFAULT_URL
