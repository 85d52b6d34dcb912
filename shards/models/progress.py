"""How far a long step is (fetching, converting, loading), for the person waiting.

On a terminal: a tqdm bar, as before. Anywhere else (a service, a log file):
plain log lines at INFO that say what is done and how far it is, at most one
every few seconds, with the first and the last always written.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

logger = logging.getLogger(__name__)


class Progress:
    """``what`` advancing towards ``total`` ``unit``s (``update``, ``set``, ``close``)."""

    def __init__(self, what: str, unit: str, total: Optional[int] = None, terminal: Optional[bool] = None,
                 every_s: float = 5.0):
        self.what, self.unit, self.total, self.every_s = what, unit, total, every_s
        self.n, self._logged = 0, 0.0
        self.bar = None
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self.bar = tqdm(desc=what, unit=unit, total=total, file=sys.stderr, unit_scale=unit == "B")
        else:
            logger.info("%s%s", what, f" ({self._amount(total)})" if total and unit == "B" else "")
            self._logged = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.set(self.n + n)

    def set(self, n: int, total: Optional[int] = None) -> None:
        """``n`` of ``total`` (when it is known only now) are done."""
        self.n, self.total = n, total or self.total
        if self.bar is not None:
            self.bar.total, self.bar.n = self.total, n
            self.bar.refresh()
        elif n == self.total or time.monotonic() - self._logged >= self.every_s:
            self._logged = time.monotonic()
            logger.info("%s: %s", self.what, self._amount(n, self.total))

    def _amount(self, n: int, total: Optional[int] = None) -> str:
        """``n`` (of ``total``) in the unit; bytes in MB."""
        if self.unit == "B":
            return f"{n / 1e6:.1f}" + (f" of {total / 1e6:.1f}" if total else "") + " MB"
        return f"{n}" + (f" of {total}" if total else "") + f" {self.unit}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
