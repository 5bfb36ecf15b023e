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

The config keys are the run settings below and every field of model.GPTConfig (the model, with GPTConfig's
defaults). Every value is checked before anything is written: a
wrong key, type or value stops with a one-line error. The checkpoint out_dir/ckpt.pt (written
atomically at every eval, only while the loss and weights are finite) holds the model, the optimizer,
the config, the RNG and sampler states, so a resumed CPU run continues bit for bit; a resumed run takes its
settings from the checkpoint, except those given again. A new run never replaces the run in out_dir unasked,
and with --overwrite=True deletes it only after its own first checkpoint (out_dir/.replaced holds it until then);
out_dir/.lock keeps a second process out while one trains there. Ctrl-C (or SIGTERM) stops the run after the
step it is in (or abandons the eval it is in), with a checkpoint to resume from.
"""
import inspect
import math
import os
import signal
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import fields
from types import SimpleNamespace

import torch

import analyze
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
# optim.OPTIMIZERS and become config keys here: optim.SETTINGS)
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
peak_tflops = 0.0              # the peak MFU is measured against; 0: analyze.GPU_PEAKS for a listed GPU, none elsewhere
# sampling at the end (and with sample_only)
num_samples = 2                # samples printed at the end; 0 for none
max_new_tokens = 300           # tokens per sample
temperature = 0.8              # softmax temperature of sampling; 0 is greedy
top_k = 40                     # sample among the top_k most likely tokens (the vocabulary size: all)
start = "\n"                   # the prompt of every sample
# ----------------------------------------------------------------------------------------------------
# every run setting's default: the assignments above, then the optimizers' settings
RUN_DEFAULTS = {**{k: v for k, v in globals().items()
                   if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))},
                **{key: setting.default for key, (setting, _) in optim.SETTINGS.items()}}
# model keys that may change on resume: they change how the same weights compute or train, not the weights
RESUME_CHANGEABLE = ("kernels", "attention", "chunk_size", "dropout", "rope_scaling", "rope_factor")
# run settings that describe this command, not the run: a resumed run takes the others from its checkpoint
COMMAND_KEYS = ("out_dir", "init_from", "overwrite", "sample_only")
# the allowed values of each numeric key (data.in_range): ">= a", "> a", or an interval "in [a, b)"; the model's
# keys' are model.CONFIG_RANGES (analyze.py checks them too)
RANGES = {"eval_interval": ">= 1", "eval_iters": ">= 1", "log_interval": ">= 1", "analyze_every": ">= 0",
          "seed": "in [0, 2**63)",
          "batch_size": ">= 1", "gradient_accumulation_steps": ">= 1", "learning_rate": ">= 0", "min_lr": ">= 0",
          "weight_decay": ">= 0", "aux_lr": ">= 0", "grad_clip": ">= 0", "max_iters": ">= 0", "lr_decay_iters": ">= 0",
          "warmup_iters": ">= 0", "wsd_decay_frac": "in [0, 1]", "num_samples": ">= 0", "max_new_tokens": ">= 0",
          "temperature": ">= 0", "top_k": ">= 1", "peak_tflops": ">= 0", **model.CONFIG_RANGES,
          **{key: s.allowed for key, (s, _) in optim.SETTINGS.items() if isinstance(s.allowed, str)}}
# --dtype: the autocast dtype of each choice (float32: no autocast); float16 scales the loss (torch.amp.GradScaler)
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
# with no config file on a GPU, train.py still trains the CPU baby model, and names this preset (see gpu_hint)
GPU_PRESET = "config/shakespeare_char_gpu.py"
# one training step that would take longer than this at the device's peak FLOP/s is a typo, not a run
MAX_STEP_SECONDS = 3600
# a long phase (an eval) prints a progress line after this many seconds, and again after each such interval
PROGRESS_SECONDS = 5


def model_defaults():
    """The model's keys, GPTConfig's fields (vocab_size comes from the data), and their defaults: GPTConfig's."""
    return {f.name: f.default for f in fields(GPTConfig) if f.name != "vocab_size"}


def choices():
    """The keys that take one of a set of values, and those values; the kinds come from their tables, read
    when asked, so a kind added to a table is allowed and listed at once."""
    return {"init_from": ("scratch", "resume"), "tokenizer": ("auto", *data.TOKENIZERS),
            "optimizer": tuple(optim.OPTIMIZERS), "schedule": ("cosine", "wsd"), "dtype": ("auto", *DTYPES),
            **model.config_choices(),
            **{key: tuple(s.allowed) for key, (s, _) in optim.SETTINGS.items() if not isinstance(s.allowed, str)}}


def config_help():
    """{key: description}: the comment beside each run setting above and each GPTConfig field, and each optimizer
    setting's help with the optimizers that take it."""
    settings = {key: f"{', '.join(users)}: {s.help}"
                for key, (s, users) in optim.SETTINGS.items()}
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


def gpu_hint(args, device):
    """The line for a GPU user of plain `python train.py`: the run is the CPU baby model, and GPU_PRESET is the one
    sized for a GPU. The same command trains the same model on every device, so its numbers compare."""
    if device.type == "cuda" and not any(not a.startswith("--") or a.startswith("--config=") for a in args):
        return (f"note: no config file, so this is the CPU baby model (seconds of GPU work); sized for a GPU: "
                f"python train.py {GPU_PRESET}")
    return None


# ----------------------------------------------------------------------------------------------------
# evaluation, samples, the loop's checks

@torch.no_grad()
def evaluate(model, val_tokens, batch_size, block_size, eval_iters, device, autocast, received=None):
    """The mean validation loss over eval_iters batches, the same ones at every call (seed 0), with progress lines when
    it runs long; None when a signal came (received: data.stop_signals' list): the eval is abandoned at once."""
    was_training = model.training
    model.eval()
    sampler = data.BatchSampler(val_tokens, batch_size, block_size, seed=0, device=device)
    total = torch.zeros((), device=device)
    try:
        with data.abandoned_on_signal(received):
            for _ in progress(range(eval_iters), "eval", "batches"):
                x, y = sampler.next_batch()
                with autocast:
                    total += model(x, y)[1].float()
    except data.Abandoned:
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


def evals_left(iter_num, max_iters, eval_interval):
    """The evals still to come at the log line of step iter_num (its own eval comes after it): at each multiple
    of eval_interval from iter_num to max_iters, and at max_iters."""
    return max_iters // eval_interval - (iter_num - 1) // eval_interval + (max_iters % eval_interval != 0)


# ----------------------------------------------------------------------------------------------------
# the run, in the steps of run() below: each step is one function

def main(args):
    """Trains (or samples, with sample_only). Returns the exit status: 0, or 128 + the number of the signal
    that stopped the run (130 for Ctrl-C)."""
    with ExitStack() as cleanup:  # the out_dir lock, the signal handlers, DDP: released however it ends
        return run(args, cleanup)


def run(args, cleanup):
    # 1. settings: defaults (a resumed run: its checkpoint's), then config files, then --key=value; all checked
    settings, given, ckpt, changes = read_settings(args)
    c = SimpleNamespace(**settings)
    # 2. the device, made current (under torchrun each process's GPU is its LOCAL_RANK's); the dry run stops here,
    # before any process group, data or write
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = kernels.use_device(c.device)
    if rank == 0 and gpu_hint(args, dev):
        print(gpu_hint(args, dev))
    if c.dry_run:
        if rank == 0:
            vocab_size = data.dataset_vocab_size(c.dataset, c.tokenizer)
            print(analyze.dry_run_report(settings, model_config(settings, vocab_size), world))
        return 0
    if dev.type == "cuda":  # float32 matmuls on TF32 tensor cores, as nanoGPT does
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world > 1:
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        cleanup.callback(torch.distributed.destroy_process_group)
    if c.sample_only:
        return sample_from_checkpoint(c, given, dev)
    # 3. the data, wandb, the checkpoint's fit, the run's size: everything that can fail on bad input fails here,
    # before a write and before the model is built
    train_tokens, val_tokens, meta, config, wandb = check_run(c, settings, ckpt, dev, rank == 0)
    # 4. model, optimizer, precision and sampler, and the state of a resumed run
    r = build_run(c, config, ckpt, train_tokens, dev, rank, world)
    # 5. the run's folder, locked, wandb's run, and the banner
    r.wandb_run = open_run_folder(c, settings, ckpt, r, wandb, cleanup)
    if r.master:
        print_banner(c, config, meta, len(train_tokens), r, world, changes if ckpt is not None else None)
    # 6. the loop: an eval (and checkpoint) every eval_interval steps and at the end, a log line every log_interval
    # steps (and after the first and the last); a signal stops it after its step (or abandons its eval)
    received = cleanup.enter_context(data.stop_signals(again_stops=world == 1))
    stopped = train_loop(c, r, settings, meta, val_tokens, received)
    # 7. the end: the loss curve, and samples (or, after a signal, how to continue)
    if r.master:
        finish(c, r, stopped)
    if stopped:
        return 128 + (received[0] if received else signal.SIGTERM)
    if r.master and c.num_samples > 0 and c.max_new_tokens > 0:
        print_samples(r.raw_model, data.tokenizer_from_meta(meta), c.start, dev, c.num_samples, c.max_new_tokens,
                      c.temperature, c.top_k)
    return 0


def read_settings(args):
    """Step 1: (settings, the keys given, the checkpoint of a resumed run or None, what the resumed run changes). A
    run that a killed one set aside comes back first."""
    defaults = {**RUN_DEFAULTS, **model_defaults()}
    given = data.parse_config(args, defaults, __doc__, config_help(), allowed=allowed_help())
    settings, ckpt, changes = {**defaults, **given}, None, []
    if not settings["dry_run"] and int(os.environ.get("RANK", 0)) == 0:
        note = data.recover_run(settings["out_dir"], data.RUN_FILES)
        if note:
            print(note)
    if settings["init_from"] == "resume" and not settings["sample_only"]:
        ckpt = data.load_checkpoint(os.path.join(settings["out_dir"], "ckpt.pt"))
        settings, changes = resumed_settings(ckpt["config"], given)
    check_settings(settings)
    optim.check_chosen_settings(settings["optimizer"], given)
    settings["learning_rate"] = peak_lr(settings)
    if ckpt is not None:
        check_schedule_length(ckpt["config"], settings, given)
    return settings, given, ckpt, changes


def model_config(settings, vocab_size):
    return GPTConfig(vocab_size=vocab_size, **{key: settings[key] for key in model_defaults()})


def sample_from_checkpoint(c, given, dev):
    """--sample_only=True: samples from out_dir/ckpt.pt, nothing trained or written."""
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    ckpt = data.load_checkpoint(ckpt_path)
    model_cfg, _ = resumed_model_config(ckpt["config"], given)
    tokenizer = data.tokenizer_from_meta(ckpt["meta"])
    check_prompt(c.start, tokenizer, ckpt["config"].get("dataset"))
    gpt = GPT(GPTConfig(vocab_size=ckpt["meta"]["vocab_size"], **model_cfg)).to(dev)
    data.load_weights(gpt, ckpt, ckpt_path)
    torch.manual_seed(c.seed)
    print_samples(gpt, tokenizer, c.start, dev, c.num_samples, c.max_new_tokens, c.temperature, c.top_k)
    return 0


def check_run(c, settings, ckpt, dev, master):
    """Step 3: (train tokens, val tokens, meta, the model's config, wandb or None), once the folder, the data, wandb,
    the vocabulary of a resumed run, the prompt and the run's memory have passed their checks."""
    data.check_writable_folder(c.out_dir, "out_dir")
    if master:  # (the other processes would find the lock that rank 0 takes in step 5)
        data.check_unlocked(c.out_dir)
        data.check_run_folder(c.out_dir, c.init_from, c.overwrite)
    train_tokens, val_tokens, meta = data.load_dataset(c.dataset, c.tokenizer)
    wandb = data.import_wandb() if c.wandb_log and master else None
    if ckpt is not None:
        check_same_vocabulary(meta, c.dataset, ckpt["meta"], ckpt["config"].get("dataset"))
    settings.update(vocab_size=meta["vocab_size"])
    config = model_config(settings, meta["vocab_size"])
    for split, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if len(tokens) < config.block_size + 2:
            raise data.ConfigError(f"the {split} split of {c.dataset} has only {len(tokens)} tokens (the validation "
                                   f"split is the last 10% of a text), fewer than block_size + 2 = "
                                   f"{config.block_size + 2}: use more text or a smaller --block_size")
    if c.num_samples > 0 and c.max_new_tokens > 0:
        check_prompt(c.start, data.tokenizer_from_meta(meta), c.dataset)
    analyze.check_fit(analyze.run_costs(c, config, act=2).memory, dev)
    return train_tokens, val_tokens, meta, config, wandb


def build_run(c, config, ckpt, train_tokens, dev, rank, world):
    """Step 4: the run's working parts and its progress, as one namespace: the model (raw, compiled, DDP-wrapped),
    the optimizer, the sampler, autocast and the loss scaler, the step's tokens and FLOPs, the MFU peak; iter_num and
    the losses where a resumed run left them."""
    torch.manual_seed(c.seed)
    r = SimpleNamespace(master=rank == 0, ddp=world > 1, device=dev, ckpt_path=os.path.join(c.out_dir, "ckpt.pt"),
                        log_path=os.path.join(c.out_dir, "log.jsonl"), block_size=config.block_size)
    r.raw_model = GPT(config).to(dev)
    r.opt = optim.build_optimizer(r.raw_model, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay,
                                  aux_lr=c.aux_lr, aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr,
                                  **optim.optimizer_options(c.optimizer, vars(c)))
    r.sampler = data.BatchSampler(train_tokens, c.batch_size, config.block_size, seed=c.seed + rank, device=dev)
    r.iter_num, r.best_val, r.val_loss, r.elapsed, r.saved_iter, r.last_eval = 0, math.inf, math.nan, 0.0, None, -1
    # mixed precision: float16's small range needs its loss scaled (GradScaler), which skips a step whose gradients
    # overflowed and lowers the scale; disabled, the scaler passes everything through unchanged
    half = DTYPES[c.dtype] if c.dtype != "auto" else kernels.autocast_dtype(dev) if dev.type == "cuda" else None
    r.autocast = torch.autocast(dev.type, dtype=half) if half else nullcontext()
    r.precision = {None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[half]
    r.scaler = torch.amp.GradScaler(dev.type, enabled=half == torch.float16)
    if ckpt is not None:
        resume_from(r, ckpt, rank)
    use_compile = c.compile if c.compile is not None else dev.type == "cuda"
    r.compiled = torch.compile(r.raw_model) if use_compile else r.raw_model
    r.gpt = r.compiled
    if r.ddp:
        from torch.nn.parallel import DistributedDataParallel
        r.gpt = DistributedDataParallel(r.compiled)
    r.total_iters = c.lr_decay_iters or c.max_iters
    r.tokens_per_iter, train_tokens_run, eval_tokens_run = analyze.run_tokens(c, config.block_size, world)
    r.flops_per_iter = r.raw_model.flops_per_token(config.block_size) * r.tokens_per_iter / world
    r.peak = analyze.peak_flops(dev, r.precision, c.peak_tflops)
    rate = r.peak or (kernels.matmul_rate() if dev.type == "cpu" else None)
    check_step_time(r.flops_per_iter, rate, dev)
    if r.master and dev.type == "cpu":
        flops = analyze.run_flops(r.raw_model.flops_per_token(config.block_size), train_tokens_run,
                                  eval_tokens_run) / world
        note = analyze.sized_for_a_gpu(c, r.flops_per_iter, flops, rate)
        if note:
            print(note, flush=True)
    if c.analyze_every:  # one fixed training batch, so the spectra logged at different steps are comparable
        r.analysis_batch = data.BatchSampler(train_tokens, c.batch_size, config.block_size, seed=1,
                                             device=dev).next_batch()
    return r


def resume_from(r, ckpt, rank):
    """The weights, optimizer, sampler, RNG, loss scale and progress of a resumed run, from its checkpoint."""
    data.load_weights(r.raw_model, ckpt, r.ckpt_path)
    r.opt.load_state_dict(ckpt["optimizer"])
    r.sampler.load_state_dict(ckpt["sampler"][rank] if rank < len(ckpt["sampler"]) else ckpt["sampler"][0])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if r.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    if ckpt.get("scaler"):
        r.scaler.load_state_dict(ckpt["scaler"])
    r.iter_num, r.best_val = ckpt["iter_num"], ckpt["best_val_loss"]
    r.val_loss, r.elapsed, r.saved_iter = ckpt.get("val_loss", r.best_val), ckpt.get("elapsed", 0.0), r.iter_num
    r.last_eval = ckpt.get("val_iter", r.iter_num)  # a checkpoint written at a stop may predate its step's eval


def open_run_folder(c, settings, ckpt, r, wandb, cleanup):
    """Step 5: out_dir made and locked; then a new run sets the run it replaces aside (deleted at its first
    checkpoint, put back if it stops before), a resumed one drops what was logged after its checkpoint. Returns
    wandb's run, or None."""
    if r.master:
        data.make_folder(c.out_dir, "out_dir")
        cleanup.callback(data.release_lock, data.take_lock(c.out_dir))
        data.check_run_folder(c.out_dir, c.init_from, c.overwrite)  # again: a run may have ended there since step 3
        data.remove_orphan_temporaries(c.out_dir)
    wandb_run = data.start_wandb(wandb, c, settings) if wandb else None
    if r.master and data.prepare_run_folder(c.out_dir, r.iter_num if ckpt is not None else None):
        cleanup.callback(data.put_back_replaced_run, c.out_dir)
    return wandb_run


def print_banner(c, config, meta, n_train_tokens, r, world, changes):
    """The run's first lines: what it trains, how, and on what (so its times can be compared with RESULTS.md)."""
    threads = torch.get_num_threads()
    print(f"{c.dataset}: {n_train_tokens:,} train tokens, vocab {meta['vocab_size']} | model "
          f"{r.raw_model.num_params() / 1e6:.2f}M params, mixer {config.mixer}, residual {config.residual} | "
          f"{c.optimizer}, lr {c.learning_rate:g} {c.schedule} to {c.min_lr:g} over {r.total_iters} iters "
          f"(warmup {c.warmup_iters}) | {r.device}, {r.precision}, "
          f"{'eager' if r.compiled is r.raw_model else 'compiled'}, {threads} thread{'s' * (threads > 1)} | "
          f"{r.tokens_per_iter:,} tokens/iter ({world} x {c.gradient_accumulation_steps} x {c.batch_size} x "
          f"{config.block_size}) | "
          + (f"MFU against {r.peak / 1e12:g} TFLOP/s" if r.peak else "no MFU (no known peak: --peak_tflops)"))
    if schedule_note(c):
        print(schedule_note(c))
    if r.compiled is not r.raw_model:
        print("torch.compile compiles the model at its first use: the first eval and step take a minute or more")
    if changes is not None:  # a resumed run
        print(f"resuming at iter {r.iter_num}" + (f"; changed: {', '.join(changes)}" if changes else ""))


def train_loop(c, r, settings, meta, val_tokens, received):
    """Step 6. Returns whether a signal stopped it (after a checkpoint to resume from)."""
    r.t_start, first_step = time.time() - r.elapsed, r.iter_num + 1
    r.loss_sum, r.steps_since_log = torch.zeros((), device=r.device), 0  # on the device until a log line
    r.skipped = 0  # float16: steps the scaler skipped since the last log line (their gradients overflowed)
    # tokens/s times training steps only: its window opens after the first step (compile, warm-up), evals apart
    r.window_start, r.window_tokens, r.paused, r.eval_seconds = time.time(), 0, 0.0, 0.0
    stopped = False
    r.gpt.train()
    while True:
        if (r.iter_num % c.eval_interval == 0 or r.iter_num >= c.max_iters) and r.iter_num != r.last_eval:
            stopped = not eval_and_save(c, r, settings, meta, val_tokens, received)
            if stopped:
                break
        if r.iter_num >= c.max_iters:
            break
        if c.analyze_every and r.iter_num % c.analyze_every == 0 and r.master:
            analyze.analyze_during_training(r.raw_model, r.analysis_batch, r.iter_num, c.out_dir)
        grad_norm = train_step(c, r)
        if r.iter_num == first_step:  # the first step compiles and warms up: the window opens after it
            kernels.synchronize(r.device)
            r.window_start, r.window_tokens, r.paused = time.time(), 0, 0.0
        else:
            r.window_tokens += r.tokens_per_iter
        log_now = r.iter_num % c.log_interval == 0 or r.iter_num in (first_step, c.max_iters)
        stopped = (log_now or not r.ddp) and data.stop_requested(received, r.ddp, r.device)
        if r.ddp and log_now:  # every process logs at the same steps: the logged loss is the mean over them
            torch.distributed.all_reduce(r.loss_sum)
            r.loss_sum /= torch.distributed.get_world_size()
        if (log_now or stopped) and r.master:
            log_line(c, r, grad_norm)
        if stopped:
            break
    if stopped:  # by a signal, after the step it came in or in the eval it abandoned: a checkpoint to resume from
        if not all_finite(r.raw_model):
            raise FloatingPointError(diverged("a weight not finite", r.iter_num, r.ckpt_path, r.saved_iter,
                                              c.learning_rate, c.grad_clip))
        save(r, settings, meta)
    return stopped


def eval_and_save(c, r, settings, meta, val_tokens, received):
    """The eval of step iter_num, its log line and the checkpoint; False when a signal abandoned the eval."""
    t_eval = time.time()
    val = evaluate(r.compiled, val_tokens, c.batch_size, r.block_size, c.eval_iters, r.device, r.autocast, received)
    if data.stop_requested(received, r.ddp, r.device):  # a signal abandoned the eval (val None): the loop stops
        return False
    r.val_loss, r.last_eval = val, r.iter_num
    if not math.isfinite(r.val_loss) or not all_finite(r.raw_model):
        raise FloatingPointError(diverged(f"val loss {r.val_loss} (or a weight not finite)", r.iter_num, r.ckpt_path,
                                          r.saved_iter, c.learning_rate, c.grad_clip))
    r.best_val = min(r.best_val, r.val_loss)
    if r.master:
        print(f"iter {r.iter_num}: val loss {r.val_loss:.4f} (best {r.best_val:.4f}), "
              f"{time.time() - r.t_start:.1f}s elapsed")
        data.append_log(r.log_path, {"step": r.iter_num, "val": r.val_loss, "time": time.time() - r.t_start},
                        r.wandb_run, sync=True)  # on the disk before the checkpoint after it
    save(r, settings, meta)
    r.saved_iter = r.iter_num
    r.eval_seconds = time.time() - t_eval
    r.paused += r.eval_seconds
    return True


def save(r, settings, meta):
    data.save_run(r.ckpt_path, r.raw_model, r.opt, r.sampler, r.master, settings, meta, iter_num=r.iter_num,
             best_val_loss=r.best_val, val_loss=r.val_loss, val_iter=r.last_eval, elapsed=time.time() - r.t_start,
             scaler=r.scaler.state_dict())


def train_step(c, r):
    """One optimizer step at the schedule's lr, over gradient_accumulation_steps micro-batches; the gradient's global
    norm is clipped to grad_clip (0: scaled by exactly 1) and returned, on the device."""
    lr_mult = optim.lr_multiplier(r.iter_num, r.total_iters, c.warmup_iters, c.min_lr / c.learning_rate, c.schedule,
                                  c.wsd_decay_frac)
    for group in r.opt.param_groups:
        group["lr"] = group["base_lr"] * lr_mult
    for micro in range(c.gradient_accumulation_steps):
        x, y = r.sampler.next_batch()
        sync = not r.ddp or micro == c.gradient_accumulation_steps - 1
        with (nullcontext() if sync else r.gpt.no_sync()), r.autocast:
            _, loss = r.gpt(x, y)
            r.scaler.scale(loss / c.gradient_accumulation_steps).backward()
        r.loss_sum += loss.detach().float() / c.gradient_accumulation_steps
    r.scaler.unscale_(r.opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(r.gpt.parameters(), c.grad_clip if c.grad_clip > 0 else math.inf)
    if r.scaler.is_enabled():  # the scaler reads its overflow flag on the host anyway: float16 syncs every step
        scale = r.scaler.get_scale()
        r.scaler.step(r.opt)
        r.scaler.update()
        r.skipped += r.scaler.get_scale() < scale
    else:
        r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    r.iter_num += 1
    r.steps_since_log += 1
    return grad_norm


def log_line(c, r, grad_norm):
    """The training loss line of step iter_num (the mean since the last one), in the terminal and log.jsonl."""
    loss_total, norm = torch.stack([r.loss_sum, grad_norm.float()]).tolist()  # the loop's only host sync
    mean_loss = loss_total / r.steps_since_log
    if not math.isfinite(mean_loss):
        raise FloatingPointError(diverged(f"training loss {mean_loss}", r.iter_num, r.ckpt_path, r.saved_iter,
                                          c.learning_rate, c.grad_clip))
    now = time.time()
    tok_s = r.window_tokens / max(now - r.window_start - r.paused, 1e-9) if r.window_tokens else None
    mfu = r.flops_per_iter * tok_s / r.tokens_per_iter / r.peak if tok_s and r.peak else None
    lr = r.opt.param_groups[0]["lr"]
    speed = "tokens/s from the next line on"  # the window opens after the first step
    if tok_s:
        eta = ((c.max_iters - r.iter_num) * r.tokens_per_iter / tok_s
               + evals_left(r.iter_num, c.max_iters, c.eval_interval) * r.eval_seconds)
        speed = f"{tok_s:,.0f} tokens/s" + (f", mfu {100 * mfu:.1f}%" if mfu else "") + f", eta {eta:.0f}s"
    scaler = r.scaler
    scaling = f", loss scale {scaler.get_scale():g} ({r.skipped} steps skipped)" if scaler.is_enabled() else ""
    print(f"iter {r.iter_num}: loss {mean_loss:.4f}, lr {lr:.2e}, grad norm {norm:.3f}{scaling}, {speed}")
    data.append_log(r.log_path, {"step": r.iter_num, "loss": mean_loss, "lr": lr, "tokens_per_s": tok_s, "mfu": mfu,
                                 "grad_norm": norm, **({"loss_scale": scaler.get_scale(), "skipped_steps": r.skipped}
                                                       if scaler.is_enabled() else {})}, r.wandb_run)
    r.window_start, r.window_tokens, r.paused, r.skipped = now, 0, 0.0, 0
    r.loss_sum.zero_()
    r.steps_since_log = 0


def finish(c, r, stopped):
    """Step 7 (rank 0): loss.png (and analysis.png), and the last line: how to continue, or the final val loss."""
    analyze.plot_losses(r.log_path, os.path.join(c.out_dir, "loss.png"))
    if c.analyze_every:
        analyze.plot_training_analysis(os.path.join(c.out_dir, "analysis.jsonl"),
                                       os.path.join(c.out_dir, "analysis.png"))
    if stopped:
        out = "" if c.out_dir == RUN_DEFAULTS["out_dir"] else f" --out_dir={c.out_dir}"
        print(f"interrupted at iter {r.iter_num}: saved {r.ckpt_path}; continue with python train.py "
              f"--init_from=resume{out}")
    else:
        print(f"done: val loss {r.val_loss:.4f} after {r.iter_num} iters, {time.time() - r.t_start:.1f}s; "
              f"checkpoint {r.ckpt_path}")
    if r.wandb_run:
        r.wandb_run.finish()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ValueError, FileNotFoundError, FloatingPointError, data.DiskFullError) as e:  # one line: what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one in it
        print("interrupted: stopped at once; the last checkpoint written, if any, is kept", file=sys.stderr)
        sys.exit(130)
