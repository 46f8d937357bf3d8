"""The offline Python API: `LLM("smollm2").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.engine.output_processor import OutputProcessor
from argosy.engine.outputs import TokenLogprob
from argosy.process import configure_process
from argosy.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0


class LLM:
    """Runs the engine in the calling thread; all prompts are batched together."""

    def __init__(self, model: str = "smollm2", **engine_options: Any) -> None:
        config = EngineConfig(model=model, **engine_options)
        configure_process(config)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.source.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str | list[int]],  # text, or token ids
        params: SamplingParams | list[SamplingParams] | None = None,
        qos: str = "interactive",
    ) -> list[GenerationResult]:
        if isinstance(prompts, str):
            prompts = [prompts]
        param_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        processors: dict[str, OutputProcessor] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, param_list, strict=True):
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p, qos=qos)
            results[request_id] = GenerationResult(
                prompt if isinstance(prompt, str) else None,
                ids,
                logprobs=[] if p.logprobs is not None else None,
            )
            processors[request_id] = OutputProcessor(self.engine.source.tokenizer, ids, p)
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                out = processors[out.request_id].process(out)
                result = results[out.request_id]
                result.text += out.text_delta
                result.token_ids.extend(out.new_token_ids)
                result.num_cached_tokens = out.num_cached_tokens
                if out.new_logprobs is not None and result.logprobs is not None:
                    result.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
                    pending.discard(out.request_id)
                    if not processors[out.request_id].engine_finished:
                        self.engine.abort(out.request_id)
        return [results[r] for r in order]
