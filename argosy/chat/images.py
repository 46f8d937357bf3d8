"""Images in chat messages, as the dialects send them, read once and checked before any model
is touched: a `data:` URL (OpenAI's `image_url`, Responses' `input_image`) or base64 (Anthropic's
image blocks, Ollama's `images`). A remote URL is refused (nothing is fetched), and so are a
corrupt image, a format Pillow cannot read, too many bytes or pixels: each a 400 naming the
part. The image's place in its message's text is IMAGE_SENTINEL, which the core replaces with
the model's own image token once the chat template has written the prompt (so any template
carries it: one that reads only string contents included).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

from argosy.errors import InvalidRequestError

IMAGE_SENTINEL = "\ue0a0"  # a private-use character: where an image stood in a message's text
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000  # width x height; Pillow's own bomb guard is ~89M
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(
    r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I
)


@dataclass(frozen=True, slots=True)
class ImagePart:
    where: str  # the client's field (`messages[0].content[1]`)
    data: bytes  # the image file's bytes
    width: int
    height: int
    format: str = "PNG"  # Pillow's name of its format

    @property
    def digest(self) -> bytes:
        """What keys its features (encoded once) and the prefix cache's blocks that hold them."""
        return hashlib.sha256(self.data).digest()

    def open(self) -> Any:
        """The decoded image (Pillow), RGB."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")


def image_from_url(url: Any, where: str) -> ImagePart:
    """An image_url's `url`: a data: URL only (a remote URL is refused, never fetched)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"'{where}' needs a string url (a data: URL).", where)
    match = _DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a relative path"
        raise InvalidRequestError(
            f"'{where}' is a {scheme} URL; only data: URLs are read (this server fetches nothing): "
            "send the image as data:image/png;base64,...",
            where,
        )
    if not match.group("b64"):
        raise InvalidRequestError(f"'{where}' is a data: URL without ';base64'.", where)
    return image_from_base64(url[match.end() :], where)


def image_from_base64(data: Any, where: str) -> ImagePart:
    """Base64 text (Anthropic's `source.data`, an Ollama `images` entry) as a checked image."""
    if not isinstance(data, str) or not data:
        raise InvalidRequestError(f"'{where}' needs the image as a base64 string.", where)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequestError(f"'{where}' is over {MAX_IMAGE_BYTES // 2**20} MiB.", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"'{where}' is not valid base64.", where) from None
    return checked_image(raw, where)


def checked_image(raw: bytes, where: str) -> ImagePart:
    from PIL import Image, UnidentifiedImageError

    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"'{where}' is over {MAX_IMAGE_BYTES // 2**20} MiB.", where)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            kind, (width, height) = image.format, image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"'{where}' is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS:,} an image may have.",
                    where,
                )
            if kind not in FORMATS:
                raise InvalidRequestError(
                    f"'{where}' is an image in {kind} format; the formats read are {', '.join(FORMATS)}.",
                    where,
                )
            image.load()  # a truncated or corrupt file fails here, not in the encoder
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:  # its own text names the BytesIO object, an address per request
        raise InvalidRequestError(
            f"'{where}' is not an image this server can read: no image format knows its bytes.", where
        ) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"'{where}' is not an image this server can read: {exc}.", where) from None
    return ImagePart(where, raw, width, height, str(kind))


def check_count(images: list[ImagePart], limit: int) -> None:
    if len(images) > limit:
        raise InvalidRequestError(
            f"This request holds {len(images)} images; at most {limit} are allowed (--max-images-per-request).",
            images[limit].where,
        )
