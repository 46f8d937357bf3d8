"""transformers' float32 model of a converted GGUF, built in memory from the file's values.

The converted folder keeps its quantized weights only as codes; writing their float32 copies
for a reference (`loader.float_folder`) costs disk: 2.5 GB for Qwen2.5-Coder-0.5B, 4 GB across
the suite's three models. Here the same values (`gguf_convert.iter_float_weights`, what those
files would hold) go straight into the model.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from argosy.models.gguf_convert import iter_float_weights
from argosy.models.source import ModelSource


def hf_model(source: ModelSource, base: bool = False) -> Any:
    """The causal LM (`base`: the model without its head) in float32, eval mode."""
    assert source.source_path is not None, "a converted GGUF"
    config = transformers.AutoConfig.from_pretrained(source.weights_dir)
    auto = transformers.AutoModel if base else transformers.AutoModelForCausalLM
    model_class = auto._model_mapping[type(config)]  # the Auto classes take no state dict alone
    state = {
        name: torch.from_numpy(values)
        for name, values in iter_float_weights(source.source_path, source.weights_dir)
    }
    return model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32).eval()
