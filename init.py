"""
Weight initialisation for specgpt, and the spectral condition for the learning rate.

    init_weights(model, "gpt2")      N(0, 0.02) for every Linear and the embedding (GPT-2).
    init_weights(model, "spectral")  the spectral condition (Yang, Simon & Bernstein 2023, "A Spectral
                                     Condition for Feature Learning"): every hidden matrix starts with a
                                     natural spectral norm of order 1, whatever the width.
Both divide the std of the Linears that write into the residual stream (named out_proj) by
sqrt(2 * n_layer), so the stream's variance does not grow with depth (GPT-2 paper).

The natural norm of a dense vector of length m is its RMS, ‖v‖₂ / sqrt(m). The natural spectral norm
of a dense → dense matrix W [fan_out, fan_in] is the operator norm between natural norms:

    ‖W‖_nat = sqrt(fan_in / fan_out) · ‖W‖₂

The spectral condition asks ‖W‖_nat = Θ(1) at init and ‖ΔW‖_nat = Θ(1) per step, i.e.
‖W‖₂, ‖ΔW‖₂ = Θ(sqrt(fan_out / fan_in)). By Marchenko–Pastur an i.i.d. N(0, σ²) matrix has
‖W‖₂ ≈ σ (sqrt(fan_out) + sqrt(fan_in)), which gives the std spectral_std below.

What "spectral" sets, and what it leaves alone:
- every nn.Linear inside the blocks, by its shape: this includes the gate and decay projections of the
  G and M mixers (Mamba2's fused in_proj as one matrix; GatedDelta's fused in_proj slice by slice, as the
  separate q, k, v, gate, erase, write and decay maps it holds). They are dense maps of the
  normalised stream like any other. Their output has RMS ≈ min(1, sqrt(fan_out / fan_in)) at init:
  about 1 for the per-channel ones (fan_out ∝ width), and shrinking with the width for one β per head,
  which then starts near σ(0) = ½, the neutral gate. The decay timescales are carried by A_log and
  dt_bias, which keep the mixer's init; the projection only modulates them around it.
- the embedding: "stable" std n_embd^-½ (default) or "exact" std 1. A token is a one-hot (sparse)
  input, so the embedding's natural norm is the RMS of a token's vector, ≈ std: "exact" meets the
  condition; "stable" is the smaller start practitioners use (the blocks see it through their
  RMSNorm, so only the raw embedding output shrinks with the width), and the one a tied lm_head needs.
- lm_head (untied): spectral_std(V, n_embd) like any dense matrix, without the depth factor. For
  V ≫ n_embd (GPT-2's BPE) this is ≈ n_embd^-½, the paper's answer, and logits start with RMS ≈ 1.
  For V < n_embd (characters: V = 84) it is ≈ sqrt(V) / n_embd, muP's readout: logits start small
  (RMS sqrt(V / n_embd), a near-uniform first prediction, harmless) and what the condition buys is
  their change: training moves the last hidden state along the head's rows, so a head with
  ‖W‖_nat ≫ 1 turns an O(1) feature change into an O(sqrt(n_embd / V)) logit change. Measured
  (10 AdamW steps on one batch, widths 64 → 512, head lr scaled as below): with an n_embd^-½ head
  the loss after 10 steps fell from 1.49 at width 64 to 0.11 at 512; with this head, 2.31 to 1.45.
  Its learning rate needs the same optim.spectral_lr_scale as the hidden matrices (fan_in = n_embd).
  A tied lm_head is the embedding matrix
  and gets the embedding's init: "stable" equals the head's std when V ≥ n_embd; "exact" (std 1) would
  give logits of RMS sqrt(n_embd), so that pair is refused.
- the residual modules' maps (in_residual: the hyper-connections), norm gains, convolutions, A_log, dt_bias, D:
  their own init.

The learning-rate half is optim.spectral_lr_scale(fan_out, fan_in, optimizer): the per-matrix multiplier
that keeps ‖ΔW‖_nat the same at every width for each kind of optimizer (its docstring derives it).
"""
import math
import sys

import torch
import torch.nn as nn

SCHEMES = ("gpt2", "spectral")
EMBEDDING_STDS = ("stable", "exact")


def in_residual(name):
    """Whether a module or parameter name lies inside a block's residual module (Block.mixer_residual,
    Block.mlp_residual: the hyper-connection maps). Those keep their own init and train with AdamW."""
    return any(part.endswith("_residual") for part in name.split("."))


def spectral_std(fan_out, fan_in, exact=False):
    """Std of a dense matrix with ‖W‖_nat ≈ 1 at init.
    exact: σ (sqrt(fan_out) + sqrt(fan_in)) = sqrt(fan_out / fan_in)
           ⇒  σ = fan_in^-½ · sqrt(fan_out) / (sqrt(fan_in) + sqrt(fan_out)),
           so ‖W‖_nat → 1;
    approx (the paper's Parametrization 1): σ = fan_in^-½ · min(1, sqrt(fan_out / fan_in)), which gives
           ‖W‖_nat ≈ 1 + min(r, 1/r) with r = sqrt(fan_out / fan_in): between 1 and 2 (2 for square)."""
    if exact:
        return math.sqrt(fan_out) / (math.sqrt(fan_in) * (math.sqrt(fan_in) + math.sqrt(fan_out)))
    return min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)


def natural_spectral_norm(W, kind="dense"):
    """The operator norm of W between natural (RMS) norms.
    dense:     W [fan_out, fan_in] maps a dense vector to a dense vector: sqrt(fan_in / fan_out) · ‖W‖₂.
    embedding: W [V, d] is an nn.Embedding table, fed one-hot tokens (sparse inputs, natural norm 1) and
               giving a dense d-vector: the norm is max over tokens i of ‖W[i]‖₂ / sqrt(d), the largest
               RMS of a token's vector (the paper's ‖W e_i‖₂ / sqrt(d), maximised over the inputs the layer
               really sees; ‖W‖₂ / sqrt(d) would include mixtures of tokens, which never occur, and
               grows like sqrt(V / d) at init)."""
    if W.ndim != 2:
        raise ValueError(f"natural_spectral_norm takes a 2-D matrix, got shape {tuple(W.shape)}")
    W = W.detach().float()
    if kind == "dense":
        fan_out, fan_in = W.shape
        return math.sqrt(fan_in / fan_out) * torch.linalg.matrix_norm(W, ord=2).item()
    if kind == "embedding":
        return (W.norm(dim=1).max() / math.sqrt(W.size(1))).item()
    raise ValueError(f"unknown kind {kind!r} for natural_spectral_norm: use 'dense' or 'embedding'")


def init_weights(model, scheme="gpt2", exact=False, embedding="stable"):
    """Initialise the dense weights of a GPT in place (biases of Linears to 0).
    scheme "gpt2": std 0.02. scheme "spectral": spectral_std(fan_out, fan_in, exact) for the Linears
    (an untied lm_head included), embedding std n_embd^-½ ("stable") or 1 ("exact").
    out_proj weights get std / sqrt(2 * n_layer) in both schemes."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}: use one of {', '.join(SCHEMES)}")
    if embedding not in EMBEDDING_STDS:
        raise ValueError(f"unknown embedding init {embedding!r}: use 'stable' or 'exact'")
    cfg = model.config
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and lm_head.weight is model.wte.weight
    if scheme == "spectral" and embedding == "exact" and tied:
        raise ValueError("embedding='exact' (std 1) with tied embeddings gives logits of RMS sqrt(n_embd): "
                         "use embedding='stable' or tie_embeddings=False")
    depth_scale = 1.0 / math.sqrt(2 * cfg.n_layer)
    for name, module in model.named_modules():
        if in_residual(name):  # hyper-connection maps keep their near-identity init
            continue
        if isinstance(module, nn.Linear):
            if module is lm_head and tied:  # the shared matrix is set once, as the embedding
                continue
            fan_in = module.weight.shape[1]
            # a fused projection (GatedDelta's in_proj) lists its maps' row counts: each slice is initialised
            # as the separate matrix it stands for
            for rows in module.weight.split(getattr(module, "row_splits", module.weight.shape[:1]), dim=0):
                std = 0.02 if scheme == "gpt2" else spectral_std(rows.shape[0], fan_in, exact)
                if name.endswith("out_proj"):
                    std *= depth_scale
                torch.nn.init.normal_(rows, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if scheme == "gpt2":
                std = 0.02
            else:
                std = module.embedding_dim ** -0.5 if embedding == "stable" else 1.0
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)


if __name__ == "__main__":
    usage = ('python init.py   the natural spectral norm of one N(0, std²) matrix per shape and width, for the '
             'spectral and GPT-2 inits')
    if sys.argv[1:]:  # the demo takes no arguments
        if sys.argv[1:] not in (["-h"], ["--help"]):
            sys.exit(f"init.py takes no arguments (got {sys.argv[1]!r}): {usage}")
        print(usage)
        sys.exit()
    # spectral's std (approx, exact) and GPT-2's σ = 0.02; the coordinate check and the lr sweep are analyze.py
    # sections (coord, lr_transfer)
    print(f"{'shape':>22s} " + " ".join(f"{'width ' + str(w):>22s}" for w in (64, 128, 256, 512)))
    print(f"{'':>22s} " + " ".join(f"{'approx / exact / gpt2':>22s}" for _ in range(4)))
    for label, out_mult, in_mult in (("square", 1, 1), ("fan_out = fan_in / 4", 1, 4), ("fan_out = 4 fan_in", 4, 1)):
        row = []
        for width in (64, 128, 256, 512):
            fan_out, fan_in = out_mult * width, in_mult * width
            z = torch.randn(fan_out, fan_in, generator=torch.Generator().manual_seed(width))
            norms = [natural_spectral_norm(z * std) for std in
                     (spectral_std(fan_out, fan_in), spectral_std(fan_out, fan_in, exact=True), 0.02)]
            row.append(" / ".join(f"{n:.2f}" for n in norms))
        print(f"{label:>22s} " + " ".join(f"{r:>22s}" for r in row))
