"""`argosy serve --config argosy.toml`: every setting from one TOML file, filling what the
command line left unset (flags given there win). Keys are the flags' names (`max_num_seqs` or
`max-num-seqs`); `model` is a model or a list of them (as --model) or [[model]] tables (as in
a models.toml); `models` is a models.toml (as --models). A bad file stops start-up naming the
file, the key and the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

from argosy.cli import _HIDDEN_FIELDS, _field_parser
from argosy.commands.model_specs import specs_from_tables
from argosy.config import EngineConfig, OperatorSampling, ServerConfig
from argosy.errors import ArgosyError

CONFIG_CLASSES = (EngineConfig, ServerConfig, OperatorSampling)


def _config_value(cls: type, field: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """A config file's value for `field`: TOML's own type, or a string the flag would take."""
    hint = typing.get_type_hints(cls)[field.name]
    if typing.get_origin(hint) is list:
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ArgosyError(f"{where}: expected a string or a list of strings, got {value!r}")
        return values
    if hint is bool:
        if not isinstance(value, bool):
            raise ArgosyError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            return _field_parser(cls, field)(value)
        except (ValueError, ArgosyError) as exc:
            raise ArgosyError(f"{where}: {exc}") from None
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)] or [hint]
    if isinstance(value, bool) or not isinstance(value, tuple(arms) + ((int,) if float in arms else ())):
        raise ArgosyError(f"{where}: expected {' or '.join(a.__name__ for a in arms)}, got {value!r}")
    return value


def apply_config_file(args: argparse.Namespace, path: str) -> None:
    """Fill what the command line left unset from a TOML config file (flags win). Its keys are
    the flags' names (`max_num_seqs` or `max-num-seqs`), `model` a model or a list (as
    --model; or [[model]] tables, as in a models.toml) and `models` a models.toml."""
    import tomllib

    try:
        document = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise ArgosyError(f"{path}: cannot read it: {exc}", param="config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ArgosyError(f"{path}: not valid TOML: {exc}", param="config") from None
    fields = {
        field.name: (cls, field)
        for cls in CONFIG_CLASSES
        for field in dataclasses.fields(cls)
        if field.name not in _HIDDEN_FIELDS
    }
    for key, value in document.items():
        name = key.replace("-", "_")
        where = f"{path}: key {key!r}"
        if name == "model":
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                if getattr(args, "models", None) is None:
                    args.config_specs = specs_from_tables(value, path, "config")
                continue
            models = [value] if isinstance(value, str) else value
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ArgosyError(
                    f"{where}: expected a model, a list of models or [[model]] tables", "config"
                )
            if getattr(args, "models", None) is None:
                args.models = models
            continue
        if name == "models":
            if not isinstance(value, str):
                raise ArgosyError(f"{where}: expected the path of a models.toml", "config")
            if getattr(args, "models_file", None) is None:
                args.models_file = value
            continue
        if name not in fields:
            raise ArgosyError(f"{where}: no such setting (see argosy serve --help)", "config")
        cls, field = fields[name]
        dest = f"{cls.__name__}.{name}"
        if not hasattr(args, dest):  # a flag given on the command line wins
            try:
                setattr(args, dest, _config_value(cls, field, value, where))
            except ArgosyError as exc:
                raise ArgosyError(exc.message, "config") from None
