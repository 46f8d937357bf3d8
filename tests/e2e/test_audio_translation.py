"""Speech in another language through the official openai client: multilingual Whisper base
(`whisper-base`) translates German speech to English (`/v1/audio/translations`) and transcribes
it in German when told the language (`language` on `/v1/audio/transcriptions`); the English-only
tiny.en refuses both with a 400 that says why.

The German clip is spoken by espeak-ng (`make espeak` installs it; without it the module is
skipped). espeak's German is robotic and Whisper base is small: measured here, the translation
reads "The weather is very nice today, I'll go with my gun in the park." and the transcript
"Das Meta ist heute sehr schön. Ich gehe mit meinem Fund in den Park.", so each is checked by a
few key words, most of which must come through. Both models load on their first request.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.server import ServerProcess, models_server

pytest.importorskip("faster_whisper")

pytestmark = [
    pytest.mark.e2e,
    # the openai client marks its translations call deprecated; the route is OpenAI's still
    pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning"),
    pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (make espeak)"),
]

GERMAN = "Das Wetter ist heute sehr schön. Ich gehe mit meinem Hund in den Park."
ENGLISH_WORDS = {"weather", "today", "park", "dog", "nice", "beautiful"}  # what it says, in English
GERMAN_WORDS = {"wetter", "heute", "sehr", "schön", "gehe", "meinem", "hund", "park"}

MODELS = """
[[model]]
id = "whisper-base"
source = "whisper-base"

[[model]]
id = "whisper-tiny.en"
source = "whisper-tiny.en"
"""


def words(text: str) -> set[str]:
    return set(re.sub(r"[^\w' ]", " ", text.lower()).split())


@pytest.fixture(scope="module")
def german_wav() -> bytes:
    spoken = subprocess.run(
        ["espeak-ng", "--stdout", "-v", "de", "-s", "150", "--", GERMAN],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return spoken.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with models_server(tmp_path_factory.mktemp("translation"), MODELS, threads=2) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_german_speech_is_translated_to_english(client: openai.OpenAI, german_wav: bytes) -> None:
    translation = client.audio.translations.create(
        model="whisper-base", file=("de.wav", german_wav), response_format="verbose_json"
    )
    assert translation.language == "english"
    assert len(words(translation.text) & ENGLISH_WORDS) >= 3, translation.text
    assert not words(translation.text) & GERMAN_WORDS - {"park"}, translation.text  # not German


def test_german_speech_is_transcribed_in_german_when_told_the_language(
    client: openai.OpenAI, german_wav: bytes
) -> None:
    transcript = client.audio.transcriptions.create(
        model="whisper-base", file=("de.wav", german_wav), language="de", response_format="verbose_json"
    )
    assert transcript.language == "german"
    assert len(words(transcript.text) & GERMAN_WORDS) >= 5, transcript.text


def test_the_english_only_model_refuses_translation_and_other_languages(
    client: openai.OpenAI, german_wav: bytes
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.translations.create(model="whisper-tiny.en", file=("de.wav", german_wav))
    error = caught.value.body
    assert (
        isinstance(error, dict) and error["param"] == "model" and error["code"] == "translation_unsupported"
    )
    assert "English only" in error["message"] and "multilingual" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(
            model="whisper-tiny.en", file=("de.wav", german_wav), language="de"
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "language" and "'de'" in error["message"]


def test_the_models_say_what_they_can_do(client: openai.OpenAI) -> None:
    models = {model.id: model.model_extra or {} for model in client.models.list()}
    base, tiny = models["whisper-base"]["capabilities"], models["whisper-tiny.en"]["capabilities"]
    assert base["tasks"] == ["transcribe", "translate"] and "de" in base["languages"]
    assert tiny["tasks"] == ["transcribe"]
