"""Transcript segments as subtitle files: SubRip (`srt`) and WebVTT (`vtt`).

SRT numbers its cues from 1 and writes times as HH:MM:SS,mmm; WebVTT starts with the
`WEBVTT` line and writes HH:MM:SS.mmm. Cues are separated by a blank line; text is the
segment's, trimmed (a cue's text never holds the blank line that would end it early).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Cue(Protocol):
    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...

    @property
    def text(self) -> str: ...


def timestamp(seconds: float, separator: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _cue_text(text: str) -> str:
    return "\n".join(line for line in text.strip().splitlines() if line.strip())


def srt(cues: Sequence[Cue]) -> str:
    blocks = [
        f"{number}\n{timestamp(cue.start, ',')} --> {timestamp(cue.end, ',')}\n{_cue_text(cue.text)}\n"
        for number, cue in enumerate(cues, start=1)
    ]
    return "\n".join(blocks)


def vtt(cues: Sequence[Cue]) -> str:
    blocks = [
        f"{timestamp(cue.start, '.')} --> {timestamp(cue.end, '.')}\n{_cue_text(cue.text)}\n" for cue in cues
    ]
    return "\n".join(["WEBVTT\n", *blocks])
