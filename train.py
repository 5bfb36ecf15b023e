"""
Train a specgpt model.

    python train.py                                  # baby GPT on shakespeare_char, ~2 minutes on a CPU
    python train.py --mixer=GGGA --optimizer=muon    # flip any config key below with --key=value
    python train.py my_config.py --max_iters=500     # a config file (plain Python assignments), then overrides
    python train.py --init_from=resume               # continue out_dir/ckpt.pt exactly where it stopped
    python train.py --sample_only=True --start="ROMEO:"   # sample from out_dir/ckpt.pt
    torchrun --nproc_per_node=2 train.py             # data-parallel (DDP) on 2 processes

Every value below can be overridden; a wrong key or type stops with a one-line error before anything
is written. The checkpoint out_dir/ckpt.pt (written atomically at every eval) holds the model, the
optimizer, the config, the RNG and sampler states, so a resumed CPU run continues bit for bit.
"""
import ast
import difflib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import torch

import analyze
import data
from model import GPT, GPTConfig
from optim import build_optimizer

# ----------------------------------------------------------------------------------------------------
# config: module-level values, overridden by config files and --key=value
out_dir = "out"
init_from = "scratch"          # scratch | resume (from out_dir/ckpt.pt)
sample_only = False            # load out_dir/ckpt.pt, print samples, exit
eval_interval = 250
eval_iters = 20                # validation batches per eval (a fixed set, the same at every eval)
log_interval = 50
analyze_every = 0              # > 0: every N iters append weight/Hessian/noise-scale spectra to out_dir/analysis.jsonl
seed = 1337
# data
dataset = "shakespeare_char"   # shakespeare_char | shakespeare | path/to/file.txt | 'dir/*_train_*.bin'
tokenizer = "char"             # for your own .txt: char | gpt2
batch_size = 24                # sequences per micro-step (per process)
gradient_accumulation_steps = 1  # micro-steps per optimizer step (per process)
# model (see model.GPTConfig)
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
mixer = "A"
mlp = "relu2"
residual = "res"
hc_streams = 4
rope_base = 10000.0
rope = "fixed"                 # fixed | learned | lie
rope_scaling = "none"          # none | pi | ntk | yarn (with rope_factor > 1: longer contexts than block_size)
rope_factor = 1.0
qk_norm = False
tie_embeddings = True
bias = False
dropout = 0.0
attention = "sdpa"
gdn_variant = "gdn2"
gdn_clip = True
gdn_expand_v = 1
conv_size = 4
mamba_d_state = 64
mamba_expand = 2
mamba_headdim = 32
mamba_discretization = "euler"
chunk_size = 64
kernels = "auto"
init = "gpt2"
# optimizer (see optim.py): sgd | signsgd | adamw | nadam | lion | tiger | muon | shampoo | mousse | galore
optimizer = "muon"
learning_rate = 0.02
min_lr = 3e-4                  # the schedule's floor; every param group is scaled by the same multiplier
weight_decay = 0.1
beta1 = 0.9                    # adamw, nadam, lion, shampoo, galore (and the aux AdamW of matrix optimizers)
beta2 = 0.99
momentum = 0.95                # sgd, muon, mousse
muon_scale = "jordan"          # muon: jordan | moonlight | spectral
ns_coeffs = "dion"             # muon, mousse: Newton-Schulz coefficients, jordan | dion
precond_every = 10             # shampoo, mousse: steps between eigendecompositions
mousse_alpha = 0.125
galore_rank = 32
galore_gap = 200
galore_scale = 0.25
aux_lr = 3e-3                  # matrix optimizers: AdamW's lr for embeddings, head, norms, gates, HC
spectral_lr = False            # scale each block matrix's lr by init.spectral_lr_scale(fan_out, fan_in)
grad_clip = 1.0                # 0 disables
max_iters = 850
lr_decay_iters = 0             # length of the schedule; 0 means max_iters
warmup_iters = 100
schedule = "cosine"            # cosine | wsd (warmup, constant, then linear decay over the last wsd_decay_frac)
wsd_decay_frac = 0.2
# system
device = "auto"                # auto (cuda > mps > cpu) | cpu | cuda | cuda:1 | mps
dtype = "auto"                 # auto (bfloat16 autocast on CUDA, float32 elsewhere) | float32 | bfloat16
compile = None                 # None: torch.compile on CUDA only; True / False force it
# sampling at the end (and with sample_only)
num_samples = 2
max_new_tokens = 300
temperature = 0.8
top_k = 40
start = "\n"
# ----------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))]


class ConfigError(ValueError):
    pass


def apply_overrides(args, namespace):
    """Apply config files (args without '--') and --key=value overrides to namespace, with checks."""
    defaults = {k: namespace[k] for k in config_keys}
    for arg in args:
        if arg in ("-h", "--help"):
            print(__doc__ + "\nkeys and defaults:\n" + "\n".join(f"  --{k}={defaults[k]!r}" for k in config_keys))
            sys.exit(0)
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found: give a path to a .py file of assignments")
            exec(open(arg).read(), {}, file_values := {})
            pairs = [(k, v) for k, v in file_values.items() if not k.startswith("_")]
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"argument {arg!r} is not of the form --key=value")
            pairs = [(key, parse_value(text))]
        for key, value in pairs:
            if key not in defaults:
                close = difflib.get_close_matches(key, config_keys, n=3)
                hint = f"did you mean {' or '.join('--' + k for k in close)}? " if close else ""
                raise ConfigError(f"unknown config key {key!r}; {hint}valid keys: {', '.join(config_keys)}")
            namespace[key] = check_type(key, value, defaults[key])


def parse_value(text):
    lowered = {"true": True, "false": False, "none": None}.get(text.lower(), text)
    if lowered is not text:
        return lowered
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string, e.g. --dataset=my.txt


def check_type(key, value, default):
    if default is None:
        ok = value is None or isinstance(value, bool)
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok, value = isinstance(value, (int, float)) and not isinstance(value, bool), value
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok, value = True, str(value)
    if not ok:
        raise ConfigError(f"--{key} expects a {type(default).__name__ if default is not None else 'bool or None'}"
                          f" (default {default!r}), got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------
# device, precision, MFU

def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
                 "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12}


def peak_flops(device_type):
    """The device's dense peak: a table for GPUs, and on the CPU a float32 matmul rate measured now."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        return next((v for k, v in GPU_PEAK_BF16.items() if k in name), None)
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))  # leaves the global RNG alone
    b = a @ a
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ b
        n += 1
    return 2 * 512 ** 3 * n / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------------
# schedule, checkpoints

def lr_multiplier(it, total):
    if it < warmup_iters:
        return (it + 1) / (warmup_iters + 1)
    floor = min_lr / learning_rate
    if schedule == "wsd":
        decay_start = total * (1 - wsd_decay_frac)
        return 1.0 if it < decay_start else floor + (1 - floor) * max(0.0, (total - it) / (total - decay_start))
    if it >= total:
        return floor
    ratio = (it - warmup_iters) / max(1, total - warmup_iters)
    return floor + 0.5 * (1 + math.cos(math.pi * ratio)) * (1 - floor)


def optimizer_options():
    """The config values each optimizer takes, by the names of its constructor's arguments."""
    betas = (beta1, beta2)
    return {"sgd": dict(momentum=momentum), "adamw": dict(betas=betas), "nadam": dict(betas=betas),
            "lion": dict(betas=betas), "muon": dict(momentum=momentum, scale=muon_scale, ns_coeffs=ns_coeffs),
            "shampoo": dict(betas=betas, precond_every=precond_every),
            "mousse": dict(momentum=momentum, alpha=mousse_alpha, precond_every=precond_every, ns_coeffs=ns_coeffs),
            "galore": dict(betas=betas, rank=galore_rank, update_proj_gap=galore_gap, scale=galore_scale),
            }.get(optimizer, {})


def save_checkpoint(path, state):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def load_checkpoint(path):
    if not os.path.exists(path):
        raise ConfigError(f"no checkpoint at {path}: train first, or point --out_dir at a run")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__}): "
                          f"delete it and train again, or point --out_dir at another run") from None


def print_samples(model, meta, device, n, length):
    tok = data.tokenizer_from_meta(meta)
    prompt = torch.tensor([tok.encode(start)], dtype=torch.long, device=device)
    model.eval()
    for i in range(n):
        out = model.generate(prompt, length, temperature=temperature, top_k=top_k)
        print(f"--- sample {i + 1} ---\n{tok.decode(out[0].tolist())}")


# ----------------------------------------------------------------------------------------------------

def main():
    apply_overrides(sys.argv[1:], globals())
    cfg = {k: globals()[k] for k in config_keys}
    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = pick_device(device)
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
        if dev.startswith("cuda"):
            dev = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(dev)
    master = rank == 0
    device_type = dev.split(":")[0]
    ckpt_path = os.path.join(out_dir, "ckpt.pt")

    if sample_only:
        ckpt = load_checkpoint(ckpt_path)
        # the architecture comes from the checkpoint; the context may be extended (--rope_factor, --rope_scaling)
        model = GPT(GPTConfig.from_dict({**ckpt["config"], "rope_scaling": rope_scaling, "rope_factor": rope_factor})).to(dev)
        model.load_state_dict(ckpt["model"])
        print_samples(model, ckpt["meta"], dev, num_samples, max_new_tokens)
        return

    # everything that can fail on bad input happens before anything is written
    train_tokens, val_tokens, meta = data.load_dataset(dataset, tokenizer)
    if init_from not in ("scratch", "resume"):
        raise ConfigError(f"--init_from={init_from!r} is not valid: use scratch or resume")
    ckpt = load_checkpoint(ckpt_path) if init_from == "resume" else None
    if ckpt is not None:  # the architecture comes from the checkpoint
        for k in (f.name for f in fields(GPTConfig)):
            if k in ckpt["config"] and k != "kernels":
                cfg[k] = ckpt["config"][k]
    cfg["vocab_size"] = meta["vocab_size"]
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_dict(cfg)).to(dev)
    opt = build_optimizer(model, optimizer, lr=learning_rate, weight_decay=weight_decay, aux_lr=aux_lr,
                          aux_betas=(beta1, beta2), spectral_lr=spectral_lr, **optimizer_options())
    train_sampler = data.BatchSampler(train_tokens, batch_size, block_size, seed=seed + rank)
    iter_num, best_val = 0, float("inf")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        train_sampler.load_state_dict(ckpt["sampler"][rank] if rank < len(ckpt["sampler"]) else ckpt["sampler"][0])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val_loss"]

    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and device_type == "cuda")
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    raw_model = model
    if compile if compile is not None else device_type == "cuda":
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    total_iters = lr_decay_iters or max_iters
    tokens_per_iter = gradient_accumulation_steps * world * batch_size * block_size
    flops_per_iter = raw_model.flops_per_token(block_size) * tokens_per_iter / world
    peak = peak_flops(device_type)
    if master:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{dataset}: {len(train_tokens):,} train tokens, vocab {meta['vocab_size']} | model "
              f"{raw_model.num_params() / 1e6:.2f}M params, mixer {mixer}, residual {residual} | {optimizer} | "
              f"{dev}{' bf16' if use_bf16 else ''} | {tokens_per_iter:,} tokens/iter ({world} x {gradient_accumulation_steps}"
              f" x {batch_size} x {block_size})")
    log_file = open(os.path.join(out_dir, "log.jsonl"), "a") if master else None

    @torch.no_grad()
    def evaluate():
        model.eval()
        val_sampler = data.BatchSampler(val_tokens, batch_size, block_size, seed=0)  # same batches each eval
        losses = []
        for _ in range(eval_iters):
            x, y = (t.to(dev) for t in val_sampler.next_batch())
            with autocast:
                losses.append(raw_model(x, y)[1].item())
        model.train()
        return sum(losses) / len(losses)

    def checkpoint_state():
        samplers = [train_sampler.state_dict()]
        if ddp:  # every rank's sampler position, so a resumed DDP run sees the same batches
            samplers = [None] * world
            torch.distributed.all_gather_object(samplers, train_sampler.state_dict())
        return {"model": raw_model.state_dict(), "optimizer": opt.state_dict(), "config": cfg, "meta": meta,
                "iter_num": iter_num, "best_val_loss": best_val, "sampler": samplers,
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}}

    if analyze_every:  # one fixed training batch, so the spectra logged at different steps are comparable
        analysis_batch = tuple(t.to(dev) for t in data.BatchSampler(train_tokens, batch_size, block_size, seed=1).next_batch())
    t_start, t_last, tokens_since, val_loss = time.time(), time.time(), 0, None
    model.train()
    while True:
        if iter_num % eval_interval == 0 or iter_num >= max_iters:
            val_loss = evaluate()
            best_val = min(best_val, val_loss)
            state = checkpoint_state()
            if master:
                print(f"iter {iter_num}: val loss {val_loss:.4f} (best {best_val:.4f}), "
                      f"{time.time() - t_start:.1f}s elapsed")
                log_file.write(json.dumps({"step": iter_num, "val": val_loss, "time": time.time() - t_start}) + "\n")
                log_file.flush()
                save_checkpoint(ckpt_path, state)
        if iter_num >= max_iters:
            break

        if analyze_every and iter_num % analyze_every == 0 and master:
            analyze.analyze_during_training(raw_model, analysis_batch, iter_num, out_dir)
        lr_mult = lr_multiplier(iter_num, total_iters)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr_mult
        loss_sum = 0.0
        for micro in range(gradient_accumulation_steps):
            x, y = (t.to(dev) for t in train_sampler.next_batch())
            sync = not ddp or micro == gradient_accumulation_steps - 1
            with (nullcontext() if sync else model.no_sync()), autocast:
                _, loss = model(x, y)
                (loss / gradient_accumulation_steps).backward()
            loss_sum += loss.item() / gradient_accumulation_steps
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"loss became {loss_sum} at iter {iter_num}: stopped; the last good checkpoint "
                              f"{ckpt_path} is kept. Try a lower --learning_rate or --grad_clip=1.0")
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        iter_num += 1
        tokens_since += tokens_per_iter

        if iter_num % log_interval == 0 and master:
            now = time.time()
            tok_s = tokens_since / (now - t_last)
            mfu = flops_per_iter * world * tok_s / tokens_per_iter / (peak * world) if peak else float("nan")
            eta = (max_iters - iter_num) * tokens_per_iter / tok_s
            print(f"iter {iter_num}: loss {loss_sum:.4f}, lr {opt.param_groups[0]['lr']:.2e}, "
                  f"{tok_s:,.0f} tokens/s, mfu {100 * mfu:.1f}%, eta {eta:.0f}s")
            log_file.write(json.dumps({"step": iter_num, "loss": loss_sum, "lr": opt.param_groups[0]["lr"],
                                       "tokens_per_s": tok_s, "mfu": mfu}) + "\n")
            t_last, tokens_since = now, 0

    if master:
        log_file.close()
        plot_losses(os.path.join(out_dir, "log.jsonl"), os.path.join(out_dir, "loss.png"))
        if analyze_every:
            analyze.plot_training_analysis(os.path.join(out_dir, "analysis.jsonl"), os.path.join(out_dir, "analysis.png"))
        print(f"done: val loss {val_loss:.4f} after {iter_num} iters, {time.time() - t_start:.1f}s; "
              f"checkpoint {ckpt_path}")
        if num_samples > 0 and max_new_tokens > 0:
            print_samples(raw_model, meta, dev, num_samples, max_new_tokens)
    if ddp:
        torch.distributed.destroy_process_group()


def plot_losses(log_path, png_path):
    """Training loss (every log line) and validation loss (every eval) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(log_path)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "train"), ("val", "val")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, marker="." if key == "val" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path + ".tmp.png")
    plt.close(fig)
    os.replace(png_path + ".tmp.png", png_path)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # bad input: one line that says what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
