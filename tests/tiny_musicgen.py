"""A tiny MusicGen folder with random weights, built offline (no MusicGen ships on PyPI): a
1-layer T5 text encoder, an EnCodec audio encoder of 8 kHz with a hop of 160 samples (50
frames a second, as MusicGen's 32 kHz EnCodec) with random codebooks, a 1-layer decoder over
2 codebooks, and a Unigram T5 tokenizer of a few words written here. Sampling as MusicGen's generation config
(top-k, classifier-free guidance 3.0), so a seed matters.
"""

from __future__ import annotations

from pathlib import Path

WORDS = ["a", "calm", "piano", "piece", "loud", "drums", "with", "and", "slow", "guitar", "fast", "song"]
SAMPLE_RATE = 8000
FRAME_RATE = 50
NUM_CODEBOOKS = 2


def build_tiny_musicgen(folder: Path) -> Path:
    import torch
    from transformers import (
        EncodecConfig,
        EncodecFeatureExtractor,
        MusicgenConfig,
        MusicgenDecoderConfig,
        MusicgenForConditionalGeneration,
        MusicgenProcessor,
        T5Config,
        T5Tokenizer,
    )

    # a Unigram vocabulary: T5's three specials, then one piece per word ("▁" marks a word start)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + word, -1.0 - 0.1 * i) for i, word in enumerate(WORDS)]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0)
    text = T5Config(
        vocab_size=len(tokenizer),
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
    )
    codebook_size = 64
    audio = EncodecConfig(
        sampling_rate=SAMPLE_RATE,
        hidden_size=16,
        num_filters=4,
        upsampling_ratios=[8, 5, 4],  # hop 160: 50 frames a second
        codebook_size=codebook_size,
        num_lstm_layers=1,
        target_bandwidths=[0.6],  # 600 bits/s over 50 frames of 6-bit codes: 2 codebooks
        num_residual_layers=1,
    )
    assert audio.frame_rate == FRAME_RATE and audio.num_quantizers == NUM_CODEBOOKS
    decoder = MusicgenDecoderConfig(
        vocab_size=codebook_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        num_codebooks=NUM_CODEBOOKS,
        pad_token_id=codebook_size,  # MusicGen's: the codebook size starts and pads
        bos_token_id=codebook_size,
    )
    torch.manual_seed(0)
    model = MusicgenForConditionalGeneration(
        MusicgenConfig(text_encoder=text, audio_encoder=audio, decoder=decoder)
    ).eval()
    with torch.no_grad():  # EnCodec starts its codebooks at zero: every code would sound the same
        for layer in model.audio_encoder.quantizer.layers:
            layer.codebook.embed.normal_()
    generation = model.generation_config
    generation.do_sample, generation.top_k, generation.guidance_scale = True, 50, 3.0
    generation.decoder_start_token_id = generation.pad_token_id = codebook_size
    model.save_pretrained(folder)
    feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE)
    MusicgenProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(folder)
    return folder
