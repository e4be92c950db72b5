"""The target's KV cache for decoding: transformers' DynamicCache whose full-attention layers
write into preallocated buffers instead of growing by concatenation.

Why: `DynamicLayer.update` does `torch.cat([keys, new])` for every layer at every step, so each
decode step reads and rewrites the whole cache into a fresh allocation. On a CPU that copy took
up to 36% of a batched generation's time (SmolLM2-135M, 32 rows, 2-core EPYC: `aten::cat`
22.9 s of 64 s), more than attention itself; how much depends on the allocator's state (fresh
pages or reused ones), see bench/LOG.md. Here a step writes only its new tokens; capacity
doubles when full (amortised O(1) per token, like a Python list), and the layer hands attention
a view of the filled part.
Cropping rejected drafts (speculative decoding) moves the fill mark and copies nothing. The
price: up to twice the memory the filled part needs, until the cache is dropped.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_MIN_CAPACITY = 64  # tokens: the first allocation holds at least this many


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over buffers [B, H, capacity, D]; `keys` / `values` are
    views of the first `length` positions (what every reader of a DynamicLayer sees)."""

    _k: torch.Tensor | None
    _v: torch.Tensor | None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._len = 0

    def _reserve(self, need: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self._k, self._v
        cap = 0 if old_k is None else old_k.shape[-2]
        if need <= cap:
            return
        cap = max(need, 2 * cap, _MIN_CAPACITY)
        new_k = k.new_empty((*k.shape[:-2], cap, k.shape[-1]))
        new_v = v.new_empty((*v.shape[:-2], cap, v.shape[-1]))
        if self._len and old_k is not None and old_v is not None:
            new_k[..., : self._len, :] = old_k[..., : self._len, :]
            new_v[..., : self._len, :] = old_v[..., : self._len, :]
        self._k, self._v = new_k, new_v

    def _expose(self) -> None:
        assert self._k is not None and self._v is not None  # after _reserve
        self.keys = self._k[..., : self._len, :]
        self.values = self._v[..., : self._len, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(self._len + n, key_states, value_states)
        assert self._k is not None and self._v is not None
        self._k[..., self._len : self._len + n, :] = key_states
        self._v[..., self._len : self._len + n, :] = value_states
        self._len += n
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # DynamicLayer's contract: a negative count to remove
            raise ValueError(f"crop takes a negative token count, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._len = max(0, self._len + tokens_to_remove)
        self._expose()

    def reset(self) -> None:
        self._k = self._v = None
        self._len = 0
        super().reset()

    def _rows(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (in that order), copying only the filled positions."""
        if not self.is_initialized or self._k is None or self._v is None:
            return
        if self._k.device.type == "cpu" and self._compact(index.tolist()):
            return
        index = index.to(self._k.device)
        self._k = self._k[index, ..., : self._len, :].contiguous()
        self._v = self._v[index, ..., : self._len, :].contiguous()
        self._expose()

    def _compact(self, rows: list[int]) -> bool:
        """Rows leaving a batch (`rows` ascending, the decode loop's case): the kept rows move
        down in place, filled positions only, and the buffers keep their capacity. A gather
        instead copies every kept row into an exact-size buffer that the next step's `_reserve`
        copies again (a CPU batched generation spent 16% of its time there). False where `rows`
        is not strictly ascending."""
        assert self._k is not None and self._v is not None
        if any(b <= a for a, b in zip(rows, rows[1:])) or not rows or rows[-1] >= len(self._k):
            return False
        n = self._len
        for dst, src in enumerate(rows):
            if dst != src:  # src > dst: its own row has not been overwritten yet
                self._k[dst, ..., :n, :].copy_(self._k[src, ..., :n, :])
                self._v[dst, ..., :n, :].copy_(self._v[src, ..., :n, :])
        self._k, self._v = self._k[: len(rows)], self._v[: len(rows)]
        self._expose()
        return True

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._k is not None:
            self._rows(torch.arange(self._k.shape[0]).repeat_interleave(repeats))


def all_growing(cache: DynamicCache) -> bool:
    """Is every layer of `cache` a GrowingLayer (full attention), so left_padded can lay it out?"""
    return bool(cache.layers) and all(type(la) is GrowingLayer for la in cache.layers)


def left_padded(rows: list[DynamicCache], width: int) -> DynamicCache:
    """One batch cache of `rows` (single-row caches, each prefilled without padding; all_growing)
    laid out as a left-padded batch of `width` positions: row i's keys and values sit at the right
    end, the padded positions before them are zeros (the attention mask hides them, as it hides
    the keys of pad tokens)."""
    if not rows or not all(all_growing(c) for c in rows):
        raise ValueError("left_padded lays out prefilled caches of full-attention layers only")
    layers: list[GrowingLayer] = []
    for per_row in zip(*(c.layers for c in rows)):
        first = per_row[0]
        assert first._k is not None and first._v is not None  # prefilled
        b, h, _, d = first._k.shape
        # what _reserve's doubling would grow it to at the first decode step, without the copy
        cap = max(2 * width, _MIN_CAPACITY)
        # only the padding is zeroed: positions past `width` are written before they are read
        k = first._k.new_empty((len(rows) * b, h, cap, d))
        v = first._v.new_empty((len(rows) * b, h, cap, d))
        for i, la in enumerate(per_row):
            n = la._len
            k[i, :, : width - n].zero_()
            v[i, :, : width - n].zero_()
            k[i, :, width - n : width] = la.keys[0]
            v[i, :, width - n : width] = la.values[0]
        layer = GrowingLayer()
        layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
        layer._k, layer._v, layer._len = k, v, width
        layer._expose()
        layers.append(layer)
    out = rows[0]  # its settings (made from the model's config); its layers replaced
    out.layers = layers  # type: ignore[assignment]
    return out


def new_kv_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty KV cache for `model`: a DynamicCache whose full-attention layers are
    GrowingLayers. Other layer kinds (sliding windows, linear attention) stay as transformers
    made them; sliding-window layers record their past (`activate_past_recording`) so that a
    speculative decoder can crop rejected drafts."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(la) is DynamicLayer else la for la in cache.layers]
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def cache_kwarg(model: nn.Module) -> str:
    """The forward's KV-cache argument: transformers 5.x renamed `past_key_values` to `cache`
    (the old name is deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
