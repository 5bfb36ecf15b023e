"""
Train a specgpt model.

    python train.py                                  # baby GPT on shakespeare_char, ~2 minutes on a CPU
    python train.py --mixer=GGGA --optimizer=muon    # flip any config key with --key=value
    python train.py my_config.py --max_iters=500     # a config file (plain Python assignments), then overrides
    python train.py --init_from=resume               # continue out_dir/ckpt.pt exactly where it stopped
    python train.py --sample_only=True --start="ROMEO:"   # sample from out_dir/ckpt.pt
    torchrun --nproc_per_node=2 train.py             # data-parallel (DDP) on 2 processes

The config keys are the run settings below and every field of model.GPTConfig (the model; only
MODEL_DEFAULTS differ from GPTConfig's defaults). Every value is checked before anything is written: a
wrong key, type or value stops with a one-line error. The checkpoint out_dir/ckpt.pt (written
atomically at every eval, only while the loss and weights are finite) holds the model, the optimizer,
the config, the RNG and sampler states, so a resumed CPU run continues bit for bit.
"""
import ast
import difflib
import inspect
import json
import math
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import torch

import data
from model import GPT, GPTConfig
from optim import build_optimizer

# ----------------------------------------------------------------------------------------------------
# config: the run's settings (module-level values, overridden by config files and --key=value;
# the comment beside each is its --help text)
out_dir = "out"                # folder for ckpt.pt, log.jsonl, loss.png
init_from = "scratch"          # scratch | resume (from out_dir/ckpt.pt)
sample_only = False            # load out_dir/ckpt.pt, print samples, exit
eval_interval = 250            # steps between evals (each eval writes the checkpoint)
eval_iters = 20                # validation batches per eval (a fixed set, the same at every eval)
log_interval = 50              # steps between training-loss lines
analyze_every = 0              # > 0: every N iters append weight/Hessian/noise-scale spectra to out_dir/analysis.jsonl
seed = 1337                    # seeds the init and the training batches
# data
dataset = "shakespeare_char"   # shakespeare_char | shakespeare | path/to/file.txt | 'dir/*_train_*.bin'
tokenizer = "char"             # for your own .txt: char | gpt2
batch_size = 24                # sequences per micro-step (per process)
gradient_accumulation_steps = 1  # micro-steps per optimizer step (per process)
# optimizer (see optim.py)
optimizer = "muon"             # sgd | signsgd | adamw | nadam | lion | tiger | muon | shampoo | mousse | galore
learning_rate = 0.02           # peak lr of the schedule
min_lr = 3e-4                  # the schedule's floor; every param group is scaled by the same multiplier
weight_decay = 0.1             # decoupled weight decay of the matrices
beta1 = 0.9                    # adamw, nadam, lion, shampoo, galore (and the aux AdamW of matrix optimizers)
beta2 = 0.99                   # as beta1
momentum = 0.95                # sgd, muon, mousse
muon_scale = "jordan"          # muon: jordan | moonlight | spectral
ns_coeffs = "dion"             # muon, mousse: Newton-Schulz coefficients, jordan | dion
precond_every = 10             # shampoo, mousse: steps between eigendecompositions
mousse_alpha = 0.125           # mousse: preconditioner exponent, L^-alpha g R^-alpha
galore_rank = 32               # galore: rank of the projection
galore_gap = 200               # galore: steps between projection updates
galore_scale = 0.25            # galore: scale of the projected update
aux_lr = 3e-3                  # matrix optimizers: AdamW's lr for embeddings, head, norms, gates, HC
spectral_lr = False            # scale each block matrix's lr by init.spectral_lr_scale(fan_out, fan_in)
grad_clip = 1.0                # clip the gradient's global norm to this; 0 disables
max_iters = 640                # optimizer steps
lr_decay_iters = 0             # length of the schedule; 0 means max_iters
warmup_iters = 30              # linear warmup steps
schedule = "cosine"            # cosine | wsd (warmup, constant, then linear decay over the last wsd_decay_frac)
wsd_decay_frac = 0.2           # wsd: fraction of the steps spent decaying, in [0, 1] (0: a constant lr after warmup)
# system
device = "auto"                # auto (cuda > mps > cpu) | cpu | cuda | cuda:1 | mps
dtype = "auto"                 # auto (bfloat16 autocast on CUDA, float32 elsewhere) | float32 | bfloat16
compile = None                 # None: torch.compile on CUDA only; True / False force it
# sampling at the end (and with sample_only)
num_samples = 2                # samples printed at the end; 0 for none
max_new_tokens = 300           # tokens per sample
temperature = 0.8              # softmax temperature of sampling; 0 is greedy
top_k = 40                     # sample among the top_k most likely tokens (>= 1; the vocabulary size: all)
start = "\n"                   # the prompt of every sample
# ----------------------------------------------------------------------------------------------------
RUN_DEFAULTS = {k: v for k, v in globals().items()
                if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))}
# the model's keys are GPTConfig's fields (vocab_size comes from the data); the run's own defaults:
# nanoGPT's shakespeare_char context; one Mamba2 layer below three attention layers, narrowed to an inner width
# of n_embd and a state of 16 (its short convolution and recurrence lower the loss per step far more than the
# layer costs), and RMSNorm on queries and keys (README, "The default run")
MODEL_DEFAULTS = {"block_size": 64, "mixer": "MAAA", "mamba_expand": 1, "mamba_d_state": 16, "qk_norm": True}
# model keys that may change on resume: they change how the same weights compute or train, not the weights
RESUME_CHANGEABLE = ("kernels", "attention", "chunk_size", "dropout", "rope_scaling", "rope_factor")
MODEL_SIZES = ("block_size", "n_layer", "n_head", "n_embd", "hc_streams", "mamba_headdim")  # each >= 1


class ConfigError(ValueError):
    pass


def model_defaults():
    """GPTConfig's fields and defaults, with MODEL_DEFAULTS in place of GPTConfig's own."""
    return {f.name: MODEL_DEFAULTS.get(f.name, f.default) for f in fields(GPTConfig) if f.name != "vocab_size"}


def source_comments(source):
    """{name: comment} for each line `name = value  # comment`, `name: type = value  # comment` or
    `"name": value,  # comment` of source (the first such line of each name)."""
    found = {}
    for name, comment in re.findall(r'^\s*"?(\w+)"?\s*[:=][^#\n]*#\s*(.*)$', source, re.M):
        found.setdefault(name, comment)
    return found


def config_help():
    """{key: description}: the comment beside each run setting above and each GPTConfig field."""
    return {**source_comments(inspect.getsource(GPTConfig)), **source_comments(open(__file__).read())}


def parse_config(args, defaults, usage, descriptions, file_keys=None):
    """The values that config files (args without '--', or --config=file) and --key=value overrides
    give, as {key: value}, each checked against the type of defaults[key]. A config file's keys outside
    file_keys (when given) are skipped. -h / --help prints usage and every key, then exits."""
    given = {}
    for arg in args:
        if arg in ("-h", "--help"):
            width = min(32, max(len(f"--{k}={v!r}") for k, v in defaults.items()))
            print(usage + "\nconfig keys and defaults:\n" + "\n".join(
                f"  {f'--{k}={v!r}':<{width}}  {descriptions.get(k, type(v).__name__)}" for k, v in defaults.items()))
            sys.exit(0)
        if arg.startswith("--config="):
            arg = arg[len("--config="):]
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found: give a path to a .py file of assignments")
            exec(open(arg).read(), {}, file_values := {})
            pairs = [(k, v) for k, v in file_values.items()
                     if not k.startswith("_") and (file_keys is None or k in file_keys)]
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"argument {arg!r} is not of the form --key=value")
            pairs = [(key, parse_value(text))]
        for key, value in pairs:
            if key not in defaults:
                close = difflib.get_close_matches(key, defaults, n=3)
                hint = f"did you mean {' or '.join('--' + k for k in close)}? " if close else ""
                raise ConfigError(f"unknown config key {key!r}; {hint}valid keys: {', '.join(defaults)}")
            given[key] = check_type(key, value, defaults[key])
    return given


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
        ok, expected = value is None or isinstance(value, bool), "True, False or None"
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), "True or False"
    elif isinstance(default, float):
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, expected, value = True, "a string", str(value)
    if not ok:
        raise ConfigError(f"--{key} expects {expected} (default {default!r}), got {value!r}")
    return value


def check_settings(c):
    """The run settings' ranges and choices, and the model's sizes (GPTConfig checks the rest)."""
    rules = [("init_from", c["init_from"] in ("scratch", "resume"), "scratch or resume"),
             ("eval_interval", c["eval_interval"] >= 1, "at least 1"),
             ("eval_iters", c["eval_iters"] >= 1, "at least 1"),
             ("log_interval", c["log_interval"] >= 1, "at least 1"),
             ("analyze_every", c["analyze_every"] >= 0, "0 (off) or more"),
             ("batch_size", c["batch_size"] >= 1, "at least 1"),
             ("gradient_accumulation_steps", c["gradient_accumulation_steps"] >= 1, "at least 1"),
             ("learning_rate", c["learning_rate"] > 0, "positive"),
             ("min_lr", c["min_lr"] >= 0, "0 or more"),
             ("aux_lr", c["aux_lr"] >= 0, "0 or more"),
             ("grad_clip", c["grad_clip"] >= 0, "0 (off) or more"),
             ("max_iters", c["max_iters"] >= 0, "0 or more"),
             ("lr_decay_iters", c["lr_decay_iters"] >= 0, "0 (= max_iters) or more"),
             ("warmup_iters", c["warmup_iters"] >= 0, "0 or more"),
             ("schedule", c["schedule"] in ("cosine", "wsd"), "cosine or wsd"),
             ("wsd_decay_frac", 0 <= c["wsd_decay_frac"] <= 1, "in [0, 1]"),
             ("precond_every", c["precond_every"] >= 1, "at least 1"),
             ("galore_rank", c["galore_rank"] >= 1, "at least 1"),
             ("galore_gap", c["galore_gap"] >= 1, "at least 1"),
             ("dtype", c["dtype"] in ("auto", "float32", "bfloat16"), "auto, float32 or bfloat16"),
             ("num_samples", c["num_samples"] >= 0, "0 or more"),
             ("max_new_tokens", c["max_new_tokens"] >= 0, "0 or more"),
             ("temperature", c["temperature"] >= 0, "0 (greedy) or more"),
             ("top_k", c["top_k"] >= 1, "at least 1 (the vocabulary size keeps every token)")]
    rules += [(k, c[k] >= 1, "at least 1") for k in MODEL_SIZES if k in c]
    for key, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"--{key}={c[key]!r} is not valid: use {allowed}")
    if c["device"] != "auto":
        try:
            torch.device(c["device"])
        except RuntimeError:
            raise ConfigError(f"--device={c['device']!r} is not a device: use auto, cpu, cuda, cuda:1 or mps") from None


def check_out_dir(path):
    """out_dir must be a folder that exists or can be made, and be writable."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--out_dir={path!r}: {existing} is a file, not a folder: point --out_dir elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out_dir={path!r}: the folder {existing} is not writable: point --out_dir elsewhere")


def make_out_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create --out_dir={path!r} ({e.strerror}): point --out_dir elsewhere") from None


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
    data.atomic_write(path, lambda tmp: torch.save(state, tmp))  # a crash mid-write keeps the previous one


def load_checkpoint(path):
    """The checkpoint dict at path, or a one-line error when it is missing, unreadable or not specgpt's."""
    if not os.path.isfile(path):
        raise ConfigError(f"no checkpoint at {path}: train first, or point --out_dir at a run")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects weights_only refuses
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__}): "
                          f"delete it and train again, or point at another run") from None
    if not isinstance(ckpt, dict) or not {"model", "config", "meta"} <= ckpt.keys():
        raise ConfigError(f"{path} is not a specgpt checkpoint (no model, config and meta): point at a train.py run")
    return ckpt


def load_weights(model, ckpt, path):
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ConfigError(f"the weights in {path} do not fit this model ({str(e).splitlines()[0]}): "
                          f"train again with this version of model.py") from None


def resumed_model_config(saved, given):
    """The checkpoint's model keys (GPTConfig's default for a key newer than the checkpoint). A model key
    given on the command line must equal the checkpoint's, except those of RESUME_CHANGEABLE, which take
    effect. Returns (model config, descriptions of the changes)."""
    config, changes = {}, []
    for key, default in model_defaults().items():
        config[key] = saved.get(key, default)
        if key in given and given[key] != config[key]:
            if key not in RESUME_CHANGEABLE:
                raise ConfigError(f"--{key}={given[key]!r} differs from the checkpoint's {key}={config[key]!r}: "
                                  f"a resumed run keeps its model; drop --{key}, or start a new run in another --out_dir")
            changes.append(f"{key} {config[key]!r} -> {given[key]!r}")
            config[key] = given[key]
    return config, changes


def check_same_vocabulary(meta, saved_meta, saved_dataset):
    same = all(meta.get(k) == saved_meta.get(k) for k in ("tokenizer", "vocab_size", "chars"))
    if not same:
        raise ConfigError(f"--dataset={dataset!r} has a {meta['tokenizer']} vocabulary of {meta['vocab_size']} tokens, "
                          f"the checkpoint's ({saved_dataset!r}) a {saved_meta['tokenizer']} vocabulary of "
                          f"{saved_meta['vocab_size']}: resume with --dataset={saved_dataset!r}")


def print_samples(model, meta, device, n, length):
    tok = data.tokenizer_from_meta(meta)
    prompt = torch.tensor([tok.encode(start)], dtype=torch.long, device=device)
    model.eval()
    for i in range(n):
        out = model.generate(prompt, length, temperature=temperature, top_k=top_k)
        print(f"--- sample {i + 1} ---\n{tok.decode(out[0].tolist())}")


def diverged(what, iter_num, ckpt_path, saved_iter):
    kept = f"{ckpt_path} still holds iter {saved_iter}" if saved_iter is not None else "no checkpoint was written"
    hint = f"try a lower --learning_rate (now {learning_rate:g})" + (" or --grad_clip=1.0" if grad_clip == 0 else "")
    return f"{what} at iter {iter_num}: stopped, {kept}; {hint}"


# ----------------------------------------------------------------------------------------------------

def main(args):
    defaults = {**RUN_DEFAULTS, **model_defaults()}
    given = parse_config(args, defaults, __doc__, config_help())
    cfg = {**defaults, **given}
    check_settings(cfg)
    globals().update({k: cfg[k] for k in RUN_DEFAULTS})
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
        model_cfg, changes = resumed_model_config(ckpt["config"], given)
        model = GPT(GPTConfig(vocab_size=ckpt["meta"]["vocab_size"], **model_cfg)).to(dev)
        load_weights(model, ckpt, ckpt_path)
        print_samples(model, ckpt["meta"], dev, num_samples, max_new_tokens)
        return

    # everything that can fail on bad input happens before anything is written
    check_out_dir(out_dir)
    train_tokens, val_tokens, meta = data.load_dataset(dataset, tokenizer)
    ckpt = load_checkpoint(ckpt_path) if init_from == "resume" else None
    model_cfg, changes = {k: cfg[k] for k in model_defaults()}, []
    if ckpt is not None:
        check_same_vocabulary(meta, ckpt["meta"], ckpt["config"].get("dataset"))
        model_cfg, changes = resumed_model_config(ckpt["config"], given)
    cfg.update(model_cfg, vocab_size=meta["vocab_size"])
    config = GPTConfig(vocab_size=meta["vocab_size"], **model_cfg)
    for split, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if len(tokens) < config.block_size + 2:
            raise ConfigError(f"the {split} split of {dataset} has only {len(tokens)} tokens (the validation split is "
                              f"the last 10% of a text), fewer than block_size + 2 = {config.block_size + 2}: "
                              f"use more text or a smaller --block_size")
    torch.manual_seed(seed)
    model = GPT(config).to(dev)
    opt = build_optimizer(model, optimizer, lr=learning_rate, weight_decay=weight_decay, aux_lr=aux_lr,
                          aux_betas=(beta1, beta2), spectral_lr=spectral_lr, **optimizer_options())
    train_sampler = data.BatchSampler(train_tokens, batch_size, config.block_size, seed=seed + rank)
    iter_num, best_val, val_loss, elapsed, saved_iter = 0, float("inf"), float("nan"), 0.0, None
    if ckpt is not None:
        load_weights(model, ckpt, ckpt_path)
        opt.load_state_dict(ckpt["optimizer"])
        train_sampler.load_state_dict(ckpt["sampler"][rank] if rank < len(ckpt["sampler"]) else ckpt["sampler"][0])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val_loss"]
        val_loss, elapsed, saved_iter = ckpt.get("val_loss", best_val), ckpt.get("elapsed", 0.0), iter_num

    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and device_type == "cuda")
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    raw_model = model
    if compile if compile is not None else device_type == "cuda":
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    total_iters = lr_decay_iters or max_iters
    tokens_per_iter = gradient_accumulation_steps * world * batch_size * config.block_size
    flops_per_iter = raw_model.flops_per_token(config.block_size) * tokens_per_iter / world
    peak = peak_flops(device_type)
    log_path = os.path.join(out_dir, "log.jsonl")
    if master:
        make_out_dir(out_dir)
        if ckpt is None and os.path.exists(log_path):
            os.remove(log_path)  # a new run starts a new log
        elif ckpt is not None and os.path.exists(log_path):  # drop what was logged after the checkpoint
            kept = [line for line in open(log_path) if line.strip() and json.loads(line)["step"] <= iter_num]
            data.atomic_write_bytes(log_path, "".join(kept).encode())
        print(f"{dataset}: {len(train_tokens):,} train tokens, vocab {meta['vocab_size']} | model "
              f"{raw_model.num_params() / 1e6:.2f}M params, mixer {config.mixer}, residual {config.residual} | "
              f"{optimizer} | {dev}{' bf16' if use_bf16 else ''} | {tokens_per_iter:,} tokens/iter ({world} x "
              f"{gradient_accumulation_steps} x {batch_size} x {config.block_size})")
        if ckpt is not None:
            print(f"resuming at iter {iter_num}" + (f"; changed: {', '.join(changes)}" if changes else ""))

    def log(row):
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    @torch.no_grad()
    def evaluate():
        model.eval()
        val_sampler = data.BatchSampler(val_tokens, batch_size, config.block_size, seed=0)  # same batches each eval
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
                "iter_num": iter_num, "best_val_loss": best_val, "val_loss": val_loss,
                "elapsed": time.time() - t_start, "sampler": samplers,
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}}

    if analyze_every:  # one fixed training batch, so the spectra logged at different steps are comparable
        import analyze
        analysis_batch = tuple(t.to(dev) for t in data.BatchSampler(train_tokens, batch_size, config.block_size, seed=1).next_batch())
    t_start, t_last, tokens_since = time.time() - elapsed, time.time(), 0
    last_eval = iter_num if ckpt is not None else -1  # the checkpoint already holds the eval at its step
    model.train()
    while True:
        if (iter_num % eval_interval == 0 or iter_num >= max_iters) and iter_num != last_eval:
            val_loss, last_eval = evaluate(), iter_num
            if not math.isfinite(val_loss) or not all(torch.isfinite(p).all() for p in raw_model.parameters()):
                raise FloatingPointError(diverged(f"val loss {val_loss} (or a weight not finite)", iter_num,
                                                  ckpt_path, saved_iter))
            best_val = min(best_val, val_loss)
            state = checkpoint_state()
            if master:
                print(f"iter {iter_num}: val loss {val_loss:.4f} (best {best_val:.4f}), "
                      f"{time.time() - t_start:.1f}s elapsed")
                log({"step": iter_num, "val": val_loss, "time": time.time() - t_start})
                save_checkpoint(ckpt_path, state)
            saved_iter = iter_num
        if iter_num >= max_iters:
            break

        if analyze_every and iter_num % analyze_every == 0 and master:
            analyze.analyze_during_training(raw_model, analysis_batch, iter_num, out_dir)
        lr_mult = lr_multiplier(iter_num, total_iters, warmup_iters, min_lr / learning_rate, schedule, wsd_decay_frac)
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
            raise FloatingPointError(diverged(f"training loss {loss_sum}", iter_num, ckpt_path, saved_iter))
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
            log({"step": iter_num, "loss": loss_sum, "lr": opt.param_groups[0]["lr"], "tokens_per_s": tok_s, "mfu": mfu})
            t_last, tokens_since = now, 0

    if master:
        plot_losses(log_path, os.path.join(out_dir, "loss.png"))
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
    rows = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "train"), ("val", "val")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, marker="." if key == "val" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    data.atomic_write(png_path, fig.savefig)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # bad input: one line that says what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
