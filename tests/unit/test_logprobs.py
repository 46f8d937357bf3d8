"""Logprobs, built once in the core and rendered per dialect.

- TokenTexts: a token's exact bytes (half a UTF-8 character included) and specials.
- The core's aligner: each entry's `text` is the slice of the output it accounts for, so the
  entries always join to the emitted text — through split characters and stop strings, and
  while streaming (an entry waits while its text is held back).
- The legacy completions shape: tokens / token_logprobs / top_logprobs / text_offset.
"""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from argosy.api.openai.chat import logprobs_json
from argosy.api.openai.completions import _merge, legacy_logprobs
from argosy.chat.events import TokenCandidate, TokenLogprobs
from argosy.core.choice import LogprobAligner, token_pieces
from argosy.core.token_text import TokenTexts, _byte_level_decoding
from argosy.engine.detokenizer import IncrementalDetokenizer
from argosy.engine.outputs import TokenLogprob

SPECIAL = "<|end|>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """GPT-2 style byte-level BPE: one token per byte, plus the merges h+e and Ġ+w."""
    char_of = {byte: char for char, byte in _byte_level_decoding().items()}
    vocab = {char_of[b]: b for b in range(256)}
    vocab["he"] = 256
    vocab["Ġw"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("Ġ", "w")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIAL, special=True)])
    return tok


def lp(token_id: int, logprob: float = -0.5, top: list[tuple[int, float]] | None = None) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, top if top is not None else [(token_id, logprob)])


def test_token_bytes_are_exact(tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("hé w").ids
    assert b"".join(texts.bytes_of(i) for i in ids) == "hé w".encode()
    first_half_of_e = ids[1]
    assert texts.bytes_of(first_half_of_e) == b"\xc3"
    assert texts.text_of(first_half_of_e) == "\ufffd"
    assert texts.bytes_of(tokenizer.token_to_id("Ġw")) == b" w"
    special = tokenizer.token_to_id(SPECIAL)
    assert texts.bytes_of(special) == SPECIAL.encode()


def test_pieces_join_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hé wörld ✓").ids
    pieces = token_pieces(tokenizer, [], ids, skip_special_tokens=False)
    assert "".join(pieces) == "hé wörld ✓"
    assert pieces[1] == ""  # the first byte of é
    assert pieces[2] == "é"


def simulate(
    tokenizer: Tokenizer, prompt: str, output: str, stop: list[str]
) -> tuple[str, list[list[TokenLogprobs]], list[str]]:
    """Feed `output`'s tokens one per step as the engine would; return the final text, the
    entries released at each step, and the text emitted at each step."""
    prompt_ids = tokenizer.encode(prompt).ids
    output_ids = tokenizer.encode(output).ids
    engine_text = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stop)
    aligner = LogprobAligner(tokenizer, TokenTexts(tokenizer), prompt_ids, skip_special=True)
    released: list[list[TokenLogprobs]] = []
    deltas: list[str] = []
    for step, token_id in enumerate(output_ids):
        result = engine_text.feed([token_id])
        is_finished = result.stop_string is not None or step == len(output_ids) - 1
        delta = result.text_delta + (
            engine_text.flush() if is_finished and result.stop_string is None else ""
        )
        aligner.add([lp(token_id, -0.1 * (step + 1))])
        released.append(aligner.release(delta, is_finished=is_finished))
        deltas.append(delta)
        if is_finished:
            break
    return engine_text.text, released, deltas


def test_entries_join_to_the_text_through_split_characters(tokenizer: Tokenizer) -> None:
    text, released, _ = simulate(tokenizer, "say:", "hé wörld ✓", stop=[])
    entries = [e for step in released for e in step]
    assert text == "hé wörld ✓"
    assert "".join(e.text for e in entries) == text
    assert len(entries) == len(tokenizer.encode("hé wörld ✓").ids)
    assert [e.chosen.logprob for e in entries] == pytest.approx([-0.1 * (i + 1) for i in range(len(entries))])


def test_a_stop_string_cuts_the_entries_text(tokenizer: Tokenizer) -> None:
    text, released, _ = simulate(tokenizer, "say:", "hello STOP more", stop=["STOP"])
    entries = [e for step in released for e in step]
    assert text == "hello "
    assert "".join(e.text for e in entries) == "hello "
    # every token up to the one completing the stop string has an entry; the last ones are ''
    assert len(entries) == len(tokenizer.encode("hello STOP").ids)
    assert entries[-1].text == ""


def test_streaming_entries_never_run_ahead_of_the_text(tokenizer: Tokenizer) -> None:
    _, released, deltas = simulate(tokenizer, "say:", "ab STab STOP", stop=["STOP"])
    emitted = ""
    covered = ""
    for step_entries, delta in zip(released, deltas, strict=True):
        emitted += delta
        covered += "".join(e.text for e in step_entries)
        assert emitted.startswith(covered)
    assert covered == emitted == "ab STab "


def test_top_alternatives_carry_their_own_text(tokenizer: Tokenizer) -> None:
    aligner = LogprobAligner(tokenizer, TokenTexts(tokenizer), [], skip_special=True)
    h, he = tokenizer.token_to_id("h"), tokenizer.token_to_id("he")
    aligner.add([lp(he, -0.2, [(he, -0.2), (h, -1.7)])])
    (entry,) = aligner.release("he", is_finished=True)
    assert entry.chosen == TokenCandidate(he, "he", b"he", -0.2)
    assert entry.top == [TokenCandidate(he, "he", b"he", -0.2), TokenCandidate(h, "h", b"h", -1.7)]


def candidate(token: str, logprob: float | None, token_id: int = 0) -> TokenCandidate:
    return TokenCandidate(token_id, token, token.encode(), logprob)


def test_legacy_shape() -> None:
    entries = [
        TokenLogprobs(
            candidate(" Paris", -0.1), " Paris", [candidate(" Paris", -0.1), candidate(" Lyon", -2.0)]
        ),
        TokenLogprobs(candidate(".", -0.7), ".", [candidate(",", -0.5)]),
    ]
    shape = legacy_logprobs(entries, text_offset=10)
    assert shape == {
        "tokens": [" Paris", "."],
        "token_logprobs": [-0.1, -0.7],
        "top_logprobs": [{" Paris": -0.1, " Lyon": -2.0}, {",": -0.5, ".": -0.7}],  # chosen always included
        "text_offset": [10, 16],
    }


def test_legacy_echo_first_entry_is_null_and_offsets_continue() -> None:
    prompt = [
        TokenLogprobs(candidate("The", None), "The"),
        TokenLogprobs(candidate(" sky", -3.0), " sky", [candidate(" sky", -3.0)]),
    ]
    generated = [TokenLogprobs(candidate(" is", -0.2), " is", [candidate(" is", -0.2)])]
    merged = _merge(legacy_logprobs(prompt, 0), legacy_logprobs(generated, len("The sky")))
    assert merged["tokens"] == ["The", " sky", " is"]
    assert merged["token_logprobs"] == [None, -3.0, -0.2]
    assert merged["top_logprobs"][0] is None
    assert merged["text_offset"] == [0, 3, 7]
    assert "".join(merged["tokens"]) == "The sky is"


def test_chat_logprobs_shape() -> None:
    entry = TokenLogprobs(candidate("é", -0.3), "é", [candidate("é", -0.3), candidate("e", -1.5)])
    assert logprobs_json([entry]) == {
        "content": [
            {
                "token": "é",
                "logprob": -0.3,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.3, "bytes": [0xC3, 0xA9]},
                    {"token": "e", "logprob": -1.5, "bytes": [0x65]},
                ],
            }
        ],
        "refusal": None,  # required by OpenAI's spec
    }
