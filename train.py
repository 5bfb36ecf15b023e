"""
Train a specgpt model.

    python train.py                                  # baby GPT on shakespeare_char, about a minute on a CPU
    python train.py --mixer=GGGA --optimizer=muon    # flip any config key with --key=value
    python train.py my_config.py --max_iters=500     # a config file (plain Python assignments), then overrides
    python train.py config/gpt2_small_fineweb.py --dry_run=True   # a preset's size, memory and GPU time; no run
    python train.py --init_from=resume               # continue out_dir/ckpt.pt exactly where it stopped
    python train.py --overwrite=True                 # a new run in place of the one in out_dir
    python train.py --sample_only=True --start="ROMEO:"   # sample from out_dir/ckpt.pt
    python train.py --sample_only=True --init_from=gpt2 --start="Hello"   # sample from OpenAI's GPT-2
    python train.py config/finetune_shakespeare.py   # finetune GPT-2 on Shakespeare (GPT-2 tokens)
    python train.py --export=exported                # out_dir/ckpt.pt as safetensors (+ transformers' GPT-2 layout)
    torchrun --nproc_per_node=2 train.py             # data-parallel (DDP) on 2 processes

The config keys are the run settings below and every field of model.GPTConfig (the model, with GPTConfig's
defaults). Every value is checked before anything is written: a
wrong key, type or value stops with a one-line error. The checkpoint out_dir/ckpt.pt (written
atomically at every eval, only while the loss and weights are finite) holds the model, the optimizer,
the config, the RNG and sampler states, so a resumed CPU run continues bit for bit; a resumed run takes its
settings from the checkpoint, except those given again. A new run never replaces the run in out_dir unasked,
and with --overwrite=True deletes it only after its own first checkpoint of a trained step (out_dir/.replaced holds
it until then, and it comes back if the new run stops or fails before);
out_dir/.lock keeps a second process out while one trains there. Ctrl-C (or SIGTERM) stops the run after the
step it is in (or abandons the eval it is in), with a checkpoint to resume from.
"""
import inspect
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
from torch.nn.parallel import DistributedDataParallel

import analyze
import data
import kernels
import model
import optim
import runs
from model import GPT, GPTConfig

# ----------------------------------------------------------------------------------------------------
# config: the run's settings (module-level values, overridden by config files and --key=value;
# the comment beside each is its --help text)
out_dir = "out"                # folder for ckpt.pt, log.jsonl, loss.png
init_from = "scratch"          # scratch, resume (out_dir/ckpt.pt), gpt2 .. gpt2-xl, or a folder of weights
export = ""                    # a folder: write out_dir/ckpt.pt's model there as safetensors (runs.export_checkpoint)
overwrite = False              # a new run may replace the run in out_dir (deleted at its first trained checkpoint)
results_tsv = "results.tsv"    # a finished run appends its row here, tab-separated (relative: beside out_dir)
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
dataset = "shakespeare_char"   # shakespeare_char | shakespeare | file.txt | 'dir/*_train_*.bin' | mqar | passkey
tokenizer = "auto"             # data.TOKENIZERS; auto: the dataset's own (gpt2: shakespeare, shards; else char)
batch_size = 24                # sequences per micro-step (per process)
gradient_accumulation_steps = 1  # micro-steps per optimizer step (per process)
# recall tasks (--dataset=mqar | passkey: data.RECALL_TASKS), generated from the seed, trained at block_size; the evals
# report the accuracy on the answers per test slice (length x pairs, or length @ the needle's depth)
recall_vocab = 8192            # mqar: vocabulary (keys from its lower half, values from its upper half)
recall_pairs = "4"             # mqar: key-value pairs of a training sequence, a comma list (one drawn per batch)
recall_test_pairs = "4"        # mqar: the pair counts tested at each test length, a comma list
recall_test_lengths = ""       # the lengths tested, a comma list ("": block_size); attention: ≤ block_size·rope_factor
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
time_budget = math.inf         # seconds of training steps (evals and checkpoints excluded), then a final eval;
                               # the budget replaces max_iters as the end, and the schedule runs on time: a step's lr
                               # is the step-schedule's at max_iters x (seconds trained by the step's end) / budget
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
COMMAND_KEYS = ("out_dir", "init_from", "overwrite", "sample_only", "export")
# the allowed values of each numeric key (runs.in_range): ">= a", "> a", or an interval "in [a, b)"; the model's
# keys' are model.CONFIG_RANGES (analyze.py checks them too)
RANGES = {"eval_interval": ">= 1", "eval_iters": ">= 1", "log_interval": ">= 1", "analyze_every": ">= 0",
          "seed": "in [0, 2**63)",
          "batch_size": ">= 1", "gradient_accumulation_steps": ">= 1", "recall_vocab": ">= 4",
          "learning_rate": ">= 0", "min_lr": ">= 0",
          "weight_decay": ">= 0", "aux_lr": ">= 0", "grad_clip": ">= 0", "max_iters": ">= 0", "lr_decay_iters": ">= 0",
          "warmup_iters": ">= 0", "wsd_decay_frac": "in [0, 1]", "num_samples": ">= 0", "max_new_tokens": ">= 0",
          "time_budget": "> 0", "temperature": ">= 0", "top_k": ">= 1", "peak_tflops": ">= 0", **model.CONFIG_RANGES,
          **{key: s.allowed for key, (s, _) in optim.SETTINGS.items() if isinstance(s.allowed, str)}}
# --dtype: the autocast dtype of each choice (float32: no autocast); float16 scales the loss (torch.amp.GradScaler)
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
# with no config file on a GPU, train.py still trains the CPU baby model, and names this preset (see gpu_hint)
GPU_PRESET = "config/shakespeare_char_gpu.py"
# one training step that would take longer than this at the device's peak FLOP/s is a typo, not a run
MAX_STEP_SECONDS = 3600
# a long phase (an eval) prints a progress line after this many seconds, and again after each such interval
PROGRESS_SECONDS = 5
# a CPU run is "sized for a GPU" only if it is long even at this float32 rate (a fast desktop CPU's), not only at the
# rate measured at start-up: a busy machine's slow matmul would give the baby model that note
CPU_FLOPS_FLOOR = 100e9


# ----------------------------------------------------------------------------------------------------
# the run: main() reads the settings, builds the model and trains it (the loop and its step: step 6); the set-up
# and the checks it calls are below it

@dataclass
class Progress:
    """Where the run is: what its checkpoint saves besides the weights, optimizer, sampler and RNG (a resumed run
    starts from its checkpoint's)."""
    iter_num: int = 0                # optimizer steps taken
    best_val: float = math.inf       # the lowest val loss of any eval
    val_loss: float = math.nan       # the last eval's val loss
    last_eval: int = -1              # the step of the last eval (a checkpoint written at a stop may predate its eval)
    saved_iter: int | None = None    # the step of the last checkpoint written (None: none yet)
    elapsed: float = 0.0             # seconds trained before this process started (a resumed run's)
    trained: float = 0.0             # seconds of training steps, evals excluded: the time budget's clock


@dataclass
class LogWindow:
    """The steps since the last training-loss line, which the next one reports. Its tokens/s times training steps
    only: evals are paused out, and the first window opens after the first step (compile, warm-up)."""
    loss_sum: torch.Tensor     # the sum of their mean losses, on the device until the line (the loop's only host sync)
    skipped: torch.Tensor      # float16: the steps the scaler skipped (gradients not finite), on the device too
    start: float               # time.time() when it opened
    steps: int = 0
    tokens: int = 0            # the tokens its tokens/s counts
    paused: float = 0.0        # seconds of evals inside it


def main(args, clock=time.monotonic):
    """Trains (or samples, with sample_only). Returns the exit status: 0, or 128 + the number of the signal
    that stopped the run (130 for Ctrl-C). clock: the time budget's clock in seconds (a test passes its own)."""
    with ExitStack() as cleanup:  # the out_dir lock, the signal handlers, DDP: released however it ends
        # 1. settings: defaults (a resumed run: its checkpoint's), then config files, then --key=value; all checked
        settings, given, ckpt, changes = read_settings(args)
        c = SimpleNamespace(**settings)
        # 2. the device, made current (under torchrun each process's GPU is its LOCAL_RANK's); the dry run stops
        # here, before any process group, data or write
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        master, dev = rank == 0, runs.use_device(c.device)
        if master and gpu_hint(args, dev):
            print(gpu_hint(args, dev))
        if c.dry_run:
            if master:
                vocab_size = c.recall_vocab if c.dataset == "mqar" else \
                    data.dataset_vocab_size("shakespeare_char" if c.dataset == "passkey" else c.dataset, c.tokenizer)
                print(analyze.dry_run_report(settings, model_config(settings, vocab_size), world))
                if c.dataset not in data.RECALL_TASKS:  # a recall task's tokens are no text: no bytes
                    print(units_line(c.dataset, c.tokenizer))
            return 0
        if dev.type == "cuda":  # float32 matmuls on TF32 tensor cores, as nanoGPT does
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if world > 1:
            torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
            cleanup.callback(torch.distributed.destroy_process_group)
        if c.export:
            print(runs.export_checkpoint(os.path.join(c.out_dir, "ckpt.pt"), c.export))
            return 0
        if c.sample_only:
            return sample_from_checkpoint(c, given, dev)
        # 3. the data, wandb, the checkpoint's fit, the run's size: everything that can fail on bad input fails
        # here, before a write and before the model is built
        train_tokens, val_tokens, meta, config, wandb = check_run(c, settings, ckpt, dev, master)
        task = train_tokens if isinstance(train_tokens, data.RecallTask) else None  # a recall task: both splits
        # its fixed test examples: eval_iters batches split over the slices, at least one each
        test_set = task.test_set(c.batch_size, -(-c.eval_iters // len(task.slices()))) if task else None
        # bits per byte: the validation text's bytes over its tokens (a recall task's tokens are no text)
        bytes_per_token = None if task else \
            data.text_bytes(val_tokens, data.tokenizer_from_meta(meta)) / len(val_tokens)
        # 4. the model, its optimizer, the batches, the precision; a resumed run where its checkpoint left it
        torch.manual_seed(c.seed)
        raw_model = GPT(config).to(dev)
        opt = optim.build_optimizer(raw_model, c.optimizer, lr=c.learning_rate, weight_decay=c.weight_decay,
                                    aux_lr=c.aux_lr, aux_betas=(c.beta1, c.beta2), spectral_lr=c.spectral_lr,
                                    **optim.optimizer_options(c.optimizer, vars(c)))
        sampler = data.RecallSampler(task, c.batch_size, c.seed + rank, dev) if task else \
            data.BatchSampler(train_tokens, c.batch_size, config.block_size, seed=c.seed + rank, device=dev)
        autocast, precision, scaler = mixed_precision(c.dtype, dev)
        progress = Progress()
        if ckpt is not None:
            progress = resume_from(ckpt, raw_model, opt, sampler, scaler, rank, dev, c.out_dir)
        elif pretrained(c.init_from):
            model.load_pretrained_weights(raw_model, c.init_from)
        compiled = torch.compile(raw_model) if (dev.type == "cuda" if c.compile is None else c.compile) else raw_model
        gpt = DistributedDataParallel(compiled) if world > 1 else compiled
        tokens_per_iter, flops_per_iter, peak = step_size(c, config, raw_model, dev, precision, world, master)
        analysis_batch = None  # one fixed training batch, so the spectra logged at different steps are comparable
        if c.analyze_every:
            analysis_batch = (data.RecallSampler(task, c.batch_size, 1, dev) if task else data.BatchSampler(
                train_tokens, c.batch_size, config.block_size, seed=1, device=dev)).next_batch()
        # 5. the run's folder, locked; wandb's run; the banner
        wandb_run = open_run_folder(c, settings, progress.iter_num if ckpt is not None else None, master, wandb,
                                    cleanup)
        if master:
            print_banner(c, config, meta, len(train_tokens) if not task else 0, raw_model, compiled, dev, precision,
                         tokens_per_iter, peak, world)
            if ckpt is not None:
                print(f"resuming at iter {progress.iter_num}" + (f"; changed: {', '.join(changes)}" if changes else ""))
        # 6. the loop: an eval (and checkpoint) every eval_interval steps and at the end, a log line every
        # log_interval steps (and after the first and the last); a signal stops it after its step (or abandons its
        # eval), with a checkpoint to resume from
        received = cleanup.enter_context(runs.stop_signals(again_stops=world == 1))
        ckpt_path, log_path, ddp = os.path.join(c.out_dir, "ckpt.pt"), os.path.join(c.out_dir, "log.jsonl"), world > 1
        t_start, first_step, eval_seconds = time.time() - progress.elapsed, progress.iter_num + 1, 0.0
        window = LogWindow(loss_sum=torch.zeros((), device=dev),
                           skipped=torch.zeros((), dtype=torch.long, device=dev), start=time.time())
        stopped, tick, step_seconds = False, clock(), 0.0  # the budget's clock reads once a step, and after an eval
        gpt.train()
        while True:
            done = finished(c, progress)
            at_eval = progress.iter_num % c.eval_interval == 0 or done
            if at_eval and progress.iter_num != progress.last_eval:
                t_eval = time.time()
                if task:  # the loss on the answers and their accuracy per test slice
                    val, accuracy = evaluate_recall(compiled, task.name, test_set, dev, autocast, received)
                else:
                    val, accuracy = evaluate(compiled, val_tokens, c.batch_size, config.block_size, c.eval_iters, dev,
                                             autocast, received), None
                stopped = runs.stop_requested(received, ddp, dev)  # a signal abandoned the eval (val None)
                if stopped:
                    break
                record_eval(c, progress, val, bytes_per_token, raw_model, t_start, ckpt_path, log_path, wandb_run,
                            master, accuracy)
                runs.save_run(ckpt_path, raw_model, opt, sampler, master, settings, meta,
                              **saved_progress(progress, t_start, scaler))
                progress.saved_iter = progress.iter_num
                eval_seconds = time.time() - t_eval
                window.paused += eval_seconds
                tick = clock()
            if done:
                break
            if c.analyze_every and progress.iter_num % c.analyze_every == 0 and master:
                analyze.analyze_during_training(raw_model, analysis_batch, progress.iter_num, c.out_dir)
                tick = clock()
            # the step: the schedule's lr; forward and backward over gradient_accumulation_steps micro-batches (DDP
            # averages the gradients at the last one); the gradient's global norm clipped to grad_clip (0: scaled by
            # exactly 1); the optimizer's step (float16: the scaler's, which skips a step whose gradients overflowed)
            lr_mult = optim.lr_multiplier(schedule_step(c, progress, step_seconds), c.lr_decay_iters or c.max_iters,
                                          c.warmup_iters, c.min_lr / c.learning_rate, c.schedule, c.wsd_decay_frac)
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_mult
            for micro in range(c.gradient_accumulation_steps):
                x, y = sampler.next_batch()
                sync = not ddp or micro == c.gradient_accumulation_steps - 1
                with (nullcontext() if sync else gpt.no_sync()), autocast:
                    _, loss = gpt(x, y)
                    scaler.scale(loss / c.gradient_accumulation_steps).backward()
                window.loss_sum += loss.detach().float() / c.gradient_accumulation_steps
            grad_norm = optimizer_step(gpt, opt, scaler, c.grad_clip, window)
            progress.iter_num += 1
            window.steps += 1
            now = clock()
            step_seconds, tick = now - tick, now
            progress.trained += step_seconds
            # the log line
            if progress.iter_num == first_step:  # the first step compiles and warms up: the window opens after it
                synchronize(dev)
                window.start, window.tokens, window.paused = time.time(), 0, 0.0
            else:
                window.tokens += tokens_per_iter
            log_now = (progress.iter_num % c.log_interval == 0 or progress.iter_num == first_step
                       or finished(c, progress))
            stopped = (log_now or not ddp) and runs.stop_requested(received, ddp, dev)
            if ddp and log_now:  # every process logs at the same steps: the logged loss is the mean over them
                torch.distributed.all_reduce(window.loss_sum)
                window.loss_sum /= torch.distributed.get_world_size()
            if (log_now or stopped) and master:
                log_line(c, progress, window, grad_norm, opt, scaler, tokens_per_iter, flops_per_iter, peak,
                         eval_seconds, ckpt_path, log_path, wandb_run)
            if stopped:
                break
            if log_now:  # on every process: each one's sum was just reduced into the line
                window = LogWindow(loss_sum=window.loss_sum.zero_(), skipped=window.skipped.zero_(),
                                   start=time.time())
        if stopped:  # by a signal, after the step it came in or in the eval it abandoned: a checkpoint to resume from
            if not all_finite(raw_model):
                raise FloatingPointError(diverged("a weight not finite", progress.iter_num, ckpt_path,
                                                  progress.saved_iter, c.learning_rate, c.grad_clip, c.weight_decay))
            runs.save_run(ckpt_path, raw_model, opt, sampler, master, settings, meta,
                          **saved_progress(progress, t_start, scaler))
        # 7. the end: the loss curve, and samples (or, after a signal, how to continue)
        if master:
            finish(c, progress, t_start, stopped, ckpt_path, log_path, wandb_run)
        if master and not stopped:
            append_result(c, settings, progress, dev, tokens_per_iter, bytes_per_token, t_start)
        if stopped:
            return 128 + (received[0] if received else signal.SIGTERM)
        if master and c.num_samples > 0 and c.max_new_tokens > 0 and not task:  # a recall task: no text to sample
            print_samples(raw_model, data.tokenizer_from_meta(meta), c.start, dev, c.num_samples, c.max_new_tokens,
                          c.temperature, c.top_k)
        return 0


# ----------------------------------------------------------------------------------------------------
# the run's parts, in the order main() uses them

def mixed_precision(dtype, dev):
    """(the autocast context of --dtype on dev, its name, the loss scaler). float16's small range needs its loss
    scaled (GradScaler), which skips a step whose gradients overflowed and lowers the scale; disabled (float32,
    bfloat16), the scaler passes everything through unchanged."""
    half = DTYPES[dtype] if dtype != "auto" else autocast_dtype(dev) if dev.type == "cuda" else None
    autocast = torch.autocast(dev.type, dtype=half) if half else nullcontext()
    precision = {None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[half]
    return autocast, precision, torch.amp.GradScaler(dev.type, enabled=half == torch.float16)


def optimizer_step(gpt, opt, scaler, grad_clip, window):
    """The step after the backward: the gradients' global norm clipped to grad_clip (0: scaled by exactly 1), then the
    optimizer's step; the norm returned, on the device. float16: the scaler unscales first and skips a step whose
    gradients are not finite, which is when their norm is not: the window counts those steps on the device, so the
    step's one host read is the scaler's own (its found-inf flag, which decides whether to step)."""
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if scaler.is_enabled():
        window.skipped += ~torch.isfinite(grad_norm)
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm


def resume_from(ckpt, raw_model, opt, sampler, scaler, rank, dev, out_dir):
    """The weights, optimizer, sampler, RNG and loss scale of a resumed run, loaded from its checkpoint (those a
    stripped checkpoint lacks start fresh, with a line saying so); returns its Progress."""
    path = os.path.join(out_dir, "ckpt.pt")
    runs.load_weights(raw_model, ckpt, path)
    fresh = [what for part, what in (("optimizer", "optimizer"), ("rng", "random generator"))
             if not isinstance(ckpt.get(part), dict)]
    if rank == 0 and fresh:  # a checkpoint shared as weights: they resume, the rest starts afresh
        print(f"note: {path} holds no {' or '.join(what + ' state' for what in fresh)} (weights only?): resuming "
              f"its weights with a fresh {' and a fresh '.join(fresh)}")
    if "optimizer" not in fresh:
        opt.load_state_dict(ckpt["optimizer"])
    streams, world = ckpt.get("sampler") or [], int(os.environ.get("WORLD_SIZE", 1))
    if rank < len(streams):  # a process the checkpoint has no stream of keeps its own fresh one (seed + rank)
        sampler.load_state_dict(streams[rank])
    if rank == 0 and len(streams) != world:
        print(f"note: the checkpoint holds the batch streams of {len(streams)} process{'es' * (len(streams) != 1)}, "
              f"this run has {world}: " + (f"the processes of rank {len(streams)} and up draw fresh ones (seed + "
                                           f"rank)" if world > len(streams) else
                                           f"the streams of rank {world} and up end here"))
    if "random generator" not in fresh:
        torch.set_rng_state(ckpt["rng"]["torch"])
        if dev.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    iter_num, best_val = ckpt["iter_num"], ckpt.get("best_val_loss", math.inf)
    return Progress(iter_num=iter_num, best_val=best_val, val_loss=ckpt.get("val_loss", best_val),
                    last_eval=ckpt.get("val_iter", iter_num),  # a checkpoint written at a stop may predate its eval
                    saved_iter=iter_num, elapsed=ckpt.get("elapsed", 0.0), trained=ckpt.get("trained", 0.0))


def step_size(c, config, raw_model, dev, precision, world, master):
    """(tokens per step, FLOPs per step and process, the peak FLOP/s that MFU is measured against or None), once the
    step has passed check_step_time; on a CPU, a note when the run is sized for a GPU."""
    tokens_per_iter, train_tokens_run, eval_tokens_run = analyze.run_tokens(c, config.block_size, world)
    flops_per_iter = raw_model.flops_per_token(config.block_size) * tokens_per_iter / world
    peak = analyze.peak_flops(dev, precision, c.peak_tflops)
    rate = peak or (matmul_rate() if dev.type == "cpu" else None)
    check_step_time(flops_per_iter, rate, dev)
    if master and dev.type == "cpu":
        flops = analyze.run_flops(raw_model.flops_per_token(config.block_size), train_tokens_run,
                                  eval_tokens_run) / world
        note = analyze.sized_for_a_gpu(c, flops_per_iter, flops, rate) \
            if flops / CPU_FLOPS_FLOOR >= analyze.LONG_CPU_RUN_SECONDS else None
        if note:
            print(note, flush=True)
    return tokens_per_iter, flops_per_iter, peak


def open_run_folder(c, settings, resume_iter, master, wandb, cleanup):
    """out_dir made and locked; then a new run (resume_iter None) sets the run it replaces aside (deleted at its first
    checkpoint, put back if it stops before), a resumed one drops what was logged after its checkpoint. Returns
    wandb's run, or None."""
    if master:
        runs.make_folder(c.out_dir, "out_dir")
        cleanup.callback(runs.release_lock, runs.take_lock(c.out_dir))
        runs.check_run_folder(c.out_dir, c.init_from, c.overwrite)  # again: a run may have ended there since step 3
        data.remove_orphan_temporaries(c.out_dir)
    wandb_run = runs.start_wandb(wandb, c, settings) if wandb else None
    if master and runs.prepare_run_folder(c.out_dir, resume_iter):
        cleanup.callback(runs.put_back_replaced_run, c.out_dir)
    return wandb_run


def print_banner(c, config, meta, n_train_tokens, raw_model, compiled, dev, precision, tokens_per_iter, peak, world):
    """The run's first lines: what it trains, how, and on what (so its times can be compared with RESULTS.md)."""
    threads = torch.get_num_threads()
    print(f"{c.dataset}: {n_train_tokens:,} train tokens, vocab {meta['vocab_size']} | model "
          f"{raw_model.num_params() / 1e6:.2f}M params, mixer {config.mixer}, residual {config.residual} | "
          f"{c.optimizer}, lr {c.learning_rate:g} {c.schedule} to {c.min_lr:g} over {c.lr_decay_iters or c.max_iters} "
          f"iters (warmup {c.warmup_iters})"
          + (f", on time: {c.time_budget:g}s of steps as {c.max_iters} iters" if math.isfinite(c.time_budget) else "")
          + f" | {dev}, {precision}, "
          f"{'eager' if compiled is raw_model else 'compiled'}, {threads} thread{'s' * (threads > 1)} | "
          f"{tokens_per_iter:,} tokens/iter ({world} x {c.gradient_accumulation_steps} x {c.batch_size} x "
          f"{config.block_size}) | "
          + (f"MFU against {peak / 1e12:g} TFLOP/s" if peak else "no MFU (no known peak: --peak_tflops)"))
    if schedule_note(c):
        print(schedule_note(c))
    if compiled is not raw_model:
        print("torch.compile compiles the model at its first use: the first eval and step take a minute or more")


@torch.no_grad()
def evaluate(model, val_tokens, batch_size, block_size, eval_iters, device, autocast, received=None):
    """The mean validation loss over eval_iters batches, the same ones at every call (seed 0), with progress lines when
    it runs long; None when a signal came (received: runs.stop_signals' list): the eval is abandoned at once."""
    was_training = model.training
    model.eval()
    sampler = data.BatchSampler(val_tokens, batch_size, block_size, seed=0, device=device)
    total = torch.zeros((), device=device)
    try:
        with runs.abandoned_on_signal(received):
            for _ in with_progress_lines(range(eval_iters), "eval", "batches"):
                x, y = sampler.next_batch()
                with autocast:
                    total += model(x, y)[1].float()
    except runs.Abandoned:
        return None
    finally:
        model.train(was_training)
    return total.item() / eval_iters  # one host sync per eval


@torch.no_grad()
def evaluate_recall(model, task_name, test_set, device, autocast, received=None):
    """A recall task's eval: (the mean loss on the answers, {slice name: accuracy on its answers}) over test_set
    (RecallTask.test_set: {(length, pairs or depth): [(x, y), ...]}); (None, None) when a signal came."""
    was_training = model.training
    model.eval()
    losses, accuracy = [], {}
    try:
        with runs.abandoned_on_signal(received):
            for (length, value), batches in test_set.items():
                correct = answers = 0
                for x, y in batches:
                    x, y = x.to(device), y.to(device)
                    with autocast:
                        logits, loss = model(x, y)
                    losses.append(loss.float())
                    right, n = data.answer_accuracy(logits, y)
                    correct, answers = correct + right, answers + n
                accuracy[data.slice_name(task_name, length, value)] = correct / answers
    except runs.Abandoned:
        return None, None
    finally:
        model.train(was_training)
    return torch.stack(losses).mean().item(), accuracy


def with_progress_lines(items, label, unit):
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


def finished(c, progress):
    """Whether the run has trained to its end: max_iters steps, or with a time budget its seconds."""
    return progress.trained >= c.time_budget if math.isfinite(c.time_budget) else progress.iter_num >= c.max_iters


def schedule_step(c, progress, step_seconds):
    """The step of the lr schedule that the next step trains at: iter_num; with a time budget, max_iters x the fraction
    of the budget trained by the next step's end (reckoned as long as the last step), so the last step is at min_lr."""
    if not math.isfinite(c.time_budget):
        return progress.iter_num
    return c.max_iters * (progress.trained + step_seconds) / c.time_budget


def bits_per_byte(loss, bytes_per_token):
    """A loss in nats a token as bits a byte of the text: loss x tokens / (ln 2 x bytes)."""
    return loss / (math.log(2) * bytes_per_token)


def record_eval(c, progress, val, bytes_per_token, raw_model, t_start, ckpt_path, log_path, wandb_run, master,
                accuracy=None):
    """The eval of step progress.iter_num: its val loss into progress (a loss or weight not finite stops the run),
    its line in the terminal and log.jsonl, with the loss in bits per byte of the validation text (bytes_per_token:
    its bytes over its tokens; the same text, so char-level and BPE runs compare; None for a recall task, whose
    tokens are no text) and a recall task's accuracy per test slice ({name: accuracy})."""
    progress.val_loss, progress.last_eval = val, progress.iter_num
    if not math.isfinite(val) or not all_finite(raw_model):
        raise FloatingPointError(diverged(f"val loss {val} (or a weight not finite)", progress.iter_num, ckpt_path,
                                          progress.saved_iter, c.learning_rate, c.grad_clip, c.weight_decay))
    progress.best_val = min(progress.best_val, val)
    if master:
        bpb = bits_per_byte(val, bytes_per_token) if bytes_per_token else None
        recall = f"accuracy {', '.join(f'{name} {acc:.3f}' for name, acc in accuracy.items())}, " if accuracy else ""
        print(f"iter {progress.iter_num}: val loss {val:.4f} (best {progress.best_val:.4f}), "
              + (f"val bpb {bpb:.4f}, " if bpb is not None else "") + f"{recall}{time.time() - t_start:.1f}s elapsed")
        extra = {**({"val_bpb": bpb} if bpb is not None else {}), **({"accuracy": accuracy} if accuracy else {})}
        runs.append_log(log_path, {"step": progress.iter_num, "val": val, **extra, "time": time.time() - t_start},
                        wandb_run, sync=True)  # on the disk before the checkpoint after it


def saved_progress(progress, t_start, scaler):
    """What the checkpoint holds besides the weights, optimizer, settings, RNG and samplers (runs.save_run)."""
    return dict(iter_num=progress.iter_num, best_val_loss=progress.best_val, val_loss=progress.val_loss,
                val_iter=progress.last_eval, elapsed=time.time() - t_start, trained=progress.trained,
                scaler=scaler.state_dict())


def log_line(c, progress, window, grad_norm, opt, scaler, tokens_per_iter, flops_per_iter, peak, eval_seconds,
             ckpt_path, log_path, wandb_run):
    """The training loss line of step iter_num (the mean over the window), in the terminal and log.jsonl."""
    loss_total, norm, skipped = torch.stack([window.loss_sum, grad_norm.float(), window.skipped.float()]).tolist()
    skipped = int(skipped)
    mean_loss = loss_total / window.steps
    if not math.isfinite(mean_loss):
        raise FloatingPointError(diverged(f"training loss {mean_loss}", progress.iter_num, ckpt_path,
                                          progress.saved_iter, c.learning_rate, c.grad_clip, c.weight_decay))
    now = time.time()
    tok_s = window.tokens / max(now - window.start - window.paused, 1e-9) if window.tokens else None
    mfu = flops_per_iter * tok_s / tokens_per_iter / peak if tok_s and peak else None
    lr = opt.param_groups[0]["lr"]
    speed = "tokens/s from the next line on"  # the window opens after the first step
    if tok_s:
        eta = ((c.max_iters - progress.iter_num) * tokens_per_iter / tok_s
               + evals_left(progress.iter_num, c.max_iters, c.eval_interval) * eval_seconds)
        if math.isfinite(c.time_budget):
            eta = max(0.0, c.time_budget - progress.trained)
        speed = f"{tok_s:,.0f} tokens/s" + (f", mfu {100 * mfu:.1f}%" if mfu else "") + f", eta {eta:.0f}s"
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaling = f", loss scale {scale:g} ({skipped} steps skipped)" if scaler.is_enabled() else ""
    print(f"iter {progress.iter_num}: loss {mean_loss:.4f}, lr {lr:.2e}, grad norm {norm:.3f}{scaling}, {speed}")
    runs.append_log(log_path, {"step": progress.iter_num, "loss": mean_loss, "lr": lr, "tokens_per_s": tok_s,
                               "mfu": mfu, "grad_norm": norm,
                               **({"loss_scale": scale, "skipped_steps": skipped}
                                  if scaler.is_enabled() else {})}, wandb_run)


def all_finite(model):
    """Whether every weight is finite, with one host sync."""
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


def diverged(what, iter_num, ckpt_path, saved_iter, learning_rate, grad_clip, weight_decay):
    """The line of a run stopped by a loss or weight not finite: what it keeps, and what to change. At lr x wd >= 1
    the decoupled decay p <- p (1 - lr wd) alone zeroes or flips the weights at each step: --weight_decay is named."""
    kept = f"{ckpt_path} still holds iter {saved_iter}" if saved_iter is not None else "no checkpoint was written"
    lower = f"a lower --learning_rate (now {learning_rate:g})" + (" or --grad_clip=1.0" if grad_clip == 0 else "")
    hint = f"try {lower}"
    if learning_rate * weight_decay >= 1:
        hint = (f"--weight_decay={weight_decay:g} times the learning rate is {learning_rate * weight_decay:g}, at "
                f"least 1: each step's decay p <- p (1 - lr wd) zeroes or flips the weights; use a --weight_decay "
                f"below {1 / learning_rate:g}, or {lower}")
    return f"{what} at iter {iter_num}: stopped, {kept}; {hint}"


def evals_left(iter_num, max_iters, eval_interval):
    """The evals still to come at the log line of step iter_num (its own eval comes after it): at each multiple
    of eval_interval from iter_num to max_iters, and at max_iters."""
    return max_iters // eval_interval - (iter_num - 1) // eval_interval + (max_iters % eval_interval != 0)


def finish(c, progress, t_start, stopped, ckpt_path, log_path, wandb_run):
    """Step 7 (rank 0): loss.png (and analysis.png), and the last line: how to continue, or the final val loss."""
    analyze.plot_losses(log_path, os.path.join(c.out_dir, "loss.png"))
    if c.analyze_every:
        analyze.plot_training_analysis(os.path.join(c.out_dir, "analysis.jsonl"),
                                       os.path.join(c.out_dir, "analysis.png"))
    if stopped and os.path.isdir(os.path.join(c.out_dir, runs.REPLACED)):  # the run it replaces comes back
        print(f"interrupted at iter {progress.iter_num}, before this run's first checkpoint of a trained step: "
              f"nothing of it is kept")
    elif stopped:
        out = "" if c.out_dir == RUN_DEFAULTS["out_dir"] else f" --out_dir={c.out_dir}"
        print(f"interrupted at iter {progress.iter_num}: saved {ckpt_path}; continue with python train.py "
              f"--init_from=resume{out}")
    else:
        print(f"done: val loss {progress.val_loss:.4f} after {progress.iter_num} iters, "
              f"{time.time() - t_start:.1f}s; checkpoint {ckpt_path}")
    if wandb_run:
        wandb_run.finish()


def append_result(c, settings, progress, dev, tokens_per_iter, bytes_per_token, t_start):
    """The finished run's row of results_tsv (one write of one line; the header first where the file is new): the
    settings that differ from the defaults, the commit, device, threads, steps, tokens, val loss and bpb, the seconds
    of training steps and of the whole run."""
    path = results_path(c.results_tsv, c.out_dir)
    defaults = {**RUN_DEFAULTS, **model_defaults()}
    defaults["learning_rate"] = peak_lr({**defaults, "optimizer": settings["optimizer"]})  # 0: the optimizer's own
    changed = " ".join(f"--{k}={v}" for k, v in settings.items()
                       if k in defaults and k not in (*COMMAND_KEYS, "results_tsv") and v != defaults[k])
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    row = {"out_dir": c.out_dir, "settings": changed or "(defaults)", "commit": source_commit(), "device": device,
           "threads": torch.get_num_threads(), "steps": progress.iter_num,
           "tokens": progress.iter_num * tokens_per_iter, "val_loss": f"{progress.val_loss:.4f}",
           "val_bpb": f"{bits_per_byte(progress.val_loss, bytes_per_token):.4f}" if bytes_per_token else "",
           "train_s": f"{progress.trained:.1f}", "wall_s": f"{time.time() - t_start:.1f}"}
    try:  # the header, by the process that makes the file
        with open(path, "x") as f:
            f.write("\t".join(row) + "\n")
    except FileExistsError:
        pass
    runs.append_line(path, "\t".join(str(v).replace("\t", " ") for v in row.values()))


def source_commit():
    """The git commit of this file's checkout (with -dirty where tracked files changed), or unknown outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
    except OSError:  # no git
        return "unknown"
    return head.stdout.strip() + "-dirty" * bool(dirty.stdout.strip()) if head.returncode == 0 else "unknown"


def results_path(results_tsv, out_dir):
    """results_tsv; a relative path is taken from out_dir's parent folder, so runs in runs/a, runs/b share one file."""
    return os.path.join(os.path.dirname(os.path.abspath(out_dir)), results_tsv)


def units_line(dataset, tokenizer):
    """The dry run's line of units: val loss in nats a token, val bpb in bits a byte, with the prepared validation
    split's bytes a token (nothing is read or written for data not yet prepared)."""
    line = ("units       val loss in nats a token; val bpb = val loss x tokens / (ln 2 x bytes) of the validation "
            "text,\n            in bits a byte")
    prepared = data.prepared_val_tokens(dataset, tokenizer)
    if prepared is None:
        return line + " (its bytes a token known once the data is prepared)"
    tokens, meta = prepared
    per_token = data.text_bytes(tokens, data.tokenizer_from_meta(meta)) / len(tokens)
    return line + f": {len(tokens):,} tokens, {per_token:.4f} bytes a token"


def print_samples(model, tokenizer, prompt, device, n, length, temperature, top_k):
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    model.eval()
    for i in range(n):
        out = model.generate(idx, length, temperature=temperature, top_k=top_k)
        print(f"--- sample {i + 1} ---\n{tokenizer.decode(out[0].tolist())}")


# ----------------------------------------------------------------------------------------------------
# the settings, read and checked; the run's checks before it writes anything; sampling a checkpoint

def read_settings(args):
    """Step 1: (settings, the keys given, the checkpoint of a resumed run or None, what the resumed run changes). A
    run that a killed one set aside comes back first."""
    defaults = {**RUN_DEFAULTS, **model_defaults()}
    given = runs.parse_config(args, defaults, __doc__, config_help(), allowed=allowed_help())
    for key in ("out_dir", "dataset"):  # --out_dir=~/runs/x: the shell leaves a ~ after = as it is
        if key in given:
            given[key] = os.path.expanduser(given[key])
    settings, ckpt, changes = {**defaults, **given}, None, []
    if not settings["dry_run"] and int(os.environ.get("RANK", 0)) == 0:
        note = runs.recover_run(settings["out_dir"], runs.RUN_FILES)
        if note:
            print(note)
    if settings["init_from"] == "resume" and not settings["sample_only"]:
        ckpt_path = os.path.join(settings["out_dir"], "ckpt.pt")
        ckpt = check_resumable(runs.load_checkpoint(ckpt_path), ckpt_path, defaults)
        settings, changes = resumed_settings(ckpt["config"], given)
        check_optimizer_kept(ckpt, given, ckpt_path)
    elif pretrained(settings["init_from"]):  # the model keys are the pretrained model's (and the changeable given)
        keys = model.merged_pretrained_keys(settings["init_from"], {k: v for k, v in given.items() if k in defaults})
        settings.update({key: value for key, value in keys.items() if key != "vocab_size"})
    check_settings(settings)
    optim.check_chosen_settings(settings["optimizer"], given)
    settings["learning_rate"] = peak_lr(settings)
    if ckpt is not None:
        check_schedule_length(ckpt["config"], settings, given)
    return settings, given, ckpt, changes


def check_resumable(ckpt, path, defaults):
    """A checkpoint to resume (a hand-edited or stripped one too): one line for what it lacks or holds of the wrong
    type; its config's values are checked as --key=value is. Its optimizer, sampler and RNG states may be missing
    (shared weights): resume_from starts those fresh and says so. Returns ckpt with its config checked."""
    for part, kind in (("config", dict), ("meta", dict), ("iter_num", int)):
        if not isinstance(ckpt.get(part), kind) or isinstance(ckpt.get(part), bool):
            raise runs.ConfigError(f"{path} has no {part} ({kind.__name__}) to resume from: point --out_dir at a run "
                                   f"that train.py wrote, or start a new run")
    meta = ckpt["meta"]
    if (meta.get("tokenizer") not in data.TOKENIZERS and meta.get("recall") not in data.RECALL_TASKS) or \
            not isinstance(meta.get("vocab_size"), int):
        raise runs.ConfigError(f"{path}'s meta names no tokenizer of data.TOKENIZERS and vocab_size: resume a run "
                               f"that train.py wrote, or start a new run")
    config = dict(ckpt["config"])
    for key in config.keys() & defaults.keys():
        try:
            config[key] = runs.check_type(key, config[key], defaults[key])
        except runs.ConfigError as e:
            raise runs.ConfigError(f"{path} holds {key}={config[key]!r} in its config, not a value train.py takes "
                                   f"({e}): fix the checkpoint's config, or start a new run") from None
    return {**ckpt, "config": config}


def check_optimizer_kept(ckpt, given, path):
    """The optimizer state of a checkpoint fits only the optimizer it came from: --optimizer and --spectral_lr (which
    splits the param groups) must stay the checkpoint's."""
    for key in ("optimizer", "spectral_lr"):
        saved = ckpt["config"].get(key, RUN_DEFAULTS[key])
        if "optimizer" in ckpt and key in given and given[key] != saved:
            raise runs.ConfigError(f"--{key}={given[key]!r} differs from {path}'s {key}={saved!r}, whose optimizer "
                                   f"state does not fit another optimizer's param groups: drop --{key}, or start a "
                                   f"new run in another --out_dir")


def model_defaults():
    """The model's keys, GPTConfig's fields (vocab_size comes from the data), and their defaults: GPTConfig's."""
    return {f.name: f.default for f in fields(GPTConfig) if f.name != "vocab_size"}


def choices():
    """The keys that take one of a set of values, and those values; the kinds come from their tables, read
    when asked, so a kind added to a table is allowed and listed at once."""
    return {"tokenizer": ("auto", *data.TOKENIZERS),
            "optimizer": tuple(optim.OPTIMIZERS), "schedule": ("cosine", "wsd"), "dtype": ("auto", *DTYPES),
            **model.config_choices(),
            **{key: tuple(s.allowed) for key, (s, _) in optim.SETTINGS.items() if not isinstance(s.allowed, str)}}


def config_help():
    """{key: description}: the comment beside each run setting above and each GPTConfig field, and each optimizer
    setting's help with the optimizers that take it."""
    settings = {key: f"{', '.join(users)}: {s.help}"
                for key, (s, users) in optim.SETTINGS.items()}
    return {**runs.source_comments(inspect.getsource(GPTConfig)), **runs.source_comments(open(__file__).read()),
            **settings}


def allowed_help():
    """{key: --help's text of its allowed values}: the ranges, and each choice with its table row's comment."""
    tables = {**{key: (model, table) for key, table in model.CHOICE_TABLES.items()},
              "optimizer": (optim, "OPTIMIZERS"), "tokenizer": (data, "TOKENIZERS")}
    return {**RANGES, **runs.choices_help(choices(), tables)}


def check_settings(c):
    """Every key's range and choice and the device (runs.check_values, as analyze.py checks them), the model's own
    rules (GPTConfig's, with a stand-in vocabulary: before any data is read), the rule between the lrs, and the kernel
    path."""
    runs.check_values(c, RANGES, {key: allowed for key, allowed in choices().items() if key != "mixer"})
    GPTConfig(**{key: c[key] for key in model_defaults()})  # mixer letters, head size, ...
    if c["min_lr"] > peak_lr(c):
        given = f"--learning_rate={c['learning_rate']!r}" if c["learning_rate"] else \
            f"{c['optimizer']}'s own learning rate {peak_lr(c)!r} (optim.OPTIMIZERS)"
        raise runs.ConfigError(f"--min_lr={c['min_lr']!r} is above {given}: the schedule decays from the learning "
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
        raise runs.ConfigError("--kernels='triton' needs Triton on a CUDA GPU (on a CPU, slowly, its interpreter: "
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
                raise runs.ConfigError(f"--{key}={given[key]!r} differs from the checkpoint's {key}={config[key]!r}: "
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
        raise runs.ConfigError(f"--max_iters={settings['max_iters']} would change the lr schedule's length from "
                               f"{before} to {now} iters: keep it with --lr_decay_iters={before} (past it the lr "
                               f"stays at min_lr), or stretch it with --lr_decay_iters={now}")


def model_config(settings, vocab_size):
    return GPTConfig(vocab_size=vocab_size, **{key: settings[key] for key in model_defaults()})


def pretrained(init_from):
    """Whether --init_from names pretrained weights (model.pretrained_config checks the name or folder)."""
    return init_from not in ("scratch", "resume")


def sample_from_checkpoint(c, given, dev):
    """--sample_only=True: samples from out_dir/ckpt.pt (or the pretrained model of --init_from), nothing trained or
    written."""
    if pretrained(c.init_from):
        tokenizer = data.tokenizer_from_meta(runs.pretrained_meta(c.init_from))
        check_prompt(c.start, tokenizer, c.init_from)
        keys = {key: getattr(c, key) for key in model.PRETRAINED_CHANGEABLE}
        gpt = GPT.from_pretrained(c.init_from, **keys).to(dev)
        torch.manual_seed(c.seed)
        print_samples(gpt, tokenizer, c.start, dev, c.num_samples, c.max_new_tokens, c.temperature, c.top_k)
        return 0
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    ckpt = runs.load_checkpoint(ckpt_path)
    model_cfg, _ = resumed_model_config(ckpt["config"], given)
    tokenizer = data.tokenizer_from_meta(ckpt["meta"])
    check_prompt(c.start, tokenizer, ckpt["config"].get("dataset"))
    gpt = GPT(GPTConfig(vocab_size=ckpt["meta"]["vocab_size"], **model_cfg)).to(dev)
    runs.load_weights(gpt, ckpt, ckpt_path)
    torch.manual_seed(c.seed)
    print_samples(gpt, tokenizer, c.start, dev, c.num_samples, c.max_new_tokens, c.temperature, c.top_k)
    return 0


def check_run(c, settings, ckpt, dev, master):
    """Step 3: (train tokens, val tokens, meta, the model's config, wandb or None), once the folder, the data, wandb,
    the vocabulary of a resumed run, the prompt and the run's memory have passed their checks."""
    data.check_writable_folder(c.out_dir, "out_dir")
    if master:  # (the other processes would find the lock that rank 0 takes in step 5)
        runs.check_unlocked(c.out_dir)
        runs.check_run_folder(c.out_dir, c.init_from, c.overwrite)
    if c.dataset in data.RECALL_TASKS:  # generated: the task stands for both splits
        task = recall_task(c)
        train_tokens, val_tokens, meta = task, task, task.meta
    else:
        train_tokens, val_tokens, meta = data.load_dataset(c.dataset, c.tokenizer)
    wandb = runs.import_wandb() if c.wandb_log and master else None
    if ckpt is not None:
        check_same_vocabulary(meta, c.dataset, ckpt["meta"], ckpt["config"].get("dataset"))
    elif pretrained(c.init_from):
        own = runs.pretrained_meta(c.init_from)
        if any(meta.get(k) != own.get(k) for k in ("tokenizer", "vocab_size", "chars")):
            raise runs.ConfigError(f"--dataset={c.dataset!r} has a {meta['tokenizer']} vocabulary of "
                                   f"{meta['vocab_size']} tokens, --init_from={c.init_from!r} reads "
                                   f"{own['tokenizer']}'s of {own['vocab_size']}: use data in its tokens "
                                   f"(GPT-2's: --dataset=shakespeare, or a text file with --tokenizer=gpt2)")
    settings.update(vocab_size=meta["vocab_size"])
    config = model_config(settings, meta["vocab_size"])
    splits = (("training", train_tokens), ("validation", val_tokens)) if c.dataset not in data.RECALL_TASKS else ()
    for split, tokens in splits:
        if len(tokens) < config.block_size + 2:
            made = "its *_train_* or *_val_* shards" if data.is_shard_pattern(c.dataset) else \
                "the validation split is the last 10% of a text"
            raise runs.ConfigError(f"the {split} split of {c.dataset} has only {len(tokens)} tokens ({made}), fewer "
                                   f"than block_size + 2 = {config.block_size + 2}: use more "
                                   f"{'tokens' if data.is_shard_pattern(c.dataset) else 'text'} or a smaller "
                                   f"--block_size")
    if c.num_samples > 0 and c.max_new_tokens > 0 and c.dataset not in data.RECALL_TASKS:
        check_prompt(c.start, data.tokenizer_from_meta(meta), c.dataset)
    analyze.check_fit(analyze.run_costs(c, config, act=2).memory, dev)
    return train_tokens, val_tokens, meta, config, wandb


def recall_task(c):
    """The data.RecallTask of --dataset=mqar or passkey, its settings checked: one line for pairs that do not fit, or
    a test length past block_size·rope_factor where a mixer is attention."""
    if c.tokenizer != "auto":
        raise runs.ConfigError(f"--dataset={c.dataset} has its own vocabulary, not --tokenizer={c.tokenizer}: drop "
                               f"--tokenizer")
    limited = any(getattr(model.MIXERS[letter], "context_limited", False) for letter in c.mixer)
    return data.RecallTask(c.dataset, c.block_size, vocab=c.recall_vocab, pairs=c.recall_pairs,
                           test_pairs=c.recall_test_pairs, test_lengths=c.recall_test_lengths,
                           max_length=int(c.block_size * c.rope_factor) if limited else None)


def check_same_vocabulary(meta, dataset, saved_meta, saved_dataset):
    if any(meta.get(k) != saved_meta.get(k) for k in ("tokenizer", "vocab_size", "chars")):
        raise runs.ConfigError(f"--dataset={dataset!r} has a {meta['tokenizer']} vocabulary of {meta['vocab_size']} "
                               f"tokens, the checkpoint's ({saved_dataset!r}) a {saved_meta['tokenizer']} vocabulary "
                               f"of {saved_meta['vocab_size']}: resume with --dataset={saved_dataset!r}")


def check_prompt(start, tokenizer, dataset):
    """The samples' prompt must be at least one token of the vocabulary."""
    try:
        ids = tokenizer.encode(start)
    except data.DataError as e:
        raise runs.ConfigError(f"--start={start!r} (the samples' prompt) does not fit the vocabulary of {dataset} "
                               f"({e}): give a prompt made of its characters, or --num_samples=0") from None
    if not ids:
        raise runs.ConfigError(f"--start={start!r} (the samples' prompt) is empty: give at least one character")


def check_step_time(flops_per_iter, peak, device):
    """One step that would take over MAX_STEP_SECONDS even at the device's peak is refused: a block_size or
    batch_size far beyond what the device can train."""
    if peak and flops_per_iter / peak > MAX_STEP_SECONDS:
        raise runs.ConfigError(f"one step of this run is {flops_per_iter:.1e} FLOPs, over "
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
# the device: its 16-bit dtype, its speed, and waiting for it

def autocast_dtype(device):
    """The 16-bit dtype of mixed precision on a GPU: bf16 where it computes bf16 natively (compute capability 8.0 and
    up: A100, H100, RTX 30xx and later), else fp16 (T4, V100, RTX 20xx), which needs a GradScaler."""
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


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


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ValueError, FileNotFoundError, FloatingPointError, data.DiskFullError) as e:  # one line: what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C before the loop, or a second one in it (in a checkpoint's write: named)
        print(f"interrupted: stopped at once; {e if e.args else 'the last checkpoint written, if any, is kept'}",
              file=sys.stderr)
        sys.exit(130)
