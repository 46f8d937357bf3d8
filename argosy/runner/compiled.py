"""A decode step compiled with torch.compile (inductor) for CPU.

Why: an eager decode step is dominated by per-op dispatch; inductor fuses the small
element-wise ops between the (packed bf16 or int4) matmuls (see
shared/notes/cpu-decode-probe.md). Few graphs cover every batch size and context length: a
single row gets a graph of its own (a size-1 dimension specialises; padding it to 2 rows
cost ~25% more in the int4 kernel), more rows share graphs with a dynamic batch dimension
(one per side of BatchSwitchLinear's int4/bf16 switch), and attention is an opaque custom op
so the context length never reaches inductor's code generation.

Each layer's attention op writes its new K/V into the cache in place (a custom op that
declares the mutation, which inductor re-inplaces: no copy of the cache). The op is the C++
one from argosy/ops/native.py when it builds (it reads K/V straight from the blocks:
~30 us a layer at one row where the Python op's gather + SDPA took ~100), else the Python
op below. The graph runs from inductor's C++ wrapper, not generated Python, and once every
graph exists the compiled code is called directly (chosen once per row count by dynamo's
guards: `_find_direct`), not through dynamo's guarded frame hook.

Only decode-only steps use it (one new token per sequence, no prompt logprobs); prefill
and mixed steps run the eager model. If compiling fails, the runner stays eager; a compiled
step that fails at run time reruns eagerly.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from argosy.models.llama import DecoderForCausalLM, DecoderLayer, cast_for_cache
from argosy.ops.attention import grouped_decode_attention, window_mask
from argosy.ops.memory import release_free_memory
from argosy.ops.native import compiler_hint, load_native_ops, native_sources_digest
from argosy.progress import StatusLine

log = logging.getLogger("argosy.runner")

MIN_BLOCKS = 2  # block tables are padded to this, so their dynamic length is never 1

# torch._dynamo and torch._inductor are imported by the first compile, on its thread, not with
# this module: ~2.5 s of a start's way to /health. Set once they are, so nothing else imports
# them meanwhile (two threads importing their cyclic modules at once see one half-initialized)
_COMPILER_IMPORTED = threading.Event()
_COMPILER_IMPORT_LOCK = threading.Lock()


# one graph compiles at a time in the process: a graph's inductor config (below) must not reach
# another engine's graph compiling beside it
_COMPILE_LOCK = threading.Lock()


def _graph_config(rows: int) -> dict[str, Any]:
    """Inductor settings for one graph. One row: its fused kernels (norms, RoPE, residual adds)
    run on one thread: each works on a few thousand values, and OpenMP's fork and join on
    every one cost more than the work (Qwen2.5-Coder-1.5B, AMX, one-row step 45.7-47.4 ->
    43.7-46.3 ms in alternating runs; at 8 rows the same setting was 2-3% slower, so the
    multi-row graph keeps its threads). Part of the compile cache's key, as all of inductor's
    config is."""
    return {"cpp.threads": 1} if rows == 1 else {}


def _import_compiler() -> None:
    with _COMPILER_IMPORT_LOCK:
        import torch._dynamo
        import torch._inductor.config  # noqa: F401 - the config CompiledDecoder sets

        _COMPILER_IMPORTED.set()


@torch.library.custom_op("argosy::paged_decode_attention", mutates_args=("k_cache", "v_cache"))
def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Write each row's new K/V at its slot, then attend over its blocks (CpuPagedAttention's
    decode, as one opaque op so the context length stays out of inductor's code).

    q: [B, H, D]; k, v: [B, KVH, D]; k_cache, v_cache: [slots, KVH, D]; slots: [B];
    block_ids: [B * max_blocks]; mask: [B, 1, 1, max_blocks * block_size] bool. Returns [B, H * D].
    """
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return grouped_decode_attention(q, k_cache, v_cache, block_ids, mask, block_size)


@paged_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, slots, block_ids, mask, block_size):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class DecodeGraph(nn.Module):
    """The whole decode forward (embeddings to logits) as one traceable function: the model's
    own layers (`forward_with`, `attend_with`: Llama's, Gemma 3's), with the paged attention op
    in place of the eager backend."""

    def __init__(
        self, model: DecoderForCausalLM, block_size: int, native: bool, invariant: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        # the invariant mode's kernel (csrc/iq_attention.cpp: the same for every row, prefill rows
        # included); else the C++ op (csrc/paged_decode.cpp) when it built, else the Python one
        self.invariant = invariant
        if invariant:
            self.attention = torch.ops.argosy_iq.attention
        else:
            self.attention = (
                torch.ops.argosy_ext.paged_decode if native else torch.ops.argosy.paged_decode_attention
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_ids: torch.Tensor,
        mask: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> torch.Tensor:
        model = self.model
        x = model.embed(input_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        masks: dict[int | None, torch.Tensor] = {None: mask}  # a sliding window's, made once a step
        for i, module in enumerate(model.layers):
            layer = cast(DecoderLayer, module)  # Llama's, or a model's own with the same two methods
            scale = layer.self_attn.k_channel_scale
            attend = functools.partial(self._attend, k_all[i], v_all[i], slots, block_ids, masks, scale)
            attention = functools.partial(layer.self_attn.attend_with, cos=cos, sin=sin, attend=attend)
            x = layer.forward_with(x, attention)
        return model.compute_logits(model.norm(x))

    def _attend(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        block_ids: torch.Tensor,
        masks: dict[int | None, torch.Tensor],
        k_channel_scale: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """One layer's heads: the new K/V written at the slots, then each row over its blocks
        (a sliding-window layer's mask narrowed as AttentionMetadata.windowed narrows eager's)."""
        q, k, v = cast_for_cache(q, k, v, k_cache.dtype, self.invariant, k_channel_scale)
        if window is not None and window not in masks:
            masks[window] = window_mask(masks[None], window)
        return cast(
            torch.Tensor,
            self.attention(q, k, v, k_cache, v_cache, slots, block_ids, masks[window], self.block_size),
        )


def compiled_graph_count() -> int:
    """How many decode graphs this process has compiled (dynamo's cache entries of the one
    DecodeGraph.forward code object, every engine's together); 0 where torch's cache API is
    not there, and before a compile imported dynamo."""
    if not _COMPILER_IMPORTED.is_set():
        return 0
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(DecodeGraph.forward.__code__))
    except Exception:  # noqa: BLE001 - an internal API
        return 0


class _Stopped(Exception):
    """The engine shut down while the decode step compiled."""


class CompiledDecoder:
    def __init__(
        self, model: DecoderForCausalLM, block_size: int, native: bool | None = None, invariant: bool = False
    ) -> None:
        self.block_size = block_size
        self.native = load_native_ops() if native is None else native
        self.graph = DecodeGraph(model, block_size, self.native, invariant).eval()
        _import_compiler()
        # torch's compile caches (inductor's, AOTAutograd's) key a graph by its own code, not by
        # the native ops it calls: after our ops' sources change (a new argument), a cached
        # graph still calls them the old way and the compile fails. Their sources' digest in
        # every key keeps one build's graphs apart from another's
        torch.compiler.config.cache_key_tag = native_sources_digest()
        # compile in this process: a pool of compile workers would add ~1 GB to the server's
        # peak memory for a one-off start-up cost
        torch._inductor.config.compile_threads = 1
        # every engine's graphs are cache entries of the one DecodeGraph.forward code object, so
        # a process that loads many models (a multi-model server, a test run) passes dynamo's
        # default limit of 8 and the next model's compile fails ("hit config.recompile_limit")
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4096
        )
        # a C++ wrapper calls the graph's ~400 kernels and ops instead of generated Python:
        # ~1 ms less per step at one row
        torch._inductor.config.cpp_wrapper = True
        # ...and that wrapper (one function of straight-line calls, ~380 KB of C++ for 18 layers)
        # built at -O1 apart from the kernels (-O3, as before): one graph of Gemma 3 or SmolLM2
        # compiled in ~60 s instead of ~200 on an AVX2 EPYC, with a smaller compiler process.
        # The kernels' code and flags are unchanged, so are their bits
        torch._inductor.config.cpp_wrapper_build_separate = True
        # no size/stride check of every input and op output on each call (~600 a step, ~7% of
        # SmolLM2's one-row step): the graph is called only with the shapes it was compiled for
        # (its row count; the dynamic dims are arguments), and our ops' outputs are contiguous
        torch._inductor.config.size_asserts = False
        if invariant:
            # round every intermediate to the model dtype where eager rounds it: a fused kernel
            # otherwise keeps fp32 between ops, and a token decoded in an eager (mixed) step
            # would differ from the same token decoded here (bench/batch_flips.py, int4: 38 of
            # 100 prompts -> 0 of 32). Process-wide, as inductor's config is.
            torch._inductor.config.emulate_precision_casts = True
        self.fn = torch.compile(self.graph, dynamic=False, fullgraph=True)
        self.warm = False
        self.num_eager_fallbacks = 0  # compiled steps that failed and ran eagerly instead
        # once warm: row count -> the graph's compiled code, called without dynamo's frame hook
        self._direct: dict[int, Callable[..., Any]] = {}

    def __call__(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_ids: torch.Tensor,
        mask: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
    ) -> torch.Tensor:
        if input_ids.shape[0] > 1:  # one row: its own static graph
            for t in (input_ids, cos, sin, slots, mask):
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(block_ids, 0)
        torch._dynamo.mark_dynamic(mask, 3)
        args = (input_ids, cos, sin, slots, block_ids, mask, k_all, v_all)
        if not self.warm:
            return cast(torch.Tensor, self.fn(*args))
        try:
            return self._run_warm(args)
        except Exception as exc:  # noqa: BLE001 - a graph that fails once must not fail the step
            # the K/V writes are idempotent (same values, same slots), so the step reruns eagerly
            self.num_eager_fallbacks += 1
            log.warning("compiled decode step failed (%s); this step runs eagerly", exc)
            return cast(torch.Tensor, self.graph(*args))

    def _run_warm(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One step once every graph exists: the compiled code called directly, else dynamo's
        guarded call."""
        direct = self._direct.get(args[0].shape[0]) or self._find_direct(args)
        if direct is not None:
            return cast(torch.Tensor, direct(self.graph, *args))
        # No garbage collection inside the guarded call: a collection there runs weakref
        # callbacks and finalizers (an asyncio transport's __del__, a WeakSet's _remove) as Python
        # frames under dynamo's frame hook, which the stance below refuses to compile
        # ("Recompilation triggered"), failing the step. Collection resumes at the next
        # allocation after it. (The direct call has no frame hook: nothing to refuse.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            # evaluate only the guards that pick between the graphs
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return cast(torch.Tensor, self.fn(*args))
        finally:
            if collecting:
                gc.enable()

    def _find_direct(self, args: tuple[torch.Tensor, ...]) -> Callable[..., Any] | None:
        """The compiled code dynamo would pick for these arguments, as a plain function: dynamo
        checks ~3,200 guards (every weight tensor's shape, stride and dtype) on each call, ~1 ms
        a step at one row even with only the distinguishing guards evaluated; the graphs are
        fixed once warm, so the choice is made once per row count. Called with the graph module
        as `self`, the code fetches the weights from it and calls the compiled graph, exactly
        what dynamo runs after its guards pass. None (the guarded call, below) when no cache
        entry matches or torch's cache API is not there."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            names = DecodeGraph.forward.__code__.co_varnames[:9]  # self and the 8 arguments
            frame_locals = dict(zip(names, (self.graph, *args), strict=True))
            for entry in _debug_get_cache_entry_list(DecodeGraph.forward.__code__):
                if entry.guard_manager.check(frame_locals):
                    fn = types.FunctionType(entry.code, DecodeGraph.forward.__globals__)
                    self._direct[args[0].shape[0]] = fn
                    return fn
        except Exception as exc:  # noqa: BLE001 - an internal API: without it, dynamo's own call
            log.debug("no direct call of the compiled decode step (%s)", exc)
        return None

    @torch.inference_mode()
    def warm_up(
        self,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        scratch_block: int,
        dtype: torch.dtype,
        row_counts: list[int],
        stop: threading.Event | None = None,
    ) -> bool:
        """Compile now on dummy rows that only touch the scratch block, once per row count
        given (layers that switch on the batch size make one graph per side); False (and eager
        from then on) on failure, or when `stop` is set before the last graph. Safe beside
        eager steps on another thread: dynamo's frame hook is per thread, and the dummy rows
        write only the scratch block."""
        started = time.perf_counter()
        log.info(
            "compiling the decode step for this CPU: %d graphs (a first start takes minutes; later starts "
            "read torch's compile cache); requests are served meanwhile with eager steps",
            len(row_counts),
        )
        line = StatusLine(
            "compiling the decode step for this CPU (first start only; later starts read the cache)"
        )
        try:
            with line:
                for i, count in enumerate(row_counts):
                    line.update(f"graph {i + 1} of {len(row_counts)}, {count} rows")
                    if stop is not None and stop.is_set():
                        raise _Stopped
                    rows, blocks = count, MIN_BLOCKS + i
                    ids = torch.zeros(rows, dtype=torch.long)
                    positions = torch.zeros(rows, dtype=torch.long)
                    cos, sin = self.graph.model.rope(positions, self.graph.model.hidden_dtype or dtype)
                    slots = torch.full((rows,), scratch_block * self.block_size, dtype=torch.long)
                    block_ids = torch.full((rows * blocks,), scratch_block, dtype=torch.long)
                    mask = torch.zeros(rows, 1, 1, blocks * self.block_size, dtype=torch.bool)
                    mask[..., 0] = True
                    with _COMPILE_LOCK, torch._inductor.config.patch(_graph_config(count)):
                        self(ids, cos, sin, slots, block_ids, mask, k_all, v_all)
                    # each graph's tracing garbage goes before the next: ~50 MB lower peak RSS
                    gc.collect()
                    release_free_memory()
                    log.info(
                        "compiled decode graph %d of %d (%d rows) at %.1fs",
                        i + 1,
                        len(row_counts),
                        count,
                        time.perf_counter() - started,
                    )
        except _Stopped:
            log.info("compiling the decode step stopped (the engine is shutting down)")
            return False
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
            log.warning(
                "torch.compile of the decode step failed (%s); decoding eagerly%s", exc, compiler_hint()
            )
            return False
        self.warm = True
        attention = "native C++" if self.native else "Python op"
        log.info("decode step compiled in %.1fs (attention: %s)", time.perf_counter() - started, attention)
        return True
