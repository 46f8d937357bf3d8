"""LLMEngine: the synchronous engine — add_request / step / abort.

One step = schedule (scheduler) -> execute (model runner) -> update (append sampled
tokens, check stop conditions, free finished requests). Not thread-safe: the async engine
drives it from a single thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from argosy.config import QOS_CLASSES, EngineConfig
from argosy.engine.block_manager import BlockManager
from argosy.engine.outputs import EngineStats, RequestOutput
from argosy.engine.scheduler import Scheduler, SchedulerOutput
from argosy.engine.sequence import Sequence
from argosy.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from argosy.models.gguf_quant import INT4_FILE
from argosy.models.llama import DecoderForCausalLM
from argosy.models.quantize import apply_int4, apply_int8, apply_int8_head
from argosy.models.registry import builder_for
from argosy.models.source import ModelSource
from argosy.ops.memory import release_free_memory
from argosy.ops.packed_linear import PackedLinear, apply_packing, packing_supported
from argosy.ops.quantized_linear import BatchSwitchLinear, Int4Linear, Int8Linear, native_qlinear
from argosy.runner.model_runner import ModelRunner, StepResult, kv_bytes_per_block
from argosy.runner.spec_decode import NgramProposer, Verified
from argosy.runner.structured import TokenGuide
from argosy.sampling_params import SamplingParams

log = logging.getLogger("argosy.engine")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16
    caps = torch._C._cpu._get_cpu_capability()
    has_bf16 = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return torch.bfloat16 if has_bf16 else torch.float32


# int4 weights serve steps of up to this many rows, packed bf16 the rest: torch's int4 kernel
# slows with every row (4 measured best, bench/engine.py); the native one (AMX) stays ahead
# of the bf16 GEMM up to 32 (30 layers of SmolLM2's shapes, cold weights, ad-hoc
# microbenchmark: 8 rows 7.6 vs 18.5 ms, 16 rows 8.7 vs 18.9, 32 rows 15.6 vs 22.7)
MAX_INT4_ROWS_TORCH = 4
MAX_INT4_ROWS_NATIVE = 32


def max_int4_rows(dtype: torch.dtype) -> int:
    return MAX_INT4_ROWS_NATIVE if native_qlinear(dtype) else MAX_INT4_ROWS_TORCH


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: str = "cpu",
    quantization: str = "none",
    pack: bool = False,
) -> DecoderForCausalLM:
    """Build and load the model; quantize it; with `pack`, pack float weights for oneDNN
    (and keep int4 layers' float twins for steps of many rows)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the parameters in their final dtype: no fp32 copy
    try:
        model = builder_for(source.architecture)(source.hf_config)
    finally:
        torch.set_default_dtype(previous)
    assert isinstance(model, DecoderForCausalLM)
    files = sorted(Path(source.weights_dir).glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {source.weights_dir}")

    def weights():  # type: ignore[no-untyped-def]
        # one tensor at a time: a whole file in memory at once raised the load's peak RSS
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                    yield name, f.get_tensor(name)

    model.load_weights(weights())
    model = model.to(device=device, dtype=dtype).eval()
    pack = pack and packing_supported(dtype, device)
    _quantize(model, source, dtype, device, quantization, max_int4_rows(dtype) if pack else 0)
    if pack:
        log.info(
            "packed %s weights: %d linear layers", str(dtype).removeprefix("torch."), apply_packing(model)
        )
    return model


def _quantize(
    model: DecoderForCausalLM,
    source: ModelSource,
    dtype: torch.dtype,
    device: str,
    mode: str,
    max_int4_rows: int = 0,
) -> None:
    if mode == "none":
        return
    if device != "cpu":
        raise ModelLoadError(f"quantization {mode!r} uses CPU kernels; use --quantization none on {device}")
    blocks_file = Path(source.weights_dir) / INT4_FILE
    if mode == "int8":
        count = apply_int8(model, dtype)
    elif blocks_file.exists():
        count = apply_int4(model, load_file(str(blocks_file)), dtype, max_int4_rows)
        if dtype != torch.float32:  # float32 asks for precision: its head stays exact
            # the native int8 kernel serves any number of rows (2+; torch's serves one): no
            # float twin of the head (57 MB of SmolLM2's peak memory)
            apply_int8_head(model, dtype, 0 if native_qlinear(dtype) else max_int4_rows)
    elif mode == "int4":
        raise ModelLoadError("int4 uses a GGUF file's own Q4_0/Q4_1 blocks; this model has none (try int8)")
    else:
        return  # auto without 4-bit blocks: keep the float weights
    log.info("quantization %s: %d projection layers", mode, count)


def describe_weights(model: DecoderForCausalLM, dtype: torch.dtype) -> str:
    """How the projections are held, for /v1/models and the start-up log."""
    kinds = {type(m) for m in model.modules()}
    float_kind = str(dtype).removeprefix("torch.") + (" (oneDNN-packed)" if PackedLinear in kinds else "")
    head = model.lm_head
    int8_head = isinstance(head, Int8Linear) or (
        isinstance(head, BatchSwitchLinear) and isinstance(head.small, Int8Linear)
    )
    int4 = "int4 (GGUF Q4 blocks)" + (", int8 output head" if int8_head else "")
    switches = [m for m in model.modules() if isinstance(m, BatchSwitchLinear)]
    if switches and isinstance(head, Int8Linear):  # the head is int8 at every step
        return (
            f"int4 (GGUF Q4 blocks) for steps of <= {switches[0].max_small_rows} rows, {float_kind} above; "
            "int8 output head"
        )
    if switches:
        return f"{int4} for steps of <= {switches[0].max_small_rows} rows, {float_kind} above"
    if Int4Linear in kinds:
        return int4
    if Int8Linear in kinds:
        return "int8 (per channel)"
    return float_kind


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        started = time.perf_counter()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if source is None:
            from argosy.models.loader import resolve_model  # reads files; only when needed

            source = resolve_model(config.model, config.cache_dir)
        self.source = source
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.model = load_model(
            self.source, self.dtype, config.device, config.quantization, pack=config.compile == "on"
        )
        cfg = self.model.config
        per_block = kv_bytes_per_block(
            cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        self.num_blocks = max(2, config.kv_cache_memory // per_block)
        capacity = self.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or self.source.context_length, capacity)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = set(self.source.eos_token_ids)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.proposer = (
            NgramProposer(
                config.num_speculative_tokens, config.ngram_min, config.ngram_max, self.max_model_len
            )
            if config.speculative == "ngram"
            else None
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.proposer,
            config.spec_max_decodes,
        )
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_spec_steps = 0
        self.runner = ModelRunner(
            self.model,
            self.num_blocks,
            config.block_size,
            self.dtype,
            cfg.vocab_size,
            config.seed,
            config.device,
        )
        # graphs: one row; up to max_int4_rows; above (BatchSwitchLinear's branch)
        self.compiled = config.compile == "on" and self.runner.compile_decode(
            [1, 2, 3, max_int4_rows(self.dtype) + 1]
        )
        self.weights = describe_weights(self.model, self.dtype)
        release_free_memory()
        self.sequences: dict[str, Sequence] = {}
        log.info(
            "engine ready: %s (%s) dtype=%s weights=%s compiled_decode=%s blocks=%d x %d max_model_len=%d in %.1fs",
            self.source.name,
            self.source.architecture,
            str(self.dtype).removeprefix("torch."),
            self.weights,
            self.compiled,
            self.num_blocks,
            config.block_size,
            self.max_model_len,
            time.perf_counter() - started,
        )
        if self.proposer is not None:
            log.info(
                "speculative decoding: %s, up to %d draft tokens, n-grams %d..%d",
                config.speculative,
                config.num_speculative_tokens,
                config.ngram_min,
                config.ngram_max,
            )

    # -- requests ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.source.tokenizer.encode(text, add_special_tokens=True).ids
        bos = self.source.bos_token_id
        if self.source.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        """Every check that needs no engine state; raises typed errors."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}.", param="prompt"
            )
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"logit_bias token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}.",
                    param="logit_bias",
                )
        if qos not in QOS_CLASSES:
            raise InvalidRequestError(
                f"Unknown QoS class {qos!r}; use one of {', '.join(QOS_CLASSES)}.", "priority"
            )
        requested = params.max_tokens or 1
        if n + requested > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + requested} tokens ({n} in the prompt, {requested} in the completion). "
                "Please reduce the prompt or the completion length.",
                param="max_tokens" if n < self.max_model_len else "prompt",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        qos: str = "interactive",
        guide: TokenGuide | None = None,
    ) -> None:
        if request_id in self.sequences:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.")
        self.validate(prompt_token_ids, params, qos)
        seq = Sequence(request_id, list(prompt_token_ids), params, qos=qos, guide=guide)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self.runner.release(request_id)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # fail this step's requests alone; the loop goes on
            log.exception("step failed; failing its %d requests", len(out.scheduled))
            return [self._fail(req.seq, exc) for req in out.scheduled]
        return self._update(out, result)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        self.scheduler.finish(seq, "error")
        self.sequences.pop(seq.request_id, None)
        self.runner.release(seq.request_id)
        out = self._output(seq)
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def _update(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        for req in out.scheduled:
            lps = result.prompt_logprobs.get(req.seq.request_id)
            if lps and len(req.seq.prompt_logprobs) == req.seq.num_computed_tokens + 1:
                req.seq.prompt_logprobs.extend(lps)  # skipped when recomputing after preemption
        self.scheduler.advance(out)
        outputs = []
        for req in out.scheduled:
            seq = req.seq
            verified = result.verified.get(seq.request_id)
            if verified is not None:
                self._append_verified(seq, req.num_spec_tokens, verified)
            else:
                sampled = result.sampled.get(seq.request_id)
                if sampled is None:
                    continue
                token_id, logprob = sampled
                seq.output_token_ids.append(token_id)
                if logprob is not None:
                    seq.output_logprobs.append(logprob)
                self._check_stop(seq, token_id)
            outputs.append(self._output(seq))
            if seq.is_finished:
                self.sequences.pop(seq.request_id, None)
                self.runner.release(seq.request_id)
        return outputs

    def _append_verified(self, seq: Sequence, num_proposed: int, verified: Verified) -> None:
        """Append a verified draft's tokens one by one, stopping exactly where plain decoding
        would (EOS, stop token ids, max_tokens, context), then count the accepted KV."""
        num_kept = 0
        for j, token_id in enumerate(verified.token_ids):
            seq.output_token_ids.append(token_id)
            if verified.logprobs is not None:
                seq.output_logprobs.append(verified.logprobs[j])
            num_kept += 1
            self._check_stop(seq, token_id)
            if seq.is_finished:
                break
        num_accepted = min(verified.num_accepted, num_kept)
        seq.num_spec_proposed += num_proposed
        seq.num_spec_accepted += num_accepted
        self.num_spec_proposed += num_proposed
        self.num_spec_accepted += num_accepted
        self.num_spec_steps += 1
        if seq.is_finished:
            seq.spec_token_ids = []
        else:
            self.scheduler.accept_draft(seq, verified.num_accepted)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        if seq.guide is not None and not seq.guide.accept_token(token_id):
            log.warning("grammar rejected token %d for %s", token_id, seq.request_id)
        if token_id in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token_id)
        elif (
            not params.ignore_eos
            and token_id in self.eos_token_ids
            or seq.guide is not None
            and seq.guide.is_terminated()
        ):
            self.scheduler.finish(seq, "stop")
        elif (
            params.max_tokens is not None
            and seq.num_output_tokens >= params.max_tokens
            or seq.num_tokens >= self.max_model_len
        ):
            self.scheduler.finish(seq, "length")

    def _output(self, seq: Sequence) -> RequestOutput:
        start = seq.num_reported_tokens
        seq.num_reported_tokens = seq.num_output_tokens
        prompt_logprobs = None
        is_prompt_done = len(seq.prompt_logprobs) == seq.num_prompt_tokens or seq.is_finished
        if seq.params.prompt_logprobs is not None and not seq.is_prompt_logprobs_reported and is_prompt_done:
            prompt_logprobs = seq.prompt_logprobs
            seq.is_prompt_logprobs_reported = True
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.output_token_ids[start:],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            new_logprobs=seq.output_logprobs[start:] if seq.params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_spec_proposed=seq.num_spec_proposed if self.proposer is not None else None,
            num_spec_accepted=seq.num_spec_accepted if self.proposer is not None else None,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            spec_proposed_tokens=self.num_spec_proposed,
            spec_accepted_tokens=self.num_spec_accepted,
            spec_steps=self.num_spec_steps,
        )
