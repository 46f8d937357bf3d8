"""IncrementalDetokenizer against real tokenizers: a byte-level BPE trained here, a Metaspace
BPE (leading-space context) and the SmolLM2 tokenizer (built from the packaged GGUF).

The reference for every streaming result is non-streaming: decode the ids one prefix at a time;
the first prefix whose (complete) text holds a stop string ends the output, cut before the
earliest-starting stop in it. Streamed deltas must add up to exactly that."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from argosy.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer

REPLACEMENT = "\ufffd"
END = "<|end|>"

CORPUS = [
    "hello world, héllo wörld! 日本語のテキスト and 🙂 smiles.",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ça va? naïve café.",
    "def main():\n    print('hello world')\n    return 42\n",
    "Привет мир. Γειά σου κόσμε. مرحبا بالعالم. 你好，世界！",
    "hello there, hello world, hello again; say hello to everyone.",
]
# The alphabet of the random texts: ASCII, accents, CJK, emoji (some never seen in training,
# so they stay split over several byte tokens).
ALPHABET = list("abcdefghij klmnop,.!?\n") + list("éöüçñ日本語テキ你好世界") + ["🙂", "🚀", "👍🏽", "龍", "𝄞"]


def _byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


def _metaspace_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    tokenizer.train_from_iterator(["hello world and hello there"] * 20, trainer)
    return tokenizer


BYTE_LEVEL = _byte_level_bpe()


@pytest.fixture(params=["byte_level_bpe", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "byte_level_bpe":
        return BYTE_LEVEL
    folder = request.getfixturevalue("smollm2_tokenizer_dir")  # only when this param runs
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def _chunks(token_ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """One id per chunk, or random chunk sizes (1..5, sometimes empty)."""
    if rng is None:
        return [[token_id] for token_id in token_ids]
    chunks, start = [], 0
    while start < len(token_ids):
        size = rng.choice([0, 1, 2, 3, 5])
        chunks.append(token_ids[start : start + size])
        start += size
    return chunks


def _stream(
    detokenizer: IncrementalDetokenizer, token_ids: list[int], rng: random.Random | None = None
) -> tuple[list[DetokenizerStep], str]:
    """Feed the ids (as `_chunks` splits them) until a stop; return the steps and the flush."""
    steps = []
    for chunk in _chunks(token_ids, rng):
        step = detokenizer.feed(chunk)
        steps.append(step)
        if step.stop_string is not None:
            return steps, detokenizer.flush()
    return steps, detokenizer.flush()


def _reference(
    tokenizer: Tokenizer,
    token_ids: list[int],
    stop: list[str],
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
) -> tuple[str, str | None, int]:
    """(text, stop string, number of ids used), decoding without streaming."""
    for num_ids in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:num_ids], skip_special_tokens=skip_special_tokens)
        if text.endswith(REPLACEMENT):
            continue  # an incomplete character: its text is not known yet
        found = [(text.find(s), len(s), s) for s in stop if s in text]
        if found:
            start, length, stop_string = min(found)
            cut = start + length if include_stop_str_in_output else start
            return text[:cut], stop_string, num_ids
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens), None, len(token_ids)


def _run(
    tokenizer: Tokenizer,
    text: str,
    stop: list[str] | None = None,
    include_stop_str_in_output: bool = False,
    rng: random.Random | None = None,
) -> tuple[list[DetokenizerStep], str, IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(
        tokenizer, [], stop=stop or [], include_stop_str_in_output=include_stop_str_in_output
    )
    steps, flushed = _stream(detokenizer, tokenizer.encode(text).ids, rng)
    return steps, flushed, detokenizer


def _streamed_text(steps: list[DetokenizerStep], flushed: str) -> str:
    return "".join(step.text_delta for step in steps) + flushed


def _split_char_ids(tokenizer: Tokenizer, char: str) -> list[int]:
    ids = tokenizer.encode(char).ids
    assert len(ids) > 1, f"{char!r} must span several tokens for this test"
    return ids


# --- round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["one_by_one", "random_chunks"])
def test_round_trip_equals_decode_of_all_ids(tokenizer: Tokenizer, chunked: bool) -> None:
    rng = random.Random(1234)
    for _ in range(120):
        text = _random_text(rng, rng.randint(0, 40))
        token_ids = tokenizer.encode(text).ids
        detokenizer = IncrementalDetokenizer(tokenizer, [])
        steps, flushed = _stream(detokenizer, token_ids, rng if chunked else None)
        expected = tokenizer.decode(token_ids)
        assert _streamed_text(steps, flushed) == expected
        assert detokenizer.text == expected
        assert flushed == ""  # every character completed before the end
        assert all(REPLACEMENT not in step.text_delta for step in steps)
        assert sum(step.num_tokens_consumed for step in steps) == len(token_ids)


def test_round_trip_of_corpus_and_code(tokenizer: Tokenizer) -> None:
    for text in CORPUS:
        steps, flushed, _ = _run(tokenizer, text)
        assert _streamed_text(steps, flushed) == text


def test_split_character_is_emitted_whole_by_its_last_token() -> None:
    emoji_ids = _split_char_ids(BYTE_LEVEL, "🚀")
    token_ids = BYTE_LEVEL.encode("ab").ids + emoji_ids + BYTE_LEVEL.encode("cd").ids
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [])
    deltas = [detokenizer.feed([token_id]).text_delta for token_id in token_ids]
    num_ab = len(BYTE_LEVEL.encode("ab").ids)
    emoji_deltas = deltas[num_ab : num_ab + len(emoji_ids)]
    assert emoji_deltas == [""] * (len(emoji_ids) - 1) + ["🚀"]
    assert "".join(deltas) == "ab🚀cd"
    assert detokenizer.flush() == ""


def test_characters_split_over_tokens_never_emit_replacement_mid_stream(tokenizer: Tokenizer) -> None:
    text = "龍🚀x👍🏽日本語𝄞 🙂"
    token_ids = tokenizer.encode(text).ids
    assert any(REPLACEMENT in tokenizer.decode([token_id]) for token_id in token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.feed([token_id]).text_delta for token_id in token_ids]
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) + detokenizer.flush() == text


def test_incomplete_character_at_the_end_is_flushed_as_decode_renders_it() -> None:
    token_ids = BYTE_LEVEL.encode("ab🚀").ids[:-1]
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [])
    step = detokenizer.feed(token_ids)
    assert step.text_delta == "ab"
    flushed = detokenizer.flush()
    assert flushed.startswith(REPLACEMENT)
    assert "ab" + flushed == BYTE_LEVEL.decode(token_ids)
    assert detokenizer.text == BYTE_LEVEL.decode(token_ids)


# --- prompt context ------------------------------------------------------------------------


def test_prompt_context_keeps_the_leading_space_of_a_metaspace_tokenizer() -> None:
    tokenizer = _metaspace_bpe()
    prompt_ids = tokenizer.encode("hello").ids
    generated_ids = tokenizer.encode("hello world there").ids[len(prompt_ids) :]
    assert tokenizer.decode(generated_ids) == "world there"  # stand-alone: the space is lost
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    steps, flushed = _stream(detokenizer, generated_ids)
    assert _streamed_text(steps, flushed) == " world there"
    full = tokenizer.decode(prompt_ids + generated_ids)
    assert full == tokenizer.decode(prompt_ids) + " world there"


def test_prompt_text_is_never_emitted(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("héllo wörld 日本語 🙂").ids
    generated_ids = tokenizer.encode(" and more 🚀").ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    steps, flushed = _stream(detokenizer, generated_ids)
    full = tokenizer.decode(prompt_ids + generated_ids)
    assert _streamed_text(steps, flushed) == full[len(tokenizer.decode(prompt_ids)) :] == " and more 🚀"


def test_prompt_ending_inside_a_character_is_completed_by_the_first_token() -> None:
    char_ids = _split_char_ids(BYTE_LEVEL, "🚀")
    prompt_ids = BYTE_LEVEL.encode("say ").ids + char_ids[:1]
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, prompt_ids)
    first = detokenizer.feed(char_ids[1:])
    assert first.text_delta == "🚀"
    rest = detokenizer.feed(BYTE_LEVEL.encode(" ok").ids)
    assert rest.text_delta == " ok"
    assert detokenizer.flush() == ""


def test_prompt_ending_inside_a_character_with_no_output_flushes_nothing() -> None:
    prompt_ids = BYTE_LEVEL.encode("say ").ids + _split_char_ids(BYTE_LEVEL, "🚀")[:1]
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, prompt_ids)
    assert detokenizer.feed([]) == DetokenizerStep("", None, 0)
    assert detokenizer.flush() == ""
    assert detokenizer.text == ""


# --- stop strings --------------------------------------------------------------------------


def test_stop_string_inside_one_token_cuts_in_its_middle() -> None:
    token_ids = BYTE_LEVEL.encode("say hello").ids
    assert BYTE_LEVEL.decode(token_ids[-1:]) == " hello"  # one token holds the whole word
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["ll"])
    step = detokenizer.feed(token_ids)
    assert step == DetokenizerStep("say he", "ll", len(token_ids))
    assert detokenizer.stop_string == "ll"
    assert detokenizer.flush() == ""
    assert detokenizer.text == "say he"


def test_stop_string_spanning_tokens() -> None:
    token_ids = BYTE_LEVEL.encode("hello world again").ids
    assert BYTE_LEVEL.decode(token_ids[:2]) == "hello world"  # "o wo" spans the two tokens
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["o wo"])
    deltas = []
    for token_id in token_ids:
        step = detokenizer.feed([token_id])
        deltas.append(step.text_delta)
        if step.stop_string:
            break
    assert deltas == ["hell", ""]  # "o" held back until " world" completes the stop
    assert step.stop_string == "o wo"
    assert detokenizer.feed(token_ids[2:]) == DetokenizerStep("", None, 0)
    assert detokenizer.flush() == ""


def test_stop_string_spanning_many_tokens_of_a_split_character() -> None:
    text = "ab🚀cd"
    steps, flushed, detokenizer = _run(BYTE_LEVEL, text, stop=["b🚀c"])
    assert _streamed_text(steps, flushed) == "a"
    assert detokenizer.stop_string == "b🚀c"


def test_stop_string_at_the_very_start() -> None:
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["hel"])
    token_ids = BYTE_LEVEL.encode("hello world").ids
    assert detokenizer.feed(token_ids) == DetokenizerStep("", "hel", 1)
    assert detokenizer.text == ""


def test_earliest_starting_stop_wins_whatever_the_list_order() -> None:
    for stop in (["world", "llo w"], ["llo w", "world"]):
        steps, flushed, detokenizer = _run(BYTE_LEVEL, "hello world", stop=stop)
        assert _streamed_text(steps, flushed) == "he"
        assert detokenizer.stop_string == "llo w"


def test_earlier_starting_stop_that_ends_later_in_the_same_token_wins() -> None:
    token_ids = BYTE_LEVEL.encode("say hello").ids
    assert BYTE_LEVEL.decode(token_ids[-1:]) == " hello"
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["ell", " hello"])
    assert detokenizer.feed(token_ids) == DetokenizerStep("say", " hello", len(token_ids))


def test_stops_starting_at_the_same_place_the_shorter_wins() -> None:
    steps, flushed, detokenizer = _run(
        BYTE_LEVEL, "hello world", stop=["o world", "o w"], include_stop_str_in_output=True
    )
    assert _streamed_text(steps, flushed) == "hello w"
    assert detokenizer.stop_string == "o w"


def test_include_stop_str_in_output() -> None:
    steps, flushed, detokenizer = _run(
        BYTE_LEVEL, "hello world again", stop=["o wo"], include_stop_str_in_output=True
    )
    assert _streamed_text(steps, flushed) == "hello wo"
    assert detokenizer.text == "hello wo"


def test_partial_stop_prefix_is_held_back_then_released_when_it_breaks() -> None:
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["hello there"])
    deltas = [detokenizer.feed([token_id]).text_delta for token_id in BYTE_LEVEL.encode("hello world").ids]
    assert deltas == ["", "hello world"]
    assert detokenizer.flush() == ""


def test_partial_stop_prefix_that_never_completes_is_flushed_at_the_end() -> None:
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["help me"])
    step = detokenizer.feed(BYTE_LEVEL.encode("say hel").ids)
    assert step.text_delta == "say "
    assert step.stop_string is None
    assert detokenizer.flush() == "hel"
    assert detokenizer.text == "say hel"
    assert detokenizer.stop_string is None


def test_num_tokens_consumed_counts_up_to_the_stop() -> None:
    token_ids = BYTE_LEVEL.encode("hello world again and again").ids
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=["world"])
    step = detokenizer.feed(token_ids)
    assert BYTE_LEVEL.decode(token_ids[: step.num_tokens_consumed]) == "hello world"
    assert step.text_delta == "hello "
    assert step.num_tokens_consumed < len(token_ids)


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_streamed_text_equals_the_non_streaming_cut(
    tokenizer: Tokenizer, include_stop_str_in_output: bool
) -> None:
    rng = random.Random(99)
    num_stopped = 0
    for _ in range(150):
        text = _random_text(rng, rng.randint(1, 40))
        token_ids = tokenizer.encode(text).ids
        stop = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7 and len(text) > 1:  # mostly substrings, so stops do happen
                start = rng.randrange(len(text) - 1)
                stop.append(text[start : start + rng.randint(1, 4)])
            else:
                stop.append(_random_text(rng, rng.randint(1, 3)))
        detokenizer = IncrementalDetokenizer(
            tokenizer, [], stop=stop, include_stop_str_in_output=include_stop_str_in_output
        )
        steps, flushed = _stream(detokenizer, token_ids, rng)
        expected_text, expected_stop, expected_num_ids = _reference(
            tokenizer, token_ids, stop, include_stop_str_in_output
        )
        assert _streamed_text(steps, flushed) == expected_text, (text, stop)
        assert detokenizer.text == expected_text
        assert detokenizer.stop_string == expected_stop
        assert sum(step.num_tokens_consumed for step in steps) == expected_num_ids
        assert all(REPLACEMENT not in step.text_delta for step in steps)
        num_stopped += expected_stop is not None
    assert num_stopped > 50


def test_overlapping_stops_over_a_two_letter_alphabet() -> None:
    """Self-overlapping stops ("aab" in "aaab") need the matcher's failure links."""
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 30)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        token_ids = BYTE_LEVEL.encode(text).ids
        detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], stop=stop)
        steps, flushed = _stream(detokenizer, token_ids, rng)
        expected_text, expected_stop, _ = _reference(BYTE_LEVEL, token_ids, stop)
        assert (_streamed_text(steps, flushed), detokenizer.stop_string) == (expected_text, expected_stop)


def test_emitted_text_never_ends_inside_a_possible_stop(tokenizer: Tokenizer) -> None:
    stop = ["hello there", "🙂!"]
    token_ids = tokenizer.encode("hello world 🙂 hello thermos 🙂?").ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stop)
    for token_id in token_ids:
        detokenizer.feed([token_id])
        emitted = detokenizer.text
        for stop_string in stop:
            for length in range(1, len(stop_string)):
                assert not emitted.endswith(stop_string[:length])
    assert detokenizer.text + detokenizer.flush() == "hello world 🙂 hello thermos 🙂?"


# --- special tokens ------------------------------------------------------------------------


def _ids_with_special_token() -> list[int]:
    end_id = BYTE_LEVEL.token_to_id(END)
    assert end_id is not None
    return BYTE_LEVEL.encode("hi").ids + [end_id] + BYTE_LEVEL.encode(" there").ids


@pytest.mark.parametrize(("skip_special_tokens", "expected"), [(True, "hi there"), (False, f"hi{END} there")])
def test_skip_special_tokens(skip_special_tokens: bool, expected: str) -> None:
    token_ids = _ids_with_special_token()
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [], skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.feed([token_id]).text_delta for token_id in token_ids]
    assert "".join(deltas) + detokenizer.flush() == expected
    assert expected == BYTE_LEVEL.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_matches_a_special_token_only_when_it_is_rendered() -> None:
    token_ids = _ids_with_special_token()
    shown = IncrementalDetokenizer(BYTE_LEVEL, [], skip_special_tokens=False, stop=[END])
    assert shown.feed(token_ids) == DetokenizerStep("hi", END, len(BYTE_LEVEL.encode("hi").ids) + 1)
    skipped = IncrementalDetokenizer(BYTE_LEVEL, [], skip_special_tokens=True, stop=[END])
    assert skipped.feed(token_ids) == DetokenizerStep("hi there", None, len(token_ids))


# --- a decoder that rewrites emitted text --------------------------------------------------


class _CapitalizeBefore:
    """A custom decoder whose "^" token upper-cases the token before it: decoding is not
    prefix-stable, which DecodeStream rejects with an exception."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        pieces: list[str] = []
        for token in tokens:
            if token == "^" and pieces:
                pieces[-1] = pieces[-1].upper()
                pieces.append("")
            else:
                pieces.append(token)
        return pieces


def test_decoder_that_rewrites_emitted_text_does_not_break_the_stream() -> None:
    vocab = {"[UNK]": 0, "ab": 1, "^": 2, "cd": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.Decoder.custom(_CapitalizeBefore())
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.feed([token_id]).text_delta for token_id in [1, 3, 1, 2, 3, 1]]
    # "ab" was emitted before "^" rewrote it; the text after the rewrite still arrives.
    assert deltas == ["ab", "cd", "ab", "", "cd", "ab"]
    assert tokenizer.decode([1, 3, 1, 2, 3, 1]) == "abcdABcdab"
    assert detokenizer.flush() == ""
