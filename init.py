"""
Weight initialisation for specgpt, and the spectral condition for the learning rate.

    init_weights(model, "gpt2")      N(0, 0.02) for every Linear and the embedding (GPT-2).
    init_weights(model, "spectral")  the spectral condition (Yang, Simon & Bernstein 2023, seed
                                     spectral-condition.md): every hidden matrix starts with a natural
                                     spectral norm of order 1, whatever the width.
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
  V ≫ n_embd (GPT-2's BPE) this is ≈ n_embd^-½, the seed's answer, and logits start with RMS ≈ 1.
  For V < n_embd (characters: V = 84) it is ≈ sqrt(V) / n_embd, muP's readout: logits start small
  (RMS sqrt(V / n_embd), a near-uniform first prediction, harmless) and what the condition buys is
  their change: training moves the last hidden state along the head's rows, so a head with
  ‖W‖_nat ≫ 1 turns an O(1) feature change into an O(sqrt(n_embd / V)) logit change. Measured
  (10 AdamW steps on one batch, widths 64 → 512, head lr scaled as below): with an n_embd^-½ head
  the loss after 10 steps fell from 1.49 at width 64 to 0.11 at 512; with this head, 2.31 to 1.45. Its learning rate needs the same
  spectral_lr_scale as the hidden matrices (fan_in = n_embd). A tied lm_head is the embedding matrix
  and gets the embedding's init: "stable" equals the head's std when V ≥ n_embd; "exact" (std 1) would
  give logits of RMS sqrt(n_embd), so that pair is refused.
- hyper-connection maps (names with ".hc_"), norm gains, convolutions, A_log, dt_bias, D: their own init.

The learning-rate half is spectral_lr_scale(fan_out, fan_in, optimizer): the per-matrix multiplier
that keeps ‖ΔW‖_nat the same at every width for each kind of optimizer (its docstring derives it).
"""
import math

import torch
import torch.nn as nn

SCHEMES = ("gpt2", "spectral")
EMBEDDING_STDS = ("stable", "exact")
BASE_WIDTH = 128  # spectral_lr_scale is 1 for a BASE_WIDTH × BASE_WIDTH matrix (the baby model's n_embd)


def spectral_std(fan_out, fan_in, exact=False):
    """Std of a dense matrix with ‖W‖_nat ≈ 1 at init.
    exact: σ (sqrt(fan_out) + sqrt(fan_in)) = sqrt(fan_out / fan_in)  ⇒  σ = fan_in^-½ · sqrt(fan_out) / (sqrt(fan_in) + sqrt(fan_out)),
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
               RMS of a token's vector (the seed's ‖W e_i‖₂ / sqrt(d), maximised over the inputs the layer
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
        if ".hc_" in f".{name}":  # hyper-connection maps keep their near-identity init
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


# update direction families, by how the size of their update u depends on the matrix shape
ADAM_LIKE = ("adamw", "nadam", "shampoo", "signsgd", "lion", "tiger")  # |u_ij| ≈ 1 (Shampoo: grafted to AdamW)
LOW_RANK_ADAM = ("galore",)  # AdamW's ±1 entries on a fixed rank-r projection
MSIGN_BASED = ("muon", "mousse")  # c · msign(·): singular values ≈ 1 times the optimizer's own shape factor c
PLAIN_GRADIENT = ("sgd",)
OPTIMIZERS = ADAM_LIKE + LOW_RANK_ADAM + MSIGN_BASED + PLAIN_GRADIENT


def _muon_shape_factor(scale, fan_out, fan_in):
    """The factor Muon's `scale` option already puts on msign's output (optim.muon_scale)."""
    if scale == "jordan":
        return max(1.0, fan_out / fan_in) ** 0.5
    if scale == "moonlight":
        return 0.2 * max(fan_out, fan_in) ** 0.5
    if scale == "spectral":
        return (fan_out / fan_in) ** 0.5
    raise ValueError(f"unknown Muon scale {scale!r}: use 'jordan', 'moonlight' or 'spectral'")


def spectral_lr_scale(fan_out, fan_in, optimizer, muon_scale="jordan", base_width=BASE_WIDTH):
    """Learning-rate multiplier for a dense matrix W [fan_out, fan_in] (a hidden one, or the untied
    lm_head with fan_out = V, fan_in = n_embd) so that each step's ΔW = −lr·s·u
    has ‖ΔW‖₂ = Θ(sqrt(fan_out / fan_in)), i.e. ‖ΔW‖_nat = Θ(1), at every width. It multiplies the lr
    the optimizer would otherwise apply (for Muon: on top of its own `scale` factor), and it is 1 for a
    base_width × base_width matrix, so an lr tuned without it at width base_width keeps its meaning.

    Gradients of a linear layer are sums of outer products δ xᵀ over tokens; the few directions the
    batch shares dominate, so an update u is close to low rank and aligned with the layer's inputs:
    the worst case, rank one, is what the sizes below use (the muP argument: ΔW x grows with the
    number of coordinates of x that add up coherently).
    - Adam-like and sign-based (adamw, nadam, signsgd, lion, tiger; shampoo, grafted to AdamW's norm):
      entries of u are ±1-sized, a rank-one sign matrix has ‖u‖₂ = sqrt(fan_out · fan_in), so
      lr·s·sqrt(fan_out·fan_in) = Θ(sqrt(fan_out/fan_in)) needs s ∝ 1/fan_in:   s = base_width / fan_in.
      ‖ΔW‖_nat = lr · base_width for every shape (so a 4·width → width MLP out_proj gets s = 1/4 even
      at the base width: its output adds up 4× more coordinates). Real updates are not exactly rank
      one: u = aligned part + a bulk of sign noise whose ‖·‖₂ ≈ sqrt(fan_out) + sqrt(fan_in). The bulk
      is a smaller share of ‖u‖₂ at larger widths, so measured ‖ΔW‖_nat still falls slowly with the
      width at these sizes (about width^-0.2 over 64 → 1024 after 10 steps), toward its limit.
    - galore (AdamW on a fixed rank-r projection, r < fan_out, fan_in): ‖u‖₂ = sqrt(r · max(fan_out, fan_in)),
      so s ∝ sqrt(fan_out / (fan_in · max(fan_out, fan_in))):   s = sqrt(base_width · min(fan_out, fan_in)) / fan_in.
    - msign-based (muon, mousse): u = c · msign(·) with ‖msign‖₂ ≈ 1 and c the optimizer's own shape
      factor (Muon's `scale` option: jordan max(1, fan_out/fan_in)^½, moonlight 0.2·max(fan_out, fan_in)^½,
      spectral (fan_out/fan_in)^½; Mousse always uses spectral), so   s = sqrt(fan_out/fan_in) / c,
      normalised by c at base_width × base_width: jordan gives min(1, sqrt(fan_out/fan_in)), spectral
      (and Mousse) 1, moonlight sqrt(fan_out/fan_in) · sqrt(base_width / max(fan_out, fan_in)).
    - sgd: u = G. When every layer meets the condition, the backward signal δ = ∂L/∂h has
      ‖δ‖₂ = Θ(1/sqrt(fan_out)) and x has ‖x‖₂ = Θ(sqrt(fan_in)), so ‖G‖₂ = Θ(sqrt(fan_in/fan_out)) and
      s ∝ fan_out / fan_in (the paper's η_l):   s = fan_out / fan_in.
      The backward signal is this size when the lm_head meets the condition too: its δ into the last
      layer has norm ‖Wᵀ(p − y)‖ ≈ sqrt(V / n_embd), which shrinks like 1/sqrt(width) only while
      n_embd > V (characters); with V ≫ n_embd (BPE) it is O(1) and plain SGD transfers less cleanly
      than the normalised optimizers above."""
    if fan_out < 1 or fan_in < 1:
        raise ValueError(f"fan_out={fan_out}, fan_in={fan_in}: both must be positive")
    name = optimizer.lower()
    if name in ADAM_LIKE:
        return base_width / fan_in
    if name in LOW_RANK_ADAM:
        return math.sqrt(base_width * min(fan_out, fan_in)) / fan_in
    if name in MSIGN_BASED:
        kind = muon_scale if name == "muon" else "spectral"
        own = _muon_shape_factor(kind, fan_out, fan_in)
        return math.sqrt(fan_out / fan_in) / own * _muon_shape_factor(kind, base_width, base_width)
    if name in PLAIN_GRADIENT:
        return fan_out / fan_in
    raise ValueError(f"unknown optimizer {optimizer!r} for spectral_lr_scale: use one of {', '.join(OPTIMIZERS)}")


def coordinate_check(model, optimizer, idx, targets, steps=10):
    """muP's coordinate check for one model: train `steps` steps on the batch (idx, targets), then
    return {"out <name>": RMS of the output of every Linear, Embedding and block on that batch,
    "dW <name>": natural spectral norm of W_after − W_before for every 2-D weight (hyper-connection
    maps excepted; kind "embedding" for wte)}. Run it at several widths: under a width-consistent
    parametrization every entry stays of the same size."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2 and ".hc_" not in n}
    model.train()
    for _ in range(steps):
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = {}

    def record(key):
        return lambda module, inputs, output: stats.__setitem__(key, output.float().pow(2).mean().sqrt().item())

    blocks = {id(b) for b in model.blocks}
    watched = [(n, m) for n, m in model.named_modules()
               if ".hc_" not in f".{n}" and (isinstance(m, (nn.Linear, nn.Embedding)) or id(m) in blocks)]
    hooks = [m.register_forward_hook(record("out " + n)) for n, m in watched]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    params = dict(model.named_parameters())
    for n, W0 in before.items():
        stats["dW " + n] = natural_spectral_norm(params[n].detach() - W0, "embedding" if n == "wte.weight" else "dense")
    return stats


if __name__ == "__main__":
    # muP's coordinate check, gpt2 vs spectral (+ spectral_lr), AdamW and Muon:
    #     python init.py               table of spreads (largest / smallest value over widths 64 → 512) + out/init_coord_check.png
    #     python init.py --lr_sweep [adamw|muon]   5 learning rates × widths 64 and 256 on shakespeare_char
    #                                              (per optimizer about 10 minutes on one CPU core)
    import os
    import sys
    import time

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from model import GPT, GPTConfig
    from optim import build_optimizer

    def make_model(width, scheme, vocab_size, block_size):
        """2 layers, head size 16 (the head count grows with the width), untied lm_head; spectral uses the
        "exact" embedding, whose output has RMS 1 at every width ("stable" is n_embd^-½ by design)."""
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=width // 16,
                              n_embd=width, tie_embeddings=False, init=scheme))
        if scheme == "spectral":
            init_weights(model, "spectral", embedding="exact")
        return model

    if "--lr_sweep" in sys.argv:
        import data
        train_tokens, val_tokens, meta = data.load_dataset("shakespeare_char")
        steps, B, T = 200, 8, 64
        val_sampler = data.BatchSampler(val_tokens, B, T, seed=123)
        val_batches = [val_sampler.next_batch() for _ in range(8)]
        grids = {"adamw": (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), "muon": (5e-3, 1e-2, 2e-2, 4e-2, 8e-2)}
        print(f"{steps} steps of {B}x{T} characters, warmup 20 + cosine to 0.1, val loss on {len(val_batches)} "
              f"batches; muon's AdamW part (embedding, head, norms) at lr 3e-3")
        for optimizer in [name for name in grids if name in sys.argv] or list(grids):
            lrs = grids[optimizer]
            for scheme in ("spectral", "gpt2"):
                for width in (64, 256):
                    losses = []
                    for lr in lrs:
                        model = make_model(width, scheme, meta["vocab_size"], T)
                        opt = build_optimizer(model, optimizer, lr=lr, weight_decay=0.0, aux_lr=3e-3,
                                              spectral_lr=scheme == "spectral")
                        sampler = data.BatchSampler(train_tokens, B, T, seed=1)
                        for it in range(steps):
                            mult = min(1.0, (it + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * it / steps)))
                            for group in opt.param_groups:
                                group["lr"] = group["base_lr"] * mult
                            _, loss = model(*sampler.next_batch())
                            loss.backward()
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                        with torch.no_grad():
                            losses.append(sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches))
                    best = lrs[losses.index(min(losses))]
                    print(f"{optimizer} {scheme:8s} width {width:3d}: "
                          + "  ".join(f"lr {lr:g}: {v:.4f}" for lr, v in zip(lrs, losses)) + f"   best {best:g}",
                          flush=True)
        sys.exit(0)

    widths = (64, 128, 256, 512)
    idx = torch.randint(0, 84, (4, 33), generator=torch.Generator().manual_seed(0))
    runs = {}
    for optimizer, lr in (("adamw", 1e-3), ("muon", 0.02)):
        for scheme in ("gpt2", "spectral"):
            t0 = time.perf_counter()
            runs[optimizer, scheme] = {}
            for width in widths:
                model = make_model(width, scheme, 84, 32)
                opt = build_optimizer(model, optimizer, lr=lr, weight_decay=0.0, aux_lr=3e-3,
                                      spectral_lr=scheme == "spectral")
                runs[optimizer, scheme][width] = coordinate_check(model, opt, idx[:, :-1], idx[:, 1:], steps=10)
            print(f"{optimizer} {scheme}: {time.perf_counter() - t0:.1f} s", flush=True)

    def spread(stats, key):
        values = [stats[w][key] for w in widths]
        return max(values) / min(values)

    for optimizer in ("adamw", "muon"):
        keys = list(runs[optimizer, "gpt2"][widths[0]])
        print(f"\n{optimizer}: 10 steps, widths {widths}; spread = largest / smallest over the widths")
        print(f"{'':38s} {'gpt2 spread':>12s} {'spectral spread':>16s}   spectral values per width")
        for key in keys:
            s = runs[optimizer, "spectral"]
            print(f"{key:38s} {spread(runs[optimizer, 'gpt2'], key):12.2f} {spread(s, key):16.2f}   "
                  + " ".join(f"{s[w][key]:.3g}" for w in widths))

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for row, optimizer in enumerate(("adamw", "muon")):
        for col, (scheme, prefix, what) in enumerate((("gpt2", "out ", "RMS of layer outputs"),
                                                      ("spectral", "out ", "RMS of layer outputs"),
                                                      ("gpt2", "dW ", "‖ΔW‖_nat"),
                                                      ("spectral", "dW ", "‖ΔW‖_nat"))):
            ax, stats = axes[row, col], runs[optimizer, scheme]
            if col % 2:
                ax.sharey(axes[row, col - 1])
            keys = [k for k in stats[widths[0]] if k.startswith(prefix)]
            for key in keys:
                color = "tab:red" if "lm_head" in key else "tab:green" if "wte" in key else "tab:blue"
                ax.plot(widths, [stats[w][key] for w in widths], marker="o", lw=1, color=color, alpha=0.7)
            worst = max(spread(stats, k) for k in keys if "lm_head" not in k)
            label = "gpt2" if scheme == "gpt2" else "spectral + spectral_lr"
            ax.set(xscale="log", yscale="log", xlabel="n_embd", title=f"{optimizer}, {label}\n{what}: max spread {worst:.1f}x")
            ax.set_xticks(widths, [str(w) for w in widths])
            ax.minorticks_off()
    fig.suptitle("Coordinate check after 10 steps, one line per layer (blue: blocks, green: embedding, "
                 "red: lm_head, left out of the spreads)")
    fig.tight_layout()
    os.makedirs("out", exist_ok=True)
    fig.savefig("out/init_coord_check.png", dpi=90)
    print("\nwrote out/init_coord_check.png")
