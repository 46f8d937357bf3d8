"""ModelRunner: owns the model and the KV tensors; turns a scheduled batch into tokens.

It prepares inputs (flattened tokens, positions, slots, attention metadata), runs the
model, and samples; a pooling request's rows go to the pooler instead (runner/pooler.py). It makes no policy decision: who runs and how much is the
scheduler's call.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from argosy.engine.outputs import TokenLogprob
from argosy.engine.scheduler import ScheduledRequest, SchedulerOutput
from argosy.engine.sequence import Sequence
from argosy.models.llama import DecoderForCausalLM
from argosy.models.lora import LoraModel
from argosy.ops.attention import (
    AttentionMetadata,
    ContextBatch,
    CpuPagedAttention,
    PrefillChunk,
)
from argosy.ops.native import invariant_ops_ready
from argosy.runner.compiled import MIN_BLOCKS, CompiledDecoder
from argosy.runner.cuda_graphs import CudaGraphDecoder, buckets_up_to
from argosy.runner.kv_cache import (
    copy_slots,
    kv_row_width,
    resolve_kv_dtype,
    set_k_channel_scales,
    uses_per_row_attention,
)
from argosy.runner.pooler import MeanPooler, pooling_token_ids
from argosy.runner.row_inputs import image_rows, lora_rows
from argosy.runner.sampler import Sampler, SamplingRow, greedy_picks, make_logprob, take_rows
from argosy.runner.spec_decode import Verified, verify_batch


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, tuple[int, TokenLogprob | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    verified: dict[str, Verified] = field(default_factory=dict)  # requests that carried a draft
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why (its logits are not finite)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling requests done this step


NON_FINITE = "The model's output for this request is not a number (NaN or inf); it was stopped."


def _non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] bool: a row with a NaN or +inf logit (-inf is a masked token, not a fault). One pass:
    a row's maximum is NaN when it holds one (amax propagates NaN), else +inf when it holds one."""
    top = logits.amax(dim=-1)
    return torch.isnan(top) | torch.isposinf(top)


def _plain_greedy(req: ScheduledRequest) -> bool:
    """A row whose next token is the argmax of its raw logits: greedy, nothing reported or
    applied before the argmax (logprobs, penalties, bias, a grammar)."""
    p = req.seq.params
    return (
        p.is_greedy
        and p.logprobs is None
        and not p.needs_penalties
        and not p.logit_bias
        and req.seq.guide is None
    )


# a sampling chunk of at most this many tokens runs as decode rows (each sees the context up to
# itself, as a draft's do): a draft model catching up on the tokens the target emitted, a
# prompt's tail after a prefix-cache hit
DECODE_CHUNK_TOKENS = 4


def _compiled_decode_fits(req: ScheduledRequest) -> bool:
    """Decode rows only (a few new tokens that sample, or a draft to verify), no prompt
    logprobs to compute, and no image token among them (the graph looks every embedding up)."""
    is_decode = (req.num_new_tokens <= DECODE_CHUNK_TOKENS and req.is_sampling) or req.num_spec_tokens > 0
    images = req.seq.images
    in_image = bool(images) and req.seq.num_computed_tokens < images[-1].stop
    return is_decode and req.seq.params.prompt_logprobs is None and not in_image


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the host, in an anonymous mapping of its own, whose pages become
    resident only when written, so the process's memory grows with the KV cache actually used,
    not its capacity. (calloc promised that too, but glibc serves a large request from heap
    memory the loader freed, and zeroes it: SmolLM2's whole K cache, 96 MiB, was resident at
    load.) The tensor holds the mapping; it is unmapped with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        vocab_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        invariant: bool = False,
        max_model_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's element (resolve_kv_dtype; None: the kernels' own)."""
        self.model = model
        self.max_model_len = max_model_len or num_blocks * block_size
        self.invariant = invariant
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        cfg = model.config
        backend = getattr(getattr(model.layers[0], "self_attn", None), "backend", None)
        self.per_row_attention = uses_per_row_attention(model, invariant, self.device)
        # the last layer runs for the rows the step reads alone (AttentionMetadata.keep): the
        # CPU's per-row kernel and a model whose forward honours it
        self._prunes_last_layer = (
            self.per_row_attention
            and invariant
            and self.device.type == "cpu"
            and isinstance(backend, CpuPagedAttention)
            and type(model).forward is DecoderForCausalLM.forward
        )
        self.kv_dtype = kv_dtype or resolve_kv_dtype("auto", model, invariant, self.device, dtype)
        if self.kv_dtype == torch.int8:
            set_k_channel_scales(model)
        # one extra block at the end: scratch space for compile warm-up rows and padded tables
        self.scratch_block = num_blocks
        width = kv_row_width(cfg.head_dim, self.kv_dtype)
        shape = (cfg.num_layers, (num_blocks + 1) * block_size, cfg.num_kv_heads, width)
        # one K and one V tensor for all layers; each layer works on its own view
        self.k_all = _zeros(shape, self.kv_dtype, self.device)
        self.v_all = _zeros(shape, self.kv_dtype, self.device)
        self.kv_caches = [(self.k_all[i], self.v_all[i]) for i in range(cfg.num_layers)]
        self.compiled: CompiledDecoder | None = None
        self.graphs: CudaGraphDecoder | None = None  # on CUDA, in place of the compiled step
        # plain greedy rows take their argmax where the logits are (an accelerator's: only ids
        # cross to the host); on the CPU the sampler does
        self.greedy_on_device = self.device.type != "cpu"
        self.num_compiled_steps = 0
        self.sampler = Sampler(vocab_size, torch.Generator().manual_seed(seed))
        self.generators: dict[str, torch.Generator] = {}
        self.pooler = MeanPooler()
        self.lora: LoraModel | None = None  # the model's projections wrapped for adapters

    def enable_lora(self, max_rows: int) -> LoraModel:
        """Wrap the model's projections for per-row LoRA adapters (models/lora.py), before any
        graph is compiled; every step from then on says each row's adapter."""
        self.lora = LoraModel(self.model, max_rows)
        # the last layer runs all rows: each row's adapter is told by its place in the step
        self._prunes_last_layer = False
        return self.lora

    def compile_decode(self, row_counts: list[int], stop: threading.Event | None = None) -> bool:
        """Compile the decode step for batches of these sizes (and all sizes that share their
        graphs); False keeps every step eager. May run on another thread than the steps: the
        steps take the graphs from the next one after they are all built. On CUDA: captured
        CUDA graphs for batches up to the largest row count, on the calling thread."""
        if self.device.type == "cuda":
            max_blocks = -(-self.max_model_len // self.block_size) + 1
            graphs = CudaGraphDecoder(
                self.model, self.kv_caches, self.block_size, max_blocks, self.scratch_block, self.dtype
            )
            if graphs.capture(buckets_up_to(max(row_counts))):
                self.graphs = graphs
            return self.graphs is not None
        compiled = CompiledDecoder(self.model, self.block_size, invariant=self.invariant)
        if compiled.warm_up(self.k_all, self.v_all, self.scratch_block, self.dtype, row_counts, stop):
            self.compiled = compiled
        return self.compiled is not None

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.pooler.release(request_id)

    def _slots(self, seq: Sequence, start: int, stop: int) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.long)
        all_slots = (table.unsqueeze(1) * self.block_size + torch.arange(self.block_size)).view(-1)
        return all_slots[start:stop]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        copy_slots(self.k_all, self.v_all, out.copies, self.block_size)
        # decodes first (one token each; a draft's tokens are decode rows too), then prefill chunks
        batch = sorted(out.scheduled, key=lambda r: r.num_new_tokens != 1 and not r.num_spec_tokens)
        if self.lora is not None:
            self.lora.rows.set(*lora_rows(batch))
        if self.compiled is not None and all(_compiled_decode_fits(r) for r in batch):
            return self._execute_compiled(batch, self.compiled)
        if (
            self.graphs is not None
            and all(_compiled_decode_fits(r) for r in batch)
            and sum(r.num_new_tokens for r in batch) <= self.graphs.max_rows
        ):
            return self._execute_graphs(batch, self.graphs)
        meta, input_ids, positions = self._prepare(batch)
        offsets = self._token_offsets(batch)
        kept = self._used_rows(batch, offsets) if meta.invariant and self._prunes_last_layer else None
        if kept is not None:
            meta.keep = torch.tensor(kept, dtype=torch.long)
        if self.device.type != "cpu":
            meta, input_ids = meta.to(self.device), input_ids.to(self.device)
        hidden = self.model(input_ids, self.kv_caches, meta)
        # the step's row r is hidden's row at[r] (the rows kept, in order) or r
        at = dict(zip(kept, range(len(kept)), strict=True)) if kept is not None else None
        result = StepResult()
        for i, req in enumerate(batch):
            if req.seq.params.prompt_logprobs is not None:
                lps = self._prompt_logprobs(hidden, offsets[i] if at is None else at[offsets[i]], req)
                if lps:
                    result.prompt_logprobs[req.seq.request_id] = lps
            if req.is_pooling:
                first = offsets[i] if at is None else at[offsets[i]]  # kept rows stay in order
                self._pool(hidden[first : first + req.num_new_tokens], req, result)

        def device_logits_at(rows: list[int]) -> torch.Tensor:
            index = torch.tensor(
                rows if at is None else [at[r] for r in rows], dtype=torch.long, device=hidden.device
            )
            return self.model.compute_logits(hidden[index])

        def logits_at(rows: list[int]) -> torch.Tensor:
            # sampling runs on the host (per-request CPU generators keep seeds device-independent)
            return device_logits_at(rows).cpu()

        on_device = device_logits_at if self.greedy_on_device else None
        self._sample_and_verify(batch, offsets, logits_at, result, on_device)
        return result

    def _pool(self, rows: torch.Tensor, req: ScheduledRequest, result: StepResult) -> None:
        """Add a pooling chunk's hidden rows; its vector once the chunk ends the input. A
        logits pooling: the named tokens' fp32 logits at the input's last row."""
        seq = req.seq
        token_ids = pooling_token_ids(seq.pooling or "")
        if token_ids is not None:
            if req.is_last_chunk:
                logits = self.model.compute_logits(rows[-1:]).float()[0, token_ids].cpu()
                if bool(torch.isfinite(logits).all()):
                    result.pooled[seq.request_id] = logits.tolist()
                else:
                    result.failed[seq.request_id] = NON_FINITE
            return
        self.pooler.add(seq.request_id, seq.num_computed_tokens, rows)
        if req.is_last_chunk:
            vector = self.pooler.finish(seq.request_id, seq.num_tokens)
            if vector is None:
                result.failed[seq.request_id] = NON_FINITE
            else:
                result.pooled[seq.request_id] = vector

    def _sample_and_verify(
        self,
        batch: list[ScheduledRequest],
        offsets: list[int],
        logits_at: Callable[[list[int]], torch.Tensor],
        result: StepResult,
        device_logits_at: Callable[[list[int]], torch.Tensor] | None = None,
    ) -> None:
        """Sample the next token of each sampling request (at its last row) and verify each
        draft (at every row of its chunk); `logits_at(rows)` gives float32 logits on the host.
        With `device_logits_at` (an accelerator's logits), plain greedy rows take their argmax
        there and only the token ids cross to the host (a step of 256 rows would otherwise copy
        50 MB of SmolLM2's logits); on the host they take their pick and NaN/inf check from the
        native argmax's one pass, without the sampler."""
        sampling = [(i, r) for i, r in enumerate(batch) if r.is_sampling and not r.num_spec_tokens]
        plain = [(i, r) for i, r in sampling if _plain_greedy(r)]
        at = [offsets[i] + r.num_new_tokens - 1 for i, r in plain]
        picks = None
        if plain and device_logits_at is None and invariant_ops_ready():
            picks = greedy_picks(logits_at(at)[:, : self.sampler.vocab_size])
        elif plain and device_logits_at is not None:
            logits = device_logits_at(at)[:, : self.sampler.vocab_size]
            picked = torch.stack([logits.argmax(dim=-1), _non_finite_rows(logits).long()]).cpu()
            picks = picked[0].tolist(), [bool(bad) for bad in picked[1].tolist()]
        if picks is not None:
            for (_, req), token, non_finite in zip(plain, *picks, strict=True):
                if non_finite:
                    result.failed[req.seq.request_id] = NON_FINITE
                else:
                    result.sampled[req.seq.request_id] = (token, None)
            sampling = [(i, r) for i, r in sampling if not _plain_greedy(r)]
        if sampling:
            logits = logits_at([offsets[i] + r.num_new_tokens - 1 for i, r in sampling])
            is_bad = _non_finite_rows(logits)
            if is_bad.any():  # a row gone NaN/inf fails its request alone; the others sample
                keep = [j for j, bad in enumerate(is_bad.tolist()) if not bad]
                for j in set(range(len(sampling))) - set(keep):
                    result.failed[sampling[j][1].seq.request_id] = NON_FINITE
                sampling, logits = [sampling[j] for j in keep], logits[keep]
            rows = [self._sampling_row(r.seq) for _, r in sampling]
            for (_, req), sampled in zip(sampling, self.sampler(logits, rows) if rows else [], strict=True):
                result.sampled[req.seq.request_id] = sampled
        drafted = [(i, r) for i, r in enumerate(batch) if r.num_spec_tokens]
        if drafted:
            spans = [[offsets[i] + j for j in range(r.num_new_tokens)] for i, r in drafted]
            logits = logits_at([row for span in spans for row in span])
            is_bad_row = _non_finite_rows(logits).tolist()
            starts = [sum(len(span) for span in spans[:k]) for k in range(len(spans))]
            bad = {k for k, span in enumerate(spans) if any(is_bad_row[starts[k] : starts[k] + len(span)])}
            for k in bad:
                result.failed[drafted[k][1].seq.request_id] = NON_FINITE
            kept_rows = [
                starts[k] + j for k, span in enumerate(spans) if k not in bad for j in range(len(span))
            ]
            drafted = [d for k, d in enumerate(drafted) if k not in bad]
            logits = logits[kept_rows] if bad else logits
            if drafted:
                requests = [(r.seq, r.seq.spec_token_ids) for _, r in drafted]
                verified = verify_batch(self.sampler, logits, requests, self._sampling_row)
                for (_, req), outcome in zip(drafted, verified, strict=True):
                    result.verified[req.seq.request_id] = outcome

    def _execute_compiled(self, batch: list[ScheduledRequest], compiled: CompiledDecoder) -> StepResult:
        """Decode rows only: one per decoding sequence, or one per token of a draft (each row
        sees the context up to itself, as in the eager path)."""
        bs = self.block_size
        self.num_compiled_steps += 1
        rows = sum(r.num_new_tokens for r in batch)
        # padding entries of a block table point at the scratch block (masked out)
        max_blocks = max(MIN_BLOCKS, *(len(r.seq.block_table) for r in batch))
        block_ids = torch.full((rows, max_blocks), self.scratch_block, dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        slots = torch.full((rows,), self.scratch_block * bs, dtype=torch.long)
        ids = torch.zeros(rows, dtype=torch.long)
        row = 0
        for req in batch:
            seq, table = req.seq, torch.tensor(req.seq.block_table, dtype=torch.long)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + req.num_new_tokens):
                block_ids[row, : len(table)] = table
                positions[row] = pos
                slots[row] = seq.block_table[pos // bs] * bs + pos % bs
                ids[row] = seq.token_at(pos)
                row += 1
        ctx = max_blocks * bs
        mask = torch.arange(ctx).unsqueeze(0) <= positions.unsqueeze(1)
        cos, sin = self.model.rope(positions, self.model.hidden_dtype or self.dtype)
        logits = compiled(
            ids, cos, sin, slots, block_ids.view(-1), mask.view(rows, 1, 1, ctx), self.k_all, self.v_all
        ).float()
        result = StepResult()
        offsets = self._token_offsets(batch)
        self._sample_and_verify(batch, offsets, lambda at: take_rows(logits, at), result)
        return result

    def _execute_graphs(self, batch: list[ScheduledRequest], graphs: CudaGraphDecoder) -> StepResult:
        """Decode rows only, replayed from the CUDA graph of the smallest bucket that holds them."""
        bs = self.block_size
        self.num_compiled_steps += 1
        rows = sum(r.num_new_tokens for r in batch)
        width = max(len(r.seq.block_table) for r in batch)
        tables = torch.full((rows, width), self.scratch_block, dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        slots = torch.zeros(rows, dtype=torch.long)
        ids = torch.zeros(rows, dtype=torch.long)
        row = 0
        for req in batch:
            seq = req.seq
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + req.num_new_tokens):
                tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)
                positions[row] = pos
                slots[row] = seq.block_table[pos // bs] * bs + pos % bs
                ids[row] = seq.token_at(pos)
                row += 1
        logits = graphs(ids, positions, slots, tables, positions + 1)  # on the GPU

        def device_logits_at(rows: list[int]) -> torch.Tensor:
            return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]

        result = StepResult()
        offsets = self._token_offsets(batch)
        self._sample_and_verify(
            batch, offsets, lambda at: device_logits_at(at).cpu(), result, device_logits_at
        )
        return result

    @staticmethod
    def _used_rows(batch: list[ScheduledRequest], offsets: list[int]) -> list[int] | None:
        """The step's rows whose hidden state it reads (each sampling request's last row, every
        row of a draft, of a pooling chunk or of a chunk asking prompt logprobs), in order; None when that is every
        row. A step that samples nothing (prefill chunks short of their prompts' ends) keeps its
        last row, so that no op sees zero rows. The model's last layer runs for these alone, as
        llama.cpp's does: 4.6% of Gemma 3's MACs a token, and a global attention layer."""
        rows: list[int] = []
        for first, req in zip(offsets, batch, strict=True):
            if req.seq.params.prompt_logprobs is not None or req.num_spec_tokens or req.is_pooling:
                rows.extend(range(first, first + req.num_new_tokens))
            elif req.is_sampling:
                rows.append(first + req.num_new_tokens - 1)
        total = offsets[-1] + batch[-1].num_new_tokens
        if len(rows) == total:
            return None
        return rows or [total - 1]

    @staticmethod
    def _token_offsets(batch: list[ScheduledRequest]) -> list[int]:
        offsets, total = [], 0
        for req in batch:
            offsets.append(total)
            total += req.num_new_tokens
        return offsets

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        generator = None
        if seq.params.seed is not None and not seq.params.is_greedy:
            generator = self.generators.get(seq.request_id)
            if generator is None:
                generator = torch.Generator().manual_seed(seq.params.seed)
                self.generators[seq.request_id] = generator
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, generator, seq.guide)

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slot_parts: list[torch.Tensor] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for req in batch:
            seq, start = req.seq, req.seq.num_computed_tokens
            stop = start + req.num_new_tokens
            token_start = len(ids)
            ids.extend(seq.token_at(j) for j in range(start, stop))
            pos.extend(range(start, stop))
            if req.num_new_tokens == 1:
                slot_parts.append(self._slots(seq, start, stop))
                decode_tables.append(seq.block_table)
                decode_lens.append(stop)
            elif req.num_spec_tokens or self.per_row_attention:
                # speculative verification (and every prefill in the per-row mode): one decode row
                # per token, each seeing the context up to itself (its K/V is written before
                # attention), so every position is computed as plain decoding computes it
                slot_parts.append(self._slots(seq, start, stop))
                decode_tables.extend([seq.block_table] * req.num_new_tokens)
                decode_lens.extend(range(start + 1, stop + 1))
            else:
                context_slots = self._slots(seq, 0, stop)
                slot_parts.append(context_slots[start:stop])
                prefills.append(PrefillChunk(token_start, req.num_new_tokens, stop, context_slots))
        positions = torch.tensor(pos, dtype=torch.long)
        cos, sin = self.model.rope(positions, self.model.hidden_dtype or self.dtype)
        meta = AttentionMetadata(torch.cat(slot_parts), cos, sin, prefills=prefills, invariant=self.invariant)
        meta.embeds = image_rows(batch)
        if ContextBatch.worth_it(prefills):
            meta.context_batch = ContextBatch.build(prefills)
        if decode_tables:
            self._prepare_decodes(meta, decode_tables, decode_lens)
        return meta, torch.tensor(ids, dtype=torch.long), positions

    def _prepare_decodes(self, meta: AttentionMetadata, tables: list[list[int]], lens: list[int]) -> None:
        bs = self.block_size
        max_blocks = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), max_blocks, dtype=torch.long)
        # a prefill in the per-row form repeats its sequence's table once a token: one tensor
        # and one (broadcast) copy a run of the same table, not one a row
        start = 0
        for stop in range(1, len(tables) + 1):
            if stop == len(tables) or tables[stop] is not tables[start]:
                table = tables[start]
                padded[start:stop, : len(table)] = torch.tensor(table, dtype=torch.long)
                start = stop
        ctx = max_blocks * bs
        meta.num_decodes = len(tables)
        meta.decode_max_context = ctx
        meta.decode_block_ids = padded.view(-1)
        meta.block_size = bs
        meta.decode_lens = torch.tensor(lens, dtype=torch.long)
        valid = torch.arange(ctx).unsqueeze(0) < meta.decode_lens.unsqueeze(1)
        meta.decode_mask = valid.view(len(tables), 1, 1, ctx)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, offset: int, req: ScheduledRequest
    ) -> list[TokenLogprob]:
        """Logprob of each prompt token given its prefix, for prompt positions in this chunk."""
        seq = req.seq
        start = seq.num_computed_tokens
        stop = min(start + req.num_new_tokens, seq.num_prompt_tokens - 1)
        if stop <= start:
            return []
        rows = hidden[offset : offset + (stop - start)]
        logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1).cpu()
        num_top = seq.params.prompt_logprobs or 0
        return [
            make_logprob(logprobs[j], seq.prompt_token_ids[start + j + 1], num_top)
            for j in range(stop - start)
        ]
