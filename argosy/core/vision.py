"""A chat's images into its prompt: the model's image token where each image stood, expanded to
one token per feature row, and the features themselves (encoded where the engine runs, each
image once: a repeated image is a cache hit).

The chat template writes the prompt with IMAGE_SENTINEL where each image part stood (whatever
the template does with string contents); here the sentinel becomes the model's own image token
(llava-hf's `<image>`), the prompt is tokenized, and each image token becomes the encoder's
number of feature rows, each row's embedding later replaced by the image's feature
(engine/sequence.py ImagePlacement). A model without a vision encoder refuses the first image
part in the words every dialect uses for media (chat/modalities.py).
"""

from __future__ import annotations

from typing import Any

from argosy.chat.images import IMAGE_SENTINEL, ImagePart, check_count
from argosy.chat.modalities import media_refusal
from argosy.engine.sequence import ImagePlacement
from argosy.errors import InvalidRequestError


async def place_images(
    engine: Any, prompt_text: str, images: list[ImagePart], tokenize: Any, model_id: str, limit: int
) -> tuple[list[int], list[ImagePlacement]]:
    """(prompt ids with each image's tokens expanded, the images' placements)."""
    check_count(images, limit)
    vision = getattr(engine, "vision_info", lambda: None)()
    if vision is None:
        refusal = media_refusal("images", images[0].where, "image", "image")
        raise InvalidRequestError(f"{refusal} (model '{model_id}')", images[0].where)
    token_id, token_text, rows = vision
    if prompt_text.count(IMAGE_SENTINEL) != len(images):
        raise InvalidRequestError(
            f"The model's chat template wrote {prompt_text.count(IMAGE_SENTINEL)} of the request's "
            f"{len(images)} images (it drops content of some messages?).",
            images[0].where,
        )
    ids: list[int] = tokenize(prompt_text.replace(IMAGE_SENTINEL, token_text))
    at = [i for i, token in enumerate(ids) if token == token_id]
    if len(at) != len(images):
        raise InvalidRequestError(
            f"The prompt holds {len(at)} image tokens for {len(images)} images (an image token written "
            "in a message's text?).",
            images[0].where,
        )
    features = await engine.encode_images(images)
    expanded: list[int] = []
    placements: list[ImagePlacement] = []
    previous = 0
    for position, image, embeds in zip(at, images, features, strict=True):
        expanded += ids[previous:position]
        placements.append(ImagePlacement(len(expanded), embeds, image.digest))
        expanded += [token_id] * rows
        previous = position + 1
    expanded += ids[previous:]
    return expanded, placements
