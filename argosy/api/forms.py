"""Multipart form bodies (the audio upload routes), read into the same kind of body model the
JSON routes use.

OpenAI's clients send `multipart/form-data`: one file part and text fields; a list is the
same field repeated, named with or without `[]` (`timestamp_granularities[]`). Fields are
strings on the wire, so the body model reads them in pydantic's lax mode ("0.2" -> 0.2,
"true" -> True); a field it does not know is kept (named in x-argosy-degraded by the route).
A body that is not multipart, a malformed one, a file part where text belongs (or the other
way round) are 400s naming what is wrong. The body's size is bounded before this runs
(BodyLimitMiddleware: --max-audio-body-bytes on these routes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from argosy.api.errors import from_validation_error
from argosy.errors import InvalidRequestError

FormT = TypeVar("FormT", bound="FormModel")
MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 4


class FormModel(BaseModel):
    """A form body: lax types (form fields are text), unknown fields kept as extras."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


@dataclass(slots=True)
class Upload:
    data: bytes
    filename: str | None
    content_type: str | None


def _list_fields(model: type[BaseModel]) -> set[str]:
    return {
        name
        for name, field in model.model_fields.items()
        if getattr(field.annotation, "__origin__", None) is list or "list[" in str(field.annotation)
    }


async def read_form(
    request: Request, model: type[FormT], file_field: str = "file"
) -> tuple[FormT, Upload | None]:
    """The form's text fields as `model` and its file part (None when there is none)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise InvalidRequestError(
            f"This route takes multipart/form-data with a '{file_field}' part (as the OpenAI clients send "
            f"it), not {content_type.split(';')[0] or 'a body without a content type'}.",
            param=file_field,
        )
    try:
        # more file parts than the one allowed are read, so the error can name the field
        form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)
    except MultiPartException as exc:
        raise InvalidRequestError(
            f"The multipart body could not be read: {exc.message}", file_field
        ) from None
    except HTTPException as exc:  # Starlette's wrapping of the same, inside an app
        raise InvalidRequestError(f"The multipart body could not be read: {exc.detail}", file_field) from None
    lists = _list_fields(model)
    values: dict[str, Any] = {}
    upload: Upload | None = None
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if isinstance(value, UploadFile):
            if name != file_field:
                raise InvalidRequestError(f"'{name}' must be a text field, not a file.", param=name)
            if upload is not None:
                raise InvalidRequestError(f"'{file_field}' is given more than once.", param=file_field)
            upload = Upload(await value.read(), value.filename, value.content_type)
            await value.close()
            continue
        if name == file_field:
            raise InvalidRequestError(
                f"'{file_field}' must be a file part (an audio file).", param=file_field
            )
        if name in lists:
            values.setdefault(name, []).append(value)
        elif name in values:
            raise InvalidRequestError(f"'{name}' is given more than once.", param=name)
        else:
            values[name] = value
    await form.close()
    try:
        return model.model_validate(values), upload
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
