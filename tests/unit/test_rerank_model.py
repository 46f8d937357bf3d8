"""The cross-encoder reranker (models/cross_encoder.py, engine/cross_encoder_engine.py) and the
rerank service over it (core/rerank_service.py).

A tiny random BertForSequenceClassification (every weight random, the token-type table
included, so a wrong segment would show) is saved with transformers' save_pretrained and a
tokenizer with BERT's pair template, then scored by sentence-transformers' CrossEncoder, by
transformers itself and by ours, in float32.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from argosy.commands.model_specs import model_kind
from argosy.core.rerank_service import RerankService, scorer_of
from argosy.engine.cross_encoder_engine import CrossEncoderEngine
from argosy.engine.embedding_engine import AsyncEmbeddingEngine
from argosy.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from argosy.models.cross_encoder import is_cross_encoder_folder, load_cross_encoder_source

_WORD_TEXT = "the a quick brown fox jumps over lazy dog cat sat on mat what is capital of france paris"
WORDS = _WORD_TEXT.split()
MAX_POSITIONS = 64
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat",
    "france",
    "",  # an empty document is still a pair: [CLS] query [SEP] [SEP]
    " ".join(WORDS * 2),
]


def wordpiece_pair_tokenizer(
    specials: list[str], unk: str, single: str, pair: str, marks: list[str]
) -> Tokenizer:
    """A lowercasing WordPiece tokenizer over `specials` + WORDS, with the `single` and `pair`
    templates (`marks`: the special tokens they name)."""
    vocab = {tok: i for i, tok in enumerate([*specials, *WORDS, "##s"])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(mark, vocab[mark]) for mark in marks]
    )
    return tokenizer


def tiny_pair_tokenizer() -> Tokenizer:
    tokenizer = wordpiece_pair_tokenizer(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
        "[UNK]",
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        marks=["[CLS]", "[SEP]"],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def save_random_model(model_type: type, config: object, folder: Path, seed: int) -> torch.nn.Module:
    """`model_type(config)` with every weight random (LayerNorm weights around 1), in float32
    eval mode, saved to `folder` as transformers saves it."""
    torch.manual_seed(seed)
    model = model_type(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3)
            if "LayerNorm.weight" in name:
                param.add_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def write_tiny_cross_encoder(folder: Path, seed: int = 7, activation: str | None = None) -> torch.nn.Module:
    """A tiny random BertForSequenceClassification folder (num_labels 1) as transformers saves
    it, with a fast tokenizer; returns the transformers model. `activation`: the
    sentence-transformers activation path its config names (None: none, the sigmoid)."""
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    config = BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
        type_vocab_size=2,
        num_labels=1,
    )
    model = save_random_model(BertForSequenceClassification, config, folder, seed)
    if activation is not None:
        data = json.loads((folder / "config.json").read_text())
        data["sentence_transformers"] = {"activation_fn": activation}
        (folder / "config.json").write_text(json.dumps(data))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tiny_pair_tokenizer(),
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        model_max_length=MAX_POSITIONS,
        # as BERT's own tokenizer class names them: the segments reach the model
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    return folder, write_tiny_cross_encoder(folder)


@pytest.fixture(scope="module")
def engine(tiny: tuple[Path, torch.nn.Module]) -> CrossEncoderEngine:
    return CrossEncoderEngine(tiny[0])


def pairs(documents: list[str] = DOCUMENTS) -> list[tuple[str, str]]:
    return [(QUERY, d) for d in documents]


def test_the_folder_is_recognised_as_a_rerank_model(tiny: tuple[Path, torch.nn.Module]) -> None:
    assert is_cross_encoder_folder(tiny[0]) and model_kind(str(tiny[0])) == "rerank"
    assert load_cross_encoder_source(tiny[0]).activation == "sigmoid"


def test_scores_equal_sentence_transformers_cross_encoder(
    tiny: tuple[Path, torch.nn.Module], engine: CrossEncoderEngine
) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(tiny[0]), device="cpu").predict(pairs(), batch_size=3)
    ours = [s[0] for s in engine.embed(engine.encode_pairs(pairs()))]
    assert torch.allclose(torch.tensor(ours), torch.tensor(reference, dtype=torch.float32), atol=1e-4)
    assert len(set(round(s, 3) for s in ours)) > 3  # random weights: the scores differ


@torch.inference_mode()
def test_logits_equal_transformers_with_token_types(
    tiny: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """Identity activation: the raw logit, compared with BertForSequenceClassification fed the
    tokenizer's own ids and token types."""
    folder = tmp_path / "identity"
    model = write_tiny_cross_encoder(folder, activation="torch.nn.modules.linear.Identity")
    identity = CrossEncoderEngine(folder)
    tokenizer = tiny_pair_tokenizer()
    for query, document in pairs():
        encoding = tokenizer.encode(query, document)
        expected = model(
            input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids])
        ).logits[0, 0]
        (ours,) = identity.embed(identity.encode_pairs([(query, document)]))
        assert abs(ours[0] - float(expected)) < 1e-4
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(folder), device="cpu").predict(pairs())
    ours_all = [s[0] for s in identity.embed(identity.encode_pairs(pairs()))]
    assert torch.allclose(torch.tensor(ours_all), torch.tensor(reference, dtype=torch.float32), atol=1e-4)


def test_a_request_of_64_pairs_is_one_forward(engine: CrossEncoderEngine) -> None:
    before = engine.num_forwards
    many = pairs(DOCUMENTS * 11)[:64]
    scores = engine.embed(engine.encode_pairs(many))
    assert engine.num_forwards == before + 1 and len(scores) == 64
    alone = [engine.embed(engine.encode_pairs([p]))[0][0] for p in many[:6]]
    assert [s[0] for s in scores[:6]] == pytest.approx(alone, abs=1e-5)  # neighbours do not matter


def test_long_documents_are_cut_to_fit_and_a_long_query_is_refused(engine: CrossEncoderEngine) -> None:
    long_document = " ".join(WORDS * 10)  # ~200 tokens, past the 64 the model takes
    (coded,) = engine.encode_pairs([(QUERY, long_document)])
    assert len(coded) == MAX_POSITIONS
    (cut,) = engine.encode_pairs([(QUERY, long_document)], max_document_tokens=5)
    assert len(cut) == 3 + len(QUERY.split()) + 5
    with pytest.raises(ContextLengthExceededError) as raised:
        engine.encode_pairs([(long_document, "paris")])
    assert raised.value.param == "query"


def test_the_service_scores_a_request_as_one_batch(
    tiny: tuple[Path, torch.nn.Module], engine: CrossEncoderEngine
) -> None:
    service = RerankService("tiny", AsyncEmbeddingEngine(lambda: CrossEncoderEngine(tiny[0])))
    try:
        assert scorer_of(service) is service
        result = asyncio.run(service.score(pairs()))
        expected = [s[0] for s in engine.embed(engine.encode_pairs(pairs()))]
        assert result.scores == pytest.approx(expected, abs=1e-6)
        assert service.num_forwards == 1
        info = service.model_info()
        assert (info.kind, info.context_length, info.architecture) == (
            "rerank",
            MAX_POSITIONS,
            "BertForSequenceClassification",
        )
    finally:
        service.shutdown()


def test_a_chat_model_has_no_scorer() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        scorer_of(object())
    assert raised.value.param == "model"


def test_heads_of_several_labels_are_refused(tmp_path: Path) -> None:
    write_tiny_cross_encoder(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["id2label"] = {"0": "no", "1": "yes"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="2 labels"):
        load_cross_encoder_source(tmp_path)


def write_tiny_xlmr_cross_encoder(folder: Path, seed: int = 11) -> torch.nn.Module:
    """A tiny random XLMRobertaForSequenceClassification folder (the bge-reranker layout:
    positions from padding id + 1, one token type, RobertaClassificationHead)."""
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaForSequenceClassification

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tokenizer = wordpiece_pair_tokenizer(
        specials, "<unk>", single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", marks=["<s>", "</s>"]
    )
    config = XLMRobertaConfig(
        vocab_size=len(specials) + len(WORDS) + 1,  # and "##s"
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS + 2,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=1,
    )
    model = save_random_model(XLMRobertaForSequenceClassification, config, folder, seed)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(folder)
    return model


def test_an_xlm_roberta_reranker_equals_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    write_tiny_xlmr_cross_encoder(tmp_path)
    assert model_kind(str(tmp_path)) == "rerank"
    engine = CrossEncoderEngine(tmp_path)
    assert engine.max_input_tokens == MAX_POSITIONS  # 66 positions, counted from 2
    many = pairs(DOCUMENTS * 2)
    reference = CrossEncoder(str(tmp_path), device="cpu").predict(many, batch_size=4)
    ours = [s[0] for s in engine.embed(engine.encode_pairs(many))]
    assert torch.allclose(torch.tensor(ours), torch.tensor(reference, dtype=torch.float32), atol=1e-4)
    (longest,) = engine.encode_pairs([(QUERY, " ".join(WORDS * 10))])  # cut to the 64 it takes
    assert len(longest) == MAX_POSITIONS and engine.embed([longest])[0][0] > 0.0
