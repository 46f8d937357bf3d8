"""Building a decoder model for serving: its dtype, its weights loaded from the source,
quantized (a GGUF's own int4 blocks, or int8) and packed for oneDNN; and the one-line
description of how its weights are held (for /v1/models and the start-up log).

Process-wide torch state is not touched here except the default dtype while the modules are
built (under a lock, so two models loading at once cannot see each other's)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from argosy.errors import ModelLoadError
from argosy.models.device_kernels import DEVICE_KERNELS
from argosy.models.gguf_convert import float_copies_missing
from argosy.models.gguf_quant import BLOCKS_FILE, INT4_FILE
from argosy.models.llama import MLP, DecoderForCausalLM, RMSNorm
from argosy.models.llava import VISION_KEY, decoder_weight_name
from argosy.models.loader import ensure_float_copies
from argosy.models.quantize import (
    FUSED_PARTS,
    apply_blocks,
    apply_int4,
    apply_int8,
    apply_int8_head,
    block_codes_of,
    take_fine_form,
)
from argosy.models.registry import builder_for
from argosy.models.source import ModelSource
from argosy.models.tensor_file import TensorFile
from argosy.ops.composite_linear import BatchSwitchLinear
from argosy.ops.devices import out_of_memory
from argosy.ops.packed_linear import PackedLinear, apply_packing, packing_supported
from argosy.ops.quantized_linear import (
    BlockCodes,
    CodesEmbedding,
    Int4Linear,
    Int8Linear,
    codes_are_exact,
    invariant_qlinear,
    native_qlinear,
)

log = logging.getLogger("argosy.models")

# torch.set_default_dtype is process-wide: held while a model's modules are built
_BUILD_LOCK = threading.Lock()

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16
    caps = torch._C._cpu._get_cpu_capability()
    has_bf16 = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return torch.bfloat16 if has_bf16 else torch.float32


def invariant_unavailable(dtype: torch.dtype, device: str, quantization: str) -> str | None:
    """Why the invariant numerics cannot run with these settings here; None when they can."""
    if device != "cpu":
        return f"its kernels are CPU kernels (device {device})"
    if quantization == "none":
        return "it runs the quantized kernels: use --quantization auto, int4 or int8"
    if dtype != torch.bfloat16:
        return "it holds weights and KV cache in bfloat16: use --dtype bfloat16 or auto"
    if not invariant_qlinear(dtype):
        return "its kernels need the native ops (a C++ compiler, --native-ops on); none built here"
    return None


def resolve_numerics(
    numerics: str, dtype_name: str, device: str, quantization: str, source: ModelSource
) -> tuple[bool, torch.dtype]:
    """(invariant?, the model dtype) for `--numerics`: fast; invariant (refused with the
    reason where it cannot run); auto, the default: invariant where the weights are quantized
    (a GGUF's blocks under quantization auto, or int4/int8 asked) and its kernels run here,
    else fast (float weights stay float: the invariant kernels are quantized ones). The
    invariant mode computes in int8 and float32 and stores bfloat16 (no bf16 arithmetic),
    so dtype auto is bfloat16 for it on any CPU."""
    dtype = resolve_dtype(dtype_name, device)
    if numerics == "fast" or device.startswith("cuda"):  # CUDA's layers are invariant as they are
        return False, dtype
    storage = torch.bfloat16 if dtype_name == "auto" and device == "cpu" else dtype
    why = invariant_unavailable(storage, device, quantization)
    if numerics == "invariant":
        if why is not None:
            raise ModelLoadError(f"--numerics invariant: {why}")
        return True, storage
    quantized = quantization in ("int4", "int8") or (
        quantization == "auto"
        and any((Path(source.weights_dir) / name).exists() for name in (INT4_FILE, BLOCKS_FILE))
    )
    if quantized and why is not None:
        log.info("numerics: fast, not invariant (%s)", why)
    return (True, storage) if quantized and why is None else (False, dtype)


# int4 weights serve steps of up to this many rows, packed bf16 the rest: torch's int4 kernel
# slows with every row (4 measured best, bench/engine.py); the native one (AMX) stays ahead
# of the bf16 GEMM up to 32 (30 layers of SmolLM2's shapes, cold weights, ad-hoc
# microbenchmark: 8 rows 7.6 vs 18.5 ms, 16 rows 8.7 vs 18.9, 32 rows 15.6 vs 22.7)
MAX_INT4_ROWS_TORCH = 4
MAX_INT4_ROWS_NATIVE = 32


def max_int4_rows(dtype: torch.dtype, invariant: bool = False) -> int:
    """Rows up to which int4 layers serve a step and float twins the rest; 0 where the
    invariant kernels serve every number of rows (one form of the weights, no twin)."""
    if invariant and invariant_qlinear(dtype):
        return 0
    return MAX_INT4_ROWS_NATIVE if native_qlinear(dtype) else MAX_INT4_ROWS_TORCH


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: str = "cpu",
    quantization: str = "none",
    pack: bool = False,
    invariant: bool = False,
) -> DecoderForCausalLM:
    """Build and load the model; quantize it; with `pack`, pack float weights for oneDNN
    (and keep int4 layers' float twins for steps of many rows); with `invariant`, the
    quantized layers run the invariant kernels for every row count (no twins)."""
    with _BUILD_LOCK:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build the parameters in their final dtype: no fp32 copy
        try:
            with _weights_left_uninitialised():  # every one is loaded from the files next
                model = builder_for(source.architecture)(source.hf_config)
        finally:
            torch.set_default_dtype(previous)
    assert isinstance(model, DecoderForCausalLM)
    served = served_by_codes(model, source) if invariant and quantization in ("auto", "int4") else set()
    if float_copies_missing(Path(source.weights_dir)) - served:  # floats the kernels' codes don't replace
        ensure_float_copies(source)
    files = sorted(Path(source.weights_dir).glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {source.weights_dir}")

    # a VLM's checkpoint: the decoder's tensors under their own names, the rest is the vision
    # encoder's (models/llava.py)
    rename = decoder_weight_name if VISION_KEY in source.hf_config else None

    def weights():  # type: ignore[no-untyped-def]
        # one tensor at a time: a whole file in memory at once raised the load's peak RSS
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                    name = stored if rename is None else rename(stored)
                    if name is not None and name not in served:
                        yield name, f.get_tensor(stored)
        yield from ((name, None) for name in sorted(served))  # their codes replace them

    model.load_weights(weights())
    # the parameters themselves (never ids: a freed one's id comes back on a new object); left
    # unwritten, their pages were never touched, so holding them costs no memory
    unread = [p for name, p in model.named_parameters() if _param_hf_names(name) & served]
    swap = DEVICE_KERNELS.get(torch.device(device).type)
    if swap is not None:  # the device's own layers, swapped on the host, then moved
        count = swap(model.eval(), source, quantization)
        log.info(
            "%s kernels: %d Q4 projections, the rest %s", device, count, str(dtype).removeprefix("torch.")
        )
        try:
            return model.to(device=device)
        except torch.cuda.OutOfMemoryError as exc:
            raise out_of_memory(source.name, device, model_memory_bytes(model)) from exc
    model = model.to(device=device, dtype=dtype).eval()
    pack = pack and packing_supported(dtype, device)
    if invariant and (why := invariant_unavailable(dtype, device, quantization)) is not None:
        raise ModelLoadError(f"--numerics invariant: {why}")
    _quantize(
        model, source, dtype, device, quantization, max_int4_rows(dtype, invariant) if pack else 0, invariant
    )
    if invariant:  # the residual stream in float32 (bench/quality.py: KL to the fp32 reference -17%)
        model.hidden_dtype = torch.float32
        take_fine_form(model)
        for name, module in model.named_modules():
            if isinstance(module, MLP):
                module.invariant_ops = True
            if isinstance(module, RMSNorm):
                module.float64_mean = True
                # its weight in float32 as the file holds it (a GGUF's norms are F32)
                rows = file_rows(files, [f"model.{name}.weight"])
                exact = rows(0, module.weight.shape[0]) if rows is not None else module.weight
                module.weight = torch.nn.Parameter(exact.detach().float(), requires_grad=False)
    left = [name for name, p in model.named_parameters() if any(p is q for q in unread)]
    del unread
    if left:  # served_by_codes promised codes the quantization did not take: a bug, not input
        raise ModelLoadError(f"internal: weights left unread but not replaced by their codes: {left[:3]}")
    if pack:
        log.info(
            "packed %s weights: %d linear layers", str(dtype).removeprefix("torch."), apply_packing(model)
        )
    return model


def served_by_codes(model: DecoderForCausalLM, source: ModelSource) -> set[str]:
    """The HF weight names the invariant mode serves from a GGUF's own codes (argosy-int4 /
    argosy-blocks files), whose float copies need never be read: every part of a fused
    projection with codes in one file (apply_int4 / apply_blocks take it whole), and the head
    and an untied embedding with codes in 16-row tiles of 32-column groups. Reading them
    anyway held the whole model in bf16 at load (Qwen2.5-Coder-1.5B: 3.1 GB before its 1 GB of
    codes replaced it)."""
    if not invariant_qlinear(model.embed_tokens.weight.dtype):
        return set()
    coded: dict[str, set[str]] = {}  # file -> the weights it has codes of
    for name in (INT4_FILE, BLOCKS_FILE):
        path = Path(source.weights_dir) / name
        if path.exists():
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())  # noqa: SIM118 - safe_open has keys(), no iteration
            coded[name] = {key.removesuffix(".codes") for key in keys if key.endswith(".codes")}
    served: set[str] = set()
    for i in range(model.config.num_layers):
        for parts in FUSED_PARTS.values():
            names = {f"model.layers.{i}.{p}.weight" for p in parts}
            if any(names <= file_names for file_names in coded.values()):
                served |= names
    blocks = coded.get(BLOCKS_FILE, set())  # the head's and the embedding's codes come from here
    tied = model.lm_head.weight is model.embed_tokens.weight
    vocab, hidden = model.embed_tokens.weight.shape
    if vocab % 16 == 0 and hidden % 32 == 0:
        for name in ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"]):
            if name in blocks:
                served.add(name)
    return served


def _param_hf_names(param_name: str) -> set[str]:
    """The HF weight names a parameter of ours is loaded from (a fused one from its parts)."""
    for fused, parts in FUSED_PARTS.items():
        if f".{fused}." in f".{param_name}":
            return {"model." + param_name.replace(fused, part) for part in parts}
    return {param_name if param_name == "lm_head.weight" else "model." + param_name}


@contextlib.contextmanager
def _weights_left_uninitialised() -> Iterator[None]:
    """Modules built without their random initialisation: load_weights overwrites every
    parameter (and refuses a checkpoint that lacks one), and initialising them cost 5.9 s of
    Gemma 3's 10.5 s load (a 262k x 640 embedding drawn from a normal distribution)."""
    names = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_", "trunc_normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def file_rows(files: list[Path], names: list[str]) -> Callable[[int, int], torch.Tensor] | None:
    """Rows [start, stop) of the weights `names` stacked in order (as a fused layer holds
    them), read from the safetensors files as stored (a converted GGUF's are float32: a Q8_0
    weight's exact values); None when one of them is not there."""
    where: dict[str, tuple[Path, int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                if name in names:
                    where[name] = (file, f.get_slice(name).get_shape()[0])
    if any(name not in where for name in names):
        return None

    def rows(start: int, stop: int) -> torch.Tensor:
        parts, offset = [], 0
        for name in names:
            file, count = where[name]
            lo, hi = max(start - offset, 0), min(stop - offset, count)
            if lo < hi:
                with safe_open(str(file), framework="pt") as f:
                    parts.append(f.get_slice(name)[lo:hi])
            offset += count
        return torch.cat(parts)

    return rows


def _head_rows(model: DecoderForCausalLM, files: list[Path]) -> Callable[[int, int], torch.Tensor] | None:
    tied = model.lm_head.weight is model.embed_tokens.weight
    return file_rows(files, ["model.embed_tokens.weight" if tied else "lm_head.weight"])


def _head_codes(model: DecoderForCausalLM, source: ModelSource) -> BlockCodes | None:
    """The output head's own codes in the converted GGUF's codes file, read alone; None where
    there are none."""
    codes_file = Path(source.weights_dir) / BLOCKS_FILE
    if not codes_file.exists():
        return None
    tied = model.lm_head.weight is model.embed_tokens.weight
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    with safe_open(str(codes_file), framework="pt") as f:
        wanted = {key: f.get_tensor(key) for key in f.keys() if key.startswith(f"{name}.")}  # noqa: SIM118
    return block_codes_of(wanted, [name])


def _fast_head(
    model: DecoderForCausalLM,
    source: ModelSource,
    files: list[Path],
    dtype: torch.dtype,
    max_int4_rows: int | None,
) -> None:
    """The fast numerics' output head. Where the invariant kernels build, theirs: the file's own
    codes (or its Q8_0-style codes), x in the fine form, fp32 logits (bench/quality.py, fast
    mode KL to the fp32 reference: SmolLM2 2.05e-3 -> 5.0e-4; its int8-per-channel or bf16 head
    was most of it). Else an int8 head per channel (max_int4_rows given: beside a Q4 model's
    blocks) or the float one. float32 asks for precision: its head stays exact."""
    if dtype == torch.float32:
        return
    if invariant_qlinear(dtype):
        head_rows, head_codes = _head_rows(model, files), _head_codes(model, source)
        apply_int8_head(
            model, dtype, invariant=True, float_output=True, weight_rows=head_rows, blocks=head_codes
        )
    elif max_int4_rows is not None:
        # the native int8 kernel serves any number of rows (2+; torch's serves one): no float
        # twin of the head (57 MB of SmolLM2's peak memory)
        apply_int8_head(model, dtype, 0 if native_qlinear(dtype) else max_int4_rows, float_output=True)


def _quantize(
    model: DecoderForCausalLM,
    source: ModelSource,
    dtype: torch.dtype,
    device: str,
    mode: str,
    max_int4_rows: int = 0,
    invariant: bool = False,
) -> None:
    if mode == "none":
        return
    if device != "cpu":
        raise ModelLoadError(f"quantization {mode!r} uses CPU kernels; use --quantization none on {device}")
    files = sorted(Path(source.weights_dir).glob("model*.safetensors"))
    # a GGUF's other block formats (Q8_0 ... Q6_K) as their own codes, on the invariant kernels,
    # read a tensor at a time as each layer is packed (tensor_file.py)
    codes_file = Path(source.weights_dir) / BLOCKS_FILE
    own_codes: Mapping[str, torch.Tensor] = (
        TensorFile(codes_file) if invariant and mode != "int8" and codes_file.exists() else {}
    )
    try:
        _quantize_from(model, source, dtype, mode, files, own_codes, max_int4_rows, invariant)
    finally:
        if isinstance(own_codes, TensorFile):
            own_codes.close()


def _quantize_from(
    model: DecoderForCausalLM,
    source: ModelSource,
    dtype: torch.dtype,
    mode: str,
    files: list[Path],
    own_codes: Mapping[str, torch.Tensor],
    max_int4_rows: int,
    invariant: bool,
) -> None:
    blocks_file = Path(source.weights_dir) / INT4_FILE

    # the invariant kernels' int8 is GGUF's Q8_0 (scales per group of 32), quantized from the
    # weights as the files hold them: a Q8_0 weight (SmolLM2's tied head) is its own codes
    def rows_of(names: list[str]) -> Callable[[int, int], torch.Tensor] | None:
        return file_rows(files, names) if invariant else None

    if mode == "int8":
        count = apply_int8(model, dtype, invariant, rows_of)
    elif blocks_file.exists() or own_codes:
        count = (
            _apply_int4_file(model, blocks_file, dtype, max_int4_rows, invariant)
            if blocks_file.exists()
            else 0
        )
        if invariant:  # the rest: their own codes, else int8, so every layer runs the kernels
            count += apply_blocks(model, own_codes, dtype)
            count += apply_int8(model, dtype, invariant, rows_of)
        else:
            _fast_head(model, source, files, dtype, max_int4_rows)
    elif mode == "int4":
        raise ModelLoadError(
            "int4 uses a GGUF file's own blocks (Q4_0 ... Q6_K); this model has none (try int8)"
        )
    elif invariant:  # auto without 4-bit blocks: int8, which the invariant kernels serve
        count = apply_int8(model, dtype, invariant, rows_of)
    else:  # auto without 4-bit blocks: keep the float weights (the head as the fast mode's)
        _fast_head(model, source, files, dtype, None)
        return
    if invariant:  # the head on the same kernels, its logits in float32
        tied = model.lm_head.weight is model.embed_tokens.weight
        head_rows = _head_rows(model, files)
        head_codes = block_codes_of(own_codes, ["model.embed_tokens.weight" if tied else "lm_head.weight"])
        apply_int8_head(
            model, dtype, invariant=True, float_output=True, weight_rows=head_rows, blocks=head_codes
        )
        del head_codes  # packed now: its int8 codes (1.5B: 233 MB) need not outlive the packing
        head = model.lm_head
        # a tied Q8_0 table: the tokens' embeddings from the head's codes, exact in float32 as
        # llama.cpp reads them (a bf16 table rounds them to 8 bits), and no bf16 copy of the
        # table (57 MB for SmolLM2). A file's own codes are its values by construction (the
        # converter wrote the float weights from them): checked only where we quantized
        if (
            tied
            and isinstance(head, Int8Linear)
            and head.invariant
            and (head.own_codes or (head_rows is not None and codes_are_exact(head, head_rows)))
        ):
            model.embed_tokens = CodesEmbedding(head)  # type: ignore[assignment]
        embed_codes = None if tied else block_codes_of(own_codes, ["model.embed_tokens.weight"])
        if embed_codes is not None:
            # an untied table from its own codes too, at their bits: exact in float32, and no
            # bf16 copy (Qwen2.5-Coder-1.5B: 467 MB in bf16, 131 MB as the file's Q4_K)
            table = Int8Linear(None, None, dtype, invariant=True, blocks=embed_codes)
            if table.invariant:
                model.embed_tokens = CodesEmbedding(table, owned=True)  # type: ignore[assignment]
    log.info("quantization %s: %d projection layers", mode, count)


def _apply_int4_file(
    model: DecoderForCausalLM, blocks_file: Path, dtype: torch.dtype, max_int4_rows: int, invariant: bool
) -> int:
    with TensorFile(blocks_file) as blocks:
        return apply_int4(model, blocks, dtype, max_int4_rows, invariant)


def describe_weights(model: DecoderForCausalLM, dtype: torch.dtype) -> str:
    """How the projections are held, for /v1/models and the start-up log."""
    kinds = {type(m) for m in model.modules()}
    gpu = {kind.__name__ for kind in kinds} & {"TritonLinear", "TritonQ4Linear"}
    if gpu:  # the CUDA layers (models/device_kernels.py)
        floats = str(dtype).removeprefix("torch.")
        q4 = "int4 (GGUF Q4 blocks), the rest " if "TritonQ4Linear" in gpu else ""
        return f"{q4}{floats} (Triton kernels, fixed reduction order)"
    float_kind = str(dtype).removeprefix("torch.") + (" (oneDNN-packed)" if PackedLinear in kinds else "")
    head = model.lm_head
    int8_head = isinstance(head, Int8Linear) or (
        isinstance(head, BatchSwitchLinear) and isinstance(head.small, Int8Linear)
    )
    projections = [m for name, m in model.named_modules() if name != "lm_head"]
    own = [m for m in projections if isinstance(m, Int8Linear) and m.own_codes]
    packed_bits = sorted({m.packed.bits for m in own if m.packed is not None})
    held = [
        *(["int4 (GGUF Q4 blocks)"] if any(isinstance(m, Int4Linear) for m in projections) else []),
        *(
            [f"the GGUF's codes at their own bits ({', '.join(map(str, packed_bits))})"]
            if packed_bits
            else []
        ),
        *(["int8 codes of the GGUF's other blocks"] if any(m.packed is None for m in own) else []),
    ]
    head_packed = head.packed if isinstance(head, Int8Linear) else None
    head_name = "int8 output head" if head_packed is None else f"{head_packed.bits}-bit output head"
    int4 = ", ".join(held) + (f", {head_name}" if int8_head else "")
    if any(getattr(m, "invariant", False) for m in model.modules()):
        int4 += " (invariant kernels: every row count, fp32 logits)" if int8_head else " (invariant kernels)"
    switches = [m for m in model.modules() if isinstance(m, BatchSwitchLinear)]
    if switches and isinstance(head, Int8Linear):  # the head is int8 at every step
        return (
            f"int4 (GGUF Q4 blocks) for steps of <= {switches[0].max_small_rows} rows, {float_kind} above; "
            "int8 output head"
        )
    if switches:
        return f"{int4} for steps of <= {switches[0].max_small_rows} rows, {float_kind} above"
    if held:
        return int4
    if Int8Linear in kinds:
        return "int8 (per channel)"
    return float_kind


def model_memory_bytes(model: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers (what torch sees of it)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
