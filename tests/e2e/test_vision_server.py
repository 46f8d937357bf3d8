"""Image input on a real `argosy serve` of a tiny random LLaVA folder (tests/unit/test_llava.py's,
given a WordLevel tokenizer and a chat template), through the official openai, anthropic and
ollama clients: greedy tokens for a prompt with one image, and with two, equal transformers'
`LlavaForConditionalGeneration.generate` on the same prompt in float32; an image sent twice is
encoded once (/metrics); /v1/models says the model reads images; a bad image is a 400 in each
dialect's own shape naming its part, never a 500; image requests batched beside text-only ones
answer what they answer alone.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jinja2
import numpy as np
import ollama
import openai
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from tests.e2e.server import ServerProcess
from tests.e2e.test_metrics_server import scrape, value
from tests.unit.test_anthropic import assert_anthropic_error
from tests.unit.test_app_edges import assert_openai_error
from tests.unit.test_llava import IMAGE_TOKEN, PATCHES, TinyLlava, build_tiny_llava

pytestmark = [pytest.mark.e2e]

MODEL = "tiny-llava"
IMAGE_TEXT = "<image>"  # the tokenizer's text of IMAGE_TOKEN, what the server writes per image
MAX_TOKENS = 12
WORDS = ["<unk>", "user", "assistant", ":", "what", "is", "in", "this", "image", "?", "compare", "and"]
WORDS += ["the", "two", "images", "hello", "how", "are", "you", "tell", "me", "about", "it", "."]
# every other id a word of its own, so each generated token's text names its id
VOCAB = {word: i for i, word in enumerate(WORDS)} | {f"w{i}": i for i in range(len(WORDS), IMAGE_TOKEN)}
VOCAB[IMAGE_TEXT] = IMAGE_TOKEN
# no BOS, no EOS: every answer runs to its max_tokens
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
ASK = "what is in this image ?"
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
GARBAGE = b"not an image at all " * 25  # fixed bytes no image format reads: one message


def word_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(IMAGE_TEXT, special=True, normalized=False)])
    return tokenizer


TOKENIZER = word_level_tokenizer()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    tiny = build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    TOKENIZER.save(str(tiny.folder / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tiny.folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tiny


@pytest.fixture(scope="module")
def server(llava: TinyLlava) -> Iterator[ServerProcess]:
    # float32 as transformers' reference runs, so greedy tokens compare exactly
    process = ServerProcess(
        model=str(llava.folder),
        served_model_name=MODEL,
        kv_cache_memory="16M",
        extra_flags=["--dtype", "float32"],
    ).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gpt(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def llama(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def picture(seed: int, width: int = 40, height: int = 50) -> Any:
    """Seeded random RGB pixels (Pillow)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Any, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_url(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{b64(data)}"}}


def text(words: str) -> dict[str, str]:
    return {"type": "text", "text": words}


@torch.inference_mode()
def reference(llava: TinyLlava, contents: list[str], pictures: list[Any]) -> list[int]:
    """transformers' greedy tokens for user turns `contents` (IMAGE_TEXT where each image
    stands): the same template rendered, the image token expanded to the tower's rows."""
    prompt = jinja2.Template(TEMPLATE).render(
        messages=[{"role": "user", "content": content} for content in contents], add_generation_prompt=True
    )
    ids = [
        i
        for token in TOKENIZER.encode(prompt).ids
        for i in [token] * (PATCHES if token == IMAGE_TOKEN else 1)
    ]
    pixels = llava.processor(pictures, return_tensors="pt")["pixel_values"]  # type: ignore[operator]
    out = llava.reference.generate(  # type: ignore[operator]
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        pixel_values=pixels,
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return list(out[0, len(ids) :].tolist())


def words_of(ids: list[int]) -> list[str]:
    """The answer's words as the server detokenizes `ids` (an image token generated is special:
    not in the text)."""
    return str(TOKENIZER.decode(ids, skip_special_tokens=True)).split()


def chat_ids(gpt: openai.OpenAI, content: Any) -> list[int]:
    """The greedy answer's token ids to one user message, read from its logprobs' tokens."""
    completion = gpt.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        logprobs=True,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    ids = [VOCAB[entry.token] for entry in choice.logprobs.content]
    assert (choice.message.content or "").split() == words_of(ids)
    return ids


def test_openai_image_url_greedy_tokens_equal_transformers(llava: TinyLlava, gpt: openai.OpenAI) -> None:
    first, second = picture(1), picture(2, 64, 48)
    tokens = chat_ids(gpt, [text(ASK), image_url(encoded(first))])
    assert tokens == reference(llava, [ASK + IMAGE_TEXT], [first])
    # the image is read: another image behind the same words answers otherwise
    other = chat_ids(gpt, [text(ASK), image_url(encoded(second))])
    assert other == reference(llava, [ASK + IMAGE_TEXT], [second]) and other != tokens


def test_two_images_in_one_message_equal_transformers(llava: TinyLlava, gpt: openai.OpenAI) -> None:
    first, second = picture(3, 33, 33), picture(4)
    content = [text("compare"), image_url(encoded(first)), text("and"), image_url(encoded(second)), text("?")]
    tokens = chat_ids(gpt, content)
    assert tokens == reference(llava, [f"compare{IMAGE_TEXT}and{IMAGE_TEXT}?"], [first, second])


def test_anthropic_image_block_answers_transformers_text(
    llava: TinyLlava, claude: anthropic.Anthropic
) -> None:
    image = picture(5)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(encoded(image))},
    }
    message = claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}, block]}],  # type: ignore[misc,list-item]
        extra_body={"temperature": 0},  # SDK 2.x takes no sampling arguments
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == MAX_TOKENS
    answer = "".join(b.text for b in message.content if b.type == "text")
    assert answer.split() == words_of(reference(llava, [ASK + IMAGE_TEXT], [image]))


def test_ollama_images_stand_before_the_text(llava: TinyLlava, llama: ollama.Client) -> None:
    image = picture(6)
    reply = llama.chat(
        model=MODEL,
        messages=[{"role": "user", "content": ASK, "images": [encoded(image)]}],  # the client base64s bytes
        options={"temperature": 0, "num_predict": MAX_TOKENS},
        logprobs=True,
    )
    assert reply.logprobs is not None
    assert [VOCAB[entry.token] for entry in reply.logprobs] == reference(llava, [IMAGE_TEXT + ASK], [image])


def test_an_image_sent_twice_is_encoded_once(gpt: openai.OpenAI, http: httpx.Client) -> None:
    content = [text(ASK), image_url(encoded(picture(7)))]  # an image no other test sends
    before = scrape(http)
    answers = [chat_ids(gpt, content) for _ in range(2)]
    after = scrape(http)

    def rise(name: str) -> float:
        return value(after, name, model=MODEL) - value(before, name, model=MODEL)

    assert rise("argosy:images_encoded_total") == 1 and rise("argosy:image_cache_hits_total") == 1
    assert answers[0] == answers[1]


def test_the_model_says_it_reads_images(http: httpx.Client) -> None:
    capabilities = http.get(f"/v1/models/{MODEL}").json()["capabilities"]
    assert capabilities["modalities"] == ["text", "image"]
    listed = {model["id"]: model for model in http.get("/v1/models").json()["data"]}
    assert listed[MODEL]["capabilities"]["modalities"] == ["text", "image"]


def bad_images() -> dict[str, dict[str, Any]]:
    """Image parts the server must refuse, by what its message says is wrong."""
    from PIL import Image

    small = picture(8, 20, 20)
    # 49M one-bit pixels (over the 40M an image may have) in a few kilobytes of PNG
    huge = encoded(Image.new("1", (7000, 7000)))
    return {
        "no image format knows its bytes": image_url(GARBAGE),
        "truncated": image_url(encoded(small)[:60]),
        "in TIFF format": image_url(encoded(small, "TIFF"), "image/tiff"),
        "in ICO format": image_url(encoded(small, "ICO"), "image/x-icon"),
        "7000x7000 pixels": image_url(huge),
        "only data: URLs are read": {
            "type": "image_url",
            "image_url": {"url": "https://example.com/cat.png"},
        },
        "without ';base64'": {
            "type": "image_url",
            "image_url": {"url": f"data:image/png,{b64(encoded(small))}"},
        },
        "not valid base64": {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}},
    }


def test_bad_images_are_openai_400s_naming_the_part(http: httpx.Client) -> None:
    before = scrape(http)
    for says, part in bad_images().items():
        body = {"model": MODEL, "messages": [{"role": "user", "content": [text(ASK), part]}], **GREEDY}
        error = assert_openai_error(
            http.post("/v1/chat/completions", json=body), 400, "messages[0].content[1]"
        )
        assert error["type"] == "invalid_request_error", says
        assert "'messages[0].content[1]'" in error["message"] and says in error["message"], error
        assert "object at 0x" not in error["message"]  # no object address in the words
    nine = [image_url(encoded(picture(9, 20, 20)))] * 9  # one over --max-images-per-request (8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": nine}]}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "messages[0].content[8]")
    assert "at most 8" in error["message"]
    # each refused before the encoder ran
    assert value(scrape(http), "argosy:images_encoded_total", model=MODEL) == value(
        before, "argosy:images_encoded_total", model=MODEL
    )


def test_bad_images_through_the_clients_in_each_dialects_shape(
    gpt: openai.OpenAI, claude: anthropic.Anthropic, llama: ollama.Client, http: httpx.Client
) -> None:
    corrupt = GARBAGE  # no format's header
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [text(ASK), image_url(corrupt)]}],  # type: ignore[misc,list-item]
            max_tokens=4,
        )
    assert refused.value.status_code == 400 and refused.value.param == "messages[0].content[1]"

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(corrupt)}}
    anthropic_body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
    message = assert_anthropic_error(
        http.post("/v1/messages", json=anthropic_body), 400, "invalid_request_error"
    )
    assert "messages[0].content[0]" in message
    with pytest.raises(anthropic.BadRequestError) as rejected:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])  # type: ignore[misc,list-item]
    assert rejected.value.status_code == 400 and "messages[0].content[0]" in rejected.value.message
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    refused_url = http.post(
        "/v1/messages", json=anthropic_body | {"messages": [{"role": "user", "content": [remote]}]}
    )
    assert "only data: URLs" in assert_anthropic_error(refused_url, 400, "invalid_request_error")

    with pytest.raises(ollama.ResponseError) as failed:
        llama.chat(model=MODEL, messages=[{"role": "user", "content": ASK, "images": [corrupt]}])
    assert failed.value.status_code == 400 and "messages[0].images[0]" in failed.value.error
    raw = http.post(
        "/api/chat",
        json={"model": MODEL, "messages": [{"role": "user", "content": ASK, "images": [b64(corrupt)]}]},
    )
    assert (
        raw.status_code == 400
        and set(raw.json()) == {"error"}
        and "messages[0].images[0]" in raw.json()["error"]
    )


def test_image_requests_batched_with_text_only_ones_answer_as_alone(gpt: openai.OpenAI) -> None:
    contents: list[Any] = [
        [text(ASK), image_url(encoded(picture(10)))],
        [image_url(encoded(picture(11, 50, 40))), text("describe it .")],
        "how are you ?",
        "tell me about the two images .",
    ]
    alone = [chat_ids(gpt, content) for content in contents]
    for _ in range(2):  # each time all four at once, so their steps are shared
        with ThreadPoolExecutor(len(contents)) as pool:
            together = list(pool.map(lambda content: chat_ids(gpt, content), contents))
        assert together == alone


def test_responses_input_image_answers_transformers_and_is_kept_for_the_next_turn(
    llava: TinyLlava, gpt: openai.OpenAI, http: httpx.Client
) -> None:
    image = picture(11)
    url = image_url(encoded(image))["image_url"]["url"]
    first = gpt.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": ASK}, {"type": "input_image", "image_url": url}],
            }
        ],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    assert first.output_text.split() == words_of(reference(llava, [ASK + IMAGE_TEXT], [image]))
    before = scrape(http)
    # the next turn reads the stored image again: its features come from the cache
    second = gpt.responses.create(
        model=MODEL, previous_response_id=first.id, input=ASK, temperature=0, max_output_tokens=MAX_TOKENS
    )
    after = scrape(http)

    def rise(name: str) -> float:
        return value(after, name, model=MODEL) - value(before, name, model=MODEL)

    assert second.status == "incomplete" and second.output_text  # its 12 tokens ran out: not an error
    assert rise("argosy:image_cache_hits_total") == 1 and rise("argosy:images_encoded_total") == 0


def test_ollama_generate_images_stand_before_the_prompt(llava: TinyLlava, llama: ollama.Client) -> None:
    image = picture(12)
    reply = llama.generate(
        model=MODEL,
        prompt=ASK,
        images=[encoded(image)],
        options={"temperature": 0, "num_predict": MAX_TOKENS},
        logprobs=True,
    )
    assert reply.logprobs is not None
    assert [VOCAB[entry.token] for entry in reply.logprobs] == reference(llava, [IMAGE_TEXT + ASK], [image])
