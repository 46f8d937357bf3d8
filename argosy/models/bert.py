"""BERT-family encoder for embeddings (all-MiniLM-L6-v2 and other BertModel checkpoints).

A batch runs packed: the tokens of all its sequences are one flat [total_tokens, hidden]
tensor, so every linear layer, norm and activation sees only real tokens (a padded batch of
short texts spends most of its matmuls on padding). Only attention needs per-sequence
structure: sequences are sorted by length and cut into groups of similar length; each group
is padded to its own longest sequence, with a key mask, for one scaled_dot_product_attention
call. A padded key gets weight exactly 0 and a padded query row is dropped, so a sequence's
result does not depend on its neighbours beyond float rounding (matmul blocking, summation
order).

Numerics follow transformers' BertModel (post-LayerNorm, erf GELU, embeddings summed as
word + token type + position) so float32 outputs match it to ~1e-6. Pooling and L2
normalization follow sentence-transformers' Pooling and Normalize modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from argosy.errors import ModelLoadError

POOLING_MODES = ("cls", "mean", "max")

# config.json hidden_act -> activation, as transformers' ACT2FN computes it
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# A group's padded attention costs num_seqs * max_len^2; a sequence under half the group's
# longest starts a new group, unless the group is this short (its attention is then a few
# percent of the layer's matmuls and one more call costs more than the padding). Measured on
# MiniLM, 2 threads: 32 texts of 8-256 tokens run ~8% faster in 3 groups than padded as one;
# texts of 7-27 tokens gain nothing from splitting.
_GROUP_MIN_LEN = 64


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    # the position of a sequence's first token in the position table: 0 for BERT; RoBERTa
    # counts positions from its padding id + 1 (2 for XLM-RoBERTa)
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BertConfig:
        """Raises ModelLoadError for anything but an absolute-position BERT encoder."""
        if hf.get("model_type", "bert") != "bert":
            raise ModelLoadError(
                f"embedding models must be BERT encoders, this one is {hf.get('model_type')!r}"
            )
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"position_embedding_type {hf['position_embedding_type']!r} is not supported"
            )
        act = str(hf.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ModelLoadError(
                f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
            )
        try:
            cfg = cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=int(hf["num_attention_heads"]),
                intermediate_size=int(hf["intermediate_size"]),
                max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
                type_vocab_size=int(hf.get("type_vocab_size", 2)),
                layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                hidden_act=act,
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc
        if cfg.hidden_size % cfg.num_heads:
            raise ModelLoadError(f"hidden_size {cfg.hidden_size} is not a multiple of {cfg.num_heads} heads")
        return cfg


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one call: packed tokens [start, stop) padded to [num_seqs, max_len]."""

    start: int
    stop: int
    num_seqs: int
    max_len: int
    token_index: torch.Tensor | None  # [stop-start]: row of each token in the padded layout; None: no padding
    key_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_len], True for real keys; None: no padding


@dataclass(slots=True)
class PackedBatch:
    """Sequences sorted longest first and packed flat; `order[i]` is the caller's index of the
    i-th packed sequence."""

    input_ids: torch.Tensor  # [total_tokens]
    positions: torch.Tensor  # [total_tokens]
    seq_lens: torch.Tensor  # [num_seqs], packed order
    seq_starts: torch.Tensor  # [num_seqs]: first token of each packed sequence
    order: torch.Tensor  # [num_seqs]
    groups: list[AttentionGroup]
    token_types: torch.Tensor | None = None  # [total_tokens]; None: every token has type 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(cls, sequences: list[list[int]], token_types: list[list[int]] | None = None) -> PackedBatch:
        """Invariant: every sequence is non-empty (the caller validates); `token_types`, when
        given (a text pair's segments), is one list per sequence of its length."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        lens = [len(sequences[i]) for i in order]
        flat = [t for i in order for t in sequences[i]]
        seq_lens = torch.tensor(lens, dtype=torch.long)
        seq_starts = torch.cumsum(seq_lens, 0) - seq_lens
        total = len(flat)
        positions = torch.arange(total) - torch.repeat_interleave(seq_starts, seq_lens, output_size=total)
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long),
            positions=positions,
            seq_lens=seq_lens,
            seq_starts=seq_starts,
            order=torch.tensor(order, dtype=torch.long),
            groups=_attention_groups(lens),
            token_types=None
            if token_types is None
            else torch.tensor([t for i in order for t in token_types[i]], dtype=torch.long),
        )


def _attention_groups(lens: list[int]) -> list[AttentionGroup]:
    """Cut lengths (sorted longest first) into groups; see _GROUP_MIN_LEN."""
    groups: list[AttentionGroup] = []
    first, token = 0, 0
    while first < len(lens):
        max_len, last = lens[first], first + 1
        while last < len(lens) and (max_len <= _GROUP_MIN_LEN or 2 * lens[last] >= max_len):
            last += 1
        group_lens = lens[first:last]
        num_tokens = sum(group_lens)
        token_index = key_mask = None
        if group_lens[-1] != max_len:
            lens_t = torch.tensor(group_lens)
            key_mask = torch.arange(max_len) < lens_t.unsqueeze(1)  # [num_seqs, max_len]
            token_index = key_mask.flatten().nonzero().squeeze(1)
            key_mask = key_mask[:, None, None, :]
        groups.append(AttentionGroup(token, token + num_tokens, last - first, max_len, token_index, key_mask))
        first, token = last, token + num_tokens
    return groups


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.hidden_act = cfg.hidden_act
        self.act = _ACTIVATIONS[cfg.hidden_act]
        # oneDNN-packed copies of the four weights (pack_weights); None: plain F.linear
        self.packed: dict[str, torch.Tensor] | None = None

    def pack_weights(self) -> None:
        """Use oneDNN linears from now on: weights packed once into its blocked layout, bias,
        GELU and the residual add fused into the matmul (no bias copy, one pass less over
        the [tokens, intermediate] activations). Measured on MiniLM, float32, 2 threads:
        5-10% off a forward, the same results to ~2e-7. Call after the model's final .to()."""
        self.packed = {
            name: torch.ops.mkldnn._reorder_linear_weight(
                getattr(self, name).weight.detach(), _PACKING_ROWS_HINT
            )
            for name in ("qkv_proj", "o_proj", "up_proj", "down_proj")
        }

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, scratch: list[torch.Tensor | None]
    ) -> torch.Tensor:
        """x: [tokens, hidden]; scratch: per attention group, its zeroed padded qkv buffer (or None)."""
        if self.packed is None:
            qkv = self.qkv_proj(x)
        else:
            qkv = _linear(x, self.packed["qkv_proj"], self.qkv_proj.bias, "none", "")
        parts = [
            self._attend(qkv[g.start : g.stop], g, buf) for g, buf in zip(batch.groups, scratch, strict=True)
        ]
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.packed is None:
            x = self.attention_norm(self.o_proj(attn) + x)
            return self.ffn_norm(self.down_proj(self.act(self.up_proj(x))) + x)
        x = self.attention_norm(_linear_add(attn, x, self.packed["o_proj"], self.o_proj.bias))
        if self.hidden_act == "gelu":  # erf GELU, fused
            h = _linear(x, self.packed["up_proj"], self.up_proj.bias, "gelu", "none")
        else:
            h = self.act(_linear(x, self.packed["up_proj"], self.up_proj.bias, "none", ""))
        return self.ffn_norm(_linear_add(h, x, self.packed["down_proj"], self.down_proj.bias))

    def _attend(self, qkv: torch.Tensor, group: AttentionGroup, padded: torch.Tensor | None) -> torch.Tensor:
        """qkv: [group tokens, 3 * hidden] -> [group tokens, hidden]."""
        n, length, hidden = group.num_seqs, group.max_len, qkv.shape[1] // 3
        if group.token_index is not None and padded is not None:
            # only real rows are written: the padding rows stay zero from allocation
            qkv = padded.index_copy_(0, group.token_index, qkv)
        q, k, v = qkv.view(n, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.key_mask)
        out = out.transpose(1, 2).reshape(n * length, hidden)
        return out if group.token_index is None else out.index_select(0, group.token_index)


# oneDNN picks its packed layout for this many rows; any row count works with it
_PACKING_ROWS_HINT = 512


def _linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, attr: str, algorithm: str
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


def _linear_add(
    x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class BertEmbedder(nn.Module):
    """Token ids of many sequences -> one (pooled, optionally L2-normalized) vector each."""

    def __init__(self, cfg: BertConfig, pooling: str, normalize: bool) -> None:
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ModelLoadError(
                f"pooling mode {pooling!r} is not supported (supported: {', '.join(POOLING_MODES)})"
            )
        self.config, self.pooling, self.normalize = cfg, pooling, normalize
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embedding_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def encode(self, batch: PackedBatch) -> torch.Tensor:
        """Last hidden states of the packed tokens, [total_tokens, hidden]."""
        if batch.token_types is None:  # single-text inputs: every token has token type 0
            x = self.word_embeddings(batch.input_ids) + self.token_type_embeddings.weight[0]
        else:
            x = self.word_embeddings(batch.input_ids) + self.token_type_embeddings(batch.token_types)
        positions = (
            batch.positions + self.config.position_offset if self.config.position_offset else batch.positions
        )
        x = self.embedding_norm(x + self.position_embeddings(positions))
        hidden = self.config.hidden_size
        scratch = [
            None if g.token_index is None else x.new_zeros(g.num_seqs * g.max_len, 3 * hidden)
            for g in batch.groups
        ]
        for layer in self.layers:
            x = layer(x, batch, scratch)
        return x

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """[num_seqs, hidden] in the caller's order (not the packed one)."""
        pooled = pool(self.encode(batch), batch, self.pooling)
        if self.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=1)
        return torch.empty_like(pooled).index_copy_(0, batch.order, pooled)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face BertModel tensors (with or without the `bert.` prefix) in.
        Raises ModelLoadError on an unknown, missing or mis-shaped weight."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            target = _our_name(hf_name)
            if target is None:
                continue
            name, shard = target
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"unexpected weight {hf_name!r} for a BERT encoder")
            size = self.config.hidden_size
            dst = param if shard is None else param.narrow(0, shard * size, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add((name, shard))
        expected = {(n, s) for n in params for s in ((0, 1, 2) if ".qkv_proj." in n else (None,))}
        missing = sorted(f"{n}#{s}" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[:5]}")


def pool(hidden: torch.Tensor, batch: PackedBatch, mode: str) -> torch.Tensor:
    """[total_tokens, hidden] -> [num_seqs, hidden] in packed order, as sentence-transformers'
    Pooling computes it over the real tokens (special tokens included). Sequences are
    contiguous runs of `seq_lens` rows, so each mode is one segment reduction."""
    if mode == "cls":
        return hidden.index_select(0, batch.seq_starts)
    if mode == "mean":
        sums = torch.segment_reduce(hidden, "sum", lengths=batch.seq_lens)
        return sums / batch.seq_lens.unsqueeze(1).to(hidden.dtype)
    if mode == "max":
        return torch.segment_reduce(hidden, "max", lengths=batch.seq_lens)
    raise ModelLoadError(f"pooling mode {mode!r} is not supported")


# HF name (after the optional `bert.` prefix) -> our parameter name and, for q/k/v, the shard
_LAYER_NAMES = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attention_norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("ffn_norm", None),
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embedding_norm",
}
# present in BertModel / BertForMaskedLM checkpoints, unused by a sentence encoder
_IGNORED = re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)")
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
_EMBEDDING = re.compile(r"^(embeddings\.\w+)\.(weight|bias|gamma|beta)$")
_SUFFIX = {"gamma": "weight", "beta": "bias", "weight": "weight", "bias": "bias"}  # old LayerNorm names


def _our_name(hf_name: str) -> tuple[str, int | None] | None:
    """(our parameter, q/k/v shard) for a checkpoint tensor; None for one we ignore."""
    name = hf_name.removeprefix("bert.")
    if _IGNORED.match(name):
        return None
    if m := _LAYER.match(name):
        mapped = _LAYER_NAMES.get(m.group(2))
        if mapped is None:
            raise ModelLoadError(f"unexpected weight {hf_name!r} for a BERT encoder")
        return f"layers.{m.group(1)}.{mapped[0]}.{_SUFFIX[m.group(3)]}", mapped[1]
    if (m := _EMBEDDING.match(name)) and m.group(1) in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[m.group(1)]}.{_SUFFIX[m.group(2)]}", None
    raise ModelLoadError(f"unexpected weight {hf_name!r} for a BERT encoder")


def safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def build_bert_embedder(
    hf_config: dict[str, Any],
    weights_dir: Path,
    pooling: str,
    normalize: bool,
    dtype: torch.dtype = torch.float32,
    pack_weights: bool = True,
) -> BertEmbedder:
    """The embedder with its weights loaded, in eval mode and `dtype`; with oneDNN-packed
    linears where supported (pack_weights=False: plain F.linear everywhere)."""
    model = BertEmbedder(BertConfig.from_hf(hf_config), pooling, normalize)
    model.load_weights(safetensors_weights(weights_dir))
    model = model.to(dtype).eval()
    if pack_weights and packing_supported(dtype, model.word_embeddings.weight.device):
        for layer in model.layers:
            layer.pack_weights()  # type: ignore[operator]
    return model
