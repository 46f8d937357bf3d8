"""What a step's rows carry besides their tokens, laid out in the step's row order (each
scheduled request's new tokens in turn): a VLM prompt's image features (the rows whose
embedding they replace) and each row's LoRA adapter slot and scale."""

from __future__ import annotations

import torch

from argosy.engine.scheduler import ScheduledRequest
from argosy.models.lora import BASE_SLOT


def image_rows(batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """AttentionMetadata.embeds of a step: its rows that hold an image token, and their features."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    first = 0
    for req in batch:
        start = req.seq.num_computed_tokens
        stop = start + req.num_new_tokens
        for image in req.seq.images:
            lo, hi = max(start, image.start), min(stop, image.stop)
            if lo < hi:
                rows.extend(range(first + lo - start, first + hi - start))
                values.append(image.embeds[lo - image.start : hi - image.start])
        first += req.num_new_tokens
    return (torch.tensor(rows, dtype=torch.long), torch.cat(values)) if rows else None


def lora_rows(batch: list[ScheduledRequest]) -> tuple[list[int], list[float]]:
    """(slot, scale) of every row of a step: its request's adapter (BASE_SLOT and 0: none)."""
    slots: list[int] = []
    scales: list[float] = []
    for req in batch:
        slot = req.seq.lora_slot
        slots.extend([slot] * req.num_new_tokens)
        scales.extend([req.seq.params.lora_scale if slot != BASE_SLOT else 0.0] * req.num_new_tokens)
    return slots, scales
