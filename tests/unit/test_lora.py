"""LoRA adapters per request (argosy/models/lora.py, engine/adapters.py), on a tiny random Llama
with adapters made by peft (random non-zero B): Argosy's greedy tokens and logprobs equal
transformers + peft's; requests for the base and for two adapters batched together each get
the tokens they get alone (eager and compiled, in the invariant mode); the native kernel's rows
are independent of their neighbours on every CPU path; the resident slots are bounded (least
recently used idle one gives way; none idle: a 503); the prefix cache keeps adapters apart;
adapters that do not fit the base are refused naming why."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from argosy.engine.llm_engine import LLMEngine
from argosy.errors import InvalidRequestError, ModelLoadError, OverloadedError
from argosy.models.lora_file import AdapterError
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import TinyModel
from tests.unit.test_engine import greedy, prompt, run, run_one

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(tiny: TinyModel, folder: Path, targets: list[str], seed: int, rank: int = 8) -> Path:
    """A peft adapter of `tiny`'s reference with random A and B (B non-zero), saved to `folder`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(tiny.reference), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def peft_reference(tiny: TinyModel, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(tiny.reference), adapter).eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(tiny_llama, root / "attn", ATTENTION, 1),
        "mlp": make_adapter(tiny_llama, root / "mlp", ATTENTION[:1] + MLP, 2, rank=4),
    }


@pytest.fixture(scope="module")
def tiny_llama(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    from tests.unit.conftest import _get

    return _get(tiny_models, "llama", tmp_path_factory)


def with_loras(tiny: TinyModel, adapters: dict[str, Path], **options: object) -> LLMEngine:
    return tiny.engine(loras=tuple((name, str(path)) for name, path in adapters.items()), **options)


def invariant(**options: object) -> dict[str, object]:
    return dict(dtype="bfloat16", quantization="int8", numerics="invariant", **options)


@torch.inference_mode()
def reference_greedy(
    model: torch.nn.Module, ids: list[int], n: int, **inputs: object
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's log-softmax; `inputs`: the model's others
    (a VLM's pixel_values)."""
    out = model.generate(
        input_ids=torch.tensor([ids]),
        **inputs,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.log_softmax(torch.cat(out.logits).float(), -1)


@pytest.mark.parametrize("name", ["attn", "mlp"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_peft(
    tiny_llama: TinyModel, adapters: dict[str, Path], name: str
) -> None:
    engine = with_loras(tiny_llama, adapters)
    ids = prompt(12, 7)
    tokens, logprobs = reference_greedy(peft_reference(tiny_llama, adapters[name]), ids, 24)
    out = run_one(engine, ids, greedy(24, lora=name, logprobs=0))
    assert out.token_ids == tokens
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # the adapter changes the answer: the base's tokens are not these
    assert run_one(engine, ids, greedy(24), "base").token_ids == tiny_llama.greedy(ids, 24) != tokens


@pytest.mark.parametrize("compile_mode", ["off", "wait"])
def test_a_batch_of_base_and_two_adapters_gives_each_its_solo_tokens(
    tiny_llama: TinyModel, adapters: dict[str, Path], compile_mode: str
) -> None:
    engine = with_loras(tiny_llama, adapters, **invariant(compile=compile_mode))
    requests = {
        f"{name}-{k}": (prompt(9 + 3 * k, 40 + k), greedy(20, lora=name))
        for k in range(2)
        for name in ("attn", "mlp", None)
    }
    alone = {rid: run_one(engine, ids, params, rid).token_ids for rid, (ids, params) in requests.items()}
    together = run(engine, requests)
    assert {rid: r.token_ids for rid, r in together.items()} == alone
    # the base rows are the base model's own, bit for bit: an engine without LoRA agrees
    plain = tiny_llama.engine(**invariant(compile=compile_mode))
    for rid, (ids, params) in requests.items():
        if params.lora is None:
            assert run_one(plain, ids, params, rid).token_ids == alone[rid]
    assert len(set(map(tuple, alone.values()))) == len(alone)
    if compile_mode == "wait":
        assert engine.runner.num_compiled_steps > 0


def test_the_native_kernel_gives_a_row_the_same_bits_alone_and_batched_on_every_path() -> None:
    from argosy.ops.native import load_invariant_ops

    if not load_invariant_ops():
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(3)
    rows, d_in, d_out = 9, 100, 70
    y, x = torch.randn(rows, d_out, generator=g), torch.randn(rows, d_in, generator=g)
    a = [torch.randn(8, d_in, generator=g), torch.empty(0), torch.randn(4, d_in, generator=g)]
    bt = [torch.randn(8, d_out, generator=g), torch.empty(0), torch.randn(4, d_out, generator=g)]
    slot = torch.tensor([0, -1, 2, 1, 0, 2, 7, 0, 2])
    scale = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 1.0, -1.0, 1.0])
    path = torch.ops.argosy_iq.path()
    try:
        outs = []
        for name in torch.ops.argosy_iq.paths():
            torch.ops.argosy_iq.set_path(name)
            out = torch.ops.argosy_iq.lora(y, x, slot, scale, a, bt)
            for r in range(rows):  # alone
                one = torch.ops.argosy_iq.lora(
                    y[r : r + 1], x[r : r + 1], slot[r : r + 1], scale[r : r + 1], a, bt
                )
                assert torch.equal(one[0], out[r]), (name, r)
            outs.append(out)
    finally:
        torch.ops.argosy_iq.set_path(path)
    assert all(torch.equal(o, outs[0]) for o in outs)
    for r in (1, 3, 6):  # base, an adapter that does not touch it, a slot past the list
        assert torch.equal(outs[0][r], y[r])
    exact = y[0].double() + (bt[0].double().T @ (a[0].double() @ x[0].double()))
    assert torch.allclose(outs[0][0].double(), exact, atol=1e-4)


def test_slots_are_bounded_least_recently_used_idle_gives_way(
    tiny_llama: TinyModel, adapters: dict[str, Path]
) -> None:
    engine = with_loras(tiny_llama, adapters, max_loras=1)
    ids = prompt(10, 5)
    first = run_one(engine, ids, greedy(8, lora="attn"), "a1").token_ids
    run_one(engine, ids, greedy(8, lora="mlp"), "m1")  # evicts attn (idle)
    assert engine.adapters is not None and engine.adapters.get("attn").slot is None  # type: ignore[union-attr]
    assert run_one(engine, ids, greedy(8, lora="attn"), "a2").token_ids == first  # read again
    engine.add_request("m2", ids, greedy(8, lora="mlp"))
    with pytest.raises(OverloadedError, match="max-loras"):
        engine.add_request("a3", ids, greedy(8, lora="attn"))  # mlp's only slot is busy
    while engine.has_unfinished():
        engine.step()
    assert all(a.users == 0 for a in engine.adapters.adapters.values())


def test_the_prefix_cache_keeps_an_adapter_apart_from_the_base(
    tiny_llama: TinyModel, adapters: dict[str, Path]
) -> None:
    engine = with_loras(tiny_llama, adapters)
    ids = prompt(40, 9)  # two full blocks of 16
    base = run_one(engine, ids, greedy(6), "b")
    adapted = run_one(engine, ids, greedy(6, lora="attn"), "a")
    assert adapted.num_cached_tokens == 0
    again = run_one(engine, ids, greedy(6, lora="attn"), "a2")
    assert again.num_cached_tokens == 32 and again.token_ids == adapted.token_ids != base.token_ids


def test_requests_and_adapters_that_do_not_fit_are_refused(
    tiny_llama: TinyModel,
    adapters: dict[str, Path],
    tiny_models: dict[str, TinyModel],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    engine = with_loras(tiny_llama, adapters)
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'") as caught:
        engine.validate(prompt(4, 1), SamplingParams(lora="nope"))
    assert caught.value.param == "lora"
    with pytest.raises(InvalidRequestError, match="serves none"):
        tiny_llama.engine().validate(prompt(4, 1), SamplingParams(lora="attn"))
    assert engine.adapters is not None
    with pytest.raises(AdapterError, match="max-lora-rank"):
        tiny_llama.engine(enable_lora=True, max_lora_rank=4).adapters.add("big", str(adapters["attn"]))  # type: ignore[union-attr]
    from tests.unit.conftest import _get

    qwen3 = _get(tiny_models, "qwen3", tmp_path_factory)  # head_dim 32: q/k/v of other shapes
    other = make_adapter(qwen3, tmp_path / "qwen3", ATTENTION, 4)
    with pytest.raises(AdapterError, match="do not fit the base"):
        engine.adapters.add("other", str(other))
    with pytest.raises(ModelLoadError, match="wrong"):
        with_loras(tiny_llama, {"wrong": other})
    with pytest.raises(AdapterError):
        engine.adapters.add("missing", str(tmp_path / "nothing-here"))


def test_a_gguf_lora_serves_the_same_tokens_as_its_peft_folder(
    tiny_llama: TinyModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The PEFT adapter written as convert_lora_to_gguf.py writes it (llama's q/k rows of B in
    llama.cpp's rope order): read back un-permuted, it runs the same tokens."""
    import numpy as np

    from argosy.models.lora_file import read_adapter
    from tests.unit.test_lora_file import _write_gguf

    def permute(rows: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter's order
        return (
            rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2)
            .reshape(rows.shape)
        )

    roles = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    heads = {"q_proj": 4, "k_proj": 2}
    weights = read_adapter(adapters["attn"])
    tensors = {}
    for (layer, name), (a, b, _) in weights.modules.items():
        b_rows = b.numpy()
        tensors[f"blk.{layer}.{roles[name]}.weight.lora_a"] = a.numpy()
        tensors[f"blk.{layer}.{roles[name]}.weight.lora_b"] = (
            permute(b_rows, heads[name]) if name in heads else b_rows
        )
    gguf_file = _write_gguf(tmp_path / "attn.gguf", tensors, arch="llama", alpha=weights.alpha)
    engine = with_loras(tiny_llama, {"peft": adapters["attn"], "gguf": gguf_file})
    ids = prompt(11, 13)
    assert (
        run_one(engine, ids, greedy(16, lora="gguf"), "g").token_ids
        == run_one(engine, ids, greedy(16, lora="peft"), "p").token_ids
    )
