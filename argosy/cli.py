"""`argosy serve`: flags built from the config dataclasses; one uvicorn worker.

Every field of EngineConfig, ServerConfig and OperatorSampling is a flag (`--max-num-seqs`
for `max_num_seqs`; a few keep shorter historic names, see _FLAG_NAMES). Flags not given
leave the dataclass default, so defaults live in one place. The dataclasses validate
themselves; a bad value stops start-up with a message naming the flag.

The HTTP server starts first and answers /health 503 {"status": "loading"} while the model
loads in a background thread; /health turns 200 when generations can be served. A model
that fails to load stops the server with exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from argosy.commands.cli import EXAMPLES, add_client_commands, client_command
from argosy.commands.model_specs import DEFAULT_CHAT_MODEL, check_source, model_specs
from argosy.commands.units import parse_byte_size, parse_duration
from argosy.config import EngineConfig, ModelSpec, OperatorSampling, ServerConfig
from argosy.core.adapter_names import with_adapters
from argosy.core.keys import config_key_ring
from argosy.errors import ArgosyError
from argosy.ops.devices import resolve_device

log = logging.getLogger("argosy")

_FLAG_NAMES = {
    "num_threads": "--threads",
    "enable_prefix_caching": "--no-prefix-cache",
    "served_model_name": "--served-model-name",
    "loras": "--lora",
}
_BYTE_SIZE_FIELDS = {
    "kv_cache_memory",
    "max_body_bytes",
    "session_max_bytes",
    "max_loaded_memory",
    "max_small_body_bytes",
    "events_log_max_bytes",
    "console_body_bytes",
    "max_audio_body_bytes",
}
_SECRET_FIELDS = {"api_key", "admin_key"}  # printed as *** (a key is never printed or logged)
_DURATION_FIELDS = {
    "session_ttl",
    "request_timeout",
    "model_load_timeout",
    "keep_alive",
    "shutdown_grace",
    "max_audio_seconds",
}
# --model is repeatable: see model_specs; --lora names its own adapters (lora_pairs)
_HIDDEN_FIELDS = {"operator_sampling", "model", "loras"}
_HELP = {
    "model": "a registered name (smollm2), a .gguf file or a Hugging Face folder",
    "native_ops": "on | off: Argosy's C++ CPU ops (built on first use); off: the Python ops",
    "numerics": "auto | fast | invariant (the same tokens and logprobs for a request whatever its batch, "
    "prompt chunking or cache hits; needs the native ops and quantized weights). auto: invariant "
    "where the weights are quantized (a GGUF's Q4 blocks) and it can run, else fast",
    "max_loaded_models": "most models loaded at once; past it the least recently used unpinned one is unloaded",
    "max_loaded_memory": "bytes of loaded models (weights + KV pool) before the least recently used is unloaded",
    "max_concurrent_loads": "model loads running at once",
    "model_load_timeout": "seconds a request waits for its model to load, then 503 + Retry-After",
    "sse_keepalive_s": "seconds without a frame before an OpenAI SSE stream sends a ': keep-alive' comment (default 15; 0: off)",
    "tool_repair_budget": "auto tool calls failing their tool's schema written again under its grammar, per request (default 1; 0: off, the call comes back as text named tool_call_invalid)",
    "max_images_per_request": "images one chat request may hold, for a vision-language model (default 8)",
    "max_rerank_documents": "documents one rerank request (pairs one /v1/score request) may hold (default 1000)",
    "max_stream_buffer": "engine outputs a streaming client may leave unread before its generation is stopped (slow_reader)",
    "api_key": "an API key every route but /health then needs (Authorization: Bearer KEY or x-api-key: KEY); repeatable",
    "admin_key": "an API key that may also load and unload LoRA adapters (POST /v1/load_lora_adapter); repeatable",
    "api_key_file": "a file of API keys, one per line (keeps them out of the process listing)",
    "api_keys": "a TOML file of API keys with per-key policy ([[key]]: name, key or key_sha256, models, requests_per_minute, tokens_per_minute, max_concurrent, max_qos, expires)",
    "insecure": "allow a non-loopback --host without any API key",
    "rate_limit_per_minute": "requests per minute per client address (token bucket; loopback exempt unless --rate-limit-loopback)",
    "burst": "the per-address bucket's depth (default: one minute's rate)",
    "rate_limit_loopback": "apply --rate-limit-per-minute to loopback clients too",
    "trusted_proxies": "an address or CIDR of a proxy whose X-Forwarded-For names the client; repeatable",
    "allowed_origins": "a browser origin allowed by CORS (or *); repeatable; none: CORS off",
    "max_small_body_bytes": "largest body on routes that generate nothing (default 1M); suffixes as for --kv-cache-memory",
    "max_audio_body_bytes": "largest upload on the audio routes (default 100M); suffixes as for --kv-cache-memory",
    "max_audio_seconds": "longest audio one transcription request may hold (default 30m); suffixes as for --session-ttl",
    "max_audio_jobs": "audio jobs (POST /v1/audio/generate) waiting or running at once; past it 503 (default 16)",
    "max_speech_chars": "most characters of text one speech request may hold (default 4096)",
    "events_log": "write every request's events as JSON lines to this file (rotated at --events-log-max-bytes)",
    "events_log_max_bytes": "rotate the events log past this size (default 64M)",
    "events_ring_size": "requests kept in memory for the console (default 1000)",
    "console_body_bytes": "bytes of each listed request's and response's body the console can show (default 32K; 0: none)",
    "shutdown_grace": "on SIGTERM / SIGINT, how long in-flight requests may run on before they are aborted (default 30s)",
    "keep_alive": "unload a model idle this long (suffixes as for --session-ttl); default: never",
    "dtype": "auto | bfloat16 | float32 | float16 (auto: bf16 on CUDA and where the CPU has it)",
    "device": "cpu | cuda | cuda:N | auto (CUDA where torch sees a GPU, else the CPU)",
    "gpu_memory_fraction": "on CUDA, the share of GPU memory the engine may hold; the KV cache takes what weights and activations leave (default 0.85)",
    "quantization": "weight-only: none | int4 (a GGUF's own Q4_0/Q4_1 blocks) | int8 | auto (int4 where the file has them)",
    "max_model_len": "context length (default: the model's, capped by the KV cache)",
    "kv_cache_memory": "bytes for the KV cache (default 192M); suffixes K, M, G, T (binary), e.g. 512M, 2G",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": "token budget per step (bounds a prefill chunk)",
    "enable_prefix_caching": "disable the prefix cache",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "served_model_name": "the model id clients use and see (default: the --model value)",
    "max_body_bytes": "largest request body; suffixes as for --kv-cache-memory",
    "data_dir": "where sessions are stored (sessions.sqlite3); default ~/.local/share/argosy",
    "session_ttl": "how long a session is kept after its last update; suffixes s, m, h, d (default 30d)",
    "session_max_bytes": "cap on stored session events, least recently updated go first; suffixes as for --kv-cache-memory",
    "max_queued_requests": "requests waiting to start, beyond which new ones get 503 + Retry-After",
    "request_timeout": "wall-clock limit per generation, then it ends with finish_reason length; suffixes as for --session-ttl",
    "temperature": "operator default temperature (a request's own value wins)",
    "top_p": "operator default top_p (with top_k/min_p: one truncation set)",
    "top_k": "operator default top_k (0 disables)",
    "min_p": "operator default min_p",
    "repetition_penalty": "operator default repetition penalty",
    "max_tokens": "operator default max_tokens (clamped to the room left in the context)",
    "spec_max_temperature": "with --speculative on: cap on a default temperature nobody chose explicitly",
    "speculative": "speculative decoding: none | ngram (prompt lookup: drafts copied from the context)",
    "num_speculative_tokens": "most draft tokens verified per step and request (--speculative)",
    "spec_max_decodes": "speculate only in steps with at most this many decoding requests",
    "ngram_min": "shortest suffix n-gram the ngram proposer looks up",
    "ngram_max": "longest suffix n-gram the ngram proposer looks up (tried first)",
    "kv_cache_dtype": "the KV cache's element: auto | fp16 | bf16 | int8 (llama.cpp's q8_0: 0.53x the bytes, "
    "~1.9x the tokens in --kv-cache-memory; the invariant kernels only)",
    "draft_model": "a smaller model of the same tokenizer that drafts tokens for the chat models "
    "(speculative decoding; with --speculative ngram, n-gram drafts first)",
    "draft_vocab": "the draft model proposes among the first N token ids only (its output head cut; 0: all)",
    "enable_lora": "wrap the layers for LoRA adapters without --lora (for POST /v1/load_lora_adapter)",
    "max_loras": "LoRA adapters resident at once per model (least recently used beyond it: read again on use)",
    "max_lora_rank": "largest LoRA rank an adapter may have",
}


def _field_parser(cls: type, field: dataclasses.Field[Any]) -> Callable[[str], Any]:
    if field.name in _BYTE_SIZE_FIELDS:
        return parse_byte_size
    if field.name in _DURATION_FIELDS:
        return parse_duration
    hint = typing.get_type_hints(cls)[field.name]
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)] or [hint]
    base = arms[0]
    if base not in (int, float, str):
        raise TypeError(f"{cls.__name__}.{field.name}: no flag parser for {hint}")
    return typing.cast(Callable[[str], Any], base)


def _add_flags(parser: argparse.ArgumentParser, cls: type, group_name: str) -> None:
    group = parser.add_argument_group(group_name)
    for field in dataclasses.fields(cls):
        if field.name in _HIDDEN_FIELDS:
            continue
        flag = _FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))
        dest = f"{cls.__name__}.{field.name}"
        help_text = _HELP.get(field.name)
        hint = typing.get_type_hints(cls)[field.name]
        if hint is bool:
            action = "store_false" if field.default is True else "store_true"
            group.add_argument(flag, dest=dest, action=action, default=argparse.SUPPRESS, help=help_text)
            continue
        if typing.get_origin(hint) is list:  # repeatable
            group.add_argument(
                flag,
                dest=dest,
                action="append",
                default=argparse.SUPPRESS,
                metavar=field.name.upper(),
                help=help_text,
            )
            continue
        group.add_argument(
            flag,
            dest=dest,
            type=_field_parser(cls, field),
            default=argparse.SUPPRESS,
            metavar=field.name.upper(),
            help=help_text,
        )


def _values_for(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = f"{cls.__name__}."
    return {dest.removeprefix(prefix): value for dest, value in vars(args).items() if dest.startswith(prefix)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="argosy",
        description="Self-hosted LLM inference daemon.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_server_flags(
        commands.add_parser("serve", help="serve models over HTTP (OpenAI, Anthropic, Ollama dialects)")
    )
    fleet = commands.add_parser(
        "fleet", help="serve as a fleet on Ray: this head, chat models on N engine nodes (argosy[fleet])"
    )
    _add_server_flags(fleet)
    nodes = fleet.add_argument_group("fleet")
    nodes.add_argument("--nodes", type=int, default=2, help="engine nodes per chat model (default 2)")
    nodes.add_argument(
        "--address",
        default=None,
        metavar="RAY_ADDRESS",
        help="join a running Ray cluster (one node per Ray node, at most --nodes); default: start one here",
    )
    nodes.add_argument(
        "--placement",
        default="affinity,prefix,least-loaded",
        help="placement policies in order: affinity, prefix, least-loaded, round-robin (default %(default)s)",
    )
    nodes.add_argument(
        "--node-cpus", type=float, default=None, help="CPUs each node reserves (default: cores / nodes)"
    )
    nodes.add_argument(
        "--node-ip-address",
        default=None,
        help="with --address: this head's address on the cluster's network (default: Ray's guess)",
    )
    add_client_commands(commands)
    return parser


def _add_server_flags(serve: argparse.ArgumentParser) -> None:
    models = serve.add_argument_group("models")
    models.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        metavar="[ID=]SOURCE[:QUANT]",
        help="a model to serve, repeatable: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2, "
        "fast=smollm2:int4, minilm (embeddings), whisper-tiny.en or whisper-base (transcription), "
        "piper-joe or espeak (speech), "
        "a .gguf file or a model folder; the first one is loaded at start-up, the others on request "
        f"(default: {DEFAULT_CHAT_MODEL})",
    )
    models.add_argument(
        "--models",
        dest="models_file",
        default=None,
        metavar="MODELS.TOML",
        help="models from a TOML file ([[model]] tables: id, source, kind, aliases, quantization, "
        "compile, max_model_len, keep_alive, pinned, adapters, [model.sampling])",
    )
    lora_help = "a LoRA adapter (a PEFT folder or a GGUF LoRA) of the first chat model, served as model NAME"
    models.add_argument(
        "--lora", dest="loras", action="append", metavar="NAME=PATH", help=lora_help + "; repeatable"
    )
    serve.add_argument(
        "--config",
        default=None,
        metavar="ARGOSY.TOML",
        help="every setting from a TOML file (keys as the flags' names; model / models as --model "
        "/ --models, or [[model]] tables); flags given on the command line win",
    )
    _add_flags(serve, EngineConfig, "engine")
    _add_flags(serve, ServerConfig, "server")
    _add_flags(serve, OperatorSampling, "operator sampling defaults")


def _flag_of(param: str | None) -> str:
    if param is None:
        return "a flag"
    return _FLAG_NAMES.get(param, "--" + param.replace("_", "-"))


def configs_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[EngineConfig, ServerConfig, list[ModelSpec]]:
    try:
        operator = OperatorSampling(**_values_for(args, OperatorSampling))
        model_args, models_file = getattr(args, "models", None), getattr(args, "models_file", None)
        config_specs = getattr(args, "config_specs", None)  # a --config file's [[model]] tables
        if config_specs and not model_args and not models_file:
            specs = config_specs
        else:
            specs = model_specs(model_args, models_file)
        specs = with_adapters(specs, getattr(args, "loras", None) or [])  # --lora: the first chat model's
        engine_config = EngineConfig(model=specs[0].source, **_values_for(args, EngineConfig))
        server_config = ServerConfig(**_values_for(args, ServerConfig), operator_sampling=operator)
        # read the key files now: a bad one stops start-up naming the file and the key
        config_key_ring(server_config)
        for spec in specs:
            check_source(spec.source)
        resolve_device(engine_config.device)  # a device that is not here: one line, before anything loads
        if server_config.served_model_name not in (None, specs[0].id):  # the same name: nothing to alias
            specs[0] = dataclasses.replace(
                specs[0], id=server_config.served_model_name, aliases=(*specs[0].aliases, specs[0].id)
            )
    except ArgosyError as exc:
        parser.error(f"{_flag_of(exc.param)}: {exc.message}")
    return engine_config, server_config, specs


def _print_config(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    def line(title: str, values: dict[str, Any]) -> None:
        print(f"argosy: {title}: " + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)

    server_values = dataclasses.asdict(server_config)
    operator_values = server_values.pop("operator_sampling")
    for name in _SECRET_FIELDS:
        if server_values.get(name):
            server_values[name] = ["***"] * len(server_values[name])
    line("engine", dataclasses.asdict(engine_config))
    line("server", server_values)
    line("operator sampling", operator_values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("serve", "fleet"):
        return client_command(args)
    if args.config is not None:
        from argosy.config_file import apply_config_file

        try:
            apply_config_file(args, args.config)
        except ArgosyError as exc:
            parser.error(f"--config: {exc.message}")
    engine_config, server_config, specs = configs_from_args(parser, args)
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _print_config(engine_config, server_config)
    for spec in specs:
        print(f"argosy: model: {spec}", flush=True)
    from argosy.commands.serve import serve

    if args.command == "fleet":
        return serve(engine_config, server_config, specs, loader=_fleet_loader(parser, args))
    return serve(engine_config, server_config, specs)


def _fleet_loader(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    try:
        import ray  # noqa: F401 - the optional extra

        from argosy.fleet.launch import FleetOptions, fleet_loader
        from argosy.fleet.placement import parse_placement
    except ImportError as exc:
        parser.error(f"argosy fleet needs Ray: pip install 'argosy[fleet]' ({exc})")
    if args.nodes < 1:
        parser.error("--nodes: at least 1")
    try:
        placement = parse_placement(args.placement)
    except ArgosyError as exc:
        parser.error(f"--placement: {exc.message}")
    options = FleetOptions(args.nodes, args.address, placement, args.node_cpus, args.node_ip_address)
    return fleet_loader(options)
