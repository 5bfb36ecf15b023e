"""
Spectra that explain what training did: weights, Hessian, gradients, Newton–Schulz, hyper-connection
mixing matrices, GDN2 gates, layer-input isotropy.

    python analyze.py --ckpt=out/ckpt.pt                      # a trained model (its data and batch shape)
    python analyze.py --n_layer=4 --n_embd=128                # a fresh init: any GPTConfig key, no training
    python analyze.py --config=my_config.py --mixer=GGGA     # a fresh init from a train.py config file
    python analyze.py --ckpt=out/ckpt.pt --sections=weights,hessian
    python analyze.py --ckpt=out/ckpt.pt --lengths=1,2,4,8    # length_extrapolation: val loss at 1x..8x block_size

writes <out_dir>/summary.json (default out_dir: the checkpoint's folder + /analysis), <section>.npz with
the arrays and <section>.png, and prints a short table. Sections, each also a function of a model:

    weights    weight_spectra(model)             singular values, σ_max, natural spectral norm, stable rank,
                                                 Marchenko–Pastur fit and the spikes above its edge, tail α
    hessian    hessian_spectrum(model, batches)  top eigenvalues (block power iteration on Hessian-vector
                                                 products), Hutchinson trace, stochastic Lanczos density
    gradients  gradient_stats(model, batches)    gradient stable rank per matrix, noise scale
                                                 B_simple = tr(Σ)/|G|² from two batch sizes
    ns         ns_response(coeffs, steps, xs)    what msign's Newton–Schulz does to each singular value
    hc         hc_spectra(model, idx)            H_res spectra per layer and ‖Π H_res‖₂ down the depth
    gates      gdn2_gates(model, idx)            ρ = ‖I − k(b⊙k)ᵀ‖₂, fraction of decays clipped, max ‖(I − a cᵀ)D‖₂
    isotropy   isotropy(model, idx)              eigenvalues of each linear layer's input second moment

The model runs in fp32 with kernels="torch" and the explicit-softmax attention (analysis_model): fused
SDPA and the Triton kernels have no second derivative, which Hessian-vector products need.
During training, `train.py --analyze_every=N` calls analyze_during_training (the cheap sections,
one JSON line per call) and plot_training_analysis draws them against the step.
"""
import dataclasses
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn

import data
import kernels
import optim
from init import natural_spectral_norm
from model import GPT, GPTConfig, HyperConnection, GatedDelta

SECTIONS = ("weights", "hessian", "gradients", "ns", "hc", "gates", "isotropy")
TW1_QUANTILE_99 = 2.02  # 99% quantile of the Tracy–Widom (β = 1) law of the largest noise eigenvalue


def progress(label, i, n, verbose):
    if verbose and (i == n or i % max(1, n // 10) == 0):
        print(f"\r  {label}: {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)


def analysis_model(model):
    """A copy of model (unwrapped from DDP / torch.compile) with the same weights, in fp32, eval mode,
    kernels="torch" and math attention, so that double backward runs through it."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    cfg = dataclasses.replace(model.config, attention="math", kernels="torch")
    with torch.random.fork_rng(devices=[]):  # building a GPT draws an init: leave the caller's RNG alone
        twin = GPT(cfg)
    twin.load_state_dict(model.state_dict())
    return twin.to(device=next(model.parameters()).device, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------------------------
# length extrapolation: validation loss at multiples of the training length

ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")


@torch.no_grad()
def length_extrapolation(model, tokens, factors=(1, 2, 4, 8), n_tokens=16384, batch_size=8):
    """Mean cross-entropy of the first n_tokens targets of `tokens`, cut into windows of factor × block_size
    tokens: every length predicts the same tokens, only the context differs. Attention with fixed RoPE
    frequencies runs under each rope_scaling with rope_factor = factor (none: the trained frequencies, used
    past the training length); learned/lie frequencies only as trained; G and M layers have no length limit
    and run as they are. Returns rows {"scaling", "factor", "length", "val_loss"}."""
    cfg = model.config
    scalings = ROPE_SCALINGS if "A" in cfg.mixer and cfg.rope == "fixed" else ("none",)
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
            if "A" in cfg.mixer:  # rebuilt so that its cos/sin cache covers `length` positions
                with torch.random.fork_rng(devices=[]):
                    twin = GPT(dataclasses.replace(cfg, rope_scaling=scaling, rope_factor=factor))
                twin.load_state_dict(model.state_dict())
                twin = twin.to(device).eval()
            losses = [twin(x[i:i + batch_size].to(device), y[i:i + batch_size].to(device))[1].item() * len(x[i:i + batch_size])
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
    s²/σ² > μ + 2.02·τ, μ = (sqrt(N−1) + sqrt M)², τ = sqrt μ · (1/sqrt(N−1) + 1/sqrt M)^⅓ (Johnstone 2001),
    which pure noise exceeds with probability 1%."""
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
# gates: the spectral clip of Gated DeltaNet-2 (seed gdn2-stability.md)

@torch.no_grad()
def gdn2_gates(model, idx):
    """For each GatedDelta mixer on one forward pass of idx, per token and head, with a = k, c = b⊙k:
    ρ = ‖I − a cᵀ‖₂ = (η + sqrt(η² − 4 a·c + 4)) / 2, η = ‖a‖‖c‖; the fraction of decay entries the
    clip g ← min(g, −log ρ) (kernels.gdn2_decay_clip) changes, whether or not the model applies it
    (gdn_clip); and the largest ‖(I − a cᵀ) Diag(exp g)‖₂ (by SVD) before and after the clip. Returns (summary, arrays); (None, {}) for a model without G mixers."""
    captured = _capture_inputs(model, GatedDelta, idx)
    if not captured:
        return None, {}
    layers, rhos = [], []
    for name, mixer, x in captured:
        _, k, _, _, b, _ = mixer.recurrence_inputs(x)
        g = mixer.log_decay(x).expand_as(k).float()
        clipped = kernels.gdn2_decay_clip(g, k, b, kernels="torch")
        a, c = k.double(), (b * k).double()
        eta = a.norm(dim=-1) * c.norm(dim=-1)
        rho = (eta + torch.sqrt((eta ** 2 - 4 * (a * c).sum(-1) + 4).clamp(min=0))) / 2
        transition = torch.eye(a.size(-1), dtype=torch.float64) - a.unsqueeze(-1) * c.unsqueeze(-2)
        before = torch.linalg.matrix_norm(transition * g.double().exp().unsqueeze(-2), ord=2)
        after = torch.linalg.matrix_norm(transition * clipped.double().exp().unsqueeze(-2), ord=2)
        layers.append({"name": name, "variant": mixer.variant, "clip_in_model": mixer.clip,
                       "rho_mean": rho.mean().item(), "rho_max": rho.max().item(),
                       "frac_clipped": (clipped < g).float().mean().item(),
                       "max_transition_norm": before.max().item(), "max_transition_norm_clipped": after.max().item()})
        rhos.append(rho.flatten().cpu().numpy())
    return {"layers": layers}, {"rho": np.stack(rhos)}


# ----------------------------------------------------------------------------------------------------
# isotropy: the second moment of each linear layer's input (seed isotropy-steepest-descent.md)

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
# plots: one PNG per section

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path):
    """Write the figure to a temporary name, then rename: a crash never leaves half a PNG."""
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


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
    ax.plot([summary[nm]["stable_rank"] / min(summary[nm]["shape"]) for nm in names], "o", label="stable rank / min dim")
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
        ax.axvline(math.log10(summary[nm]["spike_threshold"] ** 2 / N), color="k", ls=":", lw=1, label="spike threshold")
        ax.set_xlabel("log10 λ,  λ = s² / max(shape)", fontsize=6)
        ax.set_title(f"{nm.replace('.weight', '')}\nspikes {summary[nm]['n_spikes']}, α {summary[nm]['alpha']:.1f}", fontsize=8)
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


def plot_ns(results, path, model_ratios=None):
    """results: {coeffs: (summary, arrays)} from ns_response; model_ratios: σ_i/‖G‖_F of real gradients."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.linspace(0, 1.05, 500)
    ax1.plot(x, x, color="gray", lw=0.8, ls=":")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    for coeffs, (summary, arrays) in results.items():
        a, b, c = optim.ns_schedule(1, coeffs)[0]
        ax1.plot(x, a * x + b * x ** 3 + c * x ** 5, label=f"{coeffs}: peak {summary['one_step_peak']:.4f} "
                                                           f"at {summary['one_step_argmax']:.4f}")
        ax2.semilogx(arrays["xs"], arrays["ys"][-1], label=f"{coeffs}, {summary['steps']} steps "
                                                          f"(slope at 0: {summary['slope_at_zero']:.0f})")
    ax1.set_title("one Newton–Schulz step on a singular value", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_title("after all steps: input σ/‖G‖_F → output singular value", fontsize=9)
    ax2.legend(fontsize=7, loc="upper left")
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
    ax2.plot(depth, [layer["max_transition_norm"] for layer in summary["layers"]], "o-", label="max ‖(I − a cᵀ)D‖₂")
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


# ----------------------------------------------------------------------------------------------------
# run sections, save, print

def _jsonable(x):
    return json.loads(json.dumps(x, default=float, allow_nan=True))


def run_analysis(model, batches, out_dir, sections=SECTIONS, top_k=3, power_iters=100, n_probes=100,
                 lanczos_iters=60, n_slq=2, hessian_batches=1, seed=0, verbose=True):
    """Run the chosen sections on an analysis_model and write summary.json, <section>.npz and
    <section>.png into out_dir. batches: micro-batches [(x, y), ...] (≥ 2 for the noise scale); the
    Hessian uses the first hessian_batches of them, hc/gates/isotropy the first one. Returns the summary."""
    os.makedirs(out_dir, exist_ok=True)
    summary, gradient_ratios = {}, None

    def save(section, section_summary, arrays, plot, *extra):
        summary[section] = section_summary
        if arrays:
            np.savez(os.path.join(out_dir, f"{section}.npz"), **{k.replace(".", "/"): v for k, v in arrays.items()})
        plot(section_summary, arrays, os.path.join(out_dir, f"{section}.png"), *extra)

    idx = batches[0][0]
    for section in sections:
        if verbose:
            print(f"[{section}]", file=sys.stderr)
        if section == "weights":
            save(section, *weight_spectra(model), plot_weights)
        elif section == "hessian":
            s, a = hessian_spectrum(model, batches[:hessian_batches], top_k, power_iters, n_probes=n_probes,
                                    lanczos_iters=lanczos_iters, n_slq=n_slq, seed=seed, verbose=verbose)
            save(section, s, a, plot_hessian)
        elif section == "gradients":
            s, a = gradient_stats(model, batches)
            gradient_ratios = np.concatenate([sv / max(np.sqrt((sv ** 2).sum()), 1e-300)
                                              for nm, sv in a.items() if optim.is_block_matrix(nm, model.get_parameter(nm))])
            save(section, s, a, plot_gradients)
        elif section == "ns":
            results = {coeffs: ns_response(coeffs) for coeffs in optim.NS_COEFFS}
            ns_summary = {coeffs: s for coeffs, (s, _) in results.items()}
            if gradient_ratios is not None:
                for coeffs in results:
                    out = ns_response(coeffs, xs=gradient_ratios)[1]["ys"][-1]
                    ns_summary[coeffs]["gradient_frac_below_half"] = float((out < 0.5).mean())
            arrays = {f"{coeffs}.{k}": v for coeffs, (_, a) in results.items() for k, v in a.items()}
            summary[section] = ns_summary
            np.savez(os.path.join(out_dir, "ns.npz"), **{k.replace(".", "/"): v for k, v in arrays.items()})
            plot_ns(results, os.path.join(out_dir, "ns.png"), gradient_ratios)
        elif section in ("hc", "gates"):
            s, a = (hc_spectra if section == "hc" else gdn2_gates)(model, idx)
            if s is None:
                summary[section] = None
                continue
            save(section, s, a, plot_hc if section == "hc" else plot_gates)
        elif section == "isotropy":
            save(section, *isotropy(model, idx), plot_isotropy)
        else:
            raise ValueError(f"unknown section {section!r}: use any of {', '.join(SECTIONS)}")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(_jsonable(summary), f, indent=1)
    return summary


def print_table(summary):
    if summary.get("weights"):
        print(f"{'matrix':34s} {'shape':>11s} {'σ_max':>7s} {'nat‖W‖':>7s} {'s.rank':>7s} {'spikes':>6s} {'α':>6s}")
        for name, s in summary["weights"].items():
            print(f"{name:34s} {'x'.join(map(str, s['shape'])):>11s} {s['sigma_max']:7.3f} "
                  f"{s['natural_spectral_norm']:7.3f} {s['stable_rank']:7.2f} {s['n_spikes']:6d} {s['alpha']:6.2f}")
    if summary.get("hessian"):
        h = summary["hessian"]
        line = f"hessian: top eigenvalues {', '.join(f'{v:.4g}' for v in h['top_eigenvalues'])}"
        if "trace" in h:
            line += f"; trace {h['trace']:.4g} ± {h['trace_stderr']:.2g}"
        if "slq_lambda_min" in h:
            line += (f"; SLQ range [{h['slq_lambda_min']:.3g}, {h['slq_lambda_max']:.3g}], trace {h['slq_trace']:.4g}, "
                     f"mass below −1% of the radius {h['slq_mass_negative']:.3f}")
        print(line)
    if summary.get("gradients"):
        g = summary["gradients"]
        ranks = [m["stable_rank"] for m in g["matrices"].values()]
        print(f"gradients: B_simple {g['B_simple']:.4g} sequences (tr Σ {g['tr_sigma']:.3g}, |G|² {g['G_sq']:.3g}; "
              f"B {g['b_small']} vs {g['b_big']}); gradient stable rank median {np.median(ranks):.2f}")
    for coeffs, s in (summary.get("ns") or {}).items():
        extra = f"; gradient directions left below 0.5: {s['gradient_frac_below_half']:.3f}" if "gradient_frac_below_half" in s else ""
        print(f"ns {coeffs}: one-step peak {s['one_step_peak']:.4f} at {s['one_step_argmax']:.4f}, slope at 0 after "
              f"{s['steps']} steps {s['slope_at_zero']:.1f}, output range for x ≥ 1e-3 "
              f"[{s['range_above_1e-3'][0]:.3f}, {s['range_above_1e-3'][1]:.3f}]{extra}")
    if summary.get("hc"):
        h = summary["hc"]
        print(f"hc ({h['kind']}): ‖Π H_res‖₂ down the depth " +
              " ".join(f"{layer['prod_norm_max']:.3f}" for layer in h["layers"]))
    if summary.get("gates"):
        for layer in summary["gates"]["layers"]:
            print(f"gates {layer['name']}: ρ mean {layer['rho_mean']:.4f} max {layer['rho_max']:.4f}, clipped "
                  f"{layer['frac_clipped']:.4f}, max ‖(I−acᵀ)D‖₂ {layer['max_transition_norm']:.4f} → "
                  f"{layer['max_transition_norm_clipped']:.4f}")
    if summary.get("isotropy"):
        iso = summary["isotropy"]
        print("isotropy (participation ratio, 1 = isotropic): " +
              " ".join(f"{name.replace('blocks.', '').replace('.weight', '')} {s['participation_ratio']:.2f}"
                       for name, s in iso.items()))


# ----------------------------------------------------------------------------------------------------
# during training: train.py --analyze_every=N

def analyze_during_training(model, batch, step, out_dir, micro_batches=4, hessian_sequences=8, power_iters=10):
    """The cheap sections on one training batch (x, y), appended as one JSON line to
    out_dir/analysis.jsonl: per matrix σ_max, natural spectral norm and stable rank; the top Hessian
    eigenvalue (power_iters block power iterations on the first hessian_sequences sequences); the noise
    scale from micro_batches equal slices of the batch (|G_small|², |G_big|² logged too, so they can be
    averaged over steps before dividing); and the HC / GDN2 summaries when the model has them.
    Works on an fp32 copy (analysis_model) with autocast off, and leaves the model, its gradients and the
    global RNG untouched. Returns the record."""
    twin = analysis_model(model)
    x, y = (t.to(next(twin.parameters()).device) for t in batch)
    with torch.autocast(device_type=x.device.type, enabled=False):  # fp32 even inside a bf16 training step
        record = {"step": step}
        weights, _ = weight_spectra(twin)
        record["weights"] = {name: {k: s[k] for k in ("sigma_max", "natural_spectral_norm", "stable_rank", "n_spikes")}
                             for name, s in weights.items()}
        hessian, _ = hessian_spectrum(twin, [(x[:hessian_sequences], y[:hessian_sequences])], top_k=1,
                                      power_iters=power_iters, tol=1e-3, n_probes=0, lanczos_iters=0, seed=step)
        record["hessian_top"] = hessian["top_eigenvalues"][0]
        b = x.size(0) // micro_batches
        if micro_batches >= 2 and b >= 1:
            grads, _ = gradient_stats(twin, [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(micro_batches)])
            record["noise"] = {k: grads[k] for k in ("b_small", "b_big", "sq_norm_small", "sq_norm_big", "G_sq", "tr_sigma", "B_simple")}
            record["gradient_stable_rank"] = {name: m["stable_rank"] for name, m in grads["matrices"].items()}
        hc, _ = hc_spectra(twin, x)
        if hc is not None:
            record["hc_prod_norm"] = [layer["prod_norm_max"] for layer in hc["layers"]]
        gates, _ = gdn2_gates(twin, x)
        if gates is not None:
            record["gates"] = [{k: layer[k] for k in ("rho_max", "frac_clipped", "max_transition_norm")} for layer in gates["layers"]]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "analysis.jsonl"), "a") as f:
        f.write(json.dumps(_jsonable(record)) + "\n")
    return record


def plot_training_analysis(jsonl_path, png_path):
    """Natural spectral norm and stable rank of every matrix, the top Hessian eigenvalue and the noise
    scale against the step, from analyze_during_training's JSONL."""
    plt = _pyplot()
    with open(jsonl_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    names = list(records[0]["weights"])
    cmap = plt.get_cmap("viridis")
    for i, name in enumerate(names):
        color = cmap(i / max(1, len(names) - 1))
        label = name.replace(".weight", "") if i in (0, len(names) - 1) else None
        axes[0, 0].plot(steps, [r["weights"][name]["natural_spectral_norm"] for r in records], color=color, lw=1, label=label)
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
        axes[1, 1].plot([r["step"] for r in noisy], [r["noise"]["B_simple"] for r in noisy], ".", alpha=0.5, label="per call")
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
    axes[1, 1].set_title("gradient noise scale B_simple (sequences)", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("step")
    _save(plt, fig, png_path)


# ----------------------------------------------------------------------------------------------------
# command line

OPTIONS = {  # analysis options; every GPTConfig key is also accepted (fresh init only)
    "ckpt": "", "out_dir": "", "sections": ",".join(SECTIONS), "device": "auto", "seed": 0,
    "dataset": "shakespeare_char", "tokenizer": "char", "split": "val",
    "batch_size": 8, "micro_batches": 8, "hessian_batches": 1,
    "top_k": 3, "power_iters": 100, "n_probes": 100, "lanczos_iters": 60, "n_slq": 2,
    "lengths": "",  # e.g. 1,2,4,8: instead of the sections, length_extrapolation at these multiples of block_size
}


def parse_args(argv):
    """--key=value for OPTIONS and GPTConfig keys; a bare path or --config=path is a train.py config file
    whose model and data keys are used (its other keys are training settings and are ignored)."""
    model_keys = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    opts, model_overrides = dict(OPTIONS), {}
    for arg in argv:
        if arg in ("-h", "--help"):
            print(__doc__ + "\noptions: --config=file.py " + " ".join(f"--{k}={v!r}" for k, v in OPTIONS.items()) +
                  "\nfresh-init model keys: " + " ".join(f"--{k}" for k in model_keys))
            sys.exit(0)
        if arg.startswith("--config="):
            arg = arg[len("--config="):]
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ValueError(f"config file {arg!r} not found: give a train.py-style .py file of assignments")
            values = {}
            exec(open(arg).read(), {}, values)
            pairs = [(k, v) for k, v in values.items() if k in OPTIONS or k in model_keys]
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq or (key not in OPTIONS and key not in model_keys):
                raise ValueError(f"bad argument {arg!r}: use --key=value with a key among "
                                 f"{', '.join(OPTIONS)} or a GPTConfig key ({', '.join(model_keys)})")
            pairs = [(key, text)]
        for key, value in pairs:
            default = OPTIONS.get(key, model_keys.get(key))
            if isinstance(value, str) and not isinstance(default, str):
                value = {"true": True, "false": False}.get(value.lower(), value)
                try:
                    value = type(default)(value) if not isinstance(value, bool) else value
                except ValueError:
                    raise ValueError(f"--{key} expects a {type(default).__name__} (default {default!r}), got {value!r}") from None
            (opts if key in OPTIONS else model_overrides)[key] = value
    return opts, model_overrides


def load_model(opts, model_overrides):
    """(model, dataset, tokenizer): from --ckpt (its config names the data) or a fresh init of the
    GPTConfig keys given, with vocab_size from the dataset."""
    if opts["ckpt"]:
        if model_overrides:
            raise ValueError(f"model keys {sorted(model_overrides)} cannot change a checkpoint's model: drop them")
        if not os.path.isfile(opts["ckpt"]):
            raise ValueError(f"no checkpoint at {opts['ckpt']}: train first (python train.py) or fix --ckpt")
        ckpt = torch.load(opts["ckpt"], map_location="cpu", weights_only=True)
        model = GPT(GPTConfig.from_dict(ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        return model, ckpt["config"].get("dataset", opts["dataset"]), ckpt["config"].get("tokenizer", opts["tokenizer"])
    _, _, meta = data.load_dataset(opts["dataset"], opts["tokenizer"])
    torch.manual_seed(opts["seed"])
    model = GPT(GPTConfig(**{"vocab_size": meta["vocab_size"], **model_overrides}))
    return model, opts["dataset"], opts["tokenizer"]


def main(argv):
    opts, model_overrides = parse_args(argv)
    sections = [s for s in opts["sections"].split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}: choose from {','.join(SECTIONS)}")
    if opts["split"] not in ("train", "val"):
        raise ValueError(f"--split={opts['split']!r} is not valid: use train or val")
    device = opts["device"] if opts["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, dataset, tokenizer = load_model(opts, model_overrides)
    model = analysis_model(model.to(device))
    train_tokens, val_tokens, _ = data.load_dataset(dataset, tokenizer)
    out_dir = opts["out_dir"] or os.path.join(os.path.dirname(opts["ckpt"]) if opts["ckpt"] else "out", "analysis")
    if opts["lengths"]:
        factors = [float(f) for f in opts["lengths"].split(",")]
        rows = length_extrapolation(model, val_tokens if opts["split"] == "val" else train_tokens, factors,
                                    batch_size=opts["batch_size"])
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "length_extrapolation.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"{'scaling':8s} {'factor':>6s} {'length':>6s} {'val loss':>8s}")
        for r in rows:
            print(f"{r['scaling']:8s} {r['factor']:6g} {r['length']:6d} {r['val_loss']:8.4f}")
        return
    sampler = data.BatchSampler(val_tokens if opts["split"] == "val" else train_tokens, opts["batch_size"],
                                model.config.block_size, opts["seed"])
    batches = [tuple(t.to(device) for t in sampler.next_batch()) for _ in range(max(opts["micro_batches"], opts["hessian_batches"]))]
    print(f"analysing {'checkpoint ' + opts['ckpt'] if opts['ckpt'] else 'a fresh init'}: "
          f"{model.num_params():,} parameters, {len(batches)} batches of {opts['batch_size']}x{model.config.block_size} "
          f"{opts['split']} tokens from {dataset}, sections {','.join(sections)} -> {out_dir}")
    summary = run_analysis(model, batches, out_dir, sections, opts["top_k"], opts["power_iters"], opts["n_probes"],
                           opts["lanczos_iters"], opts["n_slq"], opts["hessian_batches"], opts["seed"])
    print_table(summary)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, data.DataError) as e:
        sys.exit(f"analyze.py: {e}")
