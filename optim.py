"""
Optimizers, from SGD to Mousse, and build_optimizer (which parameter goes to which optimizer).

Every optimizer is a torch.optim.Optimizer with standard param_groups and state_dict.
Shared conventions: t counts steps from 1; weight decay is decoupled,
    p <- p * (1 - lr * wd)   then   p <- p - lr * u
where u is the optimizer's update direction, given in each class docstring.

Element-wise optimizers (SGD, SignSGD, AdamW, NAdam, Lion, Tiger) use torch._foreach_* ops, one
kernel per op for the whole group, which is what makes them fast on the CPU. Matrix optimizers
(Muon, Shampoo, Mousse, GaLore) loop over their 2-D matrices.
"""

import inspect
import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from init import in_residual

# -----------------------------------------------------------------------------
# msign: the orthogonal polar factor U V^T of G = U S V^T, by Newton-Schulz

# One (a, b, c) per step; a set shorter than `steps` repeats its last triple.
NS_COEFFS = {
    "jordan": [(3.4445, -4.7750, 2.0315)],  # Keller Jordan's quintic, steepest slope at 0
    "dion": [  # the five-step schedule of microsoft/dion (Ahn et al. 2025, Dion)
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
}


def ns_schedule(steps, coeffs):
    """The list of `steps` (a, b, c) triples Newton-Schulz applies."""
    if coeffs not in NS_COEFFS:
        raise ValueError(f"unknown Newton-Schulz coeffs {coeffs!r}; use one of {sorted(NS_COEFFS)}")
    table = NS_COEFFS[coeffs]
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def ns_scalar(x, steps=5, coeffs="jordan"):
    """What Newton-Schulz does to one singular value x of G/||G||_F: x <- a x + b x^3 + c x^5."""
    for a, b, c in ns_schedule(steps, coeffs):
        x = a * x + b * x**3 + c * x**5
    return x


def ns_dtype(device):
    """Newton–Schulz's matmul dtype: fp32 on a CPU; on a GPU bf16 where its tensor cores compute it (compute
    capability 8.0 and up), else fp16 (T4, V100), whose range suffices since X is scaled to a Frobenius norm of 1."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def msign(G, steps=5, coeffs="jordan"):
    """msign(G) ~ U V^T: X = G/(||G||_F + 1e-7), then each step X <- aX + (bA + cA^2)X with A = X X^T.
    Works on the wide orientation (A is the smaller Gram matrix); fp32 on the CPU, a 16-bit dtype on CUDA (ns_dtype).
    G may be a stack [..., m, n] of same-shaped matrices, each orthogonalised on its own."""
    if G.ndim < 2:
        raise ValueError(f"msign takes a matrix (or a stack of them), got shape {tuple(G.shape)}; reshape it first")
    X = G.to(ns_dtype(G.device))
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in ns_schedule(steps, coeffs):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


# -----------------------------------------------------------------------------
# element-wise optimizers


def _live_groups(optimizer, *buffers):
    """For each param group with gradients: (group, its parameters that have a gradient, their gradients, their
    state buffers (zeros on first use), their step counts t advanced by one), after the decoupled weight decay
    p <- p (1 - lr wd) has been applied to those parameters."""
    for group in optimizer.param_groups:
        params, grads, bufs, ts = [], [], [[] for _ in buffers], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = 0
                for name in buffers:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            for lst, name in zip(bufs, buffers):
                lst.append(state[name])
            ts.append(state["step"])
        if not params:
            continue
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        yield group, params, grads, bufs, ts


class SGD(torch.optim.Optimizer):
    """SGD with momentum: m <- mu m + g;  u = g + mu m (nesterov) or u = m.
    Weight decay is decoupled, as everywhere here: p <- p (1 - lr wd) outside the momentum. torch.optim.SGD's
    weight_decay is L2 instead: g <- g + wd p before the momentum, so m carries past decay terms along.
    The two agree at wd = 0 and, at every wd, at mu = 0. With momentum and lr wd << (1 - mu)^2, the L2 form
    shrinks p by 1 - lr wd / (1 - mu) per step once m has caught up: 1/(1 - mu) times our decay (10x at 0.9)."""

    def __init__(self, params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group, params, grads, (ms,), _ in _live_groups(self, "m"):
            mu = group["momentum"]
            torch._foreach_mul_(ms, mu)
            torch._foreach_add_(ms, grads)
            if group["nesterov"]:
                u = torch._foreach_mul(ms, mu)
                torch._foreach_add_(u, grads)
            else:
                u = ms
            torch._foreach_add_(params, u, alpha=-group["lr"])


class SignSGD(torch.optim.Optimizer):
    """SignSGD / Signum: m <- beta m + (1 - beta) g;  u = sign(m). beta = 0 is plain sign(g)."""

    def __init__(self, params, lr=1e-3, beta=0.0, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group, params, grads, (ms,), _ in _live_groups(self, "m"):
            torch._foreach_lerp_(ms, grads, 1 - group["beta"])
            torch._foreach_add_(params, torch._foreach_sign(ms), alpha=-group["lr"])


class AdamW(torch.optim.Optimizer):
    """AdamW: m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""
    lookahead = False  # NAdam's Nesterov numerator

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group, params, grads, (ms, vs), ts in _live_groups(self, "m", "v"):
            b1, b2 = group["betas"]
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            denom = torch._foreach_sqrt(vs)  # sqrt(v / (1 - b2^t)) = sqrt(v) / sqrt(1 - b2^t)
            torch._foreach_div_(denom, [math.sqrt(1 - b2**t) for t in ts])
            torch._foreach_add_(denom, group["eps"])
            lr = group["lr"]
            if self.lookahead:  # the momentum debiased one step ahead, the gradient for this step
                torch._foreach_addcdiv_(params, ms, denom, [-lr * b1 / (1 - b1 ** (t + 1)) for t in ts])
                torch._foreach_addcdiv_(params, grads, denom, [-lr * (1 - b1) / (1 - b1**t) for t in ts])
            else:
                torch._foreach_addcdiv_(params, ms, denom, [-lr / (1 - b1**t) for t in ts])


class NAdam(AdamW):
    """NAdam (Dozat 2016, "Incorporating Nesterov Momentum into Adam", Algorithm 2 with constant momentum b1):
    AdamW's m and v, but the numerator looks one step ahead, each term debiased for the step it stands for:
    u = (b1 m / (1 - b1^(t+1)) + (1-b1) g / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps),
    m being the updated m_t. It is torch.optim.NAdam with momentum_decay -> inf (its schedule
    mu_t = b1 (1 - 0.96^(t psi) / 2) then stays at b1) and decoupled_weight_decay=True. At t = 1 the two
    terms weigh g by 1 + b1 / (1 + b1) (1.47 at b1 = 0.9): NAdam's first step is larger than AdamW's."""
    lookahead = True


class Lion(torch.optim.Optimizer):
    """Lion: u = sign(b1 m + (1-b1) g), then m <- b2 m + (1-b2) g."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group, params, grads, (ms,), _ in _live_groups(self, "m"):
            b1, b2 = group["betas"]
            u = torch._foreach_lerp(ms, grads, 1 - b1)
            torch._foreach_sign_(u)
            torch._foreach_add_(params, u, alpha=-group["lr"])
            torch._foreach_lerp_(ms, grads, 1 - b2)


class Tiger(SignSGD):
    """Tiger (Lion with b1 = b2): m <- beta m + (1-beta) g;  u = sign(m). SignSGD's rule with Tiger's defaults."""

    def __init__(self, params, lr=1e-4, beta=0.965, weight_decay=0.0):
        super().__init__(params, lr=lr, beta=beta, weight_decay=weight_decay)


# -----------------------------------------------------------------------------
# matrix optimizers (2-D parameters only; build_optimizer routes everything else to AdamW)


def _check_matrices(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"{type(optimizer).__name__} takes 2-D matrices, got shape {tuple(p.shape)}; "
                    "use build_optimizer, which sends other parameters to AdamW")


# Muon's shape factor s on msign's output for a [rows, cols] = [fan_out, fan_in] weight
MUON_SCALES = {
    "jordan": lambda rows, cols: max(1.0, rows / cols) ** 0.5,
    "moonlight": lambda rows, cols: 0.2 * max(rows, cols) ** 0.5,  # update RMS ~ 0.2, AdamW's typical update RMS
    "spectral": lambda rows, cols: (rows / cols) ** 0.5,  # ||u||_2 = sqrt(fan_out / fan_in), the spectral condition
}


def muon_scale(kind, rows, cols):
    if kind not in MUON_SCALES:
        raise ValueError(f"unknown Muon scale {kind!r}; use one of {', '.join(MUON_SCALES)}")
    return MUON_SCALES[kind](rows, cols)


def _inverse_root(S, exponent, eps, relative):
    """S^(-exponent) of a symmetric PSD matrix by eigh, eigenvalues floored first at eps (relative=False)
    or at eps * the largest eigenvalue (relative=True)."""
    lam, Q = torch.linalg.eigh(S)
    floor = (eps * lam.max()).clamp_min(1e-30) if relative else max(eps, 1e-30)  # a tensor: no host sync
    lam = lam.clamp_min(floor)
    return (Q * lam.pow(-exponent)) @ Q.mT


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks", blog):
    m <- beta m + (1-beta) g;  u0 = (1-beta) g + beta m (nesterov) or m;
    u = s * msign(u0), s from `scale`: 'jordan' max(1, rows/cols)^1/2, 'moonlight'
    0.2 max(rows, cols)^1/2, 'spectral' (fan_out/fan_in)^1/2.
    Newton-Schulz defaults to the 'dion' schedule: its singular values land in [0.97, 1.15] where
    'jordan' gives [0.68, 1.21], so 'moonlight' really yields an update RMS of 0.2 (jordan: 0.16-0.19)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, scale="jordan",
                 ns_steps=5, ns_coeffs="dion", weight_decay=0.0):
        muon_scale(scale, 1, 1)
        ns_schedule(ns_steps, ns_coeffs)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, scale=scale,
                                      ns_steps=ns_steps, ns_coeffs=ns_coeffs, weight_decay=weight_decay))
        _check_matrices(self)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            by_shape = {}  # same-shaped matrices go through Newton-Schulz as one batch (far fewer small ops)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p))
                state["step"] += 1
                m = state["m"]
                m.lerp_(g, 1 - beta)
                by_shape.setdefault(p.shape, []).append((p, g.lerp(m, beta) if group["nesterov"] else m))
            for shape, items in by_shape.items():
                updates = msign(torch.stack([u0 for _, u0 in items]), group["ns_steps"], group["ns_coeffs"])
                for (p, _), u in zip(items, updates.unbind(0)):
                    p.mul_(1 - lr * wd)
                    p.add_(u, alpha=-lr * muon_scale(group["scale"], *shape))


class Shampoo(torch.optim.Optimizer):
    """Shampoo with AdamW grafting: L <- b2 L + (1-b2) G G^T, R <- b2 R + (1-b2) G^T G;
    u = L^-1/4 m R^-1/4 rescaled to the Frobenius norm of AdamW's u on the same g.
    m and v are AdamW's moments (betas); the roots are recomputed from L, R on steps 1, 1 + precond_every, ...
    (eigh, eigenvalues floored at eps * max) and cached in the state between refreshes."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, precond_every=10,
                 graft_eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, precond_every=precond_every,
                                      graft_eps=graft_eps, weight_decay=weight_decay))
        _check_matrices(self)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    rows, cols = p.shape
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p),
                                 L=g.new_zeros(rows, rows), R=g.new_zeros(cols, cols),
                                 L_root=g.new_zeros(rows, rows), R_root=g.new_zeros(cols, cols))
                state["step"] += 1
                t, m, v, L, R = state["step"], state["m"], state["v"], state["L"], state["R"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                L.mul_(b2).add_(g @ g.mT, alpha=1 - b2)
                R.mul_(b2).add_(g.mT @ g, alpha=1 - b2)
                if (t - 1) % group["precond_every"] == 0:
                    for S, root in ((L, state["L_root"]), (R, state["R_root"])):
                        root.copy_(_inverse_root(S, 0.25, eps, relative=True))
                direction = state["L_root"] @ m @ state["R_root"]
                adam = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["graft_eps"])
                u = direction * (adam.norm() / direction.norm().clamp_min(1e-30))
                p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr)


class Mousse(torch.optim.Optimizer):
    """Mousse (arXiv 2603.09697): Muon in Shampoo-whitened coordinates.
    m, u0 as Muon (momentum, nesterov); L <- b2 L + (1-b2) G G^T, R <- b2 R + (1-b2) G^T G from raw g.
    On steps 1, 1 + precond_every, ...: L~ = rows * Lhat / tr(Lhat), Lhat = L / (1 - b2^t) (R~ alike),
    eigh, eigenvalues floored at eps, roots L~^-alpha, R~^-alpha cached in the state. Then
    O = msign(L~^-a u0 R~^-a),  u = L~^-a O R~^-a * ||O||_F / ||L~^-a O R~^-a||_F * (rows/cols)^1/2."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, alpha=0.125, beta2=0.95, eps=1e-5,
                 precond_every=10, ns_steps=5, ns_coeffs="dion", weight_decay=0.0):
        ns_schedule(ns_steps, ns_coeffs)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, alpha=alpha, beta2=beta2,
                                      eps=eps, precond_every=precond_every, ns_steps=ns_steps,
                                      ns_coeffs=ns_coeffs, weight_decay=weight_decay))
        _check_matrices(self)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta, b2, lr, wd = group["momentum"], group["beta2"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                rows, cols = p.shape
                if not state:
                    state.update(step=0, m=torch.zeros_like(p),
                                 L=g.new_zeros(rows, rows), R=g.new_zeros(cols, cols),
                                 L_root=g.new_zeros(rows, rows), R_root=g.new_zeros(cols, cols))
                state["step"] += 1
                t, m, L, R = state["step"], state["m"], state["L"], state["R"]
                m.lerp_(g, 1 - beta)
                u0 = g.lerp(m, beta) if group["nesterov"] else m
                L.mul_(b2).add_(g @ g.mT, alpha=1 - b2)
                R.mul_(b2).add_(g.mT @ g, alpha=1 - b2)
                if (t - 1) % group["precond_every"] == 0:
                    for S, root in ((L, state["L_root"]), (R, state["R_root"])):
                        S_hat = S / (1 - b2**t)
                        S_tilde = S_hat * (S.size(0) / S_hat.trace().clamp_min(1e-30))
                        root.copy_(_inverse_root(S_tilde, group["alpha"], group["eps"], relative=False))
                L_root, R_root = state["L_root"], state["R_root"]
                O = msign(L_root @ u0 @ R_root, group["ns_steps"], group["ns_coeffs"])
                u = L_root @ O @ R_root
                u = u * (O.norm() / u.norm().clamp_min(1e-30))
                p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr * muon_scale("spectral", rows, cols))


class GaLore(torch.optim.Optimizer):
    """GaLore (Zhao et al. 2024): on steps 1, 1 + update_proj_gap, ... P = the top-`rank` singular vectors of g on
    the side the reference implementation (galore_torch, proj_type 'std') picks: right (P = V_r, r = g P) when
    rows >= cols, so every square matrix is projected on the right; left (P = U_r, r = P^T g) when rows < cols.
    AdamW moments on the projection r: adam(r) = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), and
    u = scale * adam(r) P^T (or P adam(r)). Moments are kept across projection refreshes (as GaLore does).
    eps sits inside the projection, on the r-space root as in AdamW; the reference adds it to sqrt(v) before
    the bias correction, an eps 1/sqrt(1 - b2^t) times larger. Weight decay acts on the whole matrix, outside
    the projection and before the step: p (1 - lr wd) - lr u, where the reference decays after it,
    (p - lr u)(1 - lr wd), lr^2 wd u apart per step."""

    def __init__(self, params, lr=1e-3, rank=32, update_proj_gap=200, scale=0.25, betas=(0.9, 0.99),
                 eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, rank=rank, update_proj_gap=update_proj_gap, scale=scale,
                                      betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        _check_matrices(self)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                rows, cols = p.shape
                left = rows < cols
                r = min(group["rank"], rows, cols)
                if not state:
                    projected = (r, cols) if left else (rows, r)
                    state.update(step=0, P=g.new_zeros(rows if left else cols, r),
                                 m=g.new_zeros(projected), v=g.new_zeros(projected))
                state["step"] += 1
                t, P, m, v = state["step"], state["P"], state["m"], state["v"]
                if (t - 1) % group["update_proj_gap"] == 0:
                    U, _, Vh = torch.linalg.svd(g.float() if g.element_size() < 4 else g, full_matrices=False)
                    P.copy_(U[:, :r] if left else Vh[:r].mT)
                low = P.mT @ g if left else g @ P
                m.lerp_(low, 1 - b1)
                v.mul_(b2).addcmul_(low, low, value=1 - b2)
                adam = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                u = P @ adam if left else adam @ P.mT
                p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr * group["scale"])


# -----------------------------------------------------------------------------
# the optimizer kinds

@dataclass(frozen=True)
class Setting:
    """One hyper-parameter an optimizer takes. train.py makes it a config key (--key=value), checks it against allowed
    and lists it in --help with help and the optimizers that take it: an optimizer's settings live in its row."""
    key: str              # train.py's config key
    default: object = None  # its value when not given (its type is the key's type): required
    allowed: object = None  # a number's range as runs.in_range reads it (">= a", "> a", "in [a, b)"), or a dict of
    #                         choices: required
    help: str = ""          # the --help text


class OptimizerKind(NamedTuple):
    cls: type        # a torch.optim.Optimizer, built as cls(param_groups, lr=, weight_decay=, **options)
    matrix: bool     # takes only the blocks' 2-D matrices; build_optimizer gives the rest to AdamW
    family: str      # how the size of its update depends on the shape (spectral_lr_scale): adam, low_rank_adam,
    #                  msign or gradient
    lr: float        # its default peak learning rate (train.py's, where --learning_rate is not given)
    options: dict    # {constructor argument: a Setting, or a tuple of Settings for a tuple argument}


# the settings the rows below take (a setting shared by several optimizers is one Setting)
BETAS = (Setting("beta1", 0.9, "in [0, 1)", "decay of the first moment (lion: the update's mix)"),
         Setting("beta2", 0.99, "in [0, 1)", "decay of the second moment (lion: the momentum's; shampoo: L's, R's)"))
# the matrix optimizers' AdamW for the embeddings, head, norms and gates (build_optimizer) takes BETAS too
AUX_ADAMW = "the matrix optimizers' aux AdamW"
MOMENTUM = Setting("momentum", 0.95, "in [0, 1)", "momentum")
NS = Setting("ns_coeffs", "dion", NS_COEFFS, "Newton-Schulz coefficients (optim.NS_COEFFS)")
PRECOND_EVERY = Setting("precond_every", 10, ">= 1", "steps between eigendecompositions")

# train.py's --optimizer. A new one is its class above and one row here, its settings declared in the row.
OPTIMIZERS = {
    "sgd": OptimizerKind(SGD, False, "gradient", 0.1, {"momentum": MOMENTUM}),  # SGD with momentum
    "signsgd": OptimizerKind(SignSGD, False, "adam", 1e-4, {}),  # the sign of the gradient
    "adamw": OptimizerKind(AdamW, False, "adam", 1e-3, {"betas": BETAS}),  # Adam, decoupled decay
    "nadam": OptimizerKind(NAdam, False, "adam", 1e-3, {"betas": BETAS}),  # Adam, Nesterov momentum
    "lion": OptimizerKind(Lion, False, "adam", 1e-4, {"betas": BETAS}),  # the sign of a momentum mix
    "tiger": OptimizerKind(Tiger, False, "adam", 1e-4, {}),  # the sign of a momentum
    "muon": OptimizerKind(Muon, True, "msign", 0.02, {  # msign of the momentum, by Newton-Schulz
        "momentum": MOMENTUM, "ns_coeffs": NS,
        "scale": Setting("muon_scale", "jordan", MUON_SCALES, "shape factor on msign's output (optim.MUON_SCALES)")}),
    "shampoo": OptimizerKind(Shampoo, True, "adam", 1e-3,  # Kronecker-factored preconditioner
                             {"betas": BETAS, "precond_every": PRECOND_EVERY}),
    "mousse": OptimizerKind(Mousse, True, "msign", 0.02, {  # msign in Shampoo's preconditioned frame
        "momentum": MOMENTUM, "precond_every": PRECOND_EVERY, "ns_coeffs": NS,
        "alpha": Setting("mousse_alpha", 0.125, "> 0", "preconditioner exponent, L^-alpha g R^-alpha")}),
    "galore": OptimizerKind(GaLore, True, "low_rank_adam", 1e-2, {  # Adam in a low-rank gradient subspace
        "betas": BETAS, "rank": Setting("galore_rank", 32, ">= 1", "rank of the projection"),
        "update_proj_gap": Setting("galore_gap", 200, ">= 1", "steps between projection updates"),
        "scale": Setting("galore_scale", 0.25, "> 0", "scale of the projected update")}),
}


def optimizer_settings(rows):
    """{key: (Setting, [the optimizers that take it])} over rows (OPTIMIZERS) and the aux AdamW's betas: train.py's
    optimizer keys. Each option must be a Setting, and one key one Setting: else a one-line error (at import)."""
    found = {s.key: (s, [AUX_ADAMW]) for s in BETAS}
    for name, kind in rows.items():
        for arg, declared in kind.options.items():
            for s in declared if isinstance(declared, tuple) else (declared,):
                if not isinstance(s, Setting) or s.default is None or s.allowed is None:
                    raise TypeError(f"optim.OPTIMIZERS[{name!r}] option {arg!r} is {s!r}, which names no default or "
                                    f"no allowed values: declare it as Setting(key, default, allowed, help)")
                if found.setdefault(s.key, (s, []))[0] != s:
                    raise ValueError(f"optim.OPTIMIZERS[{name!r}] declares the setting {s.key!r} unlike another row "
                                     f"does: {s} against {found[s.key][0]}; declare it once and share it")
                found[s.key][1].append(name)
    return found


# train.py's optimizer keys: {key: (Setting, the optimizers that take it)}; a row that declares a setting badly
# fails here, at import
SETTINGS = optimizer_settings(OPTIMIZERS)


def check_chosen_settings(optimizer, given):
    """The rule of SETTINGS: a setting given (a config file or --key=value) must be one the chosen optimizer takes
    (its row declares it, or it is matrix and the aux AdamW takes it): another optimizer's setting would do nothing."""
    kind = optimizer_kind(optimizer)
    for key in given:
        users = SETTINGS[key][1] if key in SETTINGS else [optimizer]
        if optimizer not in users and not (kind.matrix and AUX_ADAMW in users):
            raise ValueError(f"--{key} is a setting of {', '.join(users)}, not of the chosen --optimizer={optimizer} "
                             f"(an optimizer takes only the settings its row of optim.OPTIMIZERS declares): drop "
                             f"--{key}, or choose one of those optimizers")


def optimizer_kind(name):
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)} "
                         f"(or add it to optim.OPTIMIZERS)")
    return OPTIMIZERS[name]


def optimizer_options(name, settings):
    """{constructor argument: value} of the settings optimizer name takes (its row's Settings), from settings
    (train.py's config, {key: value})."""
    return {arg: tuple(settings[s.key] for s in declared) if isinstance(declared, tuple) else settings[declared.key]
            for arg, declared in optimizer_kind(name).options.items()}


# -----------------------------------------------------------------------------
# routing: which parameter goes to which optimizer

def is_block_matrix(name, p):
    """The parameters matrix optimizers take: 2-D weights inside blocks, hyper-connection ones excepted."""
    return p.ndim == 2 and name.startswith("blocks.") and not in_residual(name)


class CombinedOptimizer:
    """Several optimizers driven as one: the schedule sees every param group, the checkpoint one state dict."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers],
                "kinds": [type(opt).__name__ for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        kinds = [type(opt).__name__ for opt in self.optimizers]
        if state_dict.get("kinds") != kinds:
            raise ValueError(f"optimizer state holds {state_dict.get('kinds')}, this run builds {kinds}; "
                             "resume with the same --optimizer")
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)


# ----------------------------------------------------------------------------------------------------
# spectral learning-rate scaling (Yang, Simon & Bernstein 2023)

BASE_WIDTH = 128  # spectral_lr_scale is 1 for a BASE_WIDTH × BASE_WIDTH matrix (the baby model's n_embd)

def spectral_lr_scale(fan_out, fan_in, optimizer, scale="jordan", base_width=BASE_WIDTH):
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
      so s ∝ sqrt(fan_out / (fan_in · max(fan_out, fan_in))):
      s = sqrt(base_width · min(fan_out, fan_in)) / fan_in.
    - msign-based (muon, mousse): u = c · msign(·) with ‖msign‖₂ ≈ 1 and c the optimizer's own shape
      factor (Muon's `scale` option: jordan max(1, fan_out/fan_in)^½, moonlight 0.2·max(fan_out, fan_in)^½,
      spectral (fan_out/fan_in)^½; Mousse always uses spectral), so   s = sqrt(fan_out/fan_in) / c,
      normalised by c at base_width × base_width: jordan gives min(1, sqrt(fan_out/fan_in)), spectral
      (and Mousse) 1, moonlight sqrt(fan_out/fan_in) · sqrt(base_width / max(fan_out, fan_in)).
    - sgd: u = G. When every layer meets the condition, the backward signal δ = ∂L/∂h has
      ‖δ‖₂ = Θ(1/sqrt(fan_out)) and x has ‖x‖₂ = Θ(sqrt(fan_in)),
      so ‖G‖₂ = Θ(sqrt(fan_in/fan_out)) and s ∝ fan_out / fan_in (the paper's η_l):   s = fan_out / fan_in.
      The backward signal is this size when the lm_head meets the condition too: its δ into the last
      layer has norm ‖Wᵀ(p − y)‖ ≈ sqrt(V / n_embd), which shrinks like 1/sqrt(width) only while
      n_embd > V (characters); with V ≫ n_embd (BPE) it is O(1) and plain SGD transfers less cleanly
      than the normalised optimizers above."""
    if fan_out < 1 or fan_in < 1:
        raise ValueError(f"fan_out={fan_out}, fan_in={fan_in}: both must be positive")
    name = optimizer.lower()
    family = optimizer_kind(name).family
    if family == "adam":
        return base_width / fan_in
    if family == "low_rank_adam":
        return math.sqrt(base_width * min(fan_out, fan_in)) / fan_in
    if family == "msign":
        kind = scale if name == "muon" else "spectral"
        own = muon_scale(kind, fan_out, fan_in)
        return math.sqrt(fan_out / fan_in) / own * muon_scale(kind, base_width, base_width)
    if family == "gradient":
        return fan_out / fan_in
    raise ValueError(f"optimizer {name!r} has family {family!r}, which spectral_lr_scale does not know: use adam, "
                     f"low_rank_adam, msign or gradient in optim.OPTIMIZERS, or add the family's rule here")


def build_optimizer(model, name, lr, weight_decay, aux_lr=3e-3, aux_betas=(0.9, 0.99), aux_eps=1e-8,
                    aux_weight_decay=None, spectral_lr=False, **kw):
    """One optimizer object for `model`. Routing:
    - matrix optimizers (muon, mousse, shampoo, galore): block matrices (2-D, name 'blocks.*', not in_residual)
      go to `name` with lr, weight_decay; every other parameter (embeddings, lm_head, norms, biases, gate
      scalars, HC parameters, A_log, dt_bias, conv weights) goes to AdamW with aux_lr, aux_betas, aux_eps,
      weight decay aux_weight_decay (default weight_decay) on tensors of 2 or more dims;
    - element-wise optimizers (sgd, signsgd, adamw, nadam, lion, tiger) take every parameter with lr;
    - 1-D tensors never get weight decay.
    Every param group carries base_lr (the schedule sets group['lr'] = group['base_lr'] * multiplier).
    spectral_lr=True gives each block matrix its own group with base_lr = lr * spectral_lr_scale(
    fan_out, fan_in, name). **kw are `name`'s own hyper-parameters (e.g. momentum, betas, scale, alpha, rank)."""
    name = name.lower()
    kind = optimizer_kind(name)
    cls = kind.cls
    options = [k for k in inspect.signature(cls).parameters if k not in ("params", "lr", "weight_decay")]
    unknown = sorted(set(kw) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for optimizer {name!r}; valid: {options}")
    if aux_weight_decay is None:
        aux_weight_decay = weight_decay

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    blocks = [p for n, p in named if is_block_matrix(n, p)]
    # under spectral_lr an untied lm_head is scaled as the dense map n_embd -> vocab it is (when tied it is
    # wte.weight, which named_parameters lists once, as the embedding, and which stays unscaled)
    head = [p for n, p in named if spectral_lr and n == "lm_head.weight"]
    rest = [p for n, p in named if not is_block_matrix(n, p) and not any(p is h for h in head)]
    if spectral_lr:
        own = {"scale": kw.get("scale", "jordan")} if name == "muon" else {}  # Muon's shape factor
        block_groups = [dict(params=[p], weight_decay=weight_decay,
                             base_lr=lr * spectral_lr_scale(p.shape[0], p.shape[1], name, **own)) for p in blocks]
    else:
        block_groups = [dict(params=blocks, weight_decay=weight_decay, base_lr=lr)]

    def rest_groups(base_lr, wd, kind):
        groups = [dict(params=[p for p in rest if p.ndim >= 2], weight_decay=wd, base_lr=base_lr),
                  dict(params=[p for p in rest if p.ndim < 2], weight_decay=0.0, base_lr=base_lr)]
        if head:
            groups.append(dict(params=head, weight_decay=wd, base_lr=base_lr * spectral_lr_scale(*head[0].shape, kind)))
        return groups

    def nonempty(groups):
        return [dict(g, lr=g["base_lr"]) for g in groups if g["params"]]

    if not kind.matrix:
        return CombinedOptimizer([cls(nonempty(block_groups + rest_groups(lr, weight_decay, name)), lr=lr, **kw)])
    if not blocks:
        raise ValueError(f"{name} found no block matrices (2-D 'blocks.*' parameters) in the model; "
                         "use an element-wise optimizer such as adamw")
    optimizers = [cls(nonempty(block_groups), lr=lr, **kw)]
    if rest or head:
        optimizers.append(AdamW(nonempty(rest_groups(aux_lr, aux_weight_decay, "adamw")), lr=aux_lr, betas=aux_betas,
                                eps=aux_eps))
    return CombinedOptimizer(optimizers)


# -----------------------------------------------------------------------------
# the learning-rate schedule (train.py sets every group's lr to base_lr times this)

def lr_multiplier(it, total, warmup, floor, schedule, decay_frac):
    """The schedule's factor on every group's peak lr at step it of total: a linear warmup over `warmup` steps,
    then a cosine down to `floor` (cosine) or constant, then linear to `floor` over the last decay_frac of the
    steps (wsd; decay_frac 0: constant)."""
    if it < warmup:
        return (it + 1) / (warmup + 1)
    if schedule == "wsd":
        decay_start = total * (1 - decay_frac)
        if it < decay_start or decay_frac == 0:
            return 1.0
        return floor + (1 - floor) * max(0.0, (total - it) / (total - decay_start))
    if it >= total:
        return floor
    ratio = (it - warmup) / max(1, total - warmup)
    return floor + 0.5 * (1 + math.cos(math.pi * ratio)) * (1 - floor)


def state_bytes(optimizer, params=None):
    """Bytes held in tensors of the optimizer state (of params only, when given)."""
    opts = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    kept = None if params is None else {id(p) for p in params}
    return sum(v.numel() * v.element_size() for opt in opts for p, s in opt.state.items()
               if kept is None or id(p) in kept for v in s.values() if torch.is_tensor(v))


# -----------------------------------------------------------------------------
# demo: msign's singular-value band, then each optimizer's state memory and step time against AdamW

if __name__ == "__main__":
    usage = ("python optim.py   msign's singular-value band, Muon's moonlight scale, each optimizer's state memory "
             'and step time against AdamW')
    if sys.argv[1:]:  # the demo takes no arguments
        if sys.argv[1:] not in (["-h"], ["--help"]):
            sys.exit(f"optim.py takes no arguments (got {sys.argv[1]!r}): {usage}")
        print(usage)
        sys.exit()
    import time

    torch.manual_seed(0)
    xs = torch.logspace(-4, 0, 4001, dtype=torch.float64)
    print("Newton-Schulz: singular value x of G/||G||_F -> msign's singular value")
    for coeffs in NS_COEFFS:
        for steps in (5, 8):
            y = ns_scalar(xs, steps, coeffs)
            for lo in (1e-3, 3e-3):
                ok = y[xs >= lo]
                print(f"  {coeffs:6s} {steps} steps, x >= {lo:.0e}: [{ok.min():.3f}, {ok.max():.3f}]")
    print("moonlight update RMS (target 0.2) on Gaussian gradients:")
    for shape in [(128, 128), (512, 128), (128, 512), (384, 1536)]:
        G = torch.randn(shape)
        rms = {c: (muon_scale("moonlight", *shape) * msign(G, 5, c)).pow(2).mean().sqrt().item() for c in NS_COEFFS}
        print(f"  {str(shape):12s} " + "  ".join(f"{c} {v:.3f}" for c, v in rms.items()))

    # the baby model's parameters: n_embd 128, 4 layers of attention + relu2 MLP, a 65-token embedding
    d, n_layer = 128, 4

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
            self.in_proj = torch.nn.Linear(d, 4 * d, bias=False)
            self.mlp_out_proj = torch.nn.Linear(4 * d, d, bias=False)

    model = torch.nn.Module()
    model.wte = torch.nn.Embedding(65, d)
    model.blocks = torch.nn.ModuleList(Layer() for _ in range(n_layer))
    model.norm_f = torch.nn.Parameter(torch.ones(d))
    n_block = sum(p.numel() for n, p in model.named_parameters() if is_block_matrix(n, p))
    n_all = sum(p.numel() for p in model.parameters())
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
    torch.set_num_threads(1)
    rows = []
    for name, kind in OPTIMIZERS.items():
        opt = build_optimizer(model, name, lr=kind.lr, weight_decay=0.1, aux_lr=1e-3)
        times = []
        for k in range(13):  # the first step creates the state; 12 more cross a preconditioner refresh
            for p, g in zip(model.parameters(), grads[k % 3]):
                p.grad = g
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        main = opt.optimizers[0]
        main_bytes = sum(v.numel() * v.element_size() for s in main.state.values() for v in s.values()
                         if torch.is_tensor(v))
        rows.append((name, state_bytes(opt) / n_all, main_bytes / n_block if kind.matrix else None,
                     1e3 * sum(times[1:]) / len(times[1:])))
    adamw_ms = next(ms for name, _, _, ms in rows if name == "adamw")
    print(f"{n_all:,} parameters, {n_block:,} of them in block matrices; 1 thread (timings depend on machine load)")
    print(f"{'optimizer':9s} {'state bytes/param':>17s} {'on block matrices':>17s} {'step ms':>8s} {'vs adamw':>8s}")
    for name, all_b, block_b, ms in rows:
        block = f"{block_b:17.1f}" if block_b is not None else f"{'-':>17s}"
        print(f"{name:9s} {all_b:17.1f} {block} {ms:8.2f} {ms / adamw_ms:8.2f}")
