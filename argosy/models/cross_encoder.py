"""Cross-encoder rerankers: a Hugging Face `BertForSequenceClassification` folder (the
ms-marco-MiniLM family) or `XLMRobertaForSequenceClassification` one (the bge-reranker
family) read as a BERT encoder (models/bert.py) over a text pair plus its classification head.

The pair is tokenized as transformers tokenizes it (BERT: `[CLS] query [SEP] document [SEP]`,
the document's tokens with token type 1; XLM-RoBERTa: `<s> query </s></s> document </s>`,
one token type, positions counted from its padding id + 1), the encoder runs packed like the
embedding models, and the head is transformers' own, the same computation in both:
`classifier(tanh(pooler(h[first token])))` (RoBERTa calls them `classifier.dense` and
`classifier.out_proj`). The score of a pair is
the head's single logit passed through the model's activation, chosen as
sentence-transformers' `CrossEncoder` chooses it: the one its config names
(`sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_function`;
ms-marco-MiniLM-L-6-v2 names Identity, so its scores are raw logits), else the sigmoid for a
single-label head. A head of several labels has no one relevance score and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from argosy.errors import ModelLoadError
from argosy.models.bert import BertConfig, BertEmbedder, PackedBatch, packing_supported, safetensors_weights
from argosy.models.embedding_source import read_json_object, read_tokenizer

_ARCHITECTURE_SUFFIX = "ForSequenceClassification"
_MODEL_TYPES = ("bert", "xlm-roberta", "roberta")
# activation paths sentence-transformers writes -> ours
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
}
# checkpoint names of the head (BertForSequenceClassification's; RobertaClassificationHead's)
_HEAD_NAMES = {
    "bert.pooler.dense.weight": "pooler.weight",
    "bert.pooler.dense.bias": "pooler.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
    "classifier.dense.weight": "pooler.weight",
    "classifier.dense.bias": "pooler.bias",
    "classifier.out_proj.weight": "classifier.weight",
    "classifier.out_proj.bias": "classifier.bias",
}


@dataclass(slots=True)
class CrossEncoderSource:
    name: str  # display name: the folder's
    path: Path
    hf_config: dict[str, Any]  # config.json
    tokenizer: Tokenizer  # tokenizer.json, no padding, no truncation
    max_seq_length: int  # longest pair in tokens, special tokens included
    activation: str  # "sigmoid" | "identity", applied to the logit


def is_cross_encoder_folder(source: str | Path) -> bool:
    """Whether `source` is a folder of a sequence-classification encoder we run."""
    path = Path(source).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    architectures = config.get("architectures") or []
    return config.get("model_type") in _MODEL_TYPES and any(
        str(name).endswith(_ARCHITECTURE_SUFFIX) for name in architectures
    )


def is_causal_reranker_folder(source: str | Path) -> bool:
    """Whether `source` is a folder of a causal LM reranker, scored by its yes/no judgement
    (core/judge_scorer.py): a *ForCausalLM whose folder name says reranker, as
    Qwen3-Reranker-0.6B does. (Any causal LM serves this way with `kind = "rerank"` in the
    models file.)"""
    folder = Path(source).expanduser()
    if "reranker" not in folder.name.lower():
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return any(str(name).endswith("ForCausalLM") for name in architectures or [])


def load_cross_encoder_source(source: str | Path) -> CrossEncoderSource:
    """The cross-encoder in folder `source`; ModelLoadError when it is not one we run."""
    folder = Path(source).expanduser()
    if not is_cross_encoder_folder(folder):
        raise ModelLoadError(
            f"{str(source)!r} is not a cross-encoder folder: config.json must name a "
            f"*{_ARCHITECTURE_SUFFIX} architecture of model_type {' or '.join(_MODEL_TYPES)}"
        )
    config = read_json_object(folder / "config.json", required=True, missing="has no")
    num_labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if num_labels != 1:
        raise ModelLoadError(
            f"{folder}: a reranker has one output (a relevance logit); this head has {num_labels} labels"
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder} has no *.safetensors weights (only safetensors are supported)")
    tokenizer = read_tokenizer(folder / "tokenizer.json")
    tokenizer_config = read_json_object(folder / "tokenizer_config.json", required=False)
    max_positions = int(config.get("max_position_embeddings", 512)) - encoder_config(config).position_offset
    declared = tokenizer_config.get("model_max_length")
    is_declared = isinstance(declared, int) and 4 <= declared < max_positions
    return CrossEncoderSource(
        name=folder.resolve().name,
        path=folder,
        hf_config=config,
        tokenizer=tokenizer,
        max_seq_length=int(declared) if is_declared else max_positions,  # type: ignore[arg-type]
        activation=_activation(config),
    )


def encoder_config(hf_config: dict[str, Any]) -> BertConfig:
    """The encoder's BertConfig: a RoBERTa's is BERT's with its positions offset."""
    if hf_config.get("model_type") == "bert":
        return BertConfig.from_hf(hf_config)
    cfg = BertConfig.from_hf({**hf_config, "model_type": "bert"})
    return replace(cfg, position_offset=int(hf_config.get("pad_token_id", 1)) + 1)


def _activation(config: dict[str, Any]) -> str:
    """As sentence-transformers' CrossEncoder.get_default_activation_fn: the config's, else
    the sigmoid (for the single-label heads we accept)."""
    st_config = config.get("sentence_transformers")
    named = st_config.get("activation_fn") if isinstance(st_config, dict) else None
    named = named or config.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid"
    if named not in _ACTIVATIONS:
        raise ModelLoadError(f"activation {named!r} is not supported (supported: Identity, Sigmoid)")
    return _ACTIVATIONS[named]


class CrossEncoder(nn.Module):
    """Token ids (and token types) of many pairs -> one logit each, in the caller's order."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = BertEmbedder(cfg, pooling="cls", normalize=False)
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, 1)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """[num_seqs] logits."""
        first = self.encoder.encode(batch).index_select(0, batch.seq_starts)  # [CLS] of each pair
        logits = self.classifier(torch.tanh(self.pooler(first))).squeeze(1)
        return torch.empty_like(logits).index_copy_(0, batch.order, logits)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The encoder's tensors go to BertEmbedder.load_weights; the head's are copied here.
        Raises ModelLoadError on an unknown, missing or mis-shaped weight."""
        head: dict[str, torch.Tensor] = {}

        def encoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in _HEAD_NAMES:
                    head[_HEAD_NAMES[name]] = tensor
                else:  # a RoBERTa's encoder tensors are named as BERT's, under `roberta.`
                    yield (
                        "bert." + name.removeprefix("roberta.") if name.startswith("roberta.") else name,
                        tensor,
                    )

        self.encoder.load_weights(encoder_weights())
        params = dict(self.named_parameters())
        for name in _HEAD_NAMES.values():
            if name not in head:
                raise ModelLoadError(f"the classification head's {name!r} is missing from the checkpoint")
            if tuple(head[name].shape) != tuple(params[name].shape):
                raise ModelLoadError(
                    f"head weight {name!r} has shape {tuple(head[name].shape)}, "
                    f"expected {tuple(params[name].shape)}"
                )
            params[name].copy_(head[name])


def build_cross_encoder(
    hf_config: dict[str, Any], weights_dir: Path, dtype: torch.dtype = torch.float32
) -> CrossEncoder:
    """The cross-encoder with its weights loaded, in eval mode and `dtype` (oneDNN-packed
    encoder linears where supported, as build_bert_embedder does)."""
    model = CrossEncoder(encoder_config(hf_config))
    model.load_weights(safetensors_weights(weights_dir))
    model = model.to(dtype).eval()
    if packing_supported(dtype, model.pooler.weight.device):
        for layer in model.encoder.layers:
            layer.pack_weights()  # type: ignore[operator]
    return model
