"""The package's layers, enforced: a file that imports across a boundary fails here at once.

    api/  -> core/ -> engine/ <-> runner/ -> models/ -> ops/
    (chat/ and sessions/ are leaves the core uses; nothing below the core knows HTTP or the
    core; only the core talks to an engine; the runner executes the engine's scheduler
    output, so those two share its plain data)

Every import counts, including ones inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "argosy"

# layer -> the argosy subpackages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "engine": ("api", "core"),
    "runner": ("api", "core"),
    "models": ("api", "core", "engine", "runner"),
    "ops": ("api", "core", "engine", "runner", "models"),
    "chat": ("api", "core", "engine", "runner"),
    "sessions": ("api", "core", "engine", "runner"),
    "api": ("engine", "runner"),
    # the fleet is a loader and an EngineClient beside the local ones: below the HTTP edge
    "fleet": ("api",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from argosy import engine` names the subpackage in the alias
            if node.module == "argosy":
                found += [(node.lineno, f"argosy.{alias.name}") for alias in node.names]
    return found


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "argosy" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_stay_below_it(layer: str) -> None:
    assert (PACKAGE / layer).is_dir()
    assert violations(layer) == []


def test_the_checker_sees_a_crossing(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from argosy.core.service import ModelService\n"
        "def f():\n    import argosy.api.app\n"
    )
    assert [m for _, m in imported_modules(probe)] == [
        "__future__",
        "typing",
        "argosy.core.service",
        "argosy.api.app",
    ]


DIALECTS = ("openai", "anthropic", "ollama")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_dialect_imports_no_other_dialect(dialect: str) -> None:
    """Each dialect translates in and renders out on its own; what they share is in api/
    itself (wire.py, framing.py, errors.py, route.py)."""
    others = [f"argosy.api.{other}" for other in DIALECTS if other != dialect]
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted((PACKAGE / "api" / dialect).rglob("*.py"))
        for line, module in imported_modules(path)
        if any(module == other or module.startswith(other + ".") for other in others)
    ]
    assert (PACKAGE / "api" / dialect).is_dir()
    assert bad == []
