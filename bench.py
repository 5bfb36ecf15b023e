"""
bench.py: what measures specgpt (nanoGPT's name for it): its kernels' errors, launches, registers and costs, and
its model's speed. One command with subcommands; the library files never import this one, only the tests do.

    python bench.py kernels          each op's error against its reference and the chunked paths' speed against the
                                     token loops; the Triton walk-through and each Triton op against its reference
                                     (on a CPU in Triton's interpreter: TRITON_INTERPRET=1 python bench.py kernels);
                                     on a GPU each op's forward + backward timed against the torch path and
                                     torch.compile
    python bench.py costs            what autograd keeps per mixer, and the kernel cost report: per Triton launch of a
                                     mixer's forward + backward the bytes, FLOPs, exps and steps counted in Triton's
                                     interpreter, its sm_90 occupancy and dot instruction, and an H100 time estimated
                                     by analyze.launch_time; on a GPU each launch measured beside its estimate
    python bench.py aot              every Triton kernel compiled ahead of time for sm_80/89/90 in fp32 and bf16:
                                     shared memory, registers, spilled bytes
    python bench.py recipe           nanoGPT's CPU recipe on a GPT-2-style yardstick, to time python train.py by
    python bench.py mixers [A G ...] each mixer string's training step against the GPT-2-style yardstick
    python bench.py residuals        each residual kind's training step against res
    python bench.py seeds --n=3 -- <train.py args of setting A> -- <of setting B> ...
                                     each setting trained with n seeds: mean ± sd of the final val loss and bpb, and
                                     Welch's t-test between each pair
    python bench.py clip OUT_DIR ... Gated DeltaNet-2's spectral clip on each checkpoint's gdn2 layers: how often
                                     ρ > 1, and the state's growth over long text with the clip and without
    python bench.py recall [A G:kda ...] [--grid=gpu]   each mixer on MQAR (Zoology's recall task) at 2 layers, its
                                     best lr of a small grid, several seeds: accuracy per test slice against the
                                     bytes a layer keeps to generate (recurrent state, or KV cache), a table and plot
"""
import argparse
import ast
import collections
import contextlib
import functools
import itertools
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import analyze
import kernels
import model
from model import GPT, GPTConfig, MIXERS, RESIDUALS

if kernels.HAS_TRITON:  # as kernels.py decided: a GPU, Triton's interpreter, or triton imported before it
    import triton
    import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# What a CPU can prove about a GPU run, found without one. The wrappers run on fake tensors (any shape is free)
# with every launch recorded instead of run (kernel, grid, argument dtypes, constexprs, num_warps), so the launch
# parameters are exactly the ones the wrappers choose: triton_grids checks them against CUDA's grid limits, and
# each distinct launch, specialised as Triton's JIT specialises its arguments, is compiled by triton.compile for a
# GPUTarget with the wheel's own ptxas (triton_resources: shared memory, registers, spills; needs a process that
# imported triton itself, without TRITON_INTERPRET, whose kernels cannot be compiled). kept_bytes counts what
# autograd keeps for the backward, again on fake tensors.


def triton_launches(step):
    """[(kernel, signature, constexprs, attrs, options)], one per distinct launch that step() (Triton ops forward and
    backward) makes, recorded on fake tensors (analyze.record_launches)."""
    launches = {}

    def record(kernel, grid, args, kwargs):
        launch = (kernel, *_launch_signature(kernel, args, kwargs))
        launches.setdefault(launch_key(launch), launch)

    analyze.record_launches(step, record)
    return list(launches.values())


class _AlignedAs:
    """What Triton's specialisation reads of a tensor argument (its dtype and data pointer), for a fake tensor: its
    storage is allocated aligned (CUDA's allocator: 512 bytes), so the pointer is as aligned as its offset in bytes."""

    def __init__(self, tensor):
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset() * tensor.element_size()

    def data_ptr(self):
        return self.offset


def _launch_signature(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) of one launch, as Triton's JIT hands them to triton.compile
    (JITFunction.run): each argument specialised by the running Triton's own rule (native_specialize_impl, which
    makes an integer 1 a constexpr and marks "D" each integer divisible by 16 and each 16-byte-aligned pointer);
    attrs {argument: "D"}, compiled with tt.divisibility 16 (_compile_resources)."""
    import inspect
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in kernels.LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
    signature, constexprs, attrs = {}, {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        value = _AlignedAs(value) if torch.is_tensor(value) else value
        kind, spec = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = spec
        elif spec:
            attrs[param.name] = spec
    return signature, constexprs, attrs, options


def launch_key(launch):
    """What tells one (kernel, signature, constexprs, attrs, options) launch from another, hashable."""
    kernel, *dicts = launch
    return (kernel.fn.__name__, *(tuple(d.items()) for d in dicts))


def with_general_integers(launch):
    """The launch as a shape where no integer argument is a multiple of 16 (nor 1) compiles it: every integer a
    plain i32 / i64 without divisibility, pointers as aligned as they were."""
    kernel, signature, constexprs, attrs, options = launch
    general = {p.name for p in kernel.params if not p.is_constexpr
               and (signature[p.name] in ("i32", "i64", "u64") or isinstance(constexprs.get(p.name), int))}
    as_int = lambda v: "i32" if -2**31 <= v < 2**31 else "i64"
    signature = {k: as_int(constexprs[k]) if k in general and v == "constexpr" else v for k, v in signature.items()}
    return (kernel, signature, {k: v for k, v in constexprs.items() if k not in general},
            {k: v for k, v in attrs.items() if k not in general}, options)


def triton_grids(step):
    """[(kernel name, grid)] for every launch step() makes, recorded on fake tensors (analyze.record_launches)."""
    grids = []
    analyze.record_launches(step, lambda kernel, grid, args, kwargs: grids.append((kernel.fn.__name__, grid)))
    return grids


def kept_bytes(step):
    """Bytes the forward leaves alive for the backward: step() runs under FakeTensorMode (it builds its module
    and inputs there, so any shape is free) and returns (module, inputs, output); counted are the storages that
    ops made during step and that the output's autograd graph still holds, each once, the module's parameters,
    the inputs (the caller's) and the output itself left out. What stays alive, rather than what
    saved_tensors_hooks see, also counts what activation checkpointing keeps in its own caches."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    made = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    made[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
            return out

    with FakeTensorMode(), Record():
        module, inputs, output = step()
    for t in [*module.parameters(), *torch.utils._pytree.tree_leaves((inputs, output))]:
        if isinstance(t, torch.Tensor):
            made.pop(StorageWeakRef(t.untyped_storage()), None)
    return sum(nbytes for ref, nbytes in made.items() if not ref.expired())


def mixer_kept_activations(cfg, B, T):
    """What autograd keeps for the backward of one cfg.mixer[0] mixer, run on a [B, T, n_embd] input under bf16
    autocast, in units of one bf16 [B, T, n_embd] activation; counted on fake tensors (kept_bytes), so
    any shape is free, and with cfg.kernels="triton" on a CPU too (no kernel runs)."""
    def step():
        mixer = MIXERS[cfg.mixer[0]](cfg)
        x = torch.randn(B, T, cfg.n_embd, requires_grad=True)
        rope = model.rope_cache(T, cfg.n_embd // cfg.n_head, cfg.rope_base)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the input in bf16, as the block's RMSNorm gives it
            return mixer, (x, rope), mixer(x.to(torch.bfloat16), rope)
    return kept_bytes(step) / (2 * B * T * cfg.n_embd)


def kept_activation_table(shapes=((16, 2048, 2048, 16), (8, 1024, 768, 12))):
    """Print mixer_kept_activations for A, G and M, Triton path, at each (B, T, n_embd, n_head)."""
    print("what autograd keeps per mixer under bf16 autocast, Triton path, in bf16 [B, T, n_embd] activations")
    for B, T, C, H in shapes:
        cfg = lambda mixer: GPTConfig(n_embd=C, n_head=H, block_size=T, mixer=mixer, kernels="triton")
        print(f"  B={B} T={T} n_embd={C} n_head={H}: " +
              "  ".join(f"{m} {mixer_kept_activations(cfg(m), B, T):5.2f}x" for m in MIXERS))


def _compiled(kernel, signature, constexprs, attrs, options, arch):
    """triton.compile of one launch for sm_<arch> as the JIT compiles it: with the attrs of its specialisation
    (_launch_signature), tt.divisibility 16 on each argument marked "D"."""
    from triton.backends.compiler import BaseBackend, GPUTarget
    attrs = {(kernel.arg_names.index(name),): BaseBackend.parse_attr(spec) for name, spec in attrs}
    src = triton.compiler.ASTSource(kernel, dict(signature), dict(constexprs), attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))


# archs whose Triton PTX is another arch's but for its .target line: Triton lowers an op differently for Ada (sm_89)
# than for Ampere (sm_80) only for fp8, which no kernel here takes. So sm_89's binary is ptxas's (with the flags
# Triton passes it) of sm_80's PTX retargeted, a quarter of a whole compile; retargeted_matches checks that it is the
# one a whole compile builds
SAME_PTX_AS = {89: 80}


def _cubin(kernel, signature, constexprs, attrs, options, arch):
    """(cubin, shared bytes) of one launch for sm_<arch>: _compiled's, or for an arch of SAME_PTX_AS its twin's PTX
    (a hit in Triton's cache once the twin is compiled) retargeted and assembled by Triton's own ptxas step."""
    if arch not in SAME_PTX_AS:
        compiled = _compiled(kernel, signature, constexprs, attrs, options, arch)
        return compiled.asm["cubin"], compiled.metadata.shared
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    twin = _compiled(kernel, signature, constexprs, attrs, options, SAME_PTX_AS[arch])
    backend = make_backend(GPUTarget("cuda", arch, 32))
    ptx = twin.asm["ptx"].replace(f".target sm_{SAME_PTX_AS[arch]}\n", f".target sm_{arch}\n", 1)
    return backend.make_cubin(ptx, {}, backend.parse_options(dict(options)), arch), twin.metadata.shared


def _cubin_resources(cubin):
    """(registers, stack bytes) of a cubin from the wheel's cuobjdump, (None, None) where it has none."""
    import re
    import subprocess
    import tempfile
    cuobjdump = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (int(found[1]), int(found[2])) if found else (None, None)


@functools.lru_cache(maxsize=None)
def _compile_resources(kernel, signature, constexprs, attrs, options, arch):
    """(shared bytes, registers, stack bytes) of one launch compiled for sm_<arch> (_cubin); registers and stack
    (where spilled registers go) from cuobjdump, None where the wheel has none."""
    cubin, shared = _cubin(kernel, signature, constexprs, attrs, options, arch)
    return (shared, *_cubin_resources(cubin))


def retargeted_matches(launch, arch):
    """Whether a whole compile of the launch for sm_<arch> (an arch of SAME_PTX_AS) emits its twin's PTX but for the
    .target line and assembles to the registers and stack bytes _cubin's retargeted PTX does."""
    kernel, *dicts = launch
    items = [tuple(d.items()) for d in dicts]
    whole = _compiled(kernel, *items, arch)
    twin = _compiled(kernel, *items, SAME_PTX_AS[arch])
    same_ptx = whole.asm["ptx"] == twin.asm["ptx"].replace(f".target sm_{SAME_PTX_AS[arch]}\n", f".target sm_{arch}\n",
                                                            1)
    return same_ptx and _cubin_resources(whole.asm["cubin"]) == _cubin_resources(_cubin(kernel, *items, arch)[0])


_FORKED = []   # what forked_map's workers read: (fn, items), which need not pickle (kernels and closures do not)


def _forked_call(i):
    fn, items = _FORKED[0]
    return fn(items[i])


def forked_map(fn, items, workers=None):
    """[fn(item) for item in items], in `workers` forked processes (default: one per CPU core); the results must
    pickle, fn and items need not."""
    import concurrent.futures
    import multiprocessing
    workers = min(workers or os.cpu_count() or 1, len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    _FORKED[:] = [(fn, items)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_forked_call, range(len(items))))


def triton_resources(launches, archs=(80, 89, 90), workers=None):
    """One row per (launch, arch): dict(kernel, arch, constexprs, attrs, num_warps, dtype, shared, limit, regs,
    stack). Each distinct launch compiles once for each arch, its archs in one job (an arch of SAME_PTX_AS after its
    twin, whose PTX it reuses), the jobs in `workers` forked processes (default: one per CPU core), the largest
    kernels first so that no worker is left with one at the end."""
    distinct = {launch_key(launch): launch for launch in launches}
    order = sorted(distinct, key=lambda key: -len(distinct[key][0].src))
    ordered_archs = sorted(archs, key=lambda a: (a in SAME_PTX_AS, a))
    compile_one = lambda key: {a: _compile_resources(distinct[key][0], *key[1:], a) for a in ordered_archs}
    found = dict(zip(order, forked_map(compile_one, order, workers)))
    return [dict(kernel=kernel.fn.__name__, arch=arch, constexprs=constexprs, attrs=attrs,
                 num_warps=options.get("num_warps", 4),
                 dtype=next((d for d in ("bf16", "fp16") if f"*{d}" in signature.values()), "fp32"),
                 shared=shared, limit=kernels.SHARED_LIMIT[arch], regs=regs, stack=stack)
            for (kernel, signature, constexprs, attrs, options) in launches for arch in archs
            for shared, regs, stack in [found[launch_key((kernel, signature, constexprs, attrs, options))][arch]]]


def triton_resource_table(archs=(80, 89, 90), dtypes=(torch.float32, torch.bfloat16), **dims):
    """Print shared memory / registers / stack bytes (spilled registers) per kernel and arch for fwd+bwd of every
    Triton op at the given dims (see kernels.example_steps) in each dtype; a '!' marks shared memory over the arch's
    limit."""
    steps = [step for dtype in dtypes for step in kernels.example_steps(dtype=dtype, **dims).values()]
    rows = triton_resources(triton_launches(lambda: [step() for step in steps]), archs)
    print(f"{'kernel':34s} {'dtype':5s} {'constexprs':56s} warps "
          + " ".join(f"{'sm_' + str(a) + ' smem/regs/stack':>22s}" for a in archs))
    for i in range(0, len(rows), len(archs)):
        group = rows[i:i + len(archs)]
        consts = ",".join(f"{k}={v}" for k, v in group[0]["constexprs"].items() if v is not None)
        cells = [f"{r['shared'] / 1024:6.1f}K{'!' if r['shared'] > r['limit'] else ' '}/{r['regs']}/{r['stack']}"
                 for r in group]
        print(f"{group[0]['kernel']:34s} {group[0]['dtype']:5s} {consts[:56]:56s} {group[0]['num_warps']:5d} "
              + " ".join(f"{c:>22s}" for c in cells))
    return rows


# -----------------------------------------------------------------------------
# Kernel cost, counted on a CPU. Per Triton launch of a mixer's forward + backward: the unique bytes it reads
# and writes, its dot FLOPs and exps, counted by running it in Triton's interpreter with the interpreter's
# builder instrumented (_counting_interpreter), and its sequential steps; these counts are multilinear in the
# batch B, the length T (in whole chunks) and the heads H, so eight small runs (each of B, T, H at two sizes)
# give them exactly at any shape (scaled_counts; a launch whose constexprs or grid change with H is replayed at
# the real H). The launches at the real shape (grids, warps, stages) are recorded on fake tensors, their registers
# and shared memory compiled for sm_90 (triton_resources), and the eager aten ops inside each custom op's body
# counted there too (torch.compile cannot fuse into a custom op), each op as the body calls it (a composite op
# such as einsum by its inputs and outputs). What is estimated, not counted: the time, by analyze.launch_time's
# launch model on an H100 SXM, with the dot instruction each launch's sm_90 PTX uses (kernel_costs, dot_instruction).
# kernel_cost_report (below) runs it on the mixers. Unique bytes are what a launch needs from memory at the least
# (a GPU's caches may not keep every re-read); a dot's FLOPs are 2·M·N·K whatever its operand kind (3xTF32 runs
# three).

H100_SXM = analyze.COST_GPUS["H100"]   # the GPU the report prices each launch on, by analyze.launch_time's model
SM90_LIMITS = dict(registers=65536, shared=233472, threads=2048, blocks=32)        # per SM (CUDA programming guide)


def blocks_per_sm(regs, num_warps, shared, limits=SM90_LIMITS):
    """Resident blocks of one launch per SM: registers are allocated per warp in units of 256 (regs·32 rounded up),
    shared memory per block with 1 KB reserved by the driver; at most limits["threads"] threads and
    limits["blocks"] blocks."""
    by_regs = limits["registers"] // (num_warps * -(-regs * 32 // 256) * 256)
    by_shared = limits["shared"] // (shared + 1024)
    return min(by_regs, by_shared, limits["threads"] // (32 * num_warps), limits["blocks"])


class _LoopSteps(ast.NodeTransformer):
    """Wraps every loop of a kernel (tl.static_range's unrolled ones apart) between the counting builder's
    _cost_loop_enter / _cost_loop_exit, and marks the start of each iteration (_cost_iteration); the builder is
    reached by the name the interpreter itself gives its kernels (interpreter_builder)."""

    def __init__(self, rewrite_assign):
        self.rewrite_assign = rewrite_assign  # the interpreter's own rewrite of the kernel's assignments

    def visit_Assign(self, node):
        return self.rewrite_assign(node)

    @staticmethod
    def hook(name):
        builder = ast.Name(id="interpreter_builder", ctx=ast.Load())
        return ast.Expr(ast.Call(ast.Attribute(builder, name, ast.Load()), args=[], keywords=[]))

    def visit_For(self, node):
        self.generic_visit(node)
        unrolled = isinstance(node.iter, ast.Call) and getattr(node.iter.func, "attr", "") == "static_range"
        if unrolled:
            return node
        node.body.insert(0, self.hook("_cost_iteration"))
        return [self.hook("_cost_loop_enter"), ast.Try(body=[node], handlers=[], orelse=[],
                                                       finalbody=[self.hook("_cost_loop_exit")])]

    visit_While = visit_For


class _LaunchCounts:
    """What one launch touches: the unique addresses it loads and stores (per element size), its dot FLOPs, the
    elements it exponentiates, and the most loop steps one of its programs walks."""

    def __init__(self, kernel, grid, params):
        self.kernel, self.grid, self.params = kernel, grid, params
        self.addresses = {"read": {}, "written": {}}    # element bytes -> [address arrays]
        self.dot_flops = self.exps = self.steps = self.pending = 0
        self.program_steps = self.depth = 0
        self.iteration_open = self.iteration_loaded = False

    def touch(self, kind, ptrs, mask):
        import numpy as np
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        lanes = np.broadcast_to(mask.data, ptrs.data.shape) if mask is not None else None
        addresses = ptrs.data[lanes] if lanes is not None else ptrs.data.ravel()
        pending = self.addresses[kind].setdefault(size, [])
        pending.append(np.asarray(addresses, dtype=np.uint64).ravel())
        self.pending += pending[-1].size
        if self.pending > 1 << 23:  # keep memory bounded: fold what each list holds into its unique addresses
            for arrays in (a for by_size in self.addresses.values() for a in by_size.values()):
                arrays[:] = [np.unique(np.concatenate(arrays))]
            self.pending = 0
        if kind == "read":
            self.iteration_loaded = True

    def close_iteration(self):
        if self.iteration_open and self.iteration_loaded:
            self.program_steps += 1
        self.iteration_open = False

    def next_program(self):
        self.close_iteration()
        self.steps = max(self.steps, self.program_steps)
        self.program_steps, self.depth = 0, 0

    def bytes(self, kind):
        import numpy as np
        return sum(size * len(np.unique(np.concatenate(arrays))) for size, arrays in self.addresses[kind].items())

    def counts(self):
        self.next_program()
        return dict(kernel=self.kernel, params=self.params, programs=math.prod(self.grid), read=self.bytes("read"),
                    written=self.bytes("written"), dot_flops=self.dot_flops, exps=self.exps, steps=max(1, self.steps))


@contextlib.contextmanager
def _counting_interpreter():
    """Triton's interpreter (3.6 and 3.7) with its builder instrumented for counting: this patches the interpreter,
    not the kernels under test, whose every load, store, dot and exp still runs as before. Yields the list that
    collects one _LaunchCounts per launch. Loads and stores count the addresses of their unmasked lanes; atomics
    (none in kernels.py today) read and write theirs; a dot counts 2·M·N·K FLOPs, an exp every element of its tile;
    a program's steps are the iterations of its outermost loops that load from memory (tl.static_range's unrolled
    loops are straight-line code), the launch's the most any program walks."""
    from unittest import mock
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    launches, patched = [], set()   # patched: the modules of the device functions this launch has patched for
    current = lambda: launches[-1]
    run, load, store = interpreter.InterpretedFunction.run, builder.create_masked_load, builder.create_masked_store
    rmw, cas, dot, exp, exp2 = (builder.create_atomic_rmw, builder.create_atomic_cas, builder.create_dot,
                                builder.create_exp, builder.create_exp2)
    set_grid_idx, patch_lang_tensor = builder.set_grid_idx, interpreter._patch_lang_tensor

    def counted_run(self, *args, grid, warmup, **kwargs):
        launches.append(_LaunchCounts(self.fn.__name__, tuple(grid), _launch_params(self.fn, args, kwargs)))
        patched.clear()
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def counted_load(self, ptrs, mask, *rest, **kwargs):
        current().touch("read", ptrs, mask)
        return load(self, ptrs, mask, *rest, **kwargs)

    def counted_store(self, ptrs, value, mask, *rest, **kwargs):
        current().touch("written", ptrs, mask)
        return store(self, ptrs, value, mask, *rest, **kwargs)

    def counted_rmw(self, op, ptr, val, mask, *rest):
        for kind in ("read", "written"):
            current().touch(kind, ptr, mask)
        return rmw(self, op, ptr, val, mask, *rest)

    def counted_cas(self, ptr, *rest):
        for kind in ("read", "written"):
            current().touch(kind, ptr, None)
        return cas(self, ptr, *rest)

    def counted_dot(self, a, b, *rest):
        current().dot_flops += 2 * a.data.size * b.data.shape[-1]   # a [.., M, K] @ b [.., K, N]
        return dot(self, a, b, *rest)

    def counted(fn):
        def exponentiate(self, arg):
            current().exps += arg.data.size
            return fn(self, arg)
        return exponentiate

    def loop_enter(self):
        current().depth += 1

    def iteration(self):
        if current().depth == 1:
            current().close_iteration()
            current().iteration_open, current().iteration_loaded = True, False

    def loop_exit(self):
        current().depth -= 1
        if current().depth == 0:
            current().close_iteration()

    def next_program(self, *idx):
        current().next_program()
        return set_grid_idx(self, *idx)

    def patch_tensor(tensor, scope):   # 3.6's loops took int() of a [1] array, which numpy 2 refuses; 3.7's squeeze
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    # a @triton.jit function called from a kernel: the interpreter patches the triton.language its module sees at
    # every call, the same each time (half the time counted); once a launch and module is enough
    def device_call(self, *args, **kwargs):
        if self.fn.__module__ not in patched:
            patched.add(self.fn.__module__)
            interpreter._patch_lang(self.fn)
        return self.rewrite()(*args, **kwargs)

    patches = dict(create_masked_load=counted_load, create_masked_store=counted_store, create_atomic_rmw=counted_rmw,
                   create_atomic_cas=counted_cas, create_dot=counted_dot, create_exp=counted(exp),
                   create_exp2=counted(exp2), set_grid_idx=next_program, _cost_loop_enter=loop_enter,
                   _cost_iteration=iteration, _cost_loop_exit=loop_exit)
    steps = _LoopSteps(interpreter.ASTTransformer().visit_Assign)
    with contextlib.ExitStack() as stack:
        for name, fn in patches.items():
            stack.enter_context(mock.patch.object(builder, name, fn, create=True))
        stack.enter_context(mock.patch.object(interpreter.InterpretedFunction, "run", counted_run))
        stack.enter_context(mock.patch.object(interpreter.InterpretedFunction, "__call__", device_call))
        stack.enter_context(mock.patch.object(interpreter.FunctionRewriter, "ast_transformer", steps))
        stack.enter_context(mock.patch.object(interpreter.InterpretedFunction, "rewritten_fn", {}))  # fresh rewrites
        stack.enter_context(mock.patch.object(interpreter, "_patch_lang_tensor", patch_tensor))
        yield launches


def _launch_params(fn, args, kwargs):
    """A launch's constexprs and its options (LAUNCH_OPTIONS): what compiles it, as a dict."""
    import inspect
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters}).arguments
    constexprs = {name: bound.get(name) for name, p in signature.parameters.items() if p.annotation is tl.constexpr}
    return {**constexprs, **{k: kwargs[k] for k in kernels.LAUNCH_OPTIONS if k in kwargs}}


def interpreter_counts(step):
    """[dict(kernel, params, programs, read, written, dot_flops, exps, steps)], one per Triton launch of step() in
    launch order, counted in Triton's instrumented interpreter (_counting_interpreter): read and written are unique
    bytes, params the launch's constexprs and options."""
    if not (kernels.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("counting launches needs Triton's interpreter: set TRITON_INTERPRET=1 before Python starts")
    with _counting_interpreter() as launches:
        step()
    return [launch.counts() for launch in launches]


_COUNTED = ("programs", "read", "written", "dot_flops", "exps", "steps")


def _multilinear(corners, lo, hi, at):
    """The value at `at` (a Fraction) of the function that is linear in each coordinate (for (B, T, H):
    a·B·T·H + b·B·T + … + h) and equals corners[c] at each corner c, a tuple of 0 (lo) or 1 (hi) per
    coordinate."""
    from fractions import Fraction
    total = Fraction(0)
    for corner, value in corners.items():
        weight = Fraction(1)
        for i, x, a, b in zip(corner, at, lo, hi):
            weight *= Fraction(x - a, b - a) if i else Fraction(b - x, b - a)
        total += weight * value
    return total


def scaled_counts(counts_at, lo, hi, at):
    """The counts of interpreter_counts at the shape `at`, each the multilinear function (_multilinear) through the
    shapes whose every coordinate is at lo or hi; counts_at(shape) gives interpreter_counts there, the same kernels
    in the same order at every shape. params is None where it differs between the shapes, a count None where it
    comes out a fraction (work that does not scale multilinearly: a grid of ⌈rows / block⌉ programs, say);
    corners holds the counts at each shape."""
    runs = {corner: counts_at(tuple(h if i else l for i, l, h in zip(corner, lo, hi)))
            for corner in itertools.product((0, 1), repeat=len(lo))}
    names = {corner: [c["kernel"] for c in counts] for corner, counts in runs.items()}
    if len({tuple(n) for n in names.values()}) != 1:
        raise ValueError(f"the launches differ between the shapes {lo} and {hi}: {names}")
    scaled = []
    for i, first in enumerate(next(iter(runs.values()))):
        values = {key: _multilinear({c: runs[c][i][key] for c in runs}, lo, hi, at) for key in _COUNTED}
        params = first["params"] if all(runs[c][i]["params"] == first["params"] for c in runs) else None
        scaled.append(dict(kernel=first["kernel"], params=params, corners={c: runs[c][i] for c in runs},
                           **{k: int(v) if v.denominator == 1 else None for k, v in values.items()}))
    return scaled


def _unique_bytes(t):
    """Bytes of t's elements, each once: a broadcast (stride-0) dimension adds none (t's layout is taken as
    non-overlapping otherwise)."""
    return t.element_size() * math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0)


def _eager_op_bytes(by_op=None):
    """A TorchDispatchMode that sums, into .bytes (and by_op[op name], if given), what the aten ops it sees read
    (each input tensor's elements) and write (each output tensor). This file's custom ops move what their bodies do
    (counted there, analyze.record_launches' around_body). Moving nothing: an op whose outputs are all views of its
    inputs (a view, a reshape or .contiguous() that needs no copy, .to() its own dtype) unless it mutates them,
    allocations, and ops that return no tensor (a tensor's device)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    free = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
            torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default}
    tensors = lambda tree: [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    storage = lambda t: StorageWeakRef(t.untyped_storage())

    class EagerBytes(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins, outs = tensors((args, kwargs)), tensors(out)
            views = {storage(t) for t in ins}.issuperset(storage(t) for t in outs) and not func._schema.is_mutable
            if outs and not views and func not in free and func.namespace != "specgpt":  # Triton ops: their bodies
                moved = sum(_unique_bytes(t) for t in ins + outs)
                self.bytes += moved
                if by_op is not None:
                    by_op[str(func)] += moved
            return out
    return EagerBytes()


class _TensorSpec:
    """A fake tensor argument of a recorded launch, as what replays it needs: its storage (an id shared by the
    arguments that alias one) and its view of it."""

    def __init__(self, t, storages):
        storage = t.untyped_storage()
        self.storage = storages.setdefault(id(storage), (len(storages), storage.nbytes()))
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.shape, t.stride()


def replay_counts(launch):
    """interpreter_counts of one launch recorded by real_launches (its kernel, grid and arguments), run again on CPU
    tensors of its own shapes, strides and aliasing (zeros): exact at any shape, at the interpreter's speed."""
    storages = {}

    def real(arg):
        if not isinstance(arg, _TensorSpec):
            return arg
        key, nbytes = arg.storage
        storage = storages.setdefault(key, torch.zeros(nbytes, dtype=torch.uint8).untyped_storage())
        return torch.empty(0, dtype=arg.dtype).set_(storage, arg.offset, arg.size, arg.stride)
    args, kwargs = [real(a) for a in launch["args"]], {k: real(v) for k, v in launch["kwargs"].items()}
    return interpreter_counts(lambda: launch["fn"][launch["grid"]](*args, **kwargs))[0]


def real_launches(step, signatures=False):
    """(launches, eager): step()'s Triton launches recorded on fake tensors (analyze.record_launches), in order,
    each dict(kernel name, fn, grid, params, options, args and kwargs (tensors as _TensorSpec), and with
    signatures=True also signature, constexprs: what triton.compile takes, not available in the interpreter), and
    {custom op: bytes its body's aten ops move}."""
    launches, eager, storages = [], collections.Counter(), {}
    spec = lambda a: _TensorSpec(a, storages) if isinstance(a, torch.Tensor) else a

    def record(kernel, grid, args, kwargs):
        launch = dict(kernel=kernel.fn.__name__, fn=kernel, grid=grid, params=_launch_params(kernel.fn, args, kwargs),
                      options={k: kwargs[k] for k in kernels.LAUNCH_OPTIONS if k in kwargs},
                      args=[spec(a) for a in args], kwargs={k: spec(v) for k, v in kwargs.items()})
        if signatures:
            signature = _launch_signature(kernel, args, kwargs)
            launch["signature"], launch["constexprs"], launch["attrs"] = signature[:3]
        launches.append(launch)

    @contextlib.contextmanager
    def count_eager(name):
        with _eager_op_bytes() as mode:
            yield
        eager[name] += mode.bytes

    analyze.record_launches(step, record, count_eager)
    return launches, dict(eager)


def step_bytes(step):
    """{op or kernel name: bytes} that step() (making its tensors itself) moves, on fake tensors: every aten op by
    _eager_op_bytes' rules, inside the Triton ops' bodies too, and every Triton launch by its tensor arguments, each
    element once (exact for a kernel that touches every element of its arguments once, as rms_norm's and rope's do;
    a lower bound for one that re-reads, and no substitute for the interpreter's counts of the recurrences)."""
    moved = collections.Counter()

    def record(kernel, grid, args, kwargs):
        views = {(id(t.untyped_storage()), t.storage_offset(), t.shape, t.stride()): t
                 for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        moved[kernel.fn.__name__] += sum(_unique_bytes(t) for t in views.values())

    def run():
        with _eager_op_bytes(moved):
            step()
    analyze.record_launches(run, record, lambda name: _eager_op_bytes(moved))
    return dict(moved)


def sm90_resources(step):
    """[dict(regs, shared, stack)] per Triton launch of step() (recorded on fake tensors), compiled for sm_90, each
    distinct launch once; in a process that imported triton without the interpreter (in_compiling_python)."""
    launches, _ = real_launches(step, signatures=True)
    rows = triton_resources([(l["fn"], l["signature"], l["constexprs"], l["attrs"], l["options"]) for l in launches],
                            archs=(90,))
    return [{k: row[k] for k in ("regs", "shared", "stack")} for row in rows]


def dot_instruction(ptx):
    """The instruction a launch's dots run as, from its PTX: mma (mma.sync, where any dot takes it: the slower path
    sets the rate), else wgmma, else fma (no tensor-core instruction: Triton lowered the dots to CUDA-core FMAs)."""
    return "mma" if "mma.sync" in ptx else "wgmma" if "wgmma.mma_async" in ptx else "fma"


@functools.lru_cache(maxsize=None)
def _compiled_dot_instruction(kernel, signature, constexprs, attrs, options, arch):
    """dot_instruction of one launch compiled for sm_<arch> (_compiled, as triton_resources compiles it)."""
    return dot_instruction(_compiled(kernel, signature, constexprs, attrs, options, arch).asm["ptx"])


def sm90_dot_instructions(step):
    """[dot_instruction] per Triton launch of step() (recorded on fake tensors), compiled for sm_90 as the JIT
    specialises it (Triton's disk cache holds the compiles of sm90_resources); in a process that imported triton
    without the interpreter."""
    launches, _ = real_launches(step, signatures=True)
    jobs = [(l["fn"], *(tuple(l[k].items()) for k in ("signature", "constexprs", "attrs", "options")))
            for l in launches]
    return forked_map(lambda job: _compiled_dot_instruction(*job, 90), jobs)


def in_compiling_python(program):
    """The JSON value that a Python program prints last, run in a fresh Python without Triton's interpreter, so that
    kernels compile (the interpreter's cannot); the program imports what it needs, triton before this file."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", program], cwd=HERE, env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"compiling for sm_90 failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def kernel_costs(step_at, lo, hi, at, resources=None, gpu=H100_SXM):
    """(rows, eager) for the step step_at(B, T, H) at `at` = (B, T, H), from the shapes with each coordinate at lo
    or hi. rows: one dict per Triton launch, in order: kernel, grid, read and written (unique bytes), dot_flops,
    exps, steps, num_warps, num_stages, counted: scaled from the eight small shapes (scaled_counts), or, for a launch
    whose constexprs or grid do not scale with H, replayed at the real H and the four small (B, T) and scaled in
    those (a count that still does not scale is None: rms_norm's persistent backward's steps, whose grid is 4
    programs on a CPU, 4 per SM on a GPU; steps that grow with the batch are those of a loop over such a grid, not a
    serial chain, and are None too). With resources (sm90_resources of the same step, each with its
    dot_instruction as "instruction") also regs, shared, stack, instruction and the estimate: blocks_per_sm and
    analyze.launch_time's waves, bandwidth_fraction, t_bytes, t_flops, t_latency, bound and time on `gpu`. eager:
    {custom op: bytes its body's aten ops move}, counted on fake tensors at `at`."""
    B, T, heads = at
    recorded = functools.lru_cache(maxsize=None)(lambda shape: real_launches(step_at(*shape))[0])
    counts = scaled_counts(lambda shape: interpreter_counts(step_at(*shape)), lo, hi, at)
    launches, eager = real_launches(step_at(*at))
    if [c["kernel"] for c in counts] != [launch["kernel"] for launch in launches]:
        raise ValueError(f"the launches at {at} are not those of the small shapes")
    rows = []
    for i, (c, launch) in enumerate(zip(counts, launches)):
        if c["params"] != launch["params"] or c["programs"] != math.prod(launch["grid"]):
            # its constexprs or grid change with the heads (rms_norm over Mamba2's inner width, a grid of row blocks):
            # this launch alone, replayed at the real heads, scaled in B and T
            replayed = lambda shape: [replay_counts(recorded((*shape, heads))[i])]
            c = scaled_counts(replayed, lo[:2], hi[:2], (B, T))[0]
            if c["params"] != launch["params"]:
                raise ValueError(f"{launch['kernel']}'s constexprs change with B and T: not counted")
        if c["read"] is None or c["written"] is None:
            raise ValueError(f"{launch['kernel']}'s bytes do not scale with the shape")
        if any(n["steps"] != c["corners"][(1, *rest)]["steps"] for (b, *rest), n in c["corners"].items() if not b):
            c["steps"] = None   # steps that grow with the batch: a loop over a device-sized (persistent) grid
        rows.append(dict(c, programs=math.prod(launch["grid"]), grid=launch["grid"],
                         num_warps=launch["options"].get("num_warps", 4),
                         num_stages=launch["options"].get("num_stages", 3)))
    for row, found in zip(rows, resources or []):
        row.update(found, blocks_per_sm=blocks_per_sm(found["regs"], row["num_warps"], found["shared"]))
        # a persistent grid's loop (steps None) walks independent rows: no dependent chain, one step
        row.update(analyze.launch_time(gpu, row["read"] + row["written"], row["dot_flops"] or 0, row["instruction"],
                                       row["programs"], max(1, row["blocks_per_sm"]), max(1, row["steps"] or 1),
                                       row["num_stages"]))
    return rows, eager


def cost_totals(rows, eager, gpu=H100_SXM):
    """One step's totals from kernel_costs: launches, Triton bytes (read + written), eager bytes, dot FLOPs and exps
    (of the launches that have them counted), the most steps of a launch, and (with resources) the estimated time:
    the launches' (each with its launch overhead) plus the eager bytes at analyze.STREAM_FRACTION of the bandwidth
    (their own launches left out)."""
    known = lambda key: [r[key] for r in rows if r[key] is not None]
    totals = dict(launches=len(rows), triton=sum(r["read"] + r["written"] for r in rows), eager=sum(eager.values()),
                  dot_flops=sum(known("dot_flops")), exps=sum(known("exps")), steps=max(known("steps"), default=1))
    if all("time" in r for r in rows):
        totals["time"] = sum(r["time"] for r in rows) + totals["eager"] / (analyze.STREAM_FRACTION * gpu["bandwidth"])
    return totals


def _shown(value, unit, width, digits):
    """value / unit in a column of `width`, or – where it was not counted."""
    return f"{'–':>{width}s}" if value is None else f"{value / unit:{width}.{digits}f}"


def print_kernel_costs(reports, shape):
    """Print kernel_costs' rows and eager bytes of each {name: (title, rows, eager)} (per launch: counted; its time on
    an H100 SXM: estimated, where the rows have it), then their totals; `shape` says what was run."""
    resources = all("time" in r for _, rows, _ in reports.values() for r in rows)
    for title, rows, eager in reports.values():
        print(f"\n== {title}: {shape}, per Triton launch (counted)" + (" and its time on an H100 SXM (estimated by "
                                                                       "analyze.launch_time's model)"
                                                                       if resources else "") + " ==")
        print(f"{'kernel':30s} {'grid':>12s} {'read MB':>9s} {'write MB':>9s} {'GFLOP':>7s} {'Mexp':>7s} {'steps':>5s} "
              f"{'warps':>5s} {'stages':>6s}" + (f" {'regs':>4s} {'smem KB':>7s} {'blk/SM':>6s} {'waves':>5s} "
                                                 f"{'dots':>5s} {'BW %':>4s} {'est us':>7s} bound"
                                                 if resources else ""))
        for r in rows:
            line = (f"{r['kernel']:30s} {'x'.join(map(str, r['grid'])):>12s} {r['read'] / 1e6:9.1f} "
                    f"{r['written'] / 1e6:9.1f} {_shown(r['dot_flops'], 1e9, 7, 2)} {_shown(r['exps'], 1e6, 7, 1)} "
                    f"{_shown(r['steps'], 1, 5, 0)} {r['num_warps']:5d} {r['num_stages']:6d}")
            if resources:
                line += (f" {r['regs']:4d} {r['shared'] / 1024:7.1f} {r['blocks_per_sm']:6d} {r['waves']:5d} "
                         f"{r['instruction']:>5s} {100 * r['bandwidth_fraction']:4.0f} {r['time'] * 1e6:7.1f} "
                         f"{r['bound']}")
            print(line)
        print("– not counted (kernel_costs says why); eager aten ops inside the custom ops: " + (", ".join(
            f"{op} {n / 1e6:.1f} MB" for op, n in sorted(eager.items(), key=lambda kv: -kv[1]) if n) or "none"))
    print(f"\n== totals, {shape}: bytes and FLOPs counted" + (", time estimated" if resources else "") + " ==")
    print(f"{'name':5s} {'launches':>8s} {'Triton GB':>9s} {'eager GB':>8s} {'total GB':>8s} {'dot GFLOP':>9s} "
          f"{'Gexp':>6s} {'most steps':>10s}" + (f" {'est us':>7s}" if resources else ""))
    for name, (_, rows, eager) in reports.items():
        t = cost_totals(rows, eager)
        print(f"{name:5s} {t['launches']:8d} {t['triton'] / 1e9:9.2f} {t['eager'] / 1e9:8.2f} "
              f"{(t['triton'] + t['eager']) / 1e9:8.2f} {t['dot_flops'] / 1e9:9.1f} {t['exps'] / 1e9:6.2f} "
              f"{t['steps']:10d}" + (f" {t['time'] * 1e6:7.0f}" if resources else ""))


# The mixers of the kernel cost report (kernel_costs): GPTConfig keys for H heads and the heads it reports
# (the hybrid preset's G and A: 704 wide, 11 heads of 64; Mamba2 at GPT-2 small's 768: 48 heads of 32, state 64)
COST_MIXERS = {"G": (lambda H: dict(n_embd=64 * H, n_head=H, gdn_variant="gdn2", gdn_expand_v=1), 11),
               "M": (lambda H: dict(n_embd=16 * H, n_head=1, mamba_expand=2, mamba_headdim=32, mamba_d_state=64), 48),
               "A": (lambda H: dict(n_embd=64 * H, n_head=H, qk_norm=True, rope="fixed", attention="sdpa"), 11)}


def mixer_cost_step(mixer, B, T, H, dtype=torch.bfloat16):
    """A thunk that builds one `mixer` (a letter of COST_MIXERS) with H heads, kernels="triton", and runs it forward
    and backward on a [B, T, n_embd] input under autocast to dtype (none for fp32). GPTConfig's other keys keep
    their defaults (the chunk lengths among them): the report is of the model as it is configured."""
    cfg = GPTConfig(block_size=T, mixer=mixer, kernels="triton", **COST_MIXERS[mixer][0](H))

    def step():
        torch.manual_seed(0)
        layer = MIXERS[mixer](cfg)
        x = torch.randn(B, T, cfg.n_embd).to(dtype).requires_grad_()
        rope = model.rope_cache(T, cfg.n_embd // cfg.n_head, cfg.rope_base)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y = layer(x, rope)
        y.backward(torch.randn_like(y))
    return step


def kernel_cost_rows(mixer, B=16, T=1024, dtype=torch.bfloat16, resources=True):
    """kernel_costs of one `mixer` forward + backward at [B, T] and its report's heads, counted in Triton's
    interpreter (TRITON_INTERPRET=1) at the smallest shapes of an affine fit: B 1 and 2, the two shortest lengths
    of whole chunks past 64 (gdn2's fused recurrent kernel takes T ≤ 64), 1 and 2 heads (a launch that serves a
    group of heads a program, ssd's dCB and dB/dC, changes its grid or constexprs with H and is replayed at the
    real heads); with resources, compiled for sm_90 in a Python of its own."""
    heads = COST_MIXERS[mixer][1]
    chunk = {"G": GPTConfig().gdn_chunk_size, "M": GPTConfig().chunk_size}.get(mixer, 16)
    short = chunk * (64 // chunk + 1)
    found = None
    if resources:
        found = in_compiling_python(
            "import json, torch, triton, bench; print(json.dumps(bench.sm90_resources("
            f"bench.mixer_cost_step({mixer!r}, {B}, {T}, {heads}, {dtype}))))")
        instructions = in_compiling_python(
            "import json, torch, triton, bench; print(json.dumps(bench.sm90_dot_instructions("
            f"bench.mixer_cost_step({mixer!r}, {B}, {T}, {heads}, {dtype}))))")
        found = [dict(f, instruction=i) for f, i in zip(found, instructions)]
    return kernel_costs(lambda b, t, h: mixer_cost_step(mixer, b, t, h, dtype), (1, short, 1),
                        (2, short + chunk, 2), (B, T, heads), found)


def kernel_cost_report(mixers="GMA", B=16, T=1024, dtype=torch.bfloat16, resources=True, save=None):
    """Print kernel_cost_rows for each mixer (its launches, the eager bytes inside its custom ops) and their totals;
    returns {mixer: (rows, eager)}. With save (a path), also writes {mixer: [[kernel, estimated s, bound], ...]} there
    as JSON, for measured_beside_estimated."""
    import json
    reports = {}
    for m in mixers:
        keys, heads = COST_MIXERS[m][0](COST_MIXERS[m][1]), COST_MIXERS[m][1]
        reports[m] = (f"{m} ({keys['n_embd']} wide, {heads} heads)", *kernel_cost_rows(m, B, T, dtype, resources))
    print_kernel_costs(reports, f"one layer forward + backward, B={B} T={T} {str(dtype).split('.')[-1]}")
    if save:
        with open(save, "w") as f:
            json.dump({m: [[r["kernel"], r["time"], r["bound"]] for r in rows] for m, (_, rows, _) in reports.items()},
                      f)
    return {m: report[1:] for m, report in reports.items()}


def measured_kernel_times(mixer, B=16, T=1024, dtype=torch.bfloat16, repeats=5):
    """[(kernel, seconds)] per Triton launch, in order, of one `mixer` layer (COST_MIXERS' heads) forward + backward at
    [B, T] on this GPU under autocast to dtype: torch.profiler's CUDA kernel times, each launch's median over
    `repeats` steps after a warm-up one (which compiles)."""
    from torch.profiler import ProfilerActivity, profile
    heads = COST_MIXERS[mixer][1]
    cfg = GPTConfig(block_size=T, mixer=mixer, kernels="triton", **COST_MIXERS[mixer][0](heads))
    layer = MIXERS[mixer](cfg).cuda()
    x = torch.randn(B, T, cfg.n_embd, device="cuda").to(dtype).requires_grad_()   # as mixer_cost_step's
    rope = tuple(t.cuda() for t in model.rope_cache(T, cfg.n_embd // cfg.n_head, cfg.rope_base))
    names = {name for name, fn in vars(kernels).items() if isinstance(fn, triton.runtime.jit.JITFunction)}

    def step():
        with torch.autocast("cuda", dtype=dtype):
            y = layer(x, rope)
        y.backward(torch.ones_like(y))
    step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        runs.append([(e.name, e.time_range.elapsed_us() * 1e-6) for e in prof.events()
                     if e.device_type.name == "CUDA" and e.name in names])
    return [(launch[0][0], statistics.median(seconds for _, seconds in launch)) for launch in zip(*runs)]


def print_measured_beside_estimated(estimated, measured):
    """Print, per Triton launch in order, the launch model's estimate (estimated: [[kernel, seconds, bound]]) beside
    the time measured (measured: [(kernel, seconds)], measured_kernel_times) and their ratio; then the sums. A launch
    list that differs by kernel is a one-line error (the two runs must be of the same code)."""
    if [e[0] for e in estimated] != [m[0] for m in measured]:
        raise ValueError(f"the measured launches {[m[0] for m in measured]} are not the estimated ones "
                         f"{[e[0] for e in estimated]}: measure and estimate the same version")
    print(f"{'kernel':34s} {'est us':>8s} {'bound':>7s} {'measured us':>11s} {'measured/est':>12s}")
    for (kernel, estimate, bound), (_, seconds) in zip(estimated, measured):
        print(f"{kernel:34s} {estimate * 1e6:8.1f} {bound:>7s} {seconds * 1e6:11.1f} {seconds / estimate:12.2f}")
    total_est, total = sum(e[1] for e in estimated), sum(m[1] for m in measured)
    print(f"{'all launches':34s} {total_est * 1e6:8.1f} {'':>7s} {total * 1e6:11.1f} {total / total_est:12.2f}")


def measured_beside_estimated(path, B=16, T=1024):
    """On a GPU: for each mixer that kernel_cost_report saved to path, print_measured_beside_estimated of its launches
    measured here (the estimate is an H100 SXM's: on another GPU the ratio is that GPU's against it)."""
    import json
    with open(path) as f:
        estimated = json.load(f)
    for mixer, rows in estimated.items():
        print(f"\n== {mixer}: one layer forward + backward, B={B} T={T} bf16, on {torch.cuda.get_device_name()}: "
              "each Triton launch measured (torch.profiler) beside the H100 SXM estimate ==")
        print_measured_beside_estimated(rows, measured_kernel_times(mixer, B, T))


# -----------------------------------------------------------------------------
# python bench.py kernels: every op's paths against its reference and the chunked paths' speed against the token
# loops (errors_and_speed), then the Triton side (triton_report): a walk through the softmax teaching kernel,
# every Triton op against its reference (outputs and all input gradients), and on a GPU the benchmark (T = 2048,
# 8 heads of 64, forward+backward; RMSNorm bandwidth). On a CPU the kernels run in Triton's interpreter
# (TRITON_INTERPRET=1), which is slow, so shapes are tiny there.

# dense HBM bandwidth of common GPUs in GB/s (spec sheets), for RMSNorm's "% of peak"
_GPU_PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
                  "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600,
                  "RTX 4090": 1008, "RTX 3090": 936, "V100": 900, "T4": 320}


def triton_report(device):
    if not kernels.HAS_TRITON:
        print("Triton is not loaded: on a CPU run `TRITON_INTERPRET=1 python bench.py kernels` (Triton's interpreter)")
        return
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    # 1. the teaching kernel
    R, N = 5, 37
    x = randn(R, N) * 3
    block_n = triton.next_power_of_2(N)
    print("\n== softmax_triton, the fused softmax of the Triton tutorial ==")
    print(f"x is [{R}, {N}]. Each row fits in one block of BLOCK_N = next_power_of_2({N}) = {block_n} lanes; the\n"
          f"{block_n - N} lanes past the row end load -inf, so they add exp(-inf) = 0 to the sum. A persistent grid\n"
          f"of {kernels._programs_for(x, R)} programs walks the rows (program i takes rows i, i + P, ...).\n"
          f"Per row: one load, max, exp(x - max), sum, divide, one store: HBM traffic 2·R·N·4 bytes, where the\n"
          f"unfused torch version reads and writes the [R, N] tensor about 4 times. Backward: dx = y·(dy − Σ dy·y),\n"
          f"again one pass over y and dy.")
    y = kernels.softmax_triton(x)
    print(f"row sums {[round(s, 6) for s in y.sum(-1).tolist()]}; max |softmax_triton − softmax_ref| = "
          f"{(y - kernels.softmax_ref(x)).abs().max().item():.1e}")

    # 2. errors against the references, forward and backward
    def errors(fn_tri, fn_ref, inputs):
        results = []
        for fn in (fn_tri, fn_ref):
            leaves = {k: a.detach().clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() else a
                      for k, a in inputs.items()}
            outs = fn(**leaves)
            outs = outs if isinstance(outs, tuple) else (outs,)
            results.append((leaves, outs))
        cot = [torch.randn(o.shape, device=device, generator=gen) for o in results[1][1]]
        for leaves, outs in results:
            sum((o.float() * c).sum() for o, c in zip(outs, cot)).backward()
        pairs = [(f"out{i}", a, b) for i, (a, b) in enumerate(zip(results[0][1], results[1][1]))]
        pairs += [(f"d{k}", results[0][0][k].grad, b.grad) for k, b in results[1][0].items()
                  if torch.is_tensor(b) and b.grad is not None]
        return [(name, (a.float() - b.float()).abs().max().item(),
                 ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()) for name, a, b in pairs]

    small = device == "cpu"
    cases = [(name, op, *op.compare(randn)) for name, op in kernels.OPS.items() if op.triton is not None]
    print(f"\n== Triton vs <op>_ref on {device}{' (interpreter)' if small else ''}, fp32: "
          "max abs / relative RMS error ==")
    print("at each OPS row's compare inputs; out* are outputs, d<name> the gradient of that input")
    for name, op, call, inputs in cases:
        errs = errors(functools.partial(call, op.triton), functools.partial(call, op.ref), inputs)
        print(f"  {name:16s} " + "  ".join(f"{n} {m:.1e}/{r:.1e}" for n, m, r in errs))
    if device != "cuda":
        return

    # 3. GPU timings: each OPS row's example (its inputs as the model feeds them under bf16 autocast: activations and
    # gates in bf16, decays, dt and angles in fp32) forward and backward through each path, made on the GPU
    from triton.testing import do_bench
    dims = kernels.ExampleDims(B=4, T=2048, H=8, K=64, V=64, heads_ssd=8, p=64, n=64, chunk=64)
    print(f"\n== forward+backward of each OPS row's example in bf16 at B={dims.B} T={dims.T} H={dims.H} head dim "
          f"{dims.K}, ssd's {dims.heads_ssd} heads of {dims.p}, state {dims.n}, chunk {dims.chunk} (ms, median of "
          "do_bench, each run making its inputs; (n x) = time / Triton's) ==")
    with torch.device(device):
        for name, op in kernels.OPS.items():
            if op.triton is None:
                continue
            t_tri = do_bench(op.example(torch.bfloat16, dims, op.triton))
            t_torch = do_bench(op.example(torch.bfloat16, dims, op.torch))
            try:
                t_compiled = do_bench(op.example(torch.bfloat16, dims, torch.compile(op.torch)))
                compiled = f"torch.compile {t_compiled:7.3f} ms ({t_compiled / t_tri:5.1f}x)"
            except Exception as e:  # a compiler failure should not hide the other numbers
                compiled = f"torch.compile failed: {type(e).__name__}"
            print(f"  {name:16s} triton {t_tri:7.3f} ms | torch {t_torch:7.3f} ms ({t_torch / t_tri:5.1f}x) | "
                  f"{compiled}")

    rows, C = 16384, 4096
    x = randn(rows, C).to(torch.bfloat16)
    w = torch.ones(C, device=device, dtype=torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()              # read x, write y
    t_fwd = do_bench(lambda: kernels.rms_norm_triton(x, w, 1e-6))
    t_copy = do_bench(lambda: x.clone())
    t_torch = do_bench(lambda: kernels.rms_norm_torch(x, w, 1e-6))
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in _GPU_PEAK_GBPS.items() if k in name), None)
    gbps = nbytes / t_fwd / 1e6
    print(f"\n== RMSNorm forward, [{rows}, {C}] bf16 on {name} ==")
    print(f"  triton {t_fwd * 1e3:7.1f} us = {gbps:6.0f} GB/s"
          + (f" = {100 * gbps / peak:4.1f}% of the {peak} GB/s spec peak" if peak else " (peak unknown for this GPU)")
          + f"; x.clone() {nbytes / t_copy / 1e6:6.0f} GB/s; torch path {t_torch / t_fwd:4.1f}x slower")


def errors_and_speed(device):
    """Every op's paths against <op>_ref, and the chunked paths' speed against the token loops (best of 3)."""
    torch.manual_seed(0)
    paths = ["torch"] + [p for p in ("triton",) if device == "cuda" and kernels.HAS_TRITON]

    def rand(*shape, lo=None, hi=None):
        t = torch.randn(*shape, device=device) if lo is None else lo + (hi - lo) * torch.rand(*shape, device=device)
        return t

    def best_time(fn, repeats=3):
        fn()
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    print(f"device {device}; errors against <op>_ref at each OPS row's compare inputs")
    for name, op in kernels.OPS.items():
        if op.triton is None:   # a row without a Triton path has no compare inputs (kernels.Op)
            continue
        call, inputs = op.compare(lambda *shape: torch.randn(*shape, device=device))
        want = call(op.ref, **inputs)
        want = want if isinstance(want, tuple) else (want,)
        for path in paths:
            got = call(getattr(op, path), **inputs)
            got = got if isinstance(got, tuple) else (got,)
            for part, (a, b) in enumerate(zip(got, want)):
                err = (a.float() - b.float())
                print(f"  {name:16s} {path:6s} out{part}: max abs {err.abs().max().item():.2e}  "
                      f"rel RMS {(err.norm() / b.float().norm()).item():.2e}")

    # the chunked paths of the two recurrent mixers, gdn2 and ssd, against their token loops
    B, T, H, K, V = 2, 512, 4, 64, 64
    gates = (rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, H, V),
             rand(B, T, H, K, lo=-1.0, hi=-0.01), rand(B, T, H, K, lo=0.0, hi=1.0), rand(B, T, H, V, lo=0.0, hi=1.0))
    ssd_in = (rand(B, T, H, V), F.softplus(rand(B, T, H) - 2), -rand(H, lo=1.0, hi=4.0), rand(B, T, 1, 32),
              rand(B, T, 1, 32), rand(H))
    print(f"speed at T={T} (best of 3; ratio = token loop time / chunked time)")
    b1, h1, d1 = 1, 2, 32                                         # a small shape next to the main one
    small_gates = (rand(b1, T, h1, d1), F.normalize(rand(b1, T, h1, d1), dim=-1), rand(b1, T, h1, d1),
                   rand(b1, T, h1, d1, lo=-1.0, hi=-0.01), rand(b1, T, h1, d1, lo=0.0, hi=1.0),
                   rand(b1, T, h1, d1, lo=0.0, hi=1.0))
    small_ssd = (rand(b1, T, h1, d1), F.softplus(rand(b1, T, h1) - 2), -rand(h1, lo=1.0, hi=4.0),
                 rand(b1, T, 1, 32), rand(b1, T, 1, 32), rand(h1))
    for name, inputs, shape in (("gdn2", small_gates, f"B={b1} H={h1} K=V={d1}"),
                                ("gdn2", gates, f"B={B} H={H} K=V={K}"),
                                ("ssd", small_ssd, f"b={b1} h={h1} p={d1} n=32"),
                                ("ssd", ssd_in, f"b={B} h={H} p={V} n=32")):
        ref_fn = kernels.OPS[name].ref
        for path in paths:
            fn = getattr(kernels.OPS[name], path)
            with torch.no_grad():
                t_ref, t_fast = best_time(lambda: ref_fn(*inputs), 1), best_time(lambda: fn(*inputs))
            print(f"  {name:5s} {path:6s} {shape:19s} forward:          {t_ref * 1e3:8.1f} ms vs "
                  f"{t_fast * 1e3:7.2f} ms = {t_ref / t_fast:6.1f}x")
            leaves = [t.detach().requires_grad_() for t in inputs]

            def train_step(f):
                out, state = f(*leaves)
                (out.float().sum() + state.sum()).backward()
            t_ref, t_fast = best_time(lambda: train_step(ref_fn), 1), best_time(lambda: train_step(fn))
            print(f"  {name:5s} {path:6s} {shape:19s} forward+backward: {t_ref * 1e3:8.1f} ms vs "
                  f"{t_fast * 1e3:7.2f} ms = {t_ref / t_fast:6.1f}x")


# -----------------------------------------------------------------------------
# The model's speed: forward + backward + AdamW throughput at nanoGPT's CPU recipe shape (4 layers, 4 heads, 128
# dims, block 64, batch 12, char vocabulary) for each mixer kind, against a baseline timed in the same rounds: a
# GPT-2-style model (learned positions, LayerNorm, fused qkv, GELU, no biases: nanoGPT's architecture under its
# train.py defaults), written here only as a yardstick. Rounds alternate; the median of the per-round ratios is
# robust to this machine's drift. nanogpt_recipe instead trains the yardstick with nanoGPT's CPU recipe, to time
# against `python train.py` run alongside; residual_kinds times every residual kind's training step against `res`.

class GPT2Block(nn.Module):
    def __init__(self, C, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
        self.qkv, self.proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.fc, self.fc_out = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3 * self.n_head, -1).transpose(1, 2).split(self.n_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT2(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([GPT2Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(net, B, T, V):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    idx = torch.randint(0, V, (B, T))

    def step():
        _, loss = net(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(5):
        step()
    return step


def nanogpt_recipe(seed=1337):
    """nanoGPT's shakespeare_char CPU recipe, lr-tuned, on the yardstick (seed: its init and training batches, as
    train.py's --seed): nanoGPT's init (std 0.02, residual
    projections 0.02/sqrt(2·n_layer)), batch 12 x 64, 2000 iterations, AdamW (lr 3e-3, betas (0.9, 0.99),
    weight decay 0.1 on matrices), 100 warmup steps then a cosine to 3e-4, gradient clip 1, an eval of 20
    train and 20 val batches every 250 iterations. Prints its wall time and, untimed, the val loss on
    train.py's fixed validation batches (20 of 24 x 64, seed 0), so the two runs' losses compare."""
    import data
    train_tokens, val_tokens, _ = data.load_dataset("shakespeare_char")
    torch.manual_seed(seed)
    net = GPT2(84, 64, 4, 4, 128)
    for name, p in net.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * 4) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.99))
    samplers = {"train": data.BatchSampler(train_tokens, 12, 64, seed=seed),
                "val": data.BatchSampler(val_tokens, 12, 64, seed=1)}

    @torch.no_grad()
    def mean_loss(sampler, batches):
        net.eval()
        loss = sum(net(*sampler.next_batch())[1].item() for _ in range(batches)) / batches
        net.train()
        return loss
    t0 = time.perf_counter()
    for it in range(2001):
        if it % 250 == 0:
            print(f"iter {it}: train {mean_loss(samplers['train'], 20):.4f}, "
                  f"val {mean_loss(samplers['val'], 20):.4f}, {time.perf_counter() - t0:.1f}s")
        if it == 2000:
            break
        lr = (3e-3 * (it + 1) / 101 if it < 100
              else 3e-4 + 0.5 * (1 + math.cos(math.pi * (it - 100) / 1900)) * (3e-3 - 3e-4))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = net(*samplers["train"].next_batch())[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    val = mean_loss(data.BatchSampler(val_tokens, 24, 64, seed=0), 20)
    print(f"nanoGPT recipe: {seconds:.1f}s wall for 2000 iterations and evals, "
          f"val loss {val:.4f} on train.py's validation batches")


# -----------------------------------------------------------------------------
# Repeated runs and their spread: each setting (train.py arguments) trained with n seeds, then mean ± sd of the final
# val loss and bpb, and Welch's t-test between each pair of settings. The p-value is computed here (no scipy): the
# Student t tail through the regularized incomplete beta function, as a continued fraction.

def incomplete_beta(x, a, b):
    """I_x(a, b), the regularized incomplete beta function, by its continued fraction (Abramowitz & Stegun 26.5.8),
    evaluated with the modified Lentz method; on the side x > (a + 1)/(a + b + 2) through I_x(a, b) =
    1 − I_{1−x}(b, a), where the fraction converges fast."""
    if x <= 0.0 or x >= 1.0:
        return min(max(x, 0.0), 1.0)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(1.0 - x, b, a)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)) / a
    # modified Lentz on 1 / (1 + d1 / (1 + d2 / (1 + ...))): numerators 1, d1, d2, ..., every denominator 1
    tiny = 1e-300
    f, c, d = tiny, tiny, 0.0
    for j in range(1, 500):
        m = (j - 1) // 2
        if j == 1:
            numerator = 1.0
        elif j % 2 == 0:  # d_{2m+1}
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:  # d_{2m}
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + numerator * d
        c = 1.0 + numerator / c
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if j > 1 and abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def student_t_two_sided(t, df):
    """P(|T| ≥ |t|) for Student's t with df degrees of freedom: I_{df/(df+t²)}(df/2, 1/2)."""
    return incomplete_beta(df / (df + t * t), df / 2, 0.5)


def welch_test(a, b):
    """Welch's t-test of two samples (each at least 2 values): (t, the Welch–Satterthwaite degrees of freedom,
    the two-sided p-value). Two samples without spread: p is 1 where their means are equal, else 0."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a p-value needs at least 2 runs a setting, got {len(a)} and {len(b)}: use --n=2 or more")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(a) - statistics.mean(b)
    if va + vb == 0:
        return math.copysign(math.inf, diff) if diff else 0.0, len(a) + len(b) - 2, 0.0 if diff else 1.0
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t, df, student_t_two_sided(t, df)


def split_settings(argv):
    """`[options] -- <setting A's train.py args> -- <setting B's> ...` -> (options, [settings])."""
    groups, current = [], []
    for arg in argv:
        if arg == "--":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    return groups[0], groups[1:]


def final_eval(out_dir):
    """The last eval row of out_dir/log.jsonl (val, val_bpb, and whatever else the eval logged)."""
    import runs
    rows = [row for row in runs.read_jsonl(os.path.join(out_dir, "log.jsonl"))[0] if "val" in row]
    if not rows:
        raise ValueError(f"{out_dir}/log.jsonl holds no eval: the run failed before its first one (see {out_dir}.txt)")
    return rows[-1]


def seed_runs(settings, n, first_seed, out_dir, threads, jobs):
    """Trains each setting (a list of train.py arguments) with seeds first_seed .. first_seed + n − 1, jobs processes
    at a time of threads threads each, into out_dir/<setting>-s<seed> (replacing what is there; each process's output
    in <that folder>.txt); returns [[final eval row of each seed] for each setting]."""
    import concurrent.futures
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))

    def run(i, seed):
        folder = os.path.join(out_dir, f"{i}-s{seed}")
        with open(folder + ".txt", "w") as log:
            rc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *settings[i], f"--seed={seed}",
                                 f"--out_dir={folder}", "--overwrite=True", "--num_samples=0"], env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise ValueError(f"setting {i} (seed {seed}) failed with exit status {rc}: see {folder}.txt")
        return final_eval(folder)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [[pool.submit(run, i, first_seed + s) for s in range(n)] for i in range(len(settings))]
        return [[f.result() for f in row] for row in futures]


def spread_table(names, results, metric="val"):
    """The lines of the comparison: per setting n, mean ± sd of the val loss and bpb (and of metric, if another);
    then per pair the difference of metric's means, Welch's t, its degrees of freedom and p."""
    shown = ["val", "val_bpb"] + ([metric] if metric not in ("val", "val_bpb") else [])
    labels = {"val": "val loss", "val_bpb": "val bpb"}
    lines = ["| setting | n | " + " | ".join(f"{labels.get(m, m)} mean ± sd" for m in shown) + " |",
             "|---|---|" + "---|" * len(shown)]
    for name, rows in zip(names, results):
        cells = []
        for m in shown:
            xs = [row[m] for row in rows]
            cells.append(f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}")
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    lines += ["", f"Welch's t-test of {metric}, each pair (two-sided):", "| pair | difference of means | t | df | p |",
              "|---|---|---|---|---|"]
    for (i, a), (j, b) in itertools.combinations(enumerate(results), 2):
        xs, ys = [row[metric] for row in a], [row[metric] for row in b]
        t, df, p = welch_test(xs, ys)
        lines.append(f"| {names[i]} − {names[j]} | {statistics.mean(xs) - statistics.mean(ys):+.4f} | {t:.2f} | "
                     f"{df:.1f} | {p:.2g} |")
    return lines


# -----------------------------------------------------------------------------
# Gated DeltaNet-2's spectral clip, shown on trained layers. With erase key k and write key j = b⊙k/‖b⊙k‖ (unit), η =
# ‖b⊙k‖, the transition I − η k jᵀ has ‖·‖₂ = ρ = (η + √(η² − 4η k·j + 4))/2, which exceeds 1 whenever k and j are
# not collinear (k·j < 1); the clip g ← min(g, −log ρ) keeps each ‖(I − η k jᵀ) Diag(exp g)‖₂ ≤ 1. Whether the
# unclipped state then grows over a long sequence is the top Lyapunov exponent of the transitions' product:
# λ = lim (1/T) log ‖A_T ⋯ A_1‖₂, measured on the layer's own gates over validation text longer than training.

def transition_norm(eta, kj):
    """ρ = ‖I − η k jᵀ‖₂ for unit k, j with k·j = kj: (η + √(η² − 4η k·j + 4)) / 2."""
    return (eta + torch.sqrt(eta * eta - 4 * eta * kj + 4)) / 2


@torch.no_grad()
def state_growth(k, g, b, w, v, probes=4):
    """Per head, over the T tokens of one sequence (k, g, b: [T, H, dk]; w, v: [T, H, dv]), in float64:
    λ, the growth rate of the transitions' product A_T ⋯ A_1, A_t = (I − k_t (b_t⊙k_t)ᵀ) Diag(exp g_t), from
    `probes` random directions renormalised every token (λ > 0: the unforced state grows like exp(λ t)), and the
    norm ‖S_t‖_F of the layer's own state S_t = A_t S_{t−1} + k_t (w_t⊙v_t)ᵀ at t = T. Returns (λ [H], ‖S_T‖ [H])."""
    k, g, b, w, v = (t.double() for t in (k, g, b, w, v))
    T, H, dk = k.shape
    probe = torch.randn(H, dk, probes, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    probe = probe / probe.norm(dim=1, keepdim=True)
    log_growth = torch.zeros(H, dtype=torch.float64)
    S = torch.zeros(H, dk, v.size(-1), dtype=torch.float64)
    for t in range(T):
        c = b[t] * k[t]
        decayed = g[t].exp().unsqueeze(-1) * probe  # Diag(exp g) P, then (I − k cᵀ) of it
        probe = decayed - k[t].unsqueeze(-1) * (c.unsqueeze(-1) * decayed).sum(1, keepdim=True)
        size = probe.norm(dim=1).amax(-1).clamp(min=1e-300)  # all probes scaled alike: the largest one's growth
        log_growth += size.log()
        probe = probe / size[:, None, None]
        S_decayed = g[t].exp().unsqueeze(-1) * S
        S = (S_decayed - k[t].unsqueeze(-1) * (c.unsqueeze(-1) * S_decayed).sum(1, keepdim=True)
             + k[t].unsqueeze(-1) * (w[t] * v[t]).unsqueeze(1))
    return log_growth / T, S.flatten(1).norm(dim=1)


@torch.no_grad()
def clip_report(out_dir, length=2048, sequences=2):
    """For each gdn2 layer of the checkpoint in out_dir, on `sequences` stretches of `length` validation tokens:
    the fraction of (token, head) pairs with ρ > 1 (k and j not collinear), ρ's largest value, the fraction of decay
    entries the clip lowers, the largest unclipped ‖A_t‖₂ (analyze.gdn2_gates, at the training length), and over the
    long stretches λ and ‖S_T‖_F with the clip and without (the same inputs x; the larger over heads and stretches).
    Returns one dict a layer."""
    import analyze
    import data
    import runs
    path = os.path.join(out_dir, "ckpt.pt")
    ckpt = runs.load_checkpoint(path)
    config = {**ckpt["config"], "kernels": "torch"}
    gpt = GPT(GPTConfig.from_dict(config))
    runs.load_weights(gpt, ckpt, path)
    gpt.eval()
    _, val, _ = data.load_dataset(config["dataset"], config["tokenizer"])
    if len(val) < length * sequences:
        raise ValueError(f"the validation split holds {len(val)} tokens, fewer than {sequences} x {length}: use a "
                         f"smaller --length")
    idx = torch.from_numpy(val[:length * sequences].astype("int64")).view(sequences, length)
    summary, arrays = analyze.gdn2_gates(gpt, idx[:, :gpt.config.block_size])
    if summary is None or not any(layer["variant"] == "gdn2" for layer in summary["layers"]):
        raise ValueError(f"{path} has no gdn2 layer (mixer {config.get('mixer')}, gdn_variant "
                         f"{config.get('gdn_variant')}): give the out_dir of a G run with --gdn_variant=gdn2")
    captured = analyze._capture_inputs(gpt, model.GatedDelta, idx)
    rows = []
    for (name, mixer, x), gates, rho in zip(captured, summary["layers"], arrays["rho"]):
        row = {"layer": name, "trained_with_clip": mixer.clip, "frac_rho_above_1": float((rho > 1 + 1e-6).mean()),
               "rho_max": gates["rho_max"], "frac_clipped": gates["frac_clipped"],
               "max_transition_norm": gates["max_transition_norm"]}
        trained_clip = mixer.clip
        for clip in (False, True):
            mixer.clip = clip
            q, k, v, g, b, w = mixer.recurrence_inputs(x)
            grown = [state_growth(k[i], g[i], b[i], w[i], v[i]) for i in range(sequences)]
            row[f"lyapunov_{'clip' if clip else 'noclip'}"] = max(lam.max().item() for lam, _ in grown)
            row[f"state_norm_{'clip' if clip else 'noclip'}"] = max(s.max().item() for _, s in grown)
        mixer.clip = trained_clip
        rows.append(row)
    return rows


def clip_table(out_dirs, length=2048, sequences=2):
    """The lines of clip_report for each checkpoint, then per layer the mean ± sd over the checkpoints (seeds)."""
    keys = ("frac_rho_above_1", "rho_max", "frac_clipped", "max_transition_norm", "lyapunov_noclip",
            "lyapunov_clip", "state_norm_noclip", "state_norm_clip")
    reports = {out_dir: clip_report(out_dir, length, sequences) for out_dir in out_dirs}
    lines = ["| run | layer | trained with clip | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for out_dir, rows in reports.items():
        for row in rows:
            lines.append(f"| {out_dir} | {row['layer']} | {row['trained_with_clip']} | "
                         + " | ".join(f"{row[key]:.4g}" for key in keys) + " |")
    if len(reports) > 1:
        lines += ["", f"mean ± sd over the {len(reports)} runs:", "| layer | " + " | ".join(keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for i, row in enumerate(next(iter(reports.values()))):
            cells = [[rows[i][key] for rows in reports.values()] for key in keys]
            spread = [f"{statistics.mean(c):.4g} ± {statistics.stdev(c):.2g}" for c in cells]
            lines.append(f"| {row['layer']} | " + " | ".join(spread) + " |")
    return lines


def interleaved_seconds(runs, rounds, steps):
    """{name: [seconds per step in each round]}, the runs taking turns round by round."""
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            seconds[name].append((time.perf_counter() - t0) / steps)
    return seconds


def residual_kinds():
    """`python bench.py residuals`: the training step of the default model (A mixer, n = 4 streams) for every
    residual kind, batch 16 x 64, against `res` timed in the same interleaved rounds (8 rounds of 3 steps)."""
    B, T, V, rounds, steps = 16, 64, 84, 8, 3
    runs = {}
    for kind in RESIDUALS:
        torch.manual_seed(0)
        runs[kind] = train_step(GPT(GPTConfig(vocab_size=V, block_size=T, residual=kind)), B, T, V)
    seconds = interleaved_seconds(runs, rounds, steps)
    print(f"forward+backward+AdamW, batch {B}x{T}, {torch.get_num_threads()} threads, {rounds} interleaved rounds "
          f"of {steps} steps")
    for kind, s in seconds.items():
        ratio = statistics.median(t / r for r, t in zip(seconds["res"], s))
        print(f"  {kind:>8}: {1e3 * statistics.median(s):6.1f} ms/step (median round), {ratio:.2f}x res")


def mixers_throughput(mixers):
    """Each mixer string's training step against the gpt2-style yardstick, in alternating rounds."""
    torch.manual_seed(0)
    B, T, V, rounds, steps = 12, 64, 84, 20, 5
    runs = {"gpt2-style": train_step(GPT2(V, T, 4, 4, 128), B, T, V)}
    for mixer in mixers:
        runs[mixer] = train_step(GPT(GPTConfig(vocab_size=V, block_size=T, mixer=mixer)), B, T, V)
    seconds = interleaved_seconds(runs, rounds, steps)
    print(f"forward+backward+AdamW, batch {B}x{T}, {torch.get_num_threads()} threads, {rounds} alternating rounds")
    for name, s in seconds.items():
        ratio = statistics.median(b / t for b, t in zip(seconds["gpt2-style"], s))
        print(f"  {name:>10}: {B * T / statistics.median(s):8,.0f} tokens/s (median round), "
              f"{ratio:.2f}x the gpt2-style baseline")


# -----------------------------------------------------------------------------
# the recall bench: each mixer on MQAR (data.mqar_batch) at 2 layers, its best learning rate, accuracy per test
# slice against the bytes a layer keeps to generate (Zoology's figure: recall against the state's size)

# the grids: "cpu" is sized to finish within 30 minutes on 2 idle cores (it prints the CPU time it took; 32 runs of
# 36-100 CPU-s at 400 steps): a vocabulary of 64 and 500 steps, in which attention learns 64 tokens x 4 pairs (at 256
# tokens of vocabulary it had not after 1000 steps of 32); "gpu" is Zoology's scale (vocabulary 8192, train at 256 tokens with 4 to 64 pairs, test to 1024 tokens,
# widths 64 to 512, lrs 1e-3 to 10^-1.5)
RECALL_GRIDS = {
    "cpu": dict(widths=(64,), vocab=64, train_length=64, train_pairs="4", test_lengths="64,128,256",
                test_pairs="4,8,16", optimizer="muon", aux_lr=0.01, lrs=(0.01, 0.02), seeds=3, steps=500, batch=64,
                test_batches=4),
    "gpu": dict(widths=(64, 128, 256, 512), vocab=8192, train_length=256, train_pairs="4,8,16,32,64",
                test_lengths="256,512,1024", test_pairs="4,16,64", optimizer="adamw", aux_lr=3e-3,
                lrs=(1e-3, 10 ** -2.5, 1e-2, 10 ** -1.5), seeds=3, steps=4000, batch=256, test_batches=4),
}
# the mixers it compares: a mixer string (cycled over the 2 layers) and the G variant; GGGA's 3:1 needs 4 layers, so
# at 2 layers the hybrids are GA and MA
RECALL_MIXERS = ("A", "G:gdn2", "G:kda", "G:gdn", "G:deltanet", "M", "GA", "MA")
RECALL_LAYERS = 2
RECALL_HEAD_SIZE = 64   # every mixer's head size: width 64 is one head


def recall_config(mixer, width, vocab, train_length, max_length):
    """The bench's model: 2 layers of mixer (a string, or G:variant), heads of RECALL_HEAD_SIZE, RoPE's cache long
    enough for the longest test (rope_factor), every other key named here (not GPTConfig's defaults)."""
    letters, _, variant = mixer.partition(":")
    if len(letters) > RECALL_LAYERS:
        raise ValueError(f"mixer {letters!r} has more letters than the bench's {RECALL_LAYERS} layers: use a string "
                         f"of at most {RECALL_LAYERS}, e.g. GA")
    return GPTConfig(vocab_size=vocab, vocab_multiple=1, block_size=train_length, n_layer=RECALL_LAYERS,
                     n_head=max(1, width // RECALL_HEAD_SIZE), n_embd=width, mixer=letters, mlp="relu2",
                     residual="res", rope="fixed", rope_scaling="none", rope_factor=max_length / train_length,
                     qk_norm=True, tie_embeddings=True, dropout=0.0, gdn_variant=variant or "gdn2", gdn_clip=True,
                     gdn_expand_v=1, conv_size=4, mamba_d_state=16, mamba_expand=1, mamba_headdim=32,
                     kernels="auto", init="gpt2")


@torch.no_grad()
def cache_bytes_per_layer(net, length):
    """The bytes of the generation cache (GPT.forward's cache) after `length` tokens, per layer: the recurrent state
    and convolution inputs of G and M, the keys and values of A."""
    cache = {"pos": 0, "layers": [{} for _ in net.blocks]}
    net(torch.zeros(1, length, dtype=torch.long, device=net.rope_cos.device), cache=cache)
    return sum(t.numel() * t.element_size() for layer in cache["layers"] for t in layer.values()) / len(net.blocks)


def recall_run(mixer, width, lr, seed, grid, device="cpu"):
    """Trains one model on MQAR (AdamW, weight decay 0.1, 10% linear warmup then a cosine to 0, gradient clip 1) and
    returns {"acc": {slice: accuracy}, "bytes": {test length: cache bytes per layer}, "seconds": wall time}."""
    import data
    import optim
    lengths = data.parse_ints(grid["test_lengths"], "test_lengths")
    task = data.RecallTask("mqar", grid["train_length"], vocab=grid["vocab"], pairs=grid["train_pairs"],
                           test_pairs=grid["test_pairs"], test_lengths=grid["test_lengths"])
    cfg = recall_config(mixer, width, grid["vocab"], grid["train_length"], max(lengths + (grid["train_length"],)))
    torch.manual_seed(seed)
    net = GPT(cfg).to(device)
    opt = optim.build_optimizer(net, grid["optimizer"], lr=lr, weight_decay=0.1, aux_lr=grid["aux_lr"])
    sampler = data.RecallSampler(task, grid["batch"], seed, device)
    t0, cpu0, steps = time.perf_counter(), time.process_time(), grid["steps"]
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * optim.lr_multiplier(step, steps, steps // 10, 0.0, "cosine", 0.0)
        _, loss = net(*sampler.next_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    net.eval()
    acc = {}
    with torch.no_grad():
        for key, batches in task.test_set(grid["batch"], grid["test_batches"]).items():
            counts = [data.answer_accuracy(net(x.to(device))[0], y.to(device)) for x, y in batches]
            acc[key] = sum(c for c, _ in counts) / sum(n for _, n in counts)
    return {"acc": acc, "bytes": {n: cache_bytes_per_layer(net, n) for n in lengths},
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu0}


def recall_bench(mixers=RECALL_MIXERS, grid_name="cpu", workers=None, plot_path="recall.png", **changes):
    """`python bench.py recall`: each (mixer, width) trained and tested at every lr of the grid with seed 0, then at
    the lr of the best mean accuracy over the slices with the other seeds (in forked processes, one thread each; the
    sweep's seed-0 run counts as a seed); its accuracies (mean ± sd over seeds) are printed per slice beside the cache
    bytes per layer, and plotted."""
    grid = {**RECALL_GRIDS[grid_name], **changes}
    import data
    lengths = data.parse_ints(grid["test_lengths"], "test_lengths")
    data.RecallTask("mqar", grid["train_length"], vocab=grid["vocab"], pairs=grid["train_pairs"],
                    test_pairs=grid["test_pairs"], test_lengths=grid["test_lengths"])  # bad settings: one line now
    for mixer in mixers:
        recall_config(mixer, grid["widths"][0], grid["vocab"], grid["train_length"], max(lengths))
    sweep = [(m, w, lr, 0) for m in mixers for w in grid["widths"] for lr in grid["lrs"]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{len(sweep)} runs of the lr sweep (seed 0), then {grid['seeds'] - 1} more seeds at each best lr: mixers "
          f"{' '.join(mixers)}, widths {grid['widths']}, {grid['optimizer']} lrs {grid['lrs']}; {grid['steps']} steps "
          f"of {grid['batch']} x {grid['train_length']} tokens (pairs {grid['train_pairs']}, vocabulary "
          f"{grid['vocab']}); test lengths {grid['test_lengths']} x pairs {grid['test_pairs']}, "
          f"{grid['test_batches'] * grid['batch']} examples a slice; on {device}", flush=True)

    def one(run):
        if device == "cpu":
            torch.set_num_threads(1)
        result = recall_run(*run, grid, device)
        print(f"  {run[0]:>10} width {run[1]} lr {run[2]:.2g} seed {run[3]}: mean accuracy "
              f"{statistics.mean(result['acc'].values()):.3f}, {result['seconds']:.0f}s wall, "
              f"{result['cpu_seconds']:.0f} CPU-s", flush=True)
        return result
    workers = 1 if device == "cuda" else workers
    results = dict(zip(sweep, forked_map(one, sweep, workers)))
    best = {(m, w): max(grid["lrs"], key=lambda lr: statistics.mean(results[(m, w, lr, 0)]["acc"].values()))
            for m in mixers for w in grid["widths"]}
    seeds = [(m, w, lr, s) for (m, w), lr in best.items() for s in range(1, grid["seeds"])]
    results.update(zip(seeds, forked_map(one, seeds, workers)))
    runs, rows = sweep + seeds, []
    for (mixer, width), lr in best.items():
        chosen = [results[(mixer, width, lr, s)] for s in range(grid["seeds"])]
        accs = {key: [r["acc"][key] for r in chosen] for key in chosen[0]["acc"]}
        rows.append(dict(mixer=mixer, width=width, lr=lr, bytes=chosen[0]["bytes"], accs=accs))
    print_recall_table(rows, lengths, grid["seeds"])
    cpu = sum(r["cpu_seconds"] for r in results.values())
    print(f"all {len(runs)} runs: {cpu:,.0f} CPU-seconds (one thread each), {cpu / 120:.1f} minutes on 2 idle cores")
    if plot_path:
        plot_recall(rows, plot_path)
        print(f"plot: {plot_path}")
    return rows


def mean_sd(values):
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def print_recall_table(rows, lengths, seeds):
    """A markdown table: per mixer and width, its best lr, the cache bytes per layer at each test length, and each
    slice's accuracy (mean ± sd over the seeds)."""
    slices = list(rows[0]["accs"])
    print(f"\naccuracy on the answers, mean ± sd over {seeds} seeds at each mixer's best lr; bytes: the generation "
          f"cache per layer (fp32) at test length {', '.join(map(str, lengths))}")
    print("| mixer | width | lr | bytes/layer | " + " | ".join(f"{n}x{p}" for n, p in slices) + " |")
    print("|---" * (4 + len(slices)) + "|")
    for row in rows:
        sizes = sorted(set(row["bytes"].values()))
        shown = f"{sizes[0]:,.0f}" if len(sizes) == 1 else " / ".join(f"{row['bytes'][n]:,.0f}" for n in lengths)
        print(f"| {row['mixer']} | {row['width']} | {row['lr']:.2g} | {shown} | "
              + " | ".join(mean_sd(row["accs"][key]) for key in slices) + " |")


def plot_recall(rows, path):
    """One panel per test slice: each mixer's accuracy (mean, sd as error bar) against its cache bytes per layer at
    that slice's length, log-scaled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    slices = list(rows[0]["accs"])
    lengths = sorted({n for n, _ in slices})
    pairs = sorted({p for _, p in slices})
    fig, axes = plt.subplots(len(lengths), len(pairs), figsize=(3.2 * len(pairs), 2.6 * len(lengths)), squeeze=False,
                             sharey=True)
    markers = dict(zip(dict.fromkeys(r["mixer"] for r in rows), "os^vD<>phx*"))
    for (n, p), ax in zip(((n, p) for n in lengths for p in pairs), axes.flat):
        for row in rows:
            if (n, p) in row["accs"]:
                values = row["accs"][(n, p)]
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                ax.errorbar(row["bytes"][n], statistics.mean(values), yerr=sd, marker=markers[row["mixer"]],
                            linestyle="", label=row["mixer"], capsize=2)
        ax.set_xscale("log")
        ax.set_title(f"length {n}, {p} pairs", fontsize=9)
        ax.set_ylim(-0.05, 1.05)
    for ax in axes[-1]:
        ax.set_xlabel("cache bytes per layer")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -----------------------------------------------------------------------------
# python bench.py <what>: one subcommand per measurement; the compile and kept-bytes runs go to a Python that
# imported triton without the interpreter (its kernels compile, and Triton's custom ops run on fake tensors)

def in_fresh_python(program, interpret):
    """Run a Python program here in a fresh process, with or without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", program], env=dict(env, TRITON_INTERPRET="1") if interpret else env,
                   cwd=HERE, check=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench.py", description="specgpt's measurements, one per "
                                     "subcommand; each prints first what it measures.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{kernels,costs,aot,recipe,mixers,"
                                     "residuals,seeds,clip,recall}")
    commands.add_parser("kernels", help="each op's error against its reference and the chunked paths' speed; the "
                        "Triton walk-through (TRITON_INTERPRET=1 on a CPU); on a GPU the timings against the torch "
                        "path and torch.compile")
    commands.add_parser("costs", help="what autograd keeps per mixer, and the kernel cost report (bytes, FLOPs, exps "
                        "and steps per Triton launch, counted in Triton's interpreter; an H100 estimate; on a GPU "
                        "each launch measured beside it)")
    commands.add_parser("aot", help="every Triton kernel compiled ahead of time for sm_80/89/90 in fp32 and bf16: "
                        "shared memory, registers, spills")
    recipe = commands.add_parser("recipe", help="nanoGPT's CPU recipe on the GPT-2-style yardstick, to time python "
                                 "train.py by")
    recipe.add_argument("--seed", type=int, default=1337, help="its init and training batches (default 1337)")
    mixers = commands.add_parser("mixers", help="each mixer string's training step against the GPT-2-style "
                                 "yardstick")
    mixers.add_argument("mixers", nargs="*", default=["A"], help="mixer strings, letters of "
                        f"{''.join(MIXERS)} (default A)")
    commands.add_parser("residuals", help="each residual kind's training step against res")
    seeds = commands.add_parser("seeds", help="each setting (the train.py arguments after each --) trained with n "
                                "seeds: mean ± sd of the final val loss and bpb, Welch's t-test of each pair",
                                description="python bench.py seeds --n=3 -- --mixer=A -- --mixer=G: each setting "
                                "after a -- is train.py's arguments (none: the defaults), trained with --n seeds")
    seeds.add_argument("--n", type=int, default=3, help="seeds a setting (at least 2: a p-value needs them)")
    seeds.add_argument("--seed", type=int, default=1337, help="the first seed; the others follow it")
    seeds.add_argument("--metric", default="val", help="the eval's key the t-tests compare (log.jsonl): val (the "
                       "loss), val_bpb, or another the eval logs")
    seeds.add_argument("--out_dir", default="out-seeds", help="the runs' folders, <setting>-s<seed>, and results.tsv")
    seeds.add_argument("--threads", type=int, default=1, help="threads a run (OMP_NUM_THREADS)")
    seeds.add_argument("--jobs", type=int, default=0, help="runs at a time; 0: the cores / threads")
    clip = commands.add_parser("clip", help="Gated DeltaNet-2's spectral clip on trained gdn2 layers: ρ > 1 where k, "
                               "j are not collinear; the state's growth rate over long text with the clip and without")
    clip.add_argument("out_dirs", nargs="+", help="run folders (train.py's out_dir) of G models with gdn_variant "
                      "gdn2, e.g. one setting's seeds")
    clip.add_argument("--length", type=int, default=2048, help="tokens of each validation stretch (default 2048)")
    clip.add_argument("--sequences", type=int, default=2, help="validation stretches (default 2)")
    recall = commands.add_parser("recall", help="each mixer trained on MQAR at 2 layers over an lr grid and seeds: "
                                 "accuracy per test slice against the cache bytes per layer, a table and a plot")
    recall.add_argument("mixers", nargs="*", default=list(RECALL_MIXERS), help="mixer strings of at most 2 letters, "
                        "G:variant for a G variant (default: " + " ".join(RECALL_MIXERS) + ")")
    recall.add_argument("--grid", choices=tuple(RECALL_GRIDS), default="cpu", help="cpu: width 64, lengths to 256, "
                        "under 30 minutes on 2 cores; gpu: Zoology's scale")
    recall.add_argument("--seeds", type=int, help="seeds per (mixer, lr) (default: the grid's)")
    recall.add_argument("--steps", type=int, help="training steps per run (default: the grid's)")
    recall.add_argument("--lrs", help="comma-separated learning rates (default: the grid's)")
    recall.add_argument("--workers", type=int, help="processes on a CPU (default: one per core)")
    recall.add_argument("--plot", default="recall.png", help="the plot's path ('' for none)")
    parser.error = lambda message: sys.exit(f"bench.py: {message}: python bench.py --help")   # one line, exit 1
    argv, settings = split_settings(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if settings and args.command != "seeds":
        parser.error(f"only seeds takes settings after --, not {args.command}")
    if args.command == "kernels":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"== every op's paths against its reference on {device}; the chunked paths against the token loops ==")
        errors_and_speed(device)
        triton_report(device)
    elif args.command == "costs":
        print("== what autograd keeps for one mixer's backward (on fake tensors), then the kernel cost report ==")
        in_fresh_python("import triton, bench; bench.kept_activation_table()", interpret=False)
        # in Triton's interpreter (it counts; the sm_90 compile runs in a process of its own), a few minutes; on a GPU
        # each launch is then measured beside its estimate
        import tempfile
        with tempfile.TemporaryDirectory() as folder:
            saved = os.path.join(folder, "estimates.json")
            in_fresh_python(f"import bench; bench.kernel_cost_report(save={saved!r})", interpret=True)
            if torch.cuda.is_available():
                in_fresh_python(f"import triton, bench; bench.measured_beside_estimated({saved!r})", interpret=False)
    elif args.command == "aot":
        print("== Triton kernels compiled ahead of time: shared memory / registers / stack bytes (spills) per thread, "
              "head dim 64, Mamba p 64, n 128, ssd chunk 64; '!' marks shared memory over the limit ==")
        in_fresh_python("import triton, bench; bench.triton_resource_table(B=1, T=256, H=8, K=64, V=64, heads_ssd=8, "
                        "p=64, n=128, chunk=64)", interpret=False)
    elif args.command == "recipe":
        print("== nanoGPT's shakespeare_char CPU recipe on the GPT-2-style yardstick: wall time and val loss ==")
        nanogpt_recipe(args.seed)
    elif args.command == "mixers":
        wrong = [m for m in args.mixers if not m or set(m) - set(MIXERS)]
        if wrong:
            parser.error(f"{wrong[0]!r} is not a mixer string (letters of {', '.join(MIXERS)})")
        print(f"== training step of each mixer string ({' '.join(args.mixers)}) against the GPT-2-style yardstick ==")
        mixers_throughput(args.mixers)
    elif args.command == "seeds":
        if args.n < 2:
            parser.error(f"--n={args.n}: a p-value needs at least 2 seeds a setting")
        if not settings or args.threads < 1 or args.jobs < 0:
            parser.error("give at least one setting after -- (--n=3 -- --mixer=A -- --mixer=G), --threads ≥ 1 and "
                         "--jobs ≥ 0")
        names = [chr(ord("A") + i) if i < 26 else f"S{i}" for i in range(len(settings))]
        for name, setting in zip(names, settings):  # a setting train.py refuses stops here, before any run
            check = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *setting, "--dry_run=True"],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                parser.error(f"setting {name} ({' '.join(setting)}): {check.stderr.strip().splitlines()[-1]}")
        jobs = args.jobs or max(1, (os.cpu_count() or 1) // args.threads)
        print(f"== {len(settings)} settings x {args.n} seeds (from {args.seed}), {jobs} at a time of {args.threads} "
              f"thread{'s' * (args.threads > 1)}, in {args.out_dir}: final val loss and bpb, Welch's t-test of "
              f"{args.metric} ==")
        for name, setting in zip(names, settings):
            print(f"setting {name}: python train.py {' '.join(setting) or '(the defaults)'}")
        results = seed_runs(settings, args.n, args.seed, args.out_dir, args.threads, jobs)
        missing = [name for name, rows in zip(names, results) if any(args.metric not in row for row in rows)]
        if missing:
            parser.error(f"the eval of setting {missing[0]} logs no {args.metric!r}: use --metric=val or val_bpb")
        print("\n".join(spread_table(names, results, args.metric)))
    elif args.command == "clip":
        missing = [d for d in args.out_dirs if not os.path.isfile(os.path.join(d, "ckpt.pt"))]
        if missing or args.length < 1 or args.sequences < 1:
            parser.error(f"{missing[0]} holds no ckpt.pt: give train.py run folders" if missing else
                         "--length and --sequences must be at least 1")
        print(f"== the gdn2 clip on {len(args.out_dirs)} checkpoint(s): ρ at the training length; over "
              f"{args.sequences} x {args.length} validation tokens λ (growth rate a token of the transitions' "
              f"product) and ‖S_T‖_F, unclipped and clipped ==")
        try:
            print("\n".join(clip_table(args.out_dirs, args.length, args.sequences)))
        except ValueError as e:
            parser.error(str(e))
    elif args.command == "recall":
        changes = {key: value for key, value in (("seeds", args.seeds), ("steps", args.steps)) if value is not None}
        if args.lrs:
            try:
                changes["lrs"] = tuple(float(lr) for lr in args.lrs.split(","))
            except ValueError:
                parser.error(f"--lrs={args.lrs!r} is not a comma-separated list of numbers")
        if min(changes.get("seeds", 1), changes.get("steps", 1)) < 1:
            parser.error("--seeds and --steps take at least 1")
        wrong = [m for m in args.mixers if not m.partition(":")[0] or set(m.partition(":")[0]) - set(MIXERS)
                 or m.partition(":")[2] not in ("", *model.GDN_VARIANTS)]
        if wrong:
            parser.error(f"{wrong[0]!r} is not a mixer string (letters of {', '.join(MIXERS)}, G:variant with a "
                         f"variant of {', '.join(model.GDN_VARIANTS)})")
        print(f"== MQAR recall of each mixer at {RECALL_LAYERS} layers ({args.grid} grid): accuracy per slice against "
              f"the cache bytes per layer ==")
        try:
            recall_bench(args.mixers, args.grid, args.workers, args.plot, **changes)
        except ValueError as e:  # a setting that cannot work: one line
            sys.exit(f"bench.py: {e}")
    else:
        print("== training step of each residual kind against res ==")
        residual_kinds()


if __name__ == "__main__":
    main()
