"""
Spectra that explain what training did: weights, Hessian, gradients, noise scales, Newton–Schulz,
hyper-connection mixing matrices, GDN2 gates, layer-input isotropy, width transfer; and two lab tools
that drive train.py: the critical batch size and the multi-power law of the loss against the lr schedule.

    python analyze.py --ckpt=out/ckpt.pt                      # a trained model (its data and batch shape)
    python analyze.py --n_layer=4 --n_embd=128                # a fresh init: any GPTConfig key, no training
    python analyze.py --config=my_config.py --mixer=GGGA     # a fresh init from a train.py config file
    python analyze.py --ckpt=out/ckpt.pt --sections=weights,hessian
    python analyze.py --sections=coord                        # muP's coordinate check, widths 64 → 512
    python analyze.py --scan_batch_sizes=4,8,16,32,64 --scan_target=2.2   # steps and examples to a loss
    python analyze.py --mpl_fit=out/constant,out/wsd50 --mpl_predict=out/cosine   # loss from the schedule
    python analyze.py --ckpt=out/ckpt.pt --lengths=1,2,4,8    # length_extrapolation: val loss at 1x..8x block_size
    python analyze.py --init_from=gpt2 --sections=weights     # OpenAI's GPT-2 (or a folder: transformers', --export's)

writes <out_dir>/summary.json (default out_dir: the checkpoint's folder + /analysis), <section>.npz with
the arrays and <section>.png, and prints a short table. Sections (the SECTIONS table), each also a
function:

    weights    weight_spectra(model)             singular values, σ_max, natural spectral norm, stable rank,
                                                 Marchenko–Pastur fit and the spikes above its edge, tail α
    hessian    hessian_spectrum(model, batches)  top eigenvalues (block power iteration on Hessian-vector
                                                 products), Hutchinson trace, stochastic Lanczos density
    gradients  gradient_stats(model, batches)    gradient stable rank per matrix, noise scale
                                                 B_simple = tr(Σ)/|G|² from two batch sizes
    noise      curvature_noise_scale(model, batches)  B_noise = tr(HΣ)/GᵀHG, η_max, ΔL_max
    ns         ns_response(coeffs, steps, xs)    what msign's Newton–Schulz does to each singular value
    hc         hc_spectra(model, idx)            H_res spectra per layer and ‖Π H_res‖₂ down the depth
    gates      gdn2_gates(model, idx)            ρ = ‖I − k(b⊙k)ᵀ‖₂, fraction of decays clipped,
                                                 max ‖(I − a cᵀ)D‖₂
    isotropy   isotropy(model, idx)              eigenvalues of each linear layer's input second moment
    coord      coordinate_transfer()             (not default) layer output RMS and ‖ΔW‖_nat over widths
    lr_transfer lr_transfer(dataset)             (not default) best lr per width, ~10 min per optimizer
    sparsity   attention_sparsity(model, batch)  fraction of exact zeros in the attention weights per layer and
                                                 head, over the causal entries (sparsemax attention)

The model runs in fp32 with kernels="torch" and the explicit-softmax attention, or sparsemax attention for a
sparsemax model (analysis_model): fused SDPA and the Triton kernels have no second derivative, which
Hessian-vector products need.
During training, `train.py --analyze_every=N` calls analyze_during_training (the cheap sections,
one JSON line per call) and plot_training_analysis draws them against the step. train.py also draws its loss.png
here (plot_losses), and prices a run here before it builds anything: dry_run_report (--dry_run=True), check_fit,
and the GPUs' peaks that MFU is measured against (GPU_PEAKS, peak_flops).
"""
import ast
import builtins
import collections
import dataclasses
import glob
import inspect
import itertools
import json
import math
import os
import subprocess
import sys
import time
import types

import numpy as np
import torch
import torch.nn as nn

import data
import kernels
import model as model_module
import optim
import runs
from init import in_residual, init_weights, natural_spectral_norm
from model import GPT, GPTConfig, HyperConnection, GatedDelta, Attention

TW1_QUANTILE_99 = 2.02  # 99% quantile of the Tracy–Widom (β = 1) law of the largest noise eigenvalue


def progress(label, i, n, verbose):
    if verbose and (i == n or i % max(1, n // 10) == 0):
        print(f"\r  {label}: {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)


def analysis_model(model):
    """A copy of model (unwrapped from DDP / torch.compile) with the same weights, in fp32, eval mode,
    kernels="torch" and math attention (sparsemax attention stays: its torch path has a double backward),
    so that double backward runs through it."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    attention = "sparsemax" if model.config.attention == "sparsemax" else "math"
    cfg = dataclasses.replace(model.config, attention=attention, kernels="torch")
    with torch.random.fork_rng(devices=[]):  # building a GPT draws an init: leave the caller's RNG alone
        twin = GPT(cfg).to(device=next(model.parameters()).device, dtype=torch.float32)
    twin.load_state_dict(model.state_dict())  # copied on the model's own device (meta included), cast to fp32
    return twin.eval()


# ----------------------------------------------------------------------------------------------------
# length extrapolation: validation loss at multiples of the training length

@torch.no_grad()
def length_extrapolation(model, tokens, factors=(1, 2, 4, 8), n_tokens=16384, batch_size=8):
    """Mean cross-entropy of the first n_tokens targets of `tokens`, cut into windows of factor × block_size
    tokens: every length predicts the same tokens, only the context differs. Attention with fixed RoPE
    frequencies runs under each rope_scaling with rope_factor = factor (none: the trained frequencies, used
    past the training length); learned/lie frequencies only as trained; a model without context_limited mixers
    (only G and M layers) has no length limit and runs as it is.
    Returns rows {"scaling", "factor", "length", "val_loss"}."""
    cfg = model.config
    scalings = model_module.ROPE_SCALINGS if model.context_limited and cfg.rope == "fixed" else ("none",)
    device = next(model.parameters()).device
    rows = []
    for factor in factors:
        length = int(cfg.block_size * factor)
        n_windows = n_tokens // length
        if n_windows < 1 or len(tokens) < n_windows * length + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for n_tokens={n_tokens} in windows of {length}: "
                             f"use a larger split or smaller factors")
        stretch = torch.as_tensor(np.asarray(tokens[:n_windows * length + 1], dtype=np.int64))
        x, y = stretch[:-1].view(n_windows, length), stretch[1:].view(n_windows, length)
        for scaling in scalings if factor > 1 else ("none",):  # at factor 1 every scaling is "none"
            twin = model
            if model.context_limited:  # rebuilt so that its cos/sin cache covers `length` positions
                with torch.random.fork_rng(devices=[]):
                    twin = GPT(dataclasses.replace(cfg, rope_scaling=scaling, rope_factor=factor))
                twin.load_state_dict(model.state_dict())
                twin = twin.to(device).eval()
            losses = [twin(x[i:i + batch_size].to(device), y[i:i + batch_size].to(device))[1].item()
                      * len(x[i:i + batch_size])
                      for i in range(0, n_windows, batch_size)]
            rows.append({"scaling": scaling, "factor": factor, "length": length, "val_loss": sum(losses) / n_windows})
    return rows


# ----------------------------------------------------------------------------------------------------
# weights: singular values against the Marchenko–Pastur law of a random matrix

def mp_median(gamma):
    """Median of the Marchenko–Pastur law (unit variance, aspect ratio gamma = M/N ≤ 1): the eigenvalues
    of WᵀW/N for an N×M matrix of i.i.d. unit-variance entries, density
    sqrt((λ₊−λ)(λ−λ₋)) / (2π γ λ) on λ± = (1 ± sqrt γ)². About 0.6528 at gamma = 1."""
    lo, hi = (1 - math.sqrt(gamma)) ** 2, (1 + math.sqrt(gamma)) ** 2
    # λ = lo + (hi − lo)(1 − cos u)/2 turns sqrt((hi−λ)(λ−lo)) dλ into ((hi − lo) sin u / 2)² du: smooth
    u = np.linspace(0.0, np.pi, 40001)
    mid = (u[1:] + u[:-1]) / 2
    lam = lo + (hi - lo) * (1 - np.cos(mid)) / 2
    mass = ((hi - lo) * np.sin(mid) / 2) ** 2 / (2 * np.pi * gamma * lam) * np.diff(u)
    cdf = np.cumsum(mass) / mass.sum()
    return float(np.interp(0.5, cdf, lo + (hi - lo) * (1 - np.cos(u[1:])) / 2))


def power_law_fit(eigenvalues, min_tail=10):
    """Tail exponent of p(λ) ∝ λ^−α for λ ≥ λ_min (Clauset–Shalizi–Newman): for each candidate λ_min the
    MLE α = 1 + n / Σ log(λ_i/λ_min), keeping the λ_min with the smallest Kolmogorov–Smirnov distance."""
    x = np.sort(eigenvalues[eigenvalues > 0])
    best = {"alpha": float("nan"), "xmin": float("nan"), "ks_distance": float("inf"), "n_tail": 0}
    for i in range(len(x) - min_tail + 1):
        tail = x[i:]
        n, log_sum = len(tail), np.log(tail / tail[0]).sum()
        if log_sum <= 0:
            continue
        alpha = 1 + n / log_sum
        fitted_cdf = 1 - (tail / tail[0]) ** (1 - alpha)
        steps = np.arange(n + 1) / n
        ks = max(np.abs(fitted_cdf - steps[:-1]).max(), np.abs(fitted_cdf - steps[1:]).max())
        if ks < best["ks_distance"]:
            best = {"alpha": float(alpha), "xmin": float(tail[0]), "ks_distance": float(ks), "n_tail": n}
    return best


def matrix_spectrum(W, kind="dense"):
    """Spectral summary of one matrix W and its singular values (descending).
    Marchenko–Pastur fit: N ≥ M the two sides, γ = M/N, λ = s²/N; the entry variance σ² comes from the
    median, σ² = median(λ) / median(MP_γ), robust to a few spikes; the bulk edges are λ± = σ²(1 ± sqrt γ)²
    (singular values σ(sqrt N ± sqrt M)). A spike is a λ above λ₊ plus a Tracy–Widom margin:
    s²/σ² > μ + 2.02·τ, μ = (sqrt(N−1) + sqrt M)², τ = sqrt μ · (1/sqrt(N−1) + 1/sqrt M)^⅓
    (Johnstone 2001), which pure noise exceeds with probability 1%."""
    W = W.detach().float()
    s = torch.linalg.svdvals(W).cpu().double().numpy()
    N, M = max(W.shape), min(W.shape)
    summary = {"shape": list(W.shape), "kind": kind, "sigma_max": float(s[0]),
               "frobenius": float(np.sqrt((s ** 2).sum())), "natural_spectral_norm": natural_spectral_norm(W, kind)}
    gamma, lam = M / N, s ** 2 / N
    sigma2 = float(np.median(lam)) / mp_median(gamma)
    if M < 2 or sigma2 == 0:  # a vector, or a matrix that is zero or of rank < M/2 (e.g. an HC map at init)
        nan = float("nan")
        return {**summary, "stable_rank": float((s ** 2).sum() / s[0] ** 2) if s[0] > 0 else 0.0,
                "mp_entry_std": nan, "mp_edges": [nan, nan], "spike_threshold": nan, "n_spikes": 0,
                "frac_inside_mp": nan, "mp_softrank": nan, "alpha": nan, "alpha_xmin": nan, "alpha_ks": nan}, s
    lam_minus, lam_plus = sigma2 * (1 - math.sqrt(gamma)) ** 2, sigma2 * (1 + math.sqrt(gamma)) ** 2
    root = math.sqrt(N - 1) + math.sqrt(M)
    spike_lam = sigma2 * (root ** 2 + TW1_QUANTILE_99 * root * (1 / math.sqrt(N - 1) + 1 / math.sqrt(M)) ** (1 / 3)) / N
    tail = power_law_fit(s ** 2)
    summary.update({
        "stable_rank": float((s ** 2).sum() / s[0] ** 2),
        "mp_entry_std": math.sqrt(sigma2),
        "mp_edges": [math.sqrt(lam_minus * N), math.sqrt(lam_plus * N)],  # in singular-value units
        "spike_threshold": math.sqrt(spike_lam * N),
        "n_spikes": int((lam > spike_lam).sum()),
        "frac_inside_mp": float(((lam >= lam_minus) & (lam <= lam_plus)).mean()),
        "mp_softrank": float(lam_plus / lam[0]),
        "alpha": tail["alpha"], "alpha_xmin": tail["xmin"], "alpha_ks": tail["ks_distance"],
    })
    return summary, s


def weight_spectra(model):
    """matrix_spectrum of every 2-D parameter (a tied lm_head is the embedding, listed once as wte).
    Returns (summary {name: dict}, arrays {name: singular values})."""
    summary, arrays = {}, {}
    for name, p in model.named_parameters():
        if p.ndim != 2:
            continue
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        kind = "embedding" if isinstance(owner, nn.Embedding) else "dense"
        summary[name], arrays[name] = matrix_spectrum(p, kind)
    return summary, arrays


# ----------------------------------------------------------------------------------------------------
# hessian: Hessian-vector products, block power iteration, Hutchinson, stochastic Lanczos quadrature

def hessian_vector_product(model, batches):
    """hvp(v) = H v for a flat fp32 vector v on the parameters' device, H the Hessian of the mean loss over
    batches [(x, y), ...] with respect to every trainable parameter (flattened in model.parameters()
    order). The first-order graph of each batch is built once and kept. Returns (hvp, n_params, loss)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, loss_sum = [], 0.0
    for x, y in batches:
        _, loss = model(x, y)
        g = torch.autograd.grad(loss / len(batches), params, create_graph=True)
        grads.append(torch.cat([gi.reshape(-1) for gi in g]))
        loss_sum += loss.item()

    def hvp(v):
        out = torch.zeros_like(v)
        for g in grads:
            Hv = torch.autograd.grad(g, params, grad_outputs=v, retain_graph=True, allow_unused=True)
            out += torch.cat([(h if h is not None else torch.zeros_like(p)).reshape(-1) for h, p in zip(Hv, params)])
        return out

    return hvp, grads[0].numel(), loss_sum / len(batches)


def _random_vectors(n, count, generator, device, rademacher=False):
    """count random vectors of length n as the columns of an (n, count) fp32 matrix on device (drawn on
    the CPU from generator, so results do not depend on the device)."""
    if rademacher:
        return (torch.randint(0, 2, (n, count), generator=generator).float() * 2 - 1).to(device)
    return torch.randn(n, count, generator=generator).to(device)


def top_eigenvalues(hvp, n, k=3, iters=100, tol=1e-5, generator=None, device="cpu", verbose=False):
    """The k eigenvalues of largest magnitude (signed), by block power iteration with Rayleigh–Ritz:
    V ← orth(H V) on a block of k + max(2, k) vectors; the Ritz values of VᵀHV converge like
    (|λ_{block+1}| / |λ_i|)^(2t) and, unlike one-vector power iteration with deflation, close or ±equal
    eigenvalues inside the block do not slow it down. Stops when the top-k Ritz values move less than
    tol (relative). Returns (eigenvalues, eigenvectors (n, k), iterations)."""
    block = min(n, k + max(2, k))
    V = torch.linalg.qr(_random_vectors(n, block, generator, device))[0]
    previous = None
    for it in range(1, iters + 1):
        HV = torch.stack([hvp(V[:, j]) for j in range(block)], dim=1)
        T = (V.T @ HV).double().cpu()
        ritz, rotation = torch.linalg.eigh((T + T.T) / 2)
        order = ritz.abs().argsort(descending=True)
        ritz, rotation = ritz[order], rotation[:, order].to(device=device, dtype=V.dtype)
        vectors = V @ rotation[:, :k]
        V = torch.linalg.qr(HV @ rotation)[0]
        progress("power iteration", it, iters, verbose)
        if previous is not None and ((ritz[:k] - previous).abs() <= tol * ritz[:k].abs()).all():
            progress("power iteration", iters, iters, verbose)
            break
        previous = ritz[:k]
    return ritz[:k].numpy(), vectors, it


def hutchinson_trace(hvp, n, n_probes=100, generator=None, device="cpu", verbose=False):
    """tr H ≈ mean of vᵀHv over Rademacher probes v (variance 2 Σ_{i≠j} H_ij² per probe).
    Returns the samples."""
    samples = []
    for i in range(n_probes):
        v = _random_vectors(n, 1, generator, device, rademacher=True)[:, 0]
        samples.append(torch.dot(v, hvp(v)).item())
        progress("Hutchinson probes", i + 1, n_probes, verbose)
    return np.array(samples)


def lanczos(hvp, n, m, generator=None, device="cpu"):
    """m steps of Lanczos with full reorthogonalisation from a normalised Rademacher vector. Returns the
    Ritz values θ_j (nodes) and weights τ_j = (first component of the j-th eigenvector of T)²: the
    Gauss quadrature of the spectral measure vᵀδ(λ − H)v, whose expectation is the eigenvalue density."""
    Q = [_random_vectors(n, 1, generator, device, rademacher=True)[:, 0] / math.sqrt(n)]
    alphas, betas = [], []
    for j in range(min(m, n)):
        w = hvp(Q[-1])
        alphas.append(torch.dot(w, Q[-1]).item())
        basis = torch.stack(Q, dim=1)
        for _ in range(2):  # twice is enough (Kahan–Parlett)
            w = w - basis @ (basis.T @ w)
        beta = w.norm().item()
        if j == min(m, n) - 1 or beta < 1e-6 * max(1.0, abs(alphas[-1])):  # Krylov space exhausted (fp32)
            break
        betas.append(beta)
        Q.append(w / beta)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        T += torch.diag(off, 1) + torch.diag(off, -1)
    nodes, U = torch.linalg.eigh(T)
    return nodes.numpy(), (U[0] ** 2).numpy()


def slq_density(nodes, weights, bandwidth=0.01, n_grid=2000):
    """Σ_j w_j N(λ; θ_j, s²) on a grid covering [min θ − 6s, max θ + 6s], s = bandwidth · (max θ − min θ).
    The weights of one Lanczos run sum to 1, so the density integrates to 1."""
    lo, hi = nodes.min(), nodes.max()
    s = bandwidth * max(hi - lo, 1e-12 * max(1.0, abs(hi)))
    grid = np.linspace(lo - 6 * s, hi + 6 * s, n_grid)
    density = (weights[None, :] * np.exp(-0.5 * ((grid[:, None] - nodes[None, :]) / s) ** 2)).sum(1)
    return grid, density / (s * math.sqrt(2 * math.pi))


def hessian_spectrum(model, batches, top_k=3, power_iters=100, tol=1e-4, n_probes=100,
                     lanczos_iters=60, n_slq=2, bandwidth=0.01, seed=0, verbose=False):
    """Spectrum of the Hessian of the mean loss over batches: top_k eigenvalues by magnitude (power
    iteration), the trace (Hutchinson, n_probes) and the eigenvalue density (SLQ: n_slq Lanczos runs of
    lanczos_iters steps). Set n_probes or lanczos_iters to 0 to skip a part. Runs model in eval mode;
    use analysis_model(model) for a GPT. Returns (summary, arrays)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    hvp, n, loss = hessian_vector_product(model, batches)
    device = next(model.parameters()).device
    eigenvalues, _, iterations = top_eigenvalues(hvp, n, top_k, power_iters, tol, generator, device, verbose)
    summary = {"n_params": n, "loss": loss, "top_eigenvalues": eigenvalues.tolist(), "power_iterations": iterations}
    arrays = {"top_eigenvalues": eigenvalues}
    if n_probes:
        samples = hutchinson_trace(hvp, n, n_probes, generator, device, verbose)
        summary.update(trace=float(samples.mean()), trace_stderr=float(samples.std(ddof=1) / math.sqrt(n_probes)))
        arrays["hutchinson_samples"] = samples
    if lanczos_iters:
        runs = []
        for r in range(n_slq):
            runs.append(lanczos(hvp, n, lanczos_iters, generator, device))
            progress("Lanczos runs", r + 1, n_slq, verbose)
        nodes = np.concatenate([nd for nd, _ in runs])
        weights = np.concatenate([w for _, w in runs]) / n_slq
        grid, density = slq_density(nodes, weights, bandwidth)
        # n Σ w_j θ_j estimates tr H like Hutchinson does; the bulk sits at ≈ 0 with either sign, so the
        # negative mass counts only nodes below −1% of the spectral radius
        summary.update(slq_lambda_min=float(nodes.min()), slq_lambda_max=float(nodes.max()),
                       slq_trace=float(n * (weights * nodes).sum()),
                       slq_mass_negative=float(weights[nodes < -0.01 * np.abs(nodes).max()].sum()))
        arrays.update(slq_nodes=nodes, slq_weights=weights, density_grid=grid, density=density)
    model.train(was_training)
    return summary, arrays


# ----------------------------------------------------------------------------------------------------
# gradients: stable rank, and the gradient noise scale (McCandlish et al. 2018, appendix A.1)

def noise_scale(sq_norm_small, sq_norm_big, b_small, b_big):
    """Unbiased estimates from E|G_B|² = |G|² + tr(Σ)/B at two batch sizes:
        |G|² ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
        tr Σ ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
    and B_simple = tr Σ / |G|² (a ratio of unbiased estimates: average each over steps before dividing)."""
    G_sq = (b_big * sq_norm_big - b_small * sq_norm_small) / (b_big - b_small)
    tr_sigma = (sq_norm_small - sq_norm_big) / (1 / b_small - 1 / b_big)
    return {"G_sq": G_sq, "tr_sigma": tr_sigma, "B_simple": tr_sigma / G_sq if G_sq > 0 else float("nan")}


def gradient_stats(model, batches):
    """batches: k ≥ 2 micro-batches [(x, y), ...] of b sequences each, at fixed parameters.
    |G_small|² = mean_i |g_i|² (B_small = b), |G_big|² = |mean_i g_i|² (B_big = k·b), in sequences;
    plus, for every 2-D parameter, the stable rank ‖G‖_F²/‖G‖₂² of the big-batch gradient (GaLore).
    Returns (summary, arrays {name: singular values of the big-batch gradient})."""
    sizes = {x.shape[0] for x, _ in batches}
    if len(batches) < 2 or len(sizes) != 1:
        raise ValueError(f"gradient_stats needs >= 2 micro-batches of one size, got sizes "
                         f"{[x.shape[0] for x, _ in batches]}: split the batch evenly")
    names, params = zip(*[(nm, p) for nm, p in model.named_parameters() if p.requires_grad])
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    sq_small = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.float() for g, p in zip(grads, params)]
        sq_small += sum(g.pow(2).sum().item() for g in grads) / len(batches)
        for t, g in zip(total, grads):
            t += g / len(batches)
    sq_big = sum(t.pow(2).sum().item() for t in total)
    b = sizes.pop()
    summary = {"b_small": b, "b_big": b * len(batches), "sq_norm_small": sq_small, "sq_norm_big": sq_big,
               **noise_scale(sq_small, sq_big, b, b * len(batches)), "matrices": {}}
    arrays = {}
    for name, G in zip(names, total):
        if G.ndim == 2:
            s = torch.linalg.svdvals(G).cpu().double().numpy()
            arrays[name] = s
            summary["matrices"][name] = {"stable_rank": float((s ** 2).sum() / max(s[0] ** 2, 1e-300)),
                                         "spectral_norm": float(s[0]), "frobenius": float(np.sqrt((s ** 2).sum()))}
    return summary, arrays


def curvature_noise_scale(model, batches):
    """The noise scale that predicts the best step (McCandlish et al. 2018, eqs. 2.6-2.8), from k ≥ 2
    micro-batches of b sequences: B_noise = tr(HΣ) / GᵀHG, η_opt(B) = η_max / (1 + B_noise/B) with
    η_max = |G|² / GᵀHG, and the best one-step loss drop ΔL_max = ½ |G|⁴ / GᵀHG. The two-batch-size
    estimator of noise_scale in the H-norm: E gᵀHg = GᵀHG + tr(HΣ)/B, with gᵢᵀHgᵢ (B = b) and ḡᵀHḡ
    (B = kb) from k + 1 Hessian-vector products; H is the Hessian of the mean loss over the same batches.
    B_simple = tr Σ / |G|² from the same gradients. In sequences. B_noise, η_max and ΔL_max are nan where
    GᵀHG ≤ 0: the loss has no minimum along G there (early training, see the Hessian section). Returns a dict."""
    sizes = {x.shape[0] for x, _ in batches}
    if len(batches) < 2 or len(sizes) != 1:
        raise ValueError(f"curvature_noise_scale needs >= 2 micro-batches of one size, got sizes "
                         f"{[x.shape[0] for x, _ in batches]}: split the batch evenly")
    b, k = sizes.pop(), len(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for x, y in batches:
        g = torch.autograd.grad(model(x, y)[1], params, allow_unused=True)
        grads.append(torch.cat([(gi if gi is not None else torch.zeros_like(p)).reshape(-1).float()
                                for gi, p in zip(g, params)]))
    mean = torch.stack(grads).mean(0)
    hvp = hessian_vector_product(model, batches)[0]
    plain = noise_scale(sum(g.pow(2).sum().item() for g in grads) / k, mean.pow(2).sum().item(), b, k * b)
    curved = noise_scale(sum(torch.dot(g, hvp(g)).item() for g in grads) / k, torch.dot(mean, hvp(mean)).item(),
                         b, k * b)
    G_sq, GHG = plain["G_sq"], curved["G_sq"]
    return {"b_small": b, "b_big": k * b, "G_sq": G_sq, "tr_sigma": plain["tr_sigma"], "B_simple": plain["B_simple"],
            "GHG": GHG, "tr_H_sigma": curved["tr_sigma"],
            "B_noise": curved["tr_sigma"] / GHG if GHG > 0 else float("nan"),
            "eta_max": G_sq / GHG if GHG > 0 else float("nan"),
            "delta_L_max": 0.5 * G_sq ** 2 / GHG if GHG > 0 else float("nan")}


# ----------------------------------------------------------------------------------------------------
# ns: the Newton–Schulz polynomial of optim.msign, acting on one singular value of G/‖G‖_F

def ns_response(coeffs="jordan", steps=5, xs=None):
    """Each Newton–Schulz step maps a singular value x of X = G/‖G‖_F to a x + b x³ + c x⁵ (the (a, b, c)
    of optim.NS_COEFFS[coeffs], step by step). Returns (summary, arrays): arrays["ys"] is (steps + 1,
    len(xs)), row t the value after t steps; the summary gives the one-step peak on [0, 1], the slope
    at 0 after all steps (Π a_t), and the output range for inputs ≥ 1e-3 and ≥ 1e-2."""
    schedule = optim.ns_schedule(steps, coeffs)
    xs = np.logspace(-6, 0, 1201) if xs is None else np.asarray(xs, dtype=np.float64)

    def iterate(x, triples):
        trajectory = [x]
        for a, b, c in triples:
            x = a * x + b * x ** 3 + c * x ** 5
            trajectory.append(x)
        return np.stack(trajectory)

    ys = iterate(xs, schedule)
    fine = np.linspace(0.0, 1.0, 200001)
    first = iterate(fine, schedule[:1])[1]
    final = iterate(fine[1:], schedule)[-1]
    summary = {"coeffs": coeffs, "steps": steps,
               "one_step_peak": float(first.max()), "one_step_argmax": float(fine[first.argmax()]),
               "slope_at_zero": float(np.prod([a for a, _, _ in schedule])),
               "range_above_1e-3": [float(final[fine[1:] >= 1e-3].min()), float(final[fine[1:] >= 1e-3].max())],
               "range_above_1e-2": [float(final[fine[1:] >= 1e-2].min()), float(final[fine[1:] >= 1e-2].max())]}
    return summary, {"xs": xs, "ys": ys}


# ----------------------------------------------------------------------------------------------------
# hc: hyper-connection mixing matrices H_res and their product down the depth

def _capture_inputs(model, module_type, idx):
    """Run model(idx) once and return [(name, module, first positional input)] for every module of
    module_type, in call order."""
    captured, handles = [], []
    for name, module in model.named_modules():
        if isinstance(module, module_type):
            hook = lambda m, args, name=name: captured.append((name, m, args[0]))
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def hc_spectra(model, idx):
    """For each HyperConnection (each sublayer, in depth order) on the stream states of one forward pass
    of idx: singular values and eigenvalue moduli of H_res per token, its row/column-sum errors and
    smallest entry, and ‖P_l‖₂ per token for the running product P_l = H_res^(l) ⋯ H_res^(1), which maps
    the embedding streams to layer l's (doubly stochastic kinds keep it ≤ 1, plain hc can drift).
    Returns (summary, arrays); (None, {}) for a model without hyper-connections."""
    captured = _capture_inputs(model, HyperConnection, idx)
    if not captured:
        return None, {}
    layers, svals, eig_moduli, prod_norms = [], [], [], []
    product = None
    for name, module, X in captured:
        H_res = module.mixing_matrices(X)[2].double().flatten(0, -3)  # (tokens, n, n)
        n = H_res.size(-1)
        product = H_res if product is None else H_res @ product
        s = torch.linalg.svdvals(H_res)
        prod_norm = torch.linalg.matrix_norm(product, ord=2)
        ones = torch.ones(n, dtype=torch.float64, device=H_res.device)
        layers.append({"name": name, "sigma_max": s[:, 0].max().item(), "sigma_min": s[:, -1].min().item(),
                       "row_sum_error": (H_res @ ones - 1).abs().max().item(),
                       "col_sum_error": (ones @ H_res - 1).abs().max().item(),
                       "min_entry": H_res.min().item(),
                       "prod_norm_max": prod_norm.max().item(), "prod_norm_mean": prod_norm.mean().item()})
        svals.append(s.cpu().numpy())
        eig_moduli.append(torch.linalg.eigvals(H_res).abs().cpu().numpy())
        prod_norms.append(prod_norm.cpu().numpy())
    summary = {"kind": captured[0][1].kind, "n_streams": n, "layers": layers,
               "final_prod_norm_max": layers[-1]["prod_norm_max"]}
    return summary, {"sigma": np.stack(svals), "eig_moduli": np.stack(eig_moduli), "prod_norm": np.stack(prod_norms)}


# ----------------------------------------------------------------------------------------------------
# gates: the spectral clip of Gated DeltaNet-2

@torch.no_grad()
def gdn2_gates(model, idx):
    """For each GatedDelta mixer on one forward pass of idx, per token and head, with a = k, c = b⊙k:
    ρ = ‖I − a cᵀ‖₂ = (η + sqrt(η² − 4 a·c + 4)) / 2, η = ‖a‖‖c‖ (kernels.gdn2_log_rho); the
    fraction of decay entries the clip g ← min(g, −log ρ) (kernels.gdn2_decay_clip) changes, whether
    or not the model applies it (gdn_clip); and the largest ‖(I − a cᵀ) Diag(exp g)‖₂ (by SVD) before
    and after the clip. Returns (summary, arrays); (None, {}) for a model without G mixers."""
    captured = _capture_inputs(model, GatedDelta, idx)
    if not captured:
        return None, {}
    layers, rhos = [], []
    for name, mixer, x in captured:
        _, k, _, _, b, _ = mixer.recurrence_inputs(x)
        g = mixer.log_decay(x).expand_as(k).float()
        clipped = kernels.gdn2_decay_clip(g, k, b, kernels="torch")
        a, c = k.double(), (b * k).double()
        rho = kernels.gdn2_log_rho(k, b).squeeze(-1).double().exp()
        transition = torch.eye(a.size(-1), dtype=torch.float64, device=a.device) - a.unsqueeze(-1) * c.unsqueeze(-2)
        before = torch.linalg.matrix_norm(transition * g.double().exp().unsqueeze(-2), ord=2)
        after = torch.linalg.matrix_norm(transition * clipped.double().exp().unsqueeze(-2), ord=2)
        layers.append({"name": name, "variant": mixer.variant, "clip_in_model": mixer.clip,
                       "rho_mean": rho.mean().item(), "rho_max": rho.max().item(),
                       "frac_clipped": (clipped < g).float().mean().item(),
                       "max_transition_norm": before.max().item(), "max_transition_norm_clipped": after.max().item()})
        rhos.append(rho.flatten().cpu().numpy())
    return {"layers": layers}, {"rho": np.stack(rhos)}


# ----------------------------------------------------------------------------------------------------
# isotropy: the second moment of each linear layer's input

@torch.no_grad()
def isotropy(model, idx):
    """Eigenvalues of C = XᵀX / N for the input X (N tokens × d_in) of every nn.Linear on one forward
    pass of idx (layers fed the same tensor, like q/k/v, are listed once). With C ∝ I, steepest descent
    on W is also steepest descent on the layer's output features. Summaries: participation ratio
    (Σλ)² / (d Σλ²) ∈ [1/d, 1] (1 = isotropic), λ_max / mean λ, and λ_max / λ_min.
    Returns (summary {name: dict}, arrays {name: eigenvalues, descending})."""
    captured = _capture_inputs(model, nn.Linear, idx)
    summary, arrays, seen = {}, {}, []
    for name, _, x in captured:
        if any(x is other for other in seen):
            continue
        seen.append(x)
        X = x.reshape(-1, x.size(-1)).double()
        lam = torch.linalg.eigvalsh(X.T @ X / X.size(0)).flip(0).clamp(min=0).cpu().numpy()
        d = len(lam)
        summary[name] = {"d_in": d, "participation_ratio": float(lam.sum() ** 2 / (d * (lam ** 2).sum())),
                         "top_over_mean": float(lam[0] / lam.mean()),
                         "condition": float(lam[0] / max(lam[-1], 1e-12 * lam[0]))}
        arrays[name] = lam
    return summary, arrays


# ----------------------------------------------------------------------------------------------------
# width transfer: muP's coordinate check and a learning-rate sweep over widths (Yang, Simon & Bernstein
# 2023): spectral init with optim.spectral_lr_scale against GPT-2 init, AdamW and Muon

TRANSFER_WIDTHS = (64, 128, 256, 512)
TRANSFER_LRS = {"adamw": (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), "muon": (5e-3, 1e-2, 2e-2, 4e-2, 8e-2)}


def coordinate_check(model, optimizer, idx, targets, steps=10):
    """muP's coordinate check for one model: train `steps` steps on the batch (idx, targets), then
    return {"out <name>": RMS of the output of every Linear, Embedding and block on that batch,
    "dW <name>": natural spectral norm of W_after − W_before for every 2-D weight (hyper-connection
    maps excepted; kind "embedding" for wte)}. Run it at several widths: under a width-consistent
    parametrization every entry stays of the same size."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2 and not in_residual(n)}
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
               if not in_residual(n) and (isinstance(m, (nn.Linear, nn.Embedding)) or id(m) in blocks)]
    hooks = [m.register_forward_hook(record("out " + n)) for n, m in watched]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    params = dict(model.named_parameters())
    for n, W0 in before.items():
        stats["dW " + n] = natural_spectral_norm(params[n].detach() - W0, "embedding" if n == "wte.weight" else "dense")
    return stats


def width_model(width, scheme, vocab_size, block_size):
    """2 attention layers without qk_norm, head size 16 (the head count grows with the width), untied lm_head;
    spectral uses the "exact" embedding, whose output has RMS 1 at every width ("stable" is n_embd^-½ by design)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=width // 16,
                          n_embd=width, mixer="A", qk_norm=False, tie_embeddings=False, init=scheme))
    if scheme == "spectral":
        init_weights(model, "spectral", embedding="exact")
    return model


def coordinate_transfer(widths=TRANSFER_WIDTHS, steps=10):
    """coordinate_check at each width (one batch of 4 × 32 random characters, vocabulary 84), gpt2 vs
    spectral + spectral_lr, AdamW (lr 1e-3) and Muon (lr 0.02). Returns (summary {"<optimizer> <scheme>":
    {"values": {key: [per width]}, "spread": {key: largest / smallest}, "max_spread_out",
    "max_spread_dW" (lm_head left out)}}, {})."""
    idx = torch.randint(0, 84, (4, 33), generator=torch.Generator().manual_seed(0))
    summary = {"widths": list(widths), "steps": steps}
    for optimizer, lr in (("adamw", 1e-3), ("muon", 0.02)):
        for scheme in ("gpt2", "spectral"):
            stats = []
            for width in widths:
                model = width_model(width, scheme, 84, 32)
                opt = optim.build_optimizer(model, optimizer, lr=lr, weight_decay=0.0, aux_lr=3e-3,
                                            spectral_lr=scheme == "spectral")
                stats.append(coordinate_check(model, opt, idx[:, :-1], idx[:, 1:], steps=steps))
            values = {key: [s[key] for s in stats] for key in stats[0]}
            spread = {key: max(v) / min(v) for key, v in values.items()}
            summary[f"{optimizer} {scheme}"] = {
                "values": values, "spread": spread,
                **{f"max_spread_{kind}": max(s for k, s in spread.items()
                                             if k.startswith(kind + " ") and "lm_head" not in k)
                   for kind in ("out", "dW")}}
    return summary, {}


def plot_coordinate_transfer(summary, arrays, path):
    plt = _pyplot()
    widths = summary["widths"]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for row, optimizer in enumerate(("adamw", "muon")):
        for col, (scheme, prefix, what) in enumerate((("gpt2", "out ", "RMS of layer outputs"),
                                                      ("spectral", "out ", "RMS of layer outputs"),
                                                      ("gpt2", "dW ", "‖ΔW‖_nat"),
                                                      ("spectral", "dW ", "‖ΔW‖_nat"))):
            ax, run = axes[row, col], summary[f"{optimizer} {scheme}"]
            if col % 2:
                ax.sharey(axes[row, col - 1])
            for key, values in run["values"].items():
                if key.startswith(prefix):
                    color = "tab:red" if "lm_head" in key else "tab:green" if "wte" in key else "tab:blue"
                    ax.plot(widths, values, marker="o", lw=1, color=color, alpha=0.7)
            label = "gpt2" if scheme == "gpt2" else "spectral + spectral_lr"
            ax.set(xscale="log", yscale="log", xlabel="n_embd",
                   title=f"{optimizer}, {label}\n{what}: max spread {run['max_spread_' + prefix.strip()]:.1f}x")
            ax.set_xticks(widths, [str(w) for w in widths])
            ax.minorticks_off()
    fig.suptitle(f"Coordinate check after {summary['steps']} steps, one line per layer (blue: blocks, "
                 "green: embedding, red: lm_head, left out of the spreads)")
    _save(plt, fig, path)


def show_coordinate_transfer(summary):
    print(f"coord: largest / smallest over widths {summary['widths']} after {summary['steps']} steps "
          "(lm_head left out)")
    for optimizer in ("adamw", "muon"):
        for scheme in ("gpt2", "spectral"):
            run = summary[f"{optimizer} {scheme}"]
            print(f"  {optimizer:5s} {scheme:8s}: layer output RMS spread {run['max_spread_out']:.2f}x, "
                  f"‖ΔW‖_nat spread {run['max_spread_dW']:.2f}x")


def lr_transfer(dataset="shakespeare_char", tokenizer="auto", widths=(64, 256), steps=200, batch_size=8, block_size=64,
                optimizers=tuple(TRANSFER_LRS)):
    """Val loss after `steps` steps for each lr of TRANSFER_LRS at each width, gpt2 vs spectral +
    spectral_lr, on train.py's schedule (optim.lr_multiplier): warmup 20 steps, then a cosine to 0.1 of the peak;
    Muon's AdamW part at lr 3e-3. About 10 minutes per optimizer on one CPU core. Returns (summary, {})."""
    train_tokens, val_tokens, meta = data.load_dataset(dataset, tokenizer)
    val_sampler = data.BatchSampler(val_tokens, batch_size, block_size, seed=123)
    val_batches = [val_sampler.next_batch() for _ in range(8)]
    summary = {}
    for optimizer in optimizers:
        lrs = TRANSFER_LRS[optimizer]
        for scheme in ("spectral", "gpt2"):
            for width in widths:
                losses = []
                for lr in lrs:
                    model = width_model(width, scheme, meta["vocab_size"], block_size)
                    opt = optim.build_optimizer(model, optimizer, lr=lr, weight_decay=0.0, aux_lr=3e-3,
                                                spectral_lr=scheme == "spectral")
                    sampler = data.BatchSampler(train_tokens, batch_size, block_size, seed=1)
                    for it in range(steps):
                        mult = optim.lr_multiplier(it, steps, warmup=20, floor=0.1, schedule="cosine", decay_frac=0.0)
                        for group in opt.param_groups:
                            group["lr"] = group["base_lr"] * mult
                        _, loss = model(*sampler.next_batch())
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        losses.append(sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches))
                summary[f"{optimizer} {scheme} {width}"] = {"lrs": list(lrs), "losses": losses,
                                                            "best_lr": lrs[losses.index(min(losses))]}
    return summary, {}


def plot_lr_transfer(summary, arrays, path):
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, optimizer in zip(axes, TRANSFER_LRS):
        for key, run in summary.items():
            if key.startswith(optimizer + " "):
                ax.semilogx(run["lrs"], run["losses"], "o-" if " spectral " in key else "s--",
                            label=key[len(optimizer) + 1:])
        ax.set(xlabel="lr", ylabel="val loss", title=optimizer)
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def show_lr_transfer(summary):
    for key, run in summary.items():
        print(f"lr_transfer {key}: " + "  ".join(f"lr {lr:g}: {v:.4f}" for lr, v in zip(run["lrs"], run["losses"]))
              + f"   best {run['best_lr']:g}")


# ----------------------------------------------------------------------------------------------------
# sparsity: exact zeros in the attention weights (sparsemax attention makes them; softmax only by underflow)

@torch.no_grad()
def attention_sparsity(model, batch):
    """Fraction of exact zeros in each attention layer's weights, per head, over the causal entries (key s ≤
    query t) of one forward pass of batch = (x, y) (or x alone), on analysis_model(model): softmax for sdpa and
    math models, sparsemax for sparsemax ones: each layer's Attention.attention_weights on the input it got (a
    forward pre-hook). Returns (summary, arrays); (None, {}) for a model without attention."""
    twin = analysis_model(model)
    names = [name for name, module in twin.named_modules() if isinstance(module, Attention)]
    if not names:
        return None, {}
    idx = batch[0] if isinstance(batch, (tuple, list)) else batch
    kind = twin.config.attention
    inputs = []  # each attention layer's input and positions, for its attention_weights
    hooks = [twin.get_submodule(name).register_forward_pre_hook(lambda m, args: inputs.append((m, *args[:2])))
             for name in names]
    try:
        twin(idx.to(next(twin.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    layers, fractions = [], []
    for name, (module, x, rope) in zip(names, inputs):
        weights = module.attention_weights(x, rope)
        B, _, T, S = weights.shape
        causal = torch.ones(T, S, dtype=torch.bool, device=weights.device).tril(S - T)
        zeros = ((weights == 0) & causal).sum((0, 2, 3)).double() / (B * causal.sum())
        layers.append({"name": name, "zero_frac": zeros.mean().item(), "zero_frac_per_head": zeros.tolist(),
                       "mean_keys_used": (weights > 0).sum(-1).double().mean().item()})  # nonzero weights per query
        fractions.append(zeros.cpu().numpy())
    summary = {"attention": "sparsemax" if kind == "sparsemax" else "softmax", "layers": layers,
               "zero_frac": float(np.mean([layer["zero_frac"] for layer in layers]))}
    return summary, {"zero_frac": np.stack(fractions)}


# ----------------------------------------------------------------------------------------------------
# plots: one PNG per section

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path):
    """Write the figure to a temporary name, then rename: a crash never leaves half a PNG. The PNG is titled by its
    name (a section's: weights.png is "weights"), on the figure where it has no title of its own and in the file's
    Title field."""
    title = os.path.splitext(os.path.basename(path))[0]
    if not fig.get_suptitle():
        fig.suptitle(title)
    fig.tight_layout()
    data.atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png", metadata={"Title": title}))
    plt.close(fig)


def plot_losses(log_path, png_path):
    """train.py's loss.png: the training loss (every log line) and the validation loss (every eval) against the step."""
    plt = _pyplot()
    rows, _ = runs.read_jsonl(log_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "train"), ("val", "val")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, marker="." if key == "val" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if ax.lines:  # a run stopped in its first eval has logged nothing yet
        ax.legend()
    _save(plt, fig, png_path)


def _mp_density(lam, sigma2, gamma):
    lo, hi = sigma2 * (1 - math.sqrt(gamma)) ** 2, sigma2 * (1 + math.sqrt(gamma)) ** 2
    inside = (lam > lo) & (lam < hi)
    out = np.zeros_like(lam)
    out[inside] = np.sqrt((hi - lam[inside]) * (lam[inside] - lo)) / (2 * np.pi * sigma2 * gamma * lam[inside])
    return out


def plot_weights(summary, arrays, path):
    """Natural spectral norms and stable ranks of every matrix, then the eigenvalue histograms (λ = s²/N)
    of the first and last block's matrices and the embedding against their fitted MP density."""
    plt = _pyplot()
    names = list(summary)
    blocks = sorted({nm.split(".")[1] for nm in names if nm.startswith("blocks.")}, key=int)
    shown = [nm for nm in names if math.isfinite(summary[nm]["mp_entry_std"]) and
             (not nm.startswith("blocks.") or nm.split(".")[1] in (blocks[:1] + blocks[-1:]))][:14]
    cols = 4
    rows = 1 + math.ceil(len(shown) / cols)
    fig = plt.figure(figsize=(4 * cols, 3.2 * rows))
    ax = fig.add_subplot(rows, 2, 1)
    ax.plot([summary[nm]["natural_spectral_norm"] for nm in names], "o")
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_title("natural spectral norm (spectral condition: Θ(1))")
    ax.set_xticks(range(len(names)), [nm.replace("blocks.", "").replace(".weight", "") for nm in names],
                  rotation=90, fontsize=6)
    ax = fig.add_subplot(rows, 2, 2)
    ax.plot([summary[nm]["stable_rank"] / min(summary[nm]["shape"]) for nm in names], "o",
            label="stable rank / min dim")
    ax.plot([summary[nm]["n_spikes"] / min(summary[nm]["shape"]) for nm in names], "x", label="MP spikes / min dim")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_xticks(range(len(names)), [nm.replace("blocks.", "").replace(".weight", "") for nm in names],
                  rotation=90, fontsize=6)
    for i, nm in enumerate(shown):
        ax = fig.add_subplot(rows, cols, cols + i + 1)
        N, M = max(summary[nm]["shape"]), min(summary[nm]["shape"])
        lam = arrays[nm] ** 2 / N
        log_lam = np.log10(np.maximum(lam, lam[0] * 1e-12))
        ax.hist(log_lam, bins=60, density=True, alpha=0.6)  # log axis: the bulk and the spikes both show
        grid = np.linspace(log_lam.min(), log_lam.max(), 400)
        ax.plot(grid, _mp_density(10 ** grid, summary[nm]["mp_entry_std"] ** 2, M / N) * 10 ** grid * math.log(10),
                "r-", lw=1, label="MP fit")
        ax.axvline(math.log10(summary[nm]["spike_threshold"] ** 2 / N), color="k", ls=":", lw=1,
                   label="spike threshold")
        ax.set_xlabel("log10 λ,  λ = s² / max(shape)", fontsize=6)
        ax.set_title(f"{nm.replace('.weight', '')}\nspikes {summary[nm]['n_spikes']}, "
                     f"α {summary[nm]['alpha']:.1f}", fontsize=8)
        ax.tick_params(labelsize=6)
        if i == 0:
            ax.legend(fontsize=6)
    _save(plt, fig, path)


def plot_hessian(summary, arrays, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if "density" in arrays:
        ax.semilogy(arrays["density_grid"], arrays["density"] + 1e-12)
        ax.set_ylim(bottom=max(1e-6, arrays["density"].max() * 1e-7))
    for lam in arrays["top_eigenvalues"]:
        ax.axvline(lam, color="r", ls="--", lw=1)
    trace = f", trace ≈ {summary['trace']:.3g} ± {summary['trace_stderr']:.2g}" if "trace" in summary else ""
    ax.set_title(f"Hessian eigenvalue density (SLQ), top eigenvalues dashed{trace}", fontsize=9)
    ax.set_xlabel("eigenvalue")
    _save(plt, fig, path)


def plot_gradients(summary, arrays, path):
    plt = _pyplot()
    names = list(summary["matrices"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.plot([summary["matrices"][nm]["stable_rank"] for nm in names], "o")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(names)), [nm.replace("blocks.", "").replace(".weight", "") for nm in names],
                   rotation=90, fontsize=6)
    ax1.set_title(f"gradient stable rank; B_simple ≈ {summary['B_simple']:.3g} sequences "
                  f"(B_small {summary['b_small']}, B_big {summary['b_big']})", fontsize=9)
    ratios = np.concatenate([arrays[nm] / max(np.sqrt((arrays[nm] ** 2).sum()), 1e-300) for nm in names])
    ax2.hist(np.log10(np.maximum(ratios, 1e-12)), bins=80)
    ax2.set_xlabel("log10 σ_i / ‖G‖_F  (what Newton–Schulz sees)")
    _save(plt, fig, path)


def plot_ns(summary, arrays, path):
    """summary {coeffs: ns_response summary}, arrays "<coeffs>.xs"/"<coeffs>.ys" and, when the
    gradients section ran, "gradient_ratios" (σ_i/‖G‖_F of the real gradients)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.linspace(0, 1.05, 500)
    ax1.plot(x, x, color="gray", lw=0.8, ls=":")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    for coeffs, s in summary.items():
        a, b, c = optim.ns_schedule(1, coeffs)[0]
        ax1.plot(x, a * x + b * x ** 3 + c * x ** 5, label=f"{coeffs}: peak {s['one_step_peak']:.4f} "
                                                           f"at {s['one_step_argmax']:.4f}")
        ax2.semilogx(arrays[f"{coeffs}.xs"], arrays[f"{coeffs}.ys"][-1], label=f"{coeffs}, {s['steps']} steps "
                                                                            f"(slope at 0: {s['slope_at_zero']:.0f})")
    ax1.set_title("one Newton–Schulz step on a singular value", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_title("after all steps: input σ/‖G‖_F → output singular value", fontsize=9)
    ax2.legend(fontsize=7, loc="upper left")
    model_ratios = arrays.get("gradient_ratios")
    if model_ratios is not None and len(model_ratios):
        twin = ax2.twinx()
        twin.hist(model_ratios, bins=np.logspace(-6, 0, 80), color="k", alpha=0.2)
        twin.set_ylabel("gradient singular values (count)", fontsize=7)
    _save(plt, fig, path)


def plot_hc(summary, arrays, path):
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    depth = np.arange(1, len(summary["layers"]) + 1)
    ax1.plot(depth, arrays["prod_norm"].max(1), "o-", label="max over tokens")
    ax1.plot(depth, arrays["prod_norm"].mean(1), "s-", label="mean over tokens")
    ax1.axhline(1.0, color="gray", ls="--", lw=1)
    ax1.set_xlabel("sublayer")
    ax1.set_title(f"‖H_res^(l) ⋯ H_res^(1)‖₂  ({summary['kind']}, n = {summary['n_streams']})", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.plot(depth, arrays["sigma"][:, :, 0].max(1), "o-", label="σ_max (max over tokens)")
    ax2.plot(depth, arrays["sigma"][:, :, -1].min(1), "s-", label="σ_min (min over tokens)")
    ax2.plot(depth, arrays["eig_moduli"].min(-1).min(1), "^-", label="min |eigenvalue|")
    ax2.set_xlabel("sublayer")
    ax2.set_title("spectrum of each H_res", fontsize=9)
    ax2.legend(fontsize=7)
    _save(plt, fig, path)


def plot_gates(summary, arrays, path):
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for layer, rho in zip(summary["layers"], arrays["rho"]):
        ax1.hist(rho, bins=60, histtype="step", label=layer["name"])
    ax1.set_xlabel("ρ = ‖I − k (b⊙k)ᵀ‖₂")
    ax1.legend(fontsize=6)
    depth = np.arange(len(summary["layers"]))
    ax2.plot(depth, [layer["max_transition_norm"] for layer in summary["layers"]], "o-",
             label="max ‖(I − a cᵀ)D‖₂")
    ax2.plot(depth, [layer["max_transition_norm_clipped"] for layer in summary["layers"]], "s-", label="after the clip")
    ax2.plot(depth, [layer["frac_clipped"] for layer in summary["layers"]], "^-", label="fraction of decays clipped")
    ax2.axhline(1.0, color="gray", ls="--", lw=1)
    ax2.set_xlabel("G layer")
    ax2.legend(fontsize=7)
    _save(plt, fig, path)


def plot_isotropy(summary, arrays, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("viridis")
    for i, (name, lam) in enumerate(arrays.items()):
        ax.semilogy(np.arange(1, len(lam) + 1) / len(lam), np.maximum(lam / lam.mean(), 1e-12),
                    color=cmap(i / max(1, len(arrays) - 1)), lw=1,
                    label=name if i in (0, len(arrays) - 1) else None)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_xlabel("eigenvalue index / d_in")
    ax.set_ylabel("λ / mean λ")
    ax.set_title("layer-input second-moment spectra (flat = isotropic); colour = depth", fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_sparsity(summary, arrays, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    image = ax.imshow(arrays["zero_frac"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax)
    ax.set_xticks(range(arrays["zero_frac"].shape[1]))
    ax.set_yticks(range(arrays["zero_frac"].shape[0]))
    ax.set_xlabel("head")
    ax.set_ylabel("attention layer")
    ax.set_title(f"fraction of exact zeros in the causal attention weights ({summary['attention']})", fontsize=9)
    _save(plt, fig, path)


# ----------------------------------------------------------------------------------------------------
# the sections: one row each in SECTIONS (a new section is its function and its row)

def _jsonable(x):
    return json.loads(json.dumps(x, default=float, allow_nan=True))


def _write_json(path, obj):
    data.atomic_write_bytes(path, json.dumps(_jsonable(obj), indent=1).encode())


def ns_section(model, inputs):
    """ns_response for every coefficient set; with the gradients section's results, also the share of
    the real gradients' directions that msign leaves below 0.5."""
    summary, arrays = {}, {}
    ratios = None
    if "gradients" in inputs:
        grads = inputs["gradients"][1]
        ratios = np.concatenate([sv / max(np.sqrt((sv ** 2).sum()), 1e-300) for nm, sv in grads.items()
                                 if optim.is_block_matrix(nm, model.get_parameter(nm))])
        arrays["gradient_ratios"] = ratios
    for coeffs in optim.NS_COEFFS:
        summary[coeffs], a = ns_response(coeffs)
        arrays.update({f"{coeffs}.xs": a["xs"], f"{coeffs}.ys": a["ys"]})
        if ratios is not None:
            out = ns_response(coeffs, xs=ratios)[1]["ys"][-1]
            summary[coeffs]["gradient_frac_below_half"] = float((out < 0.5).mean())
    return summary, arrays


def show_weights(summary):
    print(f"{'matrix':34s} {'shape':>11s} {'σ_max':>7s} {'nat‖W‖':>7s} {'s.rank':>7s} {'spikes':>6s} {'α':>6s}")
    for name, s in summary.items():
        print(f"{name:34s} {'x'.join(map(str, s['shape'])):>11s} {s['sigma_max']:7.3f} "
              f"{s['natural_spectral_norm']:7.3f} {s['stable_rank']:7.2f} {s['n_spikes']:6d} {s['alpha']:6.2f}")


def show_hessian(h):
    line = f"hessian: top eigenvalues {', '.join(f'{v:.4g}' for v in h['top_eigenvalues'])}"
    if "trace" in h:
        line += f"; trace {h['trace']:.4g} ± {h['trace_stderr']:.2g}"
    if "slq_lambda_min" in h:
        line += (f"; SLQ range [{h['slq_lambda_min']:.3g}, {h['slq_lambda_max']:.3g}], trace {h['slq_trace']:.4g}, "
                 f"mass below −1% of the radius {h['slq_mass_negative']:.3f}")
    print(line)


def show_gradients(g):
    ranks = [m["stable_rank"] for m in g["matrices"].values()]
    print(f"gradients: B_simple {g['B_simple']:.4g} sequences (tr Σ {g['tr_sigma']:.3g}, |G|² {g['G_sq']:.3g}; "
          f"B {g['b_small']} vs {g['b_big']}); gradient stable rank median {np.median(ranks):.2f}")


def show_noise(n):
    print(f"noise: B_noise = tr(HΣ)/GᵀHG {n['B_noise']:.4g} sequences (tr HΣ {n['tr_H_sigma']:.3g}, "
          f"GᵀHG {n['GHG']:.3g}), B_simple {n['B_simple']:.4g}; η_max = |G|²/GᵀHG {n['eta_max']:.3g}, "
          f"ΔL_max {n['delta_L_max']:.3g}")


def show_ns(summary):
    for coeffs, s in summary.items():
        extra = (f"; gradient directions left below 0.5: {s['gradient_frac_below_half']:.3f}"
                 if "gradient_frac_below_half" in s else "")
        print(f"ns {coeffs}: one-step peak {s['one_step_peak']:.4f} at {s['one_step_argmax']:.4f}, slope at 0 after "
              f"{s['steps']} steps {s['slope_at_zero']:.1f}, output range for x ≥ 1e-3 "
              f"[{s['range_above_1e-3'][0]:.3f}, {s['range_above_1e-3'][1]:.3f}]{extra}")


def show_hc(h):
    print(f"hc ({h['kind']}): ‖Π H_res‖₂ down the depth "
          + " ".join(f"{layer['prod_norm_max']:.3f}" for layer in h["layers"]))


def show_gates(summary):
    for layer in summary["layers"]:
        print(f"gates {layer['name']}: ρ mean {layer['rho_mean']:.4f} max {layer['rho_max']:.4f}, clipped "
              f"{layer['frac_clipped']:.4f}, max ‖(I−acᵀ)D‖₂ {layer['max_transition_norm']:.4f} → "
              f"{layer['max_transition_norm_clipped']:.4f}")


def show_isotropy(summary):
    print("isotropy (participation ratio, 1 = isotropic): " +
          " ".join(f"{name.replace('blocks.', '').replace('.weight', '')} {s['participation_ratio']:.2f}"
                   for name, s in summary.items()))


def show_sparsity(sp):
    print(f"sparsity ({sp['attention']}): exact zeros in the causal attention weights, per layer " +
          " ".join(f"{layer['zero_frac']:.3f}" for layer in sp["layers"]) + f"; mean {sp['zero_frac']:.3f}; keys "
          "with nonzero weight per query " + " ".join(f"{layer['mean_keys_used']:.2f}" for layer in sp["layers"]))


# The cheap versions of the sections that train.py --analyze_every=N logs: each (model, x, y, step, settings) ->
# a dict merged into that step's JSON record (dicts one level deep); settings as analyze_during_training's.

def weights_during_training(model, x, y, step, settings):
    weights, _ = weight_spectra(model)
    keys = ("sigma_max", "natural_spectral_norm", "stable_rank", "n_spikes")
    return {"weights": {name: {k: s[k] for k in keys} for name, s in weights.items()}}


def hessian_during_training(model, x, y, step, settings):
    n = settings["hessian_sequences"]
    hessian, _ = hessian_spectrum(model, [(x[:n], y[:n])], top_k=1, power_iters=settings["power_iters"], tol=1e-3,
                                  n_probes=0, lanczos_iters=0, seed=step)
    return {"hessian_top": hessian["top_eigenvalues"][0]}


def micro_batches_of(x, y, count):
    """count equal slices of the batch (x, y), or [] when it has fewer than count sequences or count < 2."""
    b = x.size(0) // count
    return [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(count)] if count >= 2 and b >= 1 else []


def gradients_during_training(model, x, y, step, settings):
    batches = micro_batches_of(x, y, settings["micro_batches"])
    if not batches:
        return {}
    grads, _ = gradient_stats(model, batches)
    keys = ("b_small", "b_big", "sq_norm_small", "sq_norm_big", "G_sq", "tr_sigma", "B_simple")
    return {"noise": {k: grads[k] for k in keys},
            "gradient_stable_rank": {name: m["stable_rank"] for name, m in grads["matrices"].items()}}


def noise_during_training(model, x, y, step, settings):
    batches = micro_batches_of(x, y, settings["micro_batches"])
    if not batches:
        return {}
    curvature = curvature_noise_scale(model, batches)
    return {"noise": {k: curvature[k] for k in ("GHG", "tr_H_sigma", "B_noise", "eta_max", "delta_L_max")}}


def hc_during_training(model, x, y, step, settings):
    hc, _ = hc_spectra(model, x)
    return {} if hc is None else {"hc_prod_norm": [layer["prod_norm_max"] for layer in hc["layers"]]}


def gates_during_training(model, x, y, step, settings):
    gates, _ = gdn2_gates(model, x)
    keys = ("rho_max", "frac_clipped", "max_transition_norm")
    return {} if gates is None else {"gates": [{k: layer[k] for k in keys} for layer in gates["layers"]]}


# The price of a section, in forward-backward passes of one micro-batch: a Hessian-vector product is a second
# backward through the first one's graph, about two passes; a forward alone is about a third of one.
HVP_PASSES, FORWARD_PASSES = 2, 1 / 3


def hessian_passes(opts):
    """hessian_spectrum's passes at most: the graph of each of its micro-batches, then every Hessian-vector product
    (power_iters iterations on a block of top_k + max(2, top_k) vectors, unless they converge first; n_probes;
    n_slq × lanczos_iters) over all of them."""
    k = opts["top_k"]
    hvps = opts["power_iters"] * (k + max(2, k)) + opts["n_probes"] + opts["n_slq"] * opts["lanczos_iters"]
    return opts["hessian_batches"] * (1 + HVP_PASSES * hvps)


def noise_passes(opts):
    """curvature_noise_scale's passes: a gradient of each micro-batch, their graph for the Hessian, and k + 1
    Hessian-vector products over all k of them."""
    k = opts["micro_batches"]
    return 2 * k + HVP_PASSES * (k + 1) * k


@dataclasses.dataclass
class Section:
    """run(model, inputs) -> (summary, arrays), summary None where the model lacks the part; inputs holds
    "batches" (micro-batches [(x, y), ...]), "idx" (the first batch's tokens), "opts" (the command-line
    options) and the (summary, arrays) of every earlier section that ran. needs: the earlier sections
    run reads when present. plot(summary, arrays, path) draws <section>.png (None: no plot); show(summary)
    prints. default: run when --sections is not given. during_training: its cheap version for
    train.py --analyze_every (None: not logged during training). Both run under torch.no_grad() (so a section may
    call .numpy() on what the model returns) unless needs_grad: it differentiates (a Hessian, gradients, training)."""
    run: object
    plot: object
    show: object
    needs: tuple = ()
    default: bool = True
    during_training: object = None
    two_batch_sizes: bool = False  # it compares the micro-batches' gradients with their mean's: --micro_batches >= 2
    needs_grad: bool = False       # it differentiates: run with gradients on (every other section under no_grad)
    batches: object = None         # batches(opts): the micro-batches it reads (None: none, it uses no batch)
    passes: object = None          # passes(opts): its work in forward-backward passes of one micro-batch, at most
                                   # (None: nothing priced, its own models' training is not priced either)
    part: tuple = ()               # (module class, what it is): a model without one gives it nothing to analyse


SECTIONS = {  # in run order: a section's needs come before it
    "weights": Section(lambda model, inputs: weight_spectra(model), plot_weights, show_weights,
                       during_training=weights_during_training),
    "hessian": Section(lambda model, inputs: hessian_spectrum(
        model, inputs["batches"][:inputs["opts"]["hessian_batches"]], inputs["opts"]["top_k"],
        inputs["opts"]["power_iters"], n_probes=inputs["opts"]["n_probes"],
        lanczos_iters=inputs["opts"]["lanczos_iters"], n_slq=inputs["opts"]["n_slq"], seed=inputs["opts"]["seed"],
        verbose=True), plot_hessian, show_hessian, during_training=hessian_during_training, needs_grad=True,
        batches=lambda opts: opts["hessian_batches"], passes=hessian_passes),
    "gradients": Section(lambda model, inputs: gradient_stats(model, inputs["batches"]), plot_gradients,
                         show_gradients, during_training=gradients_during_training, two_batch_sizes=True,
                         needs_grad=True, batches=lambda opts: opts["micro_batches"],
                         passes=lambda opts: opts["micro_batches"]),
    "noise": Section(lambda model, inputs: (curvature_noise_scale(model, inputs["batches"]), {}), None, show_noise,
                     during_training=noise_during_training, two_batch_sizes=True, needs_grad=True,
                     batches=lambda opts: opts["micro_batches"], passes=noise_passes),
    "ns": Section(ns_section, plot_ns, show_ns, needs=("gradients",)),
    "hc": Section(lambda model, inputs: hc_spectra(model, inputs["idx"]), plot_hc, show_hc,
                  during_training=hc_during_training, batches=lambda opts: 1, passes=lambda opts: FORWARD_PASSES,
                  part=(HyperConnection, "hyper-connection residuals (a --residual other than res)")),
    "gates": Section(lambda model, inputs: gdn2_gates(model, inputs["idx"]), plot_gates, show_gates,
                     during_training=gates_during_training, batches=lambda opts: 1, passes=lambda opts: FORWARD_PASSES,
                     part=(GatedDelta, "G layers (Gated DeltaNet mixers, G in --mixer)")),
    "isotropy": Section(lambda model, inputs: isotropy(model, inputs["idx"]), plot_isotropy, show_isotropy,
                        batches=lambda opts: 1, passes=lambda opts: FORWARD_PASSES),
    "coord": Section(lambda model, inputs: coordinate_transfer(parse_list(inputs["opts"], "coord_widths", int)),
                     plot_coordinate_transfer, show_coordinate_transfer, default=False, needs_grad=True),
    "lr_transfer": Section(lambda model, inputs: lr_transfer(
        inputs["opts"]["dataset"], inputs["opts"]["tokenizer"], parse_list(inputs["opts"], "lr_transfer_widths", int),
        steps=inputs["opts"]["lr_transfer_steps"]), plot_lr_transfer, show_lr_transfer, default=False,
        needs_grad=True),
    "sparsity": Section(lambda model, inputs: attention_sparsity(model, inputs["batches"][0]), plot_sparsity,
                        show_sparsity, batches=lambda opts: 1, passes=lambda opts: FORWARD_PASSES,
                        part=(Attention, "attention layers (A in --mixer)")),
}
DEFAULT_SECTIONS = [name for name, s in SECTIONS.items() if s.default]


def run_section(name, fn, *args):
    """fn(*args), section name's run or during_training, under torch.no_grad() unless its row declares needs_grad;
    one that differentiates without declaring it gets a one-line error naming it and the rule."""
    if SECTIONS[name].needs_grad:
        with torch.enable_grad():
            return fn(*args)
    try:
        with torch.no_grad():
            return fn(*args)
    except RuntimeError as e:
        if "does not require grad" not in str(e):
            raise
        raise ValueError(f"analyze section {name!r} differentiates, but its row does not declare needs_grad=True "
                         f"(sections run under torch.no_grad() unless their row in analyze.SECTIONS says so)") from None


def run_analysis(model, batches, out_dir, sections=DEFAULT_SECTIONS, opts=None, verbose=True):
    """Run the chosen sections (in SECTIONS order) on an analysis_model and write summary.json,
    <section>.npz and <section>.png into out_dir. batches: micro-batches [(x, y), ...] (≥ 2 for the noise
    scales); opts: the command-line options (OPTIONS' keys; the Hessian uses the first hessian_batches
    micro-batches). Returns the summary."""
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown sections {unknown}: choose from {','.join(SECTIONS)}")
    os.makedirs(out_dir, exist_ok=True)
    inputs = {"batches": batches, "idx": batches[0][0] if batches else None, "opts": {**OPTIONS, **(opts or {})}}
    summary = {}
    for name in [s for s in SECTIONS if s in sections]:
        section = SECTIONS[name]
        if verbose:
            print(f"[{name}]", file=sys.stderr, flush=True)
        started = time.perf_counter()
        section_summary, arrays = run_section(name, section.run, model, inputs)
        if verbose:
            print(f"[{name}] done in {duration(time.perf_counter() - started)}", file=sys.stderr, flush=True)
        summary[name] = section_summary
        if section_summary is None:
            continue
        inputs[name] = (section_summary, arrays)
        if arrays:
            data.atomic_write(os.path.join(out_dir, f"{name}.npz"),
                              lambda f: np.savez(f, **{k.replace(".", "/"): v for k, v in arrays.items()}))
        if section.plot:
            section.plot(section_summary, arrays, os.path.join(out_dir, f"{name}.png"))
    _write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary


def print_table(summary):
    for name, section_summary in summary.items():
        if section_summary:
            SECTIONS[name].show(section_summary)


# ----------------------------------------------------------------------------------------------------
# during training: train.py --analyze_every=N

def analyze_during_training(model, batch, step, out_dir, micro_batches=4, hessian_sequences=8, power_iters=10):
    """The cheap version (Section.during_training) of every section that has one, on one training batch
    (x, y), appended as one JSON line to out_dir/analysis.jsonl: per matrix σ_max, natural spectral norm and
    stable rank; the top Hessian eigenvalue (power_iters block power iterations on the first hessian_sequences
    sequences); the noise scales B_simple and B_noise with η_max and ΔL_max from micro_batches equal slices
    of the batch (|G_small|², |G_big|², tr(HΣ), GᵀHG logged too, so they can be averaged over steps before
    dividing); and the HC / GDN2 summaries when the model has them. Works on an fp32 copy (analysis_model)
    with autocast off, and leaves the model, its gradients and the global RNG untouched. Returns the record."""
    twin = analysis_model(model)
    x, y = (t.to(next(twin.parameters()).device) for t in batch)
    settings = {"micro_batches": micro_batches, "hessian_sequences": hessian_sequences, "power_iters": power_iters}
    record = {"step": step}
    with kernels.autocast_off(x.device.type):  # fp32 even inside a bf16 training step
        for name, section in SECTIONS.items():
            if section.during_training is None:
                continue
            for key, value in run_section(name, section.during_training, twin, x, y, step, settings).items():
                record[key] = {**record.get(key, {}), **value} if isinstance(value, dict) else value
    os.makedirs(out_dir, exist_ok=True)
    runs.append_line(os.path.join(out_dir, "analysis.jsonl"), json.dumps(_jsonable(record)))
    return record


def plot_training_analysis(jsonl_path, png_path):
    """Natural spectral norm and stable rank of every matrix, the top Hessian eigenvalue and the noise
    scale against the step, from analyze_during_training's JSONL."""
    plt = _pyplot()
    records, _ = runs.read_jsonl(jsonl_path)
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    names = list(records[0]["weights"])
    cmap = plt.get_cmap("viridis")
    for i, name in enumerate(names):
        color = cmap(i / max(1, len(names) - 1))
        label = name.replace(".weight", "") if i in (0, len(names) - 1) else None
        axes[0, 0].plot(steps, [r["weights"][name]["natural_spectral_norm"] for r in records], color=color, lw=1,
                        label=label)
        axes[0, 1].plot(steps, [r["weights"][name]["stable_rank"] for r in records], color=color, lw=1, label=label)
    axes[0, 0].axhline(1.0, color="gray", ls="--", lw=1)
    axes[0, 0].set_yscale("log")
    axes[0, 0].set_title("natural spectral norm (spectral condition: Θ(1))", fontsize=9)
    axes[0, 1].set_yscale("log")
    axes[0, 1].set_title("stable rank ‖W‖_F² / ‖W‖₂²", fontsize=9)
    axes[0, 0].legend(fontsize=6)
    axes[0, 1].legend(fontsize=6)
    axes[1, 0].plot(steps, [r["hessian_top"] for r in records], "o-")
    axes[1, 0].set_title("top Hessian eigenvalue (largest |λ|)", fontsize=9)
    noisy = [r for r in records if "noise" in r]
    if noisy:
        axes[1, 1].plot([r["step"] for r in noisy], [r["noise"]["B_simple"] for r in noisy], ".", alpha=0.5,
                        label="B_simple per call")
        if "B_noise" in noisy[0]["noise"]:
            axes[1, 1].plot([r["step"] for r in noisy], [r["noise"]["B_noise"] for r in noisy], "x",
                            label="B_noise = tr(HΣ)/GᵀHG per call")
        # average the two unbiased estimates before dividing (McCandlish et al.), over the last 3 calls:
        # |G|² falls by orders of magnitude early on, so a long average would be ruled by the first calls
        ratio = []
        for i in range(len(noisy)):
            window = noisy[max(0, i - 2):i + 1]
            gsq = sum(r["noise"]["G_sq"] for r in window)
            ratio.append(sum(r["noise"]["tr_sigma"] for r in window) / gsq if gsq > 0 else float("nan"))
        axes[1, 1].plot([r["step"] for r in noisy], ratio, "-", label="Σ tr Σ / Σ |G|² over the last 3 calls")
        axes[1, 1].set_yscale("symlog")
        axes[1, 1].legend(fontsize=7)
    axes[1, 1].set_title("gradient noise scales (sequences)", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("step")
    _save(plt, fig, png_path)


# ----------------------------------------------------------------------------------------------------
# critical batch size: train.py at several batch sizes to one target loss (McCandlish et al. 2018)

def steps_to_target(log_rows, target):
    """The step at which the val loss first reaches target, linearly interpolated between the two evals
    around the crossing; None if it never does."""
    evals = [(r["step"], r["val"]) for r in log_rows if "val" in r]
    for (s0, v0), (s1, v1) in zip(evals, evals[1:]):
        if v1 <= target:
            return float(s1) if v0 <= v1 else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
    return None


def batch_scan(batch_sizes, target, out_dir, max_iters=4000, analyze_batch=0, analyze_every=25,
               train_args=(), verbose=True):
    """Train train.py's model at each batch size B (sequences) with a constant lr (wsd without decay)
    until the val loss reaches target, as a subprocess, stopping it at the crossing. Evals use about 256
    validation sequences whatever B is, every ~320/B steps. The run at B = analyze_batch also logs the
    cheap analysis sections (B_simple and B_noise) every analyze_every steps. Writes and returns
    out_dir/scan.json: {"target", "analyze_batch", "runs": [{"batch_size", "steps", "examples"}], "noise":
    [analyze_during_training records]}."""
    scanned, noise = [], []
    for B in batch_sizes:
        run_dir = os.path.join(out_dir, f"B{B}")
        for name in ("log.jsonl", "analysis.jsonl"):
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
        args = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
                f"--out_dir={run_dir}", f"--batch_size={B}", f"--max_iters={max_iters}", "--schedule=wsd",
                "--wsd_decay_frac=0.0", f"--eval_interval={max(5, round(320 / B))}", f"--eval_iters={max(2, 256 // B)}",
                "--log_interval=1000000", "--num_samples=0", "--overwrite=True", *train_args]
        if B == analyze_batch:
            args.append(f"--analyze_every={analyze_every}")
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "stderr.txt"), "w") as err_file:  # a file, not a pipe: it never fills up
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err_file)
            steps = None
            while steps is None and proc.poll() is None:
                steps = steps_to_target(runs.read_jsonl(os.path.join(run_dir, "log.jsonl"))[0], target)
                if steps is None:
                    time.sleep(1.0)
            proc.terminate()
            proc.wait()
        steps = steps or steps_to_target(runs.read_jsonl(os.path.join(run_dir, "log.jsonl"))[0], target)
        if steps is None:
            err = open(os.path.join(run_dir, "stderr.txt")).read().strip()
            raise ValueError(f"batch size {B} did not reach val loss {target} in {max_iters} steps "
                             f"({err.splitlines()[-1] if err else 'no error'}): raise max_iters or the target")
        scanned.append({"batch_size": B, "steps": steps, "examples": steps * B})
        if B == analyze_batch:
            noise = runs.read_jsonl(os.path.join(run_dir, "analysis.jsonl"))[0]
        if verbose:
            print(f"B = {B}: val loss {target} after {steps:.1f} steps, {steps * B:.0f} sequences", flush=True)
        result = {"target": target, "analyze_batch": analyze_batch, "runs": scanned, "noise": noise}
        _write_json(os.path.join(out_dir, "scan.json"), result)
    return result


def fit_critical_batch(steps, examples):
    """Fit (S/S_min − 1)(E/E_min − 1) = 1 (Kaplan et al. 2020, McCandlish et al. 2018) to runs that reach
    one loss in S steps and E = B·S examples. With E = B·S the relation is S = S_min + E_min/B, linear in
    (S_min, E_min): least squares on the relative residuals (S_min + E_min/B)/S − 1. B_crit = E_min/S_min
    is the batch at which a run needs 2 S_min steps and 2 E_min examples."""
    S, E = np.asarray(steps, dtype=np.float64), np.asarray(examples, dtype=np.float64)
    if len(S) < 2 or (S <= 0).any() or (E <= 0).any():
        raise ValueError(f"fit_critical_batch needs >= 2 runs with positive steps and examples, got {len(S)}")
    B = E / S
    (S_min, E_min), *_ = np.linalg.lstsq(np.stack([1 / S, 1 / (B * S)], axis=1), np.ones_like(S), rcond=None)
    rel = (S_min + E_min / B) / S - 1
    return {"S_min": float(S_min), "E_min": float(E_min), "B_crit": float(E_min / S_min),
            "rms_rel_error": float(np.sqrt((rel ** 2).mean()))}


def plot_batch_scan(scan, fit, path):
    """Steps against examples per batch size, with the fitted hyperbola S = S_min(1 + B_crit/B),
    E = E_min(1 + B/B_crit)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    S = np.array([r["steps"] for r in scan["runs"]])
    E = np.array([r["examples"] for r in scan["runs"]])
    B = np.logspace(np.log10(E.min() / S.max()) - 1, np.log10(E.max() / S.min()) + 1, 200)
    ax.loglog(fit["E_min"] * (1 + B / fit["B_crit"]), fit["S_min"] * (1 + fit["B_crit"] / B), "-", color="gray",
              label=f"fit: S_min {fit['S_min']:.0f}, E_min {fit['E_min']:.0f}, B_crit {fit['B_crit']:.1f}")
    ax.loglog(E, S, "o")
    for r in scan["runs"]:
        ax.annotate(f"B={r['batch_size']}", (r["examples"], r["steps"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(fit["S_min"], color="gray", ls=":", lw=1)
    ax.axvline(fit["E_min"], color="gray", ls=":", lw=1)
    ax.set_xlabel("examples E (sequences)")
    ax.set_ylabel("steps S")
    ax.set_title(f"steps and examples to val loss {scan['target']}", fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)


# ----------------------------------------------------------------------------------------------------
# multi-power law: the loss curve as a function of the learning-rate schedule (Luo et al. 2025)

MPL_PARAMS = ("L0", "A", "alpha", "B", "C", "beta", "gamma")


def mpl_loss(params, lrs, steps):
    """L(t) = L0 + A (S₁(t) + S_W)^−α − LD(t) at the given steps t ≥ 1, for lrs[t − 1] = η_t, the lr of
    step t relative to the peak: S₁(t) + S_W = Σ_{τ≤t} η_τ is the lr area (warmup included), and
        LD(t) = B Σ_{k=p+1}^{t} (η_{k−1} − η_k) (1 − (C η_k^−γ S_k(t) + 1)^−β),
        S_k(t) = Σ_{τ=k}^{t} η_τ,
    the extra drop each lr decrease after the peak step p brings. params: {name: float or 0-d tensor}
    of MPL_PARAMS. Returns a float64 tensor."""
    eta = torch.as_tensor(np.asarray(lrs, dtype=np.float64))
    t = torch.as_tensor(np.asarray(steps, dtype=np.int64))
    area = torch.cat([torch.zeros(1, dtype=eta.dtype), eta.cumsum(0)])  # area[t] = Σ_{τ≤t} η_τ
    peak = int(eta.argmax())  # 0-based: step peak + 1 is the first at the peak
    k = torch.arange(peak + 2, len(eta) + 1)  # steps after the peak
    eta_k, drop = eta[k - 1], eta[k - 2] - eta[k - 1]
    S_k = (area[t][:, None] - area[k - 1][None, :]).clamp(min=0)  # Σ_{τ=k}^{t} η_τ, 0 where k > t
    p = {name: torch.as_tensor(params[name], dtype=torch.float64) for name in MPL_PARAMS}
    decay = drop * (1 - (p["C"] * eta_k.clamp(min=1e-12) ** -p["gamma"] * S_k + 1) ** -p["beta"])
    LD = p["B"] * (decay * (k[None, :] <= t[:, None])).sum(1)
    return p["L0"] + p["A"] * area[t] ** -p["alpha"] - LD


def fit_mpl(curves, iters=500):
    """Least-squares fit of mpl_loss to curves [(lrs, steps, losses), ...], using the points at or after
    each schedule's peak. A, α, B, C, β are fitted through their logs (kept positive). Returns
    (params, rms error)."""
    fitted = []
    for lrs, steps, losses in curves:
        keep = np.asarray(steps) >= int(np.argmax(lrs)) + 1
        fitted.append((lrs, np.asarray(steps)[keep], torch.as_tensor(np.asarray(losses, dtype=np.float64)[keep])))
    low = min(float(l.min()) for _, _, l in fitted)
    raw = {"L0": torch.tensor(0.8 * low, dtype=torch.float64), "A": torch.tensor(0.0, dtype=torch.float64),
           "alpha": torch.tensor(math.log(0.5), dtype=torch.float64),
           "B": torch.tensor(math.log(0.5), dtype=torch.float64),
           "C": torch.tensor(0.0, dtype=torch.float64), "beta": torch.tensor(math.log(0.5), dtype=torch.float64),
           "gamma": torch.tensor(0.5, dtype=torch.float64)}
    for v in raw.values():
        v.requires_grad_(True)

    def params():
        return {n: v if n in ("L0", "gamma") else v.exp() for n, v in raw.items()}

    def loss():
        residuals = torch.cat([mpl_loss(params(), lrs, steps) - losses for lrs, steps, losses in fitted])
        return residuals.pow(2).mean()

    opt = torch.optim.Adam(raw.values(), lr=0.02)
    for _ in range(iters):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
    lbfgs = torch.optim.LBFGS(raw.values(), max_iter=1000, line_search_fn="strong_wolfe", tolerance_grad=1e-12,
                              tolerance_change=1e-15)

    def closure():
        lbfgs.zero_grad()
        value = loss()
        value.backward()
        return value

    lbfgs.step(closure)
    with torch.no_grad():
        return {n: float(v) for n, v in params().items()}, math.sqrt(loss().item())


def read_schedule_run(run_dir):
    """(lrs relative to the peak, eval steps, val losses) from a train.py run logged with --log_interval=1."""
    if not os.path.isfile(os.path.join(run_dir, "log.jsonl")):
        raise ValueError(f"no {run_dir}/log.jsonl: give train.py run folders "
                         "(train with --out_dir=... --log_interval=1)")
    rows = runs.read_jsonl(os.path.join(run_dir, "log.jsonl"))[0]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    if not lr or sorted(lr) != list(range(1, max(lr) + 1)):
        raise ValueError(f"{run_dir}/log.jsonl lacks the lr of every step: train with --log_interval=1")
    lrs = np.array([lr[s] for s in range(1, max(lr) + 1)])
    evals = [(r["step"], r["val"]) for r in rows if "val" in r and 1 <= r["step"] <= len(lrs)]
    return lrs / lrs.max(), np.array([s for s, _ in evals]), np.array([v for _, v in evals])


def mpl_predict(fit_dirs, predict_dirs, png_path=None):
    """Fit the multi-power law to the runs in fit_dirs and predict the val loss of the runs in
    predict_dirs from their schedules alone. Returns {"params", "fit_rms", "runs": {dir: {"rms", "max",
    "rms_no_decay_term"}}}; the last is the same fit's L0 + A·area^−α without LD, for comparison."""
    fit_curves = [read_schedule_run(d) for d in fit_dirs]
    params, fit_rms = fit_mpl(fit_curves)
    result = {"params": params, "fit_rms": fit_rms, "runs": {}}
    shown = []
    for d in list(fit_dirs) + list(predict_dirs):
        lrs, steps, losses = read_schedule_run(d)
        keep = steps >= int(np.argmax(lrs)) + 1
        predicted = mpl_loss(params, lrs, steps).numpy()
        no_decay = mpl_loss({**params, "B": 0.0}, lrs, steps).numpy()
        if d in predict_dirs:
            err = predicted[keep] - losses[keep]
            result["runs"][d] = {"rms": float(np.sqrt((err ** 2).mean())), "max": float(np.abs(err).max()),
                                 "final_error": float(err[-1]),
                                 "rms_no_decay_term": float(np.sqrt(((no_decay - losses)[keep] ** 2).mean()))}
        shown.append((d, lrs, steps, losses, predicted, d in predict_dirs))
    if png_path:
        plt = _pyplot()
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for i, (d, lrs, steps, losses, predicted, held_out) in enumerate(shown):
            color = f"C{i}"
            name = os.path.basename(os.path.normpath(d)) + (" (predicted)" if held_out else " (fitted)")
            ax1.plot(steps, losses, "o", color=color, ms=3)
            ax1.plot(steps, predicted, "-" if held_out else "--", color=color, label=name)
            ax2.plot(np.arange(1, len(lrs) + 1), lrs, color=color, label=name)
        low = min(run[3].min() for run in shown)
        ax1.set_ylim(low - 0.05, low + 0.6)
        ax1.set_xlabel("step")
        ax1.set_ylabel("val loss (dots measured, lines MPL)")
        ax1.legend(fontsize=7)
        ax2.set_xlabel("step")
        ax2.set_ylabel("lr / peak lr")
        ax2.legend(fontsize=7)
        _save(plt, fig, png_path)
    return result


# ----------------------------------------------------------------------------------------------------
# what a train.py run costs, from its settings alone, without building its model: the dry run prints it, and a run
# checks that it fits before it builds anything. Parameters by closed form, checked against a count; memory by formula;
# time as an estimate; MFU against the GPUs' peaks.

# a CPU run that would take longer than this (at the CPU's measured matmul rate) is told it is sized for a GPU
LONG_CPU_RUN_SECONDS = 600

# Dense (no sparsity) peaks per GPU, from NVIDIA's datasheets (half their sparse figures; the Turing whitepaper for
# the RTX 20 cards), by the exact name torch.cuda.get_device_name() reports, in FLOP/s for each --dtype: bfloat16 and
# float16 tensor cores accumulating in fp32 (as autocast's matmuls do), float32 on TF32 tensor cores where the GPU
# has them, else on CUDA cores (Volta, Turing); None: the GPU has no bf16. A GPU not listed gets no MFU unless
# --peak_tflops states its peak.
PEAK_DTYPES = ("bfloat16", "float16", "float32")
GPU_PEAKS = {
    "NVIDIA B200": (2250e12, 2250e12, 1100e12),
    "NVIDIA H200": (989e12, 989e12, 495e12), "NVIDIA H200 NVL": (835e12, 835e12, 418e12),
    "NVIDIA H100 80GB HBM3": (989e12, 989e12, 495e12), "NVIDIA H100 NVL": (835e12, 835e12, 418e12),
    "NVIDIA H100 PCIe": (756e12, 756e12, 378e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 312e12, 156e12), "NVIDIA A100-SXM4-40GB": (312e12, 312e12, 156e12),
    "NVIDIA A100 80GB PCIe": (312e12, 312e12, 156e12), "NVIDIA A100-PCIE-40GB": (312e12, 312e12, 156e12),
    "NVIDIA L40S": (362e12, 362e12, 183e12), "NVIDIA L40": (181e12, 181e12, 90.5e12),
    "NVIDIA L4": (121e12, 121e12, 60e12), "NVIDIA A10": (125e12, 125e12, 62.5e12),
    "NVIDIA RTX A6000": (155e12, 155e12, 77.4e12), "NVIDIA RTX 6000 Ada Generation": (364e12, 364e12, 182e12),
    "NVIDIA GeForce RTX 4090": (165e12, 165e12, 82.6e12), "NVIDIA GeForce RTX 3090": (71e12, 71e12, 35.6e12),
    # without bf16: float16 autocast with a GradScaler
    "Tesla T4": (None, 65e12, 8.1e12),
    "Tesla V100-SXM2-16GB": (None, 125e12, 15.7e12), "Tesla V100-SXM2-32GB": (None, 125e12, 15.7e12),
    "Tesla V100-PCIE-16GB": (None, 112e12, 14e12), "Tesla V100-PCIE-32GB": (None, 112e12, 14e12),
    "NVIDIA TITAN RTX": (None, 130.5e12, 16.3e12), "Quadro RTX 6000": (None, 130.5e12, 16.3e12),
    "Quadro RTX 8000": (None, 130.5e12, 16.3e12), "NVIDIA GeForce RTX 2080 Ti": (None, 53.8e12, 13.4e12),
}


def peak_flops(device, dtype, stated_tflops):
    """The FLOP/s that MFU is measured against: the stated peak, else for a listed GPU its dense peak in dtype (a
    PEAK_DTYPES name); None (no MFU) on a CPU or an unlisted GPU, where no honest peak is known."""
    if stated_tflops:
        return stated_tflops * 1e12
    if device.type != "cuda":
        return None
    peaks = GPU_PEAKS.get(torch.cuda.get_device_name(device))
    return None if peaks is None else peaks[PEAK_DTYPES.index(dtype)]


# The launch model: what a kernel launch costs on a GPU, an estimate (bench.py costs prices each Triton launch of a
# mixer with it, the dry run a preset's step). A launch runs `programs` on a grid, blocks_per_sm of them resident on
# each SM, so in waves = ⌈programs / (blocks_per_sm · SMs)⌉, and takes LAUNCH_OVERHEAD plus the longest of
#   bytes / (bandwidth · f)   f = min(STREAM_FRACTION, in flight / (bandwidth · DRAM_LATENCY)): by Little's law the
#                             bandwidth is busy only with bandwidth · latency bytes in flight; a wave keeps each
#                             resident program's loads of one step in flight (num_stages − 1 steps when its loop is
#                             pipelined; all of its bytes when it has no loop)
#   FLOPs / (peak · DOT_FRACTION[arch][instruction])   by the dot instruction its compiled PTX uses: wgmma (sm_90's
#                             warpgroup MMA), mma.sync (the tensor cores' instruction before sm_90, and sm_90's
#                             older path) or fma (no tensor-core instruction: CUDA cores at the fp32 peak)
#   waves · (steps · step + PROLOGUE)   the dependent chain: a program's steps each wait for the one before, step =
#                             STEP_LATENCY with its loads prefetched (num_stages ≥ 2), plus DRAM_LATENCY where not
# The constants are assumptions, not measurements (no GPU has run this version): their orders are those of a loaded
# DRAM round trip, a step's dot + exps + reduction (about 400 cycles at 1.7 GHz) and a kernel's launch gap.
DRAM_LATENCY = 0.6e-6       # s
STEP_LATENCY = 0.25e-6      # s, a dependent step whose loads were prefetched
PROLOGUE = DRAM_LATENCY + STEP_LATENCY   # s, a program's first loads and first step
LAUNCH_OVERHEAD = 4e-6      # s a launch
STREAM_FRACTION = 0.9       # the most of the datasheet bandwidth a streaming kernel reaches
DOT_FRACTION = {90: dict(wgmma=0.7, mma=0.45, fma=0.5), 80: dict(mma=0.7, fma=0.5), 75: dict(mma=0.6, fma=0.5)}
# the GPUs the dry run prices (datasheets: HBM bandwidth in B/s, SMs, dense fp32 FLOP/s on CUDA cores; the tensor
# peak is GPU_PEAKS' for the run's dtype); a T4 has no bf16, so it is priced in float16, and the dry run fits the
# run in its memory as torch reports it (14.6 GiB of its 16 GB)
COST_GPUS = {
    "A100": dict(name="NVIDIA A100-SXM4-80GB", arch=80, sms=108, bandwidth=2.039e12, fma_flops=19.5e12),
    "H100": dict(name="NVIDIA H100 80GB HBM3", arch=90, sms=132, bandwidth=3.35e12, fma_flops=67e12),
    "H200": dict(name="NVIDIA H200", arch=90, sms=132, bandwidth=4.8e12, fma_flops=67e12),
    "T4": dict(name="Tesla T4", arch=75, sms=40, bandwidth=320e9, fma_flops=8.1e12, memory=int(14.6 * 2**30)),
}
ESTIMATE_GPUS = ("A100", "H100", "H200")   # the dry run's time line
TRITON_COMPILE_SECONDS = 2.0   # one Triton kernel compiled for sm_90 (triton.compile, ptxas included): the mean of G's
#                                and M's 21 launches measured on a shared 2-core CPU (median 1.1 s, 0.6-6.3 s)


def dot_rate(gpu, instruction, dtype="bfloat16"):
    """FLOP/s of dots issued as `instruction` (wgmma, mma or fma) on a COST_GPUS entry, in dtype (a PEAK_DTYPES
    name): the tensor peak (or, for fma, the fp32 CUDA-core peak) times DOT_FRACTION of its arch; an instruction the
    arch lacks (wgmma before sm_90) is a one-line error."""
    fractions = DOT_FRACTION[gpu["arch"]]
    if instruction not in fractions:
        raise ValueError(f"sm_{gpu['arch']} has no {instruction}: one of {', '.join(fractions)}")
    peak = gpu["fma_flops"] if instruction == "fma" else GPU_PEAKS[gpu["name"]][PEAK_DTYPES.index(dtype)]
    return fractions[instruction] * peak


def launch_time(gpu, nbytes, flops, instruction, programs, blocks_per_sm, steps, num_stages, dtype="bfloat16"):
    """The launch model (above) for one launch on a COST_GPUS entry: dict(waves, bandwidth_fraction, t_bytes, t_flops,
    t_latency, bound (the largest of the three: bytes, flops or latency), time (it plus LAUNCH_OVERHEAD)). steps:
    the iterations of a program's longest dependent loop (1 without a loop)."""
    resident = min(programs, blocks_per_sm * gpu["sms"])
    waves = -(-programs // (blocks_per_sm * gpu["sms"]))
    per_step = nbytes / (programs * steps)
    in_flight = resident * (per_step * max(1, num_stages - 1) if steps > 1 else nbytes / programs)
    fraction = min(STREAM_FRACTION, in_flight / (gpu["bandwidth"] * DRAM_LATENCY))
    step = STEP_LATENCY + (DRAM_LATENCY if num_stages < 2 else 0.0)
    terms = dict(bytes=nbytes / (gpu["bandwidth"] * fraction) if nbytes else 0.0,
                 flops=flops / dot_rate(gpu, instruction, dtype) if flops else 0.0,
                 latency=waves * (steps * step + PROLOGUE))
    bound = max(terms, key=terms.get)
    return dict(waves=waves, bandwidth_fraction=fraction, t_bytes=terms["bytes"], t_flops=terms["flops"],
                t_latency=terms["latency"], bound=bound, time=terms[bound] + LAUNCH_OVERHEAD)


def size(nbytes):
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def duration(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


def run_costs(c, config, act):
    """What the run costs: parameters (counted, and model.param_formula's closed form), FLOPs a token, and the memory
    of one process by formula (act bytes an activation). Counted on one period of its layers (a block per letter of
    the mixer string) built on the meta device and scaled to n_layer, so any depth answers at once; the optimizer's
    state (optim.state_bytes) after one step on the meta device, which creates the state's tensors and computes
    nothing."""
    period = min(config.n_layer, len(config.mixer))
    with torch.device("meta"):
        gpt = GPT(dataclasses.replace(config, n_layer=period))
    opt = optim.build_optimizer(gpt, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay, aux_lr=c.aux_lr,
                                aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr,
                                **optim.optimizer_options(c.optimizer, vars(c)))
    for p in gpt.parameters():
        p.grad = torch.empty_like(p)
    opt.step()
    layers = [len(range(i, config.n_layer, period)) for i in range(period)]  # the layers built as block i is

    def scaled(measure):  # measure(module) of the whole model: what lies outside the blocks once, block i per layer
        blocks = [measure(block) for block in gpt.blocks]
        return measure(gpt) - sum(blocks) + sum(n * b for n, b in zip(layers, blocks))
    n_params = scaled(lambda m: sum(p.numel() for p in m.parameters()))
    matmul_weights = scaled(lambda m: sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear)))
    extra = sum(n * getattr(b.mixer, "extra_flops_per_token", lambda T: 0)(config.block_size)
                for n, b in zip(layers, gpt.blocks))
    state = scaled(lambda m: optim.state_bytes(opt, m.parameters()))
    memory = {"weights": 4 * n_params, "their bf16 copies": 2 * matmul_weights if act == 2 else 0,
              "gradients": 4 * n_params, f"{c.optimizer} state": state,
              f"activations ({c.batch_size} x {config.block_size})":
                  model_module.activation_formula(config, c.batch_size, act),
              "the loss's peak": (act + 4) * c.batch_size * config.block_size * config.padded_vocab_size}
    return types.SimpleNamespace(n_params=n_params, parts=model_module.param_formula(config), memory=memory,
                                 flops_token=6 * matmul_weights + extra)


class _OpCounts(torch.utils._python_dispatch.TorchDispatchMode):
    """What the aten ops run under it would launch on a GPU, eagerly: launches (every op but views, bare allocations
    and queries), the bytes of their tensor inputs and outputs, the FLOPs of their matmuls (2·M·N·K a product), and
    the distinct signatures (op, input shapes and dtypes) of the ops that are neither point-wise, views, matmuls nor
    fills: each such one is a kernel inductor generates (it fuses the point-wise ops into them)."""
    MATMULS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}   # op: its two factors' positions
    NOT_LAUNCHED = {"detach", "t", "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty",
                    "new_empty_strided", "promote_types", "scalar_tensor"}   # views is_view misses, bare allocations
    NOT_KERNELS = {"zeros", "ones", "new_zeros", "clone", "copy_"}   # fills and copies, which inductor fuses

    def __init__(self):
        super().__init__()
        self.launches, self.bytes, self.flops, self.kernels = 0, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in self.NOT_LAUNCHED or not any(torch.is_tensor(t) for t in
                                                                 torch.utils._pytree.tree_leaves(out)):
            return out   # a view, an allocation, or a query that returns no tensor (a tensor's device)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.launches += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        if name in self.MATMULS:
            a, b = (args[i] for i in self.MATMULS[name])
            self.flops += 2 * a.numel() * b.shape[-1]
        elif torch.Tag.pointwise not in func.tags and name not in self.NOT_KERNELS:
            self.kernels.add((name, tuple((tuple(a.shape), a.dtype) for a in torch.utils._pytree.tree_leaves(args)
                                          if isinstance(a, torch.Tensor))))
        return out


def gemm_time(gpu, M, N, K, instruction, act, dtype="bfloat16"):
    """launch_time of one cuBLAS GEMM [M, K] @ [K, N] in act-byte elements, as the launch model sees it: a program a
    128 x 128 output tile (one resident an SM), walking K in pipelined steps of 64 (4 stages)."""
    return launch_time(gpu, act * (M * K + K * N + M * N), 2 * M * N * K, instruction,
                       -(-M // 128) * -(-N // 128), 1, -(-K // 64), 4, dtype)


# The mixers' Triton launches, recorded on fake tensors: the dry run prices each mixer layer by them (mixer_launches,
# mixer_layer_time); bench.py's kernel cost report counts the same launches exactly in Triton's interpreter.

def record_launches(step, on_launch, around_body=None):
    """Run step() under FakeTensorMode (step makes its tensors there, so any shape is free) with every Triton launch
    handed to on_launch(kernel, grid, args, kwargs) instead of run. Each Triton op's custom ops run their own bodies
    there, not their fake functions, so the wrappers choose their launches as they would on a GPU; around_body(name),
    if given, is the context each body of custom op `name` runs in."""
    from unittest import mock
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = {op for row in kernels.OPS.values() if row.triton is not None
           for op in vars(sys.modules[row.triton.__module__]).values()
           if isinstance(op, torch._library.custom_ops.CustomOpDef)}   # the custom ops of each op's module
    fakes = {op: op._abstract_fn for op in ops}

    def record(self, *args, grid, warmup, **kwargs):
        on_launch(self, tuple(grid), args, kwargs)

    def body(op):
        if around_body is None:
            return op._init_fn

        def run_around(*args, **kwargs):
            with around_body(op._name):
                return op._init_fn(*args, **kwargs)
        return run_around

    try:
        for op in ops:
            op.register_fake(body(op))
        with FakeTensorMode(), mock.patch.object(type(kernels._rms_norm_fwd_kernel), "run", record):
            step()
    finally:
        for op, fake in fakes.items():
            op.register_fake(fake)


class _Tile:
    """What a walked program (_Walk) holds for a tensor argument and for every tile, pointer and loaded value made from
    one: any operation on it gives it back; a branch on it (on loaded data) is an error, no walk can take it."""
    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self

    def __bool__(self):
        raise ValueError("the kernel branches on loaded data: its loops cannot be walked without the interpreter")

    __hash__ = object.__hash__


class _Scalar(int):
    """An integer of a walked program (a program id, an integer argument, what arithmetic makes of them): Triton's
    scalars take .to(dtype), and arithmetic keeps them _Scalar."""
    def to(self, *args, **kwargs):
        return self


def _tile_op(self, *other):
    return self


def _scalar_op(name):
    def op(self, *other):
        result = getattr(int, name)(self, *other)
        return _Scalar(result) if type(result) is int else result
    return op


for _op in "add sub mul truediv floordiv mod pow and or xor lshift rshift matmul".split():
    setattr(_Tile, f"__{_op}__", _tile_op)
    setattr(_Tile, f"__r{_op}__", _tile_op)
    if _op not in ("truediv", "matmul"):
        setattr(_Scalar, f"__{_op}__", _scalar_op(f"__{_op}__"))
        setattr(_Scalar, f"__r{_op}__", _scalar_op(f"__r{_op}__"))
for _op in "lt le gt ge eq ne neg pos invert abs".split():
    setattr(_Tile, f"__{_op}__", _tile_op)
for _op in "neg pos invert abs".split():
    setattr(_Scalar, f"__{_op}__", _scalar_op(f"__{_op}__"))


class _Walk:
    """One program of a recorded launch run as plain Python: the kernel's own code, with this object as its
    triton.language (tl) and its loops' range. Integer arguments and program ids are exact, tensors and everything
    made from them _Tile, so each loop runs the iterations the program would. It counts, as the cost report's
    interpreter does, the steps (the iterations of its outermost loops, tl.static_range's unrolled ones apart, that
    load) and the tl.dot calls."""

    def __init__(self, kernel, grid, program):
        self.kernel_type, self.grid, self.program = type(kernel), grid, program
        self.depth = self.steps = self.dots = 0
        self.open = self.loaded = self.persistent = False
        self.globals = {**kernel.fn.__globals__, "tl": self, "range": self.range}
        for name, value in kernel.fn.__globals__.items():
            if isinstance(value, self.kernel_type):   # a @triton.jit device function: walked too
                self.globals[name] = self.function(value)

    def function(self, jitted):
        fn = jitted.fn
        walked = types.FunctionType(fn.__code__, self.globals, fn.__name__, fn.__defaults__, fn.__closure__)
        walked.__kwdefaults__ = fn.__kwdefaults__
        return walked

    def __getattr__(self, name):   # every other tl function and dtype: a tile
        return _Tile()

    def range(self, *bounds, **options):   # a loop over a tile's dimension (no integer bounds) is walked once
        sized = all(isinstance(bound, int) for bound in bounds)
        self.depth += 1
        try:
            for i in builtins.range(*bounds) if sized else [0]:
                if self.depth == 1:
                    self.close()
                    self.open, self.loaded = True, False
                yield _Scalar(i) if sized else _Tile()
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.close()

    def close(self):
        self.steps += self.open and self.loaded
        self.open = False

    def program_id(self, axis):
        return _Scalar(self.program[axis])

    def num_programs(self, axis):   # a grid-stride loop: a persistent grid's rows
        self.persistent = True
        return _Scalar(self.grid[axis])

    def cdiv(self, a, b):
        return -(-a // b) if isinstance(a, int) and isinstance(b, int) else _Tile()

    def minimum(self, a, b):
        return min(a, b) if isinstance(a, int) and isinstance(b, int) else _Tile()

    def maximum(self, a, b):
        return max(a, b) if isinstance(a, int) and isinstance(b, int) else _Tile()

    def static_range(self, *bounds):
        return builtins.range(*bounds)

    def load(self, *args, **kwargs):
        self.loaded = True
        return _Tile()

    def dot(self, *args, **kwargs):
        self.dots += 1
        return _Tile()


def walked_loops(kernel, grid, args, kwargs):
    """(steps, dots) of one recorded launch, by walking its programs (_Walk) at the grid's corners (each axis at its
    first and last program: where a row-major decomposition of the program id puts every index at its least and its
    most): steps the most any of them walks, dots their mean tl.dot calls times the programs. A program that asks
    tl.num_programs strides over a persistent grid's rows (a CPU's few programs where it was recorded, a few an SM
    on a GPU), independent of each other: one step, as the cost report prices it."""
    as_walked = lambda v: _Tile() if torch.is_tensor(v) else _Scalar(v) if type(v) is int else v
    args = [as_walked(a) for a in args]
    kwargs = {k: as_walked(v) for k, v in kwargs.items() if k not in kernels.LAUNCH_OPTIONS}
    walks = []
    for program in itertools.product(*({0, n - 1} for n in grid)):
        walk = _Walk(kernel, grid, program)
        try:
            walk.function(kernel)(*args, **kwargs)
        except Exception as e:
            raise ValueError(f"the dry run walks each Triton kernel's loops with exact integers, and "
                             f"{kernel.fn.__name__}'s cannot be walked: {e}") from e
        walk.close()
        walks.append(walk)
    steps = 1 if any(w.persistent for w in walks) else max(1, max(w.steps for w in walks))
    return steps, math.prod(grid) * sum(w.dots for w in walks) / len(walks)


def mixer_launches(config, letter, batch_size, dtype, compiled):
    """One `letter` mixer of config (model.MIXERS), forward and backward at [batch_size, block_size] under autocast to
    dtype (none for fp32) on the Triton path, recorded on fake tensors (record_launches): dict(launches: one dict a
    Triton launch, in order: kernel, programs, num_warps, num_stages, bytes (its tensor arguments' elements, each view
    once: an upper bound of the addresses it touches, as a kernel need not touch all of an argument; the interpreter's
    unique bytes count an address both read and written twice), steps and dots
    (walked_loops); eager_launches, eager_bytes: the aten ops inside the Triton ops' bodies (_OpCounts), which no
    compiler fuses). compiled: as under torch.compile, where the dispatchers of rms_norm and rope take their torch
    paths (inductor fuses them)."""
    from unittest import mock
    cfg = dataclasses.replace(config, mixer=letter, kernels="triton", dropout=0.0)
    launches, eager = [], _OpCounts()

    def record(kernel, grid, args, kwargs):
        views = {(t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride()): t
                 for t in (*args, *kwargs.values()) if torch.is_tensor(t)}
        steps, dots = walked_loops(kernel, grid, args, kwargs)
        launches.append(dict(kernel=kernel.fn.__name__, programs=math.prod(grid),
                             num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3),
                             bytes=sum(t.element_size() * math.prod(n for n, s in zip(t.shape, t.stride()) if s)
                                       for t in views.values()), steps=steps, dots=dots))

    def step():
        mixer = model_module.MIXERS[letter](cfg)
        T, head_dim = cfg.block_size, cfg.n_embd // cfg.n_head
        x = torch.randn(batch_size, T, cfg.n_embd).to(dtype).requires_grad_()
        rope = (model_module.rope_cache(T, head_dim, cfg.rope_base) if cfg.rope == "fixed"
                else torch.arange(T, dtype=torch.float32))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y = mixer(x, rope)
        y.backward(torch.randn_like(y))

    with mock.patch.object(torch.compiler, "is_compiling", lambda: compiled):
        record_launches(step, record, lambda name: eager)
    return dict(launches=launches, eager_launches=eager.launches, eager_bytes=eager.bytes)


def recording_mixers(config, batch_size, dtype, compiled):
    """Start recording mixer_launches for each mixer letter config's layers use; returns the function that waits for
    {letter: mixer_launches}, or None where triton is not installed or config.kernels is torch or ref. In this
    process where kernels.py loaded Triton (a GPU, the interpreter), else in a Python of its own that imports triton
    first, so that the kernels are defined (nothing compiles or runs), while this one counts the rest."""
    letters = sorted(set(config.mixer[:config.n_layer]))
    if config.kernels not in ("auto", "triton"):   # the GPU run takes the torch paths: no Triton launch
        return lambda: None
    if kernels.HAS_TRITON:
        recorded = {m: mixer_launches(config, m, batch_size, dtype, compiled) for m in letters}
        return lambda: recorded
    program = ("import json, sys, torch, triton, analyze, model; a = json.loads(sys.argv[1]); print(json.dumps({m: "
               "analyze.mixer_launches(model.GPTConfig(**a['config']), m, a['batch'], getattr(torch, a['dtype']), "
               "a['compiled']) for m in a['letters']}))")
    asked = dict(config=dataclasses.asdict(config), batch=batch_size, compiled=compiled,
                 dtype=str(dtype).split(".")[-1], letters=letters)
    proc = subprocess.Popen([sys.executable, "-c", program, json.dumps(asked)],
                            cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def wait():
        out, err = proc.communicate()
        if proc.returncode and "No module named 'triton'" in err:
            return None
        if proc.returncode:
            raise RuntimeError(f"recording the mixers' launches failed: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])
    return wait


# a mixer launch's resident blocks an SM, without a compile: the registers of an SM (65536 on sm_75 to sm_90) over its
# warps at kernels.MAX_REGISTERS a thread, the most a launch takes (ptxas is held to it): the fewest blocks it can have
REGISTERS_AN_SM = 65536


def mixer_blocks_per_sm(num_warps):
    return max(1, REGISTERS_AN_SM // (num_warps * 32 * kernels.MAX_REGISTERS))


def mixer_layer_time(gpu, mixer, dtype="bfloat16"):
    """One mixer layer's forward + backward on a COST_GPUS entry by the launch model, from step_costs' mixer entry:
    each recorded Triton launch by launch_time (mixer_launches' programs, bytes, steps and stages,
    mixer_blocks_per_sm of its warps, and the layer's sequence FLOPs shared among its launches by their tl.dot calls,
    at the mma.sync rate), the aten ops inside the Triton ops' bodies by their bytes streamed and a launch overhead
    each; the sequence FLOPs that no Triton launch dots (attention's sdpa, or every mixer where triton is not
    installed and no launch was recorded) as a forward launch of a third and a backward one of two thirds, each a
    program a head and 64-token block walking up to T/64 blocks (FlashAttention's grid)."""
    recorded = mixer["recorded"] or dict(launches=[], eager_launches=0, eager_bytes=0)
    dots = sum(launch["dots"] for launch in recorded["launches"])
    seconds = sum(launch_time(gpu, launch["bytes"], mixer["flops"] * launch["dots"] / dots if dots else 0, "mma",
                              launch["programs"], mixer_blocks_per_sm(launch["num_warps"]), launch["steps"],
                              launch["num_stages"], dtype)["time"] for launch in recorded["launches"])
    seconds += recorded["eager_launches"] * LAUNCH_OVERHEAD + \
        recorded["eager_bytes"] / (STREAM_FRACTION * gpu["bandwidth"])
    if mixer["flops"] and not dots:
        seconds += sum(launch_time(gpu, 0, share * mixer["flops"], "mma", mixer["programs"], 1, mixer["steps"], 2,
                                   dtype)["time"] for share in (1 / 3, 2 / 3))
    return seconds


def step_costs(c, config, act):
    """What the dry run needs to price one optimizer step, counted on the meta device: the GEMMs of a micro-step
    (Counter of the (M, N, K) of every nn.Linear's forward, input-gradient and weight-gradient products), the mixer
    layers ({letter: dict(layers, flops: a layer's sequence FLOPs, programs: a head and 64-token block of the batch,
    steps: T/64, recorded: its Triton launches, recording_mixers' at the run's batch in bf16 autocast (fp32 for
    --dtype=float32), as torch.compile runs them unless --compile=False)}), the bytes a micro-step's activations move
    (model.activation_formula and the loss's logits, each written in the forward, read in the backward and its
    gradient written: 3 times), the optimizer step's launches, bytes and matmul FLOPs (counted in _OpCounts on one
    period of layers, its bytes and FLOPs scaled to the model by its parameters), and the distinct kernels the first
    step compiles (_OpCounts' kernels over one period's forward + backward at the run's batch, the torch path)."""
    recording = recording_mixers(config, c.batch_size, torch.float32 if act == 4 else torch.bfloat16,
                                 c.compile is not False)
    period = min(config.n_layer, len(config.mixer))
    with torch.device("meta"):
        gpt = GPT(dataclasses.replace(config, n_layer=period, kernels="torch"))
    layers = [len(range(i, config.n_layer, period)) for i in range(period)]
    tokens = c.batch_size * config.block_size
    in_blocks = {id(m): n for b, n in zip(gpt.blocks, layers) for m in b.modules()}   # a module's layers
    gemms, mixers, blocks = collections.Counter(), {}, -(-config.block_size // 64)
    for m in gpt.modules():
        if isinstance(m, nn.Linear):
            for shape in ((tokens, m.out_features, m.in_features), (tokens, m.in_features, m.out_features),
                          (m.in_features, m.out_features, tokens)):
                gemms[shape] += in_blocks.get(id(m), 1)
    kept = model_module.activation_formula(config, c.batch_size, act)
    traffic = None if kept is None else 3 * (kept + (act + 4) * tokens * config.padded_vocab_size)
    forward_backward = _OpCounts()
    with torch.device("meta"), forward_backward:
        idx = torch.zeros(c.batch_size, config.block_size, dtype=torch.long)
        gpt(idx, idx)[1].backward()
    opt = optim.build_optimizer(gpt, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay, aux_lr=c.aux_lr,
                                aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr,
                                **optim.optimizer_options(c.optimizer, vars(c)))
    opt.step()   # the state's tensors made first: the step counted is a later one
    with _OpCounts() as step:
        opt.step()
    period_params = sum(p.numel() for p in gpt.parameters())
    scale = (period_params + sum((n - 1) * sum(p.numel() for p in b.parameters())
                                 for b, n in zip(gpt.blocks, layers))) / period_params
    recorded = recording()
    for i, (b, n) in enumerate(zip(gpt.blocks, layers)):
        letter = config.mixer[i % len(config.mixer)]
        flops = getattr(b.mixer, "extra_flops_per_token", lambda T: 0)(config.block_size) * tokens
        mixers.setdefault(letter, dict(layers=0, flops=flops, programs=c.batch_size * getattr(
            b.mixer, "n_head", config.n_head) * blocks, steps=blocks, recorded=recorded and recorded[letter]))
        mixers[letter]["layers"] += n
    return types.SimpleNamespace(gemms=gemms, mixers=mixers, recorded=recorded is not None, traffic=traffic,
                                 optimizer=dict(launches=step.launches, bytes=step.bytes * scale,
                                                flops=step.flops * scale),
                                 kernels=len(forward_backward.kernels))


def step_time(costs, micro, gpu):
    """One optimizer step of one process (`micro` micro-steps) on a COST_GPUS entry by the launch model, from
    step_costs: {part: seconds} of the micro-steps' GEMMs (gemm_time; wgmma on sm_90, else mma.sync), mixers
    (mixer_layer_time: each layer's recorded Triton launches, attention's sdpa by its FLOPs) and activations (their
    bytes streamed at STREAM_FRACTION of the bandwidth), then the optimizer (its launches' overheads, its bytes
    streamed and its FLOPs at the GEMM rate, one after another)."""
    dtype = "bfloat16" if GPU_PEAKS[gpu["name"]][0] else "float16"
    instruction = "wgmma" if gpu["arch"] >= 90 else "mma"
    gemms = sum(n * gemm_time(gpu, *shape, instruction, 2, dtype)["time"] for shape, n in costs.gemms.items())
    mixers = sum(m["layers"] * mixer_layer_time(gpu, m, dtype) for m in costs.mixers.values())
    traffic = costs.traffic / (STREAM_FRACTION * gpu["bandwidth"])
    opt = costs.optimizer
    optimizer = opt["launches"] * LAUNCH_OVERHEAD + opt["bytes"] / (STREAM_FRACTION * gpu["bandwidth"]) + \
        opt["flops"] / dot_rate(gpu, instruction, dtype)
    return {"GEMMs": micro * gemms, "mixers": micro * mixers, "activations": micro * traffic, "optimizer": optimizer}


def run_tokens(c, block_size, world):
    """(tokens a step, training tokens, eval tokens) of the run."""
    tokens_per_iter = c.gradient_accumulation_steps * world * c.batch_size * block_size
    eval_tokens = (c.max_iters // c.eval_interval + 1) * c.eval_iters * c.batch_size * block_size * world
    return tokens_per_iter, tokens_per_iter * c.max_iters, eval_tokens


def run_flops(flops_token, train_tokens, eval_tokens):
    return flops_token * (train_tokens + eval_tokens / 3)  # an eval is the forward third of a training step


def check_fit(memory, device):
    """The run's memory by formula (run_costs at bf16 activations, without the weights' bf16 copies: the least it can
    need) must fit in the device's: a GPU's total memory, else this machine's physical RAM, which the processes on it
    share. Refused in one line, with the figures, before anything is built."""
    need = {k: v for k, v in memory.items() if v and k != "their bf16 copies"}
    have, where = device_memory(device)
    if have is None:
        return
    processes = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    total = processes * sum(need.values())
    if total > have:
        each = f"{processes} processes x " if processes > 1 else ""
        largest = max(need, key=need.get)
        raise runs.ConfigError(f"this run needs at least {size(total)} by formula ({each}" + ", ".join(
            f"{k} {size(v)}" for k, v in need.items()) + f"), more than the {size(have)} of {where}, the largest "
            f"figure {largest}: use a smaller --n_layer or --n_embd (the weights and optimizer state), --batch_size "
            f"or --block_size (the activations; python train.py ... --dry_run=True names a batch that fits a T4)")


def device_memory(device):
    """(bytes, what they are) of the device's memory: a GPU's total memory, else this machine's physical RAM, which
    the processes on it share; (None, None) where it cannot be read (no sysconf: Windows)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, str(device)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    except (AttributeError, ValueError, OSError):
        return None, None


def sized_for_a_gpu(c, flops_per_iter, flops, rate):
    """A CPU run estimated at over LONG_CPU_RUN_SECONDS (its FLOPs at the CPU's float32 matmul rate) is a GPU preset
    run on a CPU: the line that says so, with the estimate; None for a CPU-sized run."""
    if flops / rate < LONG_CPU_RUN_SECONDS:
        return None
    return (f"note: this run is sized for a GPU: on this CPU its {c.max_iters} steps and evals take at least "
            f"{duration(flops / rate)} ({flops_per_iter / rate:.1f} s a step at the {rate / 1e9:.0f} GFLOP/s of a "
            f"float32 matmul measured now; an optimistic estimate); --dry_run=True prices it on GPUs")


def run_time(c, costs, gpu):
    """(seconds of the run, seconds a step, {part: seconds a step}, kernels to compile) on a COST_GPUS entry by the
    launch model (step_time of step_costs' costs): max_iters steps, each eval's eval_iters batches at a third of a
    micro-step's GEMMs, mixers and activations (the forward), and the first step's compile (TRITON_COMPILE_SECONDS a
    kernel, serially)."""
    parts = step_time(costs, c.gradient_accumulation_steps, COST_GPUS[gpu])
    step = sum(parts.values())
    evals = (c.max_iters // c.eval_interval + 1) * c.eval_iters * (step - parts["optimizer"]) / (
        3 * c.gradient_accumulation_steps)
    return c.max_iters * step + evals + costs.kernels * TRITON_COMPILE_SECONDS, step, parts, costs.kernels


def time_lines(c, config, world, act, flops, flops_per_iter):
    """The dry run's time and compile lines: run_time on each of ESTIMATE_GPUS (each process's step; DDP's
    all-reduce not priced), the H100's step by part and its MFU against the dense bf16 peak, and what priced each
    mixer layer (mixer_layer_time)."""
    if model_module.activation_formula(config, c.batch_size, act) is None:
        return ["time        no estimate: the launch model prices the activations' bytes (see memory)"]
    costs = step_costs(c, config, act)
    priced = {gpu: run_time(c, costs, gpu) for gpu in ESTIMATE_GPUS}
    _, step, parts, kernels = priced["H100"]
    mfu = flops_per_iter / world / step / GPU_PEAKS[COST_GPUS["H100"]["name"]][0]
    gpus = f", {world} GPUs" if world > 1 else ""
    shares = " + ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
    priced_as = []
    for m, x in costs.mixers.items():
        launches = x["recorded"]["launches"] if x["recorded"] else []
        dots = any(launch["dots"] for launch in launches)
        priced_as.append(f"{m} by its " + " and its ".join(
            ([f"{len(launches)} Triton launches"] if launches else []) + ([] if dots else ["sequence FLOPs"])))
    run = "a compiled" if c.compile is not False else "an eager"
    how = f"recorded on fake tensors as {run} run makes them" if costs.recorded else \
        "none recorded: --kernels=torch, or triton is not installed"
    return ["time        estimates by the launch model (analyze.launch_time), not measurements: "
            + ", ".join(f"{gpu} {duration(t[0])}" for gpu, t in priced.items()) + gpus
            + f"\n            H100: {step * 1e3:.1f} ms a step = {shares} ms, {mfu:.0%} MFU"
            + f"\n            mixers a layer: {', '.join(priced_as)} ({how})",
            f"compile     the first step waits for the compiled graphs and about {kernels} Triton kernels: "
            f"{duration(kernels * TRITON_COMPILE_SECONDS)} at {TRITON_COMPILE_SECONDS:.0f} s a kernel (in the times)"]


def fit_line(memory, c, gpu):
    """Whether the run's memory by formula (check_fit's figures) fits a COST_GPUS entry's memory; where it does not,
    the figure that refused it (the largest) and the batch that fits: --batch_size halved, its accumulation doubled
    (the same tokens a step), until the activations and the loss's peak fit."""
    name = COST_GPUS[gpu]["name"]
    need = {k: v for k, v in memory.items() if v and k != "their bf16 copies"}
    if None in need.values():
        return f"fit         {gpu}: not priced (no closed form for the activations)"
    have, total = COST_GPUS[gpu]["memory"], sum(need.values())
    if total <= have:
        return f"fit         {gpu} ({name}, {size(have)}): {size(total)} fits"
    largest = max(need, key=need.get)
    per_batch = sum(v for k, v in need.items() if k.startswith("activations") or k == "the loss's peak")
    batch, accumulation = c.batch_size, c.gradient_accumulation_steps
    while batch > 1 and total - per_batch * (1 - batch / c.batch_size) > have:
        batch, accumulation = batch // 2, accumulation * 2
    fits = total - per_batch * (1 - batch / c.batch_size)
    way = (f"--batch_size={batch} --gradient_accumulation_steps={accumulation} needs {size(fits)}" if fits <= have
           else "no batch fits: a smaller model does")
    return (f"fit         {gpu} ({name}, {size(have)}): {size(total)} refused, the largest figure {largest} "
            f"{size(need[largest])}; {way}")


def dry_run_report(settings, config, world):
    """The dry run's lines for train.py's settings and the model config they make: the model and its parameters
    against the closed form, the tokens, the FLOPs, the memory of one process (weights, gradients, optimizer state,
    activations) and the GPU time (estimates)."""
    c = types.SimpleNamespace(**settings)
    act = 4 if c.dtype == "float32" else 2  # "auto": bf16 autocast, as on the GPUs priced here
    costs = run_costs(c, config, act)
    n_params, parts = costs.n_params, costs.parts
    if None in parts.values():
        missing = ", ".join(model_module.kinds_without(config, "n_params"))
        closed = f"(no closed form: {missing} declares no n_params; see model.MIXERS' protocol)"
    else:
        terms = " + ".join(f"{k} {v:,}" for k, v in parts.items() if v)
        closed = f"= the closed form: {terms}" if sum(parts.values()) == n_params else \
            f"but the closed form gives {sum(parts.values()):,} = {terms} (a layer changed: update its n_params)"
    tokens_per_iter, train_tokens, eval_tokens = run_tokens(c, config.block_size, world)
    flops = run_flops(costs.flops_token, train_tokens, eval_tokens)
    memory = costs.memory
    if None in memory.values():
        missing = ", ".join(model_module.kinds_without(config, "kept_per_token"))
        memory_line = f"no closed form for the activations: {missing} declares no kept_per_token (see model.MIXERS' " \
            f"protocol)"
    else:
        memory_line = f"{sum(memory.values()) / 2**30:.1f} GiB a process, by formula " + \
            f"({'bf16 autocast' if act == 2 else 'fp32'}):\n            " + \
            ", ".join(f"{k} {size(v)}" for k, v in memory.items() if v)
    lines = ["dry run: nothing is trained or written; the model is priced on the meta device",
             f"model       mixer {config.mixer}, {config.n_layer} layers x {config.n_embd}, {config.n_head} heads, "
             f"block {config.block_size}, vocab {config.vocab_size} ({config.padded_vocab_size} rows), {c.optimizer}",
             f"parameters  {n_params:,} {closed}",
             f"tokens      {tokens_per_iter:,} a step ({world} x {c.gradient_accumulation_steps} x {c.batch_size} x "
             f"{config.block_size}) x {c.max_iters:,} steps = {train_tokens:.3g} ({train_tokens / n_params:.1f} a "
             f"parameter)",
             f"FLOPs       {costs.flops_token:.3g} a token (6N = {6 * n_params:.3g}), {flops:.3g} for the run, its "
             f"{eval_tokens:.3g} eval tokens included",
             f"memory      {memory_line}",
             *time_lines(c, config, world, act, flops, tokens_per_iter * costs.flops_token),
             fit_line(memory, c, "T4")]
    if data.is_shard_pattern(c.dataset):
        found = len(glob.glob(c.dataset))
        lines.append(f"data        {found} files match {c.dataset}" if found else f"data        no files match "
                     f"{c.dataset} yet: python data.py fineweb10B --shards=N fetches N x ~100M tokens")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# command line

OPTIONS = {  # analysis options; every GPTConfig key is also accepted (fresh init only)
    "ckpt": "",                        # a train.py checkpoint to analyse (empty: a fresh init)
    "init_from": "",                   # pretrained weights instead: gpt2 .. gpt2-xl, or a folder (as train.py's)
    "out_dir": "",                     # where the outputs go (empty: the checkpoint's folder + /analysis)
    "sections": ",".join(DEFAULT_SECTIONS),  # comma-separated names from SECTIONS (coord, lr_transfer: opt-in)
    "device": "auto",                  # as train.py's --device: auto (cuda > mps > cpu) | cpu | cuda | cuda:1 | mps
    "seed": 0,                         # seeds a fresh init, the batches and the probes
    "dataset": "shakespeare_char",     # as train.py's --dataset (a checkpoint names its own)
    "tokenizer": "auto",               # as train.py's --tokenizer
    "split": "val",                    # train | val: the split the batches come from
    "batch_size": 8,                   # sequences per micro-batch
    "micro_batches": 4,                # micro-batches (at least 2 for the noise scale)
    "hessian_batches": 1,              # micro-batches in the Hessian's loss
    "top_k": 3,                        # top Hessian eigenvalues
    "power_iters": 20,                 # block power iterations for them (at most: they stop once converged)
    "n_probes": 20,                    # Hutchinson probes for the Hessian trace
    "lanczos_iters": 30,               # Lanczos steps per SLQ run
    "n_slq": 1,                        # SLQ runs (random start vectors)
    "scan_batch_sizes": "",            # a batch-size scan instead of an analysis: comma-separated batch sizes
    "scan_target": 2.2,                # the scan's target val loss
    "scan_max_iters": 4000,            # the scan's step limit per run
    "scan_analyze_batch": 0,           # the scan's run that logs the noise scales (0: none)
    "scan_train_args": "",             # extra train.py arguments for every scan run, space-separated
    "mpl_fit": "",                     # multi-power-law fit instead: comma-separated train.py runs (--log_interval=1)
    "mpl_predict": "",                 # run folders whose loss curves the fitted law predicts
    "lengths": "",                     # length_extrapolation instead, at these multiples of block_size (e.g. 1,2,4,8)
    "coord_widths": "64,128,256,512",  # the coord section's model widths
    "lr_transfer_widths": "64,256",    # the lr_transfer section's model widths
    "lr_transfer_steps": 200,          # the lr_transfer section's training steps per run (20 of them warm up)
}
# the allowed values of the numeric options and model keys (runs.in_range)
RANGES = {"seed": "in [0, 2**63)", "batch_size": ">= 1", "micro_batches": ">= 1", "hessian_batches": ">= 1",
          "top_k": ">= 1", "power_iters": ">= 1", "n_probes": ">= 1", "lanczos_iters": ">= 1", "n_slq": ">= 1",
          "scan_target": "> 0", "scan_max_iters": ">= 1", "scan_analyze_batch": ">= 0", "lr_transfer_steps": ">= 1",
          **model_module.CONFIG_RANGES}


def choices():
    """The options and model keys that take one of a set of values, and those values (the mixer's letters apart:
    GPTConfig checks them)."""
    return {"split": ("train", "val"), "tokenizer": ("auto", *data.TOKENIZERS),
            **{k: v for k, v in model_module.config_choices().items() if k != "mixer"}}


def train_settings():
    """The names of train.py's run settings (its module-level assignments above RUN_DEFAULTS, read from its
    source, as analyze.py does not import train.py) and the optimizers' settings (optim.OPTIMIZERS' rows): the keys
    of a train.py config file that analyze.py skips."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")) as f:
        body = ast.parse(f.read()).body
    names = [node.targets[0].id for node in body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)]
    return names[:names.index("RUN_DEFAULTS")] + list(optim.SETTINGS)


def parse_args(argv):
    """runs.parse_config (train.py's parser) over OPTIONS and the GPTConfig keys, with GPTConfig's
    defaults. A bare path or --config=path is a train.py config file; only its model keys, dataset and
    tokenizer are used (its other keys are train.py's settings; a key that is neither is refused). Every value is
    checked as train.py checks its own (runs.check_values, GPTConfig's rules), and the sections chosen. Returns
    (options, model overrides)."""
    model_keys = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size"}
    with open(__file__) as f:
        options_source = f.read().split("\nOPTIONS = {", 1)[1]
    descriptions = {**runs.source_comments(inspect.getsource(GPTConfig)), **runs.source_comments(options_source)}
    given = runs.parse_config(argv, {**OPTIONS, **model_keys}, __doc__, descriptions,
                              file_keys={*model_keys, "dataset", "tokenizer"}, file_others=train_settings(),
                              allowed={**RANGES, **runs.choices_help(choices(), {
                                  **{key: (model_module, table) for key, table in model_module.CHOICE_TABLES.items()},
                                  "tokenizer": (data, "TOKENIZERS")})})
    opts = {**OPTIONS, **{k: v for k, v in given.items() if k in OPTIONS}}
    overrides = {k: v for k, v in given.items() if k not in OPTIONS}
    runs.check_values({**model_keys, **given}, RANGES, choices())
    GPTConfig(**{**model_keys, **overrides})  # the model's own rules, with a stand-in vocabulary
    check_modes(opts)
    check_sections(opts)
    return opts, overrides


INSTEAD_MODES = ("scan_batch_sizes", "mpl_fit", "lengths")  # the options that run something else than the sections


def check_modes(opts):
    """At most one of INSTEAD_MODES, and --mpl_predict only with the --mpl_fit it predicts from."""
    given = [key for key in INSTEAD_MODES if opts[key]]
    if len(given) > 1:
        raise ValueError(f"--{given[0]} and --{given[1]} each run instead of the analysis, and only one can: give one "
                         f"of {', '.join('--' + key for key in INSTEAD_MODES)} at a time")
    if opts["mpl_predict"] and not opts["mpl_fit"]:
        raise ValueError(f"--mpl_predict={opts['mpl_predict']!r} needs --mpl_fit, the runs whose loss curves fit the "
                         f"law that predicts it: e.g. --mpl_fit=out/constant,out/wsd50 --mpl_predict=out/cosine")


def check_sections(opts):
    """--sections names sections of SECTIONS, --micro_batches is enough for them, and the widths are lists."""
    sections = [s for s in opts["sections"].split(",") if s]
    if not sections and not any(opts[key] for key in INSTEAD_MODES):
        raise ValueError(f"--sections={opts['sections']!r} names no section: choose from {','.join(SECTIONS)} (the "
                         f"default: --sections={OPTIONS['sections']})")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}: choose from {','.join(SECTIONS)}")
    for key in ("coord_widths", "lr_transfer_widths"):
        parse_list(opts, key, int)
    two = [s for s in sections if SECTIONS[s].two_batch_sizes]
    if two and opts["micro_batches"] < 2:
        raise ValueError(f"--micro_batches={opts['micro_batches']} is too few for the {', '.join(two)} section"
                         f"{'s' * (len(two) > 1)}, which compare two batch sizes: use --micro_batches=2 or more, or "
                         f"--sections without {', '.join(two)}")


def parse_list(opts, key, kind):
    """The comma-separated numbers of opts[key], each a kind (int or float) above 0, or a one-line error."""
    try:
        values = [kind(v) for v in opts[key].split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        example = "4,8,16" if kind is int else "1,2,4,8"
        raise ValueError(f"--{key}={opts[key]!r} is not valid: give numbers above 0 separated by commas, e.g. "
                         f"--{key}={example}")
    return values


def check_model_inputs(model, opts, sections, device):
    """Once the model is built and before a batch is drawn: each section named in --sections finds its part in the
    model; the Hessian's block of top_k + max(2, top_k) vectors is smaller than the parameter count (else it spans them
    all); the analysis's memory by formula (analysis_memory) fits the device's."""
    if opts["sections"] != OPTIONS["sections"]:
        for name in sections:
            part = SECTIONS[name].part
            if part and not any(isinstance(m, part[0]) for m in model.modules()):
                raise ValueError(f"--sections={name} analyses the {part[1]}, and this model (mixer "
                                 f"{model.config.mixer!r}, residual {model.config.residual!r}) has none: drop {name} "
                                 f"from --sections")
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    k = opts["top_k"]
    if "hessian" in sections and k + max(2, k) >= n:
        raise ValueError(f"--top_k={k} Hessian eigenvalues need a block of {k + max(2, k):,} vectors in the power "
                         f"iteration, as many as the model's {n:,} parameters or more: use --top_k={(n - 1) // 2:,} or "
                         f"fewer (the top few are what it resolves; {OPTIONS['top_k']} by default)")
    memory = analysis_memory(model.config, n, opts, sections)
    have, where = device_memory(device)
    if have is not None and sum(memory.values()) > have:
        raise ValueError(f"this analysis needs at least {size(sum(memory.values()))} by formula (" +
                         ", ".join(f"{key} {size(v)}" for key, v in memory.items() if v) + f"), more than the "
                         f"{size(have)} of {where}: use a smaller --batch_size, --micro_batches or --hessian_batches, "
                         f"or --top_k")


def batches_read(opts, sections):
    """The micro-batches the sections read: as many as the one that reads the most (0: none reads a batch)."""
    return max([SECTIONS[name].batches(opts) for name in sections if SECTIONS[name].batches] or [0])


def analysis_memory(config, n_params, opts, sections):
    """The least memory the sections need, by formula, in bytes by what holds it: the fp32 weights and a gradient;
    the graphs kept for a second backward (the Hessian's micro-batches, or all of them for the noise section), each
    a first backward's activations (model.activation_formula in fp32) and as much again for the gradient's own
    graph; the batches' tokens and targets; the Hessian's block of vectors (the block, its products, their
    rotation)."""
    b, T = opts["batch_size"], config.block_size
    graphs = max([opts["hessian_batches"]] * ("hessian" in sections) + [opts["micro_batches"]] * ("noise" in sections)
                 + [min(1, batches_read(opts, sections))])
    activations = model_module.activation_formula(config, b, 4) or 0
    k = opts["top_k"]
    return {"weights": 4 * n_params, "a gradient": 4 * n_params,
            f"graphs of {graphs} micro-batches of {b} x {T}": 2 * graphs * activations,
            "the batches": 16 * batches_read(opts, sections) * b * T,
            "the Hessian's block": 3 * 4 * n_params * (k + max(2, k)) if "hessian" in sections else 0}


def seconds_a_pass(model, batch, device):
    """One forward-backward pass of model on batch (x, y), timed now: the second of two (the first warms up)."""
    for _ in range(2):
        started = time.perf_counter()
        with torch.enable_grad():
            model(*batch)[1].backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def price(opts, sections, seconds, block_size, device):
    """The analysis's price line: each section's forward-backward passes (Section.passes) at seconds a pass."""
    passes = {name: SECTIONS[name].passes(opts) for name in sections if SECTIONS[name].passes}
    total = sum(passes.values())
    unpriced = [name for name in sections if SECTIONS[name].needs_grad and not SECTIONS[name].passes]
    return (f"price: about {duration(total * seconds)}, an estimate: {total:,.0f} forward-backward passes of a "
            f"{opts['batch_size']}x{block_size} micro-batch at most (" +
            ", ".join(f"{name} {p:,.0f}" if p >= 1 else f"{name} {p:.2f}" for name, p in passes.items()) +
            f"; a Hessian-vector product counted as {HVP_PASSES} passes, a forward as 1/3) at {seconds:.3f} s a pass, "
            f"one timed now on {device}" + (f"; {', '.join(unpriced)} train their own models, not priced" if unpriced
                                             else "") + loaded_cpu_hint(device))


def loaded_cpu_hint(device):
    """On a CPU busier than its cores, torch's threads wait on each other (a pass can take ten times longer than on
    one thread): the hint that says so, else ""."""
    load, cores = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0, os.cpu_count() or 1
    if device.type != "cpu" or torch.get_num_threads() == 1 or load <= cores:
        return ""
    return (f"\nnote: this CPU is busy (load {load:.1f} on {cores} cores) and torch runs {torch.get_num_threads()} "
            f"threads, which then wait on each other: OMP_NUM_THREADS=1 python analyze.py ... may be much faster")


def load_model(opts, model_overrides):
    """(model, dataset, tokenizer): from --ckpt (its config names the data), from --init_from's pretrained weights, or
    a fresh init of the GPTConfig keys given, with vocab_size from the dataset."""
    if opts["ckpt"] and opts["init_from"]:
        raise ValueError(f"--ckpt={opts['ckpt']!r} and --init_from={opts['init_from']!r} each name the model: give one")
    if opts["init_from"]:  # its data: --dataset in its tokens; the default char data becomes GPT-2's Shakespeare
        meta = runs.pretrained_meta(opts["init_from"])
        default_data = opts["dataset"] == OPTIONS["dataset"] and meta["tokenizer"] == "gpt2"
        return (GPT.from_pretrained(opts["init_from"], **model_overrides),
                "shakespeare" if default_data else opts["dataset"], opts["tokenizer"])
    if opts["ckpt"]:
        if model_overrides:
            raise ValueError(f"model keys {sorted(model_overrides)} cannot change a checkpoint's model: drop them")
        ckpt = runs.load_checkpoint(opts["ckpt"], "--ckpt")
        model = GPT(GPTConfig.from_dict(ckpt["config"]))
        runs.load_weights(model, ckpt, opts["ckpt"])
        return model, ckpt["config"].get("dataset", opts["dataset"]), ckpt["config"].get("tokenizer", opts["tokenizer"])
    _, _, meta = data.load_dataset(opts["dataset"], opts["tokenizer"])
    torch.manual_seed(opts["seed"])
    model = GPT(GPTConfig(**{"vocab_size": meta["vocab_size"], **model_overrides}))
    return model, opts["dataset"], opts["tokenizer"]


def main_scan(opts):
    """--scan_batch_sizes=4,8,16: batch_scan, the critical-batch fit, scan.png and a table."""
    out_dir = opts["out_dir"] or os.path.join("out", "scan")
    batch_sizes = parse_list(opts, "scan_batch_sizes", int)
    data.check_writable_folder(out_dir, "out_dir")
    scan = batch_scan(batch_sizes, opts["scan_target"], out_dir, opts["scan_max_iters"], opts["scan_analyze_batch"],
                      train_args=opts["scan_train_args"].split())
    report_scan(scan, out_dir)


def report_scan(scan, out_dir):
    """The fit of a scan.json, its plot and a table, with the noise scales the analysed run logged (in
    the same units, sequences, averaged over the run's calls). Returns the fit."""
    fit = fit_critical_batch([r["steps"] for r in scan["runs"]], [r["examples"] for r in scan["runs"]])
    plot_batch_scan(scan, fit, os.path.join(out_dir, "scan.png"))
    print(f"{'B':>5s} {'steps S':>9s} {'examples E':>11s} {'fit S':>9s}")
    for r in scan["runs"]:
        print(f"{r['batch_size']:5d} {r['steps']:9.1f} {r['examples']:11.0f} "
              f"{fit['S_min'] + fit['E_min'] / r['batch_size']:9.1f}")
    print(f"S_min {fit['S_min']:.1f} steps, E_min {fit['E_min']:.0f} sequences, "
          f"B_crit = E_min/S_min {fit['B_crit']:.1f} sequences (rms relative misfit {fit['rms_rel_error']:.3f})")
    noise = [r["noise"] for r in scan["noise"] if "noise" in r]
    if noise:
        fit["noise_calls"] = len(noise)
        for key in ("B_noise", "B_simple"):
            fit[f"{key}_mean"] = float(np.mean([n[key] for n in noise]))
        fit["B_noise_ratio_of_sums"] = sum(n["tr_H_sigma"] for n in noise) / sum(n["GHG"] for n in noise)
        fit["B_simple_ratio_of_sums"] = sum(n["tr_sigma"] for n in noise) / sum(n["G_sq"] for n in noise)
        print(f"over the {len(noise)} analysis calls of the B = {scan.get('analyze_batch')} run: "
              f"mean B_noise {fit['B_noise_mean']:.1f}, mean B_simple {fit['B_simple_mean']:.1f}; "
              f"Σ tr HΣ / Σ GᵀHG {fit['B_noise_ratio_of_sums']:.1f}, "
              f"Σ tr Σ / Σ |G|² {fit['B_simple_ratio_of_sums']:.1f}")
    return fit


def main_mpl(opts):
    """--mpl_fit=dirs --mpl_predict=dirs: mpl_predict, mpl.png and the errors."""
    fit_dirs = [d for d in opts["mpl_fit"].split(",") if d]
    predict_dirs = [d for d in opts["mpl_predict"].split(",") if d]
    out_dir = opts["out_dir"] or os.path.join("out", "mpl")
    data.check_writable_folder(out_dir, "out_dir")
    runs.make_folder(out_dir, "out_dir")
    result = mpl_predict(fit_dirs, predict_dirs, os.path.join(out_dir, "mpl.png"))
    print("multi-power law fitted to " + ", ".join(fit_dirs) + f" (rms {result['fit_rms']:.4f}): " +
          ", ".join(f"{k} {v:.4g}" for k, v in result["params"].items()))
    for d, r in result["runs"].items():
        print(f"  {d}: predicted val loss rms error {r['rms']:.4f}, max {r['max']:.4f}, at the last eval "
              f"{r['final_error']:+.4f} (without the decay term: rms {r['rms_no_decay_term']:.4f})")
    _write_json(os.path.join(out_dir, "mpl.json"), result)


def main(argv):
    opts, model_overrides = parse_args(argv)
    if opts["scan_batch_sizes"]:
        return main_scan(opts)
    if opts["mpl_fit"]:
        return main_mpl(opts)
    sections = [s for s in opts["sections"].split(",") if s]
    device = runs.use_device(opts["device"])  # made current: Triton launches on the current GPU
    factors = parse_list(opts, "lengths", float) if opts["lengths"] else None
    out_dir = opts["out_dir"] or os.path.join(os.path.dirname(opts["ckpt"]) if opts["ckpt"] else "out", "analysis")
    data.check_writable_folder(out_dir, "out_dir")
    model, dataset, tokenizer = load_model(opts, model_overrides)
    model = analysis_model(model.to(device))
    if not factors:
        check_model_inputs(model, opts, sections, device)
    if factors or batches_read(opts, sections):  # the sections that read no batch need no data
        train_tokens, val_tokens, meta = data.load_dataset(dataset, tokenizer)
        if meta["vocab_size"] > model.config.vocab_size:
            raise ValueError(f"--dataset={dataset!r} has {meta['vocab_size']} tokens, more than the model's "
                             f"{model.config.vocab_size}: use data in the model's tokens")
    if factors:
        rows = length_extrapolation(model, val_tokens if opts["split"] == "val" else train_tokens, factors,
                                    batch_size=opts["batch_size"])
        os.makedirs(out_dir, exist_ok=True)
        _write_json(os.path.join(out_dir, "length_extrapolation.json"), rows)
        print(f"{'scaling':8s} {'factor':>6s} {'length':>6s} {'val loss':>8s}")
        for r in rows:
            print(f"{r['scaling']:8s} {r['factor']:6g} {r['length']:6d} {r['val_loss']:8.4f}")
        return
    batches = []
    if batches_read(opts, sections):
        sampler = data.BatchSampler(val_tokens if opts["split"] == "val" else train_tokens, opts["batch_size"],
                                    model.config.block_size, opts["seed"], device=device)
        batches = [sampler.next_batch() for _ in range(batches_read(opts, sections))]
    what = f"checkpoint {opts['ckpt']}" if opts["ckpt"] else f"{opts['init_from']}'s weights" if opts["init_from"] \
        else "a fresh init"
    print(f"analysing {what}: "
          f"{model.num_params():,} parameters, {len(batches)} batches of "
          f"{opts['batch_size']}x{model.config.block_size} {opts['split']} tokens from {dataset}, "
          f"sections {','.join(sections)} -> {out_dir}", flush=True)
    if batches:
        print(price(opts, sections, seconds_a_pass(model, batches[0], device), model.config.block_size, device),
              flush=True)
    summary = run_analysis(model, batches, out_dir, sections, opts)
    print_table(summary)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, data.DiskFullError) as e:  # bad input, or a full disk: one line that says what to fix
        sys.exit(f"analyze.py: {e}")
