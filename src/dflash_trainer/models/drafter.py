"""The DFlash drafter: Qwen3-style decoder layers with target-feature KV injection
(dflash-method.md §1).

    features [B,S,n*H] --fc--> hidden_norm --> ctx [B,S,H]    (computed once per context token)
    block_embeds [B,Q,H] (target's frozen embedding of [tok, MASK x bs-1] per block)
      per layer:  x -> input_layernorm -> q from the block only;
                  K/V = [k_proj/v_proj(ctx) ; k_proj/v_proj(block)]  (ctx gets no layer norm)
                  q_norm/k_norm per head, RoPE at absolute positions, GQA, no causal mask
                  -> o_proj + residual -> post_attention_layernorm -> SwiGLU + residual
    -> norm -> hidden [B,Q,H]   (the caller applies the target's frozen lm_head)

Parameter names equal the published safetensors names (fc.weight, hidden_norm.weight,
norm.weight, layers.{i}.self_attn.q_proj.weight, ...), so export is a plain state_dict dump.
No embedding and no LM head live here.

Training (`forward`): blocks at anchors, mask by anchor position (models/attention.py).
Inference (`forward_infer`): context K/V cached per layer after k_norm + RoPE at their absolute
positions; block K/V are never kept, so the cache holds context only (dflash-method.md §3 step 2).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.config import DrafterConfig
from dflash_trainer.errors import UserError
from dflash_trainer.models import rope, variants
from dflash_trainer.models.attention import block_attention, resolve_impl
from dflash_trainer.models.target_layout import (
    SHAPE_FIELDS,
    first_source_layer,
    layer_type,
    rope_params,
    target_shapes,
)
from dflash_trainer.models.target_layout import rope_theta as target_rope_theta

log = logging.getLogger(__name__)


@dataclass
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    vocab_size: int
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None  # models/rope.py: None = plain RoPE
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    attention: str = "auto"  # auto | split | dense | flex (training attention)
    init_std: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept on export
    variant: str = "dflash"  # models/variants/
    options: dict[str, Any] = field(default_factory=dict)  # the variant's own (defaults filled)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.rope_scaling = rope.normalise_scaling(self.rope_scaling, "rope_scaling")
        self.options = self.spec.complete_options(dict(self.options))
        self.spec.check(self)

    @property
    def spec(self) -> variants.DrafterVariant:
        return variants.get(self.variant)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_configs(cls, drafter_cfg: DrafterConfig, target) -> DFlashConfig:
        """Drafter section of the run config + a loaded target (TargetModel or a duck type with
        .hidden_size .num_layers .layer_ids .vocab_size .model.config [.tokenizer]).
        Shape fields at 0 take the target's (what init=target needs); the RoPE base, at 0, is
        the target's for the layers the drafter starts from (drafter_rope_theta)."""
        tcfg = target.model.config
        pick = {k: getattr(drafter_cfg, k) for k in SHAPE_FIELDS}
        if not all(pick.values()):  # read the target's only where asked to
            shapes = target_shapes(tcfg)
            pick = {k: v or shapes[k] for k, v in pick.items()}
        try:
            return cls._from_configs(drafter_cfg, target, tcfg, pick)
        except ValueError as e:
            raise UserError(f"drafter settings: {e}; change the drafter.* key it names.") from None

    @classmethod
    def _from_configs(cls, drafter_cfg: DrafterConfig, target, tcfg, pick) -> DFlashConfig:
        variant = getattr(drafter_cfg, "variant", "dflash")
        return cls(
            hidden_size=int(target.hidden_size),
            num_layers=drafter_cfg.num_layers,
            **pick,
            block_size=drafter_cfg.block_size,
            target_layer_ids=list(target.layer_ids),
            num_target_layers=int(target.num_layers),
            mask_token_id=resolve_mask_token_id(drafter_cfg.mask_token_id, target),
            vocab_size=int(target.vocab_size),
            **drafter_rope(drafter_cfg, target),
            rms_norm_eps=drafter_cfg.rms_norm_eps,
            max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", None) or 40960),
            attention=drafter_cfg.attention,
            init_std=drafter_cfg.init_std,
            variant=variant,
            options=variants.get(variant).options_from(drafter_cfg),
        )


def drafter_rope(drafter_cfg: DrafterConfig, target) -> dict[str, Any]:
    """The drafter's RoPE (DFlashConfig's rope_theta and rope_scaling). The base:
    drafter.rope_theta, or at 0 the target's base for the layers the drafter stands for: with
    init=target the type of the first copied layer (Gemma 3: a sliding layer's local base, a
    full layer's global one), else the target's global (full-attention) base. The form:
    drafter.rope = plain (no scaling), or target (the same layers' scaling: YaRN, Llama 3's).
    Logged with where they came from, also when the target's config names no base."""
    tcfg = target.model.config
    ltype, why = None, ""
    if getattr(drafter_cfg, "init", "random") == "target":
        try:
            src = first_source_layer(
                drafter_cfg.num_layers,
                int(target.num_layers),
                list(target.layer_ids),
                drafter_cfg.init_tap,
            )
        except ValueError:
            src = None  # init_from_target reports it
        if src is not None:
            ltype = layer_type(tcfg, src)
            why = f", the type of copied layer {src}" if ltype else ""
    theta, where = target_rope_theta(tcfg, ltype)
    if drafter_cfg.rope_theta:
        theta, where, why = float(drafter_cfg.rope_theta), "drafter.rope_theta", ""
    scaling = None
    if getattr(drafter_cfg, "rope", "plain") == "target":
        params, at = rope_params(tcfg, ltype)
        scaling = rope.normalise_scaling(params, f"the target's {at}")
    form = f"{scaling['rope_type']} scaling as the target's" if scaling else "plain"
    log.info("drafter RoPE base %g (%s%s), %s", theta, where, why, form)
    return {"rope_theta": theta, "rope_scaling": scaling}


def resolve_mask_token_id(configured: int, target) -> int:
    """-1 = auto: the first padded embedding row (len(tokenizer) < vocab_size), else the
    tokenizer's first reserved special token (Llama 3's <|reserved_special_token_0|>: what
    published drafters use), else 0. run/build.py refuses an id the training text holds."""
    vocab = int(target.vocab_size)
    if configured >= 0:
        if configured >= vocab:
            raise UserError(
                f"drafter.mask_token_id={configured} is outside the target's "
                f"embedding table (vocab_size {vocab}); use -1 for auto."
            )
        return int(configured)
    tok = getattr(target, "tokenizer", None)
    n = len(tok) if tok is not None else vocab
    if n < vocab:
        return n
    added = getattr(tok, "get_added_vocab", None)
    reserved = sorted(i for t, i in (added() if added else {}).items() if "reserved" in t)
    return reserved[0] if reserved and reserved[0] < vocab else 0


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def leading_slots(x: torch.Tensor, block_size: int, slots: int) -> torch.Tensor:
    """[B, N*block_size, ...] -> [B, N*slots, ...]: the first `slots` slots of every block."""
    B, Q = x.shape[:2]
    n = Q // block_size
    return x.reshape(B, n, block_size, *x.shape[2:])[:, :, :slots].reshape(
        B, n * slots, *x.shape[2:]
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, L, d]; cos/sin [B, L, d] (broadcast over heads)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.num_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_q(self, x, cos, sin):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def project_kv(self, x, cos, sin):
        """K after k_norm + RoPE, V plain: both [B, hkv, L, d]."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def merge(self, o):
        B, h, L, d = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, L, h * d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_size = cfg.block_size
        # the variant's wraps around the attention / MLP sublayer (none for DFlash)
        self._wrap_names: dict[str, str] = {}
        for sublayer, (name, module) in cfg.spec.layer_parts(cfg).items():
            self.add_module(name, module)
            self._wrap_names[sublayer] = name

    @property
    def whole_blocks(self) -> bool:
        """The variant's wraps see whole blocks: every slot must come out (no query_slots)."""
        return bool(self._wrap_names)

    def _wrap(self, sublayer: str) -> variants.base.SublayerWrap | None:
        name = self._wrap_names.get(sublayer)
        return None if name is None else cast("variants.base.SublayerWrap", getattr(self, name))

    def forward(self, x, rope, attend, query_slots: int = 0):
        """x [B,Q,H] block stream (blocks of block_size consecutive rows); rope = (cos, sin) at
        the block positions; attend(q, k_blk, v_blk) -> [B,h,Q',d] supplies the context K/V and
        the mask. The context is never convolved: it has no residual stream here.

        `query_slots` > 0 (a last layer whose later slots nobody reads; not with the variant's
        wraps, which see whole blocks): only the first query_slots slots of every block come
        out, [B, N*query_slots, H], and only they pay for the query, the attention output and
        the MLP; every slot's keys and values are still computed, since a block attends to all
        of its slots. Those outputs equal the full layer's (tests/test_drafter.py)."""
        a = self.self_attn
        h = self.input_layernorm(x)
        wrap = self._wrap("attention")
        if wrap is not None:
            h, state = wrap.prepare(h)
        k_blk, v_blk = a.project_kv(h, *rope)
        if query_slots:
            if self.whole_blocks:
                raise ValueError("query_slots: the variant's wraps need every slot of a block")
            x, h = (
                leading_slots(x, self.block_size, query_slots),
                leading_slots(h, self.block_size, query_slots),
            )
            rope = tuple(leading_slots(r, self.block_size, query_slots) for r in rope)
        q = a.project_q(h, *rope)
        o = a.merge(attend(q, k_blk, v_blk))
        if wrap is not None:
            o = wrap.finish(o, state)
        x = x + o
        h = self.post_attention_layernorm(x)
        wrap = self._wrap("mlp")
        if wrap is None:
            return x + self.mlp(h)
        h, state = wrap.prepare(h)
        return x + wrap.finish(self.mlp(h), state)


# ------------------------------------------------------------------------------------------------
# Inference cache
# ------------------------------------------------------------------------------------------------


class DrafterCache:
    """Per-layer context K (after k_norm + RoPE) and V, [B, hkv, length, d]. Context only.

    Backed by buffers that grow by doubling, so appending a few positions per decoding cycle
    copies only the new positions (amortised), not the whole cache as `torch.cat` would.
    """

    def __init__(self, num_layers: int):
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._len = [0] * num_layers

    @property
    def length(self) -> int:
        return self._len[0]

    @property
    def keys(self) -> list[torch.Tensor | None]:
        return [None if k is None else k[:, :, :n] for k, n in zip(self._k, self._len)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return [None if v is None else v[:, :, :n] for v, n in zip(self._v, self._len)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        cur, add = self._len[layer], k.shape[2]
        bk, bv = self._k[layer], self._v[layer]
        if bk is None or bv is None or cur + add > bk.shape[2]:
            cap = max(256, 2 * (bk.shape[2] if bk is not None else 0), cur + add)
            nk = k.new_empty(*k.shape[:2], cap, k.shape[3])
            nv = v.new_empty(*v.shape[:2], cap, v.shape[3])
            if cur and bk is not None and bv is not None:
                nk[:, :, :cur] = bk[:, :, :cur]
                nv[:, :, :cur] = bv[:, :, :cur]
            self._k[layer], self._v[layer] = bk, bv = nk, nv
        bk[:, :, cur : cur + add] = k
        bv[:, :, cur : cur + add] = v
        self._len[layer] = cur + add
        return bk[:, :, : cur + add], bv[:, :, : cur + add]

    def crop(self, n: int) -> None:
        """Keep the first n context entries (e.g. after a rejected draft)."""
        self._len = [min(m, n) for m in self._len]


# ------------------------------------------------------------------------------------------------
# The drafter
# ------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, float]] = {}
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        for name, module in cfg.spec.drafter_parts(cfg).items():
            self.add_module(name, module)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Linear weights ~ N(0, init_std); every norm weight = 1 (dflash-method.md §2.5).
        The variant's parts start where they change nothing (models/variants/base.py)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.config.init_std, generator=generator)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        self.config.spec.reset_parts(self, generator)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[B, S, n*H] target taps -> [B, S, H] context (hidden_norm(fc(.)))."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin [*positions.shape, head_dim] of the config's RoPE (models/rope.py). The
        frequencies are computed once per device, in fp32, outside the parameters (a cast of the
        drafter to bf16 leaves them exact)."""
        tables = self._rope_tables.get(positions.device)
        if tables is None:
            c = self.config
            inv, scale = rope.frequencies(
                c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
            )
            tables = self._rope_tables[positions.device] = (inv.to(positions.device), scale)
        return rope.cos_sin(positions, *tables, dtype)

    # -------------------------------------------------------------------------------- training
    def forward(
        self,
        block_embeds: torch.Tensor,
        features: torch.Tensor,
        anchors: torch.Tensor,
        block_valid: torch.Tensor,
        attention: str | None = None,
        out_slots: int = 0,
    ) -> torch.Tensor:
        """block_embeds [B,N*bs,H], features [B,S,n*H], anchors [B,N] long, block_valid [B,N] bool
        -> final-normed hidden [B,N*q,H]. Block j slot k sits at position anchors[:,j]+k and sees
        context positions < anchors[:,j] and its own block (models/attention.py).

        q = last_layer_slots(out_slots, attention, device): the caller reads q from the shape."""
        c = self.config
        B, Q, _ = block_embeds.shape
        S, bs = features.shape[1], c.block_size
        impl = attention or c.attention
        layers = self.decoder_layers
        last_slots = self.last_layer_slots(out_slots, impl, block_embeds.device)
        ctx = self.fuse(features)
        x = (
            block_embeds
            if torch.is_autocast_enabled(block_embeds.device.type)
            else block_embeds.to(ctx.dtype)
        )
        dt = x.dtype
        slot = torch.arange(bs, device=x.device)
        blk_pos = (anchors[:, :, None] + slot).reshape(B, Q)
        ctx_pos = torch.arange(S, device=x.device).expand(B, S)
        rope_q = self.rope_cos_sin(blk_pos, dt)
        rope_c = self.rope_cos_sin(ctx_pos, dt)
        masks: dict = {}  # one mask / BlockMask for all layers of this forward
        for i, layer in enumerate(layers):
            a = layer.self_attn
            k_ctx, v_ctx = a.project_kv(ctx, *rope_c)

            def attend(q, k_blk, v_blk, k_ctx=k_ctx, v_ctx=v_ctx):
                k = torch.cat([k_ctx.to(k_blk.dtype), k_blk], dim=2)
                v = torch.cat([v_ctx.to(v_blk.dtype), v_blk], dim=2)
                return block_attention(q, k, v, anchors, block_valid, bs, impl, mask_cache=masks)

            last = i == len(layers) - 1
            x = layer(x, rope_q, attend, last_slots if last and last_slots < bs else 0)
        return self.norm(x)

    def last_layer_slots(
        self, out_slots: int, attention: str | None, device: torch.device | str
    ) -> int:
        """Slots per block the last layer computes (queries, attention output, MLP) when the
        caller reads only the first `out_slots` (0 = all): out_slots where that saves work,
        else block_size (the variant's wraps and flex attention need whole blocks). What
        `forward` does and the FLOP model counts."""
        bs = self.config.block_size
        if not 0 < out_slots < bs or self.decoder_layers[-1].whole_blocks:
            return bs
        flex = resolve_impl(attention or self.config.attention, device) == "flex"
        return bs if flex else out_slots

    # -------------------------------------------------------------------------------- inference
    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed (an nn.ModuleList yields plain Modules)."""
        return cast("list[DecoderLayer]", list(self.layers))

    def new_cache(self) -> DrafterCache:
        return DrafterCache(self.config.num_layers)

    def forward_infer(
        self,
        block_embeds: torch.Tensor,
        new_features: torch.Tensor | None,
        cache: DrafterCache,
        start: int,
    ) -> torch.Tensor:
        """Append context K/V of new_features [B,C,n*H] (positions cache.length..) to the cache,
        then run the block [B,Q,H] at positions start..start+Q-1 against all cached context and
        all block tokens (no mask). Block K/V are not kept. Returns final-normed [B,Q,H]."""
        B, Q, _ = block_embeds.shape
        dev = block_embeds.device
        x = (
            block_embeds
            if torch.is_autocast_enabled(dev.type)
            else block_embeds.to(self.fc.weight.dtype)
        )
        dt = x.dtype
        rope_q = self.rope_cos_sin(torch.arange(start, start + Q, device=dev).expand(B, Q), dt)
        ctx = rope_c = None
        if new_features is not None and new_features.shape[1] > 0:
            C = new_features.shape[1]
            ctx = self.fuse(new_features)
            p0 = cache.length
            rope_c = self.rope_cos_sin(torch.arange(p0, p0 + C, device=dev).expand(B, C), ctx.dtype)
        for i, layer in enumerate(self.decoder_layers):
            a = layer.self_attn
            if ctx is not None and rope_c is not None:
                k_ctx, v_ctx = cache.append(i, *a.project_kv(ctx, *rope_c))
            else:
                k_ctx, v_ctx = cache.keys[i], cache.values[i]

            def attend(q, k_blk, v_blk, k_ctx=k_ctx, v_ctx=v_ctx):
                if k_ctx is not None:
                    k_blk = torch.cat([k_ctx.to(k_blk.dtype), k_blk], dim=2)
                    v_blk = torch.cat([v_ctx.to(v_blk.dtype), v_blk], dim=2)
                return F.scaled_dot_product_attention(
                    q, k_blk, v_blk, enable_gqa=q.shape[1] != k_blk.shape[1]
                )

            x = layer(x, rope_q, attend)
        return self.norm(x)

    def propose(
        self,
        hidden: torch.Tensor,
        lm_head,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The block's draft tokens [B, L] from its final-normed hidden states [B, L, H] at
        slots 1..L (forward_infer's output, slot 0 dropped; decoding passes the slots it
        verifies), the target's frozen LM head (a module or callable: hidden -> logits
        [B, L, V]) and the anchor [B] (slot 0's token, the bonus token the target committed).

        How the tokens are picked from the logits is the variant's (DFlash: each slot's argmax;
        models/variants/). temperature > 0: Gumbel-max samples instead of argmax."""
        # 2-D rows: a 3-D input would make the head's matmul a batched one over an expanded copy
        # of the [V, H] weight (measured on CPU: 26 ms for 4 rows against 10 ms as 2-D)
        logits = lm_head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
        return self.config.spec.propose(self, hidden, logits, anchor_ids, temperature, generator)

    def config_dict(self) -> dict:
        return dataclasses.asdict(self.config)


def convert_variant(
    drafter: DFlashDrafter, variant: str, options: dict[str, Any], block_size: int = 0
) -> DFlashDrafter:
    """A drafter of `variant` that starts from `drafter` (of a variant it lists in
    warm_starts_from, e.g. a loaded export): every tensor copied, the new variant's parts at
    their neutral start, so it drafts exactly what `drafter` drafts until it trains.
    `block_size` 0 keeps the drafter's."""
    spec = variants.get(variant)
    if drafter.config.variant not in spec.warm_starts_from:
        raise ValueError(
            f"a {variant} drafter cannot start from a {drafter.config.variant} one (it starts "
            f"from {list(spec.warm_starts_from) or 'no other variant'})"
        )
    over: dict[str, Any] = {"variant": variant, "options": options}
    if block_size:
        over["block_size"] = block_size
    ref = next(drafter.parameters())
    new = DFlashDrafter(dataclasses.replace(drafter.config, **over))
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    own = set(spec.tensor_names(new.config.num_layers))
    if unexpected or not set(missing) <= own:
        stray = sorted(set(missing) - own)[:5]
        raise ValueError(
            f"converting a {drafter.config.variant} drafter into {variant}: unexpected tensors "
            f"{unexpected[:5]}, missing ones the variant does not add {stray}"
        )
    return new.to(device=ref.device, dtype=ref.dtype)
