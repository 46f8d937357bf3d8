"""Loading a configured model into this process: the registry's `load_fn` for local engines.

A chat model becomes an AsyncEngine (built on its own engine thread) behind a ModelService;
an embedding model an AsyncEmbeddingEngine behind an EmbeddingService; a cross-encoder (kind
rerank) a CrossEncoderEngine on the same worker behind a RerankService; an audio model (kind
transcription or speech) a TranscriptionService or SpeechService (argosy/audio/); an image
model a diffusers pipeline behind an ImageService (argosy/images/); a music model a MusicGen
folder behind a MusicService (argosy/audio/music.py). Runs on a worker
thread (the registry's), never on the event loop.
"""

from __future__ import annotations

from argosy.config import EngineConfig, ModelSpec, ServerConfig
from argosy.core.embedding_service import EmbeddingService
from argosy.core.recording import SessionRecorder
from argosy.core.registry import LoadedModel
from argosy.core.service import ModelService, ServiceOptions


class LocalModelLoader:
    def __init__(
        self,
        engine_config: EngineConfig,
        server_config: ServerConfig,
        sessions: SessionRecorder | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.server_config = server_config
        self.sessions = sessions

    def __call__(self, spec: ModelSpec) -> LoadedModel:
        config = spec.engine_config(self.engine_config)
        if spec.kind in ("transcription", "speech"):
            return _audio_model(spec, config.num_threads)
        if spec.kind == "image":
            from argosy.images.service import ImageService

            return ImageService(spec.id, spec.source)
        if spec.kind == "music":
            from argosy.audio.music import MusicService

            return MusicService(spec.id, spec.source)
        if spec.kind == "embedding":
            from argosy.engine.embedding_engine import AsyncEmbeddingEngine, EmbeddingEngine

            source, max_len = spec.source, spec.max_model_len
            encoder = AsyncEmbeddingEngine(lambda: EmbeddingEngine(source, max_input_tokens=max_len))
            return EmbeddingService(spec.id, encoder)
        from argosy.models.cross_encoder import is_cross_encoder_folder

        # kind rerank over a causal LM (a Qwen3-Reranker folder): its own chat engine below,
        # scored as a yes/no judge (core/judge_scorer.py)
        if spec.kind == "rerank" and is_cross_encoder_folder(spec.source):
            from argosy.core.rerank_service import RerankService
            from argosy.engine.cross_encoder_engine import CrossEncoderEngine
            from argosy.engine.embedding_engine import AsyncEmbeddingEngine

            source, max_len = spec.source, spec.max_model_len
            scorer = AsyncEmbeddingEngine(lambda: CrossEncoderEngine(source, max_input_tokens=max_len))
            return RerankService(spec.id, scorer)
        from argosy.engine.async_engine import AsyncEngine
        from argosy.engine.llm_engine import LLMEngine

        engine = AsyncEngine(lambda: LLMEngine(config))  # built on its own thread
        options = ServiceOptions.of(spec, self.server_config, config.speculation_method)
        return ModelService(spec.id, engine, options, sessions=self.sessions)


def _audio_model(spec: ModelSpec, num_threads: int | None) -> LoadedModel:
    import os

    from argosy.audio.sources import audio_source
    from argosy.errors import ModelLoadError

    source = audio_source(spec.source)
    if source is None or source.kind != spec.kind:
        raise ModelLoadError(
            f"model {spec.id!r}: {spec.source!r} is not a {spec.kind} model (a registered audio model, "
            "a CTranslate2 Whisper folder or a Piper .onnx voice)"
        )
    if source.kind == "transcription":
        from argosy.audio.transcription import TranscriptionService

        return TranscriptionService(spec.id, source, threads=num_threads or os.cpu_count() or 1)
    from argosy.audio.speech import SpeechService

    return SpeechService(spec.id, source)
