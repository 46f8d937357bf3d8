"""LLMEngine: the synchronous engine — add_request / step / abort.

One step = schedule (scheduler) -> execute (model runner) -> update (append sampled
tokens, check stop conditions, free finished requests). Not thread-safe: the async engine
drives it from a single thread.

`add_pooling_request` queues a prefill-only request whose output is its pooled hidden state
(an embedding from this chat model): it is scheduled, chunked, batched and preempted like any
prompt, on the same weights and KV pool, and finishes ("stop") with `embedding` set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time

from argosy.config import EngineConfig
from argosy.engine.adapters import AdapterSet, check_adapter, serve_adapters
from argosy.engine.block_manager import BlockManager
from argosy.engine.description import describe_engine
from argosy.engine.outputs import EngineStats, ModelDescription, RequestOutput
from argosy.engine.scheduler import Scheduler, SchedulerOutput
from argosy.engine.sequence import ImagePlacement, Sequence
from argosy.engine.validation import PREFILL_ONLY, validate_pooling_request, validate_request
from argosy.errors import InvalidRequestError
from argosy.models.build import (
    describe_weights,
    load_model,
    max_int4_rows,
    resolve_numerics,
)
from argosy.models.llava import check_images, load_vision
from argosy.models.source import ModelSource
from argosy.ops.devices import activation_reserve, gpu_kv_cache_bytes, resolve_device
from argosy.ops.memory import release_after_step, release_free_memory
from argosy.runner.compiled import compiled_graph_count
from argosy.runner.draft_model import limit_logits, make_proposer
from argosy.runner.kv_cache import kv_bytes_per_block, resolve_kv_dtype
from argosy.runner.model_runner import ModelRunner, StepResult
from argosy.runner.spec_decode import Verified
from argosy.runner.structured import TokenGuide
from argosy.sampling_params import SamplingParams

log = logging.getLogger("argosy.engine")


# The background compile starts once no request has come and no step run for this long, or this
# long after the engine is ready whatever the traffic
COMPILE_AFTER_QUIET_S = 1.0
COMPILE_START_LATEST_S = 30.0


class LLMEngine:
    def __init__(
        self, config: EngineConfig, source: ModelSource | None = None, logits_rows: int | None = None
    ) -> None:
        """`logits_rows`: logits for the first tokens only (a draft model's: runner/draft_model.py)."""
        started = time.perf_counter()
        self.config = config
        if source is None:
            from argosy.models.loader import resolve_model  # reads files; only when needed

            source = resolve_model(config.model, config.cache_dir)
        self.source = source
        self.device = resolve_device(config.device)
        self.invariant, self.dtype = resolve_numerics(
            config.numerics, config.dtype, self.device, config.quantization, source
        )
        self.model = load_model(
            self.source,
            self.dtype,
            self.device,
            config.quantization,
            pack=config.compile == "on",
            invariant=self.invariant,
        )
        if logits_rows is not None:
            limit_logits(self.model, logits_rows)
        cfg = self.model.config
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, self.model, self.invariant, self.device, self.dtype
        )
        per_block = kv_bytes_per_block(
            cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype
        )
        kv_bytes = config.kv_cache_memory
        if self.device.startswith("cuda"):  # what weights and activations leave of the GPU's share
            reserve = activation_reserve(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.vocab_size,
            )
            kv_bytes = gpu_kv_cache_bytes(
                self.device, config.gpu_memory_fraction, reserve, per_block, source.name
            )
        self.num_blocks = max(2, kv_bytes // per_block)
        capacity = self.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or self.source.context_length, capacity)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = set(self.source.eos_token_ids)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.proposer = make_proposer(config, self.source, self.max_model_len)
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
            self.device,
            invariant=self.invariant,
            max_model_len=self.max_model_len,
            kv_dtype=self.kv_dtype,
        )
        self.vision = load_vision(source, cfg.hidden_size)  # a VLM's image encoder, else None
        # LoRA adapters per request (engine/adapters.py), wrapped before any graph is compiled
        self.adapters: AdapterSet | None = serve_adapters(config, self.runner, self.source, self.device)
        # the CUDA layers give every row alike whatever its batch (ops/triton_kernels.py)
        self.deterministic = self.invariant or self.device.startswith("cuda")
        # graphs: one row; up to max_int4_rows; above (BatchSwitchLinear's branch). On CUDA:
        # a captured graph per power of two up to every running request's row
        row_counts = [1, 2, 3, max_int4_rows(self.dtype, self.invariant) + 1]
        if self.device.startswith("cuda"):
            row_counts = [config.max_num_seqs]
        self.compile_status = "off"
        self._compile_thread: threading.Thread | None = None
        self._stop_compiling = threading.Event()
        self._last_busy = time.monotonic()  # when a request last came or a step last ran
        compile_mode = config.compile
        if compile_mode != "off" and not getattr(self.model, "supports_compiled_decode", True):
            log.info("compiled decode: not built for %s; decode steps run eagerly", self.source.architecture)
            compile_mode = "off"
        if compile_mode == "on" and self.device.startswith("cuda"):
            compile_mode = "wait"  # capturing takes seconds, and must not race the steps' launches
        if compile_mode == "wait":
            self.compile_status = "ready" if self.runner.compile_decode(row_counts) else "failed"
        elif compile_mode == "on":
            self.compile_status = "compiling"
            self._compile_thread = threading.Thread(
                target=self._compile_in_background, args=(row_counts,), name="argosy-compile", daemon=True
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
            self.compile_status,
            self.num_blocks,
            config.block_size,
            self.max_model_len,
            time.perf_counter() - started,
        )
        if self.proposer is not None:
            log.info(
                "speculative decoding: %s%s, up to %d draft tokens, n-grams %d..%d",
                config.speculation_method,
                f" ({config.draft_model})" if config.draft_model else "",
                config.num_speculative_tokens,
                config.ngram_min,
                config.ngram_max,
            )
        if self._compile_thread is not None:
            self._compile_thread.start()

    @property
    def compiled(self) -> bool:
        """Whether decode steps run the compiled graphs now."""
        return self.runner.compiled is not None

    def live_compile_status(self) -> str:
        """compile_status, but "compiling" while a draft model's graphs are still being built
        after the target's: until then its draft steps run eagerly (a bench that measured once
        the target's were ready read a draft's single stream at a third of its speed)."""
        if self.compile_status == "ready" and self.proposer is not None and self.proposer.compiling():
            return "compiling"
        return self.compile_status

    def _compile_in_background(self, row_counts: list[int]) -> None:
        """The compile thread: the graphs built at the lowest CPU priority (Linux takes a
        thread's nice value, and the C++ compiler's processes inherit it) while the engine
        thread steps eagerly; the runner switches to them between steps once all are built."""
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        log.info(
            "compiling the decode step in the background (%d graphs); serving with eager steps meanwhile",
            len(row_counts),
        )
        # not while the first requests run: importing dynamo and tracing hold the GIL for
        # seconds (one cold start in bench/startup.py answered its first chat 6.6 s after /health)
        latest = time.monotonic() + COMPILE_START_LATEST_S
        while not self._stop_compiling.is_set() and time.monotonic() < latest:
            quiet = time.monotonic() - self._last_busy
            if quiet >= COMPILE_AFTER_QUIET_S and not self.has_unfinished():
                break
            self._stop_compiling.wait(0.1)
        if self._stop_compiling.is_set():
            self.compile_status = "stopped"
            return
        started = time.perf_counter()
        try:
            ready = self.runner.compile_decode(row_counts, self._stop_compiling)
        except Exception:  # noqa: BLE001 - the engine serves eagerly whatever happens here
            log.exception("compiling the decode step failed; decode steps stay eager")
            ready = False
        self.compile_status = "ready" if ready else "stopped" if self._stop_compiling.is_set() else "failed"
        if ready:
            log.info(
                "compiled decode ready after %.1fs: decode steps run the compiled graphs from now on",
                time.perf_counter() - started,
            )
        release_free_memory()

    def stop_compiling(self, timeout: float = 0.0) -> None:
        """Ask a background compile to stop after its current graph (the engine is closing);
        wait up to `timeout` seconds for it."""
        self._stop_compiling.set()
        if self.proposer is not None:
            self.proposer.stop_compiling(timeout)
        if self._compile_thread is not None and self._compile_thread.is_alive() and timeout > 0:
            self._compile_thread.join(timeout)

    def describe(self) -> ModelDescription:
        return describe_engine(self)

    # -- requests ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.source.tokenizer.encode(text, add_special_tokens=True).ids
        bos = self.source.bos_token_id
        if self.source.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        """Every check that needs no engine state; raises typed errors."""
        validate_request(prompt_token_ids, params, qos, self.vocab_size, self.max_model_len)
        check_adapter(self.adapters, params.lora)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        qos: str = "interactive",
        guide: TokenGuide | None = None,
        images: list[ImagePlacement] | None = None,
    ) -> None:
        """`images`: a VLM prompt's images (their features and where their tokens sit)."""
        if request_id in self.sequences:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.")
        self.validate(prompt_token_ids, params, qos)
        check_images(images or [], prompt_token_ids, self.vision, self.model.config.hidden_size)
        if params.batch_invariant and self.deterministic:  # every request already is: no need to run alone
            params = dataclasses.replace(params, batch_invariant=False)
        seq = Sequence(request_id, list(prompt_token_ids), params, qos=qos, guide=guide, images=images or [])
        if params.lora is not None and self.adapters is not None:
            self.adapters.hold(seq)  # resident from now until it ends
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self._last_busy = time.monotonic()

    def add_pooling_request(
        self, request_id: str, prompt_token_ids: list[int], pooling: str = "mean", qos: str = "interactive"
    ) -> None:
        """A prefill-only request: its output is the `pooling` of its last hidden states."""
        if request_id in self.sequences:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.")
        validate_pooling_request(prompt_token_ids, pooling, qos, self.vocab_size, self.max_model_len)
        seq = Sequence(request_id, list(prompt_token_ids), PREFILL_ONLY, qos=qos, pooling=pooling)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self._last_busy = time.monotonic()

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self._release(request_id)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _release(self, request_id: str) -> None:
        """A request left the engine: its sampler state, its draft's KV blocks and its hold on
        an adapter go."""
        self.runner.release(request_id)
        if self.adapters is not None:
            self.adapters.let_go(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self._last_busy = time.monotonic()
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # fail this step's requests alone; the loop goes on
            log.exception("step failed; failing its %d requests", len(out.scheduled))
            return [self._fail(req.seq, exc) for req in out.scheduled]
        release_after_step(out.num_batched_tokens)
        outputs = self._update(out, result)
        if self.proposer is not None:  # a draft model computes each prompt chunk beside the target
            self.proposer.follow(out.scheduled)
        return outputs

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        self.scheduler.finish(seq, "error")
        self.sequences.pop(seq.request_id, None)
        self._release(seq.request_id)
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
            failure = result.failed.get(seq.request_id)
            if failure is not None:  # its logits went NaN/inf: it fails alone
                seq.error = failure
                self.scheduler.finish(seq, "error")
                outputs.append(self._output(seq))
                self.sequences.pop(seq.request_id, None)
                self._release(seq.request_id)
                continue
            verified = result.verified.get(seq.request_id)
            if seq.pooling is not None:
                seq.embedding = result.pooled.get(seq.request_id)
                if seq.embedding is None:
                    continue  # a chunk short of the input's end
                self.scheduler.finish(seq, "stop")
            elif verified is not None:
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
                self._release(seq.request_id)
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
            # the mask allowed the sampled token unless it allowed none at all: the grammar
            # has no continuation here. This request fails alone; the token is not output.
            log.warning("grammar rejected token %d for %s: failing it", token_id, seq.request_id)
            seq.output_token_ids.pop()
            if len(seq.output_logprobs) > len(seq.output_token_ids):
                seq.output_logprobs.pop()
            seq.error = f"The output grammar allows no token after {seq.num_output_tokens} generated tokens."
            self.scheduler.finish(seq, "error")
            return
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
            error=seq.error,
            num_spec_proposed=seq.num_spec_proposed if self.proposer is not None else None,
            num_spec_accepted=seq.num_spec_accepted if self.proposer is not None else None,
            queue_s=seq.queue_s,
            embedding=seq.embedding,
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
            compile_status=self.live_compile_status(),
            compiled_graphs=compiled_graph_count() if self.compile_status != "off" else 0,
            **(self.adapters.stats() if self.adapters is not None else {}),
            images_encoded=self.vision.num_encoded if self.vision is not None else 0,
            image_cache_hits=self.vision.num_cache_hits if self.vision is not None else 0,
        )
