"""The frozen target LLM: which layers to tap, and a forward that returns only those layers.

DFlash conditions the drafter on the *outputs* of a few target decoder layers
(dflash-method.md §1.2, §2.1).
`output_hidden_states=True` would keep all L+1 hidden states and compute the vocab-sized logits that
training never uses (for SmolLM2 at 8x512 that is ~1.1 GB of fp32 activations). Instead, forward
hooks on the tapped layers copy out just those outputs, and the hook on the last tapped layer raises
a private exception that ends the forward: later layers, the final norm and the LM head never run.

Hooks are installed once per model and read a thread-local capture slot, so two threads may share
one `TargetModel`, and a plain `model(...)`/`model.generate(...)` call (no capture active) is not
affected. The same hooks serve training (`features`: stops after the last tap) and decoding
(`forward`: through the LM head, with a KV cache); `cast` gives the copy evaluation decodes in.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import UserError
from dflash_trainer.models import embedded, kv_cache
from dflash_trainer.models.lean_forward import LeanForward, lean_forward
from dflash_trainer.models.packed_linear import packed_linears
from dflash_trainer.models.target_layout import has_windowed_layers
from dflash_trainer.precision import resolve_dtype

log = logging.getLogger(__name__)


def tap_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """The DFlash rule: `num_taps` 0-based layer ids spread from layer 1 to layer L-3.

    n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)) with Python's (banker's) round,
    as the reference does. 30 layers, 5 taps -> [1, 8, 14, 20, 27]; 36 -> [1, 9, 17, 25, 33].
    """
    if num_layers < 1:
        raise UserError(f"the target has {num_layers} decoder layers; it needs at least one.")
    if num_taps < 1:
        raise UserError(f"target.num_taps must be >= 1, got {num_taps}.")
    if num_taps == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (num_taps - 1)) for i in range(num_taps)]
    if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= num_layers:
        # The rule needs L >= n + 3 to give n distinct layers inside 0..L-1.
        raise UserError(
            f"target.num_taps={num_taps} is too many for a target with {num_layers} layers: the "
            f"DFlash rule gives {ids}, which are not {num_taps} distinct layers in "
            f"0..{num_layers - 1}. Lower target.num_taps (at most {max(1, num_layers - 3)}) or "
            "list the layers in target.taps."
        )
    return ids


def validate_taps(taps: list[int], num_layers: int) -> list[int]:
    """Check an explicit `target.taps` list against the target's layer count."""
    if not taps:
        raise UserError(
            "target.taps is empty; list at least one 0-based layer id, or leave it "
            "empty in the config to use target.num_taps and the DFlash rule."
        )
    for t in taps:
        if not isinstance(t, int) or isinstance(t, bool):
            raise UserError(f"target.taps: {t!r} is not an integer layer id.")
        if not 0 <= t < num_layers:
            raise UserError(
                f"target.taps: layer {t} does not exist; the target has {num_layers} "
                f"layers (0..{num_layers - 1})."
            )
    if any(b <= a for a, b in zip(taps, taps[1:])):
        raise UserError(
            f"target.taps must be strictly increasing (no repeats), got {list(taps)}; "
            "the feature order follows the layer order."
        )
    return list(taps)


def resolve_layer_ids(target_cfg: TargetConfig, num_layers: int) -> list[int]:
    if target_cfg.taps:
        return validate_taps(list(target_cfg.taps), num_layers)
    return tap_layer_ids(num_layers, target_cfg.num_taps)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (Llama, Qwen2/3, Mistral, Gemma...:
    model.model.layers; else whatever `get_decoder().layers` names). Training and speculative
    decoding both tap these modules."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    hf: Any = model  # an HF PreTrainedModel; nn.Module's attribute typing does not know it
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise UserError(
        f"cannot find the decoder layers of {type(model).__name__}: expected "
        "`model.model.layers` (Llama/Qwen-style causal LM). This target "
        "architecture is not supported."
    )


def _backbone(model: nn.Module) -> nn.Module:
    """The module that runs embeddings + decoder layers without the LM head."""
    for name in ("model", "transformer", "gpt_neox"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module) and not isinstance(sub, nn.ModuleList):
            return sub
    return model


class _StopForward(Exception):
    """Raised by the last tap's hook to end the forward early; never escapes this module."""


class TargetModel:
    """A frozen HF causal LM plus the tapped-layer feature extractor (see module docstring)."""

    def __init__(self, model: nn.Module, tokenizer, layer_ids: list[int], name: str):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self._layers = decoder_layers(model)
        self.num_layers = len(self._layers)
        self.layer_ids = validate_taps(list(layer_ids), self.num_layers)
        hf: Any = model  # an HF PreTrainedModel; nn.Module's attribute typing does not know it
        text_cfg = (
            hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        )
        self.hidden_size = int(text_cfg.hidden_size)
        emb = hf.get_input_embeddings()
        self.embed_weight = emb.weight
        # The drafter embeds its blocks with the raw table (F.embedding(ids, embed_weight)) in
        # training, evaluation and every engine (no input_embedding_scale in the export); a
        # family whose embedding module scales (Gemma: sqrt(hidden)) feeds its own layers
        # scaled rows. Both sides agree; the scale is logged so the difference is known.
        self.embed_scale = float(getattr(emb, "embed_scale", 1.0))
        if self.embed_scale != 1.0:
            log.info(
                "target %s scales its embeddings by %g; the drafter embeds with the raw table "
                "(scale 1) in training, evaluation and export, as serving engines do",
                name,
                self.embed_scale,
            )
        self.vocab_size = int(self.embed_weight.shape[0])
        self.lm_head: nn.Module = hf.get_output_embeddings()
        self.eos_token_ids = _eos_ids(model, tokenizer)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # the dtype its weights were loaded in (a cast copy keeps its source's): weights loaded in
        # bf16 and cast to fp32 are not the checkpoint's fp32 weights that a server loads
        self.loaded_dtype = p.dtype
        # target.attn_implementation as transformers resolved it
        self.attn_implementation = getattr(model.config, "_attn_implementation", None) or "eager"
        self._backbone = _backbone(model)
        self._windowed = has_windowed_layers(hf.config)  # takes_4d_mask
        self._cache_kw = kv_cache.cache_kwarg(model)
        self._state = threading.local()
        self._lean: LeanForward | None = None  # inside `decoding`, where the target fits it
        self._hooks = [
            self._layers[lid].register_forward_hook(self._make_hook(k))
            for k, lid in enumerate(self.layer_ids)
        ]

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (a drafter can start from copies of the last ones)."""
        return self._layers

    @property
    def takes_4d_mask(self) -> bool:
        """Whether the target's forward takes a prepared additive [B, 1, S, S] causal mask: its
        attention kernel reads one (eager, SDPA; flash and flex kernels are causal by themselves
        and break on a tensor mask) and every layer attends to its whole causal past. A target
        with sliding-window (or other windowed) layers builds its own mask per layer type:
        transformers uses a prepared mask as is in every layer, so the taps training reads would
        see past each window, which neither the decode loop nor any engine does (a tiny gpt-oss
        past its window of 8: taps off by O(10); a drafter memorised on its answers drafted at
        tau 1.7 of 7.75, in our loop and in vLLM alike; tests/test_vllm_families.py)."""
        return self.attn_implementation in ("eager", "sdpa") and not self._windowed

    @property
    def final_norm(self) -> nn.Module | None:
        """The norm before the LM head, where the backbone has one (`norm`, `ln_f`)."""
        for name in ("norm", "ln_f", "final_layernorm"):
            m = getattr(self._backbone, name, None)
            if isinstance(m, nn.Module):
                return m
        return None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(
        cls, model: nn.Module, tokenizer, layer_ids: list[int], name: str = ""
    ) -> TargetModel:
        """Wrap an already-built HF model (tests, or callers that load it themselves)."""
        return cls(model, tokenizer, layer_ids, name or type(model).__name__)

    @classmethod
    def load(
        cls,
        target_cfg: TargetConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> TargetModel:
        """Load `target_cfg.model` (local dir, hub name at `target.revision`, or
        'embedded:smollm2') with `target.attn_implementation`, frozen, in eval mode, in `dtype`
        (None: target.dtype resolved for `device`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        name = target_cfg.model
        common = _common_load_kwargs(target_cfg)  # checked before converting an embedded model
        path = embedded.target_location(name, target_cfg.cache_dir)
        dtype = dtype or resolve_dtype(target_cfg.dtype, device)
        trc = bool(target_cfg.trust_remote_code)
        if trc:
            log.warning("target.trust_remote_code is on: %s may run its own Python code.", name)
        attn = _attn_kwargs(target_cfg)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **common)
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **common, **attn)
        except ImportError as e:  # a flash-attention kernel (or a remote code dependency)
            fix = (
                f"install the package that target.attn_implementation={attn['attn_implementation']}"
                " needs, or choose sdpa (or auto)"
                if attn
                else "install the missing package"
            )
            raise UserError(
                f"target.model: cannot load '{name}': {_first_line(e)} ({fix})."
            ) from None
        except (OSError, ValueError) as e:
            at = f" at target.revision '{common['revision']}'" if "revision" in common else ""
            hint = (
                "it is not a local directory, so it must be a Hugging Face hub name that is "
                f"reachable or already in the HF cache{at}"
                if not Path(path).is_dir()
                else "the directory does not hold a loadable HF causal LM"
            )
            raise UserError(
                f"target.model: cannot load '{name}': {hint}. Cause: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from None
        model.to(device)
        layers = decoder_layers(model)
        layer_ids = resolve_layer_ids(target_cfg, len(layers))
        return cls(model, tokenizer, layer_ids, name)

    # ------------------------------------------------------------------ hooks

    def _make_hook(self, k: int):
        is_last = k == len(self.layer_ids) - 1

        def hook(module, args, output):
            slots = getattr(self._state, "slots", None)
            if slots is None:  # no capture active: a plain model call
                return None
            # Decoder layers return a tensor in transformers 5, a tuple in 4.x.
            slots[k] = output[0] if isinstance(output, tuple) else output
            if is_last and self._state.stop:
                raise _StopForward
            return None

        return hook

    def _begin(self, stop: bool) -> None:
        if getattr(self._state, "slots", None) is not None:
            raise RuntimeError("TargetModel capture is not re-entrant")
        self._state.slots = [None] * len(self.layer_ids)
        self._state.stop = stop

    def _end(self) -> torch.Tensor | None:
        slots, self._state.slots = self._state.slots, None
        if any(s is None for s in slots):
            return None
        return torch.cat(slots, dim=-1)

    # ------------------------------------------------------------------ forwards

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        final: bool = False,
    ):
        """[B,S] token ids -> [B,S,n*H] tapped layer outputs concatenated in `layer_ids` order;
        with `final`, also [B,S,H] the final normed hidden states (what the LM head reads: logit
        distillation needs them at the drafted positions).

        Runs under no_grad (not inference_mode: the drafter saves these tensors for its backward,
        which inference tensors forbid). Without `final` it stops after the last tapped layer.
        """
        self._begin(stop=not final)
        out = None
        try:
            with torch.no_grad():
                out = self._backbone(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False
                )
        except _StopForward:
            pass
        finally:
            feats = self._end()
        if feats is None:
            raise RuntimeError("a tapped layer did not run; the model skipped a decoder layer")
        if not final:
            return feats
        assert out is not None  # final: the forward ran to its end
        return feats, out.last_hidden_state

    def check_taps(
        self, features_fn=None, seq_len: int = 32, seed: int = 0, attention_mask=None
    ) -> float:
        """Startup integrity check of the captured features (not a hot path: it reads values).

        Runs one short random sequence through the capture path (`features_fn(ids)`, by default
        `self.features`) and through a plain HF forward with `output_hidden_states=True`, and
        requires tap k to equal hidden_states[layer_ids[k] + 1] and every value to be finite.
        This catches hooks on the wrong modules (an architecture whose decoder layers are not
        where `decoder_layers` finds them), a layer that returns something other than its
        hidden states, and a target that overflows in its dtype: each of these would otherwise
        train a drafter on silently wrong features. Returns the largest relative error.

        The last decoder layer is not compared: HF applies the final norm to that entry.

        `attention_mask`: the mask the capture path passes (a prepared 4-D one). The reference
        forward gets the same, so both run the same attention kernel: in bf16 a masked and an
        unmasked kernel round differently, and through 36 layers of a random-initialised
        Qwen3-8B that alone reached 4.6e-2 on an H200, a false alarm.
        """
        vocab = self.vocab_size
        try:  # padded embedding rows are not real tokens
            vocab = min(vocab, len(self.tokenizer))
        except TypeError:
            pass
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (1, seq_len), generator=g).to(self.device)
        feats = (features_fn or self.features)(ids)
        H = self.hidden_size
        with torch.no_grad():
            kw = (
                {"logits_to_keep": 1}
                if "logits_to_keep" in inspect.signature(self.model.forward).parameters
                else {}
            )
            hs = self.model(
                input_ids=ids,
                attention_mask=attention_mask,
                output_hidden_states=True,
                use_cache=False,
                **kw,
            ).hidden_states
        # bf16/fp16 features may still come from another kernel (a features_fn that masks
        # differently): allow a rounding-sized difference, relative to the layer's largest value.
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        worst = 0.0
        for k, lid in enumerate(self.layer_ids):
            got = feats[..., k * H : (k + 1) * H].float().to(self.device)
            if not torch.isfinite(got).all():
                raise UserError(
                    f"target {self.name}: tapped layer {lid} produced non-finite hidden states "
                    f"in {str(self.dtype).replace('torch.', '')}. Load the target in another "
                    "dtype (target.dtype=bfloat16 or float32)."
                )
            if lid == self.num_layers - 1:
                continue
            want = hs[lid + 1].float()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            worst = max(worst, err)
            if err > tol:
                raise UserError(
                    f"target {self.name}: the features captured at layer {lid} differ from "
                    f"output_hidden_states[{lid + 1}] (relative error {err:.2e} > {tol:.0e}). "
                    f"dflash-trainer hooks {type(self._layers[lid]).__name__} modules of "
                    f"{type(self.model).__name__}; this architecture does not fit that. Report "
                    "it with the model name; target.taps cannot fix it."
                )
        return worst

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        *,
        taps: bool,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoding forward through the LM head: ids [B, Q] at `positions` [B, Q], extending
        the KV `cache` (models/kv_cache.py) -> (logits [B, Q or logits_to_keep, V], the tapped
        features [B, Q, n*H] when `taps`, else None). The features come from the same hooks as
        `features` (one tap mechanism); `attention_mask` [B, cached + Q] for left-padded rows.
        Inside `decoding`, a Llama-shaped float32 CPU target runs models/lean_forward.py."""
        lean = self._lean
        if lean is not None and kv_cache.all_growing(cache):
            with torch.no_grad():
                return lean(
                    ids,
                    positions,
                    cache,
                    taps=taps,
                    attention_mask=attention_mask,
                    logits_to_keep=logits_to_keep,
                )
        if taps:
            self._begin(stop=False)
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=ids,
                    attention_mask=attention_mask,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **{self._cache_kw: cache},
                )
        finally:
            feats = self._end() if taps else None
        if taps and feats is None:
            raise RuntimeError("a tapped layer did not run; the model skipped a decoder layer")
        return out.logits, feats

    @contextmanager
    def decoding(self, *others: nn.Module | None, packed: bool = True) -> Iterator[None]:
        """Inside: decoding on CPU in float32 runs on the kernels made for it
        (target.packed_linear): a Llama-shaped target's `forward` as one lean pass over stacked,
        prepacked weights (models/lean_forward.py), any other's linear layers on oneDNN's
        prepacked GEMM (models/packed_linear.py), and so the LM head and the linear layers of
        `others` (a drafter). `packed=False`: nothing changes. Restored on exit."""
        lean = lean_forward(self.model, self.layer_ids) if packed else None
        mine = (self.lm_head,) if lean is not None else (self.model, self.lm_head)
        with packed_linears(*mine, *others, enabled=packed):
            outer, self._lean = self._lean, lean or self._lean
            try:
                yield
            finally:
                self._lean = outer

    def cast(self, dtype: torch.dtype) -> TargetModel:
        """This target computing in `dtype` (evaluation's eval.dtype): itself when it already
        does, else a TargetModel on a cast copy of the model (the training target is never
        changed in place). Tokenizer, taps, name and stop ids are shared."""
        if self.dtype == dtype:
            return self
        model = _copy_without_hooks(self.model)
        out = TargetModel(model.to(dtype), self.tokenizer, self.layer_ids, self.name)
        out.eos_token_ids = list(self.eos_token_ids)
        out.loaded_dtype = self.loaded_dtype
        return out

    def close(self) -> None:
        """Remove the hooks (the HF model is then back to its original behaviour)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _copy_without_hooks(model: nn.Module) -> nn.Module:
    """A deep copy of `model` that keeps only transformers' own forward and backward hooks: the
    copy computes the model as transformers defines it. Dropped: whatever else is attached, such
    as this target's taps (the copy's TargetModel installs its own) and the pipeline's
    core-borrowing pre-hook (a bound method of the target worker, which holds locks a deepcopy
    cannot copy). Kept: transformers' output-capturing hooks, installed once per model (a flag
    on the model, copied with it, says so): the copy's `output_hidden_states` needs them. The
    original is only read, never changed: the target worker may be running it in another
    thread."""

    def foreign(hook: object) -> bool:
        return not str(getattr(hook, "__module__", "")).startswith("transformers.")

    memo: dict[int, object] = {}
    for m in model.modules():
        for name, hooks in vars(m).items():
            if not (name.startswith(("_forward", "_backward")) and name.endswith("hooks")):
                continue  # (the *_with_kwargs / *_always_called dicts hold flags, not hooks)
            if isinstance(hooks, dict) and any(foreign(h) for h in hooks.values()):
                kept = ((k, copy.deepcopy(h, memo)) for k, h in hooks.items() if not foreign(h))
                memo[id(hooks)] = type(hooks)(kept)  # deepcopy takes a memo entry as the copy
    return copy.deepcopy(model, memo)


def _common_load_kwargs(target_cfg: TargetConfig) -> dict:
    """from_pretrained kwargs shared by the tokenizer and the model: remote code, revision."""
    kwargs: dict[str, Any] = {"trust_remote_code": bool(target_cfg.trust_remote_code)}
    revision = target_cfg.revision
    if revision:
        model = target_cfg.model
        if model.startswith(embedded.EMBEDDED_PREFIX) or Path(model).expanduser().is_dir():
            # from_pretrained would ignore it, and training.json would record a revision that
            # was never used
            raise UserError(
                f"target.revision='{revision}' applies to Hugging Face hub names; "
                f"'{model}' is a local model. Unset target.revision."
            )
        kwargs["revision"] = revision
    return kwargs


def _attn_kwargs(target_cfg: TargetConfig) -> dict:
    """The model's attn_implementation kwarg; none for 'auto' (transformers picks)."""
    impl = target_cfg.attn_implementation
    return {} if impl == "auto" else {"attn_implementation": impl}


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _eos_ids(model: nn.Module, tokenizer) -> list[int]:
    """Stop tokens: the generation config's eos (int or list), else the tokenizer's eos."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return [int(i) for i in dict.fromkeys(ids)]
