"""
specgpt's model: a GPT whose sequence mixer, residual stream and MLP are chosen by one config key each.

    x_0 = wte(idx)
    x_l = x_{l-1} + mixer(norm(x_{l-1})),  then  x_l = x_l + mlp(norm(x_l))      (residual = "res")
    logits = lm_head(norm_f(x_L))

`mixer` is a string of letters cycled over the layers: A = RoPE causal self-attention,
G = the gated delta family (DeltaNet / GDN / KDA / Gated DeltaNet-2), M = Mamba2. The hyper-connection
residuals replace `x + F(norm(x))` by a mix of n parallel streams (see HyperConnection below).
The ops with fast paths (RMSNorm, RoPE, the linear recurrences) come from kernels.py.
GPT-2's architecture is keys too: pos="learned" (x_0 = wte(idx) + wpe(t), no RoPE), norm="layernorm",
mlp="gelu_tanh", bias=True; its weights come in (GPT.from_pretrained) and go out at the end of this file.
"""
import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_in_torch_dispatch_mode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import kernels
from init import SCHEMES, init_weights


# The defaults are the default run's (`python train.py`, the baby MAAA model, RESULTS.md "The default run"): nanoGPT's
# shakespeare_char context; one Mamba2 layer below three attention layers, narrowed to an inner width of n_embd
# and a state of 16 (its short convolution and recurrence lower the loss per step far more than the layer costs),
# and RMSNorm on queries and keys. train.py and analyze.py read every model default from here.
@dataclass
class GPTConfig:
    vocab_size: int = 84             # tokens in the vocabulary (train.py takes it from the data)
    vocab_multiple: int = 1          # embedding and head rows: vocab_size rounded up to a multiple of this
    block_size: int = 64             # context length in tokens
    n_layer: int = 4                 # blocks (mixer + MLP)
    n_head: int = 4                  # heads of every mixer; n_embd / n_head is the head size (even)
    n_embd: int = 128                # residual stream width
    mixer: str = "MAAA"            # letters cycled over layers (MIXERS)
    mlp: str = "relu2"             # the MLP's activation (MLPS)
    residual: str = "res"          # the residual stream (RESIDUALS)
    hc_streams: int = 4              # parallel residual streams of the hyper-connection residuals
    pos: str = "rope"              # where positions enter: RoPE in attention, or GPT-2's learned table (POSITIONS)
    norm: str = "rmsnorm"          # the blocks' and the final norm (NORMS)
    rope_base: float = 10000.0       # RoPE's base: the slowest pair turns once per ~2π·rope_base tokens
    rope: str = "fixed"            # RoPE's fixed θ_i, learned θ per head, or lie (θ and a trainable basis U)
    rope_scaling: str = "none"     # how fixed θ_i adapt to a context rope_factor× longer (rope_frequencies)
    rope_factor: float = 1.0       # attention accepts block_size·rope_factor tokens (eval/generate past training)
    qk_norm: bool = True             # RMSNorm on queries and keys before RoPE
    tie_embeddings: bool = True      # lm_head shares the token embedding's weight
    bias: bool = False               # biases in the linear layers
    dropout: float = 0.0             # dropout probability (embeddings, attention, residual branches)
    attention: str = "sdpa"        # attention's weighting (ATTENTIONS)
    gdn_variant: str = "gdn2"      # G mixer: which gates are per channel, per head or absent (GDN_VARIANTS)
    gdn_clip: bool = True            # gdn2: the spectral clip that keeps each transition contractive
    gdn_expand_v: int = 1            # G mixer: value width = gdn_expand_v x head size
    conv_size: int = 4               # G and M mixers: width of the causal short convolution
    mamba_d_state: int = 16          # M mixer: state size N
    mamba_expand: int = 1            # M mixer: inner width = mamba_expand x n_embd
    mamba_headdim: int = 32          # M mixer: head size P (divides the inner width)
    mamba_discretization: str = "euler"  # M mixer: the input factor dt (euler) or (exp(dt A) − 1)/A (zoh)
    chunk_size: int = 256            # M mixer: SSD chunk length, torch and Triton paths (Triton: at most 256)
    gdn_chunk_size: int = 64         # G mixer: chunk length, torch and Triton paths (Triton: 16, 32 or 64)
    kernels: str = "auto"          # kernels.py's path: auto (Triton on CUDA, else torch), torch, triton, ref
    init: str = "gpt2"             # init.py's scheme: GPT-2's N(0, 0.02), or the spectral condition

    def __post_init__(self):
        for key, allowed in config_choices().items():
            if key != "mixer" and getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r} is not valid: use one of {', '.join(allowed)}")
        unknown = set(self.mixer) - set(MIXERS)
        if not self.mixer or unknown:
            raise ValueError(f"mixer={self.mixer!r} is not valid: use letters of {', '.join(MIXERS)}, e.g. 'A', "
                             f"'GGGA', 'MA' (a new letter goes in model.MIXERS)")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: change one of them")
        rotary = POSITIONS[self.pos].rotary
        if not rotary and (self.rope != "fixed" or self.rope_scaling != "none" or self.rope_factor != 1):
            raise ValueError(f"pos={self.pos!r} has no RoPE for rope={self.rope!r}, rope_scaling="
                             f"{self.rope_scaling!r}, rope_factor={self.rope_factor:g} to change: use pos='rope', or "
                             f"leave those three keys at 'fixed', 'none', 1")
        if rotary and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head size {self.n_embd // self.n_head} is odd: RoPE needs an even head size")
        if self.conv_size < 1 or self.gdn_expand_v < 1 or self.mamba_expand < 1 or self.mamba_d_state < 1:
            raise ValueError("conv_size, gdn_expand_v, mamba_expand and mamba_d_state must each be at least 1")
        if not self.rope_factor >= 1:
            raise ValueError(f"rope_factor={self.rope_factor} is below 1: use 1 (no extension) or the ratio "
                             f"of the evaluation length to block_size")
        if self.rope_scaling != "none" and self.rope != "fixed":
            raise ValueError(f"rope_scaling={self.rope_scaling!r} adapts RoPE's fixed frequencies: use rope='fixed' "
                             f"or rope_scaling='none' with rope={self.rope!r}")
        if self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size={self.chunk_size} is not a power of two: use e.g. 16, 32 or 64")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple={self.vocab_multiple} is not valid: use 1 (no padding) or e.g. 64")
        if self.gdn_chunk_size not in (16, 32, 64):
            raise ValueError(f"gdn_chunk_size={self.gdn_chunk_size} is not supported: use 16, 32 or 64 "
                             f"(the Triton kernels' sub-chunks of 16)")

    @property
    def padded_vocab_size(self):
        """vocab_size rounded up to a multiple of vocab_multiple: the rows of the embedding and the head. GPUs
        run matmuls whose sizes are multiples of 64 faster (50257 -> 50304, nanoGPT's padding); the extra rows
        are never a target, so training only pushes their logits down, and generation never samples them."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @classmethod
    def from_dict(cls, d):
        """Build from a dict (e.g. a checkpoint's config), ignoring keys that are not model keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# the allowed values of GPTConfig's numeric keys, as train.py and analyze.py check them (runs.in_range's rules);
# GPTConfig itself checks the rules between keys
CONFIG_RANGES = {"block_size": ">= 1", "n_layer": ">= 1", "n_head": ">= 1", "n_embd": ">= 1", "hc_streams": ">= 1",
                 "mamba_headdim": ">= 1", "vocab_multiple": ">= 1", "rope_base": "> 0", "dropout": "in [0, 1)"}


# the module-level table each choice key of GPTConfig reads its kinds from (their rows' comments: --help's text)
CHOICE_TABLES = {"mixer": "MIXERS", "mlp": "MLPS", "residual": "RESIDUALS", "attention": "ATTENTIONS",
                 "gdn_variant": "GDN_VARIANTS", "pos": "POSITIONS", "norm": "NORMS"}


def config_choices():
    """GPTConfig's keys that take one of a set of values, and those values: the kinds from their tables
    (MIXERS' letters, MLPS, RESIDUALS, ATTENTIONS, ...), read when called, so that a new entry counts at once."""
    return {"mixer": tuple(MIXERS), "mlp": tuple(MLPS), "residual": tuple(RESIDUALS), "attention": tuple(ATTENTIONS),
            "gdn_variant": tuple(GDN_VARIANTS), "pos": tuple(POSITIONS), "norm": tuple(NORMS),
            "mamba_discretization": ("euler", "zoh"),
            "kernels": kernels.KERNEL_CHOICES, "init": SCHEMES, "rope": ("fixed", "learned", "lie"),
            "rope_scaling": ROPE_SCALINGS}


class RMSNorm(nn.Module):
    """y = g / sqrt(mean(g²) + eps) ⊙ weight with g = x, or g = x ⊙ SiLU(gate) (Mamba2's gated norm, one op).
    Under autocast y is written once, in the autocast dtype: what reads it is a matmul, which would cast it anyway
    (attention's q, k and v projections each their own copy)."""

    def __init__(self, dim, eps=1e-6, kernels_path="auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels_path = kernels_path

    def forward(self, x, gate=None):
        kind = x.device.type
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        return kernels.rms_norm(x, self.weight, self.eps, gate, torch.get_autocast_dtype(kind) if autocast else None,
                                kernels=self.kernels_path)


def layer_norm(cfg, dim):
    """GPT-2's LayerNorm: y = (x − mean(x)) / sqrt(var(x) + 1e-5) ⊙ weight (+ bias where cfg.bias)."""
    return nn.LayerNorm(dim, eps=1e-5, bias=cfg.bias)


# GPTConfig.norm: the norm before each sublayer and before the head, built as NORMS[kind](cfg, dim); a norm module
# maps (..., dim) to (..., dim). The norms inside mixers (qk_norm, the gated norms of G and M) stay RMSNorm.
NORMS = {
    "rmsnorm": lambda cfg, dim: RMSNorm(dim, kernels_path=cfg.kernels),  # x / rms(x) ⊙ weight, by kernels.rms_norm
    "layernorm": layer_norm,                                             # GPT-2's, with a bias where bias=True
}


class PositionKind(NamedTuple):
    rotary: bool   # attention rotates q and k by R_t (RoPE and its variants, GPTConfig.rope)
    table: bool    # a learned vector wpe[t] per position t < block_size is added to the token embedding


# GPTConfig.pos: how a token's position reaches the model. The rule: a model with a table reads at most block_size
# positions (GPT.context_limited), so rope_factor and the RoPE keys are refused with it (GPTConfig).
POSITIONS = {
    "rope": PositionKind(rotary=True, table=False),     # RoPE on q and k (Su et al. 2021): scores see s − t
    "learned": PositionKind(rotary=False, table=True),  # GPT-2's absolute positions: x_0 = wte[idx_t] + wpe[t]
}


ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")
YARN_FAST_TURNS, YARN_SLOW_TURNS = 32, 1  # YaRN's beta_fast, beta_slow (the paper's β, α): the ramp's ends in turns


def yarn_correction_range(head_dim, base, train_length):
    """YaRN's ramp ends (low, high) as pair indices, as the authors' code finds them. Pair i turns
    r_i = L θ_i / 2π times within L = train_length; since θ_i = base^(−2i/d), the (fractional) pair that turns
    r times is p(r) = d·ln(L / (2π r)) / (2 ln base). low = ⌊p(32)⌋, high = ⌈p(1)⌉,
    clamped to [0, d − 1]."""
    def pair(turns):
        return head_dim * math.log(train_length / (2 * math.pi * turns)) / (2 * math.log(base))
    return max(math.floor(pair(YARN_FAST_TURNS)), 0), min(math.ceil(pair(YARN_SLOW_TURNS)), head_dim - 1)


def rope_frequencies(head_dim, base, scaling="none", factor=1.0, train_length=None):
    """RoPE's θ_i = base^(−2i/d), i < d/2, adapted to a context `factor` = s times longer than train_length:
    pi    θ_i / s (position interpolation, Chen et al. 2023);
    ntk   static NTK-aware scaling: base → base·α^(d/(d−2)) with α = s fixed, so θ_0 is kept and θ_{d/2−1} is
          divided by s at every length (dynamic NTK instead grows α with the length of the sequence at hand);
    yarn  YaRN's NTK-by-parts (Peng et al. 2023) as the authors' code computes it: (1 − γ_i) θ_i / s + γ_i θ_i,
          γ_i = 1 − clamp((i − low) / (high − low), 0, 1) linear in the pair index i between the pairs that turn
          32 times (low) and once (high) within L = train_length (yarn_correction_range; a step if low = high).
          In the turns r_i = L θ_i / 2π this is γ = log₃₂ r_i, up to the rounding of low and high; the paper's
          text ramps linearly in r instead, (r_i − 1)/31, which the released code and configs do not follow."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # fp32: "none" is RoPE's cache as ever
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    theta = base ** -exponents
    if scaling == "pi":
        theta = theta / factor
    elif scaling == "yarn":
        if train_length is None:
            raise ValueError("rope_scaling='yarn' needs train_length, the context the model was trained on")
        low, high = yarn_correction_range(head_dim, base, train_length)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        gamma = 1 - ramp.clamp(0, 1)
        theta = theta * (1 / factor + gamma * (1 - 1 / factor))  # = (1 − γ) θ / s + γ θ, exactly θ at s = 1
    return theta


def rope_cache(length, head_dim, base, device=None, scaling="none", factor=1.0, train_length=None):
    """cos, sin of the angles t·θ_i (rope_frequencies), each [length, head_dim/2]. YaRN also multiplies both by
    m = 0.1·ln(s) + 1 (1 for s ≤ 1), as the authors' code does: q and k are both rotated with them, so q·k is
    scaled by m², the paper's attention temperature 1/t with sqrt(1/t) = 0.1·ln(s) + 1."""
    theta = rope_frequencies(head_dim, base, scaling, factor, train_length).to(device)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), theta)
    if scaling == "yarn" and factor > 1:
        scale = 0.1 * math.log(factor) + 1
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def attention_sdpa(q, k, v, dropout=0.0, kernels_path="auto"):
    """softmax(q kᵀ / sqrt(d) + M) v as attention_math, by PyTorch's fused scaled_dot_product_attention."""
    T, S = q.size(2), k.size(2)
    if S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # query t sees keys ≤ S − T + t
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


def attention_math(q, k, v, dropout=0.0, kernels_path="auto"):
    """softmax(q kᵀ / sqrt(d) + M) v for q (B, nh, T, d) and k, v (B, nh, S, d), the T queries being the last T
    of S positions: M = 0 where key s ≤ query position S − T + t, −inf elsewhere. Plain ops, so it supports
    double backward; the mask and the scale ride in one baddbmm."""
    B, nh, T, d = q.shape
    S = k.size(2)
    mask = torch.full((T, S), float("-inf"), device=q.device, dtype=q.dtype).triu_(S - T + 1)
    att = torch.baddbmm(mask.expand(B * nh, T, S), q.reshape(B * nh, T, d), k.reshape(B * nh, S, d).transpose(1, 2),
                        alpha=d ** -0.5)
    att = F.dropout(att.softmax(dim=-1), dropout)
    return torch.bmm(att, v.reshape(B * nh, S, -1)).view(B, nh, T, -1)


def attention_sparsemax(q, k, v, dropout=0.0, kernels_path="auto"):
    """sparsemax(q kᵀ / sqrt(d)) v (Martins & Astudillo 2016), shapes as in attention_math: each query's weights
    are the projection of its scores onto the simplex, so low-scoring keys get exactly 0. The causal mask is
    applied inside kernels.sparsemax (future keys get weight 0)."""
    att = kernels.sparsemax((q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5, causal=True, kernels=kernels_path)
    return F.dropout(att, dropout) @ v


# GPTConfig.attention: how the scores become weights, each (q, k, v, dropout, kernels_path) -> (B, nh, T, d).
# The rule: the output is W v with weights W (B, nh, T, S) from q and k alone, for v of any width (with dropout 0),
# so Attention.attention_weights reads W as the output for v = I.
ATTENTIONS = {
    "sdpa": attention_sdpa,             # softmax, by PyTorch's fused kernels
    "math": attention_math,             # softmax by plain ops: supports double backward
    "sparsemax": attention_sparsemax,   # sparsemax: exact zeros for low scores
}


class Attention(nn.Module):
    """Causal self-attention with rotary positions: o_t = Σ_{s≤t} softmax_s((R_t q_t)·(R_s k_s) / sqrt(d)) v_s,
    R_t = exp(t X) for one skew-symmetric generator X per head, so R_tᵀ R_s = R_{s−t}: scores see only s − t.
    rope="fixed": X = Λ, 2×2 blocks turning pair i at RoPE's θ_i (Su et al. 2021);
    "learned": the same Λ with trainable θ_{h,i} = exp(log_freq) per head, initialised at RoPE's;
    "lie": X = U Λ Uᵀ with a trainable orthogonal U = exp(B − Bᵀ) per head (B = 0: RoPE at init). Since
    R_t = U exp(tΛ) Uᵀ and (U a)·(U b) = a·b, scores need only exp(tΛ) Uᵀ q: the outer U cancels, and Uᵀ is
    what W_q, W_k could learn themselves; the frequencies Λ are what RoPE really fixes."""

    context_limited = True  # its RoPE cache covers block_size·rope_factor positions

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.q_norm = RMSNorm(self.head_dim, kernels_path=cfg.kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, kernels_path=cfg.kernels) if cfg.qk_norm else None
        self.dropout, self.attention, self.kernels_path = cfg.dropout, cfg.attention, cfg.kernels
        self.rope, self.rotary = cfg.rope, POSITIONS[cfg.pos].rotary
        if cfg.rope != "fixed":  # 1-D, so the optimizers treat it like a gain: AdamW, no weight decay, no Muon
            self.log_freq = nn.Parameter(rope_frequencies(self.head_dim, cfg.rope_base).log().repeat(cfg.n_head))
        if cfg.rope == "lie":
            self.basis = nn.Parameter(torch.zeros(cfg.n_head, self.head_dim, self.head_dim))

    def forward(self, x, rope, cache=None):
        B, T, C = x.shape
        q, k, v = self.heads(x, rope)
        if cache is not None:  # generation: append to the keys and values of earlier positions
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        y = ATTENTIONS[self.attention](q, k, v, self.dropout if self.training else 0.0, self.kernels_path)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))

    def heads(self, x, rope):
        """q, k, v (B, nh, T, hs) of x (B, T, C): the projections, qk_norm, and R_t on q and k."""
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = self.rotate(q, k, rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attention_weights(self, x, rope):
        """The weights (B, nh, T, T) each query of x (B, T, C) puts on each key, as this layer's kind in ATTENTIONS
        makes them (softmax, sparsemax, ...; no dropout): the output for v = I, by the rule above ATTENTIONS."""
        q, k, _ = self.heads(x, rope)
        B, nh, T, _ = q.shape
        identity = torch.eye(T, device=q.device, dtype=q.dtype).expand(B, nh, T, T)
        try:
            weights = ATTENTIONS[self.attention](q, k, identity, 0.0, self.kernels_path)
        except RuntimeError:
            weights = None
        if weights is None or weights.shape != (B, nh, T, T):
            raise ValueError(f"attention {self.attention!r} cannot give its weights: its output must be W v for v of "
                             f"any width (the rule above model.ATTENTIONS)")
        return weights

    def rotate(self, q, k, rope):
        """R_t q, R_t k for q, k (B, T, nh, hs). rope: (cos, sin) of the T positions' angles for rope="fixed"
        (the model's cache), else the positions t (T,) themselves, turned into angles t·θ_{h,i} here."""
        if self.rope == "fixed":
            cos, sin = rope
            return (kernels.rope(q, cos, sin, kernels=self.kernels_path),
                    kernels.rope(k, cos, sin, kernels=self.kernels_path))
        B, T, nh, hs = q.shape
        if self.rope == "lie":
            U = torch.matrix_exp(self.basis - self.basis.transpose(1, 2))  # (nh, hs, hs), orthogonal
            q, k = torch.einsum("bthi,hij->bthj", q, U), torch.einsum("bthi,hij->bthj", k, U)  # Uᵀ q, Uᵀ k
        angles = (rope[:, None, None] * self.log_freq.exp().view(nh, hs // 2)).view(T * nh, hs // 2)
        cos, sin = angles.cos(), angles.sin()
        # each (t, h) its own angles: fold the heads into the time axis of kernels.rope's x[B, T, H, D]
        turn = lambda x: kernels.rope(x.reshape(B, T * nh, 1, hs), cos, sin,
                                      kernels=self.kernels_path).view(B, T, nh, hs)
        return turn(q), turn(k)

    def extra_flops_per_token(self, T):
        """q·k and att·v: 2·T·C multiply-adds each, forward + backward = 3× forward (PaLM's count)."""
        return 12 * T * self.n_head * self.head_dim

    @staticmethod
    def n_params(cfg):
        """q, k, v and out projections; qk_norm's two gains; trainable frequencies θ (and the basis U per head)."""
        d, H = cfg.n_embd, cfg.n_head
        hs = d // H
        rope = {"fixed": 0, "learned": d // 2, "lie": d // 2 + H * hs * hs}[cfg.rope]
        return 4 * (d + cfg.bias) * d + 2 * hs * cfg.qk_norm + rope

    @staticmethod
    def kept_per_token(cfg, act):
        """Bytes a token keeps for the backward (act bytes an activation, 4 for fp32; the weights apart): the
        projections' input, q, k and v at two stages, the output and out_proj's input (7 of width n_embd);
        with qk_norm its two outputs and their fp32 statistics; the softmax's log-sum-exp per head; the explicit
        paths (math, sparsemax) also the weights of every key."""
        d, H = cfg.n_embd, cfg.n_head
        weights = act * H * cfg.block_size if cfg.attention != "sdpa" else 0
        return act * d * (7 + 2 * cfg.qk_norm) + 4 * H * (1 + 2 * cfg.qk_norm) + weights


# -----------------------------------------------------------------------------
# Linear-recurrent mixers: G (the gated delta family) and M (Mamba2). Both keep a fixed-size state per
# head, so generation carries the state (and the short convolution's input tail) from step to step.

def init_A_log(n):
    """A_log = log U(1, 16), so the decay rates exp(A_log) spread over [1, 16] (Mamba2's init)."""
    return torch.empty(n).uniform_(1, 16).log()


def init_dt_bias(n, dt_min=1e-3, dt_max=0.1):
    """Inverse softplus of dt ~ logU(dt_min, dt_max) (floored at 1e-4): softplus(0 + dt_bias) = dt at init."""
    dt = torch.empty(n).uniform_(math.log(dt_min), math.log(dt_max)).exp().clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def causal_conv(conv, x, cache=None, key="conv"):
    """Depthwise causal convolution over time, y_t = Σ_i w_i ⊙ x_{t−K+1+i} (+ bias), of x (B, T, C) with the
    weights of conv = Conv1d(C, C, K, groups=C). The K−1 inputs before x are zeros, or in generation the last
    K−1 inputs of the previous call, kept in cache[key]. Returned in x's dtype (conv_taps sums in fp32)."""
    B, T, C = x.shape
    K = conv.kernel_size[0]
    if cache is not None:
        x = torch.cat([cache[key] if key in cache else x.new_zeros(B, K - 1, C), x], dim=1)
        cache[key] = x[:, x.size(1) - (K - 1):]
    return conv_taps(x, conv.weight[:, 0, :], conv.bias, T).to(x.dtype)


def conv_taps(x, w, bias, T):
    """The convolution's last T outputs, y_t = Σ_i w_i ⊙ x_{t−K+1+i} (+ bias), for x (B, S, C), S ≥ T (the
    S − T inputs before the outputs' own, zeros before those), w (C, K); in fp32. K shifted multiply-adds into
    slices of y in x's layout (on the CPU their backward is several times faster than the depthwise Conv1d's),
    reading x itself rather than a padded copy, so autograd keeps nothing but x. The multiply-adds are in place, but
    only into y, which this function made and no autograd node saves (each product saves its slice of x and w), so
    they are safe inside GatedDelta's selectively checkpointed region too, which torch.compile warns about for
    in-place ops in general (the inductor test checks its gradients)."""
    past, K = x.size(1) - T, w.size(1)
    y = x[:, past:] * w[:, K - 1] if bias is None else torch.addcmul(bias, x[:, past:], w[:, K - 1])
    for i in range(K - 1):
        back = K - 1 - i  # tap i reads the input `back` steps before the output's own
        first = max(back - past, 0)  # the outputs before it read the zeros before x
        if first < T:
            y[:, first:].addcmul_(x[:, past + first - back:past + T - back], w[:, i])
    return y


class ConvSiLU(torch.autograd.Function):
    """s = SiLU(causal_conv(conv, x)) over a whole sequence (x (B, T, C), weight (C, 1, K), bias (C,) or None),
    keeping only x and the weights: the backward reruns the convolution's K multiply-adds rather than keep v, its
    output, an activation of x's size. With σ = sigmoid(v),
        ∂v = ∂s ⊙ σ(1 + v(1 − σ)),  ∂x_t = Σ_i w_i ⊙ ∂v_{t+K−1−i},
        ∂w_i = Σ_t ∂v_t ⊙ x_{t−K+1+i},  ∂b = Σ_t ∂v_t,
    in differentiable ops, so double backward (Hessian-vector products) runs through it."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.silu(conv_taps(x, weight[:, 0, :], bias, x.size(1))).to(x.dtype)

    @staticmethod
    def backward(ctx, ds):
        x, weight, bias = ctx.saved_tensors
        w, T = weight[:, 0, :], x.size(1)
        K = w.size(1)
        v = conv_taps(x, w, bias, T)
        sig = torch.sigmoid(v)
        dv = ds * sig * (1 + v * (1 - sig))
        dx = dv * w[:, K - 1]
        for i in range(K - 1):
            back = K - 1 - i
            if back < T:
                dx[:, :T - back].addcmul_(dv[:, back:], w[:, i])
        dw = torch.stack([(dv[:, K - 1 - i:] * x[:, :max(T - (K - 1 - i), 0)]).sum((0, 1)) for i in range(K)], -1)
        return dx.to(x.dtype), dw.unsqueeze(1).to(weight.dtype), None if bias is None else dv.sum((0, 1))


def conv_silu(conv, x, cache=None, key="conv"):
    """SiLU(causal_conv(conv, x, cache, key)); a whole sequence goes through ConvSiLU, which keeps less for the
    backward."""
    return F.silu(causal_conv(conv, x, cache, key)) if cache is not None else ConvSiLU.apply(x, conv.weight, conv.bias)


def unit_norm(x, eps=1e-12):
    """x / max(‖x‖, eps) over the last dim (F.normalize), in x's dtype with the norm taken in fp32:
    under CUDA autocast F.normalize would return fp32."""
    return x / torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True).clamp_min(eps).to(x.dtype)


def keep_only(*ops):
    """context_fn for torch.utils.checkpoint: keep the outputs of ops, recompute everything else in the backward."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


# G's variants (GPTConfig.gdn_variant): the width of the erase gate b, the write gate w and the log-decay g, each
# per key channel ("key"), per value channel ("value"), one per head ("head") or absent (None: w = b = β, g = 0)
GDN_VARIANTS = {
    "gdn2": ("key", "value", "key"),   # Gated DeltaNet-2
    "kda": ("head", None, "key"),      # Kimi delta attention
    "gdn": ("head", None, "head"),     # Gated DeltaNet
    "deltanet": ("head", None, None),  # DeltaNet
}


def gated_delta_rows(cfg):
    """in_proj's rows for the erase, write and decay logits of cfg's G variant."""
    H, dk = cfg.n_head, cfg.n_embd // cfg.n_head
    width = {"key": H * dk, "value": H * dk * cfg.gdn_expand_v, "head": H, None: 0}
    return tuple(width[kind] for kind in GDN_VARIANTS[cfg.gdn_variant])


class GatedDelta(nn.Module):
    """Gated delta rule; per head a state S ∈ R^{dk×dv}, read o_t = S_tᵀ q_t / sqrt(dk):
        S_t = (I − k_t (b_t⊙k_t)ᵀ) Diag(exp g_t) S_{t−1} + k_t (w_t⊙v_t)ᵀ,
        y = W_o (RMSNorm(o) ⊙ SiLU(W_gate x))
    gdn2: g, b per key channel, w per value channel; kda: g per key channel, b = w = β per head;
    gdn: g and b = w = β per head; deltanet: g = 0, b = w = β. g = −exp(A_log)·softplus(W_f x + dt_bias).
    One matmul in_proj computes W_q x, W_k x, W_v x, W_gate x, W_b x (or W_β x), W_w x, W_f x (in that order;
    the absent ones have 0 rows) and one depthwise convolution runs over the q, k, v channels."""

    def __init__(self, cfg):
        super().__init__()
        H, dk = cfg.n_head, cfg.n_embd // cfg.n_head
        dv = dk * cfg.gdn_expand_v
        self.n_head, self.head_k, self.head_v = H, dk, dv
        self.variant = cfg.gdn_variant
        self.clip = cfg.gdn_clip and cfg.gdn_variant == "gdn2"  # for the others the clip is the identity
        self.chunk_size, self.kernels_path = cfg.gdn_chunk_size, cfg.kernels
        erase, write, decay = gated_delta_rows(cfg)
        self.conv_channels = H * (2 * dk + dv)
        # rows of in_proj, in order: q, k, v (through the convolution), gate, erase (β), write, decay logits
        self.in_splits = [self.conv_channels, H * dv, erase, write, decay]
        self.in_proj = nn.Linear(cfg.n_embd, sum(self.in_splits), bias=cfg.bias)
        # init.py initialises each map's rows (q, k, v, gate, erase, write, decay) as its own matrix
        self.in_proj.row_splits = [H * dk, H * dk, H * dv] + self.in_splits[1:]
        self.conv = nn.Conv1d(self.conv_channels, self.conv_channels, cfg.conv_size, groups=self.conv_channels,
                              bias=False)
        if decay:
            self.A_log = nn.Parameter(init_A_log(H))
            self.dt_bias = nn.Parameter(init_dt_bias(decay))
        self.o_norm = RMSNorm(dv, kernels_path=cfg.kernels)
        self.out_proj = nn.Linear(H * dv, cfg.n_embd, bias=cfg.bias)

    def log_decay(self, x):
        """g = −exp(A_log)·softplus(W_f x + dt_bias) ≤ 0 in fp32, shaped (B, T, H, dk) or (B, T, H, 1) for gdn;
        0 for deltanet. Before the spectral clip."""
        B, T, _ = x.shape
        if self.variant == "deltanet":
            return x.new_zeros(B, T, self.n_head, 1, dtype=torch.float32)
        W, bias = self.in_proj.weight[-self.in_splits[-1]:], None
        if self.in_proj.bias is not None:
            bias = self.in_proj.bias[-self.in_splits[-1]:]
        decay_logits = F.linear(x, W, bias).view(B, T, self.n_head, -1)
        return kernels.gdn_log_decay(decay_logits, self.A_log, self.dt_bias)

    def recurrence_inputs(self, x):
        """q, k, v, g, b, w exactly as the recurrence gets them (g after the clip), broadcast to
        [B,T,H,dk] (q, k, g, b) and [B,T,H,dv] (v, w)."""
        return self.project(self.in_proj(x))[0]

    def project(self, mixed, cache=None):
        """(q, k, v, g, b, w) as recurrence_inputs returns them, and the output gate's logits W_gate x, from in_proj's
        output."""
        B, T, _ = mixed.shape
        H, dk, dv = self.n_head, self.head_k, self.head_v
        qkv, gate, erase, write, decay = mixed.split(self.in_splits, dim=-1)
        qkv = F.silu(causal_conv(self.conv, qkv, cache))
        qk, v = qkv.split([2 * H * dk, H * dv], dim=-1)
        q, k = unit_norm(qk.view(B, T, 2 * H, dk)).split(H, dim=2)
        v = v.view(B, T, H, dv)
        if self.variant == "gdn2":  # g and b = σ(W_b x) in one fused op, with the clip
            log_decay, erase_gate = kernels.gdn2_gates(decay.view(B, T, H, dk), erase.view(B, T, H, dk), k,
                                                       self.A_log, self.dt_bias, clip=self.clip,
                                                       kernels=self.kernels_path)
            write_gate = torch.sigmoid(write).view(B, T, H, dv)
        else:
            if self.variant == "deltanet":
                log_decay = mixed.new_zeros(B, T, H, 1, dtype=torch.float32)
            else:
                log_decay = kernels.gdn_log_decay(decay.view(B, T, H, -1), self.A_log, self.dt_bias)
            beta = torch.sigmoid(erase).view(B, T, H, 1)
            log_decay = log_decay.expand(B, T, H, dk)
            erase_gate, write_gate = beta.expand(B, T, H, dk), beta.expand(B, T, H, dv)
        return (q, k, v, log_decay, erase_gate, write_gate), gate

    def mix(self, mixed, cache=None):
        """From in_proj's output to out_proj's input: the recurrence, then RMSNorm(o) ⊙ SiLU(W_gate x)."""
        B, T, _ = mixed.shape
        (q, k, v, log_decay, erase_gate, write_gate), gate = self.project(mixed, cache)
        o, state = kernels.gdn2(q, k, v, log_decay, erase_gate, write_gate, scale=self.head_k ** -0.5,
                                initial_state=None if cache is None else cache.get("state"),
                                chunk_size=self.chunk_size, kernels=self.kernels_path)
        if cache is not None:
            cache["state"] = state
        o = self.o_norm(o) * F.silu(gate).view(B, T, self.n_head, self.head_v)
        return o.reshape(B, T, self.n_head * self.head_v)

    def forward(self, x, rope, cache=None):
        mixed = self.in_proj(x)
        if torch.is_grad_enabled() and kernels.gdn2_uses_triton(x, self.kernels_path):
            # autograd keeps in_proj's output and the recurrence's: the convolution, the norms, the gates and the
            # output gating (element-wise work) are recomputed in the backward, whose Triton kernels rerun the
            # recurrence's chunks anyway. The CPU's torch path keeps them: there time binds, not memory
            y = checkpoint(self.mix, mixed, use_reentrant=False, context_fn=keep_only(*kernels.GDN2_TRITON_FORWARDS))
        else:
            y = self.mix(mixed, cache)
        return self.out_proj(y)

    def extra_flops_per_token(self, T):
        """The chunked algorithm (chunk c) per head and token, forward: the in-chunk pair weights of
        (b⊙k, k) and (q, k) 4·c·dk, the triangular solve ≈ c²/3, the solved right-hand sides 2·c·(dk+dv),
        the pair-weighted sum 2·c·dv, the three state products (Y S, Kᵀ U, Q S) 6·dk·dv; plus the short
        convolution, 2·K per channel of q, k, v. × 3 for backward."""
        c, dk, dv, K = min(self.chunk_size, T), self.head_k, self.head_v, self.conv.kernel_size[0]
        forward = self.n_head * (6 * c * dk + 4 * c * dv + c * c // 3 + 6 * dk * dv + 2 * K * (2 * dk + dv))
        return 3 * forward

    @staticmethod
    def n_params(cfg):
        """in_proj (q, k, v, gate, erase, write, decay rows), the convolution, A_log and dt_bias (with a decay),
        o_norm, out_proj."""
        d, H = cfg.n_embd, cfg.n_head
        dk = d // H
        dv = dk * cfg.gdn_expand_v
        erase, write, decay = gated_delta_rows(cfg)
        conv = H * (2 * dk + dv)
        rows = conv + H * dv + erase + write + decay
        return (d + cfg.bias) * rows + conv * cfg.conv_size + (H + decay if decay else 0) + dv + (H * dv + cfg.bias) * d

    @staticmethod
    def kept_per_token(cfg, act):
        """Bytes a token keeps for the backward on the Triton path (the weights apart): in_proj's input and output,
        the recurrence's output o and out_proj's input; the final state S_T in fp32 (per sequence, spread over its
        tokens). The convolution, norms and gates are recomputed in the backward (selective checkpointing), and so
        are the chunk states (the Triton backward reruns the state pass)."""
        d, H = cfg.n_embd, cfg.n_head
        dk = d // H
        dv = dk * cfg.gdn_expand_v
        rows = H * (2 * dk + dv) + H * dv + sum(gated_delta_rows(cfg))
        return act * (d + rows + 2 * H * dv) + 4 * H * dk * dv // cfg.block_size


class Mamba2(nn.Module):
    """Mamba2 (SSD, one group of B, C); per head a state h ∈ R^{P×N}:
        h_t = exp(dt_t A) h_{t−1} + dt_t x_t B_tᵀ,   y_t = h_t C_t + D x_t,   out = W_o RMSNorm(y ⊙ SiLU(z))
    with A = −exp(A_log), dt_t = softplus(W_dt x + dt_bias). mamba_discretization="zoh" replaces the
    input factor dt_t by the exact zero-order hold (exp(dt_t A) − 1)/A."""

    def __init__(self, cfg):
        super().__init__()
        self.d_inner = cfg.mamba_expand * cfg.n_embd
        if self.d_inner % cfg.mamba_headdim:
            raise ValueError(f"Mamba2's d_inner = mamba_expand*n_embd = {self.d_inner} is not divisible by "
                             f"mamba_headdim={cfg.mamba_headdim}: pick a headdim that divides it")
        self.headdim, self.d_state = cfg.mamba_headdim, cfg.mamba_d_state
        self.n_head = self.d_inner // self.headdim
        self.zoh = cfg.mamba_discretization == "zoh"
        self.chunk_size, self.kernels_path = cfg.chunk_size, cfg.kernels
        conv_channels = self.d_inner + 2 * self.d_state  # x, B and C go through the short convolution
        # one projection for z, (x, B, C) and the per-head dt, in that order (mamba_ssm's layout)
        self.in_proj = nn.Linear(cfg.n_embd, self.d_inner + conv_channels + self.n_head, bias=cfg.bias)
        self.conv = nn.Conv1d(conv_channels, conv_channels, cfg.conv_size, groups=conv_channels)
        self.A_log = nn.Parameter(init_A_log(self.n_head))
        self.dt_bias = nn.Parameter(init_dt_bias(self.n_head))
        self.D = nn.Parameter(torch.ones(self.n_head))
        self.norm = RMSNorm(self.d_inner, kernels_path=cfg.kernels)
        self.out_proj = nn.Linear(self.d_inner, cfg.n_embd, bias=cfg.bias)

    def forward(self, x, rope, cache=None):
        B, T, _ = x.shape
        H, P, N = self.n_head, self.headdim, self.d_state
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * N, H], dim=-1)
        xBC = conv_silu(self.conv, xBC, cache, "conv")
        xs, Bs, Cs = xBC.split([self.d_inner, N, N], dim=-1)
        xs = xs.reshape(B, T, H, P)
        dt = F.softplus(dt.float() + self.dt_bias)
        A = -self.A_log.float().exp()
        # zoh: ssd writes dt·x·Bᵀ, so feeding x·expm1(dt A)/(dt A) writes (exp(dt A) − 1)/A · x·Bᵀ
        x_in = (xs * kernels.zoh_input_scale(dt, A)[..., None]).to(xs.dtype) if self.zoh else xs
        y, state = kernels.ssd(x_in, dt, A, Bs.reshape(B, T, 1, N), Cs.reshape(B, T, 1, N),
                               chunk_size=self.chunk_size,
                               initial_state=None if cache is None else cache.get("state"), kernels=self.kernels_path)
        if cache is not None:
            cache["state"] = state
        y = torch.addcmul(y, self.D[:, None], xs).to(y.dtype)  # the skip reads the undiscretised x in both
        y = self.norm(y.reshape(B, T, self.d_inner), gate=z)
        return self.out_proj(y)

    def extra_flops_per_token(self, T):
        """The chunked SSD (chunk c) per token, forward: C Bᵀ in the chunk 2·c·N (shared by the heads), and
        per head the masked sum over the chunk 2·c·P, the chunk state and its read-out 4·P·N; plus the short
        convolution, 2·K per channel of x, B, C. × 3 for backward."""
        c, P, N, K = min(self.chunk_size, T), self.headdim, self.d_state, self.conv.kernel_size[0]
        return 3 * (2 * c * N + self.n_head * (2 * c * P + 4 * P * N) + 2 * K * self.conv.in_channels)

    @staticmethod
    def n_params(cfg):
        """in_proj (z, x, B, C, dt rows), the convolution with its bias, A_log, dt_bias, D, the norm, out_proj."""
        d, inner, N = cfg.n_embd, cfg.mamba_expand * cfg.n_embd, cfg.mamba_d_state
        heads, conv = inner // cfg.mamba_headdim, inner + 2 * N
        return (d + cfg.bias) * (inner + conv + heads) + conv * (cfg.conv_size + 1) + 3 * heads + inner + \
            (inner + cfg.bias) * d

    @staticmethod
    def kept_per_token(cfg, act):
        """Bytes a token keeps for the backward on the Triton path (the weights apart): in_proj's input and output
        (the convolution's input is a slice of it; the convolution is recomputed), the SiLU's output (x, B, C),
        y and the gated norm's output (the inner width each), dt in fp32 before and after the softplus, the norm's
        fp32 statistic. ssd keeps nothing but its inputs: its backward reruns the chunk states."""
        d, inner, N = cfg.n_embd, cfg.mamba_expand * cfg.n_embd, cfg.mamba_d_state
        heads, conv = inner // cfg.mamba_headdim, inner + 2 * N
        return act * (d + (inner + conv + heads) + conv + 2 * inner) + 8 * heads + 4


# The mixer kinds (GPTConfig.mixer's letters). A mixer is an nn.Module built as cls(cfg), with
#   forward(x, rope, cache=None) -> y      x, y (B, T, n_embd); causal: y_t depends on x_1 .. x_t only
#       rope   what GPT.rope_inputs gives for these positions (attention's rotations; other mixers ignore it)
#       cache  None in training. In generation a dict of the mixer's own that lives across calls: the first
#              call brings the prompt, every later call one new token, so keep in it whatever the next call
#              needs (keys and values, a recurrent state, a convolution's last inputs). GPT.generate checks
#              that each mixer writes to it.
#   extra_flops_per_token(T) (optional)    training FLOPs per token beyond 6 per matmul weight (MFU); else 0
#   n_params(cfg), kept_per_token(cfg, act) (optional, static)   closed forms of its parameter count and of the
#                                          bytes a token keeps for the backward, for train.py's dry run (without
#                                          them it names the figure missing and the closed-form tests skip the
#                                          kind); what a sequence keeps, e.g. an (H, T, T) matrix, is divided
#                                          by T = cfg.block_size: H·block_size·act bytes a token
#   context_limited = True (optional)      it sees at most block_size·rope_factor tokens (attention's RoPE
#                                          cache): longer inputs are refused, generation re-reads a window
# Three rules go by name and shape (init.py, optim.py), for every kind:
#   a Linear named out_proj writes into the residual stream: its init std is divided by sqrt(2·n_layer)
#   every 2-D parameter under blocks. (outside a residual module) trains with the matrix optimizer (Muon,
#   Mousse, ...): keep a per-head gain 1-D, (H,) not (H, 1), or Muon orthogonalises it
#   a Linear that fuses several projections sets .row_splits (their output sizes) so the spectral init
#   scales each part by its own shape
# and one by dtype: under autocast a mixer hands specgpt's ops (kernels.py) its activations in its projections'
# dtype, the autocast dtype (a cast to fp32 doubles the kernels' bytes); only OP_FP32_ARGS may stay fp32. GPT checks
# it when a kind is first built for the Triton path (check_mixer_dtypes).
MIXERS = {
    "A": Attention,    # attention
    "G": GatedDelta,   # gated delta rule
    "M": Mamba2,       # Mamba2
}
# the specgpt ops' arguments that may stay fp32 under autocast: parameters, positions' angles, the decays and steps
# whose exponents and cumulative sums need fp32 (dt, A, g), recurrent states
OP_FP32_ARGS = {"rms_norm_fwd": {"weight"}, "rope": {"cos", "sin"}, "ssd_fwd": {"dt", "A", "D", "initial_state"},
                "gdn2_gates_fwd": {"A_log", "dt_bias"}, "gdn2_recurrent_fwd": {"g", "initial_state"},
                "gdn2_chunked_fwd": {"g", "initial_state"}}
DTYPE_CHECKED = set()  # the mixer classes check_mixer_dtypes has passed in this process


class OpArguments(TorchDispatchMode):
    """Records (specgpt op name, {argument: dtype}) for every specgpt forward op dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func._schema.name.partition("::")
        if namespace == "specgpt" and not op.endswith("_bwd"):
            bound = {**dict(zip([a.name for a in func._schema.arguments], args)), **(kwargs or {})}
            self.calls.append((op, {k: v.dtype for k, v in bound.items()
                                    if torch.is_tensor(v) and v.is_floating_point()}))
        return func(*args, **(kwargs or {}))


def check_mixer_dtypes(letter, cfg):
    """The dtype rule above MIXERS for mixer `letter`, once a process for each class: its forward on fake tensors
    (any size is free) under the CPU's bf16 autocast (which casts as CUDA's does) on the Triton path, every floating
    argument of each specgpt forward op bf16 but OP_FP32_ARGS. Only for a model that may take the Triton path
    (kernels triton, or auto with CUDA), where the ops are specgpt's; skipped inside another dispatch mode (a fake or
    recording one), where the next build outside it checks."""
    cls = MIXERS[letter]
    triton_path = cfg.kernels == "triton" or (cfg.kernels == "auto" and torch.cuda.is_available())
    if cls in DTYPE_CHECKED or not (kernels.HAS_TRITON and triton_path) or is_in_torch_dispatch_mode():
        return
    T, head_dim = min(cfg.block_size, 64), cfg.n_embd // cfg.n_head
    record = OpArguments()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), FakeTensorMode(), torch.no_grad():
        mixer = cls(dataclasses.replace(cfg, kernels="triton", dropout=0.0))
        x = torch.randn(1, T, cfg.n_embd)
        rope = (rope_cache(T, head_dim, cfg.rope_base) if cfg.rope == "fixed"
                else torch.arange(T, dtype=torch.float32))
        with record, torch.autocast("cpu", dtype=torch.bfloat16):
            mixer(x, rope)
    for op, args in record.calls:
        for arg, dtype in args.items():
            if dtype != torch.bfloat16 and arg not in OP_FP32_ARGS.get(op, ()):
                raise ValueError(f"mixer {letter!r} hands specgpt::{op} its {arg} in {dtype} under bf16 autocast: a "
                                 f"mixer hands specgpt's ops its projections' dtype, the autocast dtype (the rule "
                                 f"above model.MIXERS)")
    DTYPE_CHECKED.add(cls)


def relu_squared(h):
    h = F.relu(h)
    return h * h  # a plain product backpropagates faster on the CPU than .square()


class MLPKind(NamedTuple):
    activation: object            # φ, elementwise
    gated: bool                   # W_out (φ(W_gate x) ⊙ W_in x) in place of W_out φ(W_in x)
    takes_kernels: bool = False   # φ(h, kernels=cfg.kernels): an op of kernels.py with a torch and a Triton path


# The MLP kinds (GPTConfig.mlp): name -> MLPKind. Plain: W_out φ(W_in x); gated: W_out (φ(W_gate x) ⊙ W_in x), whose
# third matrix is paid for with a hidden layer 2/3 as wide. The rule: a row with takes_kernels=True has an activation
# with a kernels= parameter (a kernels.py op), which gets --kernels; the others are called as φ(h).
MLPS = {
    "relu2": MLPKind(relu_squared, False),   # relu²
    "gelu": MLPKind(F.gelu, False),          # gelu
    "gelu_tanh": MLPKind(functools.partial(F.gelu, approximate="tanh"), False),  # GPT-2's gelu, tanh approximation
    "swiglu": MLPKind(F.silu, True),         # gated silu
}


def signature_parameters(fn):
    """fn's parameter names; none for a builtin that shows no signature (torch.tanh)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


class MLP(nn.Module):
    """W_out φ(W_in x), or gated W_out (φ(W_gate x) ⊙ W_in x), with φ and gated from MLPS[cfg.mlp]:
    relu2 φ = relu², gelu φ = gelu, swiglu (gated) φ = silu. Same parameter count either way."""

    def __init__(self, cfg):
        super().__init__()
        activation, gated, takes_kernels = MLPKind(*MLPS[cfg.mlp])
        if takes_kernels and "kernels" not in signature_parameters(activation):
            raise ValueError(f"mlp {cfg.mlp!r} declares takes_kernels but its activation has no kernels= parameter "
                             f"(the rule above model.MLPS): add it, or declare takes_kernels=False")
        self.activation = functools.partial(activation, kernels=cfg.kernels) if takes_kernels else activation
        hidden = MLP.hidden_size(cfg)
        self.in_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias) if gated else None
        self.out_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        h = self.in_proj(x)
        h = self.activation(h) if self.gate_proj is None else self.activation(self.gate_proj(x)) * h
        return self.out_proj(h)

    @staticmethod
    def hidden_size(cfg):
        """4 n_embd, or for a gated kind 8/3 n_embd rounded up to a multiple of 8 (the same parameter count)."""
        return 8 * ((8 * cfg.n_embd // 3 + 7) // 8) if MLPS[cfg.mlp][1] else 4 * cfg.n_embd

    @staticmethod
    def n_params(cfg):
        d, h, gated = cfg.n_embd, MLP.hidden_size(cfg), MLPS[cfg.mlp][1]
        return (1 + gated) * (d + cfg.bias) * h + (h + cfg.bias) * d

    @staticmethod
    def kept_per_token(cfg, act):
        """Bytes a token keeps for the backward: the input, and two (gated: four) tensors of the hidden width."""
        return act * (cfg.n_embd + (4 if MLPS[cfg.mlp][1] else 2) * MLP.hidden_size(cfg))


# -----------------------------------------------------------------------------
# Hyper-connections: n parallel residual streams X (B, T, n, C), one HyperConnection per sublayer.

HC_ALPHA_INIT = 0.01     # α_pre, α_post, α_res: the data-dependent part starts small (mHC paper)
HC_PRE_LOGIT = 2.0       # b_pre = +2 on stream (sublayer mod n), −2 elsewhere: H_pre ≈ (0.88, 0.12, …)
HC_POST_LOGIT = 0.5      # b_post = 0.5 on stream (sublayer mod n), 0 elsewhere: H_post = (1.25, 1, …)
HC_RES_DIAG = 0.95       # every constrained H_res starts with 0.95 on its diagonal (hc: exactly I)
HC_SINKHORN_ITERS = 20


def hc_permutations(n):
    """All n! permutation matrices (n!, n, n), the identity first: P_k[i, π_k(i)] = 1."""
    return torch.eye(n)[torch.tensor(list(itertools.permutations(range(n))))]


def hc_cycle_generators(n):
    """P_c − I for every cyclic permutation c of every subset of ≥ 2 streams: (m, n, n) with
    m = Σ_k C(n, k)(k − 1)! (1 for n = 2, 5 for n = 3, 20 for n = 4). P_c moves stream c_{j+1} into c_j."""
    generators = []
    for size in range(2, n + 1):
        for subset in itertools.combinations(range(n), size):
            for rest in itertools.permutations(subset[1:]):  # fixing the first element: each cycle once
                cycle = (subset[0],) + rest
                P = torch.eye(n)
                for a, b in zip(cycle, cycle[1:] + cycle[:1]):
                    P[a, a], P[a, b] = 0.0, 1.0
                generators.append(P - torch.eye(n))
    return torch.stack(generators) if generators else torch.zeros(0, n, n)


def hc_helmert_basis(n):
    """U_Z (n, n−1): an orthonormal basis of 1⊥; column k is (1, …, 1, −k, 0, …)/sqrt(k(k+1)) with k ones."""
    U = torch.zeros(n, n - 1)
    for k in range(1, n):
        U[:k, k - 1] = 1.0
        U[k, k - 1] = -float(k)
        U[:, k - 1] /= math.sqrt(k * (k + 1))
    return U


def hc_skew_basis(k):
    """E (k(k−1)/2, k·k): E_ij − E_ji for i < j, flattened, so that params @ E is a skew-symmetric k×k map."""
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    E = torch.zeros(len(pairs), k, k)
    for p, (i, j) in enumerate(pairs):
        E[p, i, j], E[p, j, i] = 1.0, -1.0
    return E.flatten(1)


def hc_num_res(kind, n):
    """How many per-token numbers parameterise H_res for each residual kind."""
    if kind == "markov":  # Σ_{k≥2} C(n, k)(k − 1)! cycles
        return sum(math.comb(n, k) * math.factorial(k - 1) for k in range(2, n + 1))
    sizes = {"hc": n * n, "mhc": n * n, "mhc-lite": math.factorial(n), "kromhc": n.bit_length() - 1,
             "shc": (n - 1) ** 2}
    if kind not in sizes:
        raise ValueError(f"residual={kind!r} has no H_res size: add it in hc_num_res")
    return sizes[kind]


def hc_res_init(kind, n):
    """b_res: H_res = I (hc) or diag(H_res) = HC_RES_DIAG = w with the rest spread evenly (every other kind)."""
    w = HC_RES_DIAG
    t = (w - 1 / n) / (1 - 1 / n) if n > 1 else 0.0  # H_res = J + t(I − J) has diagonal w (n = 1: unused)
    if kind == "hc":
        return torch.eye(n).flatten()
    if kind == "mhc":  # Sinkhorn(exp(d·I)) = (e^d I + (11ᵀ − I)) / (e^d + n − 1)
        return math.log(w * (n - 1) / (1 - w)) * torch.eye(n).flatten() if n > 1 else torch.zeros(1)
    if kind == "mhc-lite":  # weight a on the identity, q on each other permutation:
        # H_res[i, j≠i] = (n−1)!·q, so q = (1 − w)/((n−1)·(n−1)!) gives diagonal w; a = 1 − (n! − 1)q
        if n == 1:
            return torch.zeros(1)
        q = (1 - w) / ((n - 1) * math.factorial(n - 1))
        logits = torch.full((math.factorial(n),), math.log(q / (1 - (math.factorial(n) - 1) * q)))
        logits[0] = 0.0
        return logits
    if kind == "kromhc":  # m factors with p = w^(1/m): diagonal Π p = w
        m = n.bit_length() - 1
        return torch.full((m,), math.log(w ** (1 / m) / (1 - w ** (1 / m)))) if m else torch.zeros(0)
    if kind == "shc":  # U_c = V_c = I (zero skew maps), tanh(s) = t on every singular value
        k = n - 1
        return torch.cat([torch.zeros(k * (k - 1)), torch.full((k,), math.atanh(t))])
    if kind == "markov":  # Σ_c (P_c − I) = −c_n (I − J),
        # so equal rates r give H_res = J + exp(−r c_n)(I − J)
        with torch.device("cpu"):  # a count read with .item(): on the CPU, even when the model is built on meta
            generators = hc_cycle_generators(n)
        if len(generators) == 0:
            return torch.zeros(0)
        c_n = -generators.sum(0)[0, 0].item() * n / (n - 1)
        rate = -math.log(t) / c_n
        return torch.full((len(generators),), math.log(math.expm1(rate)))  # softplus⁻¹(rate)
    raise ValueError(f"residual={kind!r} has no H_res init: add it in hc_res_init")


def hc_read(X, weight, alpha, bias, eps):
    """The read side of a HyperConnection in plain autograd ops (HCRead's double backward): (x_in, p)."""
    n = X.shape[-2]
    x = X.flatten(-2)
    proj = F.linear(x, weight) * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True) ** 2 / x.shape[-1] + eps)
    H_pre = torch.sigmoid(proj[..., :n] * alpha[0] + bias[:n])
    return (H_pre.unsqueeze(-2) @ X).squeeze(-2), proj


class HCRead(torch.autograd.Function):
    """hc_read as one autograd node, for X (…, n, C), φ (K, nC), α (3), b (K):
        p = x̃ φᵀ (x̃ = x·r, x = flatten(X), r = 1/sqrt(mean(x²) + ε)),
        H_pre = σ(α_pre p_pre + b_pre),  x_in = H_pre X
    returns (x_in, p); H_post and H_res are built from p outside. Backward, ∂p being the gradient from outside:
        ∂H̃_pre = (X ∂x_in)·H_pre(1 − H_pre),  ∂p_pre += α_pre ∂H̃_pre,  g = ∂p·r,  ∂φ = gᵀx,
        ∂X = H_preᵀ ∂x_in + g φ − x·(r²/nC)·Σ_k ∂p_k p_k,
        ∂α_pre = Σ ∂H̃_pre p_pre,  ∂b_pre = Σ ∂H̃_pre.
    One node writes the three terms of ∂X into one buffer: on the CPU each pass over the n-times-wider
    stream state costs about what an op of the sublayer does, and autograd would add three tensors."""

    @staticmethod
    def forward(ctx, X, weight, alpha, bias, eps):
        n, C = X.shape[-2:]
        x = X.reshape(-1, n * C)
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_() / (n * C) + eps)
        proj = F.linear(x, weight).mul_(r)
        H_pre = torch.sigmoid(proj[:, :n] * alpha[0] + bias[:n])
        x_in = torch.bmm(H_pre.unsqueeze(1), x.view(-1, n, C))  # (1×n)(n×C) per token: CPU bmm is fast at M = 1
        ctx.save_for_backward(X, weight, alpha, bias, r, proj, H_pre)
        ctx.eps = eps
        return x_in.view(X.shape[:-2] + (C,)), proj.view(X.shape[:-2] + (-1,))

    @staticmethod
    def backward(ctx, dx_in, dproj):
        X, weight, alpha, bias, r, proj, H_pre = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (Hessian-vector products): differentiate the plain formula
            with torch.enable_grad():  # (its inputs are independent, so each gradient is the partial one)
                x_in, proj = hc_read(X, weight, alpha, bias, ctx.eps)
            grads = torch.autograd.grad((x_in, proj), (X, weight, alpha, bias), (dx_in, dproj), create_graph=True)
            return (*grads, None)
        n, C = X.shape[-2:]
        x = X.reshape(-1, n * C)
        with kernels.autocast_off(X.device.type):
            dx_in, dproj = dx_in.reshape(-1, 1, C), dproj.reshape(proj.shape).clone()
            dH_pre = torch.bmm(dx_in, x.view(-1, n, C).transpose(1, 2)).squeeze(1)
            dlogit_pre = dH_pre.mul_(H_pre * (1 - H_pre))
            dproj[:, :n] += alpha[0] * dlogit_pre
            g = dproj * r
            scale = (dproj * proj).sum(-1, keepdim=True).mul_(r.square()).div_(-n * C)
            dX = X.new_empty(X.shape)  # not a view, so that autograd can add the write's ∂X into it in place
            torch.mul(x, scale, out=dX.view(-1, n * C)).addmm_(g, weight)
            dX.view(-1, n, C).addcmul_(H_pre.unsqueeze(-1), dx_in)
            dalpha, dbias = torch.zeros_like(alpha), torch.zeros_like(bias)
            dalpha[0] = (dlogit_pre * proj[:, :n]).sum()
            dbias[:n] = dlogit_pre.sum(0)
        return dX, g.T @ x, dalpha, dbias, None


class HCWrite(torch.autograd.Function):
    """The write side of a HyperConnection as one autograd node: X_new = H_res X + H_postᵀ y per token, for
    X (…, n, C), H_res (…, n, n), H_post (…, n), y (…, C); backward: ∂X = H_resᵀ ∂X_new,
    ∂H_res = ∂X_new Xᵀ, ∂H_post = ∂X_new y, ∂y = H_post ∂X_new. H_res must be contiguous: CPU bmm copies a
    strided batch operand matrix by matrix."""

    @staticmethod
    def forward(ctx, X, H_res, H_post, y):
        n, C = X.shape[-2:]
        ctx.save_for_backward(X, H_res, H_post, y)
        X_new = X.new_empty(X.shape)
        torch.bmm(H_res.view(-1, n, n), X.reshape(-1, n, C), out=X_new.view(-1, n, C))
        return X_new.addcmul_(H_post.unsqueeze(-1), y.unsqueeze(-2))

    @staticmethod
    def backward(ctx, dX_new):
        X, H_res, H_post, y = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the same formulas in differentiable ops (H_res, H_post and
            # y depend on X, so differentiating a recomputed X_new would add their paths to ∂X)
            return (H_res.transpose(-1, -2) @ dX_new, dX_new @ X.transpose(-1, -2),
                    (dX_new * y.unsqueeze(-2)).sum(-1), (H_post.unsqueeze(-1) * dX_new).sum(-2))
        n, C = X.shape[-2:]
        with kernels.autocast_off(X.device.type):
            dX3 = dX_new.reshape(-1, n, C)
            dX = X.new_empty(X.shape)  # not a view, so that autograd can add the read's ∂X into it in place
            torch.bmm(H_res.view(-1, n, n).transpose(1, 2), dX3, out=dX.view(-1, n, C))
            dH_res = torch.bmm(dX3, X.reshape(-1, n, C).transpose(1, 2)).view(H_res.shape)
            dH_post = torch.bmm(y.reshape(-1, 1, C), dX3.transpose(1, 2)).view(H_post.shape)
            dy = torch.bmm(H_post.reshape(-1, 1, n), dX3).view(y.shape)
        return dX, dH_res, dH_post, dy


class HyperConnection(nn.Module):
    """One sublayer F on n streams X (B, T, n, C):   X ← H_res X + H_postᵀ F(H_pre X)

    per token, from x̃ = RMSNorm(flatten(X)) (length nC), with one fused map φ and scalars α:
        H̃ = α·(x̃ φ) + b,   H_pre = σ(H̃_pre),   H_post = 2σ(H̃_post)   (1×n each)
        hc        H_res = b_res + α_res·tanh(x̃ φ_res)                             (unconstrained)
        mhc       H_res = Sinkhorn(exp(H̃_res)), 20 row/column normalisations    (≈ doubly stochastic)
        mhc-lite  H_res = Σ_k softmax(H̃_res)_k P_k over all n! permutations      (doubly stochastic)
        kromhc    H_res = ⊗_i [[p_i, 1−p_i], [1−p_i, p_i]], p = σ(H̃_res), n = 2^m   (doubly stochastic)
        shc       H_res = J + U_Z U_c diag(tanh s) V_cᵀ U_Zᵀ,
                  U_c, V_c = expm(skew)                                            (rows, cols sum 1, ‖·‖₂ = 1)
        markov    H_res = expm(Σ_c softplus(θ_c)(P_c − I)) over cyclic permutations (doubly stochastic)
    Every kind, hc included, squashes H_pre into (0, 1)ⁿ and H_post into (0, 2)ⁿ with σ and 2σ, as mHC does
    (arXiv 2512.24880); the original HC (Zhu et al. 2024, arXiv 2409.19606) leaves its read and write weights
    free, static weights + α·tanh(x̃ φ). The choice is deliberate: so hc differs from the other kinds in
    H_res alone. The coefficients and the mixing run in fp32 with autocast off; F runs under the caller's autocast.
    forward reads and writes X in two autograd nodes with hand-written backwards (HCRead, HCWrite);
    mixing_matrices computes the same H's in plain ops, for analysis and tests.
    Init (close to the pre-norm residual x + F(norm(x)), with the streams told apart):
      φ = 0, α = 0.01: the module starts static; b_res from hc_res_init (hc: I; others: diagonal 0.95);
      b_pre = ±HC_PRE_LOGIT: H_pre ≈ one-hot on stream s = sublayer mod n (F's RMSNorm removes Σ H_pre);
      b_post = HC_POST_LOGIT on stream s, 0 elsewhere: H_post = 1.25 on s, 1 elsewhere. With H_post = 1
      everywhere the repeated embedding would stay n identical streams, and since H_res X only sees the
      row sums of H_res on identical streams, a constrained H_res would get exactly zero gradient."""

    def __init__(self, cfg, sublayer):
        super().__init__()
        kind, n = cfg.residual, cfg.hc_streams
        if n < 1:
            raise ValueError(f"hc_streams={n} is not valid: use at least 1 stream (the default is 4)")
        if kind in ("mhc-lite", "markov") and n > 6:
            raise ValueError(f"residual={kind} enumerates permutations and needs hc_streams <= 6 (got {n}); "
                             f"use kromhc, shc or mhc for more streams")
        if kind == "kromhc" and n & (n - 1):
            raise ValueError(f"residual=kromhc needs hc_streams to be a power of two (got {n}): use 1, 2, 4 or 8")
        self.kind, self.n, self.kernels_path = kind, n, cfg.kernels
        n_res = hc_num_res(kind, n)
        self.phi = nn.Linear(n * cfg.n_embd, 2 * n + n_res, bias=False)
        nn.init.zeros_(self.phi.weight)
        self.alpha = nn.Parameter(torch.full((3,), HC_ALPHA_INIT))  # α_pre, α_post, α_res
        b_pre = torch.full((n,), -HC_PRE_LOGIT)
        b_pre[sublayer % n] = HC_PRE_LOGIT
        b_post = torch.zeros(n)
        b_post[sublayer % n] = HC_POST_LOGIT
        self.bias = nn.Parameter(torch.cat([b_pre, b_post, hc_res_init(kind, n)]))
        groups = torch.tensor([0] * n + [1] * n + [2] * n_res)  # which α scales each column of x̃ φ
        self.register_buffer("alpha_map", F.one_hot(groups, 3).T.float(), persistent=False)
        if kind == "mhc-lite":
            self.register_buffer("permutations", hc_permutations(n).flatten(1), persistent=False)
        if kind == "markov":
            self.register_buffer("generators", hc_cycle_generators(n).flatten(1), persistent=False)
        if kind == "shc":
            self.register_buffer("U_Z", hc_helmert_basis(n), persistent=False)
            self.register_buffer("skew_basis", hc_skew_basis(n - 1), persistent=False)

    def coefficients(self, X):
        """H̃ = α·(x̃ φ) + b for stream state X (…, n, C), split into pre (…, n), post (…, n),
        res (…, n_res)."""
        x = X.flatten(-2).float()
        return self.logits(self.phi(x) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))

    def logits(self, proj):
        """H̃ = α·p + b from p = x̃ φ (hc: tanh on the res part), split into pre, post, res."""
        n = self.n
        if self.kind == "hc":  # HC keeps tanh on the dynamic part of H_res
            proj = torch.cat([proj[..., :2 * n], torch.tanh(proj[..., 2 * n:])], dim=-1)
        H = proj * (self.alpha @ self.alpha_map) + self.bias  # a product, not an index: CPU index backward is slow
        return H[..., :n], H[..., n:2 * n], H[..., 2 * n:]

    def res_matrix(self, res):
        """H_res (…, n, n) from its per-token parameters res (…, n_res), by residual kind."""
        n, lead = self.n, res.shape[:-1]
        if self.kind == "hc":
            return res.unflatten(-1, (n, n))
        if self.kind == "mhc":
            return kernels.sinkhorn(res.unflatten(-1, (n, n)), iters=HC_SINKHORN_ITERS, kernels=self.kernels_path)
        if self.kind == "mhc-lite":
            return (res.softmax(-1) @ self.permutations).unflatten(-1, (n, n))
        if self.kind == "kromhc":
            H = res.new_ones(*lead, 1, 1)
            for i in range(res.size(-1)):
                p = torch.sigmoid(res[..., i, None, None])
                U = torch.cat([torch.cat([p, 1 - p], -1), torch.cat([1 - p, p], -1)], -2)  # [[p, 1−p], [1−p, p]]
                H = (H[..., :, None, :, None] * U[..., None, :, None, :]).flatten(-4, -3).flatten(-2, -1)
            return H
        if self.kind == "shc":
            k = n - 1
            skew, s = res[..., :k * (k - 1)], res[..., k * (k - 1):]
            skew = (skew.reshape(*lead, 2, k * (k - 1) // 2) @ self.skew_basis).reshape(*lead, 2, k, k)
            rotations = torch.linalg.matrix_exp(skew.double())  # fp64: ‖H_res‖₂ = 1 to ~1e-7, cheap at n×n
            U_c, V_c = rotations[..., 0, :, :], rotations[..., 1, :, :]
            core = (U_c * torch.tanh(s).unsqueeze(-2)) @ V_c.transpose(-1, -2)  # U_c diag(tanh s) V_cᵀ
            return (1.0 / n + self.U_Z.double() @ core @ self.U_Z.T.double()).float()
        if self.kind == "markov":
            Q = (F.softplus(res).double() @ self.generators.double()).unflatten(-1, (n, n))  # fp64: exact sums
            return torch.linalg.matrix_exp(Q).float()
        raise ValueError(f"residual={self.kind!r} has no H_res: add it in HyperConnection.res_matrix")

    def mixing_matrices(self, X):
        """(H_pre (…, n), H_post (…, n), H_res (…, n, n)) in fp32 for stream state X (…, n, C)."""
        with kernels.autocast_off(X.device.type):
            pre, post, res = self.coefficients(X)
            return torch.sigmoid(pre), 2 * torch.sigmoid(post), self.res_matrix(res)

    @staticmethod
    def n_params(cfg):
        """φ (n·n_embd by 2n + n_res), α (3) and b (2n + n_res)."""
        n = cfg.hc_streams
        return (n * cfg.n_embd + 1) * (2 * n + hc_num_res(cfg.residual, n)) + 3

    @staticmethod
    def kept_per_token(cfg, act):
        """Bytes a token keeps for the backward, in fp32: the stream state X (n of width n_embd) and F's output."""
        return 4 * (cfg.hc_streams + 1) * cfg.n_embd

    @staticmethod
    def enter(x, cfg):
        """The stream state at the embeddings x (B, T, C): n identical copies, (B, T, n, C)."""
        return x.unsqueeze(2).expand(*x.shape[:2], cfg.hc_streams, x.size(-1)).contiguous()

    @staticmethod
    def leave(X):
        """The streams' mean (B, T, C), which the final norm reads."""
        return X.mean(dim=2)

    def forward(self, X, f):
        """The same H_pre, H_post, H_res as mixing_matrices, with the reads and writes of X in two nodes."""
        with kernels.autocast_off(X.device.type):
            x_in, proj = HCRead.apply(X.float(), self.phi.weight, self.alpha, self.bias, 1e-6)
        y = f(x_in.to(X.dtype))
        with kernels.autocast_off(X.device.type):
            _, post, res = self.logits(proj)
            H_res = self.res_matrix(res).contiguous()
            return HCWrite.apply(X.float(), H_res, 2 * torch.sigmoid(post), y.float()).to(X.dtype)


class Residual(nn.Module):
    """res, the plain pre-norm residual: x ← x + F(x), where F norms its own input."""

    def __init__(self, cfg, sublayer):
        super().__init__()

    def forward(self, x, f):
        return x + f(x)

    @staticmethod
    def n_params(cfg):
        return 0

    @staticmethod
    def kept_per_token(cfg, act):
        return 0


# The residual kinds (GPTConfig.residual). A residual kind is an nn.Module built as cls(cfg, sublayer) for every
# sublayer (2·layer for the mixer, 2·layer + 1 for the MLP), with
#   forward(x, f) -> the stream after the sublayer; f(h) = F(norm(h)) maps h (…, n_embd) to (…, n_embd)
#   enter(x, cfg) (optional, static)   the stream state from the embeddings x (B, T, n_embd); else x itself
#   leave(x) (optional, static)        (B, T, n_embd) from the stream state, for the final norm; else x itself
#   n_params(cfg), kept_per_token(cfg, act) (optional, static)   closed forms for the dry run, as for a mixer
# Its parameters go to AdamW (optim.is_block_matrix) and keep their own init (init.py skips "_residual" modules).
# The hyper-connection kinds share one module; each one's H_res is in hc_num_res, hc_res_init and res_matrix.
RESIDUALS = {
    "res": Residual,                   # plain x + F(x)
    "hc": HyperConnection,             # hyper-connections, H_res free
    "mhc": HyperConnection,            # H_res by Sinkhorn
    "mhc-lite": HyperConnection,       # H_res a mix of permutations
    "kromhc": HyperConnection,         # H_res a Kronecker product
    "shc": HyperConnection,            # H_res spectral, norm 1
    "markov": HyperConnection,         # H_res a Markov generator's exp
}


class Block(nn.Module):
    """x ← R(x, mixer ∘ norm1), then x ← R(x, mlp ∘ norm2), R the residual kind: x + F(x) for res, the
    stream update X ← H_res X + H_postᵀ F(H_pre X) for the hyper-connections."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.norm1 = NORMS[cfg.norm](cfg, cfg.n_embd)
        self.mixer = MIXERS[cfg.mixer[layer % len(cfg.mixer)]](cfg)
        self.norm2 = NORMS[cfg.norm](cfg, cfg.n_embd)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.mixer_residual = RESIDUALS[cfg.residual](cfg, 2 * layer)
        self.mlp_residual = RESIDUALS[cfg.residual](cfg, 2 * layer + 1)

    def forward(self, x, rope, cache=None):
        x = self.mixer_residual(x, lambda h: self.dropout(self.mixer(self.norm1(h), rope, cache)))
        return self.mlp_residual(x, lambda h: self.dropout(self.mlp(self.norm2(h))))


class GPT(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if POSITIONS[cfg.pos].table else None
        self.drop = nn.Dropout(cfg.dropout)
        for letter in dict.fromkeys(cfg.mixer):
            check_mixer_dtypes(letter, cfg)
        self.blocks = nn.ModuleList([Block(cfg, layer) for layer in range(cfg.n_layer)])
        self.norm_f = NORMS[cfg.norm](cfg, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.residual = RESIDUALS[cfg.residual]
        self.context_limited = self.wpe is not None or any(getattr(MIXERS[letter], "context_limited", False)
                                                           for letter in cfg.mixer)
        self.max_len = int(cfg.block_size * cfg.rope_factor)  # the limit of context_limited mixers
        cos, sin = rope_cache(self.max_len, cfg.n_embd // cfg.n_head, cfg.rope_base, scaling=cfg.rope_scaling,
                              factor=cfg.rope_factor, train_length=cfg.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self, cfg.init)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) → logits (B, T, V) and the mean cross-entropy against targets (or None).
        cache: None when training; for generation a dict {"pos": int, "layers": [dict per block]}
        that each mixer reads and extends in place (keys/values for A, recurrent state for G and M)."""
        B, T = idx.shape
        pos = 0 if cache is None else cache["pos"]
        if pos + T > self.max_len and self.context_limited:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size·rope_factor={self.max_len}: crop the "
                             f"input, train with a larger --block_size or extend it with --rope_factor")
        rope = self.rope_inputs(pos, T)
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(pos, pos + T, device=idx.device))
        x = self.drop(x)
        if hasattr(self.residual, "enter"):  # e.g. the n streams of a hyper-connection
            x = self.residual.enter(x, self.config)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, None if cache is None else cache["layers"][i])
        if hasattr(self.residual, "leave"):
            x = self.residual.leave(x)
        if cache is not None:
            cache["pos"] = pos + T
        logits = self.lm_head(self.norm_f(x))
        loss = None
        if targets is not None:
            # a target of -100 (torch's default ignore_index) is skipped: the recall tasks' non-answers
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    def rope_inputs(self, pos, T):
        """What the attention layers get for positions pos .. pos+T−1: the cached (cos, sin) rows for fixed
        frequencies, else the positions themselves (each layer turns them into angles with its own θ)."""
        if self.config.rope == "fixed":
            return self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        return torch.arange(pos, pos + T, dtype=torch.float32, device=self.rope_cos.device)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens continuations of idx (B, T). Each step feeds only the newest token: each
        mixer keeps what it needs in its cache (keys and values, a recurrent state). When a context_limited
        model reaches block_size·rope_factor tokens, the cache is rebuilt from the last half of that many."""
        cache, next_input = None, idx
        for _ in range(max_new_tokens):
            fresh = cache is None or (self.context_limited and cache["pos"] + 1 > self.max_len)
            if fresh:
                window = self.max_len if cache is None else self.max_len // 2
                cache = {"pos": 0, "layers": [{} for _ in self.blocks]}
                next_input = idx[:, -window:] if self.context_limited else idx
            logits, _ = self(next_input, cache=cache)
            for block, layer_cache in zip(self.blocks, cache["layers"] if fresh else ()):
                if not layer_cache:  # the next calls bring one token each: a mixer that kept nothing would forget
                    raise ValueError(f"mixer {type(block.mixer).__name__} keeps nothing in its generation cache, so "
                                     f"sampling would forget the prompt: store what the next call needs in "
                                     f"forward's cache (the protocol above model.MIXERS)")
            logits = logits[:, -1, :self.config.vocab_size].float() / max(temperature, 1e-6)  # no padding rows
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
            next_input = next_token
        return idx

    @classmethod
    def from_pretrained(cls, source, **keys):
        """GPT-2 with its weights (nanoGPT's from_pretrained): source is a name of GPT2_SIZES, or a folder saved by
        transformers or runs.export_checkpoint; keys are model keys of PRETRAINED_CHANGEABLE (e.g. dropout)."""
        return load_pretrained_weights(cls(GPTConfig(**merged_pretrained_keys(source, keys))), source)

    def num_params(self):
        """Number of parameters (the tied embedding/head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, T=None):
        """Training FLOPs per token (forward + backward): 6 per weight of every matmul (the lm_head
        included, the embedding lookup not) plus each mixer's sequence-length-dependent work."""
        T = T or self.config.block_size
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        extra = sum(getattr(b.mixer, "extra_flops_per_token", lambda T: 0)(T) for b in self.blocks)
        return 6 * matmul_weights + extra


# -----------------------------------------------------------------------------
# closed forms of a configuration's size, from each kind's n_params and kept_per_token (train.py's dry run)

def kinds_without(cfg, closed_form):
    """The kinds cfg builds ("mixer 'G'", "residual 'mhc'") that lack the optional closed form named (n_params or
    kept_per_token): the dry run names them where its figure is missing, and the tests that check the forms skip."""
    letters = dict.fromkeys(cfg.mixer[i % len(cfg.mixer)] for i in range(cfg.n_layer))
    kinds = {**{f"mixer {letter!r}": MIXERS[letter] for letter in letters},
             f"residual {cfg.residual!r}": RESIDUALS[cfg.residual]}
    return [name for name, kind in kinds.items() if not hasattr(kind, closed_form)]


def param_formula(cfg):
    """{part: parameters} by closed form, from each kind's n_params; None for a part whose kind has none."""
    d, L = cfg.n_embd, cfg.n_layer
    mixers = [getattr(MIXERS[cfg.mixer[i % len(cfg.mixer)]], "n_params", None) for i in range(L)]
    residual = getattr(RESIDUALS[cfg.residual], "n_params", None)
    return {"embedding": cfg.padded_vocab_size * d * (1 if cfg.tie_embeddings else 2)
            + POSITIONS[cfg.pos].table * cfg.block_size * d,
            "mixers": None if None in mixers else sum(count(cfg) for count in mixers),
            "MLPs": L * MLP.n_params(cfg), "norms": (2 * L + 1) * d * (1 + (cfg.norm == "layernorm" and cfg.bias)),
            "residuals": None if residual is None else 2 * L * residual(cfg)}


def activation_formula(cfg, batch_size, act):
    """Bytes one micro-batch of batch_size x block_size keeps for the backward on the Triton path, by closed form
    (each kind's kept_per_token; None where a kind has none), act bytes an activation: per layer the fp32 inputs
    of its two norms, its mixer's, MLP's and two residual modules' share; then the final norm's fp32 input, the
    head's input and the loss's fp32 log-softmax. The weights' bf16 copies are not counted here."""
    if kinds_without(cfg, "kept_per_token"):
        return None
    d, L = cfg.n_embd, cfg.n_layer
    mixers = [MIXERS[cfg.mixer[i % len(cfg.mixer)]] for i in range(L)]
    per_layer = 2 * 4 * d + MLP.kept_per_token(cfg, act) + 2 * RESIDUALS[cfg.residual].kept_per_token(cfg, act)
    per_token = sum(kind.kept_per_token(cfg, act) for kind in mixers) + L * per_layer + \
        (4 + act) * d + 4 * cfg.padded_vocab_size
    return batch_size * cfg.block_size * per_token



# -----------------------------------------------------------------------------
# GPT-2's weights in (nanoGPT's from_pretrained: OpenAI's GPT-2 as Hugging Face hosts it, or a folder saved by
# transformers or by runs.export_checkpoint) and out (transformers' GPT-2 layout). The files are safetensors, read
# through huggingface_hub and safetensors: transformers itself is not needed.

# GPT-2 in model keys: what every size shares, then each size's depth, heads and width (Radford et al. 2019)
GPT2_ARCHITECTURE = {"pos": "learned", "norm": "layernorm", "mlp": "gelu_tanh", "bias": True, "qk_norm": False,
                     "mixer": "A", "residual": "res", "tie_embeddings": True, "vocab_multiple": 1}
GPT2_SIZES = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768},         # 124M
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},  # 350M
    "gpt2-large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},   # 774M
    "gpt2-xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},      # 1558M
}
GPT2_HUB = "openai-community"  # the hub's owner of the four GPT-2 repositories
# model keys that may differ from a pretrained model's: they change how the same weights compute, or (block_size, no
# larger than the model's) how many learned positions are kept; every other key given must equal the model's
PRETRAINED_CHANGEABLE = ("block_size", "dropout", "kernels", "attention", "chunk_size", "gdn_chunk_size", "init")
# transformers' GPT-2 activations in MLPS' names (gelu_new and gelu_pytorch_tanh compute the same tanh form)
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def hf_gpt2_keys(hf, where):
    """GPTConfig keys of a transformers GPT-2 config.json (a dict); a config whose model is not GPT-2's math (another
    model_type, activation, epsilon or attention scaling) is one line naming the field."""
    rules = [("model_type", "gpt2"), ("layer_norm_epsilon", 1e-5), ("scale_attn_weights", True),
             ("scale_attn_by_inverse_layer_idx", False), ("n_inner", None)]
    for field, expected in rules:
        if hf.get(field, expected) != expected and not (field == "n_inner" and hf[field] == 4 * hf.get("n_embd")):
            raise ValueError(f"{where} has {field}={hf[field]!r}: specgpt's GPT-2 needs {expected!r} (transformers' "
                             f"GPT-2 defaults); load another GPT-2")
    if hf.get("activation_function", "gelu_new") not in HF_ACTIVATIONS:
        raise ValueError(f"{where} has activation_function={hf['activation_function']!r}, which no row of model.MLPS "
                         f"computes: use one of {', '.join(HF_ACTIVATIONS)}")
    return {**GPT2_ARCHITECTURE, "vocab_size": hf["vocab_size"], "block_size": hf["n_positions"],
            "n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_embd": hf["n_embd"],
            "mlp": HF_ACTIVATIONS[hf.get("activation_function", "gelu_new")],
            "tie_embeddings": hf.get("tie_word_embeddings", True)}


def pretrained_config(source):
    """GPTConfig keys (vocab_size included) of a pretrained model: a name of GPT2_SIZES (no download: GPT-2's sizes
    are known), or a folder with config.json (specgpt's export: its "specgpt" keys; else transformers' GPT-2)."""
    if source in GPT2_SIZES:
        return {**GPT2_ARCHITECTURE, **GPT2_SIZES[source], "vocab_size": 50257, "block_size": 1024}
    saved = saved_config(source)
    return saved["specgpt"] if "specgpt" in saved else hf_gpt2_keys(saved, os.path.join(source, "config.json"))


def saved_config(source):
    """The dict in folder source's config.json, or one line saying what source lacks."""
    if not os.path.isdir(source):
        raise ValueError(f"--init_from={source!r} is neither a model ({', '.join(GPT2_SIZES)}) nor a folder: use "
                         f"scratch, resume, one of those names, or a folder saved by transformers or --export")
    path = os.path.join(source, "config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is missing or not JSON ({type(e).__name__}): point --init_from at a folder saved "
                         f"by transformers' save_pretrained or by python train.py --export") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no config (a JSON object): point --init_from at a folder saved by "
                         f"transformers' save_pretrained or by python train.py --export")
    return saved


def merged_pretrained_keys(source, given):
    """The model keys of a run that starts from source: the model's, with the keys of PRETRAINED_CHANGEABLE given
    (block_size at most the model's); another key given that contradicts the model's is one line."""
    keys = pretrained_config(source)
    for key, value in given.items():
        if key not in keys and key not in PRETRAINED_CHANGEABLE or keys.get(key, value) == value:
            continue
        if key not in PRETRAINED_CHANGEABLE or (key == "block_size" and value > keys[key]):
            raise ValueError(f"--{key}={value!r} contradicts --init_from={source!r}, whose {key} is {keys[key]!r}: "
                             f"drop --{key}" + (f" (its {key} may only shrink)" if key == "block_size" else ""))
    return {**keys, **{key: value for key, value in given.items() if key in PRETRAINED_CHANGEABLE}}


def pretrained_files(source):
    """The safetensors files of source: a name of GPT2_SIZES through huggingface_hub (cached after the first
    download), or a folder's model.safetensors (or the shards its model.safetensors.index.json lists)."""
    if source in GPT2_SIZES:
        from huggingface_hub import hf_hub_download
        try:
            return [hf_hub_download(f"{GPT2_HUB}/{source}", "model.safetensors")]
        except Exception as e:  # offline, or the hub unreachable: how to bring the file here
            raise ValueError(f"could not download {GPT2_HUB}/{source}'s model.safetensors ({type(e).__name__}): on a "
                             f"machine online, `hf download {GPT2_HUB}/{source} config.json model.safetensors "
                             f"--local-dir {source}`, copy the folder here, then --init_from=./{source}") from None
    index = os.path.join(source, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(source, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    if not os.path.isfile(os.path.join(source, "model.safetensors")):
        raise ValueError(f"{source} holds no model.safetensors: save the model there with transformers' "
                         f"save_pretrained (safetensors, its default) or python train.py --export={source}")
    return [os.path.join(source, "model.safetensors")]


def gpt2_state_dict(hf, cfg):
    """specgpt's state dict of GPT(cfg) from transformers' GPT-2 tensors hf (keys with or without "transformer."):
    Conv1D stores y = x W + b with W (in, out), nn.Linear W (out, in), so every matrix is transposed; the fused
    c_attn (C, 3C) splits into q, k, v. Biases absent from cfg (bias=False) must be zero in hf."""
    hf = {key.removeprefix("transformer."): tensor for key, tensor in hf.items()
          if not key.endswith((".attn.bias", ".attn.masked_bias"))}  # the causal masks older files store
    ours = {"wte.weight": hf.pop("wte.weight"), "wpe.weight": hf.pop("wpe.weight")[:cfg.block_size],
            "norm_f.weight": hf.pop("ln_f.weight"), "norm_f.bias": hf.pop("ln_f.bias")}
    ours["wte.weight"] = F.pad(ours["wte.weight"], (0, 0, 0, cfg.padded_vocab_size - ours["wte.weight"].size(0)))
    lm_head = hf.pop("lm_head.weight", None)
    ours["lm_head.weight"] = ours["wte.weight"] if cfg.tie_embeddings or lm_head is None else lm_head
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        q, k, v = hf.pop(h + "attn.c_attn.weight").t().chunk(3)
        bq, bk, bv = hf.pop(h + "attn.c_attn.bias").chunk(3)
        ours.update({
            b + "norm1.weight": hf.pop(h + "ln_1.weight"), b + "norm1.bias": hf.pop(h + "ln_1.bias"),
            b + "mixer.q_proj.weight": q, b + "mixer.k_proj.weight": k, b + "mixer.v_proj.weight": v,
            b + "mixer.q_proj.bias": bq, b + "mixer.k_proj.bias": bk, b + "mixer.v_proj.bias": bv,
            b + "mixer.out_proj.weight": hf.pop(h + "attn.c_proj.weight").t(),
            b + "mixer.out_proj.bias": hf.pop(h + "attn.c_proj.bias"),
            b + "norm2.weight": hf.pop(h + "ln_2.weight"), b + "norm2.bias": hf.pop(h + "ln_2.bias"),
            b + "mlp.in_proj.weight": hf.pop(h + "mlp.c_fc.weight").t(),
            b + "mlp.in_proj.bias": hf.pop(h + "mlp.c_fc.bias"),
            b + "mlp.out_proj.weight": hf.pop(h + "mlp.c_proj.weight").t(),
            b + "mlp.out_proj.bias": hf.pop(h + "mlp.c_proj.bias")})
    if hf:
        raise ValueError(f"the GPT-2 weights hold {sorted(hf)[0]!r} (and {len(hf) - 1} more keys) that a GPT-2 of "
                         f"{cfg.n_layer} layers has not: load them with their own config.json")
    if not cfg.bias:
        for key in [key for key in ours if key.endswith(".bias")]:
            if ours.pop(key).any():
                raise ValueError(f"the weights hold a nonzero {key} but the config says bias=False: load them with "
                                 f"bias=True")
    return {key: tensor.contiguous() for key, tensor in ours.items()}


def load_pretrained_weights(model, source):
    """source's weights (pretrained_files) into model, built from pretrained_config(source) and the changeable keys;
    in transformers' GPT-2 layout or (a specgpt export of another architecture) in specgpt's own."""
    from safetensors.torch import load_file
    tensors = {}
    for path in pretrained_files(source):
        tensors.update(load_file(path))
    cfg = model.config
    own = source not in GPT2_SIZES and "model_type" not in saved_config(source)  # specgpt's layout, not GPT-2's
    state = tensors if own else gpt2_state_dict(tensors, cfg)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    if model.wpe is not None and own:
        state["wpe.weight"] = state["wpe.weight"][:cfg.block_size]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"the weights of {source} do not fit its config: "
                         + (f"{missing[0]} is missing" if missing else f"{unexpected[0]} is not in the model")
                         + ": export it again with this version of specgpt")
    return model


def gpt2_unholdable(cfg):
    """None if transformers' GPT2LMHeadModel can hold GPT(cfg) with equal logits, else the key that it cannot (and
    why), for one line. Biases absent here are written as zeros, so bias=False is held."""
    layers = {cfg.mixer[i % len(cfg.mixer)] for i in range(cfg.n_layer)}
    rules = [("pos", cfg.pos == "learned", "GPT-2 has learned positions"),
             ("norm", cfg.norm == "layernorm", "GPT-2 has LayerNorm"),
             ("mlp", cfg.mlp in HF_ACTIVATIONS.values(), "GPT-2's MLP is gelu or gelu_tanh"),
             ("mixer", layers == {"A"}, "GPT-2 has attention layers only"),
             ("residual", cfg.residual == "res", "GPT-2 has the plain residual"),
             ("qk_norm", not cfg.qk_norm, "GPT-2 has no qk_norm"),
             ("attention", cfg.attention in ("sdpa", "math"), "GPT-2's attention is a softmax")]
    for key, holds, why in rules:
        if not holds:
            return f"{key}={getattr(cfg, key)!r} ({why})"
    return None


def hf_gpt2_config(cfg):
    """transformers' GPT-2 config.json (a dict) for GPT(cfg), whose gpt2_unholdable is None."""
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.mlp]
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.padded_vocab_size,
              "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
              "n_inner": None, "activation_function": activation, "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": cfg.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if cfg.padded_vocab_size > 50256:  # GPT-2's <|endoftext|> is in the vocabulary
        config.update(bos_token_id=50256, eos_token_id=50256)
    return config


def hf_gpt2_state_dict(model):
    """The tensors of GPT(cfg) in transformers' GPT2LMHeadModel layout (gpt2_state_dict's inverse): matrices
    transposed to Conv1D's (in, out), q, k, v fused into c_attn, zeros for the biases bias=False leaves out."""
    cfg, ours = model.config, {key: t.detach() for key, t in model.state_dict().items()}

    def with_bias(name, size):
        return ours.get(name + ".bias", torch.zeros(size, dtype=ours["wte.weight"].dtype))
    C = cfg.n_embd
    hf = {"transformer.wte.weight": ours["wte.weight"], "transformer.wpe.weight": ours["wpe.weight"],
          "transformer.ln_f.weight": ours["norm_f.weight"], "transformer.ln_f.bias": with_bias("norm_f", C)}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = ours["lm_head.weight"]
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = [b + f"mixer.{p}_proj" for p in "qkv"]
        hf.update({
            h + "ln_1.weight": ours[b + "norm1.weight"], h + "ln_1.bias": with_bias(b + "norm1", C),
            h + "attn.c_attn.weight": torch.cat([ours[name + ".weight"] for name in qkv]).t(),
            h + "attn.c_attn.bias": torch.cat([with_bias(name, C) for name in qkv]),
            h + "attn.c_proj.weight": ours[b + "mixer.out_proj.weight"].t(),
            h + "attn.c_proj.bias": with_bias(b + "mixer.out_proj", C),
            h + "ln_2.weight": ours[b + "norm2.weight"], h + "ln_2.bias": with_bias(b + "norm2", C),
            h + "mlp.c_fc.weight": ours[b + "mlp.in_proj.weight"].t(),
            h + "mlp.c_fc.bias": with_bias(b + "mlp.in_proj", 4 * C),
            h + "mlp.c_proj.weight": ours[b + "mlp.out_proj.weight"].t(),
            h + "mlp.c_proj.bias": with_bias(b + "mlp.out_proj", C)})
    return {key: t.contiguous() for key, t in hf.items()}


def exported_files(model):
    """(config.json's dict, model.safetensors' tensors) of runs.export_checkpoint: transformers' GPT-2 layout with
    specgpt's keys beside its config where transformers can hold the model, else specgpt's own state dict (the
    tied head once)."""
    cfg = model.config
    keys = dataclasses.asdict(cfg)
    if gpt2_unholdable(cfg) is None:
        return {**hf_gpt2_config(cfg), "specgpt": keys}, hf_gpt2_state_dict(model)
    tensors = {key: t.detach().contiguous() for key, t in model.state_dict().items()
               if not (cfg.tie_embeddings and key == "lm_head.weight")}
    return {"specgpt": keys}, tensors

if __name__ == "__main__":
    # the model alone: the baby GPT (GPTConfig's defaults), its parameters, one forward; what measures the model
    # (its training step against a GPT-2-style yardstick, nanoGPT's recipe) is in bench.py
    import sys
    usage = "python model.py   builds GPTConfig's default model, counts its parameters and runs one forward"
    if sys.argv[1:]:
        if sys.argv[1:] not in (["-h"], ["--help"]):
            sys.exit(f"model.py takes no arguments (got {sys.argv[1]!r}): {usage}")
        print(usage)
        sys.exit()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 2, cfg.block_size))
    logits, loss = model(idx, targets)
    print(f"mixer {cfg.mixer!r}, {cfg.n_layer} layers of {cfg.n_embd}: "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    print(f"logits {tuple(logits.shape)}, loss at init on random tokens {loss.item():.4f} (ln {cfg.vocab_size} = "
          f"{math.log(cfg.vocab_size):.4f})")
