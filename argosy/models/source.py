"""ModelSource: everything the loader learned about a model, as plain data.

The loader (loader.py) turns a name, a GGUF file or a Hugging Face folder into a
ModelSource whose `weights_dir` holds safetensors files with Hugging Face tensor names.
The tokenizer, chat template, special tokens and generation defaults come from the same
source as the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


@dataclass(slots=True)
class ModelSource:
    name: str  # a short display name, e.g. "smollm2" or the folder/file stem
    architecture: str  # Hugging Face architecture, e.g. "LlamaForCausalLM"
    hf_config: dict[str, Any]  # config.json contents
    weights_dir: Path  # folder with *.safetensors (HF tensor names)
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends generation (config + generation_config)
    add_bos_token: bool  # whether prompts get a BOS prepended when tokenized
    generation_config: dict[str, Any] = field(default_factory=dict)
    source_format: str = "hf"  # "hf" | "gguf"
    source_path: Path | None = None  # the GGUF file or HF folder it came from
    gguf_file_type: str | None = None  # e.g. "Q4_1" for a GGUF source

    @property
    def context_length(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])
