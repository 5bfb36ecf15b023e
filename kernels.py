"""
kernels.py: every op the model needs that has a fast path, one section per op.

    op                signature (shapes)                                           paths
    rms_norm          (x[..., C], weight[C], eps, gate=None) -> y  (of x ⊙ silu(gate)) ref, torch, triton
    rope              (x[B,T,H,D], cos[T,D/2], sin[T,D/2]) -> y  (interleaved pairs) ref, torch, triton
    softmax           (x[R, N]) -> y                                               ref, torch, triton*
    sparsemax         (z[..., T, N], causal=False) -> p = [z − τ]₊ with Σ p = 1      ref, torch, triton
    sinkhorn          (logits[..., n, n], iters=20) -> P  (doubly stochastic)      ref, torch, triton
    gdn2_decay_clip   (g, k, b [B,T,H,K]) -> g' = min(g, −log ‖I − k(b⊙k)ᵀ‖₂)         ref, torch, triton*
    gdn2_gates        (decay_logits, erase_logits, k [B,T,H,K], A_log [H], dt_bias [H,K], clip=True) -> (g', b)
                      g = −exp(A_log)·softplus(decay_logits + dt_bias), b = σ(erase_logits),
                      g' = gdn2_decay_clip(g, k, b), or g without the clip         ref, torch, triton
    gdn2              (q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=16) -> (o, S_T)
                      q,k,g,b [B,T,H,K]; v,w [B,T,H,V]; S [B,H,K,V]                ref, torch, triton
    ssd               (x, dt, A, B, C, D=None, chunk_size=64, initial_state=None) -> (y, h_T)
                      x [b,l,h,p]; dt [b,l,h]; A, D [h]; B, C [b,l,1,n]; h [b,h,p,n]  ref, torch, triton
Helpers: gdn2_log_rho(k, b) = log ‖I − k(b⊙k)ᵀ‖₂ (what the clip uses), gdn_log_decay(decay_logits, A_log,
dt_bias) (the gated variants' g), zoh_input_scale(dt, A) (ZOH for ssd).
* teaching kernels, never called by the model (both tested): softmax's Triton path is the fused-softmax walkthrough
of `python bench.py kernels`; gdn2_decay_clip's standalone Triton kernel is the clip alone, which gdn2_gates' kernel
fuses.

After what the ops share (the registry's row type Op, the dispatcher's _path, the Triton helpers), one section per
op, in the table's order (the order a reader meets them). Each holds the whole op: the math, `<op>_ref` (the spec,
written plainly), `<op>_torch` (vectorised or chunked PyTorch, the CPU path), its Triton kernels and `<op>_triton`
where it has them, the dispatcher `<op>(..., kernels="auto")`, and its row in OPS, the one registry of ops (its
paths, the example launch and the test cases every check of an op reads: a new op is its section and its row):
    "auto"   -> Triton for CUDA tensors when triton is importable and the op has a Triton path, else torch
    "torch"  -> <op>_torch (or <op>_ref when the two are the same code)
    "triton" -> <op>_triton (ValueError if this op has no Triton path, or no row in OPS)
    "ref"    -> <op>_ref
chunk_size is the chunk length of the chunked paths, honoured by torch and Triton alike (a power of two; gdn2's
Triton kernels take 16, 32 or 64, ssd's at most 256, what fits a GPU block's registers and shared memory; else a
ValueError; gdn2's Triton dispatch runs fp32 and fp16 inputs in chunks of at most 16, see gdn2_triton).
Reductions and recurrences run in fp32 and results are cast back to the input dtype; the recurrent states S_T, h_T
come back in fp32. Any sequence length works (chunked paths pad the tail internally). The Triton
kernels' dots take bf16 inputs as they are, accumulating in fp32. What measures the ops (their launches recorded
on fake tensors, compiled ahead of time, counted in Triton's interpreter, timed) is in bench.py.
"""

import contextlib
import functools
import os
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

# Triton is imported only where its kernels can run: on a CUDA machine, or on the CPU in Triton's interpreter
# when TRITON_INTERPRET=1 is set before Python imports this file (the tests do), or where the caller imported
# triton first (the ahead-of-time compile check, which builds cubins without a GPU). A plain CPU import stays
# torch-only.
HAS_TRITON = False
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or "triton" in sys.modules:
    try:
        import triton
        import triton.language as tl
        HAS_TRITON = True
    except ImportError:
        pass


def _widen_bf16_dots_in_the_interpreter():
    """Triton's CPU interpreter (3.7) hands tl.dot the raw uint16 bits of bf16 operands (numpy has no bf16), so
    every bf16 dot returns garbage there; widen them to fp32 first, which is what a GPU's tensor cores compute
    (a bf16 × bf16 product is exact in fp32, and they accumulate in fp32). A GPU run never comes here."""
    import numpy as np
    from triton.runtime import interpreter
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle(interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
                                        .view(np.float32), tl.float32)
    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: create_dot(self, widened(a), widened(b),
                                                                                     *rest)


def _drop_the_interpreters_unasserted_overflow_checks():
    """Triton's CPU interpreter (3.6, 3.7) redoes every int32 add, sub and mul of a kernel in int64 and compares the
    result with int32's range, then hands the comparison to device_assert, which asserts nothing unless the options'
    debug is on, and the interpreter's never is: about a third of a kernel's time there, for no check. Off, the
    kernels compute exactly what they did."""
    import dataclasses
    from triton.runtime import interpreter
    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _widen_bf16_dots_in_the_interpreter()
    _drop_the_interpreters_unasserted_overflow_checks()

KERNEL_CHOICES = ("auto", "torch", "triton", "ref")


class Op(NamedTuple):
    """One row of OPS, the registry of ops: the dispatcher and every check of an op read it. An op's section ends
    with its row. ref, torch, triton: <op>_ref (the spec), <op>_torch (the CPU path), <op>_triton (None where the op
    has no Triton path). Every Triton path has, as functions its section defines:
      example(dtype, dims, fn=None): a thunk that runs fn (the triton or torch path; None: its Triton kernels, what
        the launch recorder and the ahead-of-time compile see) forward and backward at ExampleDims dims on tensors it
        makes when called, on the default device (the GPU timings of bench.py run it under torch.device("cuda"));
      opcheck(randn): [(case, custom op, args, whether to run the whole opcheck)], covering each of its custom ops;
      compare(randn): (call, inputs by name), where call(fn, **inputs) runs any of the paths ref, torch, triton with
        the op's other arguments bound: the interpreter test of triton against ref in fp32, and bench's errors;
    fp16: (the inputs given in fp16, the results allowed 2u) for the fp16 test, None where the op has no fp16 case
    there (sinkhorn computes in fp32 under any autocast; gdn2's and ssd's own tests hold their fp16 error budgets);
    in_model: False for the teaching kernels the model never calls (the ahead-of-time test launches those itself).
    randn(*shape) draws a test's inputs. A row that names a missing function fails at import on that row; one that
    breaks these rules, with a ValueError naming it (_check_ops)."""
    ref: Callable
    torch: Callable
    triton: Optional[Callable]
    example: Optional[Callable] = None
    opcheck: Optional[Callable] = None
    compare: Optional[Callable] = None
    fp16: Optional[tuple] = None
    in_model: bool = True


OPS = {}   # op name: Op, one row per op, written at the end of the op's section


class ExampleDims(NamedTuple):
    """The model dims of the example launches: batch, length, heads and their key and value dims (gdn2's; the
    normalised width is H·K), ssd's heads, head dim and state dim, and ssd's chunk."""
    B: int = 1
    T: int = 256
    H: int = 4
    K: int = 32
    V: int = 32
    heads_ssd: int = 8
    p: int = 32
    n: int = 64
    chunk: int = 64


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _backward(outs):
    """Backpropagate zeros through every output: the launches of the backward, whatever its values."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [torch.zeros_like(o) for o in outs])


def _requiring_grad(t):
    return None if t is None else t.detach().requires_grad_(True)


def _path(op, kernels, x):
    """Resolve kernels= to "torch" | "triton" | "ref" for op on tensor x."""
    if kernels == "auto" and not x.is_cuda:  # the common CPU case, decided without a lookup
        return "torch"
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r} is not one of {KERNEL_CHOICES}; pick one of those")
    if op not in OPS:
        raise ValueError(f"{op} has no row in kernels.OPS; end its section with OPS[{op!r}] = Op(...)")
    if OPS[op].triton is None:
        has_triton, why = False, f"{op} has no Triton path (its OPS row's triton is None)"
    else:
        has_triton, why = HAS_TRITON, "triton is not installed, or a CPU run without TRITON_INTERPRET=1 set before " \
                                      "starting Python"
    if kernels == "auto":
        return "triton" if (has_triton and x.is_cuda) else "torch"
    if kernels == "triton" and not has_triton:
        raise ValueError(f"the Triton path for {op} is not available: {why}; use kernels='torch'")
    return kernels


def autocast_off(device_type):
    """A context with autocast off on this device type; nothing to turn off where autocast does not exist (meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _fp32(fn):
    """Run a recurrence with autocast off: its fp32 matmuls and solves stay fp32 inside a bf16 autocast region."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = next(a for a in (*args, *kwargs.values()) if torch.is_tensor(a))  # keyword calls work too
        with autocast_off(first.device.type):
            return fn(*args, **kwargs)
    return run


def _fp32_or_wider(dtype):
    """The dtype a reference computes in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (the tests' exact runs)."""
    return torch.promote_types(dtype, torch.float32)


def _double_backward(forward, inputs, cotangents):
    """For the hand-written backwards below under create_graph (double backward, e.g. Hessian-vector products):
    the input gradients of forward(*inputs) (a tuple of outputs) by autograd, as differentiable tensors. Taken at
    fresh views of the inputs: autograd.grad at the inputs themselves would also follow the paths by which one
    input was computed from another (L = E_in k̃ᵀ from E_in, were both passed as they are), counting those twice."""
    views = [None if t is None else t.view_as(t) for t in inputs]
    outputs = forward(*views)
    used = [(o, c) for o, c in zip(outputs, cotangents) if c is not None]
    wrt = [v for v in views if v is not None and v.requires_grad]
    grads = iter(torch.autograd.grad([o for o, _ in used], wrt, [c for _, c in used], create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if v is not None and v.requires_grad else None for v in views)


# -----------------------------------------------------------------------------
# What the ops' Triton paths share. Each op's forward and backward launches are torch.library custom ops
# ("specgpt::<op>_fwd", "specgpt::<op>_bwd"; rope's backward is its forward turned back), with fake functions for
# shapes and the backward registered as the forward's autograd: torch.compile sees every Triton op as one opaque node
# and the model traces as one graph.


def on_device_of(x):
    """The context a Triton op's body runs in: x's GPU made the current device (Triton launches on the current
    device, not on its arguments'), and autocast off, so the body's own einsums and casts keep the dtypes it asks
    for (under autocast an fp32 einsum would become a bf16 matmul)."""
    stack = contextlib.ExitStack()
    if x.is_cuda:
        stack.enter_context(torch.cuda.device(x.device))
    stack.enter_context(autocast_off(x.device.type))
    return stack


def _triton_op(name):
    """torch.library.custom_op(name) around a Triton op's body, which runs on_device_of its first tensor."""
    def register(body):
        @functools.wraps(body)
        def on_inputs_device(*args, **kwargs):
            with on_device_of(next(a for a in (*args, *kwargs.values()) if torch.is_tensor(a))):
                return body(*args, **kwargs)
        return torch.library.custom_op(name, mutates_args=())(on_inputs_device)
    return register


# ptxas gives a kernel up to 255 registers a thread wherever it can use them. The launches that took more than
# MAX_REGISTERS are held to it (the launch option maxnreg), at which each fits without a spill on sm_75, sm_80 and
# sm_90 (the ahead-of-time test compiles them): headroom under 255, so another compiler's choices spill nothing
# unseen, at no cost in occupancy (above 128 registers an 8-warp kernel runs one block an SM either way, a 4-warp
# one two). Only those: given a cap, ptxas uses up to it, and took more registers than uncapped (fewer blocks an
# SM) where a launch needs fewer.
MAX_REGISTERS = 232
SHARED_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}   # shared bytes per block
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")   # the launch keywords the wrappers pass, all compile options


def _rows(t, width):
    """(t as rows of its last `width` values, the stride between rows), which the kernels' pointer arithmetic
    takes: a view where those values are contiguous and the leading dims flatten to one stride (a slice of a wider
    tensor along its last dim, as the models pass their projections' columns), else a contiguous copy."""
    rows = t.reshape(-1, width)
    if width > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


def _programs_for(x, rows):
    """Persistent-grid size for row kernels: a few programs per SM on a GPU, a handful elsewhere."""
    if x.is_cuda:
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count))
    return max(1, min(rows, 4))


# -----------------------------------------------------------------------------
# rms_norm: y = g / sqrt(mean(g²) + eps) * weight with g = x, or g = x ⊙ silu(gate) (Mamba2's gated norm, one op so
# that autograd keeps x and gate, not silu(gate) and the product too); in fp32, written once in out_dtype (x's dtype
# by default; under autocast the model asks for the dtype its next matmul reads, so no cast follows)
# Under torch.compile the dispatchers of rms_norm and rope take their torch paths, which inductor fuses with their
# neighbours (the residual add before a norm, the cast and the projections' epilogues around it); a Triton op is an
# opaque custom op there, and every one reads and writes its whole tensor.

def rms_norm_ref(x, weight, eps=1e-6, gate=None, out_dtype=None):
    xf = x.float() if gate is None else x.float() * F.silu(gate.float())
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(out_dtype or x.dtype)


def rms_norm_torch(x, weight, eps=1e-6, gate=None, out_dtype=None):
    dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 is computed in fp32, fp64 stays fp64
    g = x.to(dtype) if gate is None else x.to(dtype) * F.silu(gate.to(dtype))
    return F.rms_norm(g, (x.shape[-1],), weight.to(dtype), eps).to(out_dtype or x.dtype)


# rms_norm in Triton

if HAS_TRITON:
    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, stride_x, stride_gate, eps,
                             HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program normalises BLOCK_R rows of g = x (⊙ silu(gate)); the whole row sits in registers, sums in fp32.
        # x and the gate are read at their row strides, y written contiguous
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        g = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            z = tl.load(gate_ptr + rows[:, None].to(tl.int64) * stride_gate + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            g *= z * tl.sigmoid(z)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=1) / n_cols + eps)
        tl.store(y_ptr + offs, (g * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def _rms_norm_bwd_kernel(x_ptr, gate_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dgate_ptr, dw_partial_ptr, n_rows,
                             n_cols, stride_x, stride_gate, stride_dy, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        # dg = rstd·(dy⊙w − ĝ·mean(dy⊙w⊙ĝ)) with ĝ = rstd·g; g = x gives dx = dg, g = x⊙silu(z) gives
        # dx = dg⊙silu(z) and dz = dg⊙x⊙silu'(z), silu'(z) = σ(z)(1 + z(1 − σ(z))). Each program also sums
        # dy⊙ĝ over its rows into one dw partial
        pid, n_prog = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_C)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for start in range(pid * BLOCK_R, n_rows, n_prog * BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            g = x
            if HAS_GATE:
                z = tl.load(gate_ptr + rows[:, None].to(tl.int64) * stride_gate + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                g = x * z * tl.sigmoid(z)
            dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
            g_hat = g * rstd[:, None]
            dyw = dy * w[None, :]
            dg = rstd[:, None] * (dyw - g_hat * (tl.sum(dyw * g_hat, axis=1) / n_cols)[:, None])
            dw += tl.sum(dy * g_hat, axis=0)
            if HAS_GATE:
                sig = tl.sigmoid(z)
                tl.store(dgate_ptr + offs, (dg * x * sig * (1 + z * (1 - sig))).to(dgate_ptr.dtype.element_ty),
                         mask=mask)
                dg *= z * sig
            tl.store(dx_ptr + offs, dg.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cols < n_cols)


def _rms_norm_blocks(n_cols, gated_backward=False):
    """(BLOCK_R, BLOCK_C, num_warps): a tile of 4096 values, or one row when it is longer, spread 16 values a thread
    (at most 16 warps) so that the backward's tiles stay in registers: no spills up to rows of 8192, or of 4096
    with a gate. The gated backward holds more tiles at once and takes 2048 values, 8 a thread: under 232 registers
    (4096 at 16 a thread took up to 254; 4096 at 8 a thread needs 16 warps, whose 128 registers spilled). The
    backward is held to MAX_REGISTERS: uncapped, ptxas stopped the gated one (16 x 128, 8 warps) at 128 registers and
    spilled 8 B under triton 3.6.0 in fp32 on sm_90; capped it takes 139 and spills none."""
    tile, per_thread = (2048, 8) if gated_backward else (4096, 16)
    block_c = triton.next_power_of_2(n_cols)
    block_r = max(1, min(64, tile // block_c))
    return block_r, block_c, min(16, max(4, block_r * block_c // (32 * per_thread)))


@_triton_op("specgpt::rms_norm_fwd")
def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: Optional[torch.Tensor],
                  out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): the normalised x (⊙ silu(gate)) in out_dtype (x's by default) and each row's 1/rms, which the
    backward reuses."""
    n_cols = x.shape[-1]
    x2, stride_x = _rows(x, n_cols)
    gate2, stride_gate = (x2, stride_x) if gate is None else _rows(gate, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=out_dtype or x.dtype)
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    block_r, block_c, warps = _rms_norm_blocks(n_cols)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x2, gate2, weight.contiguous(), y, rstd, n_rows, n_cols, stride_x, stride_gate, eps, HAS_GATE=gate is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y, rstd


@_rms_norm_fwd.register_fake
def _(x, weight, eps, gate, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@_triton_op("specgpt::rms_norm_bwd")
def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  gate: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dgate); dgate is empty without a gate."""
    n_cols = x.shape[-1]
    (x2, stride_x), (dy2, stride_dy) = _rows(x, n_cols), _rows(dy, n_cols)
    gate2, stride_gate = (x2, stride_x) if gate is None else _rows(gate, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dgate = torch.empty(gate.shape, device=x.device, dtype=gate.dtype) if gate is not None else x.new_empty(0)
    block_r, block_c, warps = _rms_norm_blocks(n_cols, gated_backward=gate is not None)
    n_prog = _programs_for(x2, triton.cdiv(n_rows, block_r))
    dw_partial = torch.empty(n_prog, n_cols, device=x.device, dtype=torch.float32)
    _rms_norm_bwd_kernel[(n_prog,)](x2, gate2, weight.contiguous(), rstd, dy2, dx, dgate, dw_partial, n_rows, n_cols,
                                    stride_x, stride_gate, stride_dy, HAS_GATE=gate is not None, BLOCK_R=block_r,
                                    BLOCK_C=block_c, num_warps=warps, maxnreg=MAX_REGISTERS)
    return dx, dw_partial.sum(0).to(weight.dtype), dgate


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, gate):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty(gate.shape if gate is not None else 0)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, gate, out_dtype = inputs
    ctx.save_for_backward(x, weight, output[1], gate)
    ctx.mark_non_differentiable(output[1])


def _rms_norm_backward(ctx, dy, d_rstd):
    x, weight, rstd, gate = ctx.saved_tensors
    dx, dweight, dgate = _rms_norm_bwd(dy, x, weight, rstd, gate)
    return dx, dweight, None, dgate if gate is not None else None, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm_triton(x, weight, eps=1e-6, gate=None, out_dtype=None):
    return _rms_norm_fwd(x, weight, eps, gate, out_dtype)[0]


def rms_norm(x, weight, eps=1e-6, gate=None, out_dtype=None, kernels="auto"):
    path = _path("rms_norm", kernels, x)
    if path == "triton" and not torch.compiler.is_compiling():
        return rms_norm_triton(x, weight, eps, gate, out_dtype)
    if path == "ref":
        return rms_norm_ref(x, weight, eps, gate, out_dtype)
    return rms_norm_torch(x, weight, eps, gate, out_dtype)


def _rms_norm_example(dtype, d, fn=None):
    C, fn = d.H * d.K, fn or rms_norm_triton
    return lambda: [_backward(fn(_leaf(d.B, d.T, C, dtype=dtype), _leaf(C), 1e-6, gate))
                    for gate in (None, _leaf(d.B, d.T, C, dtype=dtype))]


def _rms_norm_opcheck(randn):
    x, w, gate = randn(2, 3, 5), randn(5), randn(2, 3, 5)
    rstd = _rms_norm_fwd(x, w, 1e-6, gate)[1]
    x_, w_ = _requiring_grad(x), _requiring_grad(w)
    return [("rms_norm", _rms_norm_fwd, (x_, w_, 1e-6, None), False),
            ("rms_norm gate", _rms_norm_fwd, (x_, w_, 1e-6, _requiring_grad(gate)), True),
            ("rms_norm_bwd", _rms_norm_bwd, (randn(2, 3, 5), x, w, rstd, None), False),
            ("rms_norm_bwd gate", _rms_norm_bwd, (randn(2, 3, 5), x, w, rstd, gate), False)]


def _rms_norm_compare(randn):
    return lambda fn, x, w, gate: fn(x, w, 1e-6, gate), dict(x=randn(3, 5, 37), w=randn(37), gate=2 * randn(3, 5, 37))


OPS["rms_norm"] = Op(rms_norm_ref, rms_norm_torch, rms_norm_triton, _rms_norm_example, _rms_norm_opcheck,
                     _rms_norm_compare, fp16=({"x", "gate"}, ()))


# -----------------------------------------------------------------------------
# rope: the pairs (x_2i, x_2i+1) are complex numbers z_i = x_2i + i·x_2i+1, turned by angle θ_i(t):
#   y_2i = x_2i·cos − x_2i+1·sin,   y_2i+1 = x_2i+1·cos + x_2i·sin,   i.e. y = z · e^{iθ}
# (RoFormer's interleaved pairs. Rotate-half pairs (x_i, x_i+D/2) are the same rotation of a permuted x,
# so either convention gives the same model family; interleaved lets the torch path be one complex multiply.)

def rope_ref(x, cos, sin):
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    cos, sin = cos.float()[None, :, None, :], sin.float()[None, :, None, :]  # [1, T, 1, D/2]
    y = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)
    return y.flatten(-2).to(x.dtype)


def rope_torch(x, cos, sin):
    # one complex multiply each way (its backward multiplies by the conjugate), computed in fp32 or wider
    z = torch.view_as_complex(x.to(torch.promote_types(x.dtype, torch.float32)).contiguous().unflatten(-1, (-1, 2)))
    turn = torch.complex(cos, sin).to(z.dtype)[None, :, None, :]
    return torch.view_as_real(z * turn).flatten(-2).to(x.dtype)


# rope in Triton

if HAS_TRITON:
    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, HALF, SIN_SIGN: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # one program per (b, t): turn every head's (x_2i, x_2i+1) pairs by angle θ_t (SIN_SIGN=-1 turns back,
        # which is the backward pass because a rotation's transpose is its inverse)
        row = tl.program_id(0)
        t = row % T
        heads = tl.arange(0, BLOCK_H)
        pairs = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < H) & (pairs[None, :] < HALF)
        offs = row.to(tl.int64) * H * 2 * HALF + heads[:, None] * 2 * HALF + 2 * pairs[None, :]
        cos = tl.load(cos_ptr + t * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)[None, :]
        sin = SIN_SIGN * tl.load(sin_ptr + t * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)[None, :]
        x_even = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (x_even * cos - x_odd * sin).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + offs + 1, (x_odd * cos + x_even * sin).to(y_ptr.dtype.element_ty), mask=mask)


@_triton_op("specgpt::rope")
def _rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sin_sign: float) -> torch.Tensor:
    """x's pairs turned by +θ (sin_sign = 1), or back by −θ (sin_sign = −1: the backward pass)."""
    B, T, H, D = x.shape
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    _rope_kernel[(B * T,)](x, cos, sin, y, T, H, D // 2, SIN_SIGN=sin_sign,
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(D // 2))
    return y


@_rope_rotate.register_fake
def _(x, cos, sin, sin_sign):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    x, cos, sin, sin_sign = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.sin_sign = sin_sign


def _rope_backward(ctx, dy):
    x, cos, sin = ctx.saved_tensors
    dx = _rope_rotate(dy, cos, sin, -ctx.sin_sign)
    dcos = dsin = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # cos/sin are usually buffers; cheap in torch
        x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
        dy_even, dy_odd = dy[..., 0::2].float(), dy[..., 1::2].float()
        dcos = (dy_even * x_even + dy_odd * x_odd).sum((0, 2)).to(cos.dtype)
        dsin = (dy_odd * x_even - dy_even * x_odd).sum((0, 2)).to(sin.dtype)
    return dx, dcos, dsin, None


_rope_rotate.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope_triton(x, cos, sin):
    B, T, H, D = x.shape
    if D % 2 or cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError(f"rope needs x[B,T,H,D] with even D and cos, sin of shape [T, D/2]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return _rope_rotate(x, cos, sin, 1.0)


def rope(x, cos, sin, kernels="auto"):
    path = _path("rope", kernels, x)
    if path == "triton" and not torch.compiler.is_compiling():
        return rope_triton(x, cos, sin)
    if path == "ref" or torch.compiler.is_compiling():  # under torch.compile the real products: inductor fuses them
        return rope_ref(x, cos, sin)                     # (complex numbers it leaves to eager kernels)
    return rope_torch(x, cos, sin)


def _rope_example(dtype, d, fn=None):
    fn = fn or rope_triton
    return lambda: _backward(fn(_leaf(d.B, d.T, d.H, d.K, dtype=dtype), torch.ones(d.T, d.K // 2),
                                torch.zeros(d.T, d.K // 2)))


def _rope_opcheck(randn):
    angle = randn(3, 2)
    return [("rope", _rope_rotate, (_requiring_grad(randn(1, 3, 2, 4)), angle.cos(), angle.sin(), 1.0), True)]


def _rope_compare(randn):
    angle = 3 * randn(7, 5)   # cos and sin in fp32, or in x's dtype where wider (the fp16 test's fp64 reference)

    def call(fn, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        return fn(x, angle.cos().to(x.device, dtype), angle.sin().to(x.device, dtype))
    return call, dict(x=randn(2, 7, 3, 10))


OPS["rope"] = Op(rope_ref, rope_torch, rope_triton, _rope_example, _rope_opcheck, _rope_compare, fp16=({"x"}, ()))


# -----------------------------------------------------------------------------
# softmax over the last dim of x[R, N]: y = exp(x − max) / Σ exp(x − max)

def softmax_ref(x):
    xf = x.float()
    e = torch.exp(xf - xf.max(-1, keepdim=True).values)
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


def softmax_torch(x):
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


# softmax in Triton

# The Triton softmax is the lab's teaching kernel (the fused softmax of the Triton tutorial): a
# persistent grid of programs strides over the rows; each row is loaded once into registers (the
# block is the row length rounded up to a power of two, the tail masked with -inf so it adds exp(-inf)=0),
# reduced twice (max, then sum of exponentials) and written once. torch's unfused version reads and
# writes the row several times; here HBM sees one read and one write per element.
if HAS_TRITON:
    @triton.jit
    def _softmax_fwd_kernel(x_ptr, y_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr):
        cols = tl.arange(0, BLOCK_N)
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            offs = row * n_cols + cols
            x = tl.load(x_ptr + offs, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            e = tl.exp(x - tl.max(x, axis=0))
            tl.store(y_ptr + offs, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=cols < n_cols)

    @triton.jit
    def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, BLOCK_N: tl.constexpr):
        # dx = y ⊙ (dy − Σ dy⊙y), again one read of each input row and one write
        cols = tl.arange(0, BLOCK_N)
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            offs = row * n_cols + cols
            y = tl.load(y_ptr + offs, mask=cols < n_cols, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=cols < n_cols, other=0.0).to(tl.float32)
            dx = y * (dy - tl.sum(dy * y, axis=0))
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=cols < n_cols)


@_triton_op("specgpt::softmax_fwd")
def _softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    _softmax_fwd_kernel[(_programs_for(x, x.shape[0]),)](x, y, x.shape[0], x.shape[1],
                                                          BLOCK_N=triton.next_power_of_2(x.shape[1]))
    return y


@_softmax_fwd.register_fake
def _(x):
    return x.new_empty(x.shape)


@_triton_op("specgpt::softmax_bwd")
def _softmax_bwd(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y = y.contiguous()
    dx = torch.empty_like(y)
    _softmax_bwd_kernel[(_programs_for(y, y.shape[0]),)](y, dy.contiguous(), dx, y.shape[0], y.shape[1],
                                                          BLOCK_N=triton.next_power_of_2(y.shape[1]))
    return dx


@_softmax_bwd.register_fake
def _(dy, y):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    return _softmax_bwd(dy, *ctx.saved_tensors)


_softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def softmax_triton(x):
    if x.ndim != 2:
        raise ValueError(f"softmax_triton takes a 2-D x[R, N]; got shape {tuple(x.shape)}; reshape to rows first")
    return _softmax_fwd(x)


def softmax(x, kernels="auto"):
    path = _path("softmax", kernels, x)
    if path == "triton":
        return softmax_triton(x)
    if path == "ref":
        return softmax_ref(x)
    return softmax_torch(x)


def _softmax_example(dtype, d, fn=None):
    return lambda: _backward((fn or softmax_triton)(_leaf(d.B * d.H * d.T, d.T, dtype=dtype)))


def _softmax_opcheck(randn):
    return [("softmax", _softmax_fwd, (_requiring_grad(randn(3, 5)),), True),
            ("softmax_bwd", _softmax_bwd, (randn(3, 5), _softmax_fwd(randn(3, 5))), False)]


def _softmax_compare(randn):
    return lambda fn, x: fn(x), dict(x=3 * randn(6, 33))


OPS["softmax"] = Op(softmax_ref, softmax_torch, softmax_triton, _softmax_example, _softmax_opcheck, _softmax_compare,
                    fp16=({"x"}, ()), in_model=False)


# -----------------------------------------------------------------------------
# sparsemax over the last dim of z[..., T, N] (Martins & Astudillo 2016): the Euclidean projection of each row
# onto the probability simplex, p = [z − τ]₊ with τ chosen so that Σ_j p_j = 1: every score at or below τ gets
# weight exactly 0. causal=True: row t of the last two dims sees only columns s ≤ N − T + t (the
# T queries are the last T of N positions, as in attention with a key cache); the other columns get p = 0.
# Jacobian: on the support S = {j : p_j > 0}, dz = g − mean_S(g); off it dz = 0 (at a tie z_j = τ, j is off S:
# the derivative for a z_j moving down). Every path first subtracts the row max m, which p = [z − τ]₊ does not see
# (τ moves with it): sorted sums and bisection brackets then work on scores near 0, not near m, whose rounding
# grows with |m| (in fp32, p off by up to 7e-4 at scores offset by 1e4 without the shift, 2e-8 with it).

def _sparsemax_visible(z, causal):
    """The [T, N] mask of the columns each row may use (None when all of them)."""
    if not causal:
        return None
    if z.ndim < 2 or z.shape[-2] > z.shape[-1]:
        raise ValueError(f"causal sparsemax needs z[..., T, N] with T <= N (queries are the last T of N positions); "
                         f"got shape {tuple(z.shape)}")
    T, N = z.shape[-2], z.shape[-1]
    return torch.ones(T, N, dtype=torch.bool, device=z.device).tril(N - T)


def sparsemax_ref(z, causal=False):
    # sorted z_(1) ≥ z_(2) ≥ …: the support is the first k entries, k = max{j : 1 + j·z_(j) > Σ_{i≤j} z_(i)},
    # and τ = (Σ_{i≤k} z_(i) − 1) / k. Hidden columns are −inf: they sort last and never join the support.
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    visible = _sparsemax_visible(z, causal)
    if visible is not None:
        zf = zf.masked_fill(~visible, float("-inf"))
    zf = zf - zf.amax(-1, keepdim=True).detach()  # p does not depend on the shift: a constant to autograd
    z_sorted = zf.sort(dim=-1, descending=True).values
    j = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=zf.dtype)
    cumsum = z_sorted.cumsum(-1)
    k = (1 + j * z_sorted > cumsum).sum(-1, keepdim=True)
    tau = (cumsum.gather(-1, k - 1) - 1) / k
    return torch.where(zf > tau, zf - tau, 0).to(z.dtype)  # a tie z_j = τ is off the support, gradient too


def sparsemax_torch(z, causal=False):
    # The support from the sort (no autograd), then τ = (Σ_S z − 1)/|S| and p = z − τ on S in plain elementwise
    # ops: autograd sees exactly the Jacobian above (and double backward works, which analyze.py needs),
    # instead of differentiating through sort and cumsum.
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    with torch.no_grad():
        support = sparsemax_ref(zf, causal) > 0
        top = torch.where(support, zf, float("-inf")).amax(-1, keepdim=True)  # the row max (it is on S)
    zf = zf - top
    tau = (torch.where(support, zf, 0).sum(-1, keepdim=True) - 1) / support.sum(-1, keepdim=True)
    return torch.where(support, zf - tau, 0).to(z.dtype)


# sparsemax in Triton

# τ without a sort, on z − max z (as every path, see sparsemax_ref): f(τ) = Σ_j [z_j − τ]₊ − 1 falls
# monotonically in τ, f(−1) ≥ 0 (the largest entry alone gives 1) and f(0) = −1, so τ lies in [−1, 0]. Each
# program holds BLOCK_R rows in registers and halves that bracket _SPARSEMAX_HALVINGS times (one pass over the
# row each; 2^-24 is fp32's resolution on the unit bracket), keeping f(lo) ≥ 0. Then S = {z_j > lo} contains
# the support and τ = (Σ_S z − 1)/|S| exactly; an entry wrongly in S lies within the final bracket width of τ,
# so it moves τ by less than that width. The backward needs only p: S = {p > 0}.
_SPARSEMAX_HALVINGS = 24


def _sparsemax_blocks(n):
    """(BLOCK_R, BLOCK_N, num_warps): whole rows in one tile of about 2048 entries (16 a thread: larger tiles
    spill on sm_90), more warps for long rows."""
    block_n = triton.next_power_of_2(n)
    return max(1, min(64, 2048 // block_n)), block_n, min(16, max(4, block_n // 512))


if HAS_TRITON:
    @triton.jit
    def _sparsemax_fwd_kernel(z_ptr, p_ptr, n_rows, T, N, CAUSAL: tl.constexpr, HALVINGS: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_N)
        in_rows = (rows[:, None] < n_rows) & (cols[None, :] < N)
        visible = in_rows
        if CAUSAL:  # row t sees columns s ≤ N − T + t
            visible = visible & (cols[None, :] <= (N - T + rows % T)[:, None])
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        z = tl.load(z_ptr + offs, mask=visible, other=-float("inf")).to(tl.float32)
        z = tl.where(rows[:, None] < n_rows, z, 0.0)  # rows past the end stay finite: no NaN in unused lanes
        z = z - tl.max(z, axis=1)[:, None]
        hi = tl.zeros((BLOCK_R,), dtype=tl.float32)
        lo = hi - 1.0
        for _ in range(HALVINGS):
            mid = 0.5 * (lo + hi)
            above = tl.sum(tl.maximum(z - mid[:, None], 0.0), axis=1) >= 1.0  # f(mid) ≥ 0: τ ≥ mid
            lo = tl.where(above, mid, lo)
            hi = tl.where(above, hi, mid)
        support = z > lo[:, None]
        tau = (tl.sum(tl.where(support, z, 0.0), axis=1) - 1.0) / tl.sum(support.to(tl.float32), axis=1)
        p = tl.maximum(z - tau[:, None], 0.0)  # hidden columns: −inf − τ → 0
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _sparsemax_bwd_kernel(p_ptr, g_ptr, dz_ptr, n_rows, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        # dz = g − mean_S(g) on S = {p > 0}, 0 elsewhere
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        on = tl.load(p_ptr + offs, mask=mask, other=0.0) > 0
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean_g = tl.sum(tl.where(on, g, 0.0), axis=1) / tl.maximum(tl.sum(on.to(tl.float32), axis=1), 1.0)
        dz = tl.where(on, g - mean_g[:, None], 0.0)
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)

    # forward and backward are each one opaque op to autograd and torch.compile
    @_triton_op("specgpt::sparsemax_fwd")
    def _sparsemax_fwd(z: torch.Tensor, causal: bool) -> torch.Tensor:
        N = z.shape[-1]
        z2 = z.reshape(-1, N).contiguous()
        p = torch.empty_like(z2)
        block_r, block_n, warps = _sparsemax_blocks(N)
        _sparsemax_fwd_kernel[(triton.cdiv(z2.shape[0], block_r),)](
            z2, p, z2.shape[0], z.shape[-2] if causal else 1, N, CAUSAL=causal, HALVINGS=_SPARSEMAX_HALVINGS,
            BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps)
        return p.view(z.shape)

    @_sparsemax_fwd.register_fake
    def _(z, causal):
        return z.new_empty(z.shape)

    @_triton_op("specgpt::sparsemax_bwd")
    def _sparsemax_bwd(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        N = p.shape[-1]
        p2, g2 = p.reshape(-1, N).contiguous(), g.reshape(-1, N).contiguous()
        dz = torch.empty_like(p2)
        block_r, block_n, warps = _sparsemax_blocks(N)
        _sparsemax_bwd_kernel[(triton.cdiv(p2.shape[0], block_r),)](p2, g2, dz, p2.shape[0], N,
                                                                    BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps)
        return dz.view(p.shape)

    @_sparsemax_bwd.register_fake
    def _(p, g):
        return p.new_empty(p.shape)

    def _sparsemax_setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    def _sparsemax_backward(ctx, g):
        (p,) = ctx.saved_tensors
        return _sparsemax_bwd(p, g), None

    _sparsemax_fwd.register_autograd(_sparsemax_backward, setup_context=_sparsemax_setup_context)


def sparsemax_triton(z, causal=False):
    _sparsemax_visible(z, causal)  # the shape check
    return _sparsemax_fwd(z, causal)


def sparsemax(z, causal=False, kernels="auto"):
    path = _path("sparsemax", kernels, z)
    if path == "triton":
        return sparsemax_triton(z, causal)
    if path == "ref":
        return sparsemax_ref(z, causal)
    return sparsemax_torch(z, causal)


def _sparsemax_example(dtype, d, fn=None):   # the causal attention weights of every head, [B, H, T, T]
    return lambda: _backward((fn or sparsemax_triton)(_leaf(d.B, d.H, d.T, d.T, dtype=dtype), True))


def _sparsemax_opcheck(randn):
    z = 3 * randn(2, 5, 7)
    return [("sparsemax", _sparsemax_fwd, (_requiring_grad(z), True), True),
            ("sparsemax_bwd", _sparsemax_bwd, (sparsemax_triton(z, True), randn(2, 5, 7)), True)]


def _sparsemax_compare(randn):
    return lambda fn, z: fn(z, True), dict(z=2 * randn(2, 9, 9))


OPS["sparsemax"] = Op(sparsemax_ref, sparsemax_torch, sparsemax_triton, _sparsemax_example, _sparsemax_opcheck,
                      _sparsemax_compare, fp16=({"z"}, ()))


# -----------------------------------------------------------------------------
# sinkhorn: P = exp(logits), then `iters` rounds of (row normalisation, column normalisation), in fp32 (fp64
# stays fp64). The last step normalises columns, so columns sum to 1 exactly and rows to within the convergence
# error. sinkhorn_ref iterates on log P, L ← L − logsumexp over each row, then over each column, and exponentiates
# at the end, so it is finite at any logit spread. The fast paths take only the first round in the log domain (a
# row softmax, then a column log-softmax) and the rest on P itself: after a row normalisation each row's largest
# entry is ≥ 1/n, and dividing by column sums ≤ n leaves it ≥ 1/n² (columns likewise), so every sum they divide
# by lies in [1/n², n] and none can underflow to 0, whatever the spread. On the CPU the cost is the count of small
# ops, not their arithmetic, so the torch path is one autograd node: the matrices are laid out tokens last,
# (n, n, M), where every row or column sum adds n contiguous vectors of length M; the forward normalises in place
# and keeps only the sums; the backward walks the half-steps back, 3 ops each, recovering each iterate from its sums.

def _sinkhorn_check(logits, iters):
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn needs logits[..., n, n]; got shape {tuple(logits.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1 rounds of row and column normalisation; got {iters}")


def sinkhorn_ref(logits, iters=20):
    _sinkhorn_check(logits, iters)
    L = logits.to(torch.promote_types(logits.dtype, torch.float32))
    for _ in range(iters):
        L = L - L.logsumexp(-1, keepdim=True)
        L = L - L.logsumexp(-2, keepdim=True)
    return L.exp()


def _sinkhorn_plain(logits, iters):
    """The torch path's math as plain autograd ops: what its double backward differentiates."""
    L = logits.to(torch.promote_types(logits.dtype, torch.float32))
    P = L.log_softmax(-1).log_softmax(-2).exp()  # the first round in the log domain
    for _ in range(iters - 1):
        P = P / P.sum(-1, keepdim=True)
        P = P / P.sum(-2, keepdim=True)
    return P


class _SinkhornTorch(torch.autograd.Function):
    """P (n, n, M), entry [i, j, m]: the logits' row log-softmax A, then P¹ = exp(A − logsumexp_i A) (columns), then
    row, column, … scalings. For Y = X / s (s the row or column sums of X), ∂X = (∂Y − Σ ∂Y ⊙ Y) / s summed
    along that axis, so Z = ∂Y ⊙ Y steps back as ∂X ⊙ X = Z − Y·ΣZ with no division; the same step takes Z
    back through the column log-softmax (Z is then ∂A), and the row log-softmax ends it:
    ∂logits = Z − exp(A)·Σ_j Z."""

    @staticmethod
    def forward(ctx, logits, iters):
        n = logits.shape[-1]
        L = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, n, n).permute(1, 2, 0)
        P = torch.log_softmax(L.contiguous(), dim=1)  # A: rows in the log domain
        col_sums = P.new_empty(iters, n, P.shape[-1])  # col_sums[k]: column j of every matrix
        P.sub_(torch.logsumexp(P, 0, out=col_sums[0])).exp_()  # columns in the log domain: P¹
        col_sums[0].exp_()
        row_sums = []
        for k in range(1, iters):
            row_sums.append(P.sum(1, keepdim=True))  # (n, 1, M): row i of every matrix
            P.div_(row_sums[-1])
            P.div_(torch.sum(P, 0, out=col_sums[k]))
        ctx.save_for_backward(logits, P, col_sums, *row_sums)
        ctx.iters, ctx.shape = iters, logits.shape
        return P.permute(2, 0, 1).reshape(logits.shape)

    @staticmethod
    def backward(ctx, dP):
        logits, P, col_sums, *row_sums = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a differentiable gradient, from the plain ops
            return _double_backward(lambda x: (_sinkhorn_plain(x, ctx.iters),), (logits,), (dP,))[0], None
        n = ctx.shape[-1]
        with autocast_off(dP.device.type):
            Y = P.clone()  # each half-step's output, recovered from the last by multiplying its sums back in
            Z = dP.to(P.dtype).reshape(-1, n, n).permute(1, 2, 0).contiguous().mul_(Y)  # ∂Y ⊙ Y, tokens last
            for k in reversed(range(ctx.iters)):
                Z.addcmul_(Z.sum(0), Y, value=-1.0)
                Y.mul_(col_sums[k])
                if k:
                    Z.addcmul_(Z.sum(1, keepdim=True), Y, value=-1.0)
                    Y.mul_(row_sums[k - 1])
            dL = Z.addcmul_(Z.sum(1, keepdim=True), Y, value=-1.0)  # Y is now exp(A), the row softmax
        return dL.permute(2, 0, 1).reshape(ctx.shape).to(logits.dtype), None


def sinkhorn_torch(logits, iters=20):
    _sinkhorn_check(logits, iters)
    return _SinkhornTorch.apply(logits, iters)


# sinkhorn in Triton

if HAS_TRITON:
    @triton.jit
    def _sinkhorn_log_normalise(x, AXIS: tl.constexpr, real):
        # x − logsumexp(x) along AXIS (2: rows, 1: columns) on the real lines;
        # a padding line, all −inf, stays −inf
        top = tl.where(real, tl.max(x, axis=AXIS), 0.0)
        total = tl.where(real, tl.sum(tl.exp(x - tl.expand_dims(top, AXIS)), axis=AXIS), 1.0)
        return x - tl.expand_dims(top + tl.log(total), AXIS)

    @triton.jit
    def _sinkhorn_load(l_ptr, M, n, BLOCK_M: tl.constexpr, BN: tl.constexpr):
        # BLOCK_M matrices per program as a [BLOCK_M, BN, BN] tile; padding entries get logit −inf (P = 0). The first
        # round runs in the log domain, as in sinkhorn_torch: A = row log-softmax, P1 = exp(column log-normalised A)
        mats = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        idx = tl.arange(0, BN)
        entry = (idx[None, :, None] < n) & (idx[None, None, :] < n)
        offs = mats[:, None, None].to(tl.int64) * n * n + idx[None, :, None] * n + idx[None, None, :]
        mask = entry & (mats[:, None, None] < M)
        x = tl.where(entry, tl.load(l_ptr + offs, mask=mask, other=0.0).to(tl.float32), -float("inf"))
        A = _sinkhorn_log_normalise(x, 2, idx[None, :] < n)
        P1 = tl.exp(_sinkhorn_log_normalise(A, 1, idx[None, :] < n))
        return tl.exp(A), P1, offs, mask, mats, idx

    @triton.jit
    def _sinkhorn_fwd_kernel(l_ptr, p_ptr, M, n, ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr):
        _, P, offs, mask, mats, idx = _sinkhorn_load(l_ptr, M, n, BLOCK_M, BN)
        for _ in range(ITERS - 1):
            P = P / tl.where(idx[None, :] < n, tl.sum(P, axis=2), 1.0)[:, :, None]  # rows
            P = P / tl.where(idx[None, :] < n, tl.sum(P, axis=1), 1.0)[:, None, :]  # columns
        tl.store(p_ptr + offs, P, mask=mask)

    @triton.jit
    def _sinkhorn_bwd_kernel(l_ptr, dp_ptr, dl_ptr, sums_ptr, M, n, ITERS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BN: tl.constexpr):
        # Recompute the iterates, keeping each normaliser (row sums r_k, column sums c_k) in a scratch
        # buffer, then walk back: for Y = X / rowsum(X), dX = (dY − rowsum(dY⊙Y)) / r and X = Y·r
        # (columns alike), down to P1. With Z = dP1 ⊙ P1 (the gradient of log P1), the column log-softmax
        # gives dA = Z − P1·colsum(Z) and the row log-softmax dlogits = dA − exp(A)·rowsum(dA).
        P0, P, offs, mask, mats, idx = _sinkhorn_load(l_ptr, M, n, BLOCK_M, BN)
        sums = sums_ptr + mats[:, None].to(tl.int64) * (2 * (ITERS - 1) * BN) + idx[None, :]
        for k in range(ITERS - 1):
            r = tl.where(idx[None, :] < n, tl.sum(P, axis=2), 1.0)
            tl.store(sums + (2 * k) * BN, r)
            P = P / r[:, :, None]
            c = tl.where(idx[None, :] < n, tl.sum(P, axis=1), 1.0)
            tl.store(sums + (2 * k + 1) * BN, c)
            P = P / c[:, None, :]
        tl.debug_barrier()
        dP = tl.load(dp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for kk in range(ITERS - 1):
            k = ITERS - 2 - kk
            c = tl.load(sums + (2 * k + 1) * BN)
            dP = (dP - tl.sum(dP * P, axis=1)[:, None, :]) / c[:, None, :]
            P = P * c[:, None, :]
            r = tl.load(sums + (2 * k) * BN)
            dP = (dP - tl.sum(dP * P, axis=2)[:, :, None]) / r[:, :, None]
            P = P * r[:, :, None]
        Z = dP * P
        dA = Z - P * tl.sum(Z, axis=1)[:, None, :]
        tl.store(dl_ptr + offs, (dA - P0 * tl.sum(dA, axis=2)[:, :, None]).to(dl_ptr.dtype.element_ty), mask=mask)


def _sinkhorn_blocks(n):
    bn = triton.next_power_of_2(n)
    return max(1, min(128, 2048 // (bn * bn))), bn


@_triton_op("specgpt::sinkhorn_fwd")
def _sinkhorn_fwd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    n = logits.shape[-1]
    L = logits.reshape(-1, n, n).contiguous()
    P = torch.empty(L.shape, device=L.device, dtype=torch.float32)
    block_m, bn = _sinkhorn_blocks(n)
    _sinkhorn_fwd_kernel[(triton.cdiv(L.shape[0], block_m),)](L, P, L.shape[0], n, ITERS=iters,
                                                              BLOCK_M=block_m, BN=bn)
    return P.reshape(logits.shape)


@_sinkhorn_fwd.register_fake
def _(logits, iters):
    return logits.new_empty(logits.shape, dtype=torch.float32)


@_triton_op("specgpt::sinkhorn_bwd")
def _sinkhorn_bwd(dP: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    n = logits.shape[-1]
    L = logits.reshape(-1, n, n).contiguous()
    M = L.shape[0]
    block_m, bn = _sinkhorn_blocks(n)
    grid = triton.cdiv(M, block_m)
    sums = torch.empty(grid * block_m, 2 * (iters - 1), bn, device=L.device, dtype=torch.float32)
    dL = torch.empty_like(L)
    _sinkhorn_bwd_kernel[(grid,)](L, dP.reshape(M, n, n).contiguous(), dL, sums, M, n, ITERS=iters,
                                  BLOCK_M=block_m, BN=bn)
    return dL.reshape(logits.shape)


@_sinkhorn_bwd.register_fake
def _(dP, logits, iters):
    return logits.new_empty(logits.shape)


def _sinkhorn_setup(ctx, inputs, output):
    logits, iters = inputs
    ctx.save_for_backward(logits)
    ctx.iters = iters


def _sinkhorn_backward(ctx, dP):
    return _sinkhorn_bwd(dP, *ctx.saved_tensors, ctx.iters), None


_sinkhorn_fwd.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup)


def sinkhorn_triton(logits, iters=20):
    _sinkhorn_check(logits, iters)
    return _sinkhorn_fwd(logits, iters)


def sinkhorn(logits, iters=20, kernels="auto"):
    path = _path("sinkhorn", kernels, logits)
    if path == "triton":
        return sinkhorn_triton(logits, iters)
    if path == "ref":
        return sinkhorn_ref(logits, iters)
    return sinkhorn_torch(logits, iters)


def _sinkhorn_example(dtype, d, fn=None):   # mHC's 4 × 4 mixing matrices, in fp32 under any autocast
    return lambda: _backward((fn or sinkhorn_triton)(_leaf(d.B, d.T, 4, 4)))


def _sinkhorn_opcheck(randn):
    return [("sinkhorn", _sinkhorn_fwd, (_requiring_grad(randn(2, 3, 3)), 3), True),
            ("sinkhorn_bwd", _sinkhorn_bwd, (randn(2, 3, 3), randn(2, 3, 3), 3), False)]


def _sinkhorn_compare(randn):
    return lambda fn, logits: fn(logits), dict(logits=2 * randn(2, 13, 4, 4))


OPS["sinkhorn"] = Op(sinkhorn_ref, sinkhorn_torch, sinkhorn_triton, _sinkhorn_example, _sinkhorn_opcheck,
                     _sinkhorn_compare)


# -----------------------------------------------------------------------------
# gdn2_decay_clip: per token and head, with a = k, c = b⊙k, η = ‖a‖‖c‖:
#   ρ = ‖I − a cᵀ‖₂ = (η + sqrt(η² − 4 a·c + 4)) / 2,   g' = min(g, −log ρ)
# so that ‖(I − a cᵀ) Diag(exp g')‖₂ ≤ ρ · max exp g' ≤ 1. ρ ≥ 1 always;
# ρ = 1 iff c = βa with 0 ≤ β‖a‖² ≤ 2, which covers KDA/GDN/DeltaNet (b = β ≤ 2 scalar, ‖k‖ = 1),
# where the clip changes nothing.
# g, k, b are [B,T,H,K] (a scalar β broadcast over K); g' comes back in g's dtype.

def gdn2_decay_clip_ref(g, k, b):
    dtype = _fp32_or_wider(g.dtype)
    gf, a = g.to(dtype), k.to(dtype)
    c = b.to(dtype) * a
    eta = a.norm(dim=-1, keepdim=True) * c.norm(dim=-1, keepdim=True)
    ac = (a * c).sum(-1, keepdim=True)
    rho = (eta + torch.sqrt(torch.clamp(eta * eta - 4 * ac + 4, min=0))) / 2
    return torch.minimum(gf, -torch.log(rho)).to(g.dtype)


def gdn2_log_rho(k, b):
    """log ρ = log ‖I − k (b⊙k)ᵀ‖₂ per token and head ([..., K] -> [..., 1], fp32, ≥ 0).
    Written as log1p(ρ − 1) with ρ − 1 free of cancellation: with δ = η − a·c ≥ 0 and
    s = sqrt((2 − η)² + 4δ), ρ − 1 = (η − 2 + s)/2, which for η < 2 equals 2δ / (s + 2 − η).
    δ = η(1 − cos θ) = (η/2)‖â − ĉ‖² is a sum of squares, so for parallel a, c (KDA, GDN, DeltaNet)
    it is rounding squared, not rounding; ρ − 1 below 1e-6 is taken as 0."""
    a = k.float()
    c = b.float() * a
    eta = a.norm(dim=-1, keepdim=True) * c.norm(dim=-1, keepdim=True)
    delta = eta / 2 * (F.normalize(a, dim=-1) - F.normalize(c, dim=-1)).pow(2).sum(-1, keepdim=True)
    # the floor keeps d sqrt finite at η = 2, δ = 0
    s = torch.sqrt(torch.clamp((2 - eta) ** 2 + 4 * delta, min=1e-20))
    small = eta < 2
    rho_minus_1 = torch.where(small, 2 * delta / torch.where(small, s + 2 - eta, 1.0), (eta - 2 + s) / 2)
    return torch.where(rho_minus_1 < 1e-6, 0.0, torch.log1p(rho_minus_1))


class _GDN2DecayClip(torch.autograd.Function):
    """g' = min(g, β), β = −log ρ (gdn2_log_rho), with the backward written out: as a function of η and a·c,
    ρ = (η + sqrt(η² − 4 a·c + 4))/2, so ∂ρ/∂η = (1 + η/s)/2 and ∂ρ/∂(a·c) = −1/s
    (s the square root), and dβ/da = −(1/ρ)(∂ρ/∂η·(‖c‖/‖a‖) a + ∂ρ/∂(a·c) c), dβ/dc alike;
    then dk = da + b⊙dc, db = k⊙dc. The gradient goes to g where g < β, to β where g > β, half each on a tie
    (as torch.minimum); β is flat where ρ − 1 was rounded to 0. Under create_graph (Hessian-vector products) the
    backward differentiates the forward's ops."""

    @staticmethod
    def forward(ctx, g, k, b):
        bound = -gdn2_log_rho(k, b)
        ctx.save_for_backward(g, k, b, bound)
        return torch.minimum(g.float(), bound).to(g.dtype)

    @staticmethod
    def backward(ctx, dout):
        g, k, b, bound = ctx.saved_tensors
        if torch.is_grad_enabled():
            clip = lambda g, k, b: (torch.minimum(g.float(), -gdn2_log_rho(k, b)).to(g.dtype),)
            return _double_backward(clip, (g, k, b), (dout,))
        g, a, b32, dout = g.float(), k.float(), b.float(), dout.float()
        c = b32 * a
        dg = torch.where(g < bound, dout, torch.where(g == bound, 0.5 * dout, 0.0))
        d_bound = torch.where(bound < 0, (dout - dg).sum(-1, keepdim=True), 0.0)
        na, nc = a.norm(dim=-1, keepdim=True), c.norm(dim=-1, keepdim=True)
        eta = na * nc
        delta = (eta - (a * c).sum(-1, keepdim=True)).clamp_min(0)
        s = torch.sqrt((2 - eta) ** 2 + 4 * delta).clamp_min(1e-20)
        rho = (-bound).exp()
        d_eta = d_bound * -(1 + eta / s) / (2 * rho)
        d_ac = d_bound / (s * rho)
        da = (d_eta * nc / na.clamp_min(1e-30)) * a + d_ac * c
        dc = (d_eta * na / nc.clamp_min(1e-30)) * c + d_ac * a
        return dg.to(ctx.saved_tensors[0].dtype), (da + b32 * dc).to(k.dtype), (a * dc).to(b.dtype)


def gdn2_decay_clip_torch(g, k, b):
    return _GDN2DecayClip.apply(g, k, b)


# gdn2_decay_clip in Triton

if HAS_TRITON:
    @triton.jit
    def _gdn2_clip_bound(k, b):
        # −log ρ and its pieces for a = k, c = b⊙k (rows of a [BLOCK_R, BLOCK_K] tile), cancellation-free as
        # in gdn2_decay_clip_torch: δ = η − a·c ≥ 0, s = sqrt((2 − η)² + 4δ),
        # ρ − 1 = 2δ/(s + 2 − η) for η < 2
        c = b * k
        na = tl.sqrt(tl.sum(k * k, axis=1))
        nc = tl.sqrt(tl.sum(c * c, axis=1))
        eta = na * nc
        delta = tl.maximum(eta - tl.sum(k * c, axis=1), 0.0)
        s = tl.sqrt((2.0 - eta) * (2.0 - eta) + 4.0 * delta)
        small = eta < 2.0
        rho_m1 = tl.where(small, 2.0 * delta / tl.where(small, s + 2.0 - eta, 1.0), (eta - 2.0 + s) / 2.0)
        rho_m1 = tl.where(rho_m1 < 1e-6, 0.0, rho_m1)  # fp32 rounding of δ for parallel a, c, as gdn2_log_rho
        bound = -tl.log(1.0 + rho_m1)
        return bound, c, na, nc, eta, s, 1.0 + rho_m1

    @triton.jit
    def _gdn2_clip_load(g_ptr, k_ptr, b_ptr, n_rows, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < K)
        offs = rows[:, None].to(tl.int64) * K + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return g, k, b, offs, mask

    @triton.jit
    def _gdn2_clip_fwd_kernel(g_ptr, k_ptr, b_ptr, out_ptr, n_rows, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        g, k, b, offs, mask = _gdn2_clip_load(g_ptr, k_ptr, b_ptr, n_rows, K, BLOCK_R, BLOCK_K)
        bound, c, na, nc, eta, s, rho = _gdn2_clip_bound(k, b)
        tl.store(out_ptr + offs, tl.minimum(g, bound[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gdn2_clip_bwd(g, k, b, dout):
        # (dg, dk, db) of g' = min(g, β) with β = −log ρ(η, a·c), on fp32 tiles where k and dout are 0 past the
        # row ends; shared with the fused gdn2_gates kernel. The gradient goes to g where g < β, to β where g > β,
        # half each on a tie (as torch.minimum).
        # dβ/da = −(1/ρ)(∂ρ/∂η·‖c‖/‖a‖·a + ∂ρ/∂(a·c)·c), c alike, with
        # ∂ρ/∂η = (1 + η/s)/2, ∂ρ/∂(a·c) = −1/s; then dk = da + b⊙dc, db = k⊙dc.
        bound, c, na, nc, eta, s, rho = _gdn2_clip_bound(k, b)
        bound = bound[:, None]
        dg = tl.where(g < bound, dout, tl.where(g == bound, 0.5 * dout, 0.0))
        dbound = tl.where(rho > 1.0, tl.sum(dout - dg, axis=1), 0.0)  # β is flat where ρ − 1 was rounded to 0
        s_safe = tl.maximum(s, 1e-20)
        deta = dbound * -(1.0 + eta / s_safe) / (2.0 * rho)
        dac = dbound / (s_safe * rho)
        da = (deta * tl.where(na > 0, nc / tl.where(na > 0, na, 1.0), 0.0))[:, None] * k + dac[:, None] * c
        dc = (deta * tl.where(nc > 0, na / tl.where(nc > 0, nc, 1.0), 0.0))[:, None] * c + dac[:, None] * k
        return dg, da + b * dc, k * dc

    @triton.jit
    def _gdn2_clip_bwd_kernel(g_ptr, k_ptr, b_ptr, dout_ptr, dg_ptr, dk_ptr, db_ptr, n_rows, K,
                              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        g, k, b, offs, mask = _gdn2_clip_load(g_ptr, k_ptr, b_ptr, n_rows, K, BLOCK_R, BLOCK_K)
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dg, dk, db = _gdn2_clip_bwd(g, k, b, dout)
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def _gdn2_clip_blocks(K):
    block_k = triton.next_power_of_2(K)
    return max(1, min(16, 1024 // block_k)), block_k  # larger tiles spill registers in the backward kernel


@_triton_op("specgpt::gdn2_decay_clip_fwd")
def _gdn2_decay_clip_fwd(g: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    g, k, b = g.contiguous(), k.contiguous(), b.contiguous()
    K = g.shape[-1]
    n_rows = g.numel() // K
    out = torch.empty_like(g)
    block_r, block_k = _gdn2_clip_blocks(K)
    _gdn2_clip_fwd_kernel[(triton.cdiv(n_rows, block_r),)](g, k, b, out, n_rows, K, BLOCK_R=block_r, BLOCK_K=block_k)
    return out


@_gdn2_decay_clip_fwd.register_fake
def _(g, k, b):
    return g.new_empty(g.shape)


@_triton_op("specgpt::gdn2_decay_clip_bwd")
def _gdn2_decay_clip_bwd(dout: torch.Tensor, g: torch.Tensor, k: torch.Tensor,
                         b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, k, b = g.contiguous(), k.contiguous(), b.contiguous()
    K = g.shape[-1]
    n_rows = g.numel() // K
    dg, dk, db = torch.empty_like(g), torch.empty_like(k), torch.empty_like(b)
    block_r, block_k = _gdn2_clip_blocks(K)
    _gdn2_clip_bwd_kernel[(triton.cdiv(n_rows, block_r),)](g, k, b, dout.contiguous(), dg, dk, db, n_rows, K,
                                                           BLOCK_R=block_r, BLOCK_K=block_k)
    return dg, dk, db


@_gdn2_decay_clip_bwd.register_fake
def _(dout, g, k, b):
    return g.new_empty(g.shape), k.new_empty(k.shape), b.new_empty(b.shape)


def _gdn2_decay_clip_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gdn2_decay_clip_backward(ctx, dout):
    return _gdn2_decay_clip_bwd(dout, *ctx.saved_tensors)


_gdn2_decay_clip_fwd.register_autograd(_gdn2_decay_clip_backward, setup_context=_gdn2_decay_clip_setup)


def gdn2_decay_clip_triton(g, k, b):
    if k.shape != g.shape or b.shape != g.shape:
        raise ValueError(f"gdn2_decay_clip needs g, k, b of one shape [B,T,H,K]; got {tuple(g.shape)}, "
                         f"{tuple(k.shape)}, {tuple(b.shape)}; broadcast scalar gates with .expand_as(k)")
    return _gdn2_decay_clip_fwd(g, k, b)


def gdn2_decay_clip(g, k, b, kernels="auto"):
    if k.shape != g.shape or b.shape != g.shape:
        raise ValueError(f"gdn2_decay_clip needs g, k, b of one shape [B,T,H,K]; got {tuple(g.shape)}, "
                         f"{tuple(k.shape)}, {tuple(b.shape)}; broadcast scalar gates with .expand_as(k)")
    path = _path("gdn2_decay_clip", kernels, g)
    if path == "triton":
        return gdn2_decay_clip_triton(g, k, b)
    if path == "ref":
        return gdn2_decay_clip_ref(g, k, b)
    return gdn2_decay_clip_torch(g, k, b)


def _gdn2_decay_clip_example(dtype, d, fn=None):
    shape, fn = (d.B, d.T, d.H, d.K), fn or gdn2_decay_clip_triton
    return lambda: _backward(fn(_leaf(*shape), _leaf(*shape, dtype=dtype), _leaf(*shape, dtype=dtype)))


def _gdn2_decay_clip_opcheck(randn):
    k = F.normalize(randn(1, 3, 2, 4), dim=-1)
    g, b = -randn(1, 3, 2, 4).abs(), randn(1, 3, 2, 4).abs() * 2
    return [("gdn2_decay_clip", _gdn2_decay_clip_fwd, tuple(map(_requiring_grad, (g, k, b))), True),
            ("gdn2_decay_clip_bwd", _gdn2_decay_clip_bwd, (randn(1, 3, 2, 4), g, k, b), False)]


def _gdn2_decay_clip_compare(randn):   # b up to 2: a mix of clipped and kept decays
    shape = (2, 9, 2, 16)
    inputs = dict(g=-randn(*shape).abs(), k=F.normalize(randn(*shape), dim=-1), b=2 * randn(*shape).sigmoid())
    return lambda fn, **kw: fn(**kw), inputs


OPS["gdn2_decay_clip"] = Op(gdn2_decay_clip_ref, gdn2_decay_clip_torch, gdn2_decay_clip_triton,
                            _gdn2_decay_clip_example, _gdn2_decay_clip_opcheck, _gdn2_decay_clip_compare,
                            fp16=({"k", "b"}, ()), in_model=False)


# -----------------------------------------------------------------------------
# gdn2_gates: gdn2's log-decay and erase gate from their projections, the clip fused in. Per token, head h, channel:
#   g = −exp(A_log[h])·softplus(decay_logits + dt_bias[h]),   b = σ(erase_logits),
#   g' = min(g, −log ρ(k, b)) if clip
# decay_logits, erase_logits, k are [B,T,H,K], A_log [H], dt_bias [H, K] or [H*K]. g' comes back in fp32, b in
# erase_logits' dtype; the clip reads b as returned, so ρ is the norm of the transition the recurrence applies.

def _gdn2_gates_check(decay_logits, erase_logits, k, A_log, dt_bias):
    if k.dim() != 4 or decay_logits.shape != k.shape or erase_logits.shape != k.shape or A_log.shape != k.shape[2:3] \
            or dt_bias.numel() != k.shape[2] * k.shape[3]:
        raise ValueError(f"gdn2_gates needs decay_logits, erase_logits, k of one shape [B,T,H,K], A_log [H], "
                         f"dt_bias [H, K]; got {tuple(decay_logits.shape)}, {tuple(erase_logits.shape)}, "
                         f"{tuple(k.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")


def gdn_log_decay(decay_logits, A_log, dt_bias):
    """g = −exp(A_log[h])·softplus(decay_logits + dt_bias) in fp32 for decay_logits [..., H, K] (K = 1: one decay per
    head) and dt_bias [H·K]: the log-decay of every gated variant (gdn, kda, gdn2; gdn2_gates' first half)."""
    H, K = decay_logits.shape[-2:]
    dtype = _fp32_or_wider(decay_logits.dtype)
    return -A_log.to(dtype).exp()[:, None] * F.softplus(decay_logits.to(dtype) + dt_bias.to(dtype).view(H, K))


def gdn2_gates_ref(decay_logits, erase_logits, k, A_log, dt_bias, clip=True):
    erase_gate = torch.sigmoid(erase_logits)
    log_decay = gdn_log_decay(decay_logits, A_log, dt_bias)
    return (gdn2_decay_clip_ref(log_decay, k, erase_gate) if clip else log_decay), erase_gate


def gdn2_gates_torch(decay_logits, erase_logits, k, A_log, dt_bias, clip=True):
    log_decay, erase_gate = gdn2_gates_ref(decay_logits, erase_logits, k, A_log, dt_bias, clip=False)
    return (gdn2_decay_clip_torch(log_decay, k, erase_gate) if clip else log_decay), erase_gate


# gdn2_gates in Triton

if HAS_TRITON:
    @triton.jit
    def _softplus(x):
        # log(1 + eˣ), and x itself past 20 as in F.softplus. tl has no log1p: log(w)·u/(w − 1) with w = 1 + u is
        # log1p(u) to full precision, where log(1 + u) would round away the small u = eˣ of a negative x
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        return tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * u / tl.where(w == 1.0, 1.0, w - 1.0)))

    @triton.jit
    def _sigmoid(x):
        # σ(x) through e^−|x| ≤ 1, which cannot overflow
        e = tl.exp(-tl.abs(x))
        return tl.where(x >= 0, 1.0, e) / (1.0 + e)

    @triton.jit
    def _gdn2_gates_tile(ptr, stride, tokens, h, K, cols, mask):
        # the [tokens, cols] tile of head h in fp32, a token's H·K values `stride` elements apart
        return tl.load(ptr + tokens[:, None].to(tl.int64) * stride + h * K + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)

    @triton.jit
    def _gdn2_gates_load(decay_logits_ptr, erase_logits_ptr, A_log_ptr, dt_bias_ptr, n_tokens, H, K, stride_decay,
                         stride_erase, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # a [BLOCK_R, BLOCK_K] tile of BLOCK_R tokens of head h = program_id(1): x = decay_logits + dt_bias[h],
        # A = exp(A_log[h]), the unclipped g = −A·softplus(x), and b = σ(erase_logits) rounded to erase_logits'
        # dtype, as gdn2_gates returns it. Inputs are read at their token strides; offs addresses a contiguous
        # [B,T,H,K]
        h = tl.program_id(1)
        tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        mask = (tokens[:, None] < n_tokens) & (cols[None, :] < K)
        offs = (tokens[:, None].to(tl.int64) * H + h) * K + cols[None, :]
        dt_bias = tl.load(dt_bias_ptr + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        x = _gdn2_gates_tile(decay_logits_ptr, stride_decay, tokens, h, K, cols, mask) + dt_bias[None, :]
        A = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        g = -A * _softplus(x)
        erase_logits = _gdn2_gates_tile(erase_logits_ptr, stride_erase, tokens, h, K, cols, mask)
        b = _sigmoid(erase_logits).to(erase_logits_ptr.dtype.element_ty).to(tl.float32)
        return x, A, g, b, tokens, cols, offs, mask

    @triton.jit
    def _gdn2_gates_fwd_kernel(decay_logits_ptr, erase_logits_ptr, k_ptr, A_log_ptr, dt_bias_ptr, g_ptr, b_ptr,
                               n_tokens, H, K, stride_decay, stride_erase, stride_k, CLIP: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        x, A, g, b, tokens, cols, offs, mask = _gdn2_gates_load(decay_logits_ptr, erase_logits_ptr, A_log_ptr,
                                                                dt_bias_ptr, n_tokens, H, K, stride_decay,
                                                                stride_erase, BLOCK_R, BLOCK_K)
        if CLIP:
            k = _gdn2_gates_tile(k_ptr, stride_k, tokens, tl.program_id(1), K, cols, mask)
            bound, c, na, nc, eta, s, rho = _gdn2_clip_bound(k, b)
            g = tl.minimum(g, bound[:, None])
        tl.store(g_ptr + offs, g, mask=mask)
        tl.store(b_ptr + offs, b.to(b_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gdn2_gates_bwd_kernel(decay_logits_ptr, erase_logits_ptr, k_ptr, A_log_ptr, dt_bias_ptr, dg_ptr, db_ptr,
                               d_decay_logits_ptr, d_erase_logits_ptr, dk_ptr, d_dt_bias_ptr, dA_log_ptr, n_tokens, H,
                               K, stride_decay, stride_erase, stride_k, stride_dg, stride_db, CLIP: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # through the clip (shared with the standalone kernel) to dg of the unclipped g = −A·softplus(x); then
        # dx = −A·σ(x)·dg, which is also dt_bias's gradient per element; ∂g/∂A_log = g, so
        # dA_log[h] = Σ dg·g, d erase_logits = b(1 − b)·db, db including the clip's share. dt_bias's and A_log's
        # gradients are summed over the tile's tokens in fp32: one partial per (block of tokens, head), added outside
        h = tl.program_id(1)
        x, A, g, b, tokens, cols, offs, mask = _gdn2_gates_load(decay_logits_ptr, erase_logits_ptr, A_log_ptr,
                                                                dt_bias_ptr, n_tokens, H, K, stride_decay,
                                                                stride_erase, BLOCK_R, BLOCK_K)
        dg = _gdn2_gates_tile(dg_ptr, stride_dg, tokens, h, K, cols, mask)
        db = _gdn2_gates_tile(db_ptr, stride_db, tokens, h, K, cols, mask)
        if CLIP:
            k = _gdn2_gates_tile(k_ptr, stride_k, tokens, h, K, cols, mask)
            dg, dk, db_clip = _gdn2_clip_bwd(g, k, b, dg)
            db += db_clip
            tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=mask)
        dx = -A * _sigmoid(x) * dg
        tl.store(d_decay_logits_ptr + offs, dx.to(d_decay_logits_ptr.dtype.element_ty), mask=mask)
        tl.store(d_erase_logits_ptr + offs, (b * (1.0 - b) * db).to(d_erase_logits_ptr.dtype.element_ty), mask=mask)
        partial = tl.program_id(0).to(tl.int64) * H + h
        tl.store(d_dt_bias_ptr + partial * K + cols, tl.sum(dx, axis=0), mask=cols < K)
        tl.store(dA_log_ptr + partial, tl.sum(tl.sum(dg * g, axis=1), axis=0))


@_triton_op("specgpt::gdn2_gates_fwd")
def _gdn2_gates_fwd(decay_logits: torch.Tensor, erase_logits: torch.Tensor, k: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor, clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    H, K = k.shape[-2:]
    (decay2, stride_decay), (erase2, stride_erase), (k2, stride_k) = (_rows(t, H * K)
                                                                      for t in (decay_logits, erase_logits, k))
    n_tokens = k2.shape[0]
    log_decay = torch.empty(k.shape, device=k.device, dtype=torch.float32)
    erase_gate = torch.empty(k.shape, device=k.device, dtype=erase_logits.dtype)
    block_r, block_k = _gdn2_clip_blocks(K)
    _gdn2_gates_fwd_kernel[(triton.cdiv(n_tokens, block_r), H)](
        decay2, erase2, k2, A_log.contiguous(), dt_bias.contiguous(), log_decay, erase_gate, n_tokens, H, K,
        stride_decay, stride_erase, stride_k, CLIP=clip, BLOCK_R=block_r, BLOCK_K=block_k)
    return log_decay, erase_gate


@_gdn2_gates_fwd.register_fake
def _(decay_logits, erase_logits, k, A_log, dt_bias, clip):
    return k.new_empty(k.shape, dtype=torch.float32), erase_logits.new_empty(erase_logits.shape)


@_triton_op("specgpt::gdn2_gates_bwd")
def _gdn2_gates_bwd(d_log_decay: torch.Tensor, d_erase_gate: torch.Tensor, decay_logits: torch.Tensor,
                    erase_logits: torch.Tensor, k: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    clip: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of decay_logits, erase_logits, k, A_log, dt_bias; k's is empty without the clip (none flows)."""
    H, K = k.shape[-2:]
    (decay2, stride_decay), (erase2, stride_erase), (k2, stride_k), (dg2, stride_dg), (db2, stride_db) = (
        _rows(t, H * K) for t in (decay_logits, erase_logits, k, d_log_decay, d_erase_gate))
    n_tokens = k2.shape[0]
    new = lambda t: torch.empty(k.shape, device=k.device, dtype=t.dtype)
    d_decay_logits, d_erase_logits, dk = new(decay_logits), new(erase_logits), new(k) if clip else None
    block_r, block_k = _gdn2_clip_blocks(K)
    n_blocks = triton.cdiv(n_tokens, block_r)
    d_dt_bias = torch.empty(n_blocks, H * K, device=k.device, dtype=torch.float32)
    dA_log = torch.empty(n_blocks, H, device=k.device, dtype=torch.float32)
    _gdn2_gates_bwd_kernel[(n_blocks, H)](
        decay2, erase2, k2, A_log.contiguous(), dt_bias.contiguous(), dg2, db2, d_decay_logits, d_erase_logits, dk,
        d_dt_bias, dA_log, n_tokens, H, K, stride_decay, stride_erase, stride_k, stride_dg, stride_db, CLIP=clip,
        BLOCK_R=block_r, BLOCK_K=block_k)
    return (d_decay_logits, d_erase_logits, dk if clip else k.new_empty(0), dA_log.sum(0).to(A_log.dtype),
            d_dt_bias.sum(0).to(dt_bias.dtype).view(dt_bias.shape))


@_gdn2_gates_bwd.register_fake
def _(d_log_decay, d_erase_gate, decay_logits, erase_logits, k, A_log, dt_bias, clip):
    return (decay_logits.new_empty(decay_logits.shape), erase_logits.new_empty(erase_logits.shape),
            k.new_empty(k.shape if clip else 0), A_log.new_empty(A_log.shape), dt_bias.new_empty(dt_bias.shape))


def _gdn2_gates_setup(ctx, inputs, output):
    *tensors, ctx.clip = inputs
    ctx.save_for_backward(*tensors)


def _gdn2_gates_backward(ctx, d_log_decay, d_erase_gate):
    d_decay_logits, d_erase_logits, dk, dA_log, d_dt_bias = _gdn2_gates_bwd(d_log_decay, d_erase_gate,
                                                                            *ctx.saved_tensors, ctx.clip)
    return d_decay_logits, d_erase_logits, dk if ctx.clip else None, dA_log, d_dt_bias, None


_gdn2_gates_fwd.register_autograd(_gdn2_gates_backward, setup_context=_gdn2_gates_setup)


def gdn2_gates_triton(decay_logits, erase_logits, k, A_log, dt_bias, clip=True):
    _gdn2_gates_check(decay_logits, erase_logits, k, A_log, dt_bias)
    return _gdn2_gates_fwd(decay_logits, erase_logits, k, A_log, dt_bias, clip)


def gdn2_gates(decay_logits, erase_logits, k, A_log, dt_bias, clip=True, kernels="auto"):
    _gdn2_gates_check(decay_logits, erase_logits, k, A_log, dt_bias)
    path = _path("gdn2_gates", kernels, k)
    if path == "triton":
        return gdn2_gates_triton(decay_logits, erase_logits, k, A_log, dt_bias, clip)
    if path == "ref":
        return gdn2_gates_ref(decay_logits, erase_logits, k, A_log, dt_bias, clip)
    return gdn2_gates_torch(decay_logits, erase_logits, k, A_log, dt_bias, clip)


def _gdn2_gates_example(dtype, d, fn=None):
    shape, fn = (d.B, d.T, d.H, d.K), fn or gdn2_gates_triton
    return lambda: [_backward(fn(_leaf(*shape, dtype=dtype), _leaf(*shape, dtype=dtype), _leaf(*shape, dtype=dtype),
                                 _leaf(d.H), _leaf(d.H * d.K), clip))
                    for clip in (True, False)]


def _gdn2_gates_opcheck(randn):
    gates = (randn(1, 3, 2, 4), randn(1, 3, 2, 4), F.normalize(randn(1, 3, 2, 4), dim=-1), randn(2), randn(8))
    return [case for clip in (True, False) for case in (
        (f"gdn2_gates clip={clip}", _gdn2_gates_fwd, (*map(_requiring_grad, gates), clip), clip),
        (f"gdn2_gates_bwd clip={clip}", _gdn2_gates_bwd, (randn(1, 3, 2, 4), randn(1, 3, 2, 4), *gates, clip), False))]


def _gdn2_gates_compare(randn):
    B, T, H, K = 2, 9, 2, 16
    gates = dict(decay_logits=randn(B, T, H, K) - 1, erase_logits=2 * randn(B, T, H, K),
                 k=F.normalize(randn(B, T, H, K), dim=-1), A_log=2.7 * randn(H).sigmoid(), dt_bias=randn(H * K) - 3)
    return lambda fn, **kw: fn(**kw, clip=True), gates


# in fp16 the erase logits' and keys' gradients go through the rounded gate b
OPS["gdn2_gates"] = Op(gdn2_gates_ref, gdn2_gates_torch, gdn2_gates_triton, _gdn2_gates_example, _gdn2_gates_opcheck,
                       _gdn2_gates_compare, fp16=({"decay_logits", "erase_logits", "k"}, ("derase_logits", "dk")))


# -----------------------------------------------------------------------------
# gdn2 (Gated DeltaNet-2), state S ∈ R^{K×V} per head, read after the update:
#   S_t = (I − k_t (b_t⊙k_t)ᵀ) Diag(exp g_t) S_{t−1} + k_t (w_t⊙v_t)ᵀ,   o_t = S_tᵀ (q_t·scale)
# q, k, g, b [B,T,H,K]; v, w [B,T,H,V]; S [B,H,K,V]; scale defaults to K^-½.
# Special cases: KDA (b = w = β), GDN (KDA with g equal over K), DeltaNet (GDN with g = 0).
# Computed in fp32; o comes back in q's dtype, S_T in fp32.

def _gdn2_check(q, k, v, g, b, w, initial_state):
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape or b.shape != q.shape:
        raise ValueError(f"gdn2: q, k, g, b must share one [B,T,H,K] shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(g.shape)}, {tuple(b.shape)}; broadcast scalar gates with .expand_as(q)")
    if v.shape[:3] != q.shape[:3] or w.shape != v.shape:
        raise ValueError(f"gdn2: v and w must be [B,T,H,V] matching q's [B,T,H], got {tuple(v.shape)}, "
                         f"{tuple(w.shape)}")
    B, T, H, K = q.shape
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"gdn2: initial_state must be [B,H,K,V] = {(B, H, K, v.shape[-1])}, got "
                         f"{tuple(initial_state.shape)}")


@_fp32
def gdn2_ref(q, k, v, g, b, w, scale=None, initial_state=None):
    _gdn2_check(q, k, v, g, b, w, initial_state)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dtype = _fp32_or_wider(q.dtype)
    qf, kf, vf, gf, bf, wf = (t.to(dtype) for t in (q, k, v, g, b, w))
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(T):
        k_t = kf[:, t]
        S = gf[:, t].exp()[..., None] * S                                   # Diag(exp g_t) S_{t-1}
        erased = torch.einsum("bhk,bhkv->bhv", bf[:, t] * k_t, S)           # (b_t⊙k_t)ᵀ Diag(exp g_t) S_{t-1}
        S = S + k_t[..., None] * (wf[:, t] * vf[:, t] - erased)[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qf[:, t] * scale))
    return torch.stack(outs, dim=1).to(q.dtype), S


def _segsum(a):
    """[..., Q] -> [..., Q, Q]: entry (r, s) is the segment sum Σ_{s<i≤r} a_i for s ≤ r (0 on the diagonal) and −inf
    above it, so that its exp is the decay from token s to token r, 0 where s comes later. Summed segment by segment,
    not as a difference of cumulative sums: a short segment keeps its digits next to a steep one."""
    Q = a.shape[-1]
    later = torch.ones(Q, Q, dtype=torch.bool, device=a.device).tril(-1)             # i > s
    seg = a[..., :, None].expand(*a.shape, Q).masked_fill(~later, 0).cumsum(-2)     # rows i ≤ r summed
    return seg.masked_fill(later.T, float("-inf"))                                  # s > r


@_fp32
def gdn2_chunked_ref(q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=64):
    """gdn2_ref's recurrence in chunks of Q tokens: the chunked WY / UT-transform algorithm of the fast paths (Yang et
    al., 2024, for DeltaNet), plain torch with autograd's backward. In a chunk entering with state S_0, with
    G_r = Σ_{i≤r} g_i (per key channel, from the chunk start) and the delta rule's corrections
    u_r = w_r⊙v_r − (b_r⊙k_r)ᵀ Diag(exp g_r) S_{r−1}, the recurrence S_r = Diag(exp g_r) S_{r−1} + k_r u_rᵀ unrolls to
        S_r = Diag(exp G_r) S_0 + Σ_{s≤r} Diag(exp(G_r − G_s)) k_s u_sᵀ,
    so the corrections solve one unit lower-triangular system (the UT transform)
        (I + L) U = W⊙V − Ẽ S_0,   L_rs = Σ_d b_rd k_rd k_sd exp(G_rd − G_sd) (s < r),   Ẽ_r = exp(G_r)⊙b_r⊙k_r,
    solved once for all chunks against the chunk's own inputs (the WY form): U = U_0 − Y S_0 with
    [U_0, Y] = (I + L)^{-1} [W⊙V, Ẽ]. Then chunk by chunk
        o_r = scale·(exp(G_r)⊙q_r)ᵀ S_0 + scale·Σ_{s≤r} Σ_d q_rd k_sd exp(G_rd − G_sd) u_s,
        S_Q = Diag(exp G_Q) S_0 + Σ_s (exp(G_Q − G_s)⊙k_s) u_sᵀ   (the state handed to the next chunk).
    Every exponent is a sum of g ≤ 0 over a segment s < i ≤ r or from the chunk start, so it is ≤ 0: nothing
    overflows at any decay (Q²K decay factors a chunk, for clarity). KDA (b = w = β), GDN (KDA with g equal over K)
    and DeltaNet (g = 0) are the same call with broadcast gates, as for gdn2_ref. The tail is padded with g = 0 and
    zero inputs, which leaves the state unchanged."""
    _gdn2_check(q, k, v, g, b, w, initial_state)
    if chunk_size < 1:
        raise ValueError(f"gdn2_chunked_ref: chunk_size must be a positive integer, got {chunk_size}")
    B, T, H, K = q.shape
    V, Q, N = v.shape[-1], chunk_size, -(-T // chunk_size)
    scale = K ** -0.5 if scale is None else scale
    out_dtype, dtype = q.dtype, _fp32_or_wider(q.dtype)

    def chunks(t):  # [B,T,H,D] -> [B,H,N,Q,D] in dtype, the tail padded with zeros
        return F.pad(t.to(dtype), (0, 0, 0, 0, 0, N * Q - T)).unflatten(1, (N, Q)).permute(0, 3, 1, 2, 4)

    q, k, v, g, b, w = (chunks(t) for t in (q, k, v, g, b, w))
    G = g.cumsum(-2)                                                    # [B,H,N,Q,K]
    decay = _segsum(g.transpose(-1, -2)).exp()                          # [B,H,N,K,Q,Q]: exp(G_r − G_s), s ≤ r
    L = torch.einsum("bhnrd,bhnsd,bhndrs->bhnrs", b * k, k, decay).tril(-1)
    A_qk = torch.einsum("bhnrd,bhnsd,bhndrs->bhnrs", q * scale, k, decay)   # s ≤ r: decay is 0 above the diagonal
    eye = torch.eye(Q, dtype=dtype, device=q.device)
    U0, Y = torch.linalg.solve_triangular(eye + L, torch.cat([w * v, G.exp() * b * k], -1), upper=False,
                                          unitriangular=True).split([V, K], -1)
    q_in = q * scale * G.exp()                                          # exp(G_r)⊙q_r·scale
    k_out = k * decay[..., -1, :].transpose(-1, -2)                     # exp(G_Q − G_s)⊙k_s
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outs = []
    for n in range(N):
        U = U0[:, :, n] - Y[:, :, n] @ S                                # the corrections u_r
        outs.append(q_in[:, :, n] @ S + A_qk[:, :, n] @ U)
        S = G[:, :, n, -1, :, None].exp() * S + k_out[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S


def _gdn2_pair_positions(C, device):
    """Where W[r, s] sits among _gdn2_pair_weights' products (flattened level by level after one leading zero, the
    entry of every s ≥ r): the level of a pair is its highest differing bit, with half-blocks of h rows."""
    r, s = torch.arange(C, device=device)[:, None], torch.arange(C, device=device)[None, :]
    h = 1 << (r ^ s).clamp(min=1).float().log2().floor().long()
    level_start = 1 + C // 2 * (h - 1)                          # the levels below hold C/2 · h' entries each
    return torch.where(s < r, level_start + ((r // (2 * h)) * h + r % h) * h + s % h, 0).flatten()


def _gdn2_pair_weights(G, k, xs):
    """W[..., r, s] = Σ_d x_rd k_sd exp(G_rd − G_sd) for s < r, else 0, for each x in xs; G, k, x [..., C, K] (C a
    power of two) with G non-increasing along C (g ≤ 0). Halve the chunk into blocks of C/2, C/4, ..., 1 rows: a pair
    s < r first falls apart where s is in the earlier half of a block and r in the later half, and through m, that
    half's first row, exp(G_r − G_s) = exp(G_r − G_m)·exp(G_m − G_s) with both exponents ≤ 0 (s < m ≤ r): no
    factor overflows however steep the decay. Each level is one batched product of half-blocks, log2(C) of them, the
    same code for every chunk: no test for steep chunks, no host sync."""
    C = G.shape[-2]

    def halves(t, h):  # the (earlier, later) halves of each block of 2h rows, [..., C/2h, h, K] each
        return t.unflatten(-2, (C // (2 * h), 2, h)).unbind(-3)

    X = torch.stack(xs)
    products = [X.new_zeros(*X.shape[:-2], 1)]
    for h in (1 << i for i in range(C.bit_length() - 1)):
        G_early, G_late = halves(G, h)
        G_m = G_late.split([1, h - 1], dim=-2)[0]
        k_hat = halves(k, h)[0] * (G_m - G_early).exp()
        x_hat = halves(X, h)[1] * (G_late - G_m).exp()
        # blocks of one row: element-wise products and a sum (a batched matmul of 1 x 1 blocks costs more)
        pairs = (x_hat * k_hat).sum(-1, keepdim=True) if h == 1 else x_hat @ k_hat.transpose(-1, -2)
        products.append(pairs.flatten(-3))
    return torch.cat(products, -1)[..., _gdn2_pair_positions(C, G.device)].unflatten(-1, (C, C)).unbind(0)


def _gdn2_chunk_scan(L, Aqk, E_in, q_in, k_out, decay_out, Z, S0, scale):
    """The chunks' solves and their state hand-off, (batch, head) flattened: L, Aqk [n,N,C,C]; E_in, q_in, k_out
    [n,N,C,K]; decay_out = exp(G_C) [n,N,K,1]; Z = W⊙V [n,N,C,V]; S0 [n,K,V]. Returns o [n,N,C,V], S_C and what
    the backward reuses. Out-of-place ops only: double backward reruns it."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    solve = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)   # (I + L)^{-1}
    Y, U0 = solve @ E_in, solve @ Z
    S, states, corrections = S0, [], []
    # chunk by chunk: u = U0 − Y S, S ← Diag(exp G_C) S + k_outᵀ u. unbind, not indexing: its backward stacks the
    # chunks' gradients once instead of filling N full-size zeros
    for U0_n, Y_n, k_out_n, decay_n in zip(U0.unbind(1), Y.unbind(1), k_out.unbind(1), decay_out.unbind(1)):
        states.append(S)
        corrections.append(torch.baddbmm(U0_n, Y_n, S, alpha=-1))
        S = torch.baddbmm(decay_n * S, k_out_n.transpose(-1, -2), corrections[-1])
    S_in, U = torch.stack(states, 1), torch.stack(corrections, 1)
    o = scale * (q_in @ S_in) + Aqk @ U                          # all chunks' reads at once
    return o, S, (solve, Y, U0, S_in, U)


class _GDN2ChunkScan(torch.autograd.Function):
    """_gdn2_chunk_scan with its backward written out. Per chunk, with T = (I + L)^{-1}, Y = T E_in, U0 = T Z:
        U = U0 − Y S,   S' = Diag(d) S + k_outᵀ U,   o = scale·q_in S + Aqk U.
    With dS' the gradient of the next chunk's state (dS_T for the last), chunk by chunk backwards:
        dU = Aqkᵀ do + k_out dS',   dS = Diag(d) dS' + scale·q_inᵀ do − Yᵀ dU;
    then for all chunks at once: dAqk = do Uᵀ, dq_in = scale·do Sᵀ, dk_out = U dS'ᵀ, dd = rowsum(S ⊙ dS'),
    [dE_in, dZ] = Tᵀ [−dU Sᵀ, dU] and dL = −tril([dE_in, dZ] [Y, U0]ᵀ, −1) (d(T) = −T d(L) T).
    Under create_graph (Hessian-vector products) the backward differentiates _gdn2_chunk_scan's ops instead."""

    @staticmethod
    def forward(ctx, L, Aqk, E_in, q_in, k_out, decay_out, Z, S0, scale):
        o, S, saved = _gdn2_chunk_scan(L, Aqk, E_in, q_in, k_out, decay_out, Z, S0, scale)
        ctx.save_for_backward(L, Aqk, E_in, q_in, k_out, decay_out, Z, S0, *saved)
        ctx.scale = scale
        ctx.set_materialize_grads(False)                         # dS_T stays None when the final state is unused
        return o, S

    @staticmethod
    def backward(ctx, do, dS_T):
        L, Aqk, E_in, q_in, k_out, decay_out, Z, S0, solve, Y, U0, S_in, U = ctx.saved_tensors
        scale = ctx.scale
        if torch.is_grad_enabled():                              # double backward: differentiate the forward's ops
            scan = lambda *inputs: _gdn2_chunk_scan(*inputs, scale)[:2]
            return *_double_backward(scan, (L, Aqk, E_in, q_in, k_out, decay_out, Z, S0), (do, dS_T)), None
        do = torch.zeros_like(Z) if do is None else do.contiguous()
        dU_read = Aqk.transpose(-1, -2) @ do
        dS_read = scale * (q_in.transpose(-1, -2) @ do)
        dS = torch.zeros_like(S0) if dS_T is None else dS_T
        dU, dS_next = [], []
        for n in range(L.shape[1] - 1, -1, -1):
            dS_next.append(dS)
            dU.append(torch.baddbmm(dU_read[:, n], k_out[:, n], dS))
            dS = torch.baddbmm(decay_out[:, n] * dS + dS_read[:, n], Y[:, n].transpose(-1, -2), dU[-1], alpha=-1)
        dU, dS_next = torch.stack(dU[::-1], 1), torch.stack(dS_next[::-1], 1)
        dAqk = do @ U.transpose(-1, -2)
        dq_in = scale * (do @ S_in.transpose(-1, -2))
        dk_out = U @ dS_next.transpose(-1, -2)
        d_decay = (S_in * dS_next).sum(-1, keepdim=True)
        K = E_in.shape[-1]
        rhs = solve.transpose(-1, -2) @ torch.cat([-(dU @ S_in.transpose(-1, -2)), dU], -1)
        dL = -(rhs @ torch.cat([Y, U0], -1).transpose(-1, -2)).tril(-1)
        return dL, dAqk, rhs[..., :K], dq_in, dk_out, d_decay, rhs[..., K:], dS, None


@_fp32
def gdn2_torch(q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=16):
    """Chunked WY / UT-transform form. In a chunk with entering state S_0 and G_r = Σ_{i≤r} g_i (per key channel):
    the delta-rule corrections u_r = w_r⊙v_r − (b_r⊙k_r)ᵀ Diag(exp g_r) S_{r−1} solve
    (I + L) U = Z − Ẽ S_0 with L_rs = Σ_d b_rd k_rd k_sd exp(G_rd − G_sd) (s < r), Z = W⊙V,
    Ẽ_r = exp(G_r)⊙b_r⊙k_r; then
    o_r = scale·((exp(G_r)⊙q_r)ᵀ S_0 + Σ_{s≤r} Σ_d q_rd k_sd exp(G_rd − G_sd) u_s),
    S_C = Diag(exp G_C) S_0 + Σ_s (exp(G_C − G_s)⊙k_s) u_sᵀ.
    The pair weights (_gdn2_pair_weights) factor through a reference row inside the chunk where both exponents are
    ≤ 0 and sum the pairs near the diagonal one by one, so they hold at any decay, every chunk the same code (no
    data-dependent branch, no host sync). All chunks are built at once; only the state hand-off loops over chunks
    (_GDN2ChunkScan, its backward written out).
    Inputs shorter than a chunk get a chunk of the next power of two above T. Per-channel decays cost K multiply-adds
    per pair of tokens (16 was the fastest chunk on a CPU).
    The tail is padded with g = 0 and zero inputs, which leaves the state unchanged. Fewer than 4 tokens (decoding
    steps) take the token loop, which is cheaper there."""
    _gdn2_check(q, k, v, g, b, w, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"gdn2: chunk_size must be a power of two, got {chunk_size}")
    B, T, H, K = q.shape
    if T < 4:
        return gdn2_ref(q, k, v, g, b, w, scale, initial_state)
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = min(chunk_size, 1 << (T - 1).bit_length())
    N = -(-T // C)
    out_dtype = q.dtype

    def chunks(t, copy):  # [B,T,H,D] -> [B,H,N,C,D] fp32, tail padded with zeros; a view where no matmul reads it
        t = t.float()
        t = F.pad(t, (0, 0, 0, 0, 0, N * C - T)) if N * C > T else t
        t = t.view(B, N, C, H, t.shape[-1]).permute(0, 3, 1, 2, 4)
        return t.contiguous() if copy else t

    q, k, v = (chunks(t, True) for t in (q, k, v))
    g, b, w = (chunks(t, False) for t in (g, b, w))
    G = g.cumsum(dim=-2)
    decay_in = G.exp()                                          # exp(G_r): chunk start -> r
    erase = k * b
    E_in = erase * decay_in
    q_in = q * decay_in
    k_out = k * (G[..., -1:, :] - G).exp()                      # exp(G_C − G_s) ⊙ k_s
    L, Aqk = _gdn2_pair_weights(G, k, (erase, q))
    Aqk = (Aqk + torch.diag_embed((q * k).sum(-1))) * scale     # the s = r terms, exp 0 = 1
    S0 = q.new_zeros(B * H, K, V) if initial_state is None else initial_state.float().reshape(B * H, K, V)
    per_chunk = (L, Aqk, E_in, q_in, k_out, decay_in[..., -1, :, None], v * w)
    o, S = _GDN2ChunkScan.apply(*(t.flatten(0, 1) for t in per_chunk), S0, scale)
    o = o.view(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S.reshape(B, H, K, V)


# gdn2 in Triton

# gdn2 in Triton. Two algorithms, picked by length in gdn2_triton:
# - fused recurrent: one program per (batch·head, value block) walks the tokens with its K×BV slice of S
#   in registers (columns of S evolve independently, so value blocks need no communication);
# - chunked (below): the UT-transform form of gdn2_torch, for training lengths.
# Per token (fla's form of the recurrence):
#   S ← Diag(exp g) S;  u = w⊙v − (b⊙k)ᵀ S;  S ← S + k uᵀ;  o = Sᵀ q̃.
# Backward of the recurrent form, with e = b⊙k, A_t = Diag(exp g_t) S_{t−1}, q̃ = q·scale:
#   reverse in time:  dS += q̃ doᵀ;  du = dSᵀ k;  dv = du⊙w;  dw = du⊙v;  dk ∋ dS u;
#                     dS ← Diag(exp g)(dS − e duᵀ)
#   forward again:    de = −A du;  dq = scale·S_t do      (du kept from the reverse pass)
#   and dg by the gauge identity: with G_t = Σ_{i≤t} g_i, the loss sees G only through q·e^G, e·e^G and the
#   written k·e^{−G}, so ∂L/∂G_t = q⊙dq + e⊙de − k⊙dk_write (+ rowsum(dS_T⊙S_T) at t = T),
#   dg = reverse cumsum.
if HAS_TRITON:
    @triton.jit
    def _gdn2_rec_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, s0_ptr, o_ptr, sT_ptr, u_ptr, scale, T, H, K, V,
                             HAS_INITIAL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # u (the corrected write w⊙v − eᵀS per token) is kept for the backward pass
        pid_bh, pid_v = tl.program_id(0), tl.program_id(1)
        bi, hi = pid_bh // H, pid_bh % H
        ks = tl.arange(0, BLOCK_K)
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mk, mv = ks < K, vs < V
        state_offs = pid_bh.to(tl.int64) * K * V + ks[:, None] * V + vs[None, :]
        S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
        if HAS_INITIAL:
            S = tl.load(s0_ptr + state_offs, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        for t in range(T):
            row = (bi * T + t).to(tl.int64) * H + hi
            q = tl.load(q_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32) * scale
            k = tl.load(k_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            S = S * tl.exp(g)[:, None]
            u = w * v - tl.sum((b * k)[:, None] * S, axis=0)
            S = S + k[:, None] * u[None, :]
            tl.store(o_ptr + row * V + vs, tl.sum(S * q[:, None], axis=0).to(o_ptr.dtype.element_ty), mask=mv)
            tl.store(u_ptr + row * V + vs, u, mask=mv)
        tl.store(sT_ptr + state_offs, S, mask=mk[:, None] & mv[None, :])

    @triton.jit
    def _gdn2_rec_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, s0_ptr, u_ptr, do_ptr, dsT_ptr,
                             dq_ptr, dk_ptr, de_ptr, dv_ptr, dw_ptr, ds0_ptr, dgT_ptr, du_ptr,
                             scale, B, T, H, K, V, HAS_INITIAL: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # dq, dk (write part), de and dgT are partial sums over this value block: [NV, ...] buffers summed outside
        pid_bh, pid_v = tl.program_id(0), tl.program_id(1)
        bi, hi = pid_bh // H, pid_bh % H
        ks = tl.arange(0, BLOCK_K)
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mk, mv = ks < K, vs < V
        state_offs = pid_bh.to(tl.int64) * K * V + ks[:, None] * V + vs[None, :]
        partial = pid_v.to(tl.int64) * B * T * H * K
        dS = tl.load(dsT_ptr + state_offs, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        dS_T = dS
        for tt in range(T):
            t = T - 1 - tt
            row = (bi * T + t).to(tl.int64) * H + hi
            q = tl.load(q_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32) * scale
            k = tl.load(k_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + row * V + vs, mask=mv, other=0.0)
            do = tl.load(do_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            # dk and dq are stored without the read at t itself (o_t ∋ q̃_t·k_t u_t), which is added outside
            tl.store(dk_ptr + partial + row * K + ks, tl.sum(dS * u[None, :], axis=1), mask=mk)
            dS += q[:, None] * do[None, :]
            du = tl.sum(dS * k[:, None], axis=0)
            tl.store(dv_ptr + row * V + vs, du * w, mask=mv)
            tl.store(dw_ptr + row * V + vs, du * v, mask=mv)
            tl.store(du_ptr + row * V + vs, du, mask=mv)
            dS = tl.exp(g)[:, None] * (dS - (b * k)[:, None] * du[None, :])
        tl.store(ds0_ptr + state_offs, dS, mask=mk[:, None] & mv[None, :])
        tl.debug_barrier()  # du written above is read back below, possibly by other threads
        S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
        if HAS_INITIAL:
            S = tl.load(s0_ptr + state_offs, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        dgT = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for t in range(T):
            row = (bi * T + t).to(tl.int64) * H + hi
            k = tl.load(k_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * K + ks, mask=mk, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + row * V + vs, mask=mv, other=0.0)
            du = tl.load(du_ptr + row * V + vs, mask=mv, other=0.0)
            do = tl.load(do_ptr + row * V + vs, mask=mv, other=0.0).to(tl.float32)
            S = S * tl.exp(g)[:, None]
            if t == T - 1:  # the end state's gauge term, without the last write (it cancels that write's k⊙dk)
                dgT = tl.sum(dS_T * S, axis=1)
            tl.store(de_ptr + partial + row * K + ks, -tl.sum(S * du[None, :], axis=1), mask=mk)
            tl.store(dq_ptr + partial + row * K + ks, scale * tl.sum(S * do[None, :], axis=1), mask=mk)
            S = S + k[:, None] * u[None, :]
        tl.store(dgT_ptr + (pid_v.to(tl.int64) * B * H + pid_bh) * K + ks, dgT, mask=mk)


def _gdn2_rec_blocks(K, V):
    return triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))


@_triton_op("specgpt::gdn2_recurrent_fwd")
def _gdn2_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                        w: torch.Tensor, scale: float,
                        initial_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, S_T, u): u, the corrected writes, is kept for the backward."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, b, w = (t.contiguous() for t in (q, k, v, g, b, w))
    block_k, block_v = _gdn2_rec_blocks(K, V)
    o = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    S_T = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    u = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32)
    s0 = initial_state.contiguous() if initial_state is not None else S_T
    _gdn2_rec_fwd_kernel[(B * H, triton.cdiv(V, block_v))](
        q, k, v, g, b, w, s0, o, S_T, u, scale, T, H, K, V, HAS_INITIAL=initial_state is not None,
        BLOCK_K=block_k, BLOCK_V=block_v)
    return o, S_T, u


@_gdn2_recurrent_fwd.register_fake
def _(q, k, v, g, b, w, scale, initial_state):
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = dict(dtype=torch.float32)
    return q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, **f32), q.new_empty(B, T, H, V, **f32)


@_triton_op("specgpt::gdn2_recurrent_bwd")
def _gdn2_recurrent_bwd(do: torch.Tensor, dS_T: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, u: torch.Tensor, scale: float,
                        initial_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """(dq, dk, dv, dg, db, dw, d initial_state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, b, w = (t.contiguous() for t in (q, k, v, g, b, w))
    block_k, block_v = _gdn2_rec_blocks(K, V)
    nv = triton.cdiv(V, block_v)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq_p, dk_p, de_p = (torch.empty(nv, B, T, H, K, **f32) for _ in range(3))
    dv, dw, du = (torch.empty(B, T, H, V, **f32) for _ in range(3))
    ds0 = torch.empty(B, H, K, V, **f32)
    dgT = torch.empty(nv, B, H, K, **f32)
    do = do.contiguous()
    s0 = initial_state.contiguous() if initial_state is not None else ds0
    # held to MAX_REGISTERS from head size 64 (uncapped it took 234-255 registers) and to 128 below it (uncapped,
    # triton 3.6.0's ptxas took 72 on sm_75 and spilled 20 B)
    _gdn2_rec_bwd_kernel[(B * H, nv)](
        q, k, v, g, b, w, s0, u, do, dS_T.contiguous(), dq_p, dk_p, de_p, dv, dw, ds0, dgT, du, scale,
        B, T, H, K, V, HAS_INITIAL=initial_state is not None, BLOCK_K=block_k, BLOCK_V=block_v,
        maxnreg=MAX_REGISTERS if block_k >= 64 else 128)
    dq_apart, dk_apart, de = dq_p.sum(0), dk_p.sum(0), de_p.sum(0)
    qf, kf, bf = q.float(), k.float(), b.float()
    # ∂L/∂G_t by the gauge identity, from dq, dk without each token's read of its own write: that adds
    # scale·q k (do·u) to both q⊙dq and k⊙dk, which cancel, and its rounding would swamp strong decays' tiny dg.
    # Likewise the last write k_T u_Tᵀ is in S_T: its k⊙dk is left out, and the end-state term is Σ_v dS_T⊙S_T
    # without it (dgT from the kernel)
    k_dk = kf * dk_apart
    k_dk[:, -1] = 0.0
    dG = qf * dq_apart + bf * kf * de - k_dk
    dG[:, -1] += dgT.sum(0)
    read_own = scale * (u * do.float()).sum(-1, keepdim=True)
    dq, dk_write = dq_apart + read_own * kf, dk_apart + read_own * qf
    dg = dG.flip(1).cumsum(1).flip(1)
    return (dq.to(q.dtype), (dk_write + bf * de).to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), (kf * de).to(b.dtype),
            dw.to(w.dtype), ds0)


@_gdn2_recurrent_bwd.register_fake
def _(do, dS_T, q, k, v, g, b, w, u, scale, initial_state):
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, b, w)), dS_T.new_empty(dS_T.shape, dtype=torch.float32))


def _gdn2_recurrent_setup(ctx, inputs, output):
    q, k, v, g, b, w, ctx.scale, initial_state = inputs
    ctx.save_for_backward(q, k, v, g, b, w, output[2], initial_state)
    ctx.mark_non_differentiable(output[2])


def _gdn2_recurrent_backward(ctx, do, dS_T, du):
    q, k, v, g, b, w, u, initial_state = ctx.saved_tensors
    *grads, ds0 = _gdn2_recurrent_bwd(do, dS_T, q, k, v, g, b, w, u, ctx.scale, initial_state)
    return *grads, None, ds0 if initial_state is not None else None


_gdn2_recurrent_fwd.register_autograd(_gdn2_recurrent_backward, setup_context=_gdn2_recurrent_setup)


# Chunked gdn2 (chunks of CHUNK tokens; G = within-chunk cumsum of g, q̃ = scale·q, e = b⊙k, as gdn2_torch), each chunk
# in NS = CHUNK / SUB sub-chunks of SUB = 16 rows:
#   intra, per chunk, in two kernels (the pair kernel, then the solve, L between them in fp32; in one, the solve's
#   and Y, U0's fp32 [CHUNK, CHUNK] operands held 1 block of 8 warps an SM):
#     pairs:  L_rs = Σ_d e_rd k_sd P_rsd (s < r),  Aqk_rs = Σ_d q̃_rd k_sd P_rsd (s ≤ r),  P_rsd = exp(G_rd − G_sd),
#             and the state pass's operands q_in = exp(G)⊙q̃, k_out = exp(G_C − G)⊙k, d = exp(G_C)
#     solve:  Ainv = (I + L)^{-1},  Y = Ainv (exp(G)⊙e),  U0 = Ainv (w⊙v)
#   state pass, over the chunks in order:  U = U0 − Y S,  S ← Diag(d) S + k_outᵀ U   (S_in: each chunk's entering S)
#   output, per chunk:  O = q_in S_in + Aqk U
# The pair weights go by blocks of sub-chunks. Below the diagonal (r in sub-chunk i, s in an earlier one, m the first
# row of sub-chunk i) P_rsd = exp(G_rd − G_md)·exp(G_md − G_sd), both exponents ≤ 0 (s < m ≤ r): those blocks of L
# and Aqk are tensor-core dots over K of e⊙exp(G − G_m) (or q̃⊙…) and k⊙exp(G_m − G), and no factor overflows however
# strong the decay (one that underflows multiplies a product that small anyway). The diagonal [SUB, SUB] blocks form
# P per channel for s < r only, as explicit [SUB, SUB, BLOCK] tiles: no exponent is positive there either. The
# solve inverts each diagonal block D_i = I + L_ii by forward substitution, then block row i of Ainv is
# D_i⁻¹ (E_i − L_i Ainv), L_i the blocks left of the diagonal in block row i (NS − 1 steps).
# The backward keeps nothing but the inputs: it reruns the intra kernels and the state pass, then
#   reverse over the chunks:  dU = Aqkᵀ dO + k_out dS',  dS = q_inᵀ dO + Diag(d) dS' − Yᵀ dU   (dS' the exit state's)
#   per chunk:                dAqk = dO Uᵀ,  dZ = Ainvᵀ dU (dv = dZ⊙w, dw = dZ⊙v),  dẼ = Ainvᵀ dY = −dZ Sᵀ,
#                             dL = −dZ Uᵀ (dY = −dU Sᵀ; as U = Ainv (Z − Ẽ S), −Ainvᵀ (dU Zᵀ + dY Ẽᵀ) Ainvᵀ is that),
#                             then the pair weights' terms by the forward's blocks,
# and dg by the gauge identity (below), the pair weights' diagonal (s = r, exp 0 = 1) kept out of it as in gdn2_torch,
# its reverse cumulative sum over the sequence in a kernel of its own. The kernels read q, k, v, g, b, w and dO where
# they lie (_token_rows: a slice of the projection's output is not copied) and write the gradients in their dtypes.
# Every tl.dot accumulates in fp32 (_gdn2_dot_kinds). DOT, the products of stored operands (and of the pair weights
# below the diagonal, against exact products 0.3u of o's margin in the bf16 budget test): bf16 or fp16 as the inputs
# are, else fp32 at torch's matmul precision. SOLVE, the solve's products and Y, U0 from the unrounded Ainv: three
# products of operands split into 16-bit halves (bf16 and fp16 inputs), else as DOT. Where keys nearly repeat (I + L
# ill-conditioned), 16-bit solve products, or Y and U0 from the stored Ainv, took o's error from 2.6u to 7.3-7.9u.
# The pair weights, the solve, the decays and the states are computed in fp32; what only dots read again (Ainv, Aqk,
# Y, q_in, k_out, U0, the states handed to the backward) is stored in the operands' dtype.
if HAS_TRITON:
    @triton.jit
    def _gdn2_dot(a, b, DOT: tl.constexpr):
        # a @ b accumulated in fp32 on tensor cores. DOT "bf16" / "fp16" round both operands to that dtype; "bf16x3"
        # / "fp16x3" split fp32 operands as x = x_hi + x_lo in it and add three products (x_lo·y_lo dropped: about 16
        # and 21 bits); "tf32x3" (three TF32 products, fp32's accuracy to about 1e-6) and "tf32" take fp32 operands
        if DOT == "bf16":
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif DOT == "fp16":
            out = tl.dot(a.to(tl.float16), b.to(tl.float16))
        elif DOT == "bf16x3" or DOT == "fp16x3":
            a_hi, a_lo = _gdn2_halves(a, DOT)
            out = _gdn2_dot_halves(a_hi, a_lo, b, DOT)
        else:
            out = tl.dot(a, b, input_precision=DOT)
        return out

    @triton.jit
    def _gdn2_halves(a, DOT: tl.constexpr):
        # a split for _gdn2_dot_halves: its "bf16x3" / "fp16x3" halves, a = a_hi + a_lo, else a (twice)
        if DOT == "bf16x3" or DOT == "fp16x3":
            half: tl.constexpr = tl.bfloat16 if DOT == "bf16x3" else tl.float16
            a_hi = a.to(half)
            a_lo = (a - a_hi.to(tl.float32)).to(half)
        else:
            a_hi, a_lo = a, a
        return a_hi, a_lo

    @triton.jit
    def _gdn2_dot_halves(a_hi, a_lo, b, DOT: tl.constexpr):
        # _gdn2_dot(a, b, DOT) from a's _gdn2_halves (split once where a is the left operand of several dots)
        if DOT == "bf16x3" or DOT == "fp16x3":
            b_hi, b_lo = _gdn2_halves(b, DOT)
            out = tl.dot(a_hi, b_hi, tl.dot(a_hi, b_lo, tl.dot(a_lo, b_hi)))
        else:
            out = _gdn2_dot(a_hi, b, DOT)
        return out

    @triton.jit
    def _gdn2_chunk_rows(ptr, row, bi, c, hi, T, D, cols, CHUNK: tl.constexpr):
        # pointers to chunk c's rows at columns cols in a [B, T, H, D] tensor whose tokens lie `row` elements apart
        # (H·D when contiguous; wider for a slice of in_proj's output, read in place), and their mask (0 past T and
        # past D). The chunk's first row is an int64 offset, the tile's offsets from it int32 (half the registers)
        rs = tl.arange(0, CHUNK)
        first = ptr + ((bi * T + c * CHUNK).to(tl.int64) * row + hi * D)
        return first + (rs[:, None] * row + cols[None, :]), ((c * CHUNK + rs)[:, None] < T) & (cols[None, :] < D)

    @triton.jit
    def _gdn2_chunk_tile(ptr, row, bi, c, hi, T, D, cols, CHUNK: tl.constexpr):
        # chunk c's rows at columns cols, in the tensor's own dtype (0 past T and past D), and their mask
        ptrs, mask = _gdn2_chunk_rows(ptr, row, bi, c, hi, T, D, cols, CHUNK)
        return tl.load(ptrs, mask=mask, other=0.0), mask

    @triton.jit
    def _gdn2_chunk_load_kbg(k_ptr, b_ptr, g_ptr, row_k, row_b, row_g, bi, c, hi, T, K, k0, CHUNK: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        # k, b, G in fp32 at channels k0 .. k0 + BLOCK_K of chunk c (G per channel needs no other channel), G's last
        # row, and the tiles' mask. Called with a sub-chunk's rows (CHUNK = SUB), G starts at the sub-chunk
        cols = k0 + tl.arange(0, BLOCK_K)
        k, mask = _gdn2_chunk_tile(k_ptr, row_k, bi, c, hi, T, K, cols, CHUNK)
        b = _gdn2_chunk_tile(b_ptr, row_b, bi, c, hi, T, K, cols, CHUNK)[0].to(tl.float32)
        g = _gdn2_chunk_tile(g_ptr, row_g, bi, c, hi, T, K, cols, CHUNK)[0].to(tl.float32)
        G = tl.cumsum(g, axis=0)                                    # tail: g = 0, G flat
        G_last = tl.sum(tl.where(tl.arange(0, CHUNK)[:, None] == CHUNK - 1, G, 0.0), axis=0)
        return k.to(tl.float32), b, G, G_last, mask

    @triton.jit
    def _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g, scale, bi, c, hi, T, K, k0,
                            CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
        # q̃ and _gdn2_chunk_load_kbg's k, b, G, G's last row and mask
        q, mask = _gdn2_chunk_tile(q_ptr, row_q, bi, c, hi, T, K, k0 + tl.arange(0, BLOCK_K), CHUNK)
        k, b, G, G_last, _ = _gdn2_chunk_load_kbg(k_ptr, b_ptr, g_ptr, row_k, row_b, row_g, bi, c, hi, T, K, k0,
                                                  CHUNK, BLOCK_K)
        return q.to(tl.float32) * scale, k, b, G, G_last, mask

    @triton.jit
    def _gdn2_chunk_block(ptr, bi, c, hi, H, n_chunks, rows, cols, n_rows, n_cols):
        # pointers to a [rows, cols] tile of chunk c in a [B, N, H, n_rows, n_cols] per-chunk tensor (Ainv, S, ...)
        first = ptr + ((bi * n_chunks + c) * H + hi).to(tl.int64) * n_rows * n_cols
        return first + (rows[:, None] * n_cols + cols[None, :])

    @triton.jit
    def _gdn2_sub_gates(G, i, SUB: tl.constexpr):
        # with m = i·SUB the first row of sub-chunk i: exp(G_r − G_m) on its rows r (0 on the chunk's other rows) and
        # exp(G_m − G_s) on the rows s < m (0 on the others), [C, D] each: both exponents ≤ 0
        rows = tl.arange(0, G.shape[0])[:, None]
        G_m = tl.sum(tl.where(rows == i * SUB, G, 0.0), axis=0)[None, :]
        later = tl.exp(tl.where((rows >= i * SUB) & (rows < i * SUB + SUB), G - G_m, -float("inf")))
        return later, tl.exp(tl.where(rows < i * SUB, G_m - G, -float("inf")))

    @triton.jit
    def _gdn2_pair_decay(G):
        # [R, R, D] tile of exp(G_rd − G_sd) for s < r among the R rows of G [R, D], 0 elsewhere (s = r is exp 0 = 1)
        rs = tl.arange(0, G.shape[0])
        return tl.exp(tl.where((rs[:, None] > rs[None, :])[:, :, None], G[:, None, :] - G[None, :, :], -float("inf")))

    @triton.jit
    def _gdn2_sub_block(X, i):
        # block i of X [NS, R, D], [R, D]
        return tl.sum(tl.where(tl.arange(0, X.shape[0])[:, None, None] == i, X, 0.0), axis=0)

    @triton.jit
    def _gdn2_sub_placed(x, i, NS: tl.constexpr):
        # x [R, D] as block i of an [NS, R, D] tile, 0 in the others
        return tl.where(tl.arange(0, NS)[:, None, None] == i, x[None, :, :], 0.0)

    @triton.jit
    def _gdn2_sub_diagonal(X, C: tl.constexpr):
        # the [C, C] block-diagonal matrix whose diagonal blocks are X [NS, SUB, SUB]
        i = tl.arange(0, X.shape[0])
        return tl.reshape(tl.where(i[:, None, None, None] == i[None, None, :, None], X[:, :, None, :], 0.0), (C, C))

    @triton.jit
    def _gdn2_sub_inverse(L):
        # (I + L_i)^{-1} of each strictly lower block L_i of L [NS, SUB, SUB], all at once by forward substitution:
        # row r is e_r − Σ_{s<r} L_rs (row s of the inverse)
        rs = tl.arange(0, L.shape[1])
        inverse = tl.zeros(L.shape, dtype=tl.float32)
        for r in range(L.shape[1]):
            L_r = tl.sum(tl.where(rs[None, :, None] == r, L, 0.0), axis=1)
            row = tl.where(rs[None, :] == r, 1.0, 0.0) - tl.sum(L_r[:, :, None] * inverse, axis=1)
            inverse = tl.where(rs[None, :, None] == r, row[:, None, :], inverse)
        return inverse

    @triton.jit
    def _gdn2_chunk_pair_kernel(q_ptr, k_ptr, g_ptr, b_ptr, L_ptr, Aqk_ptr, q_in_ptr, k_out_ptr, decay_ptr, row_q,
                                row_k, row_g, row_b, scale, T, H, K, n_chunks, CHUNK: tl.constexpr,
                                SUB: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_KD: tl.constexpr, DOT: tl.constexpr):
        # one program per (batch·chunk, head): q_in, k_out, d and L, Aqk below the sub-chunk diagonal (dots through
        # each row block's first row), K in blocks of BLOCK_KP, then their diagonal blocks (tiles, a sub-chunk at a
        # time, K in blocks of BLOCK_KD). L goes out in fp32, its strictly lower triangle only: the solve reads it
        # as if it had computed it
        pid_bc, hi = tl.program_id(0), tl.program_id(1)
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        NS: tl.constexpr = CHUNK // SUB
        rs = tl.arange(0, CHUNK)
        L = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        Aqk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_KP):
            q, k, b, G, G_last, mask = _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g,
                                                           scale, bi, c, hi, T, K, k0, CHUNK, BLOCK_KP)
            ks = k0 + tl.arange(0, BLOCK_KP)
            tl.store(_gdn2_chunk_rows(q_in_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0],
                     (tl.exp(G) * q).to(q_in_ptr.dtype.element_ty), mask=mask)
            tl.store(_gdn2_chunk_rows(k_out_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0],
                     (tl.exp(G_last[None, :] - G) * k).to(k_out_ptr.dtype.element_ty), mask=mask)
            tl.store(decay_ptr + (pid_bc * H + hi).to(tl.int64) * K + ks, tl.exp(G_last), mask=ks < K)
            if NS > 1:
                for i in range(1, NS):
                    later, earlier = _gdn2_sub_gates(G, i, SUB)
                    k_earlier = tl.trans(k * earlier)
                    L += _gdn2_dot(b * k * later, k_earlier, DOT)
                    Aqk += _gdn2_dot(q * later, k_earlier, DOT)
        L_diag = tl.zeros((NS, SUB, SUB), dtype=tl.float32)
        Aqk_diag = tl.zeros((NS, SUB, SUB), dtype=tl.float32)
        qk = tl.zeros((CHUNK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_KD):
            for i in range(NS):   # sub-chunk i's rows, their G from its own start (only differences enter)
                q, k, b, G, _, _ = _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g, scale,
                                                       bi, c * NS + i, hi, T, K, k0, SUB, BLOCK_KD)
                P = _gdn2_pair_decay(G)
                L_diag += _gdn2_sub_placed(tl.sum((b * k)[:, None, :] * P * k[None, :, :], axis=2), i, NS)
                Aqk_diag += _gdn2_sub_placed(tl.sum(q[:, None, :] * P * k[None, :, :], axis=2), i, NS)
                qk += tl.reshape(_gdn2_sub_placed(tl.sum(q * k, axis=1)[:, None], i, NS), (CHUNK,))
        subs = tl.arange(0, SUB)
        Aqk_diag += tl.where(subs[:, None] == subs[None, :], tl.reshape(qk, (NS, SUB))[:, :, None], 0.0)   # s = r
        tl.store(_gdn2_chunk_block(Aqk_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK),
                 (Aqk + _gdn2_sub_diagonal(Aqk_diag, CHUNK)).to(Aqk_ptr.dtype.element_ty))
        tl.store(_gdn2_chunk_block(L_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK),
                 L + _gdn2_sub_diagonal(L_diag, CHUNK), mask=rs[:, None] > rs[None, :])

    @triton.jit
    def _gdn2_chunk_solve_kernel(k_ptr, g_ptr, b_ptr, v_ptr, w_ptr, L_ptr, Ainv_ptr, Y_ptr, U0_ptr, row_k, row_g,
                                 row_b, row_v, row_w, T, H, K, V, n_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr,
                                 BLOCK_KS: tl.constexpr, BLOCK_V: tl.constexpr, SOLVE: tl.constexpr):
        # one program per (batch·chunk, head): the solve from the pair kernel's L (its diagonal blocks, then a block
        # row at a time), then Y (K in blocks of BLOCK_KS) and U0 (V in blocks of BLOCK_V) from the unrounded Ainv.
        # The forward passes no Ainv_ptr: only the backward reads Ainv
        pid_bc, hi = tl.program_id(0), tl.program_id(1)
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        NS: tl.constexpr = CHUNK // SUB
        rs, subs = tl.arange(0, CHUNK), tl.arange(0, SUB)
        blocks = tl.arange(0, NS)[:, None, None]
        diagonal = (blocks * SUB + subs[None, :, None]) * CHUNK + blocks * SUB + subs[None, None, :]   # its blocks
        L_diag = tl.load(L_ptr + ((bi * n_chunks + c) * H + hi).to(tl.int64) * CHUNK * CHUNK + diagonal,
                         mask=subs[None, :, None] > subs[None, None, :], other=0.0)
        D_inv = _gdn2_sub_inverse(L_diag)
        Ainv = _gdn2_sub_diagonal(D_inv, CHUNK)
        if NS > 1:
            rows = tl.reshape(Ainv, (NS, SUB, CHUNK))    # block row i: D_i⁻¹ E_i, then less D_i⁻¹ L_i Ainv
            for i in tl.static_range(1, NS):   # L_i: the blocks of L left of the diagonal in block row i
                L_i = tl.load(_gdn2_chunk_block(L_ptr, bi, c, hi, H, n_chunks, i * SUB + subs, rs, CHUNK, CHUNK),
                              mask=rs[None, :] < i * SUB, other=0.0)
                solved = _gdn2_dot(L_i, tl.reshape(rows, (CHUNK, CHUNK)), SOLVE)
                rows -= _gdn2_sub_placed(_gdn2_dot(_gdn2_sub_block(D_inv, i), solved, SOLVE), i, NS)
            Ainv = tl.reshape(rows, (CHUNK, CHUNK))
        if Ainv_ptr is not None:
            tl.store(_gdn2_chunk_block(Ainv_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK),
                     Ainv.to(Ainv_ptr.dtype.element_ty))
        Ainv_hi, Ainv_lo = _gdn2_halves(Ainv, SOLVE)
        for k0 in range(0, K, BLOCK_KS):
            k, b, G, _, mask = _gdn2_chunk_load_kbg(k_ptr, b_ptr, g_ptr, row_k, row_b, row_g, bi, c, hi, T, K, k0,
                                                    CHUNK, BLOCK_KS)
            Y = _gdn2_dot_halves(Ainv_hi, Ainv_lo, tl.exp(G) * b * k, SOLVE)
            tl.store(_gdn2_chunk_rows(Y_ptr, H * K, bi, c, hi, T, K, k0 + tl.arange(0, BLOCK_KS), CHUNK)[0],
                     Y.to(Y_ptr.dtype.element_ty), mask=mask)
        for v0 in range(0, V, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            v, mask = _gdn2_chunk_tile(v_ptr, row_v, bi, c, hi, T, V, vs, CHUNK)
            w = _gdn2_chunk_tile(w_ptr, row_w, bi, c, hi, T, V, vs, CHUNK)[0].to(tl.float32)
            U0 = _gdn2_dot_halves(Ainv_hi, Ainv_lo, v.to(tl.float32) * w, SOLVE)
            tl.store(_gdn2_chunk_rows(U0_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0], U0.to(U0_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _gdn2_chunk_state_kernel(Y_ptr, U0_ptr, k_out_ptr, decay_ptr, s0_ptr, sT_ptr, S_in_ptr, U_ptr, T, H, K, V,
                                 n_chunks, HAS_INITIAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                                 BLOCK_V: tl.constexpr, DOT: tl.constexpr, ROWS: tl.constexpr):
        # one program per (batch·head, value block), over the chunks in order, its state S [K, BLOCK_V] in fp32:
        # writes each chunk's entering state S and its corrections U, then S_T. The chunks' reads O = q_in S + Aqk U
        # need no state of their own and run in parallel after it (_gdn2_chunk_output_kernel): inside the pass
        # their operands doubled what each step holds. A chunk goes by pieces of ROWS rows (U's rows need only S,
        # and S's update sums over rows): where rows are not 16-byte aligned each element is its own load and
        # address, and a whole chunk's [CHUNK, K] operands spilled
        pid_bh, pid_v = tl.program_id(0), tl.program_id(1)
        bi, hi = pid_bh // H, pid_bh % H
        ks = tl.arange(0, BLOCK_K)
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        st_offs = ks[:, None] * V + vs[None, :]
        st_mask = (ks[:, None] < K) & (vs[None, :] < V)
        S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
        if HAS_INITIAL:
            S = tl.load(s0_ptr + pid_bh.to(tl.int64) * K * V + st_offs, mask=st_mask, other=0.0).to(tl.float32)
        for c in range(n_chunks):
            chunk = ((bi * n_chunks + c) * H + hi).to(tl.int64)
            tl.store(S_in_ptr + chunk * K * V + st_offs, S.to(S_in_ptr.dtype.element_ty), mask=st_mask)
            d = tl.load(decay_ptr + chunk * K + ks, mask=ks < K, other=0.0)
            S_next = d[:, None] * S
            for j in range(CHUNK // ROWS):
                piece = c * (CHUNK // ROWS) + j
                Y = _gdn2_chunk_tile(Y_ptr, H * K, bi, piece, hi, T, K, ks, ROWS)[0]
                U0, v_mask = _gdn2_chunk_tile(U0_ptr, H * V, bi, piece, hi, T, V, vs, ROWS)
                U = U0 - _gdn2_dot(Y, S, DOT)
                tl.store(_gdn2_chunk_rows(U_ptr, H * V, bi, piece, hi, T, V, vs, ROWS)[0], U.to(U_ptr.dtype.element_ty),
                         mask=v_mask)
                k_out = _gdn2_chunk_tile(k_out_ptr, H * K, bi, piece, hi, T, K, ks, ROWS)[0]
                S_next += _gdn2_dot(tl.trans(k_out), U, DOT)
            S = S_next
        tl.store(sT_ptr + pid_bh.to(tl.int64) * K * V + st_offs, S, mask=st_mask)

    @triton.jit
    def _gdn2_chunk_output_kernel(Aqk_ptr, q_in_ptr, S_in_ptr, U_ptr, o_ptr, T, H, K, V, n_chunks,
                                  CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                                  DOT: tl.constexpr):
        # one program per (batch·chunk, head): O = q_in S + Aqk U, S the chunk's entering state
        pid_bc, hi = tl.program_id(0), tl.program_id(1)
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        rs = tl.arange(0, CHUNK)
        Aqk = tl.load(_gdn2_chunk_block(Aqk_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK))
        for v0 in range(0, V, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            U, v_mask = _gdn2_chunk_tile(U_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)
            o = _gdn2_dot(Aqk, U, DOT)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                q_in = _gdn2_chunk_tile(q_in_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0]
                S = tl.load(_gdn2_chunk_block(S_in_ptr, bi, c, hi, H, n_chunks, ks, vs, K, V),
                            mask=(ks[:, None] < K) & (vs[None, :] < V), other=0.0)
                o += _gdn2_dot(q_in, S, DOT)
            tl.store(_gdn2_chunk_rows(o_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0], o.to(o_ptr.dtype.element_ty),
                     mask=v_mask)

    @triton.jit
    def _gdn2_chunk_bwd_state_kernel(Aqk_ptr, Y_ptr, q_in_ptr, k_out_ptr, decay_ptr, do_ptr, dsT_ptr, dS_next_ptr,
                                     dU_ptr, ds0_ptr, row_do, T, H, K, V, n_chunks, CHUNK: tl.constexpr,
                                     BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT: tl.constexpr,
                                     ROWS: tl.constexpr):
        # reverse over the chunks: dU = Aqkᵀ dO + k_out dS',  dS = q_inᵀ dO + Diag(d) dS' − Yᵀ dU, with dS' the
        # gradient of the chunk's exit state (dS_T for the last one), held as the state pass holds S, a chunk by
        # pieces of ROWS rows as there (dU's rows j: Aqk's columns j against the whole dO); dS' and dU are written
        # per chunk
        pid_bh, pid_v = tl.program_id(0), tl.program_id(1)
        bi, hi = pid_bh // H, pid_bh % H
        rs = tl.arange(0, CHUNK)
        ks = tl.arange(0, BLOCK_K)
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        st_offs = ks[:, None] * V + vs[None, :]
        st_mask = (ks[:, None] < K) & (vs[None, :] < V)
        dS = tl.load(dsT_ptr + pid_bh.to(tl.int64) * K * V + st_offs, mask=st_mask, other=0.0).to(tl.float32)
        for cc in range(n_chunks):
            c = n_chunks - 1 - cc
            chunk = ((bi * n_chunks + c) * H + hi).to(tl.int64)
            tl.store(dS_next_ptr + chunk * K * V + st_offs, dS.to(dS_next_ptr.dtype.element_ty), mask=st_mask)
            dO = _gdn2_chunk_tile(do_ptr, row_do, bi, c, hi, T, V, vs, CHUNK)[0]
            d = tl.load(decay_ptr + chunk * K + ks, mask=ks < K, other=0.0)
            dS_prev = d[:, None] * dS
            for j in range(CHUNK // ROWS):
                piece = c * (CHUNK // ROWS) + j
                js = j * ROWS + tl.arange(0, ROWS)
                Aqk_j = tl.load(_gdn2_chunk_block(Aqk_ptr, bi, c, hi, H, n_chunks, rs, js, CHUNK, CHUNK))
                k_out = _gdn2_chunk_tile(k_out_ptr, H * K, bi, piece, hi, T, K, ks, ROWS)[0]
                dU = _gdn2_dot(tl.trans(Aqk_j), dO, DOT) + _gdn2_dot(k_out, dS, DOT)
                dO_j, v_mask = _gdn2_chunk_tile(do_ptr, row_do, bi, piece, hi, T, V, vs, ROWS)
                tl.store(_gdn2_chunk_rows(dU_ptr, H * V, bi, piece, hi, T, V, vs, ROWS)[0],
                         dU.to(dU_ptr.dtype.element_ty), mask=v_mask)
                q_in = _gdn2_chunk_tile(q_in_ptr, H * K, bi, piece, hi, T, K, ks, ROWS)[0]
                Y = _gdn2_chunk_tile(Y_ptr, H * K, bi, piece, hi, T, K, ks, ROWS)[0]
                dS_prev += _gdn2_dot(tl.trans(q_in), dO_j, DOT) - _gdn2_dot(tl.trans(Y), dU, DOT)
            dS = dS_prev
        tl.store(ds0_ptr + pid_bh.to(tl.int64) * K * V + st_offs, dS, mask=st_mask)

    @triton.jit
    def _gdn2_sub_pair_grads(q, k, e, G, dAqk, dL):
        # the pair weights' terms within one sub-chunk, q̃, k, e, G [SUB, D] its rows and dAqk, dL [SUB, SUB] its block:
        #   dq̃_r = Σ_s dAqk_rs k_s P_rs,  de_r = Σ_s dL_rs k_s P_rs,  dk_s = Σ_r (dL_rs e_r + dAqk_rs q̃_r) P_rs
        # over s < r, each [SUB, D]
        P = _gdn2_pair_decay(G)
        k_P = k[None, :, :] * P
        dk = tl.sum((dL[:, :, None] * e[:, None, :] + dAqk[:, :, None] * q[:, None, :]) * P, axis=0)
        return tl.sum(dAqk[:, :, None] * k_P, axis=1), tl.sum(dL[:, :, None] * k_P, axis=1), dk

    @triton.jit
    def _gdn2_chunk_bwd_intra_kernel(q_ptr, k_ptr, g_ptr, b_ptr, v_ptr, w_ptr, do_ptr, Ainv_ptr, S_in_ptr, U_ptr,
                                     dS_next_ptr, dU_ptr, dAqk_ptr, dL_ptr, dq_ptr, dk_ptr, dv_ptr, db_ptr, dw_ptr,
                                     dG_ptr, row_q, row_k, row_g, row_b, row_v, row_w, row_do, scale, T, H, K, V,
                                     n_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
                                     BLOCK_V: tl.constexpr, DOT: tl.constexpr):
        # one program per (batch·chunk, head), every gradient of the chunk. Pass 1 walks V: dAqk = dO Uᵀ,
        # dZ = Ainvᵀ dU (dv, dw, final) and dL = −dZ Uᵀ. dZ goes out over dU at dU_ptr in the operands' dtype (each
        # tile after this program read it; no other program reads the chunk's rows); dAqk's diagonal stays in
        # registers, the strictly lower dAqk and dL go out to dAqk_ptr, dL_ptr in the operands' dtype (held across
        # pass 2 they spilled registers) and pass 2 reads them back a sub-chunk's rows at a time. Pass 2 walks K in
        # blocks, each over V for the operands' terms dq_in = dO Sᵀ, dk_out = U dS'ᵀ and
        # dẼ = Ainvᵀ dY = −Ainvᵀ dU Sᵀ = −dZ Sᵀ (pass 1's dZ: Ainv is not held across pass 2, where it spilled), then
        # adds the pair weights' terms (each sub-chunk over its rows r):
        #   dq̃_r += Σ_s dAqk_rs k_s P_rs,  de_r += Σ_s dL_rs k_s P_rs,  dk_s += Σ_r (dL_rs e_r + dAqk_rs q̃_r) P_rs,
        # the diagonal blocks as tiles, then the blocks left of them by dots through each sub-chunk's first row m as
        # the forward forms them, and writes dq = scale·dq̃, dk, db = k⊙de in the inputs' dtypes and dG, ∂L/∂G by the
        # gauge identity, for _gdn2_chunk_bwd_dg_kernel
        pid_bc, hi = tl.program_id(0), tl.program_id(1)
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        NS: tl.constexpr = CHUNK // SUB
        rs = tl.arange(0, CHUNK)
        AinvT = tl.trans(tl.load(_gdn2_chunk_block(Ainv_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK)))
        dAqk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        dL = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            dO, v_mask = _gdn2_chunk_tile(do_ptr, row_do, bi, c, hi, T, V, vs, CHUNK)
            U = _gdn2_chunk_tile(U_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0]
            v = _gdn2_chunk_tile(v_ptr, row_v, bi, c, hi, T, V, vs, CHUNK)[0].to(tl.float32)
            w = _gdn2_chunk_tile(w_ptr, row_w, bi, c, hi, T, V, vs, CHUNK)[0].to(tl.float32)
            dZ = _gdn2_dot(AinvT, _gdn2_chunk_tile(dU_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0], DOT)
            dAqk += _gdn2_dot(dO, tl.trans(U), DOT)
            dL -= _gdn2_dot(dZ, tl.trans(U), DOT)
            tl.store(_gdn2_chunk_rows(dv_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0],
                     (dZ * w).to(dv_ptr.dtype.element_ty), mask=v_mask)
            tl.store(_gdn2_chunk_rows(dw_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0],
                     (dZ * v).to(dw_ptr.dtype.element_ty), mask=v_mask)
            tl.store(_gdn2_chunk_rows(dU_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0],
                     dZ.to(dU_ptr.dtype.element_ty), mask=v_mask)
        dAqk_rr = tl.sum(tl.where(rs[:, None] == rs[None, :], dAqk, 0.0), axis=1)[:, None]
        below = rs[:, None] > rs[None, :]
        tl.store(_gdn2_chunk_block(dAqk_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK),
                 tl.where(below, dAqk, 0.0).to(dAqk_ptr.dtype.element_ty))
        tl.store(_gdn2_chunk_block(dL_ptr, bi, c, hi, H, n_chunks, rs, rs, CHUNK, CHUNK),
                 tl.where(below, dL, 0.0).to(dL_ptr.dtype.element_ty))
        tl.debug_barrier()   # this block's stores are read back by its other threads
        rows = rs[:, None]
        for k0 in range(0, K, BLOCK_K):
            q, k, b, G, G_last, mask = _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g,
                                                           scale, bi, c, hi, T, K, k0, CHUNK, BLOCK_K)
            ks = k0 + tl.arange(0, BLOCK_K)
            e = b * k
            dq_in = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)     # dO Sᵀ
            dk_out = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)    # U dS'ᵀ
            dE = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)        # dẼ = Ainvᵀ dY = −dZ Sᵀ
            for v0 in range(0, V, BLOCK_V):
                vs = v0 + tl.arange(0, BLOCK_V)
                st_mask = (ks[:, None] < K) & (vs[None, :] < V)
                S = tl.load(_gdn2_chunk_block(S_in_ptr, bi, c, hi, H, n_chunks, ks, vs, K, V), mask=st_mask,
                            other=0.0)
                dS_next = tl.load(_gdn2_chunk_block(dS_next_ptr, bi, c, hi, H, n_chunks, ks, vs, K, V), mask=st_mask,
                                  other=0.0)
                dO = _gdn2_chunk_tile(do_ptr, row_do, bi, c, hi, T, V, vs, CHUNK)[0]
                U = _gdn2_chunk_tile(U_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0]
                dZ = _gdn2_chunk_tile(dU_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)[0]
                dq_in += _gdn2_dot(dO, tl.trans(S), DOT)
                dk_out += _gdn2_dot(U, tl.trans(dS_next), DOT)
                dE -= _gdn2_dot(dZ, tl.trans(S), DOT)
            dq = tl.exp(G) * dq_in                                   # dq̃
            de = tl.exp(G) * dE                                      # exp(G)⊙dẼ
            dk_state = tl.exp(G_last[None, :] - G) * dk_out
            dk_pairs = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)
            n_subs = tl.cdiv(tl.minimum(T - c * CHUNK, CHUNK), SUB)   # the sub-chunks that hold tokens
            for i in range(n_subs):   # the diagonal blocks, as tiles
                q_i, k_i, b_i, G_i, _, _ = _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g,
                                                               scale, bi, c * NS + i, hi, T, K, k0, SUB, BLOCK_K)
                subs = i * SUB + tl.arange(0, SUB)
                dAqk_ii = tl.load(_gdn2_chunk_block(dAqk_ptr, bi, c, hi, H, n_chunks, subs, subs, CHUNK, CHUNK))
                dL_ii = tl.load(_gdn2_chunk_block(dL_ptr, bi, c, hi, H, n_chunks, subs, subs, CHUNK, CHUNK))
                dq_i, de_i, dk_i = _gdn2_sub_pair_grads(q_i, k_i, b_i * k_i, G_i, dAqk_ii.to(tl.float32),
                                                        dL_ii.to(tl.float32))
                dq += tl.reshape(_gdn2_sub_placed(dq_i, i, NS), (CHUNK, BLOCK_K))
                de += tl.reshape(_gdn2_sub_placed(de_i, i, NS), (CHUNK, BLOCK_K))
                dk_pairs += tl.reshape(_gdn2_sub_placed(dk_i, i, NS), (CHUNK, BLOCK_K))
            # the blocks left of the diagonal, by dots through the sub-chunk's first row m; unpipelined (its loads
            # prefetched, the kernel spilled at a shape with no integer a multiple of 16)
            for i in tl.range(1, n_subs, num_stages=1):
                q_i, k_i, b_i, G_i, _, _ = _gdn2_chunk_load_qk(q_ptr, k_ptr, b_ptr, g_ptr, row_q, row_k, row_b, row_g,
                                                               scale, bi, c * NS + i, hi, T, K, k0, SUB, BLOCK_K)
                subs = i * SUB + tl.arange(0, SUB)
                dAqk_i = tl.load(_gdn2_chunk_block(dAqk_ptr, bi, c, hi, H, n_chunks, subs, rs, CHUNK, CHUNK))
                dL_i = tl.load(_gdn2_chunk_block(dL_ptr, bi, c, hi, H, n_chunks, subs, rs, CHUNK, CHUNK))
                G_m = tl.sum(tl.where(rows == i * SUB, G, 0.0), axis=0)[None, :]
                later = tl.exp(G_i - tl.sum(tl.where(subs[:, None] == i * SUB, G_i, 0.0), axis=0)[None, :])
                earlier = tl.exp(tl.where(rows < i * SUB, G_m - G, -float("inf")))
                k_earlier = k * earlier
                dq += tl.reshape(_gdn2_sub_placed(later * _gdn2_dot(dAqk_i, k_earlier, DOT), i, NS), (CHUNK, BLOCK_K))
                de += tl.reshape(_gdn2_sub_placed(later * _gdn2_dot(dL_i, k_earlier, DOT), i, NS), (CHUNK, BLOCK_K))
                dk_pairs += earlier * (_gdn2_dot(tl.trans(dAqk_i), q_i * later, DOT)
                                       + _gdn2_dot(tl.trans(dL_i), b_i * k_i * later, DOT))
            # without the diagonal dAqk_rr (it adds q̃⊙k·dAqk_rr to q̃⊙dq̃ and to k⊙dk, which cancel), and
            # without the state term's share in the last chunk: its writes cancel the end-state term, which
            # _gdn2_chunk_bwd_dg_kernel adds without them
            k_dk = k * dk_pairs + tl.where(c == n_chunks - 1, 0.0, k * dk_state)
            tl.store(_gdn2_chunk_rows(dG_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0], q * dq + e * de - k_dk, mask=mask)
            tl.store(_gdn2_chunk_rows(dq_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0],
                     ((dq + dAqk_rr * k) * scale).to(dq_ptr.dtype.element_ty), mask=mask)
            tl.store(_gdn2_chunk_rows(dk_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0],
                     (dk_state + dk_pairs + dAqk_rr * q + b * de).to(dk_ptr.dtype.element_ty), mask=mask)
            tl.store(_gdn2_chunk_rows(db_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0],
                     (k * de).to(db_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gdn2_chunk_bwd_dg_kernel(dG_ptr, g_ptr, k_ptr, U_ptr, S_in_ptr, dsT_ptr, dg_ptr, row_g, row_k, T, H, K, V,
                                  n_chunks, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # dg_t = Σ_{s≥t} dG_s plus the end state's term Σ_v dS_T⊙S_T, split as S_T = Diag(exp G_C) S_in +
        # Σ_s k_out,s u_sᵀ over the last chunk (whose k⊙dk state share the backward per-chunk kernel left out): the
        # first part reaches every token's dg, the write of token s only the dg of the tokens after it in that chunk.
        # Written out, it would cancel those writes, O(1) terms whose difference is small under steep decays.
        # One program per (batch·head, block of channels), over the chunks from the last, a running sum carried
        # over; the last chunk's step, ahead of the loop, also forms the end state's terms (over V, from U's rows one
        # token back): inside it, its tiles stayed live across the loop and spilled
        pid_bh, pid_k = tl.program_id(0), tl.program_id(1)
        bi, hi = pid_bh // H, pid_bh % H
        rs = tl.arange(0, CHUNK)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        c = n_chunks - 1   # the last chunk first, with the end state's terms
        u_dS = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)        # u_{t−1} · dS_T (over v)
        end = tl.zeros((BLOCK_K,), dtype=tl.float32)               # exp(G_C)·Σ_v dS_T⊙S_in of the last chunk
        for v0 in range(0, V, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            U_rows, v_mask = _gdn2_chunk_rows(U_ptr, H * V, bi, c, hi, T, V, vs, CHUNK)
            U_prev = tl.load(U_rows - H * V, mask=v_mask & (rs[:, None] > 0), other=0.0).to(tl.float32)
            st_offs = ks[:, None] * V + vs[None, :]
            st_mask = (ks[:, None] < K) & (vs[None, :] < V)
            dS_T = tl.load(dsT_ptr + pid_bh.to(tl.int64) * K * V + st_offs, mask=st_mask, other=0.0)
            S_in = tl.load(_gdn2_chunk_block(S_in_ptr, bi, c, hi, H, n_chunks, ks, vs, K, V), mask=st_mask,
                           other=0.0).to(tl.float32)
            u_dS += tl.dot(U_prev, tl.trans(dS_T), input_precision="ieee")
            end += tl.sum(dS_T * S_in, axis=1)
        g, mask = _gdn2_chunk_tile(g_ptr, row_g, bi, c, hi, T, K, ks, CHUNK)
        g = g.to(tl.float32)
        end *= tl.exp(tl.sum(g, axis=0))
        later = tl.cumsum(g, axis=0, reverse=True)      # row t: G_C − G_{t−1}, the decay after token t − 1
        # token t − 1's k and u on row t (none on the chunk's first row)
        k_prev = tl.load(_gdn2_chunk_rows(k_ptr, row_k, bi, c, hi, T, K, ks, CHUNK)[0] - row_k,
                         mask=mask & (rs[:, None] > 0), other=0.0).to(tl.float32)
        ends = tl.cumsum(tl.exp(later) * k_prev * u_dS, axis=0)
        dG = _gdn2_chunk_tile(dG_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0]
        dg = tl.cumsum(dG, axis=0, reverse=True) + ends
        tl.store(_gdn2_chunk_rows(dg_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0], dg + end[None, :], mask=mask)
        after = tl.sum(dG, axis=0)             # Σ dG over the chunks after this one
        for cc in range(1, n_chunks):
            c = n_chunks - 1 - cc
            dG, mask = _gdn2_chunk_tile(dG_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)
            dg = tl.cumsum(dG, axis=0, reverse=True) + after[None, :]
            tl.store(_gdn2_chunk_rows(dg_ptr, H * K, bi, c, hi, T, K, ks, CHUNK)[0], dg + end[None, :], mask=mask)
            after += tl.sum(dG, axis=0)


def _gdn2_dot_kinds(x):
    """The chunked kernels' dot kinds (_gdn2_dot) for inputs like x. DOT, the products of stored operands: bf16 or
    fp16 as the inputs are (GPUs without bf16, sm_75, have no bf16 tensor cores); for fp32 ones TF32 where torch
    allows it for fp32 matmuls (torch.set_float32_matmul_precision("high")), else 3xTF32, near fp32's accuracy on
    tensor cores (IEEE fp32 dots run on CUDA cores with whole operand rows in registers: they spilled). SOLVE, the
    solve's products of fp32 values: for 16-bit inputs three products of operands split into that dtype's halves, 16
    or 21 bits (a 16-bit solve lost the budget in ill-conditioned chunks); for fp32 inputs DOT (bf16 halves missed
    the steep-decay dg test's 1e-5 by 2-3x)."""
    if x.dtype == torch.float32:
        dot = "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"
        return dict(DOT=dot, SOLVE=dot)
    dot = {torch.bfloat16: "bf16", torch.float16: "fp16"}[x.dtype]
    return dict(DOT=dot, SOLVE=dot + "x3")


def _gdn2_chunk_blocks(K, chunk, dot):
    """Launch parameters of the chunked kernels for dots of kind `dot` (_gdn2_dot_kinds), measured with the
    ahead-of-time compile (the AOT test: as Triton's JIT specialises them and at a shape with no integer a multiple
    of 16, under triton 3.7.1 and 3.6.0) over head sizes 32-128, value sizes to 256: at chunks 16, 32 and 64 with
    bf16 dots, at chunk 16 with fp32 (TF32) and fp16 dots (what gdn2_triton runs them at). The output and backward
    per-chunk kernels run 4 warps: with 8, Triton lays chained dots' warps all along the chunk's 64 rows, 4 of them
    computing copies, and they spilled. The state passes take a chunk in pieces of 16 rows: at a shape whose rows are
    not 16-byte aligned every element of a tile is its own load and 64-bit address, and whole [64, 64] operands
    spilled 40-560 B at value blocks of 16-64. With bf16 dots up to head size 64 they run value blocks of 32 at 4
    warps, the forward held to 160 registers (3 blocks an SM: B 16, H 11, V 64 is 352 programs, 1 wave of an H100's
    132 SMs), the reverse to MAX_REGISTERS (2 blocks, 2 waves; held to 160-168 it spilled 24-40 B). Other dots and
    head size 128 keep value blocks of 8: 8 warps held to 128 registers up to head size 64, 2 blocks an SM; at head
    size 128 to MAX_REGISTERS, 1 block; fp32 dots' up to head size 64 at 4 warps held to MAX_REGISTERS, 2 blocks
    (value blocks of 32 there spilled 8-1680 B). dg's pass takes channel blocks of 16 (704 programs) at 4 warps held
    to 168 registers, 3 blocks an SM, 2 waves, and the end state's terms over value blocks of 64 (one step at V 64;
    at blocks of 32 the pass walked 17 steps; channel blocks of 32 at 8 warps held to 128 spilled 16-24 B). The intra
    kernel, in one, held 1 block of 8 warps an SM (at 4, 184-536 B spilled: the solve and Y, U0's split-operand dots
    hold the whole chunk's [64, 64] in fp32); split in two, each runs 4 warps held to MAX_REGISTERS, 2 blocks an SM:
    the pair kernel at 141-231 registers, the solve writing Y, U0 in blocks of 16 at 80-232 (blocks of 32 spilled
    8-32 B on sm_80 and sm_89 at the general shape; 8 warps held to 128 spilled 8-32 B). The backward
    per-chunk kernel walks K in blocks of 8 at 4 warps (2 blocks an SM), fp32 dots' in blocks of 16 unpipelined
    (blocks of 8 spilled 192-248 B under triton 3.6.0, pipelined 8)."""
    block_k = max(16, triton.next_power_of_2(K))
    fp32 = dot in ("tf32", "tf32x3")
    if dot == "bf16" and block_k <= 64:
        state = dict(BLOCK_V=32, num_warps=4, maxnreg=160)
        bwd_state = dict(BLOCK_V=32, num_warps=4, maxnreg=MAX_REGISTERS)
    else:
        state = bwd_state = dict(BLOCK_V=8, **(dict(num_warps=4, maxnreg=MAX_REGISTERS) if fp32 and block_k <= 64
                                               else dict(num_warps=8, maxnreg=128 if block_k <= 64 else MAX_REGISTERS)))
    return dict(
        pair=dict(CHUNK=chunk, SUB=16, BLOCK_KP=16, BLOCK_KD=16, num_warps=4, num_stages=2, maxnreg=MAX_REGISTERS),
        solve=dict(CHUNK=chunk, SUB=16, BLOCK_KS=16, BLOCK_V=16, num_warps=4, num_stages=2, maxnreg=MAX_REGISTERS),
        state=dict(CHUNK=chunk, BLOCK_K=block_k, ROWS=16, num_stages=2, **state),
        output=dict(CHUNK=chunk, BLOCK_K=min(block_k, 32), BLOCK_V=16, num_warps=4, num_stages=2),
        bwd_state=dict(CHUNK=chunk, BLOCK_K=block_k, ROWS=16, num_stages=2, **bwd_state),
        bwd_intra=dict(CHUNK=chunk, SUB=16, BLOCK_K=16 if fp32 else 8, BLOCK_V=16, num_warps=4,
                       num_stages=1 if fp32 else 2, maxnreg=MAX_REGISTERS),
        bwd_dg=dict(CHUNK=chunk, BLOCK_K=16, BLOCK_V=64, num_warps=4, num_stages=2, maxnreg=168))


GDN2_TRITON_CHUNKS = (16, 32, 64)   # the chunk sizes the Triton kernels take (sub-chunks of 16)


def _token_rows(t):
    """t [B, T, H, D] as the kernels address it, (b·T + t)·row + h·D + d, and that row stride (_rows: t itself when
    its strides allow it, as a slice of the projection's output does)."""
    rows, row = _rows(t, t.shape[2] * t.shape[3])
    return rows.view(t.shape), row


def _gdn2_token_rows(q, k, v, g, b, w):
    """(q, k, v, g, b, w) as _token_rows leaves them and their row strides in the kernels' order (q, k, g, b, v, w)."""
    (q, row_q), (k, row_k), (v, row_v), (g, row_g), (b, row_b), (w, row_w) = map(_token_rows, (q, k, v, g, b, w))
    return (q, k, v, g, b, w), (row_q, row_k, row_g, row_b, row_v, row_w)


def _gdn2_chunk_intra(q, k, v, g, b, w, rows, scale, chunk, dots, with_ainv):
    """The intra kernels' per-chunk quantities (Ainv, Aqk, Y, U0, q_in, k_out, d), all but d in the dots' operand
    dtype: every later read of Ainv, Aqk, Y, q_in and k_out is a dot's operand (rounded there anyway), U0 is the
    corrections' start (U is stored so too); the decays d stay fp32. Ainv (None without with_ainv) only for the
    backward. L goes from the pair kernel to the solve in fp32 (its strictly lower triangle): the solve's input
    unrounded, as if one kernel did both."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, chunk)
    f32 = dict(device=q.device, dtype=torch.float32)
    operand = dict(device=q.device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(dots["DOT"],
                                                                                              torch.float32))
    Ainv = torch.empty(B, N, H, chunk, chunk, **operand) if with_ainv else None
    Aqk = torch.empty(B, N, H, chunk, chunk, **operand)
    Y, q_in, k_out = (torch.empty(B, T, H, K, **operand) for _ in range(3))
    U0, decay = torch.empty(B, T, H, V, **operand), torch.empty(B, N, H, K, **f32)
    L = torch.empty(B, N, H, chunk, chunk, **f32)
    blocks = _gdn2_chunk_blocks(K, chunk, dots["DOT"])
    row_q, row_k, row_g, row_b, row_v, row_w = rows
    _gdn2_chunk_pair_kernel[(B * N, H)](q, k, g, b, L, Aqk, q_in, k_out, decay, row_q, row_k, row_g, row_b, scale, T,
                                        H, K, N, DOT=dots["DOT"], **blocks["pair"])
    _gdn2_chunk_solve_kernel[(B * N, H)](k, g, b, v, w, L, Ainv, Y, U0, row_k, row_g, row_b, row_v, row_w, T, H, K, V,
                                         N, SOLVE=dots["SOLVE"], **blocks["solve"])
    return Ainv, Aqk, Y, U0, q_in, k_out, decay


def _gdn2_chunk_states(Y, U0, k_out, decay, initial_state, chunk, dot):
    """The state pass: each chunk's entering state S_in [B, N, H, K, V] (operand dtype), the corrections U, S_T."""
    B, T, H, K = Y.shape
    V = U0.shape[-1]
    N = triton.cdiv(T, chunk)
    state = _gdn2_chunk_blocks(K, chunk, dot)["state"]
    S_in, U = torch.empty(B, N, H, K, V, device=Y.device, dtype=Y.dtype), torch.empty_like(U0)
    S_T = torch.empty(B, H, K, V, device=Y.device, dtype=torch.float32)
    _gdn2_chunk_state_kernel[(B * H, triton.cdiv(V, state["BLOCK_V"]))](
        Y, U0, k_out, decay, S_T if initial_state is None else initial_state.contiguous(), S_T, S_in, U, T, H, K, V, N,
        HAS_INITIAL=initial_state is not None, DOT=dot, **state)
    return S_in, U, S_T


@_triton_op("specgpt::gdn2_chunked_fwd")
def _gdn2_chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                      w: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                      chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, S_T). Nothing else is kept: the backward recomputes the chunks' quantities and states."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    (q, k, v, g, b, w), rows = _gdn2_token_rows(q, k, v, g, b, w)
    dots = _gdn2_dot_kinds(q)
    _, Aqk, Y, U0, q_in, k_out, decay = _gdn2_chunk_intra(q, k, v, g, b, w, rows, scale, chunk, dots, False)
    S_in, U, S_T = _gdn2_chunk_states(Y, U0, k_out, decay, initial_state, chunk, dots["DOT"])
    N = triton.cdiv(T, chunk)
    o = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    _gdn2_chunk_output_kernel[(B * N, H)](Aqk, q_in, S_in, U, o, T, H, K, V, N, DOT=dots["DOT"],
                                          **_gdn2_chunk_blocks(K, chunk, dots["DOT"])["output"])
    return o, S_T


@_gdn2_chunked_fwd.register_fake
def _(q, k, v, g, b, w, scale, initial_state, chunk):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=torch.float32)


@_triton_op("specgpt::gdn2_chunked_bwd")
def _gdn2_chunked_bwd(do: torch.Tensor, dS_T: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, initial_state: Optional[torch.Tensor],
                      scale: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, db, dw, d initial_state), each in its input's dtype (d initial_state in fp32): the intra
    kernels and the state pass rerun, then the reverse state pass, the per-chunk backward (every gradient but dg's
    sum over the sequence) and dg's reverse cumulative sum."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    (q, k, v, g, b, w), rows = _gdn2_token_rows(q, k, v, g, b, w)
    N = triton.cdiv(T, chunk)
    dots = _gdn2_dot_kinds(q)
    blocks = _gdn2_chunk_blocks(K, chunk, dots["DOT"])
    Ainv, Aqk, Y, U0, q_in, k_out, decay = _gdn2_chunk_intra(q, k, v, g, b, w, rows, scale, chunk, dots, True)
    S_in, U, _ = _gdn2_chunk_states(Y, U0, k_out, decay, initial_state, chunk, dots["DOT"])
    (do, row_do), dS_T = _token_rows(do), dS_T.contiguous()
    dS_next, dU = torch.empty_like(S_in), torch.empty_like(U)
    ds0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    _gdn2_chunk_bwd_state_kernel[(B * H, triton.cdiv(V, blocks["bwd_state"]["BLOCK_V"]))](
        Aqk, Y, q_in, k_out, decay, do, dS_T, dS_next, dU, ds0, row_do, T, H, K, V, N, DOT=dots["DOT"],
        **blocks["bwd_state"])
    dq, dk, dv, db, dw = (torch.empty(t.shape, device=q.device, dtype=t.dtype) for t in (q, k, v, b, w))
    dG = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    _gdn2_chunk_bwd_intra_kernel[(B * N, H)](
        q, k, g, b, v, w, do, Ainv, S_in, U, dS_next, dU, torch.empty_like(Ainv), torch.empty_like(Ainv), dq, dk, dv,
        db, dw, dG, *rows, row_do, scale, T, H, K, V, N, DOT=dots["DOT"], **blocks["bwd_intra"])
    dg = torch.empty(B, T, H, K, device=q.device, dtype=g.dtype)
    _gdn2_chunk_bwd_dg_kernel[(B * H, triton.cdiv(K, blocks["bwd_dg"]["BLOCK_K"]))](
        dG, g, k, U, S_in, dS_T, dg, rows[2], rows[1], T, H, K, V, N, **blocks["bwd_dg"])
    return dq, dk, dv, dg, db, dw, ds0


@_gdn2_chunked_bwd.register_fake
def _(do, dS_T, q, k, v, g, b, w, initial_state, scale, chunk):
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, b, w)), dS_T.new_empty(dS_T.shape, dtype=torch.float32))


def _gdn2_chunked_setup(ctx, inputs, output):
    q, k, v, g, b, w, ctx.scale, initial_state, ctx.chunk = inputs
    ctx.save_for_backward(q, k, v, g, b, w, initial_state)
    ctx.has_initial = initial_state is not None


def _gdn2_chunked_backward(ctx, do, dS_T):
    *grads, ds0 = _gdn2_chunked_bwd(do, dS_T, *ctx.saved_tensors, ctx.scale, ctx.chunk)
    return *grads, None, ds0 if ctx.has_initial else None, None


_gdn2_chunked_fwd.register_autograd(_gdn2_chunked_backward, setup_context=_gdn2_chunked_setup)


# the recurrence's forward ops, whose outputs GatedDelta's selective checkpointing keeps (all else is recomputed)
GDN2_TRITON_FORWARDS = (torch.ops.specgpt.gdn2_chunked_fwd.default, torch.ops.specgpt.gdn2_recurrent_fwd.default)


def gdn2_recurrent_triton(q, k, v, g, b, w, scale=None, initial_state=None):
    _gdn2_check(q, k, v, g, b, w, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _gdn2_recurrent_fwd(q, k, v, g, b, w, scale, initial_state)[:2]


def gdn2_chunked_triton(q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=16):
    _gdn2_check(q, k, v, g, b, w, initial_state)
    if chunk_size not in GDN2_TRITON_CHUNKS:
        raise ValueError(f"gdn2: the Triton path takes chunk_size in {GDN2_TRITON_CHUNKS}, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _gdn2_chunked_fwd(q, k, v, g, b, w, scale, initial_state, chunk_size)[:2]


def gdn2_triton(q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=16):
    """Fused recurrent kernel for short sequences (decode, T ≤ 64), chunked kernels for training lengths: in chunks of
    chunk_size on bf16 inputs, of at most 16 on fp32 and fp16 ones. The chunk changes only the rounding; at 32 and 64
    the kernels spilled registers with TF32 operands (4 times bf16's registers) and on sm_75 (fp16), whose dots
    Triton compiles to FMAs that hold each operand's whole contraction in registers (_gdn2_chunk_blocks)."""
    if q.shape[1] <= 64:
        return gdn2_recurrent_triton(q, k, v, g, b, w, scale, initial_state)
    chunk = chunk_size if q.dtype == torch.bfloat16 else min(chunk_size, 16)
    return gdn2_chunked_triton(q, k, v, g, b, w, scale, initial_state, chunk)


def gdn2_uses_triton(x, kernels="auto"):
    """Whether gdn2 takes its Triton path for inputs on x's device (GatedDelta recomputes around it, see there)."""
    return _path("gdn2", kernels, x) == "triton"


def gdn2(q, k, v, g, b, w, scale=None, initial_state=None, chunk_size=16, kernels="auto"):
    path = _path("gdn2", kernels, q)
    if path == "triton":
        return gdn2_triton(q, k, v, g, b, w, scale, initial_state, chunk_size)
    if path == "ref":
        return gdn2_ref(q, k, v, g, b, w, scale, initial_state)
    return gdn2_torch(q, k, v, g, b, w, scale, initial_state, chunk_size)


def _gdn2_example(dtype, d, fn=None):   # fn None: the recurrent kernels and the chunked ones (in chunks of 16)
    B, T, H, K, V = d.B, d.T, d.H, d.K, d.V
    return lambda: [_backward(fn(_leaf(B, T, H, K, dtype=dtype), _leaf(B, T, H, K, dtype=dtype),
                                 _leaf(B, T, H, V, dtype=dtype), _leaf(B, T, H, K), _leaf(B, T, H, K, dtype=dtype),
                                 _leaf(B, T, H, V, dtype=dtype), None, _leaf(B, H, K, V)))
                    for fn in ((gdn2_recurrent_triton, gdn2_chunked_triton) if fn is None else (fn,))]


def _gdn2_opcheck(randn):
    # 17 tokens: two chunks of 16 in the chunked kernels, the second ragged, or one ragged chunk of 32
    B, T, H, K, V = 1, 17, 1, 4, 5
    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    gdn2_in = (q, k, randn(B, T, H, V), -randn(B, T, H, K).abs() / 2, randn(B, T, H, K).sigmoid(),
               randn(B, T, H, V).sigmoid())
    cases = []
    for s0, chunk in ((None, 16), (randn(B, H, K, V), 32)):
        named, full = ("", False) if s0 is None else (" initial_state", True)
        u = _gdn2_recurrent_fwd(*gdn2_in, 0.5, s0)[2]
        d_out = (randn(B, T, H, V), randn(B, H, K, V))
        cases += [("gdn2_recurrent" + named, _gdn2_recurrent_fwd, (*map(_requiring_grad, gdn2_in), 0.5,
                                                                   _requiring_grad(s0)), full),
                  ("gdn2_recurrent_bwd" + named, _gdn2_recurrent_bwd, (*d_out, *gdn2_in, u, 0.5, s0), False),
                  (f"gdn2_chunked{named} chunk={chunk}", _gdn2_chunked_fwd,
                   (*map(_requiring_grad, gdn2_in), 0.5, _requiring_grad(s0), chunk), full),
                  (f"gdn2_chunked_bwd{named} chunk={chunk}", _gdn2_chunked_bwd, (*d_out, *gdn2_in, s0, 0.5, chunk),
                   False)]
    return cases


def _gdn2_compare(randn):   # 37 tokens: the recurrent kernels (the chunked ones have tests of their own)
    B, T, H, K, V = 2, 37, 3, 20, 12
    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    return lambda fn, **kw: fn(**kw), dict(q=q, k=k, v=randn(B, T, H, V), g=-randn(B, T, H, K).abs() / 2,
                                           b=randn(B, T, H, K).sigmoid(), w=randn(B, T, H, V).sigmoid(),
                                           initial_state=randn(B, H, K, V))


OPS["gdn2"] = Op(gdn2_ref, gdn2_torch, gdn2_triton, _gdn2_example, _gdn2_opcheck, _gdn2_compare)


# -----------------------------------------------------------------------------
# ssd (Mamba2, ngroups = 1), state h ∈ R^{P×N} per head:
#   h_t = exp(dt_t A) h_{t−1} + dt_t x_t B_tᵀ,   y_t = h_t C_t + D x_t
# x [b,l,h,p], dt [b,l,h], A [h], B, C [b,l,1,n], D [h] or None, h [b,h,p,n]. fp32 inside;
# y comes back in x's dtype, h_T in fp32. zoh_input_scale converts Euler's dt·B into ZOH's B̄.

def zoh_input_scale(dt, A):
    """expm1(dt·A)/(dt·A): multiply x by this to turn ssd's dt·x·Bᵀ into ZOH's (exp(dt A) − 1)/A · x·Bᵀ."""
    z = dt.float() * A.float()
    small = z.abs() < 1e-3
    z_safe = torch.where(small, -1.0, z)                        # keeps the unused branch finite (and its gradient)
    return torch.where(small, 1 + z / 2 + z * z / 6, torch.expm1(z_safe) / z_safe)


def _ssd_check(x, dt, A, B, C, D, initial_state):
    b, l, h, p = x.shape
    if dt.shape != (b, l, h) or A.shape != (h,):
        raise ValueError(f"ssd: dt must be [b,l,h] = {(b, l, h)} and A [h], got {tuple(dt.shape)}, {tuple(A.shape)}")
    if B.ndim != 4 or B.shape[:3] != (b, l, 1) or C.shape != B.shape:
        raise ValueError(f"ssd: B and C must be [b,l,1,n] (ngroups = 1), got {tuple(B.shape)}, {tuple(C.shape)}; "
                         "use B.unsqueeze(2)")
    if D is not None and D.shape != (h,):
        raise ValueError(f"ssd: D must be [h] = ({h},) or None, got {tuple(D.shape)}")
    if initial_state is not None and initial_state.shape != (b, h, p, B.shape[-1]):
        raise ValueError(f"ssd: initial_state must be [b,h,p,n] = {(b, h, p, B.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")


@_fp32
def ssd_ref(x, dt, A, B, C, D=None, initial_state=None):
    _ssd_check(x, dt, A, B, C, D, initial_state)
    b, l, h, p = x.shape
    dtype = _fp32_or_wider(x.dtype)
    xf, dtf, Af, Bf, Cf = (t.to(dtype) for t in (x, dt, A, B[:, :, 0], C[:, :, 0]))
    hs = x.new_zeros(b, h, p, B.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    ys = []
    for t in range(l):
        decay = torch.exp(dtf[:, t] * Af)[..., None, None]                           # [b,h,1,1]
        write = (dtf[:, t, :, None] * xf[:, t])[..., None] * Bf[:, t, None, None, :]  # dt_t x_t B_tᵀ
        hs = decay * hs + write
        ys.append(torch.einsum("bhpn,bn->bhp", hs, Cf[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + D.to(dtype)[:, None] * xf
    return y.to(x.dtype), hs


@_fp32
def ssd_chunked_ref(x, dt, A, B, C, D=None, chunk_size=64, initial_state=None):
    """ssd_ref's recurrence in chunks of Q tokens, the state space duality of Mamba2 (Dao & Gu, 2024) that the fast
    paths compute, plain torch with autograd's backward. With a_r = Σ_{i≤r} dt_i A from the chunk's start, X_s =
    dt_s x_s and exp(a_r − a_s) summed over the segment s < i ≤ r (_segsum), four steps:
      1. the diagonal blocks, attention within a chunk:  y_r = Σ_{s≤r} (C_r·B_s) exp(a_r − a_s) X_s
      2. the chunk states, each chunk's own end state:    H_z = Σ_s exp(a_Q − a_s) X_s B_sᵀ
      3. the state passing between chunks:               h_z = exp(a_Q) h_{z−1} + H_z from h_0 = initial_state
      4. the states' read-out:                           y_r += exp(a_r) h_{z−1} C_r
    The tail is padded with dt = 0 and zero inputs, which leaves the state unchanged."""
    _ssd_check(x, dt, A, B, C, D, initial_state)
    if chunk_size < 1:
        raise ValueError(f"ssd_chunked_ref: chunk_size must be a positive integer, got {chunk_size}")
    b, l, h, p = x.shape
    Q, N = chunk_size, -(-l // chunk_size)
    out_dtype, dtype = x.dtype, _fp32_or_wider(x.dtype)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B[:, :, 0], C[:, :, 0]))

    def chunks(t):  # [b,l,...] -> [b,N,Q,...], the tail padded with zeros
        return F.pad(t, (0, 0) * (t.ndim - 2) + (0, N * Q - l)).unflatten(1, (N, Q))

    X, Bc, Cc = chunks(x * dt[..., None]), chunks(B), chunks(C)          # [b,N,Q,h,p], [b,N,Q,n]
    dtA = chunks(dt * A).permute(0, 3, 1, 2)                            # [b,h,N,Q]
    a = dtA.cumsum(-1)                                                  # a_r, from the chunk's start
    decay = _segsum(dtA).exp()                                          # [b,h,N,Q,Q]: exp(a_r − a_s), s ≤ r
    y = torch.einsum("bzrn,bzsn,bhzrs,bzshp->bzrhp", Cc, Bc, decay, X)                      # 1.
    chunk_states = torch.einsum("bhzs,bzshp,bzsn->bzhpn", decay[..., -1, :], X, Bc)         # 2.
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    entering = []
    for z in range(N):                                                                      # 3.
        entering.append(state)
        state = a[:, :, z, -1, None, None].exp() * state + chunk_states[:, z]
    y = y + torch.einsum("bzrn,bzhpn,bhzr->bzrhp", Cc, torch.stack(entering, 1), a.exp())   # 4.
    y = y.flatten(1, 2)[:, :l]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    return y.to(out_dtype), state


def _ssd_chunks(X, dtA, B, C, initial_state):
    """The chunked scan on the layout [b, N, h, Cs, ·]: X = dt⊙x [b,N,h,Cs,p], dtA [b,N,h,Cs], B, C [b,N,Cs,n].
    Returns y, the final state and what the backward reuses. In-place ops only on its own intermediates: double
    backward reruns it under autograd."""
    b, N, h, Cs, p = X.shape
    a64 = dtA.double().cumsum(-1)                                # fp64: see ssd_torch
    a = a64.float()
    a_low = (a64 - a.double()).float()                           # a64 = a + a_low to fp64's precision
    causal = torch.ones(Cs, Cs, device=X.device).tril()
    # exp(a_r − a_s) for s ≤ r; the fp32 difference of a is correctly rounded and a_low adds back what rounding a
    # dropped, so small exponents keep their digits however large a grows. Above the diagonal the exponent is
    # set to 0 (never exp of a large one) and C Bᵀ is masked instead, at an eighth of the size
    L = (a[..., :, None] - a[..., None, :]).add_(a_low[..., :, None]).sub_(a_low[..., None, :]).mul_(causal).exp_()
    W = ((C @ B.transpose(-1, -2)) * causal).unsqueeze(2) * L    # (C Bᵀ) ⊙ L, C Bᵀ shared by the heads
    y = W @ X
    chunk_states = torch.einsum("bzhcp,bzcn->bzhpn", X * L[..., -1, :, None], B)   # Xᵀ diag(ℓ) B
    chunk_decay = a[..., -1].exp()                               # [b,N,h]
    S, entering = initial_state, []
    for decay_z, state_z in zip(chunk_decay.unbind(1), chunk_states.unbind(1)):   # unbind: see gdn2_torch
        entering.append(S)
        S = state_z if S is None else decay_z[..., None, None] * S + state_z
    first = 0 if initial_state is not None else 1               # a zero entering state reads nothing
    S_in = torch.stack(entering[first:], 1) if N > first else None
    if S_in is not None:
        read = torch.einsum("bzcn,bzhpn->bzhcp", C[:, first:], S_in) * a[:, first:].exp()[..., None]
        y = torch.cat([y[:, :first], y[:, first:] + read], 1)
    return y, S, (a, L, W, S_in, chunk_decay, first)


class _SSDChunks(torch.autograd.Function):
    """_ssd_chunks with its backward written out. Per chunk, with entering state S:
        y = W X + e^a ⊙ (C Sᵀ),   S' = e^{a_C} S + Xᵀ diag(ℓ) B,   ℓ_s = L_{Cs,s} = exp(a_C − a_s).
    With G = ∂/∂S' (dS_T for the last chunk, then chunk by chunk backwards):
        ∂S = e^{a_C} G + (e^a⊙dy)ᵀ C,   ∂X = Wᵀ dy + ℓ⊙(B Gᵀ),   dW = dy Xᵀ,
        ∂C = (Σ_h dW⊙L) B + Σ_h e^a⊙(dy S),   ∂B = (Σ_h dW⊙L)ᵀ C + Σ_h (ℓ⊙X) G,
        ∂(dt A)_i = Σ_{r≥i} Σ_{s<i} (dW⊙W)_rs + Σ_{r≥i} ∂a_r (the reads', ℓ's and e^{a_C}'s direct
    terms): the first sum runs over the pairs whose segment a_r − a_s contains i, so nothing cancels there.
    Under create_graph (Hessian-vector products) the backward differentiates _ssd_chunks' ops instead."""

    @staticmethod
    def forward(ctx, X, dtA, B, C, initial_state):
        y, S, (a, L, W, S_in, chunk_decay, first) = _ssd_chunks(X, dtA, B, C, initial_state)
        ctx.save_for_backward(X, dtA, B, C, initial_state, a, L, W, S_in, chunk_decay)
        ctx.first = first
        ctx.set_materialize_grads(False)                         # dS_T stays None when the final state is unused
        return y, S

    @staticmethod
    def backward(ctx, dy, dS_T):
        X, dtA, B, C, initial_state, a, L, W, S_in, chunk_decay = ctx.saved_tensors
        if torch.is_grad_enabled():                              # double backward: differentiate the forward's ops
            scan = lambda *inputs: _ssd_chunks(*inputs)[:2]
            return _double_backward(scan, (X, dtA, B, C, initial_state), (dy, dS_T))
        first, N = ctx.first, X.shape[1]
        dy = torch.zeros_like(X) if dy is None else dy.contiguous()
        dy_e = dy * a.exp()[..., None]
        # G_z = ∂/∂(state after chunk z), last chunk first; None where it is zero (the final state unused)
        from_reads = torch.einsum("bzhcp,bzcn->bzhpn", dy_e[:, first:], C[:, first:]) if N > first else None
        G, Gs = dS_T, []
        for z in range(N - 1, -1, -1):
            Gs.append(G)
            if z >= first:                                       # the state entering chunk z is read
                G = from_reads[:, z - first] + (0 if G is None else chunk_decay[:, z, :, None, None] * G)
        d_initial = G if first == 0 else None
        dW = dy @ X.transpose(-1, -2)
        dX = W.transpose(-1, -2) @ dy
        dCB = (dW * L).sum(2).tril_()                            # L is 1 above the diagonal
        d_seg = dW.mul_(W)                                       # ∂/∂(a_r − a_s), zero above the diagonal
        dC, dB = dCB @ B, dCB.transpose(-1, -2) @ C
        d_a = torch.zeros_like(a)
        if any(G is not None for G in Gs):
            Gs = torch.stack([torch.zeros_like(from_reads[:, 0]) if G is None else G for G in Gs[::-1]], 1)
            ell = L[..., -1, :]
            BG = torch.einsum("bzcn,bzhpn->bzhcp", B, Gs)        # B Gᵀ, per head
            dX += BG * ell[..., None]
            d_seg[..., -1, :] += (BG * X).sum(-1) * ell          # ℓ_s = exp(a_C − a_s) is the last row's pair
            dB += torch.einsum("bzhcp,bzhpn->bzcn", X * ell[..., None], Gs)
            if S_in is not None:
                d_a[:, first:, :, -1] = (S_in * Gs[:, first:]).sum((-1, -2)) * chunk_decay[:, first:]
        if S_in is not None:
            dC[:, first:] += torch.einsum("bzhcp,bzhpn->bzcn", dy_e[:, first:], S_in)
            d_a[:, first:] += (dy_e[:, first:] * torch.einsum("bzcn,bzhpn->bzhcp", C[:, first:], S_in)).sum(-1)
        pairs = d_seg.cumsum(-1).tril_(-1).sum(-2)               # [.., j] = Σ_{r>j} Σ_{s≤j} d_seg[r, s]
        d_dtA = F.pad(pairs[..., :-1], (1, 0)) + d_a.flip(-1).cumsum(-1).flip(-1)
        return dX, d_dtA, dB, dC, d_initial


@_fp32
def ssd_torch(x, dt, A, B, C, D=None, chunk_size=64, initial_state=None):
    """Chunked SSD. Within a chunk, with a_r = Σ_{i≤r} dt_i A (cumulative log-decay from the chunk start):
    y_r = Σ_{s≤r} (C_r·B_s) exp(a_r − a_s) dt_s x_s + exp(a_r) h_0 C_r, and the chunk's own contribution to
    its end state is Σ_s exp(a_C − a_s) dt_s x_s B_sᵀ; states are passed between chunks in a short loop.
    Every exponent is a within-chunk difference masked to s ≤ r, so it is ≤ 0. a is summed in fp64 and kept as
    an fp32 value plus its fp32 rounding remainder: with a decay of −1000 in one step a reaches the thousands,
    where a difference of fp32-rounded sums would lose the small exponents' digits. The backward is written out
    (_SSDChunks). The tail is padded with dt = 0 and zero inputs, which leaves the state unchanged."""
    _ssd_check(x, dt, A, B, C, D, initial_state)
    b, l, h, p = x.shape
    n = B.shape[-1]
    if chunk_size < 1:
        raise ValueError(f"ssd: chunk_size must be a positive integer, got {chunk_size}")
    Cs = min(chunk_size, max(l, 1))                              # short inputs (decoding) get a short chunk
    N = -(-l // Cs)
    pad = N * Cs - l
    # per-head products in the contiguous layout [b, N, h, Cs, ·]: CPU batched matmuls copy strided operands
    xf = F.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(b, N, Cs, h, p)
    dtf = F.pad(dt.float(), (0, 0, 0, pad)).view(b, N, Cs, h)
    X = (xf * dtf[..., None]).transpose(2, 3).contiguous()
    dtA = (dtf * A.float()).transpose(-1, -2).contiguous()
    Bf = F.pad(B.float()[:, :, 0], (0, 0, 0, pad)).view(b, N, Cs, n)
    Cf = F.pad(C.float()[:, :, 0], (0, 0, 0, pad)).view(b, N, Cs, n)
    y, h_T = _SSDChunks.apply(X, dtA, Bf, Cf, None if initial_state is None else initial_state.float())
    y = y.transpose(2, 3).reshape(b, N * Cs, h, p)[:, :l]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), h_T


# ssd in Triton

# ssd in Triton: the chunked scan of the Mamba-2 paper (Dao & Gu 2024) in mamba_ssm's decomposition, with chunks of up
# to 256 tokens whose edges alone store a state, each chunk walked in blocks of up to 32 tokens. Per head, dt_i A is
# token i's step of log-decay and h_in[c] the state entering chunk c. With CB_rs = C_r·B_s, formed once per chunk
# for all heads (the Mamba-2 paper's single group of B and C), token r of block k reads
#   y_r = Σ_{s≤r in the chunk} CB_rs L_rs dt_s x_s + exp(a_r) C_r h_in + D x_r,     L_rs = exp(Σ_{s<i≤r} dt_i A)
# with a_r the decay from the chunk's start through r. Every exponent is a sum of steps, never a difference of
# cumulative sums (which next to a decay of −1000 would lose the small exponents' digits): for s in block j < k,
# L_rs = exp(u_r)·exp(between)·exp(e_s), with u_r = Σ_{k_0≤i≤r} dt_i A (from k's start through r), e_s = Σ_{s<i≤j_end}
# dt_i A (after s to j's end) and between the whole blocks' sums T in between; within a block, L's steps are summed.
# Forward:
#   1 state pass   sequential over 64-token blocks of every chunk: h_in[c] is stored at each chunk's start, then
#                  h ← exp(T) h + Σ_s exp(e_s) dt_s x_sᵀ B_s
#   2 CB           per (chunk, pair of blocks j ≥ k): C_j B_kᵀ, fp32
#   3 chunk scan   per (chunk, head, block of p): y of each block k, walking the chunk's blocks j ≤ k
# The forward keeps nothing but its inputs: the backward reruns kernels 1 and 2 (h_in is p·n numbers per chunk and
# head, a quarter of x's at p = 32, n = 64, chunk 256), then
#   4 reverse state pass: dS_next[c] = ds, the gradient of chunk c's end state, is stored at each chunk's end, then
#                  ds ← exp(T) ds + Σ_r exp(u_r) dy_rᵀ C_r
#   5 dx           per (chunk, head, block of p), the transpose of kernel 3, walking the chunk's blocks k twice
#                  (what each block reads, then what it writes): dx, and the terms of ddt that read x and dy of k
#   6 dCB          per (chunk, group of heads): per pair of blocks j ≥ k, dCB_rs = Σ_heads dt_s L_rs dy_r·x_s; per
#                  block and block of n, the state terms of dC and dB
#   7 dB, dC       per (chunk, block, block of n): dC = dCB B + its state term, dB = dCBᵀ C + its state term
#   8 ddt          per (chunk, head): the terms of ∂L/∂(dt_i A) that cross whole blocks, added to kernel 5's
# ∂L/∂(dt_i A) is the sum of the pair weights over the pairs (s, r) with s < i ≤ r, h_in as a token before the chunk
# and dS_next one after it. It is gathered term by term, so that nothing cancels: kernel 5 sums the pairs with an end
# in i's block (its own pairs; the reads of everything before the block from i on; the writes of the block before i
# into everything after it), kernel 8 those passing over the whole block: h_in into dS_next, the blocks before into
# dS_next, h_in into the blocks after, and the pairs between a block before and one after (kernel 5's pair sums).
# Dots take their operands in the inputs' dtype and accumulate in fp32: bf16 inputs (x, B, C, dy) go in as loaded
# and the fp32 factors that meet them (decays, dt, CB) are rounded to bf16 there; fp32 inputs take IEEE or TF32
# dots (_dot_precision). Decays, CB, dCB, the final state and every accumulator stay fp32; the passed states h_in
# and the backward's dS_next are stored in the inputs' dtype (_ssd_passed_dtype, as mamba_ssm keeps them). Every
# grid puts batch × chunks (× blocks × heads) on axis 0 (up to 2³¹ − 1 programs), and only small counts on axis 1.
# x, dt, B, C and dy are read where they lie, each token's row at its own stride (_ssd_rows: the model's are column
# slices of in_proj's output); what the kernels write is contiguous.
if HAS_TRITON:
    @triton.jit
    def _ssd_block_tokens(c, k, l, Cs, BLOCK_C: tl.constexpr):
        # block k of chunk c: its rows, their positions, which of them are in the chunk and the sequence, and the
        # position of the block's last token
        rs = tl.arange(0, BLOCK_C)
        pos = c * Cs + k * BLOCK_C + rs
        return rs, pos, (k * BLOCK_C + rs < Cs) & (pos < l), c * Cs + tl.minimum(k * BLOCK_C + BLOCK_C, Cs) - 1

    @triton.jit
    def _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last):
        # a block's dt and its log-decays, each a sum of steps dt_i A: u_r through r from the block's start, e_s
        # after s to the block's end (a reversed cumulative sum of dt_{s+1} A), and T the whole block's
        dt = tl.load(dt_ptr + (bi * l + pos).to(tl.int64) * stride_dt + hi, mask=valid, other=0.0).to(tl.float32)
        dt_next = tl.load(dt_ptr + (bi * l + pos + 1).to(tl.int64) * stride_dt + hi, mask=(pos < last) & (pos + 1 < l),
                          other=0.0).to(tl.float32)
        steps = dt * A
        return dt, tl.cumsum(steps, axis=0), tl.cumsum(dt_next * A, axis=0, reverse=True), tl.sum(steps, axis=0)

    @triton.jit
    def _ssd_pair_decays(dt, A, rs):
        # L_rs = exp(Σ_{s<i≤r} dt_i A) for s ≤ r within a block, 0 elsewhere: the steps in between summed
        steps = tl.where(rs[:, None] > rs[None, :], (dt * A)[:, None], 0.0)           # [i, s]: dt_i A where i > s
        return tl.exp(tl.where(rs[:, None] >= rs[None, :], tl.cumsum(steps, axis=0), -float("inf")))

    @triton.jit
    def _ssd_steps_between(dt_ptr, stride_dt, A, bi, l, hi, c, Cs, lo, hi_tok, BLOCK_CS: tl.constexpr):
        # Σ dt_i A over chunk c's tokens lo ≤ i < hi_tok (counted from the chunk's start), a sum of whole blocks' steps
        ts = tl.arange(0, BLOCK_CS)
        pos = c * Cs + ts
        dt = tl.load(dt_ptr + (bi * l + pos).to(tl.int64) * stride_dt + hi, mask=(ts >= lo) & (ts < hi_tok) & (pos < l),
                     other=0.0)
        return tl.sum(dt.to(tl.float32) * A, axis=0)

    @triton.jit
    def _ssd_chunk_outer(x_ptr, stride_x, y_ptr, stride_y, scale, bi, hi, l, p, n, pos, valid, ps, ns,
                         DOT: tl.constexpr):
        # Σ_s scale_s x_sᵀ y_s over the tokens pos, a [BLOCK_P, BLOCK_N] block in fp32: x [b,l,h,p] and y [b,l,1,n]
        # (rows of a token at their token strides); x goes into the dot as loaded, scale·y is rounded to x's dtype
        xT = tl.load(x_ptr + (bi * l + pos[None, :]).to(tl.int64) * stride_x + hi * p + ps[:, None],
                     mask=valid[None, :] & (ps[:, None] < p), other=0.0)                        # [BLOCK_P, BLOCK_C]
        y = tl.load(y_ptr + (bi * l + pos[:, None]).to(tl.int64) * stride_y + ns[None, :],
                    mask=valid[:, None] & (ns[None, :] < n), other=0.0).to(tl.float32)          # [BLOCK_C, BLOCK_N]
        return tl.dot(xT, (y * scale[:, None]).to(xT.dtype), input_precision=DOT)

    @triton.jit
    def _ssd_state_block(pid_bh, pid_pn, h, p, n, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        # a state pass's program: (batch, head) and, numbered pid_pn, a [BLOCK_P, BLOCK_N] block of the p × n state;
        # its batch, head, rows, columns, and offsets and mask in one [p, n] state
        n_nb = tl.cdiv(n, BLOCK_N)
        ps = (pid_pn // n_nb) * BLOCK_P + tl.arange(0, BLOCK_P)
        ns = (pid_pn % n_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
        return pid_bh // h, pid_bh % h, ps, ns, ps[:, None] * n + ns[None, :], (ps[:, None] < p) & (ns[None, :] < n)

    @triton.jit
    def _ssd_state_pass_kernel(x_ptr, B_ptr, dt_ptr, A_ptr, h0_ptr, h_in_ptr, hT_ptr, l, h, p, n, n_chunks, Cs,
                               stride_x, stride_B, stride_dt, HAS_INITIAL: tl.constexpr, BLOCK_P: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # kernel 1, sequential over the blocks of every chunk for a [BLOCK_P, BLOCK_N] block of the state, carried in
        # fp32: at a chunk's start h_in[c] is stored in h_in's dtype; each block k does
        # h ← exp(T_k) h + Σ_s exp(e_s) dt_s x_sᵀ B_s. One program per (batch·head, block of p × block of n)
        pid_bh, pid_pn = tl.program_id(0), tl.program_id(1)
        bi, hi, ps, ns, st_offs, st_mask = _ssd_state_block(pid_bh, pid_pn, h, p, n, BLOCK_P, BLOCK_N)
        A = tl.load(A_ptr + hi).to(tl.float32)
        hs = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        if HAS_INITIAL:
            hs = tl.load(h0_ptr + pid_bh.to(tl.int64) * p * n + st_offs, mask=st_mask, other=0.0).to(tl.float32)
        n_blocks = tl.cdiv(Cs, BLOCK_C)
        for i in range(n_chunks * n_blocks):
            c, k = i // n_blocks, i % n_blocks
            if k == 0:
                tl.store(h_in_ptr + ((bi * n_chunks + c) * h + hi).to(tl.int64) * p * n + st_offs,
                         hs.to(h_in_ptr.dtype.element_ty), mask=st_mask)
            _, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
            dt, _, e, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
            hs = tl.exp(T) * hs + _ssd_chunk_outer(x_ptr, stride_x, B_ptr, stride_B, tl.exp(e) * dt, bi, hi, l, p, n,
                                                   pos, valid, ps, ns, DOT)
        tl.store(hT_ptr + pid_bh.to(tl.int64) * p * n + st_offs, hs, mask=st_mask)

    @triton.jit
    def _ssd_block_pair(t):
        # the t-th pair (j, k), k ≤ j, of a chunk's blocks, row by row: t = j(j+1)/2 + k (the square root is exact
        # for the few pairs of a chunk; the guards make it so for any)
        j = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        j = tl.where(j * (j + 1) // 2 > t, j - 1, j)
        j = tl.where((j + 1) * (j + 2) // 2 <= t, j + 1, j)
        return j, t - j * (j + 1) // 2

    @triton.jit
    def _ssd_pair_tile(ptr, pid, j, k, rs, BLOCK_C: tl.constexpr, n_blocks):
        # the [BLOCK_C, BLOCK_C] tile (rows of block j, columns of block k) of the pid-th in a stack of fp32 [Cs, Cs]
        # chunk matrices (CB, dCB), Cs rounded up to n_blocks whole blocks; 32-bit offsets within the matrix (64-bit
        # ones take twice the registers a pointer)
        side = n_blocks * BLOCK_C
        return ptr + pid.to(tl.int64) * side * side + ((j * BLOCK_C + rs[:, None]) * side + k * BLOCK_C + rs[None, :])

    @triton.jit
    def _ssd_rows_tile(ptr, stride, first, rs, cols):
        # the tile [rows first + rs, columns cols] of a tensor of token rows `stride` apart, 32-bit offsets from the
        # row `first`
        return ptr + first.to(tl.int64) * stride + (rs[:, None] * stride + cols[None, :])

    @triton.jit
    def _ssd_cb_kernel(B_ptr, C_ptr, CB_ptr, l, n, n_chunks, Cs, stride_B, stride_C, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # kernel 2: CB[r, s] = C_r·B_s for r in block j and s in block k ≤ j of a chunk, in fp32 (0 past the
        # sequence). One program per (batch·chunk, pair of blocks); the pairs above the diagonal are never read
        pid_bc = tl.program_id(0)
        j, k = _ssd_block_pair(tl.program_id(1))
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        rs, pos_j, valid_j, _ = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
        _, pos_k, valid_k, _ = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
        CB = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            Cj = tl.load(_ssd_rows_tile(C_ptr, stride_C, bi * l + c * Cs + j * BLOCK_C, rs, ns),
                         mask=valid_j[:, None] & (ns[None, :] < n), other=0.0)
            Bk = tl.load(_ssd_rows_tile(B_ptr, stride_B, bi * l + c * Cs + k * BLOCK_C, rs, ns),
                         mask=valid_k[:, None] & (ns[None, :] < n), other=0.0)
            CB += tl.dot(Cj, tl.trans(Bk).to(Cj.dtype), input_precision=DOT)
        tl.store(_ssd_pair_tile(CB_ptr, pid_bc, j, k, rs, BLOCK_C, tl.cdiv(Cs, BLOCK_C)), CB)

    @triton.jit
    def _ssd_chunk_of_head(pid, pid_p, h, n_chunks, BLOCK_P: tl.constexpr):
        # a per-chunk program (kernels 3 and 5): (batch·chunk·head, block of p) → its batch, chunk, head, batch·chunk,
        # and p's indices
        hi, pid_bc = pid % h, pid // h
        return pid_bc // n_chunks, pid_bc % n_chunks, hi, pid_bc, pid_p * BLOCK_P + tl.arange(0, BLOCK_P)

    @triton.jit
    def _ssd_from_block(x_ptr, stride_x, dt_ptr, stride_dt, CB_ptr, A, bi, c, hi, l, p, Cs, pid_bc, k, j, between,
                        rs, ps, BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # what block j < k writes into block k's rows r, short of their exp(u_r): Σ_{s in j} CB_rs exp(e_s + between)
        # dt_s x_s [BLOCK_C, BLOCK_P], between the steps of the blocks between j and k; and block j's T
        _, pos, valid, last = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
        dt, _, e, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
        x = tl.load(_ssd_rows_tile(x_ptr, stride_x, bi * l + c * Cs, j * BLOCK_C + rs, hi * p + ps),
                    mask=valid[:, None] & (ps[None, :] < p), other=0.0)
        CB = tl.load(_ssd_pair_tile(CB_ptr, pid_bc, k, j, rs, BLOCK_C, tl.cdiv(Cs, BLOCK_C)))
        return tl.dot((CB * (tl.exp(e + between) * dt)[None, :]).to(x.dtype), x, input_precision=DOT), T

    @triton.jit
    def _ssd_into_block(dy_ptr, stride_dy, dt_ptr, stride_dt, CB_ptr, A, bi, c, hi, l, p, Cs, pid_bc, k, j, between,
                        rs, ps, BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # the transpose: what block j > k reads of block k's columns s, short of their exp(e_s): Σ_{r in j} CB_rs
        # exp(between + u_r) dy_r [BLOCK_C, BLOCK_P], between the steps of the blocks between k and j; and j's T
        _, pos, valid, last = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
        _, u, _, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
        dy = tl.load(_ssd_rows_tile(dy_ptr, stride_dy, bi * l + c * Cs, j * BLOCK_C + rs, hi * p + ps),
                     mask=valid[:, None] & (ps[None, :] < p), other=0.0)
        CB = tl.load(_ssd_pair_tile(CB_ptr, pid_bc, j, k, rs, BLOCK_C, tl.cdiv(Cs, BLOCK_C)))
        return tl.dot(tl.trans(CB * tl.exp(between + u)[:, None]).to(dy.dtype), dy, input_precision=DOT), T

    @triton.jit
    def _ssd_state_rows(rows_ptr, stride_rows, state_ptr, first, rs, valid, ps, p, n, BLOCK_C: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
        # rows · stateᵀ [BLOCK_C, BLOCK_P] in fp32, over n: C_r h_inᵀ (or B_s dS_nextᵀ) for a block's tokens from
        # the row `first`, rows [b,l,1,n] at their token stride and the state [p, n] in the inputs' dtype
        acc = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            rows = tl.load(_ssd_rows_tile(rows_ptr, stride_rows, first, rs, ns),
                           mask=valid[:, None] & (ns[None, :] < n), other=0.0)
            state = tl.load(state_ptr + ps[:, None] * n + ns[None, :], mask=(ps[:, None] < p) & (ns[None, :] < n),
                            other=0.0)
            acc += tl.dot(rows, tl.trans(state).to(rows.dtype), input_precision=DOT)
        return acc

    @triton.jit
    def _ssd_chunk_scan_kernel(x_ptr, dt_ptr, A_ptr, C_ptr, CB_ptr, h_in_ptr, D_ptr, y_ptr, l, h, p, n, n_chunks, Cs,
                               stride_x, stride_dt, stride_C, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # kernel 3: y = exp(u)⊙(Σ_{j<k} what block j writes + exp(T_0 + … + T_{k−1}) C h_inᵀ) + (CB⊙L⊙dt) x + D x for
        # each block k of a chunk, the earlier blocks nearest first; one program per (batch·chunk·head, block of p)
        # walks the chunk's blocks, its tiles' offsets counted from the chunk's first row (as kernel 5's). x and C go
        # into the dots as loaded; CB times the decays and dt, and h_in, in x's dtype
        bi, c, hi, pid_bc, ps = _ssd_chunk_of_head(tl.program_id(0), tl.program_id(1), h, n_chunks, BLOCK_P)
        A = tl.load(A_ptr + hi).to(tl.float32)
        h_in = h_in_ptr + ((bi * n_chunks + c) * h + hi).to(tl.int64) * p * n
        first = bi * l + c * Cs                                         # the chunk's first row
        for k in range(tl.cdiv(Cs, BLOCK_C)):
            rs, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
            dt, u, _, _ = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
            rows = k * BLOCK_C + rs                                     # in the chunk
            x_mask = valid[:, None] & (ps[None, :] < p)
            y = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
            before = 0.0                                                # Σ T over the blocks between j and k
            for i in range(k):
                written, T = _ssd_from_block(x_ptr, stride_x, dt_ptr, stride_dt, CB_ptr, A, bi, c, hi, l, p, Cs,
                                             pid_bc, k, k - 1 - i, before, rs, ps, BLOCK_C, DOT)
                y += written
                before += T
            y += tl.exp(before) * _ssd_state_rows(C_ptr, stride_C, h_in, first, rows, valid, ps, p, n, BLOCK_C,
                                                  BLOCK_P, BLOCK_N, DOT)
            y *= tl.exp(u)[:, None]
            x = tl.load(_ssd_rows_tile(x_ptr, stride_x, first, rows, hi * p + ps), mask=x_mask, other=0.0)
            CB = tl.load(_ssd_pair_tile(CB_ptr, pid_bc, k, k, rs, BLOCK_C, tl.cdiv(Cs, BLOCK_C)))
            y += tl.dot((CB * _ssd_pair_decays(dt, A, rs) * dt[None, :]).to(x.dtype), x, input_precision=DOT)
            if HAS_D:
                y += tl.load(D_ptr + hi).to(tl.float32) * x.to(tl.float32)
            tl.store(_ssd_rows_tile(y_ptr, h * p, first, rows, hi * p + ps), y.to(y_ptr.dtype.element_ty),
                     mask=x_mask)

    @triton.jit
    def _ssd_state_pass_bwd_kernel(dy_ptr, C_ptr, dt_ptr, A_ptr, dhT_ptr, dS_next_ptr, dh0_ptr, l, h, p, n, n_chunks,
                                   Cs, stride_dy, stride_C, stride_dt, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # kernel 4, the reverse of kernel 1, ds carried in fp32: at a chunk's end dS_next[c] = ds is stored; each block
        # k, last first, does ds ← exp(T_k) ds + Σ_r exp(u_r) dy_rᵀ C_r. One program per (batch·head, block of p ×
        # block of n)
        pid_bh, pid_pn = tl.program_id(0), tl.program_id(1)
        bi, hi, ps, ns, st_offs, st_mask = _ssd_state_block(pid_bh, pid_pn, h, p, n, BLOCK_P, BLOCK_N)
        A = tl.load(A_ptr + hi).to(tl.float32)
        ds = tl.load(dhT_ptr + pid_bh.to(tl.int64) * p * n + st_offs, mask=st_mask, other=0.0).to(tl.float32)
        n_blocks = tl.cdiv(Cs, BLOCK_C)
        for i in range(n_chunks * n_blocks):
            c, k = n_chunks - 1 - i // n_blocks, n_blocks - 1 - i % n_blocks
            if k == n_blocks - 1:
                tl.store(dS_next_ptr + ((bi * n_chunks + c) * h + hi).to(tl.int64) * p * n + st_offs,
                         ds.to(dS_next_ptr.dtype.element_ty), mask=st_mask)
            _, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
            _, u, _, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
            ds = tl.exp(T) * ds + _ssd_chunk_outer(dy_ptr, stride_dy, C_ptr, stride_C, tl.exp(u), bi, hi, l, p, n, pos,
                                                   valid, ps, ns, DOT)
        tl.store(dh0_ptr + pid_bh.to(tl.int64) * p * n + st_offs, ds, mask=st_mask)

    @triton.jit
    def _ssd_dx_block(dy_ptr, stride_dy, dt_ptr, stride_dt, A, bi, c, k, l, hi, p, Cs, ps, BLOCK_C: tl.constexpr):
        # what both walks of kernel 5 start block k with: its tokens, steps, rows in the chunk, mask and dy tile
        rs, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
        dt, u, e, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
        rows = k * BLOCK_C + rs
        x_mask = valid[:, None] & (ps[None, :] < p)
        dy = tl.load(_ssd_rows_tile(dy_ptr, stride_dy, bi * l + c * Cs, rows, hi * p + ps), mask=x_mask, other=0.0)
        return rs, pos, valid, dt, u, e, T, rows, x_mask, dy

    @triton.jit
    def _ssd_chunk_bwd_dx_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, CB_ptr, D_ptr, h_in_ptr, dS_next_ptr, dy_ptr,
                                 dx_ptr, ddt_parts_ptr, ends_ptr, crossings_ptr, b, l, h, p, n, n_chunks, Cs, stride_x,
                                 stride_dt, stride_B, stride_C, stride_dy, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr,
                                 DOT: tl.constexpr):
        # kernel 5, kernel 3's transpose, block by block k of a chunk: what block k reads of everything before it,
        #   y_in = exp(u)⊙(Σ_{j<k} what j writes + exp(T_0 + … + T_{k−1}) C h_inᵀ),
        # gives of ∂L/∂(dt_i A) the reads from i on, Σ_{r≥i} (dy⊙y_in)_r summed over p; what everything after it reads
        # of the block, g_out = exp(e)⊙(Σ_{j>k} what j reads + exp(T_{k+1} + …) B dS_nextᵀ), gives, with xdt = dt⊙x
        # and the block's own pairs M = CB⊙L⊙(dy xdtᵀ),
        #   dxdt = (CB⊙L)ᵀ dy + g_out,   dx = dt⊙dxdt + D dy,   ∂L/∂dt_s ∋ Σ_p dxdt_sp x_sp,
        # and of ∂L/∂(dt_i A) M's pairs s < i ≤ r and the writes Σ_{s<i} (xdt⊙g_out)_s. The reads and the writes each
        # store their part of ddt; for kernel 8 they store the block's sums [the reads of h_in, the writes into
        # dS_next, exp(all T)⟨h_in, dS_next⟩ (block 0 alone), Σ dy⊙x, Σ_i dt_i ∂L/∂(dt_i A) of the writes, of the
        # reads] in ends, and each earlier block's pairs with it in crossings. One program per (batch·chunk·head,
        # block of p) walks the chunk's blocks twice, the reads then the writes (walked once together they spilled);
        # its tiles' offsets count from the chunk's first row, so that they change with k (offsets the same for every
        # block would be computed once and held in registers through the walks)
        pid_p = tl.program_id(1)
        bi, c, hi, pid_bc, ps = _ssd_chunk_of_head(tl.program_id(0), pid_p, h, n_chunks, BLOCK_P)
        n_blocks = tl.cdiv(Cs, BLOCK_C)
        A = tl.load(A_ptr + hi).to(tl.float32)
        state = ((bi * n_chunks + c) * h + hi).to(tl.int64) * p * n
        pid_ch = ((pid_p.to(tl.int64) * b + bi) * n_chunks + c) * h + hi       # (block of p, batch, chunk, head)
        js = tl.arange(0, BLOCK_NB)
        first = bi * l + c * Cs                                         # the chunk's first row
        for k in range(n_blocks):                                       # the reads: y_in, earlier blocks nearest first
            rs, pos, valid, dt, u, e, T, rows, x_mask, dy = _ssd_dx_block(dy_ptr, stride_dy, dt_ptr, stride_dt, A, bi,
                                                                          c, k, l, hi, p, Cs, ps, BLOCK_C)
            ends = ends_ptr + pid_ch * 6 * n_blocks + k
            dyu = dy.to(tl.float32) * tl.exp(u)[:, None]
            crossing = tl.zeros((BLOCK_NB,), dtype=tl.float32)          # [j]: the pairs of block j < k with k
            y_in = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
            before = 0.0
            for i in range(k):
                written, T_j = _ssd_from_block(x_ptr, stride_x, dt_ptr, stride_dt, CB_ptr, A, bi, c, hi, l, p, Cs,
                                               pid_bc, k, k - 1 - i, before, rs, ps, BLOCK_C, DOT)
                crossing = tl.where(js == k - 1 - i, tl.sum(tl.sum(dyu * written, axis=1), axis=0), crossing)
                y_in += written
                before += T_j
            read_h_in = tl.exp(before) * _ssd_state_rows(C_ptr, stride_C, h_in_ptr + state, first, rows, valid, ps, p,
                                                         n, BLOCK_C, BLOCK_P, BLOCK_N, DOT)
            d_dtA = tl.cumsum(tl.sum(dyu * (y_in + read_h_in), axis=1), axis=0, reverse=True)   # Σ_{r≥i}
            tl.store(ddt_parts_ptr + (((2 * pid_p) * b + bi) * l + pos) * h + hi, A * d_dtA, mask=valid)
            tl.store(ends, tl.sum(tl.sum(dyu * read_h_in, axis=1), axis=0))
            tl.store(ends + 5 * n_blocks, tl.sum(dt * d_dtA, axis=0))
            tl.store(crossings_ptr + (pid_ch * n_blocks + k) * n_blocks + js, crossing, mask=js < n_blocks)
        for k in range(n_blocks):                                       # the writes: g_out, later blocks nearest first
            rs, pos, valid, dt, u, e, T, rows, x_mask, dy = _ssd_dx_block(dy_ptr, stride_dy, dt_ptr, stride_dt, A, bi,
                                                                          c, k, l, hi, p, Cs, ps, BLOCK_C)
            x = tl.load(_ssd_rows_tile(x_ptr, stride_x, first, rows, hi * p + ps), mask=x_mask, other=0.0)
            ends = ends_ptr + pid_ch * 6 * n_blocks + k
            g_out = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
            after = 0.0
            for j in range(k + 1, n_blocks):
                read, T_j = _ssd_into_block(dy_ptr, stride_dy, dt_ptr, stride_dt, CB_ptr, A, bi, c, hi, l, p, Cs,
                                            pid_bc, k, j, after, rs, ps, BLOCK_C, DOT)
                g_out += read
                after += T_j
            write_dS = tl.exp(after) * _ssd_state_rows(B_ptr, stride_B, dS_next_ptr + state, first, rows, valid, ps, p,
                                                       n, BLOCK_C, BLOCK_P, BLOCK_N, DOT)
            xf = x.to(tl.float32)
            xdte = xf * (tl.exp(e) * dt)[:, None]
            tl.store(ends + n_blocks, tl.sum(tl.sum(xdte * write_dS, axis=1), axis=0))
            writes = tl.sum(xdte * (g_out + write_dS), axis=1)
            if k == 0:                                                  # once a chunk: exp(all T)⟨h_in, dS_next⟩
                passed = 0.0
                for n0 in range(0, n, BLOCK_N):
                    ns = n0 + tl.arange(0, BLOCK_N)
                    st = ps[:, None] * n + ns[None, :]
                    st_mask = (ps[:, None] < p) & (ns[None, :] < n)
                    passed += tl.sum(tl.sum(tl.load(h_in_ptr + state + st, mask=st_mask, other=0.0).to(tl.float32)
                                            * tl.load(dS_next_ptr + state + st, mask=st_mask, other=0.0)
                                            .to(tl.float32), axis=1), axis=0)
                tl.store(ends + 2 * n_blocks, tl.exp(T + after) * passed)
            CBL = tl.load(_ssd_pair_tile(CB_ptr, pid_bc, k, k, rs, BLOCK_C, n_blocks)) * _ssd_pair_decays(dt, A, rs)
            dxdt = tl.dot(tl.trans(CBL).to(dy.dtype), dy, input_precision=DOT) + tl.exp(e)[:, None] * (g_out + write_dS)
            dx = dxdt * dt[:, None]
            if HAS_D:
                dx += tl.load(D_ptr + hi).to(tl.float32) * dy.to(tl.float32)
            tl.store(_ssd_rows_tile(dx_ptr, h * p, first, rows, hi * p + ps), dx.to(dx_ptr.dtype.element_ty),
                     mask=x_mask)
            M = CBL * tl.dot(dy, tl.trans(x), input_precision=DOT) * dt[None, :]
            before_i = tl.cumsum(M, axis=1) - M                                      # [r, i] = Σ_{s<i} M_rs
            d_dtA = tl.sum(tl.where(rs[:, None] >= rs[None, :], before_i, 0.0), axis=0)   # [i] = Σ_{r≥i} Σ_{s<i}
            d_dtA += tl.sum(tl.where(rs[:, None] < rs[None, :], writes[:, None], 0.0), axis=0)   # Σ_{s<i}
            tl.store(ddt_parts_ptr + (((2 * pid_p + 1) * b + bi) * l + pos) * h + hi,
                     tl.sum(dxdt * xf, axis=1) + A * d_dtA, mask=valid)
            tl.store(ends + 3 * n_blocks, tl.sum(tl.sum(dy.to(tl.float32) * xf, axis=1), axis=0))
            tl.store(ends + 4 * n_blocks, tl.sum(dt * d_dtA, axis=0))

    @triton.jit
    def _ssd_chunk_bwd_dcb_kernel(x_ptr, dt_ptr, A_ptr, h_in_ptr, dS_next_ptr, dy_ptr, dCB_ptr, dC_ptr, dB_ptr, b, l, h,
                                  p, n, n_chunks, Cs, heads_per_program, stride_x, stride_dt, stride_dy,
                                  BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                                  BLOCK_CS: tl.constexpr, DOT: tl.constexpr):
        # kernel 6, per (batch·chunk·group of heads) one program per pair of blocks j ≥ k and one per block and block
        # of n, each summed over the group's heads (kernel 7 adds the groups). A pair's: for r in block j, s in block k
        #   dCB_rs = Σ_h dt_s L_rs dy_r·x_s,
        # L as in kernel 3. A block's: the state terms of its tokens,
        #   dC_r ∋ Σ_h exp(a_r) dy_r h_in,   dB_s ∋ Σ_h exp(w_s) dt_s x_s dS_next,
        # a_r the decay from the chunk's start through r and w_s after s to the chunk's end. The two kinds take the
        # registers of the larger one
        n_groups, n_blocks, n_pb = tl.cdiv(h, heads_per_program), tl.cdiv(Cs, BLOCK_C), tl.cdiv(p, BLOCK_P)
        pid, t = tl.program_id(0), tl.program_id(1)
        group, pid_bc = pid % n_groups, pid // n_groups
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        first_head = group * heads_per_program
        heads = (tl.minimum(first_head + heads_per_program, h) - first_head) * n_pb       # (head, block of p) pairs
        n_pairs = n_blocks * (n_blocks + 1) // 2
        if t < n_pairs:
            j, k = _ssd_block_pair(t)
            rs, pos_j, valid_j, last_j = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
            rs_k, pos_k, valid_k, last_k = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
            dCB = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
            for i in range(heads):
                hi, ps = first_head + i // n_pb, (i % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
                A = tl.load(A_ptr + hi).to(tl.float32)
                dt, u_k, e, T_k = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos_k, valid_k, last_k)
                dt_j, u, e_j, T_j = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos_j, valid_j, last_j)
                dy = tl.load(_ssd_rows_tile(dy_ptr, stride_dy, bi * l + c * Cs + j * BLOCK_C, rs, hi * p + ps),
                             mask=valid_j[:, None] & (ps[None, :] < p), other=0.0)
                x = tl.load(_ssd_rows_tile(x_ptr, stride_x, bi * l + c * Cs + k * BLOCK_C, rs, hi * p + ps),
                            mask=valid_k[:, None] & (ps[None, :] < p), other=0.0)
                between = _ssd_steps_between(dt_ptr, stride_dt, A, bi, l, hi, c, Cs, (k + 1) * BLOCK_C, j * BLOCK_C,
                                             BLOCK_CS)
                L = tl.where(j == k, _ssd_pair_decays(dt, A, rs), tl.exp(u)[:, None] * tl.exp(e + between)[None, :])
                dCB += L * dt[None, :] * tl.dot(dy, tl.trans(x), input_precision=DOT)
            tl.store(_ssd_pair_tile(dCB_ptr, group * b * n_chunks + pid_bc, j, k, rs, BLOCK_C, n_blocks), dCB)
        else:
            n_nb = tl.cdiv(n, BLOCK_N)
            k, ns = (t - n_pairs) // n_nb, ((t - n_pairs) % n_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
            rs, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
            first = bi * l + c * Cs + k * BLOCK_C
            dC = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
            dB = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
            for i in range(heads):
                hi, ps = first_head + i // n_pb, (i % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
                A = tl.load(A_ptr + hi).to(tl.float32)
                dt, u, e, T = _ssd_block_steps(dt_ptr, stride_dt, A, bi, l, hi, pos, valid, last)
                dy = tl.load(_ssd_rows_tile(dy_ptr, stride_dy, first, rs, hi * p + ps),
                             mask=valid[:, None] & (ps[None, :] < p), other=0.0)
                x = tl.load(_ssd_rows_tile(x_ptr, stride_x, first, rs, hi * p + ps),
                            mask=valid[:, None] & (ps[None, :] < p), other=0.0)
                state = ((bi * n_chunks + c) * h + hi).to(tl.int64) * p * n
                st = ps[:, None] * n + ns[None, :]
                st_mask = (ps[:, None] < p) & (ns[None, :] < n)
                before = _ssd_steps_between(dt_ptr, stride_dt, A, bi, l, hi, c, Cs, 0, k * BLOCK_C, BLOCK_CS)
                after = _ssd_steps_between(dt_ptr, stride_dt, A, bi, l, hi, c, Cs, (k + 1) * BLOCK_C, Cs, BLOCK_CS)
                h_in = tl.load(h_in_ptr + state + st, mask=st_mask, other=0.0)
                dS = tl.load(dS_next_ptr + state + st, mask=st_mask, other=0.0)
                dC += tl.exp(u + before)[:, None] * tl.dot(dy, h_in.to(dy.dtype), input_precision=DOT)
                dB += (tl.exp(e + after) * dt)[:, None] * tl.dot(x, dS.to(x.dtype), input_precision=DOT)
            rows = group.to(tl.int64) * b * l + first                              # in the group's [b, l, n]
            mask = valid[:, None] & (ns[None, :] < n)
            tl.store(_ssd_rows_tile(dC_ptr, n, rows, rs, ns), dC, mask=mask)
            tl.store(_ssd_rows_tile(dB_ptr, n, rows, rs, ns), dB, mask=mask)

    @triton.jit
    def _ssd_groups_pair_tile(ptr, group_size, pid, j, k, rs, BLOCK_C: tl.constexpr, n_blocks, n_groups):
        # the sum over the groups of a stack of n_groups · group_size chunk matrices of their (j, k) tiles
        # (_ssd_pair_tile), for the chunk matrix pid of each group
        tile = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
        for g in range(n_groups):
            tile += tl.load(_ssd_pair_tile(ptr, g * group_size + pid, j, k, rs, BLOCK_C, n_blocks))
        return tile

    @triton.jit
    def _ssd_chunk_bwd_dbc_kernel(B_ptr, C_ptr, dCB_ptr, dC_states_ptr, dB_states_ptr, dB_ptr, dC_ptr, b, l, n,
                                  n_chunks, Cs, n_groups, stride_B, stride_C, BLOCK_N: tl.constexpr,
                                  BLOCK_C: tl.constexpr, DOT: tl.constexpr):
        # kernel 7, one program per (batch·chunk·block k, block of n), kernel 6's groups of heads added as loaded:
        #   dC_r = Σ_{j≤k} Σ_{s in j} dCB_rs B_s + state term,   dB_s = Σ_{j≥k} Σ_{r in j} dCB_rs C_r + state term
        # dCB rounded to B's dtype where it meets B and C; written in B's and C's dtype. The groups are added one
        # at a time: loaded all at once ([groups, BLOCK_C, BLOCK_C]), triton 3.6.0 took 255 registers on sm_75
        n_blocks = tl.cdiv(Cs, BLOCK_C)
        pid, pid_n = tl.program_id(0), tl.program_id(1)
        k, pid_bc = pid % n_blocks, pid // n_blocks
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        rs, pos, valid, last = _ssd_block_tokens(c, k, l, Cs, BLOCK_C)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (bi * l + pos[:, None]).to(tl.int64) * n + ns[None, :]
        mask = valid[:, None] & (ns[None, :] < n)
        dC = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
        dB = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
        for g in range(n_groups):                                               # the groups' [b, l, n] state terms
            group_rows = ((g * b + bi) * l + pos[:, None]).to(tl.int64) * n + ns[None, :]
            dC += tl.load(dC_states_ptr + group_rows, mask=mask, other=0.0)
            dB += tl.load(dB_states_ptr + group_rows, mask=mask, other=0.0)
        for j in range(k + 1):
            rs_j, pos_j, valid_j, last_j = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
            B_j = tl.load(_ssd_rows_tile(B_ptr, stride_B, bi * l + c * Cs + j * BLOCK_C, rs, ns),
                          mask=valid_j[:, None] & (ns[None, :] < n), other=0.0)
            dCB = _ssd_groups_pair_tile(dCB_ptr, b * n_chunks, pid_bc, k, j, rs, BLOCK_C, n_blocks, n_groups)
            dC += tl.dot(dCB.to(B_j.dtype), B_j, input_precision=DOT)
        for j in range(k, n_blocks):
            rs_j, pos_j, valid_j, last_j = _ssd_block_tokens(c, j, l, Cs, BLOCK_C)
            C_j = tl.load(_ssd_rows_tile(C_ptr, stride_C, bi * l + c * Cs + j * BLOCK_C, rs, ns),
                          mask=valid_j[:, None] & (ns[None, :] < n), other=0.0)
            dCB = _ssd_groups_pair_tile(dCB_ptr, b * n_chunks, pid_bc, j, k, rs, BLOCK_C, n_blocks, n_groups)
            dB += tl.dot(tl.trans(dCB).to(C_j.dtype), C_j, input_precision=DOT)
        tl.store(dC_ptr + rows, dC.to(dC_ptr.dtype.element_ty), mask=mask)
        tl.store(dB_ptr + rows, dB.to(dB_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ssd_chunk_bwd_ddt_kernel(dt_ptr, A_ptr, ddt_parts_ptr, ends_ptr, crossings_ptr, ddt_ptr, dA_ptr, dD_ptr, b, l,
                                  h, n_chunks, Cs, n_pb, stride_dt, HAS_D: tl.constexpr, BLOCK_C: tl.constexpr,
                                  BLOCK_NB: tl.constexpr, BLOCK_CS: tl.constexpr):
        # kernel 8, one program per (batch·chunk·head), kernel 5's partials added as loaded: of ∂L/∂(dt_i A), the
        # pairs that pass over the whole of i's block k, from before it to after it,
        #   E_k = exp(all T)⟨h_in, dS_next⟩ + Σ_{j<k} (j's writes into dS_next) + Σ_{j>k} (j's reads of h_in)
        #         + Σ_{j>k>j'} (the pairs of block j' with block j);
        # then ddt_i = kernel 5's + A E_k, and the chunk's and head's partial sums of dA (Σ_i dt_i ∂L/∂(dt_i A)) and dD
        pid = tl.program_id(0)
        hi, pid_bc = pid % h, pid // h
        bi, c = pid_bc // n_chunks, pid_bc % n_chunks
        n_blocks = tl.cdiv(Cs, BLOCK_C)
        ks = tl.arange(0, BLOCK_NB)
        in_chunk = ks < n_blocks
        reads = tl.zeros((BLOCK_NB,), dtype=tl.float32)
        writes = tl.zeros((BLOCK_NB,), dtype=tl.float32)
        crossings = tl.zeros((BLOCK_NB, BLOCK_NB), dtype=tl.float32)    # [k, j]: the pairs of block j < k with k
        passed, dA, dD = 0.0, 0.0, 0.0
        for q in range(n_pb):
            pid_ch = (q * b * n_chunks * h + pid).to(tl.int64)
            ends = ends_ptr + pid_ch * 6 * n_blocks
            reads += tl.load(ends + ks, mask=in_chunk, other=0.0)
            writes += tl.load(ends + n_blocks + ks, mask=in_chunk, other=0.0)
            passed += tl.load(ends + 2 * n_blocks)
            dD += tl.sum(tl.load(ends + 3 * n_blocks + ks, mask=in_chunk, other=0.0), axis=0)
            dA += tl.sum(tl.load(ends + 4 * n_blocks + ks, mask=in_chunk, other=0.0)
                         + tl.load(ends + 5 * n_blocks + ks, mask=in_chunk, other=0.0), axis=0)
            crossings += tl.load(crossings_ptr + (pid_ch * n_blocks + ks[:, None]) * n_blocks + ks[None, :],
                                 mask=in_chunk[:, None] & in_chunk[None, :], other=0.0)
        E = passed + tl.sum(tl.where(ks[None, :] < ks[:, None], writes[None, :], 0.0), axis=1)
        E += tl.sum(tl.where(ks[None, :] > ks[:, None], reads[None, :], 0.0), axis=1)
        over = (ks[None, :, None] > ks[:, None, None]) & (ks[None, None, :] < ks[:, None, None])   # [k, j, j']
        E += tl.sum(tl.sum(tl.where(over, crossings[None, :, :], 0.0), axis=2), axis=1)
        ts = tl.arange(0, BLOCK_CS)
        pos = c * Cs + ts
        valid = (ts < Cs) & (pos < l)
        E_i = tl.sum(tl.where((ts // BLOCK_C)[:, None] == ks[None, :], E[None, :], 0.0), axis=1)
        A = tl.load(A_ptr + hi).to(tl.float32)
        ddt = A * E_i
        for q in range(2 * n_pb):                                       # kernel 5's two kinds per block of p
            ddt += tl.load(ddt_parts_ptr + ((q * b + bi) * l + pos).to(tl.int64) * h + hi, mask=valid, other=0.0)
        tl.store(ddt_ptr + (bi * l + pos).to(tl.int64) * h + hi, ddt.to(ddt_ptr.dtype.element_ty), mask=valid)
        dt = tl.load(dt_ptr + (bi * l + pos).to(tl.int64) * stride_dt + hi, mask=valid, other=0.0).to(tl.float32)
        tl.store(dA_ptr + pid, dA + tl.sum(dt * E_i, axis=0))
        if HAS_D:
            tl.store(dD_ptr + pid, dD)


def _dot_precision(x):
    """tl.dot's precision for fp32 inputs: IEEE fp32 (as the references), unless torch is allowed TF32 for fp32
    matmuls (torch.set_float32_matmul_precision("high")): then TF32 tensor cores. bf16/fp16 inputs go into the dots
    in their own dtype, where the flag does nothing. (Triton's interpreter computes every dot in fp32.)"""
    if x.dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


SSD_TRITON_MAX_CHUNK = 256  # mamba_ssm's default: h_in and dS_next a quarter of chunk 64's
SSD_HEADS_PER_PROGRAM = 16  # (head, block of p) pairs a dCB program walks: partial sums for groups, 16 steps


def _ssd_blocks(dtype, p, n, Cs):
    """(BLOCK_P, BLOCK_N, BLOCK_C, BLOCK_S) for inputs of `dtype`. The state passes walk blocks of BLOCK_S ≤ 64
    tokens (16 steps at T 1024) over a [BLOCK_P, BLOCK_N] block of the state, p and n in blocks of 32 for bf16 dots,
    16 for fp32 ones (whose operands take twice the registers) and fp16 ones (Turing, sm_75, whose smaller mma tiles
    spill at 32). The per-block kernels take blocks of BLOCK_C ≤ 32 tokens, whose [32, 32] pair tiles leave room
    for 2 or more blocks an SM. tl.dot wants every dimension ≥ 16."""
    most = 32 if dtype == torch.bfloat16 else 16
    block = lambda d, most: max(16, min(most, triton.next_power_of_2(d)))
    return block(p, most), block(n, most), block(Cs, 32), block(Cs, 64)


def _ssd_state_pass_launch(x):
    """num_warps, num_stages and maxnreg of the state passes (kernels 1 and 4) for inputs like x, with the next
    block's loads in flight: 4 warps for 16-bit dots; 8 for fp32 ones, held to MAX_REGISTERS (left to itself ptxas
    took 128 and spilled 16 B on sm_80)."""
    if x.dtype == torch.float32:
        return dict(num_warps=8, num_stages=2, maxnreg=MAX_REGISTERS)
    return dict(num_warps=4, num_stages=2)


def _ssd_passed_dtype(x):
    """The dtype of the passed states h_in and the backward's dS_next: 16-bit inputs' own (mamba_ssm's
    choice: half the bytes of fp32, and the dots read them in that dtype), else fp32."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _ssd_rows(x, dt, B, C):
    """x, dt, B, C as the kernels read them, each as (rows of one token, the token stride) (_rows): the model's
    are column slices of in_proj's output (x, B, C) and views."""
    h, p = x.shape[-2:]
    return _rows(x, h * p), _rows(dt, h), _rows(B, B.shape[-1]), _rows(C, C.shape[-1])


def _ssd_chunk_length(chunk_size, l):
    """The chunk length the kernels walk: chunk_size, or the whole sequence where it is shorter (one chunk either
    way, without blocks past its end)."""
    return min(chunk_size, max(l, 1))


def _ssd_states(rows, A, shape, Cs, initial_state):
    """Kernel 1: (h_in, h_T) from _ssd_rows' rows and shape = (b, l, h, p, n); the forward and the backward (which
    recomputes h_in) share this."""
    (x, sx), (dt, sdt), (B, sB), _ = rows
    b, l, h, p, n = shape
    N = triton.cdiv(l, Cs)
    BP, BN, _, BS = _ssd_blocks(x.dtype, p, n, Cs)
    h_in = torch.empty(b, N, h, p, n, device=x.device, dtype=_ssd_passed_dtype(x))
    h_T = torch.empty(b, h, p, n, device=x.device, dtype=torch.float32)
    h0 = initial_state.contiguous() if initial_state is not None else h_T
    _ssd_state_pass_kernel[(b * h, triton.cdiv(p, BP) * triton.cdiv(n, BN))](
        x, B, dt, A, h0, h_in, h_T, l, h, p, n, N, Cs, sx, sB, sdt, HAS_INITIAL=initial_state is not None,
        BLOCK_P=BP, BLOCK_N=BN, BLOCK_C=BS, DOT=_dot_precision(x), **_ssd_state_pass_launch(x))
    return h_in, h_T


def _ssd_cb(rows, shape, Cs, dot):
    """Kernel 2: CB [b, chunks, Cs', Cs'] in fp32 (Cs' = Cs in whole blocks), its tiles at and below the blocks'
    diagonal formed; the forward and the backward share this."""
    _, _, (B, sB), (C, sC) = rows
    b, l, h, p, n = shape
    N = triton.cdiv(l, Cs)
    _, BN, BC, _ = _ssd_blocks(B.dtype, p, n, Cs)
    n_kb = triton.cdiv(Cs, BC)
    CB = torch.empty(b, N, n_kb * BC, n_kb * BC, device=B.device, dtype=torch.float32)
    _ssd_cb_kernel[(b * N, n_kb * (n_kb + 1) // 2)](B, C, CB, l, n, N, Cs, sB, sC, BLOCK_N=BN, BLOCK_C=BC, DOT=dot,
                                                    num_warps=4, num_stages=2)
    return CB


@_triton_op("specgpt::ssd_fwd")
def _ssd_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: Optional[torch.Tensor], chunk_size: int,
             initial_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h_T)"""
    b, l, h, p = x.shape
    n = B.shape[-1]
    Cs = _ssd_chunk_length(chunk_size, l)
    rows = _ssd_rows(x, dt, B, C)
    (x2, sx), (dt2, sdt), _, (C2, sC) = rows
    A = A.contiguous()
    dot = _dot_precision(x)
    h_in, h_T = _ssd_states(rows, A, (b, l, h, p, n), Cs, initial_state)
    CB = _ssd_cb(rows, (b, l, h, p, n), Cs, dot)
    BP, BN, BC, _ = _ssd_blocks(x.dtype, p, n, Cs)
    N = triton.cdiv(l, Cs)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _ssd_chunk_scan_kernel[(b * N * h, triton.cdiv(p, BP))](
        x2, dt2, A, C2, CB, h_in, D if D is not None else A, y, l, h, p, n, N, Cs, sx, sdt, sC, HAS_D=D is not None,
        BLOCK_P=BP, BLOCK_N=BN, BLOCK_C=BC, DOT=dot, num_warps=4,
        num_stages=1 if x.dtype == torch.float32 else 2)
    return y, h_T


@_ssd_fwd.register_fake
def _(x, dt, A, B, C, D, chunk_size, initial_state):
    b, l, h, p = x.shape
    return x.new_empty(x.shape), x.new_empty(b, h, p, B.shape[-1], dtype=torch.float32)


@_triton_op("specgpt::ssd_bwd")
def _ssd_bwd(dy: torch.Tensor, dh_T: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor, torch.Tensor]:
    """(dx, ddt, dA, dB, dC, dD, d initial_state) in their inputs' dtypes, d initial_state in fp32; dD is empty
    without D."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    Cs = _ssd_chunk_length(chunk_size, l)
    N = triton.cdiv(l, Cs)
    rows = _ssd_rows(x, dt, B, C)
    (x2, sx), (dt2, sdt), (B2, sB), (C2, sC) = rows
    dy2, sdy = _rows(dy, h * p)
    A = A.contiguous()
    dot = _dot_precision(x)
    h_in, _ = _ssd_states(rows, A, (b, l, h, p, n), Cs, initial_state)
    CB = _ssd_cb(rows, (b, l, h, p, n), Cs, dot)
    BP, BN, BC, BS = _ssd_blocks(x.dtype, p, n, Cs)
    f32 = dict(device=x.device, dtype=torch.float32)
    dS_next = torch.empty(b, N, h, p, n, device=x.device, dtype=_ssd_passed_dtype(x))
    dh0 = torch.empty(b, h, p, n, **f32)
    _ssd_state_pass_bwd_kernel[(b * h, triton.cdiv(p, BP) * triton.cdiv(n, BN))](
        dy2, C2, dt2, A, dh_T.contiguous(), dS_next, dh0, l, h, p, n, N, Cs, sdy, sC, sdt, BLOCK_P=BP, BLOCK_N=BN,
        BLOCK_C=BS, DOT=dot, **_ssd_state_pass_launch(x))
    # partial sums: ddt's terms within a block and the blocks' sums for kernel 8 per block of p (kernel 5), dCB and
    # the state terms of dB and dC per group of heads (kernel 6)
    n_pb, n_nb, n_kb = triton.cdiv(p, BP), triton.cdiv(n, BN), triton.cdiv(Cs, BC)
    full = lambda d: max(16, triton.next_power_of_2(d))
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    ddt_parts = torch.empty(n_pb, 2, b, l, h, **f32)
    ends, crossings = torch.empty(n_pb, b, N, h, 6, n_kb, **f32), torch.empty(n_pb, b, N, h, n_kb, n_kb, **f32)
    # kernels 5 and 6 at 4 warps, 2 blocks an SM: kernel 5 held to MAX_REGISTERS (it took 255); kernel 6 too (left
    # to itself ptxas stopped at 128 and spilled 8-16 B on sm_80 / sm_89 as the JIT specialises it; held, it takes
    # 146-196). Kernel 5 runs unpipelined: with the next block's loads in flight it spilled 8 B (fp32 on sm_90, bf16
    # on sm_80 at a general shape); kernel 6's fp32 pair tiles spilled with the next head's loads in flight, so fp32
    # runs it unpipelined. Kernel 5 has one program per chunk, head and block of p (3072 at B 16, T 1024, 48 heads,
    # chunk 256), each walking its chunk's blocks
    _ssd_chunk_bwd_dx_kernel[(b * N * h, n_pb)](
        x2, dt2, A, B2, C2, CB, D if D is not None else A, h_in, dS_next, dy2, dx, ddt_parts, ends, crossings, b, l, h,
        p, n, N, Cs, sx, sdt, sB, sC, sdy, HAS_D=D is not None, BLOCK_P=BP, BLOCK_N=BN, BLOCK_C=BC,
        BLOCK_NB=max(2, triton.next_power_of_2(n_kb)), DOT=dot, num_warps=4, num_stages=1, maxnreg=MAX_REGISTERS)
    heads_per_program = max(1, SSD_HEADS_PER_PROGRAM // n_pb)
    n_hg = triton.cdiv(h, heads_per_program)
    dCB = torch.empty(n_hg, b, N, n_kb * BC, n_kb * BC, **f32)
    dC_states, dB_states = torch.empty(n_hg, b, l, n, **f32), torch.empty(n_hg, b, l, n, **f32)
    _ssd_chunk_bwd_dcb_kernel[(b * N * n_hg, n_kb * (n_kb + 1) // 2 + n_kb * n_nb)](
        x2, dt2, A, h_in, dS_next, dy2, dCB, dC_states, dB_states, b, l, h, p, n, N, Cs, heads_per_program, sx, sdt,
        sdy, BLOCK_P=BP, BLOCK_N=BN, BLOCK_C=BC, BLOCK_CS=full(Cs), DOT=dot, num_warps=4,
        num_stages=1 if x.dtype == torch.float32 else 2, maxnreg=MAX_REGISTERS)
    dB, dC = torch.empty(B.shape, device=B.device, dtype=B.dtype), torch.empty(C.shape, device=C.device, dtype=C.dtype)
    _ssd_chunk_bwd_dbc_kernel[(b * N * n_kb, n_nb)](
        B2, C2, dCB, dC_states, dB_states, dB, dC, b, l, n, N, Cs, n_hg, sB, sC, BLOCK_N=BN, BLOCK_C=BC, DOT=dot,
        num_warps=8, num_stages=2, maxnreg=MAX_REGISTERS)   # uncapped, ptxas took 40 in fp32 on sm_80 and spilled 8 B
    ddt = torch.empty(b, l, h, device=dt.device, dtype=dt.dtype)
    dA, dD = torch.empty(b, N, h, **f32), torch.empty(b, N, h, **f32)
    _ssd_chunk_bwd_ddt_kernel[(b * N * h,)](
        dt2, A, ddt_parts, ends, crossings, ddt, dA, dD, b, l, h, N, Cs, n_pb, sdt, HAS_D=D is not None,
        BLOCK_C=BC, BLOCK_NB=max(2, triton.next_power_of_2(n_kb)), BLOCK_CS=full(Cs), num_warps=4)
    dD = dD.sum((0, 1)).to(D.dtype) if D is not None else A.new_empty(0)
    return dx, ddt, dA.sum((0, 1)).to(A.dtype), dB, dC, dD, dh0


@_ssd_bwd.register_fake
def _(dy, dh_T, x, dt, A, B, C, D, initial_state, chunk_size):
    dD = D.new_empty(D.shape) if D is not None else A.new_empty(0)
    return (*(t.new_empty(t.shape) for t in (x, dt, A, B, C)), dD, dh_T.new_empty(dh_T.shape, dtype=torch.float32))


def _ssd_setup(ctx, inputs, output):
    x, dt, A, B, C, D, ctx.chunk_size, initial_state = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, initial_state)
    ctx.has_initial = initial_state is not None


def _ssd_backward(ctx, dy, dh_T):
    x, dt, A, B, C, D, initial_state = ctx.saved_tensors
    dx, ddt, dA, dB, dC, dD, dh0 = _ssd_bwd(dy, dh_T, x, dt, A, B, C, D, initial_state, ctx.chunk_size)
    return dx, ddt, dA, dB, dC, dD if D is not None else None, None, dh0 if ctx.has_initial else None


_ssd_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup)


def ssd_triton(x, dt, A, B, C, D=None, chunk_size=64, initial_state=None):
    _ssd_check(x, dt, A, B, C, D, initial_state)
    if not 1 <= chunk_size <= SSD_TRITON_MAX_CHUNK:
        raise ValueError(f"ssd: the Triton path takes chunk_size from 1 to {SSD_TRITON_MAX_CHUNK}, got {chunk_size}")
    return _ssd_fwd(x, dt, A, B, C, D, chunk_size, initial_state)


def ssd(x, dt, A, B, C, D=None, chunk_size=64, initial_state=None, kernels="auto"):
    path = _path("ssd", kernels, x)
    if path == "triton":
        return ssd_triton(x, dt, A, B, C, D, chunk_size, initial_state)
    if path == "ref":
        return ssd_ref(x, dt, A, B, C, D, initial_state)
    return ssd_torch(x, dt, A, B, C, D, chunk_size, initial_state)


def _ssd_example(dtype, d, fn=None):
    B, T, h, p, n, fn = d.B, d.T, d.heads_ssd, d.p, d.n, fn or ssd_triton
    return lambda: _backward(fn(_leaf(B, T, h, p, dtype=dtype), _leaf(B, T, h), _leaf(h),
                                _leaf(B, T, 1, n, dtype=dtype), _leaf(B, T, 1, n, dtype=dtype), _leaf(h), d.chunk,
                                _leaf(B, h, p, n)))


def _ssd_opcheck(randn):
    b, l, h, p, n, Cs = 1, 9, 2, 3, 4, 8   # 9 tokens: two chunks of 8, the second ragged
    ssd_in = (randn(b, l, h, p), F.softplus(randn(b, l, h)), -randn(h).abs() - 0.5, randn(b, l, 1, n),
              randn(b, l, 1, n))
    cases = []
    for D, s0 in ((None, None), (randn(h), randn(b, h, p, n))):
        named, full = ("", False) if D is None else (" D initial_state", True)
        cases += [("ssd" + named, _ssd_fwd, (*map(_requiring_grad, ssd_in), _requiring_grad(D), Cs,
                                             _requiring_grad(s0)), full),
                  ("ssd_bwd" + named, _ssd_bwd, (randn(b, l, h, p), randn(b, h, p, n), *ssd_in, D, s0, Cs), False)]
    return cases


def _ssd_compare(randn):   # 37 tokens in chunks of 16, the last ragged
    b, l, h, p, n = 2, 37, 3, 8, 16
    return (lambda fn, **kw: fn(**kw) if fn is ssd_ref else fn(**kw, chunk_size=16),   # ssd_ref has no chunks
            dict(x=randn(b, l, h, p), dt=F.softplus(randn(b, l, h) - 1), A=-randn(h).abs() - 0.5, B=randn(b, l, 1, n),
                 C=randn(b, l, 1, n), D=randn(h), initial_state=randn(b, h, p, n)))


OPS["ssd"] = Op(ssd_ref, ssd_torch, ssd_triton, _ssd_example, _ssd_opcheck, _ssd_compare)


# -----------------------------------------------------------------------------
# The registry's rules, checked at import, and every Triton op's example launch.

def _check_ops():
    """Each OPS row keeps the rules of Op: a one-line ValueError naming the row and the rule it breaks."""
    for name, op in OPS.items():
        checks = (op.example, op.opcheck, op.compare)
        if not (callable(op.ref) and callable(op.torch)):
            raise ValueError(f"OPS[{name!r}]: ref and torch must be functions, {name}_ref and {name}_torch")
        if op.triton is None and (any(f is not None for f in checks) or op.fp16 is not None):
            raise ValueError(f"OPS[{name!r}]: an op without a Triton path has no example, opcheck, compare or fp16")
        if op.triton is not None and not all(callable(f) for f in (op.triton, *checks)):
            raise ValueError(f"OPS[{name!r}]: a Triton path needs its example, opcheck and compare functions (see Op)")
        if op.fp16 is not None and len(op.fp16) != 2:
            raise ValueError(f"OPS[{name!r}]: fp16 is (the inputs given in fp16, the results allowed 2u) or None")


_check_ops()


def example_steps(dtype=torch.float32, **dims):
    """{op: a thunk running its Triton forward and backward on CPU tensors} for every op with a Triton path, at the
    model dims given (ExampleDims' fields; the rest at their defaults) in dtype: what triton_launches records."""
    return {name: op.example(dtype, ExampleDims(**dims)) for name, op in OPS.items() if op.triton is not None}


if __name__ == "__main__":
    # the registry at a glance; what measures the ops (their errors against _ref, the Triton walk-through, the
    # ahead-of-time compile table, the kernel cost report) is in bench.py: python bench.py kernels | aot | costs
    usage = "python kernels.py   lists kernels.OPS: each op, its paths and whether the model calls it"
    if sys.argv[1:]:
        if sys.argv[1:] not in (["-h"], ["--help"]):
            sys.exit(f"kernels.py takes no arguments (got {sys.argv[1]!r}): {usage}")
        print(usage)
        sys.exit()
    print(f"{'op':16s} {'paths':18s} model  the functions")
    for name, op in OPS.items():
        paths = "ref, torch" + (", triton" if op.triton is not None else "")
        functions = ", ".join(f.__name__ for f in (op.ref, op.torch, op.triton) if f is not None)
        print(f"{name:16s} {paths:18s} {'yes' if op.in_model else 'no':6s} {functions}")
    print(f"Triton {'can run here' if HAS_TRITON else 'cannot run here: a GPU, or TRITON_INTERPRET=1 on a CPU'}")
