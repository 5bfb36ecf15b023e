"""Tests for analyze.py: every spectrum against a dense computation, a closed form or a known construction."""
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import analyze
import optim
from model import GPT, GPTConfig


def analyze_tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=8, block_size=8, n_layer=2, n_head=2, n_embd=8, attention="math", kernels="torch")
    return GPT(GPTConfig(**{**cfg, **overrides}))


@pytest.fixture(scope="module")
def analyze_tiny_hessian():
    """A 1,640-parameter GPT after 50 Adam steps on a successor task, its dense Hessian (autograd) and
    analyze.hessian_spectrum on the same batch."""
    model = analyze_tiny_gpt()
    x = torch.randint(0, 8, (16, 8), generator=torch.Generator().manual_seed(1))
    y = (x + 1) % 8
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss_of(theta):
        params, i = {}, 0
        for name, shape in zip(names, shapes):
            params[name] = theta[i:i + shape.numel()].view(shape)
            i += shape.numel()
        return functional_call(model, params, (x, y))[1]

    assert flat.numel() <= 2000
    H = torch.autograd.functional.hessian(loss_of, flat, vectorize=True).double()
    exact = torch.linalg.eigvalsh((H + H.T) / 2).numpy()
    summary, arrays = analyze.hessian_spectrum(model, [(x, y)], top_k=3, n_probes=200, lanczos_iters=60, n_slq=2)
    return exact, summary, arrays


def test_hessian_top_eigenvalues_match_dense(analyze_tiny_hessian):
    exact, summary, _ = analyze_tiny_hessian
    by_magnitude = exact[np.argsort(-np.abs(exact))][:3]
    found = np.array(summary["top_eigenvalues"])
    assert np.all(np.abs(found - by_magnitude) <= 1e-3 * np.abs(by_magnitude)), (found, by_magnitude)


def test_hutchinson_trace_within_10_percent(analyze_tiny_hessian):
    exact, summary, arrays = analyze_tiny_hessian
    assert len(arrays["hutchinson_samples"]) == 200
    assert abs(summary["trace"] - exact.sum()) <= 0.1 * abs(exact.sum()), (summary["trace"], exact.sum())


def test_slq_density_integrates_to_one_and_covers_extremes(analyze_tiny_hessian):
    exact, summary, arrays = analyze_tiny_hessian
    grid, density = arrays["density_grid"], arrays["density"]
    assert abs(np.trapezoid(density, grid) - 1) < 1e-3
    assert grid[0] <= exact.min() and grid[-1] >= exact.max()
    spread = exact.max() - exact.min()
    assert abs(summary["slq_lambda_min"] - exact.min()) < 0.01 * spread
    assert abs(summary["slq_lambda_max"] - exact.max()) < 0.01 * spread


@pytest.mark.parametrize("shape", [(400, 200), (256, 256)])
def test_weight_spectra_gaussian_bulk_and_rank2_spikes(shape):
    torch.manual_seed(0)
    fan_out, fan_in = shape
    layer = nn.Linear(fan_in, fan_out, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    noise = analyze.weight_spectra(layer)[0]["weight"]
    assert noise["frac_inside_mp"] >= 0.99
    assert noise["n_spikes"] == 0
    assert abs(noise["mp_entry_std"] / 0.05 - 1) < 0.02
    edge = noise["mp_edges"][1]
    u = torch.linalg.qr(torch.randn(fan_out, 2))[0]
    v = torch.linalg.qr(torch.randn(fan_in, 2))[0]
    with torch.no_grad():
        layer.weight += u @ torch.diag(torch.tensor([3.0 * edge, 2.0 * edge])) @ v.T
    spiked = analyze.weight_spectra(layer)[0]["weight"]
    assert spiked["n_spikes"] == 2


def test_noise_scale_recovers_known_covariance():
    """Per-example gradients z_i ~ N(μ, diag(s²)) (loss θ·z): |G|² = |μ|², tr Σ = Σ s², B_simple = 32."""
    gen = torch.Generator().manual_seed(0)

    class LinearLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.zeros(64, 64))

        def forward(self, z, targets=None):
            return None, (self.theta * z).sum(dim=(1, 2)).mean()

    scales = torch.rand(64, 64, generator=gen) + 0.5
    tr_sigma = scales.pow(2).sum().item()
    mu = torch.randn(64, 64, generator=gen)
    mu *= math.sqrt(tr_sigma / 32) / mu.norm()
    batches = [(mu + scales * torch.randn(4, 64, 64, generator=gen), None) for _ in range(16)]
    summary, arrays = analyze.gradient_stats(LinearLoss(), batches)
    assert (summary["b_small"], summary["b_big"]) == (4, 64)
    assert abs(summary["tr_sigma"] / tr_sigma - 1) < 0.2
    assert abs(summary["G_sq"] / mu.pow(2).sum().item() - 1) < 0.2
    assert abs(summary["B_simple"] / 32 - 1) < 0.2
    s = torch.linalg.svdvals(sum(b[0].mean(0) for b in batches) / len(batches)).double()
    assert abs(summary["matrices"]["theta"]["stable_rank"] - (s.pow(2).sum() / s[0] ** 2).item()) < 1e-3


def test_ns_response_jordan_closed_forms():
    a, b, c = optim.NS_COEFFS["jordan"][0]
    summary, arrays = analyze.ns_response("jordan", steps=5, xs=[1e-6, 1e-5])
    # g'(x) = a + 3b x² + 5c x⁴ = 0 at the peak
    x_peak = math.sqrt((-3 * b - math.sqrt(9 * b * b - 20 * a * c)) / (10 * c))
    assert abs(summary["one_step_argmax"] - x_peak) < 1e-4 and abs(x_peak - 0.5545) < 1e-3
    assert abs(summary["one_step_peak"] - (a * x_peak + b * x_peak ** 3 + c * x_peak ** 5)) < 1e-8
    assert abs(summary["one_step_peak"] - 1.2024) < 1e-4
    assert abs(arrays["ys"][-1][0] / 1e-6 / a ** 5 - 1) < 1e-4 and abs(a ** 5 - 484.9) < 0.1
    # the scalar response is what msign does to each singular value of G / ‖G‖_F
    torch.manual_seed(0)
    s = torch.logspace(-2.5, 0, 24)
    U, V = torch.linalg.qr(torch.randn(40, 24))[0], torch.linalg.qr(torch.randn(24, 24))[0]
    G = U @ torch.diag(s) @ V.T
    predicted = analyze.ns_response("jordan", 5, (s / s.norm()).double().numpy())[1]["ys"][-1]
    measured = torch.linalg.svdvals(optim.msign(G, steps=5, coeffs="jordan")).double().numpy()
    assert np.allclose(np.sort(measured), np.sort(predicted), rtol=1e-3, atol=1e-5)


def analyze_perturbed_hc_model(kind, std):
    model = analyze_tiny_gpt(vocab_size=16, block_size=16, n_layer=4, n_embd=16, residual=kind)
    with torch.no_grad():  # stands in for training: move every hyper-connection parameter off its init
        for name, p in model.named_parameters():
            if ".hc_" in name:
                p.add_(torch.randn_like(p) * std)
    return model, torch.randint(0, 16, (2, 16))


def test_hc_spectra_mhc_product_bounded_hc_drifts():
    model, idx = analyze_perturbed_hc_model("mhc", 0.1)
    summary, arrays = analyze.hc_spectra(model, idx)
    assert arrays["prod_norm"].shape == (8, 32)
    bound = 1.0
    for layer in summary["layers"]:
        # ‖H‖₂ ≤ sqrt(‖H‖₁‖H‖∞): exactly 1 for doubly stochastic, Sinkhorn's leftover row/column error on top
        bound *= math.sqrt((1 + layer["row_sum_error"]) * (1 + layer["col_sum_error"]))
        assert layer["min_entry"] >= 0
        assert layer["prod_norm_max"] <= bound * (1 + 1e-9) and layer["prod_norm_max"] <= 1 + 1e-3
    model, idx = analyze_perturbed_hc_model("hc", 0.0)
    assert all(abs(layer["prod_norm_max"] - 1) < 1e-6 for layer in analyze.hc_spectra(model, idx)[0]["layers"])
    model, idx = analyze_perturbed_hc_model("hc", 0.1)
    norms = [layer["prod_norm_max"] for layer in analyze.hc_spectra(model, idx)[0]["layers"]]
    assert norms[-1] > 1.5 and norms[-1] > norms[0]
    assert analyze.hc_spectra(analyze_tiny_gpt(), torch.zeros(1, 4, dtype=torch.long)) == (None, {})


def test_gdn2_gates_rho_and_clip():
    model = analyze_tiny_gpt(vocab_size=16, block_size=16, n_layer=2, n_embd=16, mixer="G")
    with torch.no_grad():  # spread the erase gates b over (0, 1) so that ρ > 1 and the clip has work
        for block in model.blocks:
            block.mixer.erase_proj.weight.normal_(0, 2.0)
    idx = torch.randint(0, 16, (2, 16))
    summary, arrays = analyze.gdn2_gates(model, idx)
    x = model.blocks[0].norm1(model.wte(idx))
    with torch.no_grad():
        _, k, _, _, b, _ = model.blocks[0].mixer.recurrence_inputs(x)
    eye = torch.eye(k.size(-1), dtype=torch.float64)
    rho_svd = torch.linalg.matrix_norm(eye - k.double().unsqueeze(-1) * (b * k).double().unsqueeze(-2), ord=2)
    assert np.allclose(arrays["rho"][0], rho_svd.flatten().numpy(), rtol=1e-6)
    first = summary["layers"][0]
    assert first["rho_max"] > 1.01 and first["frac_clipped"] > 0 and first["max_transition_norm"] > 1
    assert all(layer["max_transition_norm_clipped"] <= 1 + 1e-6 for layer in summary["layers"])
    kda = analyze_tiny_gpt(vocab_size=16, block_size=16, n_layer=2, n_embd=16, mixer="G", gdn_variant="kda")
    for layer in analyze.gdn2_gates(kda, idx)[0]["layers"]:  # b = w = β ≤ 2 with unit k: ρ = 1, nothing clipped
        assert abs(layer["rho_max"] - 1) < 1e-6 and layer["frac_clipped"] == 0


def test_analyze_during_training_logs_without_side_effects(tmp_path):
    model = analyze_tiny_gpt(vocab_size=16, block_size=16, mixer="A", attention="sdpa", kernels="auto")
    batch = (torch.randint(0, 16, (8, 16)), torch.randint(0, 16, (8, 16)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    for step in (0, 10):
        record = analyze.analyze_during_training(model, batch, step, str(tmp_path), micro_batches=4)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[n], p) and p.grad is None for n, p in model.named_parameters())
    W = model.blocks[1].mlp.in_proj.weight
    logged = record["weights"]["blocks.1.mlp.in_proj.weight"]["sigma_max"]
    assert abs(logged - torch.linalg.matrix_norm(W.detach(), ord=2).item()) < 1e-5
    lines = open(os.path.join(tmp_path, "analysis.jsonl")).read().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 10]
    analyze.plot_training_analysis(os.path.join(tmp_path, "analysis.jsonl"), os.path.join(tmp_path, "a.png"))
    assert os.path.getsize(os.path.join(tmp_path, "a.png")) > 0
