"""Start `mlxpipe serve` as a real process and wait until it is ready."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx


class ServerProcess:
    """``capture_log``: its stderr is kept in ``log`` (lines, as they come) and still shown."""

    def __init__(self, *args: str, timeout: float = 180, headers=None, env=None, capture_log: bool = False):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE if capture_log else None, text=True, env=env)
        self.log: list = []
        if capture_log:
            threading.Thread(target=self._keep_log, daemon=True).start()
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"server failed to start: {line!r}")
        self.base_url = line.split(" on ")[1].strip()          # http://127.0.0.1:PORT/v1
        self.root = self.base_url.removesuffix("/v1")
        self.banner = [line]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.root}/health", timeout=5, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server never became healthy")

    def _keep_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
