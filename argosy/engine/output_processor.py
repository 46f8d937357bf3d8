"""OutputProcessor: per request, turns engine outputs into text deltas and applies stop
strings. When a stop string ends the text, the output is marked finished here; the caller
then aborts the request in the engine (its remaining tokens are not wanted)."""

from __future__ import annotations

from tokenizers import Tokenizer

from argosy.engine.detokenizer import IncrementalDetokenizer
from argosy.engine.outputs import RequestOutput
from argosy.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer: IncrementalDetokenizer | None = None
        if params.detokenize:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self.engine_finished = False  # the engine ended it itself (no abort needed)

    def process(self, out: RequestOutput) -> RequestOutput:
        self.engine_finished = out.finished
        if self.detokenizer is None:
            return out
        step = self.detokenizer.feed(out.new_token_ids)
        out.text_delta = step.text_delta
        if step.stop_string is not None:
            out.finished = True
            out.finish_reason = "stop"
            out.stop_reason = step.stop_string
            consumed = step.num_tokens_consumed
            out.num_output_tokens -= len(out.new_token_ids) - consumed
            out.new_token_ids = out.new_token_ids[:consumed]
            if out.new_logprobs is not None:
                out.new_logprobs = out.new_logprobs[:consumed]
        elif out.finished:
            out.text_delta += self.detokenizer.flush()
        return out

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
