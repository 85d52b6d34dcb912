"""Sizes and rates as people type them: '192GB', '144 GiB', '800GB/s', '3x192GB,64GB'.

Neutral ground: the node (``--memory``) and the head (``--weights-rate``,
``mlxpipe plan``) both read them.
"""

from __future__ import annotations

import re
from typing import List

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '192GB', '144 GiB', '1.5TB', '512MB' (GB = 1e9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number and a unit, e.g. 192GB or 144GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bandwidth(text: str) -> float:
    """Bytes per second from '800GB/s' (the '/s' may be left out)."""
    return float(parse_size(re.sub(r"/s\s*$", "", text.strip())))


def expand_list(text: str) -> List[str]:
    """'3x192GB,64GB' -> ['192GB', '192GB', '192GB', '64GB']."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\s*[x*]\s*(.+)", item)
        out.extend([m.group(2)] * int(m.group(1)) if m else [item])
    return out


def gb(n: float) -> str:
    """Bytes as '12.3 GB'."""
    return f"{n / 1e9:.1f} GB"
