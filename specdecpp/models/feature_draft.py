"""A draft that reads the target's own hidden states (EAGLE-3), stored in the ``speculators`` format
that vLLM loads (``config.json`` + ``model.safetensors``; facts in docs/feature_draft.md).

The target's residual stream at ``aux_layers`` (HF ``hidden_states[i]``: the input of layer i,
before any norm), concatenated to 3H, is the *feature* g_t of position t. The draft:

    u_t = fc(input_norm(g_t))                                  [H]  (or its own previous output)
    x   = [input_layernorm(Emb(x_{t+1})); hidden_norm(u_t)]    [2H] -> q/k/v of layer 0
    h_t = u_t' + o_proj(attn(x)) ;  h_t += mlp(post_attention_layernorm(h_t))
    hidden_out_t = norm(h_t) (``norm_output``, else h_t) ;  logits_t = lm_head(norm(h_t)) over V_d ids

(u_t' is hidden_norm(u_t) with ``norm_before_residual``, else u_t.) The draft's logits over its V_d
kept ids are scattered into a V-wide row of -inf, so q = softmax is exactly 0 off its vocabulary.

**Shift convention.** Draft position t reads the target feature g_t (the target having read
x_0..x_t) and the token x_{t+1}; its logits there are q(x_{t+2} | x_0..x_{t+1}). After the target
has read x_0..x_{n-1} (features g_0..g_{n-1}) and x_n is committed, the draft is fed
``input_ids = x_1..x_n``, ``features = g_0..g_{n-1}`` at positions 0..n-1 and its last logits propose
d_1 = x_{n+1}; the next step feeds ``hidden = hidden_out[:, -1:]`` with ``input_ids = d_1`` at
position n, and so on. The draft's cache then holds one entry per position, as the target's does:
after the target verifies [x_n, d_1..d_K] (features g_n..g_{n+K}) and keeps d_1..d_j plus its own
token b, ``cache.rollback(n)`` drops the entries made from the draft's own outputs and the draft is
fed ``features = g_n..g_{n+j}``, ``input_ids = d_1..d_j, b`` (positions n..n+j); both caches then
hold n+j+1 positions. RoPE is relative: any constant offset of the positions gives the same
outputs (speculators' trainer counts from 1, vLLM from 0; this module from 0).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .identity import portable_name

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the release whose format this module writes (docs/feature_draft.md)
# the layer config's keys this module reads and writes (speculators' transformer_layer_config)
LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "rope_parameters", "attention_bias", "mlp_bias")
FLAGS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}  # speculators' names


class FeatureDraftOutput(NamedTuple):
    logits: torch.Tensor  # [B, n_logits, V] over the target's whole vocabulary, -inf off the draft's
    hidden: torch.Tensor  # [B, T, H]: what the next step takes as ``hidden=`` (and what a head reads)


class UnrolledStep(NamedTuple):
    normed: torch.Tensor  # [B, L-1, H]: the final norm's output (``lm_head`` of it: logits over the draft's ids)
    hidden: torch.Tensor  # [B, L-1, H]: what the next step reads (FeatureDraftOutput.hidden)
    # [B, L-1, H] or None: the state after reading this step's probe token instead of the next true one
    # (what the paper's head reads for a candidate drafted here; FeatureDraft.unrolled's ``probes``)
    after: torch.Tensor | None = None


class FeatureDraftCache:
    """The draft's KV cache: one preallocated [B, kv_heads, capacity, head_dim] buffer per layer for
    keys and values; ``length`` positions are valid. Rolling back is setting ``length`` (the stale
    slots past it are overwritten by the next write); buffers grow by doubling."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (no-op if fewer are held)."""
        if length < 0:
            raise ValueError(f"rollback: length must be >= 0, got {length}")
        self.length = min(self.length, int(length))

    def compact(self, keep) -> None:
        """Keep only positions ``keep`` (increasing), moved to the front: a tree's accepted path."""
        keep = torch.as_tensor(keep, dtype=torch.long)
        if keep.numel() and (bool((keep.diff() <= 0).any()) or int(keep[0]) < 0 or int(keep[-1]) >= self.length):
            raise ValueError(f"compact: keep must be increasing positions < {self.length}, got {keep.tolist()}")
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                buffers[i][:, :, : keep.numel()] = buf.index_select(2, keep.to(buf.device))
        self.length = keep.numel()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [B, kv_heads, T, head_dim] at positions start..start+T-1 of ``layer``;
        return that layer's keys and values for positions 0..start+T-1. ``length`` is not moved
        (the forward sets it once every layer has written)."""
        end = start + k.shape[2]
        if layer == len(self.keys):
            shape = (k.shape[0], k.shape[1], max(16, end), k.shape[3])
            self.keys.append(k.new_empty(shape))
            self.values.append(v.new_empty(shape))
        if self.keys[layer].shape[0] != k.shape[0]:
            raise ValueError(f"the draft's cache holds batch {self.keys[layer].shape[0]}, got a batch of {k.shape[0]}")
        if end > self.keys[layer].shape[2]:
            grow = max(end, 2 * self.keys[layer].shape[2]) - self.keys[layer].shape[2]
            for buffers, new in ((self.keys, k), (self.values, v)):
                buffers[layer] = torch.cat([buffers[layer], new.new_empty((*new.shape[:2], grow, new.shape[3]))], 2)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def _rms_norm(size: int, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(size, eps=eps)


class FeatureAttention(torch.nn.Module):
    """Grouped-query attention over a :class:`FeatureDraftCache`, q/k/v projected from ``in_size``."""

    def __init__(self, layer: dict, in_size: int) -> None:
        super().__init__()
        heads, kv_heads, head_dim, bias = (layer["num_attention_heads"], layer["num_key_value_heads"],
                                           layer["head_dim"], layer["attention_bias"])
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(in_size, heads * head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(in_size, kv_heads * head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(in_size, kv_heads * head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(heads * head_dim, layer["hidden_size"], bias=bias)

    def project(self, x, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, d], k and v [B, kv_heads, T, d] of ``x`` [B, T, in], rotated."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return q, k, v

    def attend(self, q, k, v, mask) -> torch.Tensor:
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1).to(q.dtype), v.repeat_interleave(group, dim=1).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = q.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, rope, mask, cache: FeatureDraftCache | None, layer: int, start: int,
                earlier: tuple[list, list] | None = None) -> torch.Tensor:
        """``earlier``: the unrolled form's (keys, values) of the steps before this one: this step's
        k, v are appended and every entry attended under ``mask`` (:meth:`FeatureDraft.unrolled`)."""
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
        if earlier is not None:
            earlier[0].append(k)
            earlier[1].append(v)
            k, v = torch.cat(earlier[0], dim=2), torch.cat(earlier[1], dim=2)
        return self.attend(q, k, v, mask)


class FeatureDecoderLayer(torch.nn.Module):
    """One Llama decoder layer; the first (``first=True``) takes [Emb(x); u] of width 2H (EAGLE-3)."""

    def __init__(self, layer: dict, llama_config, first: bool, norm_before_residual: bool) -> None:
        from transformers.models.llama.modeling_llama import LlamaMLP

        super().__init__()
        hidden, eps = layer["hidden_size"], layer["rms_norm_eps"]
        self.first, self.norm_before_residual = first, norm_before_residual
        self.self_attn = FeatureAttention(layer, 2 * hidden if first else hidden)
        self.mlp = LlamaMLP(llama_config)
        self.input_layernorm = _rms_norm(hidden, eps)
        self.hidden_norm = _rms_norm(hidden, eps) if first else None
        self.post_attention_layernorm = _rms_norm(hidden, eps)

    def forward(self, h, embeds, rope, mask, cache, layer: int, start: int, earlier=None) -> torch.Tensor:
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, rope, mask, cache, layer, start, earlier)
        return h + self.mlp(self.post_attention_layernorm(h))


class FeatureDraft(torch.nn.Module):
    """An EAGLE-3 draft over a target's fused features (module docstring: the architecture and the
    shift convention). Build an untrained one with :meth:`init_from`, load a trained one with
    :meth:`from_pretrained` (or ``load_pair(draft=DIR, ...)``), write one with :meth:`save_pretrained`.

    The round core's calls::

        cache = draft.new_cache()
        feats = draft.fuse(target_out.hidden_states)      # [B, T, 3H] from output_hidden_states=True
        out = draft(input_ids, features=feats, cache=cache)           # after the target's forward
        out = draft(next_ids, hidden=out.hidden[:, -1:], cache=cache)  # each drafting step
        cache.rollback(n)                                            # after verification

    ``forward(input_ids [B, T], features=[B, T, F*H] | hidden=[B, T, H], position_ids=[B, T] | None,
    cache=None, attention_mask=None, n_logits=None) -> FeatureDraftOutput(logits [B, n, V], hidden
    [B, T, H])``: exactly one of ``features`` (the target's, for positions the target has read) and
    ``hidden`` (the draft's own ``hidden`` output, for drafted positions). Without ``position_ids``
    the T positions follow the cache (``cache.length + arange(T)``); with a cache they are written
    at ``cache.length`` and the length moves by T. ``attention_mask`` (bool [B, T, cached + T], True:
    may attend) replaces the causal mask (trees, padded rows). ``n_logits``: logits for the last n
    positions only (the lm_head is most of a step's cost); None: all T.
    """

    def __init__(self, config: dict) -> None:
        """``config``: the speculators config.json as a dict (:func:`speculators_config`, :func:`read_config`),
        kept as ``spec_config``; ``config`` is its layer's LlamaConfig (hidden_size, vocab_size,
        ``_name_or_path``), which code written for transformers models reads."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        layer = config["transformer_layer_config"]
        self.spec_config = config
        self.config = LlamaConfig(**_llama_kwargs(layer))
        hidden, vocab, draft_vocab = layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"]
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden, vocab, draft_vocab
        self.aux_layers = list(config["eagle_aux_hidden_state_layer_ids"])
        self.embed_tokens = torch.nn.Embedding(vocab, hidden).requires_grad_(False)
        n_aux = len(self.aux_layers)
        self.input_norm = _rms_norm(n_aux * hidden, layer["rms_norm_eps"]) if config["norm_before_fc"] else None
        self.fc = torch.nn.Linear(n_aux * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList(
            FeatureDecoderLayer(layer, self.config, i == 0, config["norm_before_residual"])
            for i in range(layer["num_hidden_layers"]))
        self.norm = _rms_norm(hidden, layer["rms_norm_eps"])
        self.lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False).requires_grad_(False)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool) if draft_vocab == vocab
                             else torch.zeros(vocab, dtype=torch.bool))
        self.register_buffer("token_ids", torch.arange(draft_vocab), persistent=False)

    @property
    def name_or_path(self) -> str | None:
        """The reference it was loaded from (``config._name_or_path``, as load_model records it); None if built."""
        return self.config._name_or_path or None

    @name_or_path.setter
    def name_or_path(self, ref: str | None) -> None:
        self.config._name_or_path = ref or ""

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` casts the weights but keeps the rotary frequencies in float32, as the
        target's and vLLM's rope are (a bfloat16 inv_freq puts long positions' angles off by radians)."""
        rope = dict(self.rotary_emb.named_buffers())
        super()._apply(fn, recurse)
        for name, buf in rope.items():
            setattr(self.rotary_emb, name, buf.to(getattr(self.rotary_emb, name).device))
        return self

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding (a frozen copy of the target's), as a transformers model names it."""
        return self.embed_tokens

    def new_cache(self) -> FeatureDraftCache:
        return FeatureDraftCache()

    def fuse(self, hidden_states) -> torch.Tensor:
        """The features [B, T, F*H] from a target forward's ``hidden_states`` (``output_hidden_states=True``)."""
        return torch.cat([hidden_states[i] for i in self.aux_layers], dim=-1)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """u = fc(input_norm(g)) [..., H] of the target's fused features g [..., F*H]: what an entry
        that reads the target's features feeds the layer (forward's ``features=``; per-row batches
        mix it with drafted entries' ``hidden``)."""
        features = features.to(self.dtype)
        return self.fc(self.input_norm(features) if self.input_norm is not None else features)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor, source: str = "the id mapping") -> None:
        """Install the id mapping (target id = i + d2t[i]; t2d[v]: v is kept), checked for consistency."""
        ids = check_vocab_map(d2t, t2d, self.vocab_size, self.draft_vocab_size, source)
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))
        self.token_ids = ids.to(self.d2t.device)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: FeatureDraftCache | None = None, attention_mask: torch.Tensor | None = None,
                n_logits: int | None = None) -> FeatureDraftOutput:
        if (features is None) == (hidden is None):
            raise ValueError("FeatureDraft.forward takes exactly one of features= (the target's) and hidden= "
                             "(the draft's own previous output)")
        b, t = input_ids.shape
        start = cache.length if cache is not None else 0
        if features is not None:
            want = len(self.aux_layers) * self.hidden_size
            if features.shape != (b, t, want):
                raise ValueError(f"features must be [B, T, {want}] = [{b}, {t}, {want}] ({len(self.aux_layers)} aux "
                                 f"layers x hidden {self.hidden_size}), got {tuple(features.shape)}")
            u = self.project(features)
        else:
            if hidden.shape != (b, t, self.hidden_size):
                raise ValueError(f"hidden must be [B, T, H] = [{b}, {t}, {self.hidden_size}], "
                                 f"got {tuple(hidden.shape)}")
            u = hidden.to(self.dtype)
        if position_ids is None:
            position_ids = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary_emb(embeds, position_ids)
        mask = self._mask(attention_mask, b, t, start, input_ids.device)
        h = u
        for i, layer in enumerate(self.layers):
            h = layer(h, embeds, rope, mask, cache, i, start)
        if cache is not None:
            cache.length = start + t
        normed = self.norm(h)
        kept = normed if n_logits is None else normed[:, t - n_logits:]
        fed_back = normed if self.spec_config["norm_output"] else h
        return FeatureDraftOutput(self.full_logits(self.lm_head(kept)), fed_back)

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                 probes: torch.Tensor | None = None) -> list[UnrolledStep]:
        """The draft unrolled ``steps`` steps over every anchor i = 0..L-2 of ``tokens`` [B, L]
        (x_0..x_{L-1}, right-padded rows are fine) with the target's ``features`` [B, L, F*H] of
        those positions, in one pass per step (the training-time test's form; data_gen's labels at
        depth k + 1): step k at anchor i reads the token x_{i+1+k} at position i+k and, for k = 0,
        the feature g_i, for k > 0 its own output of step k-1 at anchor i; it predicts x_{i+2+k}.
        Attention: the step-0 entries causally, then each later step's entry of the same anchor,
        which is exactly what drafting k+1 tokens after the prefix x_0..x_{i+1} with a cache
        computes (tests/models/test_feature_draft.py checks it). Returns one :class:`UnrolledStep`
        per step: ``normed`` [B, L-1, H] (``lm_head`` of it: the logits over the draft's ids) and
        ``hidden`` (what the next step reads, and what a lag-free head reads).

        ``probes`` [B, L-1, steps] (optional): a token per anchor and step, e.g. the candidate a round
        drew at step k where x_{i+2+k} stands; each step's ``after`` is then the state after reading
        it, i.e. step k+1 at anchor i with the probe in place of x_{i+2+k} (what the draft computes
        when it feeds that candidate: the state the paper's head reads for it), at the cost of one
        more step per step. A probe's entry is not attended by later steps."""
        b, length = tokens.shape
        t = length - 1
        if probes is not None and probes.shape != (b, t, steps):
            raise ValueError(f"probes must be [B, L-1, steps] = [{b}, {t}, {steps}], got {tuple(probes.shape)}")
        dev = tokens.device
        g = features[:, :t].to(self.dtype)
        u = self.fc(self.input_norm(g) if self.input_norm is not None else g)
        earlier = [([], []) for _ in self.layers]
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(t, dtype=torch.bool, device=dev)

        def step(k: int, ids: torch.Tensor, u: torch.Tensor, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
            position_ids = (torch.arange(t, device=dev) + k).expand(b, t)
            embeds = self.embed_tokens(ids)
            rope = self.rotary_emb(embeds, position_ids)
            mask = torch.cat([causal] + [eye] * k, dim=1)[None, None]
            h = u
            for i, layer in enumerate(self.layers):
                past = earlier[i] if keep else (list(earlier[i][0]), list(earlier[i][1]))  # a probe: not kept
                h = layer(h, embeds, rope, mask, None, i, 0, past)
            normed = self.norm(h)
            return normed, (normed if self.spec_config["norm_output"] else h)

        outs = []
        for k in range(steps):
            ids = torch.cat([tokens[:, 1 + k:], tokens.new_zeros((b, k))], dim=1)[:, :t]
            normed, u = step(k, ids, u, keep=True)
            after = None if probes is None else step(k + 1, probes[..., k].to(dev), u, keep=False)[1]
            outs.append(UnrolledStep(normed, u, after))
        return outs

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V_d] over the draft's ids as logits [..., V]: -inf off its vocabulary."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, draft_logits)

    @staticmethod
    def _mask(allowed, b: int, t: int, start: int, device) -> torch.Tensor | None:
        if allowed is None and t == 1:
            return None  # one new position sees the whole cache
        if allowed is None:
            allowed = torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start)
            return allowed[None, None]
        if allowed.shape != (b, t, start + t):
            raise ValueError(f"attention_mask must be bool [B, T, cached + T] = [{b}, {t}, {start + t}], "
                             f"got {tuple(allowed.shape)}")
        return allowed.to(device=device, dtype=torch.bool)[:, None]

    # ------------------------------------------------------------ building, checking, saving, loading

    @classmethod
    def init_from(cls, target, aux_layers=None, draft_vocab=None, *, num_layers: int = 1,
                  generator: torch.Generator | None = None, train_lm_head: bool = False,
                  speculative_tokens: int = 3, **flags) -> FeatureDraft:
        """An untrained draft for a Llama-family ``target``: its shape, rope and norms' eps from
        ``target.config``; ``embed_tokens`` a frozen copy of the target's embedding, ``lm_head`` a copy
        of its output rows for the kept ids (frozen unless ``train_lm_head``); every other weight
        drawn as Llama initialises (std ``initializer_range``) from ``generator``. ``aux_layers``:
        HF ``hidden_states`` ids in [0, L) (default :func:`default_aux_layers`); ``draft_vocab``: the kept target
        ids (None: all); ``flags``: speculators' ``norm_before_residual``, ``norm_before_fc``,
        ``norm_output`` (all True by default). On the target's device, in its dtype."""
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"FeatureDraft.init_from: unknown flags {sorted(unknown)}; known: {sorted(FLAGS)}")
        cfg = _text_config(target.config)
        n_layers = cfg.num_hidden_layers
        aux = default_aux_layers(n_layers) if aux_layers is None else [int(i) for i in aux_layers]
        embed = target.get_input_embeddings().weight
        vocab = int(embed.shape[0])
        ids = torch.arange(vocab) if draft_vocab is None else _kept_ids(draft_vocab, vocab)
        heads = cfg.num_attention_heads
        layer = {"vocab_size": vocab, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                 "num_hidden_layers": int(num_layers), "num_attention_heads": heads,
                 "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
                 "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                 "hidden_act": getattr(cfg, "hidden_act", "silu"),
                 "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
                 "rope_parameters": _rope_parameters(cfg),
                 "attention_bias": bool(getattr(cfg, "attention_bias", False)),
                 "mlp_bias": bool(getattr(cfg, "mlp_bias", False)), "model_type": "llama",
                 "tie_word_embeddings": False}
        verifier = {"name_or_path": portable_name(getattr(cfg, "_name_or_path", None) or None),
                    "architectures": list(getattr(target.config, "architectures", None) or [type(target).__name__])}
        check_aux_layers(aux, n_layers, "aux_layers")
        draft = cls(speculators_config(layer, aux, int(ids.numel()), verifier, speculative_tokens, **flags))
        std = getattr(cfg, "initializer_range", 0.02)
        with torch.no_grad():
            for module in draft.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.normal_(0.0, std, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()
            draft.embed_tokens.weight.copy_(embed.detach().float().cpu())
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[ids.to(embed.device)].float().cpu())
        d2t = ids - torch.arange(ids.numel())
        t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
        draft.set_vocab_map(d2t, t2d, "init_from")
        draft.lm_head.weight.requires_grad_(train_lm_head)
        return draft.to(device=embed.device, dtype=embed.dtype)

    def check_target(self, target, name: str = "the target") -> None:
        """Refuse a target this draft was not made for: hidden size, layer count (aux ids out of
        range) or vocabulary size differ. A ValueError names the draft, the target and both values."""
        cfg = _text_config(target.config)
        draft = repr(self.name_or_path or "the feature draft")
        vocab = int(target.get_input_embeddings().weight.shape[0])
        problems = []
        if cfg.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} in the draft, {cfg.hidden_size} in the target")
        if vocab != self.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} in the draft's transformer_layer_config, "
                            f"{vocab} embedding rows in the target")
        bad = [i for i in self.aux_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            problems.append(f"eagle_aux_hidden_state_layer_ids {self.aux_layers} need layers {bad}, but the target "
                            f"has {cfg.num_hidden_layers} layers (ids in [0, {cfg.num_hidden_layers}))")
        if problems:
            raise ValueError(f"feature draft {draft} was not made for {name}: {'; '.join(problems)}. Use the draft "
                             "trained for this target (its speculators_config.verifier names it: "
                             f"{self.spec_config['speculators_config']['verifier']['name_or_path']!r}), or build one "
                             "with FeatureDraft.init_from(target)")

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the speculators format (vLLM loads it);
        float weights in ``dtype`` (default: as held), ``d2t`` int64, ``t2d`` bool."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.spec_config, indent=2) + "\n")
        tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target=None, device=None,
                        dtype: torch.dtype | None = None) -> FeatureDraft:
        """Load a speculators-format directory, frozen and in eval mode. With ``target``: checked
        against it (:meth:`check_target`), its embedding used where the file has none (as vLLM
        shares it), on its device and in its dtype unless ``device``/``dtype`` say otherwise;
        without: on the CPU in the stored dtype."""
        from safetensors.torch import load_file

        path = Path(directory)
        config = read_config(path)
        weights = path / WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(f"feature draft {str(path)!r} has no {WEIGHTS_FILE}")
        tensors = load_file(str(weights))
        draft = cls(config)
        draft.name_or_path = str(directory)
        if target is not None:
            draft.check_target(target)
            if "embed_tokens.weight" not in tensors:
                tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu()
        expected = set(draft.state_dict())
        mapping = {k for k in ("d2t", "t2d") if k in tensors}
        if len(mapping) == 1 or (not mapping and draft.draft_vocab_size != draft.vocab_size):
            missing = sorted({"d2t", "t2d"} - mapping)
            raise ValueError(f"feature draft {str(weights)!r} lacks its id mapping {missing}: a draft vocabulary of "
                             f"{draft.draft_vocab_size} of {draft.vocab_size} ids needs both d2t [V_d] and t2d [V]")
        missing = sorted(expected - set(tensors) - {"d2t", "t2d"})
        if missing:
            hint = " (pass target= to take the target's embedding)" if missing == ["embed_tokens.weight"] else ""
            raise ValueError(f"feature draft {str(weights)!r} lacks weights {missing}{hint}")
        for key in expected - {"d2t", "t2d"}:
            have, want = tuple(tensors[key].shape), tuple(draft.state_dict()[key].shape)
            if have != want:
                raise ValueError(f"feature draft {str(weights)!r}: {key} has shape {have}, its config.json says {want}")
        stored = tensors["fc.weight"].dtype
        floats = {k: v for k, v in tensors.items() if k in expected and v.is_floating_point()}
        draft.load_state_dict(floats, strict=False)
        if mapping:
            draft.set_vocab_map(tensors["d2t"], tensors["t2d"], f"feature draft {str(weights)!r}")
        ref = target.get_input_embeddings().weight if target is not None else None
        device = device if device is not None else (ref.device if ref is not None else "cpu")
        dtype = dtype if dtype is not None else (ref.dtype if ref is not None else stored)
        return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def is_feature_draft(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose config.json has ``speculators_model_type`` (load_pair asks)."""
    f = Path(os.path.expanduser(str(path))) / CONFIG_FILE
    if not f.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(f.read_text())
    except (ValueError, TypeError):
        return False


def speculators_config(layer: dict, aux_layers: list[int], draft_vocab_size: int, verifier: dict,
                       speculative_tokens: int = 3, **flags) -> dict:
    """The config.json of an EAGLE-3 draft in the speculators format (docs/feature_draft.md)."""
    flags = {**FLAGS, **flags}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": int(draft_vocab_size),
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layers],
            "norm_before_residual": bool(flags["norm_before_residual"]),
            "norm_before_fc": bool(flags["norm_before_fc"]), "fc_norm": False,
            "norm_output": bool(flags["norm_output"]), "embed_requires_grad": False,
            "transformer_layer_config": dict(layer),
            "speculators_config": {"algorithm": "eagle3",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": int(speculative_tokens),
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "default_proposal_method": "greedy", "verifier": dict(verifier)}}


def read_config(path: Path) -> dict:
    """A speculators-format config.json, checked for what this module builds (an EAGLE-3 Llama layer)."""
    f = path / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"feature draft {str(path)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(f.read_text())
    except ValueError as exc:
        raise ValueError(f"{str(f)!r} is not valid JSON: {exc}") from exc

    def need(mapping: dict, key: str, where: str):
        if not isinstance(mapping, dict) or key not in mapping:
            raise ValueError(f"{str(f)!r}: {where}{key} is missing; not an EAGLE-3 speculators config")
        return mapping[key]

    kind = need(config, "speculators_model_type", "")
    if kind != "eagle3":
        raise ValueError(f"{str(f)!r}: speculators_model_type {kind!r} is not supported (only 'eagle3')")
    layer = need(config, "transformer_layer_config", "")
    for key in LAYER_KEYS:
        if key not in ("head_dim", "rope_parameters", "attention_bias", "mlp_bias", "hidden_act"):
            need(layer, key, "transformer_layer_config.")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{str(f)!r}: transformer_layer_config.model_type {layer['model_type']!r} is not "
                         "supported (only 'llama')")
    for key in ("fc_norm",):
        if config.get(key):
            raise ValueError(f"{str(f)!r}: {key}=true is not supported yet")
    target_hidden = config.get("target_hidden_size")
    if target_hidden not in (None, layer["hidden_size"]):
        raise ValueError(f"{str(f)!r}: target_hidden_size {target_hidden} differs from the draft's hidden_size "
                         f"{layer['hidden_size']}; not supported (speculators requires them equal)")
    need(config, "draft_vocab_size", "")
    aux = need(config, "eagle_aux_hidden_state_layer_ids", "")
    if not isinstance(aux, list) or not aux or len(set(aux)) != len(aux) or not all(isinstance(i, int) for i in aux):
        raise ValueError(f"{str(f)!r}: eagle_aux_hidden_state_layer_ids must be distinct layer ids, got {aux!r}")
    layer = {"head_dim": layer["hidden_size"] // layer["num_attention_heads"], "hidden_act": "silu",
             "attention_bias": False, "mlp_bias": False, **layer,
             "rope_parameters": _rope_parameters_of(layer)}
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return {**config, "transformer_layer_config": layer,
            "speculators_config": {**(config.get("speculators_config") or {}),
                                   "verifier": {"name_or_path": verifier.get("name_or_path"),
                                                "architectures": verifier.get("architectures") or []}},
            **{k: bool(config.get(k, False)) for k in FLAGS}}


def default_aux_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers [2, L//2, L-3] (EAGLE, speculators and vLLM alike);
    for a target of fewer than 7 layers, where those collide, up to three spread over [0, L)."""
    if n_layers >= 7:
        return [2, n_layers // 2, n_layers - 3]
    return sorted({round(i * (n_layers - 1) / 2) for i in range(3)})


def check_aux_layers(aux: list[int], n_layers: int, name: str) -> None:
    if not aux or len(set(aux)) != len(aux) or any(not 0 <= i < n_layers for i in aux):
        raise ValueError(f"{name} must be distinct HF hidden_states ids in [0, {n_layers}) for a target of "
                         f"{n_layers} layers (id i: the input of layer i; the final normed state is not one), "
                         f"got {aux}")


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, draft_vocab: int, source: str) -> torch.Tensor:
    """The kept target ids (i + d2t[i]) after checking d2t [V_d] and t2d [V] against each other;
    a ValueError naming ``source`` otherwise."""
    if d2t.dim() != 1 or d2t.numel() != draft_vocab or d2t.is_floating_point():
        raise ValueError(f"{source}: d2t must be integer [draft_vocab_size] = [{draft_vocab}], "
                         f"got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dim() != 1 or t2d.numel() != vocab:
        raise ValueError(f"{source}: t2d must be bool [vocab_size] = [{vocab}], got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(draft_vocab) + d2t.cpu().long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft_vocab:
        raise ValueError(f"{source}: d2t maps draft ids to target ids i + d2t[i] that are not distinct ids in "
                         f"[0, {vocab}) (got {ids.unique().numel()} distinct in [{int(ids.min())}, {int(ids.max())}])")
    kept = t2d.cpu().bool()
    if int(kept.sum()) != draft_vocab or not bool(kept[ids].all()):
        raise ValueError(f"{source}: d2t and t2d disagree: t2d marks {int(kept.sum())} target ids, d2t maps "
                         f"{draft_vocab}, and {int((~kept[ids]).sum())} of d2t's targets are not marked in t2d")
    return ids


def _kept_ids(draft_vocab, vocab: int) -> torch.Tensor:
    ids = torch.as_tensor(draft_vocab, dtype=torch.long).flatten().unique(sorted=True)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"draft_vocab must be target ids in [0, {vocab}), got {ids.numel()} ids"
                         + (f" in [{int(ids.min())}, {int(ids.max())}]" if ids.numel() else ""))
    return ids


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_parameters(config) -> dict:
    """A target config's rope as speculators writes it: ``{"rope_type", "rope_theta", ...scaling}``
    (transformers 5 holds it so; 4.x as ``rope_theta`` plus ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_type": "default", **params}
    return _rope_parameters_of({"rope_theta": getattr(config, "rope_theta", 10000.0),
                                "rope_scaling": getattr(config, "rope_scaling", None)})


def _rope_parameters_of(layer: dict) -> dict:
    params = layer.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_type": "default", **params}
    scaling = dict(layer.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    return {"rope_type": rope_type, "rope_theta": float(layer.get("rope_theta", 10000.0)), **scaling}


def _llama_kwargs(layer: dict) -> dict:
    """LlamaConfig's arguments for the draft's layer (its MLP and rotary embedding read them), with
    the rope in the form this transformers version takes."""
    kwargs = {k: layer[k] for k in LAYER_KEYS if k != "rope_parameters"}
    from transformers import LlamaConfig

    rope = dict(layer["rope_parameters"])
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4.x
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return kwargs

