"""
Train a specgpt model.

    python train.py                                  # baby GPT on shakespeare_char, ~2 minutes on a CPU
    python train.py --mixer=GGGA --optimizer=muon    # flip any config key with --key=value
    python train.py my_config.py --max_iters=500     # a config file (plain Python assignments), then overrides
    python train.py config/gpt2_small_fineweb.py --dry_run=True   # a preset's size, memory and GPU time; no run
    python train.py --init_from=resume               # continue out_dir/ckpt.pt exactly where it stopped
    python train.py --overwrite=True                 # a new run in place of the one in out_dir
    python train.py --sample_only=True --start="ROMEO:"   # sample from out_dir/ckpt.pt
    torchrun --nproc_per_node=2 train.py             # data-parallel (DDP) on 2 processes

The config keys are the run settings below and every field of model.GPTConfig (the model; only
MODEL_DEFAULTS differ from GPTConfig's defaults). Every value is checked before anything is written: a
wrong key, type or value stops with a one-line error. The checkpoint out_dir/ckpt.pt (written
atomically at every eval, only while the loss and weights are finite) holds the model, the optimizer,
the config, the RNG and sampler states, so a resumed CPU run continues bit for bit; a resumed run takes its
settings from the checkpoint, except those given again. A new run never replaces the run in out_dir unasked,
and with --overwrite=True deletes it only after its own first checkpoint (out_dir/.replaced holds it until then);
out_dir/.lock keeps a second process out while one trains there. Ctrl-C (or SIGTERM) stops the run after the
step it is in (or abandons the eval it is in), with a checkpoint to resume from.
"""
import glob
import inspect
import json
import math
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import fields, replace
from types import SimpleNamespace

import torch

import data
import kernels
import model
import optim
from model import GPT, GPTConfig

# ----------------------------------------------------------------------------------------------------
# config: the run's settings (module-level values, overridden by config files and --key=value;
# the comment beside each is its --help text)
out_dir = "out"                # folder for ckpt.pt, log.jsonl, loss.png
init_from = "scratch"          # where the run starts: from scratch, or resume out_dir/ckpt.pt
overwrite = False              # a new run may replace the run in out_dir (deleted at the new one's first checkpoint)
sample_only = False            # load out_dir/ckpt.pt, print samples, exit
eval_interval = 250            # steps between evals (each eval writes the checkpoint)
eval_iters = 20                # validation batches per eval (a fixed set, the same at every eval)
log_interval = 50              # steps between training-loss lines
analyze_every = 0              # > 0: every N iters append weight/Hessian/noise-scale spectra to out_dir/analysis.jsonl
seed = 1337                    # seeds the init and the training batches
dry_run = False                # print the run's size, FLOPs, memory and estimated GPU time, then exit: no out_dir
wandb_log = False              # also log to Weights & Biases (pip install wandb); log.jsonl is written either way
wandb_project = "specgpt"      # wandb's project
wandb_run_name = ""            # wandb's run name ("": wandb picks one)
# data
dataset = "shakespeare_char"   # shakespeare_char | shakespeare | path/to/file.txt | 'dir/*_train_*.bin'
tokenizer = "auto"             # data.TOKENIZERS; auto: the dataset's own (gpt2: shakespeare, shards; else char)
batch_size = 24                # sequences per micro-step (per process)
gradient_accumulation_steps = 1  # micro-steps per optimizer step (per process)
# optimizer (see optim.py; each optimizer's own settings, momentum, beta1, ..., are declared in its row of
# optim.OPTIMIZERS and become config keys here: OPTIMIZER_SETTINGS below)
optimizer = "muon"             # the optimizer of the blocks' matrices (optim.OPTIMIZERS)
learning_rate = 0.0            # peak lr of the schedule; 0: the optimizer's own (its row's lr: muon 0.02)
min_lr = 3e-4                  # the schedule's floor; every param group is scaled by the same multiplier
weight_decay = 0.1             # decoupled weight decay of the matrices
aux_lr = 3e-3                  # matrix optimizers: AdamW's lr for embeddings, head, norms, gates, HC
spectral_lr = False            # scale each block matrix's lr by optim.spectral_lr_scale(fan_out, fan_in)
grad_clip = 1.0                # clip the gradient's global norm to this; 0 disables
max_iters = 640                # optimizer steps
lr_decay_iters = 0             # length of the schedule; 0 means max_iters
warmup_iters = 30              # linear warmup steps
schedule = "cosine"            # after the warmup: a cosine, or wsd (constant, then linear over wsd_decay_frac)
wsd_decay_frac = 0.2           # wsd: fraction of the steps spent decaying (0: a constant lr after warmup)
# system
device = "auto"                # auto (cuda > mps > cpu) | cpu | cuda | cuda:1 | mps
dtype = "auto"                 # auto: 16-bit autocast on CUDA (bfloat16, or float16 with a loss scaler where the
                               # GPU lacks bf16: T4, V100), float32 elsewhere
compile = None                 # None: torch.compile on CUDA only; True / False force it
peak_tflops = 0.0              # the peak MFU is measured against; 0: GPU_PEAKS for a listed GPU, no MFU elsewhere
# sampling at the end (and with sample_only)
num_samples = 2                # samples printed at the end; 0 for none
max_new_tokens = 300           # tokens per sample
temperature = 0.8              # softmax temperature of sampling; 0 is greedy
top_k = 40                     # sample among the top_k most likely tokens (the vocabulary size: all)
start = "\n"                   # the prompt of every sample
# ----------------------------------------------------------------------------------------------------
# the optimizers' settings: {key: (optim.Setting, the optimizers that take it)}, then every run setting's default
OPTIMIZER_SETTINGS = optim.optimizer_settings(optim.OPTIMIZERS)
RUN_DEFAULTS = {**{k: v for k, v in globals().items()
                   if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))},
                **{key: setting.default for key, (setting, _) in OPTIMIZER_SETTINGS.items()}}
# the model's keys are GPTConfig's fields (vocab_size comes from the data); the run's own defaults:
# nanoGPT's shakespeare_char context; one Mamba2 layer below three attention layers, narrowed to an inner width
# of n_embd and a state of 16 (its short convolution and recurrence lower the loss per step far more than the
# layer costs), and RMSNorm on queries and keys (RESULTS.md, "The default run")
MODEL_DEFAULTS = {"block_size": 64, "mixer": "MAAA", "mamba_expand": 1, "mamba_d_state": 16, "qk_norm": True}
# model keys that may change on resume: they change how the same weights compute or train, not the weights
RESUME_CHANGEABLE = ("kernels", "attention", "chunk_size", "dropout", "rope_scaling", "rope_factor")
# run settings that describe this command, not the run: a resumed run takes the others from its checkpoint
COMMAND_KEYS = ("out_dir", "init_from", "overwrite", "sample_only")
# the files a run writes in out_dir
RUN_FILES = ("ckpt.pt", "log.jsonl", "loss.png", "analysis.jsonl", "analysis.png")
# the allowed values of each numeric key (data.in_range): ">= a", "> a", or an interval "in [a, b)"; the model's
# keys' are model.CONFIG_RANGES (analyze.py checks them too)
RANGES = {"eval_interval": ">= 1", "eval_iters": ">= 1", "log_interval": ">= 1", "analyze_every": ">= 0",
          "seed": "in [0, 2**63)",
          "batch_size": ">= 1", "gradient_accumulation_steps": ">= 1", "learning_rate": ">= 0", "min_lr": ">= 0",
          "weight_decay": ">= 0", "aux_lr": ">= 0", "grad_clip": ">= 0", "max_iters": ">= 0", "lr_decay_iters": ">= 0",
          "warmup_iters": ">= 0", "wsd_decay_frac": "in [0, 1]", "num_samples": ">= 0", "max_new_tokens": ">= 0",
          "temperature": ">= 0", "top_k": ">= 1", "peak_tflops": ">= 0", **model.CONFIG_RANGES,
          **{key: s.allowed for key, (s, _) in OPTIMIZER_SETTINGS.items() if isinstance(s.allowed, str)}}
# --dtype: the autocast dtype of each choice (float32: no autocast); float16 scales the loss (torch.amp.GradScaler)
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
# with no config file on a GPU, train.py still trains the CPU baby model, and names this preset (see gpu_hint)
GPU_PRESET = "config/shakespeare_char_gpu.py"
# one training step that would take longer than this at the device's peak FLOP/s is a typo, not a run
MAX_STEP_SECONDS = 3600
# a CPU run that would take longer than this (at the CPU's measured matmul rate) is told it is sized for a GPU
LONG_CPU_RUN_SECONDS = 600
# a long phase (an eval) prints a progress line after this many seconds, and again after each such interval
PROGRESS_SECONDS = 5


def model_defaults():
    """GPTConfig's fields and defaults, with MODEL_DEFAULTS in place of GPTConfig's own."""
    return {f.name: MODEL_DEFAULTS.get(f.name, f.default) for f in fields(GPTConfig) if f.name != "vocab_size"}


def choices():
    """The keys that take one of a set of values, and those values; the kinds come from their tables, read
    when asked, so a kind added to a table is allowed and listed at once."""
    return {"init_from": ("scratch", "resume"), "tokenizer": ("auto", *data.TOKENIZERS),
            "optimizer": tuple(optim.OPTIMIZERS), "schedule": ("cosine", "wsd"), "dtype": ("auto", *DTYPES),
            **model.config_choices(),
            **{key: tuple(s.allowed) for key, (s, _) in OPTIMIZER_SETTINGS.items() if not isinstance(s.allowed, str)}}


def config_help():
    """{key: description}: the comment beside each run setting above and each GPTConfig field, each optimizer
    setting's help with the optimizers that take it, and each choice's values with their rows' comments."""
    settings = {key: f"{', '.join(users)}: {s.help}"
                for key, (s, users) in OPTIMIZER_SETTINGS.items()}
    return {**data.source_comments(inspect.getsource(GPTConfig)), **data.source_comments(open(__file__).read()),
            **settings}


def allowed_help():
    """{key: --help's text of its allowed values}: the ranges, and each choice with its table row's comment."""
    tables = {**{key: (model, table) for key, table in model.CHOICE_TABLES.items()},
              "optimizer": (optim, "OPTIMIZERS"), "tokenizer": (data, "TOKENIZERS")}
    return {**RANGES, **data.choices_help(choices(), tables)}


def check_settings(c):
    """Every key's range and choice and the device (data.check_values, as analyze.py checks them), the model's own
    rules (GPTConfig's, with a stand-in vocabulary: before any data is read), the rule between the lrs, and the kernel
    path."""
    data.check_values(c, RANGES, {key: allowed for key, allowed in choices().items() if key != "mixer"})
    GPTConfig(**{key: c[key] for key in model_defaults()})  # mixer letters, head size, ...
    if c["min_lr"] > peak_lr(c):
        given = f"--learning_rate={c['learning_rate']!r}" if c["learning_rate"] else \
            f"{c['optimizer']}'s own learning rate {peak_lr(c)!r} (optim.OPTIMIZERS)"
        raise data.ConfigError(f"--min_lr={c['min_lr']!r} is above {given}: the schedule decays from the learning "
                               f"rate down to min_lr; use a smaller --min_lr (1.5% of it: {0.015 * peak_lr(c):.3g})")
    check_kernel_path(c["kernels"], c["device"])


def peak_lr(c):
    """--learning_rate, or where it is 0 the optimizer's own: its row's lr in optim.OPTIMIZERS."""
    return c["learning_rate"] or optim.OPTIMIZERS[c["optimizer"]].lr


def check_kernel_path(path, device):
    """--kernels=triton needs Triton where the run computes: a CUDA GPU, or on a CPU Triton's interpreter (set before
    Python starts)."""
    on_gpu = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
    if path == "triton" and not (kernels.HAS_TRITON and (on_gpu or os.environ.get("TRITON_INTERPRET") == "1")):
        raise data.ConfigError("--kernels='triton' needs Triton on a CUDA GPU (on a CPU, slowly, its interpreter: "
                               "TRITON_INTERPRET=1 python train.py ...): use --kernels=auto or torch")


def check_run_folder(out_dir, init_from, overwrite):
    """A new run never replaces the run in out_dir (its checkpoint) unasked."""
    if init_from == "scratch" and not overwrite and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        raise data.ConfigError(f"--out_dir={out_dir!r} holds a run (ckpt.pt): continue it with --init_from=resume, "
                               f"start this one in another --out_dir, or replace it with --overwrite=True")


def prepare_run_folder(out_dir, resume_iter):
    """A new run (resume_iter None) sets the files of the run it replaces aside (data.set_aside_run: deleted at its
    first checkpoint, put back if it stops before) and returns whether there were any; a resumed one keeps the rows
    of its logs up to its checkpoint's step, dropping (and saying so) lines that a crash or a full disk cut short and
    rows that are no step's."""
    if resume_iter is None:
        return data.set_aside_run(out_dir, RUN_FILES)
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        if name.endswith(".jsonl") and os.path.exists(path):
            rows, dropped = data.read_jsonl(path)
            kept = "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= resume_iter)
            data.atomic_write_bytes(path, kept.encode())
            for why, count in dropped.items():
                print(f"note: dropped {count} line{'s' * (count > 1)} of {path} {why}")
    return False


def put_back_replaced_run(out_dir):
    """The run a new run set aside comes back when the new one ends before its first checkpoint."""
    if data.restore_run(out_dir, RUN_FILES):
        print(f"note: {out_dir} holds the run it held before again: this run stopped before its first checkpoint")


def schedule_note(c):
    """A warmup longer than the schedule is legal (a short trial run) but worth a line: the lr never peaks."""
    schedule = c.lr_decay_iters or c.max_iters
    if c.max_iters and c.warmup_iters > schedule:
        return (f"note: the warmup ({c.warmup_iters} iters) is longer than the schedule ({schedule} iters): the lr "
                f"never reaches --learning_rate={c.learning_rate:g}; a shorter --warmup_iters makes it")
    return None


def resumed_settings(saved, given):
    """A resumed run's settings: its checkpoint's (the defaults for keys newer than the checkpoint, and for
    COMMAND_KEYS), then those given now; the model keys as resumed_model_config allows. Returns (settings,
    descriptions of the changes)."""
    settings, changes = {}, []
    for key, default in RUN_DEFAULTS.items():
        settings[key] = default if key in COMMAND_KEYS else saved.get(key, default)
        if key in given and given[key] != settings[key]:
            if key not in COMMAND_KEYS:
                changes.append(f"{key} {settings[key]!r} -> {given[key]!r}")
            settings[key] = given[key]
    model_config, model_changes = resumed_model_config(saved, given)
    return {**settings, **model_config}, changes + model_changes


def resumed_model_config(saved, given):
    """The checkpoint's model keys (GPTConfig's default for a key newer than the checkpoint). A model key
    given on the command line must equal the checkpoint's, except those of RESUME_CHANGEABLE, which take
    effect. Returns (model config, descriptions of the changes)."""
    config, changes = {}, []
    for key, default in model_defaults().items():
        config[key] = saved.get(key, default)
        if key in given and given[key] != config[key]:
            if key not in RESUME_CHANGEABLE:
                raise data.ConfigError(f"--{key}={given[key]!r} differs from the checkpoint's {key}={config[key]!r}: "
                                       f"a resumed run keeps its model; drop --{key}, or start a new run in another "
                                       f"--out_dir")
            changes.append(f"{key} {config[key]!r} -> {given[key]!r}")
            config[key] = given[key]
    return config, changes


def check_schedule_length(saved, settings, given):
    """Resuming with another max_iters would silently move the end of the lr schedule (a cosine stretched past
    its floor climbs back up): a new length must be asked for with --lr_decay_iters."""
    before = saved.get("lr_decay_iters") or saved.get("max_iters")
    now = settings["lr_decay_iters"] or settings["max_iters"]
    if now != before and "lr_decay_iters" not in given:
        raise data.ConfigError(f"--max_iters={settings['max_iters']} would change the lr schedule's length from "
                               f"{before} to {now} iters: keep it with --lr_decay_iters={before} (past it the lr "
                               f"stays at min_lr), or stretch it with --lr_decay_iters={now}")


def check_same_vocabulary(meta, dataset, saved_meta, saved_dataset):
    if any(meta.get(k) != saved_meta.get(k) for k in ("tokenizer", "vocab_size", "chars")):
        raise data.ConfigError(f"--dataset={dataset!r} has a {meta['tokenizer']} vocabulary of {meta['vocab_size']} "
                               f"tokens, the checkpoint's ({saved_dataset!r}) a {saved_meta['tokenizer']} vocabulary "
                               f"of {saved_meta['vocab_size']}: resume with --dataset={saved_dataset!r}")


def check_prompt(start, tokenizer, dataset):
    """The samples' prompt must be at least one token of the vocabulary."""
    try:
        ids = tokenizer.encode(start)
    except data.DataError as e:
        raise data.ConfigError(f"--start={start!r} (the samples' prompt) does not fit the vocabulary of {dataset} "
                               f"({e}): give a prompt made of its characters, or --num_samples=0") from None
    if not ids:
        raise data.ConfigError(f"--start={start!r} (the samples' prompt) is empty: give at least one character")


def check_step_time(flops_per_iter, peak, device):
    """One step that would take over MAX_STEP_SECONDS even at the device's peak is refused: a block_size or
    batch_size far beyond what the device can train."""
    if peak and flops_per_iter / peak > MAX_STEP_SECONDS:
        raise data.ConfigError(f"one step of this run is {flops_per_iter:.1e} FLOPs, over "
                               f"{flops_per_iter / peak / 3600:,.0f} hours on {device} even at its peak of "
                               f"{peak:.1e} FLOP/s: use a smaller --block_size, --batch_size or model")


# ----------------------------------------------------------------------------------------------------
# device, precision, MFU

def gpu_hint(args, device):
    """The line for a GPU user of plain `python train.py`: the run is the CPU baby model, and GPU_PRESET is the one
    sized for a GPU. The same command trains the same model on every device, so its numbers compare."""
    if device.type == "cuda" and not any(not a.startswith("--") or a.startswith("--config=") for a in args):
        return (f"note: no config file, so this is the CPU baby model (seconds of GPU work); sized for a GPU: "
                f"python train.py {GPU_PRESET}")
    return None


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


def matmul_rate():
    """A float32 matmul rate of this machine measured now (0.2 s): an optimistic speed for check_step_time only,
    as MFU against it would swing with the machine's load."""
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))  # leaves the global RNG alone
    b = a @ a
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ b
        n += 1
    return 2 * 512 ** 3 * n / (time.perf_counter() - t0)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ----------------------------------------------------------------------------------------------------
# optimizer, evaluation, samples

def optimizer_options(c):
    """The settings the chosen optimizer takes, by its constructor's argument names (optim.OPTIMIZERS)."""
    options = optim.optimizer_kind(c.optimizer).options
    return {arg: tuple(vars(c)[s.key] for s in declared) if isinstance(declared, tuple) else vars(c)[declared.key]
            for arg, declared in options.items()}


@torch.no_grad()
def evaluate(model, val_tokens, batch_size, block_size, eval_iters, device, autocast, received=None):
    """The mean validation loss over eval_iters batches, the same ones at every call (seed 0), with progress lines when
    it runs long; None when a signal came (received: stop_signals' list): the eval is abandoned at once."""
    was_training = model.training
    model.eval()
    sampler = data.BatchSampler(val_tokens, batch_size, block_size, seed=0, device=device)
    total = torch.zeros((), device=device)
    try:
        with abandoned_on_signal(received):
            for _ in progress(range(eval_iters), "eval", "batches"):
                x, y = sampler.next_batch()
                with autocast:
                    total += model(x, y)[1].float()
    except Abandoned:
        return None
    finally:
        model.train(was_training)
    return total.item() / eval_iters  # one host sync per eval


def progress(items, label, unit):
    """items one by one, printing `label: i/n unit, t s, about r s to go` (rank 0) every PROGRESS_SECONDS while it runs:
    a long phase never looks like a hang."""
    start = last = time.time()
    talk = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for done, item in enumerate(items, 1):
        yield item
        now = time.time()
        if talk and now - last >= PROGRESS_SECONDS and done < len(items):
            print(f"{label}: {done}/{len(items)} {unit}, {now - start:.0f} s, about "
                  f"{(now - start) * (len(items) - done) / done:.0f} s to go", flush=True)
            last = now


def all_finite(model):
    """Whether every weight is finite, with one host sync."""
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


def print_samples(model, tokenizer, prompt, device, n, length, temperature, top_k):
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    model.eval()
    for i in range(n):
        out = model.generate(idx, length, temperature=temperature, top_k=top_k)
        print(f"--- sample {i + 1} ---\n{tokenizer.decode(out[0].tolist())}")


def diverged(what, iter_num, ckpt_path, saved_iter, learning_rate, grad_clip):
    kept = f"{ckpt_path} still holds iter {saved_iter}" if saved_iter is not None else "no checkpoint was written"
    hint = f"try a lower --learning_rate (now {learning_rate:g})" + (" or --grad_clip=1.0" if grad_clip == 0 else "")
    return f"{what} at iter {iter_num}: stopped, {kept}; {hint}"


# log.jsonl's keys as they are named in wandb (the others keep their names)
WANDB_KEYS = {"loss": "train/loss", "val": "val/loss"}


def import_wandb():
    """wandb, once it is known that it can log: installed, and logged in (an API key in WANDB_API_KEY, ~/.netrc or
    wandb's settings, found by wandb's own lookup, without the network) unless WANDB_MODE or wandb's settings make it
    offline or disabled. Anything else is one line now, before any work."""
    try:
        import wandb
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth  # wandb 0.31's credentials lookup (requirements.txt pins that version)
    except ImportError:
        raise data.ConfigError("--wandb_log=True needs the wandb package: pip install wandb (or drop --wandb_log)") \
            from None
    settings = wandb_setup.singleton().settings
    if settings.mode in ("offline", "dryrun", "disabled"):
        return wandb
    try:
        key = wbauth.authenticate_session(host=settings.base_url, source="train.py", prompt=False,
                                          update_session=False)
    except AuthenticationError as e:
        raise data.ConfigError(f"wandb's API key is not valid ({e}): run `wandb login`, set WANDB_MODE=offline, or "
                               f"drop --wandb_log") from None
    if key is None:
        raise data.ConfigError("wandb has no API key: run `wandb login`, set WANDB_MODE=offline, or drop --wandb_log")
    return wandb


def start_wandb(wandb, c, settings):
    """The wandb run of this run (its files in out_dir/wandb), or a one-line error (no network to an online server)."""
    try:
        return wandb.init(project=c.wandb_project, name=c.wandb_run_name or None, config=settings, dir=c.out_dir)
    except Exception as e:
        raise data.ConfigError(f"wandb could not start its run ({type(e).__name__}: {str(e).splitlines()[0]}): check "
                               f"the network, set WANDB_MODE=offline, or drop --wandb_log") from None


def append_log(path, row, wandb_run=None, sync=False):
    """One row of out_dir/log.jsonl (whole or not at all: data.append_line), and of the wandb run if there is one."""
    data.append_line(path, json.dumps(row), sync=sync)
    if wandb_run:
        wandb_run.log({WANDB_KEYS.get(k, k): v for k, v in row.items() if k != "step"}, step=row["step"])


def save_run(path, raw_model, opt, sampler, master, settings, meta, **progress):
    """Writes the checkpoint: the model, the optimizer, the settings, the RNG and every process's sampler state
    (so that a resumed run sees the batches it would have seen), and progress (iter_num, losses, time). Under
    DDP every process calls it: the sampler states are gathered."""
    samplers = [sampler.state_dict()]
    if torch.distributed.is_initialized():
        samplers = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(samplers, sampler.state_dict())
    if master:
        cuda = next(raw_model.parameters()).device.type == "cuda"
        data.save_checkpoint(path, {
            "model": raw_model.state_dict(), "optimizer": opt.state_dict(), "config": settings, "meta": meta,
            "sampler": samplers, "rng": {"torch": torch.get_rng_state(),
                                         "cuda": torch.cuda.get_rng_state() if cuda else None}, **progress})
        data.drop_replaced_run(os.path.dirname(path))  # the first checkpoint of a new run: the one it replaces goes


@contextmanager
def signals_handled_by(handle):
    """While inside, handle(signum, frame) handles SIGINT (Ctrl-C) and SIGTERM; then the previous handlers are back."""
    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def stop_signals(again_stops=True):
    """While inside, SIGINT (Ctrl-C) and SIGTERM append their number to the list this yields, and the loop
    stops after the step it is in; a second signal raises KeyboardInterrupt (stop at once, saving nothing), unless
    again_stops is False: torchrun passes each signal it gets on to every process (which got Ctrl-C already)."""
    received = []

    def handle(signum, frame):
        if received and again_stops:
            raise KeyboardInterrupt
        received.append(signum)
    with signals_handled_by(handle):
        yield received


class Abandoned(Exception):
    """A signal came while inside abandoned_on_signal."""


@contextmanager
def abandoned_on_signal(received):
    """Inside, SIGINT and SIGTERM are recorded in received (stop_signals' list; None: no change) and raise Abandoned,
    so what runs inside (an eval, minutes on a CPU) stops within an op, not at its end; a signal received before
    entering raises it at once. The run then stops as after a step."""
    if received is None:
        yield
        return
    if received:
        raise Abandoned

    def handle(signum, frame):
        received.append(signum)
        raise Abandoned
    with signals_handled_by(handle):
        yield


def stop_requested(received, ddp, device):
    """Whether a signal asked the run to stop; under DDP, whether one reached any process (each calls this at
    the same steps, so that all stop after the same one)."""
    if not ddp:
        return bool(received)
    flag = torch.tensor([float(bool(received))], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def evals_left(iter_num, max_iters, eval_interval):
    """The evals still to come at the log line of step iter_num (its own eval comes after it): at each multiple
    of eval_interval from iter_num to max_iters, and at max_iters."""
    return max_iters // eval_interval - (iter_num - 1) // eval_interval + (max_iters % eval_interval != 0)


def plot_losses(log_path, png_path):
    """Training loss (every log line) and validation loss (every eval) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, _ = data.read_jsonl(log_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "train"), ("val", "val")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, marker="." if key == "val" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if ax.lines:  # a run stopped in its first eval has logged nothing yet
        ax.legend()
    fig.tight_layout()
    data.atomic_write(png_path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# what a run costs, from its settings alone, without building its model: the dry run prints it, and a run checks that
# it fits before it builds anything. Parameters by closed form, checked against a count; memory by formula; time as an
# estimate.

ESTIMATE_MFU = 0.4   # the model FLOPs utilisation the time estimates assume
ESTIMATE_GPUS = {"A100": "NVIDIA A100-SXM4-80GB", "H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}


def size(nbytes):
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def duration(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


def run_costs(c, config, world, act):
    """What the run costs: parameters (counted, and model.param_formula's closed form), FLOPs a token, and the memory
    of one process by formula (act bytes an activation). Counted on one period of its layers (a block per letter of
    the mixer string) built on the meta device and scaled to n_layer, so any depth answers at once; the optimizer's
    state (optim.state_bytes) after one step on the meta device, which creates the state's tensors and computes
    nothing."""
    period = min(config.n_layer, len(config.mixer))
    with torch.device("meta"):
        gpt = GPT(replace(config, n_layer=period))
    opt = optim.build_optimizer(gpt, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay, aux_lr=c.aux_lr,
                                aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr, **optimizer_options(c))
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
                  model.activation_formula(config, c.batch_size, act),
              "the loss's peak": (act + 4) * c.batch_size * config.block_size * config.padded_vocab_size}
    return SimpleNamespace(n_params=n_params, parts=model.param_formula(config), memory=memory,
                           flops_token=6 * matmul_weights + extra)


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
    if device.type == "cuda":
        have, where, processes = torch.cuda.get_device_properties(device).total_memory, str(device), 1
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to check against
            return
        where, processes = "this machine's RAM", int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    total = processes * sum(need.values())
    if total > have:
        each = f"{processes} processes x " if processes > 1 else ""
        raise data.ConfigError(f"this run needs at least {size(total)} by formula ({each}" + ", ".join(
            f"{k} {size(v)}" for k, v in need.items()) + f"), more than the {size(have)} of {where}: use a smaller "
            f"--n_layer or --n_embd (the weights and optimizer state), --batch_size or --block_size (the activations)")


def sized_for_a_gpu(c, flops_per_iter, flops, rate):
    """A CPU run estimated at over LONG_CPU_RUN_SECONDS (its FLOPs at the CPU's float32 matmul rate) is a GPU preset
    run on a CPU: the line that says so, with the estimate; None for a CPU-sized run."""
    if flops / rate < LONG_CPU_RUN_SECONDS:
        return None
    return (f"note: this run is sized for a GPU: on this CPU its {c.max_iters} steps and evals take at least "
            f"{duration(flops / rate)} ({flops_per_iter / rate:.1f} s a step at the {rate / 1e9:.0f} GFLOP/s of a "
            f"float32 matmul measured now; an optimistic estimate); --dry_run=True prices it on GPUs")


def dry_run_report(settings, world):
    """The dry run's lines: the model and its parameters against the closed form, the tokens, the FLOPs, the
    memory of one process (weights, gradients, optimizer state, activations) and the GPU time (estimates)."""
    c = SimpleNamespace(**settings)
    vocab_size = data.dataset_vocab_size(c.dataset, c.tokenizer)
    config = GPTConfig(vocab_size=vocab_size, **{k: settings[k] for k in model_defaults()})
    act = 4 if c.dtype == "float32" else 2  # "auto": bf16 autocast, as on the GPUs priced here
    costs = run_costs(c, config, world, act)
    n_params, parts = costs.n_params, costs.parts
    if None in parts.values():
        closed = f"(no closed form: {', '.join(model.kinds_without(config, 'n_params'))} declares no n_params; see " \
            f"model.MIXERS' protocol)"
    else:
        terms = " + ".join(f"{k} {v:,}" for k, v in parts.items() if v)
        closed = f"= the closed form: {terms}" if sum(parts.values()) == n_params else \
            f"but the closed form gives {sum(parts.values()):,} = {terms} (a layer changed: update its n_params)"
    tokens_per_iter, train_tokens, eval_tokens = run_tokens(c, config.block_size, world)
    flops = run_flops(costs.flops_token, train_tokens, eval_tokens)
    seconds = {gpu: flops / (ESTIMATE_MFU * GPU_PEAKS[name][0] * world) for gpu, name in ESTIMATE_GPUS.items()}
    memory = costs.memory
    if None in memory.values():
        missing = ", ".join(model.kinds_without(config, "kept_per_token"))
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
             f"time        estimates at {ESTIMATE_MFU:.0%} MFU, not measurements: " +
             ", ".join(f"{gpu} {duration(t)}" for gpu, t in seconds.items()) + (f", {world} GPUs" if world > 1 else "")]
    if data.is_shard_pattern(c.dataset):
        found = len(glob.glob(c.dataset))
        lines.append(f"data        {found} files match {c.dataset}" if found else f"data        no files match "
                     f"{c.dataset} yet: python data.py fineweb10B --shards=N fetches N x ~100M tokens")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------

def main(args):
    """Trains (or samples, with sample_only). Returns the exit status: 0, or 128 + the number of the signal
    that stopped the run (130 for Ctrl-C)."""
    with ExitStack() as cleanup:  # the out_dir lock, the signal handlers, DDP: released however it ends
        return run(args, cleanup)


def run(args, cleanup):
    # 1. settings: defaults (a resumed run: its checkpoint's settings), then config files, then --key=value;
    # every value is checked here
    defaults = {**RUN_DEFAULTS, **model_defaults()}
    given = data.parse_config(args, defaults, __doc__, config_help(), allowed=allowed_help())
    settings, ckpt, changes = {**defaults, **given}, None, []
    ckpt_path, log_path = os.path.join(settings["out_dir"], "ckpt.pt"), os.path.join(settings["out_dir"], "log.jsonl")
    if not settings["dry_run"] and int(os.environ.get("RANK", 0)) == 0:  # first, a run that a killed one set aside
        note = data.recover_run(settings["out_dir"], RUN_FILES)
        if note:
            print(note)
    if settings["init_from"] == "resume" and not settings["sample_only"]:
        ckpt = data.load_checkpoint(ckpt_path)
        settings, changes = resumed_settings(ckpt["config"], given)
    check_settings(settings)
    settings["learning_rate"] = peak_lr(settings)
    if ckpt is not None:
        check_schedule_length(ckpt["config"], settings, given)
    c = SimpleNamespace(**settings)

    # 2. device and processes: the device is made current (under torchrun, each process's GPU is its LOCAL_RANK's)
    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = kernels.use_device(c.device)
    if rank == 0 and gpu_hint(args, dev):
        print(gpu_hint(args, dev))
    if c.dry_run:  # what the run would cost, then stop: no process group, no data read, nothing written
        if rank == 0:
            print(dry_run_report(settings, world))
        return 0
    if dev.type == "cuda":  # float32 matmuls on TF32 tensor cores, as nanoGPT does
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        cleanup.callback(dist.destroy_process_group)
    master = rank == 0

    if c.sample_only:
        ckpt = data.load_checkpoint(ckpt_path)
        model_cfg, _ = resumed_model_config(ckpt["config"], given)
        tokenizer = data.tokenizer_from_meta(ckpt["meta"])
        check_prompt(c.start, tokenizer, ckpt["config"].get("dataset"))
        gpt = GPT(GPTConfig(vocab_size=ckpt["meta"]["vocab_size"], **model_cfg)).to(dev)
        data.load_weights(gpt, ckpt, ckpt_path)
        torch.manual_seed(c.seed)
        print_samples(gpt, tokenizer, c.start, dev, c.num_samples, c.max_new_tokens, c.temperature, c.top_k)
        return 0

    # 3. the run's folder, the data, wandb, the checkpoint's fit, the run's size (everything that can fail on bad
    # input fails before a write, and before the model is built)
    data.check_writable_folder(c.out_dir, "out_dir")
    if master:  # (the other processes would find the lock that rank 0 takes in step 5)
        data.check_unlocked(c.out_dir)
        check_run_folder(c.out_dir, c.init_from, c.overwrite)
    train_tokens, val_tokens, meta = data.load_dataset(c.dataset, c.tokenizer)
    wandb = import_wandb() if c.wandb_log and master else None
    if ckpt is not None:
        check_same_vocabulary(meta, c.dataset, ckpt["meta"], ckpt["config"].get("dataset"))
    settings.update(vocab_size=meta["vocab_size"])
    config = GPTConfig(vocab_size=meta["vocab_size"], **{key: settings[key] for key in model_defaults()})
    for split, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if len(tokens) < config.block_size + 2:
            raise data.ConfigError(f"the {split} split of {c.dataset} has only {len(tokens)} tokens (the validation "
                                   f"split is the last 10% of a text), fewer than block_size + 2 = "
                                   f"{config.block_size + 2}: use more text or a smaller --block_size")
    if c.num_samples > 0 and c.max_new_tokens > 0:
        check_prompt(c.start, data.tokenizer_from_meta(meta), c.dataset)
    check_fit(run_costs(c, config, world, act=2).memory, dev)

    # 4. model and optimizer, and the state of a resumed run
    torch.manual_seed(c.seed)
    raw_model = GPT(config).to(dev)
    opt = optim.build_optimizer(raw_model, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay,
                                aux_lr=c.aux_lr, aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr,
                                **optimizer_options(c))
    train_sampler = data.BatchSampler(train_tokens, c.batch_size, config.block_size, seed=c.seed + rank, device=dev)
    iter_num, best_val, val_loss, elapsed, saved_iter = 0, float("inf"), float("nan"), 0.0, None
    last_eval = -1  # the step of the last eval
    if ckpt is not None:
        data.load_weights(raw_model, ckpt, ckpt_path)
        opt.load_state_dict(ckpt["optimizer"])
        train_sampler.load_state_dict(ckpt["sampler"][rank] if rank < len(ckpt["sampler"]) else ckpt["sampler"][0])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if dev.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val_loss"]
        val_loss, elapsed, saved_iter = ckpt.get("val_loss", best_val), ckpt.get("elapsed", 0.0), iter_num
        last_eval = ckpt.get("val_iter", iter_num)  # a checkpoint written at a stop may predate its step's eval
    # mixed precision: float16's small range needs its loss scaled (GradScaler), which skips a step whose gradients
    # overflowed and lowers the scale; disabled, the scaler passes everything through unchanged
    half = DTYPES[c.dtype] if c.dtype != "auto" else kernels.autocast_dtype(dev) if dev.type == "cuda" else None
    autocast = torch.autocast(dev.type, dtype=half) if half else nullcontext()
    precision = {None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[half]
    scaler = torch.amp.GradScaler(dev.type, enabled=half == torch.float16)
    if ckpt is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    compiled = torch.compile(raw_model) if (c.compile if c.compile is not None else dev.type == "cuda") else raw_model
    gpt = compiled
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        gpt = DistributedDataParallel(compiled)
    total_iters = c.lr_decay_iters or c.max_iters
    tokens_per_iter, train_tokens_run, eval_tokens_run = run_tokens(c, config.block_size, world)
    flops_per_iter = raw_model.flops_per_token(config.block_size) * tokens_per_iter / world
    peak = peak_flops(dev, precision, c.peak_tflops)
    rate = peak or (matmul_rate() if dev.type == "cpu" else None)
    check_step_time(flops_per_iter, rate, dev)
    if master and dev.type == "cpu":
        flops = run_flops(raw_model.flops_per_token(config.block_size), train_tokens_run, eval_tokens_run) / world
        note = sized_for_a_gpu(c, flops_per_iter, flops, rate)
        if note:
            print(note, flush=True)
    if c.analyze_every:  # one fixed training batch, so the spectra logged at different steps are comparable
        import analyze
        analysis_batch = data.BatchSampler(train_tokens, c.batch_size, config.block_size, seed=1,
                                           device=dev).next_batch()

    # 5. the run's folder, locked, and wandb's run; then a new run sets the run it replaces aside (deleted at its
    # first checkpoint, put back if it stops before), a resumed one drops what was logged after its checkpoint
    if master:
        data.make_folder(c.out_dir, "out_dir")
        cleanup.callback(data.release_lock, data.take_lock(c.out_dir))
        check_run_folder(c.out_dir, c.init_from, c.overwrite)  # again: a run may have ended there since step 3
        data.remove_orphan_temporaries(c.out_dir)
    wandb_run = start_wandb(wandb, c, settings) if wandb else None
    if master:
        if prepare_run_folder(c.out_dir, iter_num if ckpt is not None else None):
            cleanup.callback(put_back_replaced_run, c.out_dir)
        threads = torch.get_num_threads()
        print(f"{c.dataset}: {len(train_tokens):,} train tokens, vocab {meta['vocab_size']} | model "
              f"{raw_model.num_params() / 1e6:.2f}M params, mixer {config.mixer}, residual {config.residual} | "
              f"{c.optimizer}, lr {c.learning_rate:g} {c.schedule} to {c.min_lr:g} over {total_iters} iters "
              f"(warmup {c.warmup_iters}) | {dev}, {precision}, {'eager' if compiled is raw_model else 'compiled'}, "
              f"{threads} thread{'s' * (threads > 1)} | {tokens_per_iter:,} tokens/iter "
              f"({world} x {c.gradient_accumulation_steps} x {c.batch_size} x {config.block_size}) | "
              + (f"MFU against {peak / 1e12:g} TFLOP/s" if peak else "no MFU (no known peak: --peak_tflops)"))
        if schedule_note(c):
            print(schedule_note(c))
        if compiled is not raw_model:
            print("torch.compile compiles the model at its first use: the first eval and step take a minute or more")
        if ckpt is not None:
            print(f"resuming at iter {iter_num}" + (f"; changed: {', '.join(changes)}" if changes else ""))

    # 6. the loop: an eval (and checkpoint) every eval_interval steps and at the end, a log line every log_interval
    # steps (and after the first and the last); a signal stops it after the step it is in (or abandons the eval it
    # came in), with a checkpoint
    received = cleanup.enter_context(stop_signals(again_stops=not ddp))
    t_start, first_step = time.time() - elapsed, iter_num + 1
    loss_sum, steps_since_log = torch.zeros((), device=dev), 0  # the loss stays on the device until a log line
    skipped = 0  # float16: steps the scaler skipped since the last log line (their gradients overflowed)
    # tokens/s times training steps only: its window opens after the first step (compile, warm-up), evals apart
    window_start, window_tokens, paused, eval_seconds = time.time(), 0, 0.0, 0.0
    stopped = False
    gpt.train()
    while True:
        if (iter_num % c.eval_interval == 0 or iter_num >= c.max_iters) and iter_num != last_eval:
            t_eval = time.time()
            val = evaluate(compiled, val_tokens, c.batch_size, config.block_size, c.eval_iters, dev, autocast,
                           received)
            stopped = stop_requested(received, ddp, dev)  # a signal abandoned the eval (val None): the loop stops
            if stopped:
                break
            val_loss, last_eval = val, iter_num
            if not math.isfinite(val_loss) or not all_finite(raw_model):
                raise FloatingPointError(diverged(f"val loss {val_loss} (or a weight not finite)", iter_num,
                                                  ckpt_path, saved_iter, c.learning_rate, c.grad_clip))
            best_val = min(best_val, val_loss)
            if master:
                print(f"iter {iter_num}: val loss {val_loss:.4f} (best {best_val:.4f}), "
                      f"{time.time() - t_start:.1f}s elapsed")
                append_log(log_path, {"step": iter_num, "val": val_loss, "time": time.time() - t_start}, wandb_run,
                           sync=True)  # on the disk before the checkpoint after it
            save_run(ckpt_path, raw_model, opt, train_sampler, master, settings, meta, iter_num=iter_num,
                     best_val_loss=best_val, val_loss=val_loss, val_iter=last_eval, elapsed=time.time() - t_start,
                     scaler=scaler.state_dict())
            saved_iter = iter_num
            eval_seconds = time.time() - t_eval
            paused += eval_seconds
        if iter_num >= c.max_iters:
            break

        if c.analyze_every and iter_num % c.analyze_every == 0 and master:
            analyze.analyze_during_training(raw_model, analysis_batch, iter_num, c.out_dir)
        lr_mult = optim.lr_multiplier(iter_num, total_iters, c.warmup_iters, c.min_lr / c.learning_rate, c.schedule,
                                c.wsd_decay_frac)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr_mult
        for micro in range(c.gradient_accumulation_steps):
            x, y = train_sampler.next_batch()
            sync = not ddp or micro == c.gradient_accumulation_steps - 1
            with (nullcontext() if sync else gpt.no_sync()), autocast:
                _, loss = gpt(x, y)
                scaler.scale(loss / c.gradient_accumulation_steps).backward()
            loss_sum += loss.detach().float() / c.gradient_accumulation_steps
        # the gradient's global norm (logged), clipped to grad_clip; grad_clip 0 scales by exactly 1
        scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), c.grad_clip if c.grad_clip > 0 else math.inf)
        if scaler.is_enabled():  # the scaler reads its overflow flag on the host anyway: float16 syncs every step
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        iter_num += 1
        steps_since_log += 1
        if iter_num == first_step:  # the first step compiles and warms up: the window opens after it
            synchronize(dev)
            window_start, window_tokens, paused = time.time(), 0, 0.0
        else:
            window_tokens += tokens_per_iter

        log_now = iter_num % c.log_interval == 0 or iter_num in (first_step, c.max_iters)
        stopped = (log_now or not ddp) and stop_requested(received, ddp, dev)
        if ddp and log_now:  # every process logs at the same steps: the logged loss is the mean over them
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= world
        if (log_now or stopped) and master:
            loss_total, norm = torch.stack([loss_sum, grad_norm.float()]).tolist()  # the loop's only host sync
            mean_loss = loss_total / steps_since_log
            if not math.isfinite(mean_loss):
                raise FloatingPointError(diverged(f"training loss {mean_loss}", iter_num, ckpt_path, saved_iter,
                                                  c.learning_rate, c.grad_clip))
            now = time.time()
            tok_s = window_tokens / max(now - window_start - paused, 1e-9) if window_tokens else None
            mfu = flops_per_iter * tok_s / tokens_per_iter / peak if tok_s and peak else None
            lr = opt.param_groups[0]["lr"]
            speed = "tokens/s from the next line on"  # the window opens after the first step
            if tok_s:
                eta = ((c.max_iters - iter_num) * tokens_per_iter / tok_s
                       + evals_left(iter_num, c.max_iters, c.eval_interval) * eval_seconds)
                speed = f"{tok_s:,.0f} tokens/s" + (f", mfu {100 * mfu:.1f}%" if mfu else "") + f", eta {eta:.0f}s"
            scaling = f", loss scale {scaler.get_scale():g} ({skipped} steps skipped)" if scaler.is_enabled() else ""
            print(f"iter {iter_num}: loss {mean_loss:.4f}, lr {lr:.2e}, grad norm {norm:.3f}{scaling}, {speed}")
            append_log(log_path, {"step": iter_num, "loss": mean_loss, "lr": lr, "tokens_per_s": tok_s, "mfu": mfu,
                                  "grad_norm": norm, **({"loss_scale": scaler.get_scale(), "skipped_steps": skipped}
                                                        if scaler.is_enabled() else {})}, wandb_run)
            window_start, window_tokens, paused, skipped = now, 0, 0.0, 0
            loss_sum.zero_()
            steps_since_log = 0
        if stopped:
            break
    if stopped:  # by a signal, after the step it came in or in the eval it abandoned: a checkpoint to resume from
        if not all_finite(raw_model):
            raise FloatingPointError(diverged("a weight not finite", iter_num, ckpt_path, saved_iter,
                                              c.learning_rate, c.grad_clip))
        save_run(ckpt_path, raw_model, opt, train_sampler, master, settings, meta, iter_num=iter_num,
                 best_val_loss=best_val, val_loss=val_loss, val_iter=last_eval, elapsed=time.time() - t_start,
                 scaler=scaler.state_dict())

    # 7. the end: the loss curve, and samples (or, after a signal, how to continue)
    if master:
        plot_losses(log_path, os.path.join(c.out_dir, "loss.png"))
        if c.analyze_every:
            analyze.plot_training_analysis(os.path.join(c.out_dir, "analysis.jsonl"),
                                           os.path.join(c.out_dir, "analysis.png"))
        if stopped:
            out = "" if c.out_dir == RUN_DEFAULTS["out_dir"] else f" --out_dir={c.out_dir}"
            print(f"interrupted at iter {iter_num}: saved {ckpt_path}; continue with python train.py "
                  f"--init_from=resume{out}")
        else:
            print(f"done: val loss {val_loss:.4f} after {iter_num} iters, {time.time() - t_start:.1f}s; "
                  f"checkpoint {ckpt_path}")
        if wandb_run:
            wandb_run.finish()
    if stopped:
        return 128 + (received[0] if received else signal.SIGTERM)
    if master and c.num_samples > 0 and c.max_new_tokens > 0:
        print_samples(raw_model, data.tokenizer_from_meta(meta), c.start, dev, c.num_samples, c.max_new_tokens,
                      c.temperature, c.top_k)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ValueError, FileNotFoundError, FloatingPointError, data.DiskFullError) as e:  # one line: what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one in it
        print("interrupted: stopped at once; the last checkpoint written, if any, is kept", file=sys.stderr)
        sys.exit(130)
