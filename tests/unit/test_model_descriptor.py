"""/v1/models' descriptor (argosy/api/openai/models.py): `n_ctx` beside `max_model_len`, the
`reasoning_effort` levels a chat template reads, and per-modality reasons that are the very
words a media part is refused with (argosy/chat/modalities.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models

from argosy.api.anthropic.wire import messages_from_wire
from argosy.api.openai.content import text_of_parts
from argosy.api.openai.models import model_json
from argosy.chat.modalities import MEDIA_REASONS
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.core.service import ModelInfo
from argosy.errors import InvalidRequestError

LEVELS_TEMPLATE = (
    "{% if reasoning_effort == 'high' %}Think hard.{% elif reasoning_effort in ['low', 'medium'] %}"
    "Think.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)
AS_GIVEN_TEMPLATE = "Reasoning: {{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _profile(source: str) -> ChatProfile:
    tokenizer = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    return ChatProfile(ChatTemplate(source), tokenizer)


@pytest.mark.parametrize(
    ("source", "levels"),
    [
        (LEVELS_TEMPLATE, ("high", "low", "medium")),
        (AS_GIVEN_TEMPLATE, ("low", "medium", "high")),
        (PLAIN_TEMPLATE, None),
    ],
    ids=["compared", "written-as-given", "not-read"],
)
def test_reasoning_effort_levels_are_what_the_template_reads(
    source: str, levels: tuple[str, ...] | None
) -> None:
    assert _profile(source).reasoning_effort_levels() == levels


def _info(**fields: Any) -> ModelInfo:
    values: dict[str, Any] = {
        "id": "m",
        "created": 0,
        "kind": "chat",
        "state": "loaded",
        "is_loaded": True,
        "context_length": 4096,
        "architecture": "Qwen2ForCausalLM",
        "dtype": "bfloat16",
        "quantization": None,
        "has_chat_template": True,
        "sampling_defaults": {},
    }
    return ModelInfo(**(values | fields))


def test_a_chat_model_descriptor() -> None:
    body = model_json(_info(reasoning_effort_levels=("low", "high")))
    assert body["n_ctx"] == body["max_model_len"] == body["capabilities"]["context_length"] == 4096
    capabilities = body["capabilities"]
    assert capabilities["reasoning_effort"] == ["low", "high"]
    assert capabilities["modalities"] == ["text"]
    assert capabilities["modality_support"] == {
        "text": True,
        "image": "no vision encoder",
        "audio": "no audio encoder",
        "video": "no video encoder",
        "file": "no document reader",
    }
    assert model_json(_info())["capabilities"]["reasoning_effort"] is None


def test_other_kinds_say_what_they_take() -> None:
    assert model_json(_info(kind="transcription"))["capabilities"]["modality_support"]["audio"] is True
    image = model_json(_info(kind="image"))["capabilities"]["modality_support"]
    assert image["image"] is True and image["audio"] == "no audio encoder"
    assert (
        model_json(_info(kind="embedding"))["capabilities"]["modality_support"]["image"]
        == "no vision encoder"
    )


@pytest.mark.parametrize(
    ("part", "medium"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
        ({"type": "file", "file": {"file_id": "f"}}, "file"),
    ],
)
def test_a_refused_part_gives_the_descriptor_reason(part: dict[str, Any], medium: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        text_of_parts([{"type": "text", "text": "hi"}, part], "messages[0].content")
    assert refused.value.param == "messages[0].content[1]"
    assert refused.value.message.endswith(f": {MEDIA_REASONS[medium]}.")
    assert model_json(_info())["capabilities"]["modality_support"][medium] == MEDIA_REASONS[medium]


def test_a_text_model_refuses_an_image_for_the_same_reason() -> None:
    """An image read from any dialect (here Anthropic's block) reaches a model without a vision
    encoder: refused naming the part, the model and the descriptor's reason."""
    import asyncio

    from argosy.core.vision import place_images

    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg==",
        },
    }
    images: list = []  # type: ignore[type-arg]
    messages_from_wire(None, [("user", [block])], images)

    class TextOnly:
        def vision_info(self) -> None:
            return None

    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(place_images(TextOnly(), "user: \ue0a0", images, list, "smollm2", 8))
    assert refused.value.param == "messages[0].content[0]"
    message = refused.value.message
    assert "does not accept images" in message and MEDIA_REASONS["image"] in message and "smollm2" in message
    garbage = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(InvalidRequestError, match="not an image this server can read"):
        messages_from_wire(None, [("user", [garbage])])
