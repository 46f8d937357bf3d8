"""The units a flag or a config file's value may carry: sizes (512M, 2G) and durations (30s,
5m, 30d)."""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdSMHD]?)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_byte_size(text: str) -> int:
    """'512M' -> 536870912; binary units; a plain number is bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 536870912, 512M or 2G)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(text: str) -> float:
    """'30d' -> 2592000.0; units s, m, h, d; a plain number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 600, 90s, 10m, 12h or 30d)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
