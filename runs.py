"""
What train.py and analyze.py share about a run: its settings (config files and --key=value arguments, checked
against each key's range and choices), the device it computes on, its folder (one process writes it at a time; a
new run replaces an old one only once it has its own checkpoint), the Ctrl-C and SIGTERM handling that stops it
between steps, its log (out_dir/log.jsonl, and wandb) and its checkpoints. data.py holds the data it trains on and
the atomic writes every file goes through.

    python runs.py [out_dir]     what the run in out_dir (default: out) holds: its checkpoint, its log, its lock
"""
import ast
import collections
import difflib
import errno
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import traceback
import types
from contextlib import contextmanager

import torch

import data
import model

# ----------------------------------------------------------------------------------------------------
# config files and --key=value arguments (train.py and analyze.py)

class ConfigError(ValueError):
    """A wrong setting, reported as one line that says how to fix it."""


def source_comments(source):
    """{name: comment} for each line `name = value  # comment`, `name: type = value  # comment` or
    `"name": value,  # comment` of source (the first such line of each name): the --help texts."""
    found = {}
    for name, comment in re.findall(r'^\s*"?(\w+)"?\s*[:=][^#\n]*#\s*(.*)$', source, re.M):
        found.setdefault(name, comment)
    return found


def row_comments(module, table):
    """{key: comment} for the rows of the dict `table = {` in module's source, one `"key": value,  # comment` a line:
    the one-line description each kind's row carries, for --help (a row without a comment has none)."""
    body = inspect.getsource(module).split(f"\n{table} = {{", 1)[1].split("\n}", 1)[0]
    return dict(re.findall(r'^\s*"([^"]+)"\s*:[^#\n]*#\s*(.*)$', body, re.M))


def choices_help(choices, tables):
    """{key: --help's text of its allowed values}, e.g. "A (attention) | G (gated delta rule)": each value of
    choices[key] with its row's comment in its table (tables: {key: (module, table name)}), where it has one."""
    about = {key: row_comments(module, table) for key, (module, table) in tables.items()}
    return {key: " | ".join(f"{v} ({about[key][v]})" if v in about.get(key, {}) else v for v in values)
            for key, values in choices.items()}


def parse_config(args, defaults, usage, descriptions, file_keys=None, allowed=None, file_others=()):
    """The values that config files (args without '--', or --config=file) and --key=value overrides
    give, as {key: value}, each checked against the type of defaults[key]. A config file's keys outside
    file_keys (when given) must be file_others (the settings of the other script that reads such files: skipped);
    any other key is unknown, as on the command line. -h / --help prints usage and every key with its description
    and allowed[key] (the text of its allowed values, where given); then exits."""
    given = {}
    for arg in args:
        if arg in ("-h", "--help"):
            width = min(32, max(len(f"--{k}={v!r}") for k, v in defaults.items()))
            print(usage + "\nconfig keys and defaults:\n" + "\n".join(
                f"  {f'--{k}={v!r}':<{width}}  {descriptions.get(k, type(v).__name__)}"
                + (f" [{allowed[k]}]" if k in (allowed or {}) else "") for k, v in defaults.items()))
            sys.exit(0)
        if arg.startswith("--config="):
            arg = arg[len("--config="):]
        if not arg.startswith("--"):
            pairs = []
            for key, value in read_config_file(arg).items():
                if file_keys is None or key in file_keys:
                    pairs.append((key, value))
                elif key not in file_others:
                    raise unknown_key(key, [*(k for k in defaults if k in file_keys), *file_others])
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"argument {arg!r} is not of the form --key=value")
            value = parse_value(text)  # a string key keeps what was typed: --lengths=1,2,4 is text, not a tuple
            pairs = [(key, text if isinstance(defaults.get(key), str) and not isinstance(value, str) else value)]
        for key, value in pairs:
            if key not in defaults:
                raise unknown_key(key, defaults)
            given[key] = check_type(key, value, defaults[key])
    return given


def unknown_key(key, keys):
    close = similar_keys(key, keys)
    hint = f"did you mean {' or '.join('--' + k for k in close)}? " if close else ""
    return ConfigError(f"unknown config key {key!r}; {hint}valid keys: {', '.join(keys)}")


def read_config_file(path):
    """{name: value} of the assignments a config file (plain Python) makes; the modules, functions and classes it
    imports or defines, and names starting with _, are not keys. A syntax error or a failing line is one line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found: give a path to a .py file of assignments")
    with open(path) as f:
        source = f.read()
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}: a config file holds Python assignments "
                          f"such as max_iters = 500") from None
    values = {}  # one namespace, as a module has: a line may use the names the lines above it made
    try:
        exec(code, values)
    except (Exception, SystemExit) as e:  # sys.exit() in a config file too: it would end the run without a word
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                     if frame.filename == path), "?")
        what = f"it calls sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config file {path}, line {line}: {what}: a config file holds Python assignments such "
                          f"as max_iters = 500") from None
    keys = {k: v for k, v in values.items()
            if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)}
    if not keys:  # e.g. JSON: {"max_iters": 5} is a valid Python expression that assigns nothing
        hint = ' (JSON is not read: write max_iters = 5, not {"max_iters": 5})' if source.lstrip().startswith("{") \
            else ""
        raise ConfigError(f"config file {path} assigns no key{hint}: a config file holds Python assignments such as "
                          f"max_iters = 500")
    return keys


def similar_keys(key, keys):
    """Up to three keys like key: spelled alike, with key's letters as their words' initials (lr: learning_rate),
    or with key as one of their words (lr: min_lr)."""
    initials = [k for k in keys if "".join(word[0] for word in k.split("_")) == key]
    words = [k for k in keys if key in k.split("_")]
    return list(dict.fromkeys(initials + difflib.get_close_matches(key, keys, n=3) + words))[:3]


def bound(text):
    """A bound of a range rule: a number, or a power of two written 2**k."""
    base, power, exponent = text.partition("**")
    return float(base) ** int(exponent) if power else float(text)


def in_range(value, rule):
    """Whether value satisfies rule: ">= a", "> a", or an interval "in [a, b)" ([ ]: closed, ( ): open)."""
    if rule.startswith("in "):
        low_bracket, low, high, high_bracket = re.fullmatch(r"in ([\[(])(.+), (.+)([\])])", rule).groups()
        above = value >= bound(low) if low_bracket == "[" else value > bound(low)
        below = value <= bound(high) if high_bracket == "]" else value < bound(high)
        return above and below
    op, limit = rule.split()
    return value >= bound(limit) if op == ">=" else value > bound(limit)


def one_of(allowed):
    return ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]


def check_values(values, ranges, choices):
    """The check of every key that train.py and analyze.py share, each with its own rules: each number within its rule
    of ranges (in_range), each key of choices one of its allowed values (a near miss is named), and the device one
    that this machine has."""
    check_ranges(values, ranges)
    for key, allowed in choices.items():
        if key in values and values[key] not in allowed:
            close = difflib.get_close_matches(str(values[key]), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"--{key}={values[key]!r} is not valid: use {one_of(allowed)}{hint}")
    if "device" in values:
        check_device(values["device"])


def check_ranges(values, ranges):
    """A one-line error for the first of values outside its rule in ranges ({key: rule of in_range})."""
    for key, rule in ranges.items():
        if key in values and not in_range(values[key], rule):
            op, limit = rule.split(maxsplit=1)
            allowed = {">=": f"at least {limit}", ">": f"a value above {limit}"}.get(op, f"a value {rule}")
            raise ConfigError(f"--{key}={values[key]!r} is not valid: use {allowed}")


def make_folder(path, flag):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create --{flag}={path!r} ({e.strerror}): point --{flag} elsewhere") from None


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
        if ok and not math.isfinite(value) and value != default:  # 1e999 reads as inf (a default of inf: none)
            raise ConfigError(f"--{key}={value!r} is not a finite number: give a finite value (default {default!r})")
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, expected, value = True, "a string", str(value)
    if not ok:
        raise ConfigError(f"--{key} expects {expected} (default {default!r}), got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------
# the device a run computes on

def mps_available():
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def check_device(name):
    """name must be auto or a device of this machine: cpu, cuda (cuda:N) or mps; under torchrun, with one process a
    GPU (a process whose LOCAL_RANK has no GPU would fail at its first CUDA call: refused here, before any)."""
    gpus = torch.cuda.device_count()
    local_rank = os.environ.get("LOCAL_RANK")
    on_cuda = gpus > 0 if name == "auto" else name.startswith("cuda")
    if local_rank is not None and on_cuda and 0 < gpus <= int(local_rank):
        processes = os.environ.get("LOCAL_WORLD_SIZE", int(local_rank) + 1)
        raise ConfigError(f"torchrun started {processes} processes on this machine, which has {gpus} CUDA "
                          f"GPU{'s' * (gpus > 1)}: one process a GPU, torchrun --nproc_per_node={gpus}")
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device={name!r} is not a device: use auto, cpu, cuda, cuda:1 or mps")
    if device.type == "cuda" and (device.index or 0) >= gpus:
        have = f"{gpus} CUDA GPU{'s' * (gpus > 1)} (cuda:0 .. cuda:{gpus - 1})" if gpus else "no CUDA GPU"
        raise ConfigError(f"--device={name!r}: this machine has {have}: use --device=auto or cpu")
    if device.type == "mps" and not mps_available():
        raise ConfigError(f"--device={name!r}: this machine has no MPS (Apple GPU): use --device=auto or cpu")


def use_device(name="auto"):
    """The device a run computes on, made current, as a torch.device with its index: auto is cuda > mps > cpu;
    cuda is the current GPU (0 unless set), or under torchrun the GPU of the process's LOCAL_RANK; cuda:N is GPU N.
    Making it current matters because Triton launches on the current GPU, not on its arguments'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and device.index not in (None, int(local_rank)):
        raise ValueError(f"--device={name!r}: under torchrun each process computes on the GPU of its LOCAL_RANK "
                         f"(here cuda:{local_rank}); use --device=cuda or auto")
    index = device.index if device.index is not None else int(local_rank) if local_rank is not None else \
        torch.cuda.current_device()
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


# ----------------------------------------------------------------------------------------------------
# a run's folder: one process writes it at a time

def lock_holder(path):
    """Who holds the lock file at path, as text ("pid 123 on host h"), or None when there is no lock or its
    process is dead. A lock from another host counts as held: its process cannot be looked up from here."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")  # garbage bytes read as an unreadable lock
    except FileNotFoundError:
        return None
    pid, _, host = text.strip().partition(" ")
    if pid.isdigit() and host == socket.gethostname() and not data.process_alive(int(pid)):
        return None
    return f"pid {pid} on host {host}" if pid.isdigit() else "an unreadable lock"


def check_unlocked(folder):
    """A one-line error when a live process holds folder/.lock."""
    path = os.path.join(folder, ".lock")
    holder = lock_holder(path)
    if holder is not None:
        raise ConfigError(f"{folder} is in use by another run ({holder}): wait for it to end, or use another "
                          f"--out_dir (if no run is using it, delete {path})")


def take_lock(folder):
    """Creates folder/.lock (atomically, O_EXCL) holding this process's pid and host, or fails with one line
    naming the run that holds it; a lock whose process has died is taken over. Returns the lock's path."""
    path = os.path.join(folder, ".lock")
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            check_unlocked(folder)
            take_over_stale_lock(path)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        return path


def take_over_stale_lock(path):
    """Removes a dead process's lock. It is first renamed aside, which only one of two processes taking it
    over at once achieves; a lock that turns out to be live (the other one's, just made) is put back."""
    aside = f"{path}.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if lock_holder(aside) is None:
        os.remove(aside)
    else:
        os.rename(aside, path)


def release_lock(path):
    """Deletes the lock take_lock made, if it is still this process's."""
    if lock_holder(path) == f"pid {os.getpid()} on host {socket.gethostname()}":
        os.remove(path)


# A new run in a folder that holds another run's files moves them into folder/.replaced (set_aside_run) and deletes
# them once it has written its own first checkpoint (drop_replaced_run); until then the old run is whole in there.
# If the new run fails before that, it puts the old one back (restore_run); if it was killed, the next train.py in
# that folder does (recover_run). Its first checkpoint is the first of a trained step (iter_num >= 1): the one of
# its eval at iter 0, or of a Ctrl-C in it, holds an untrained model and replaces nothing. names: the run's files,
# its checkpoint first; a folder holding both .replaced and a trained checkpoint is one whose new run had
# checkpointed (and was killed before it deleted .replaced).
REPLACED = ".replaced"


def set_aside_run(folder, names):
    """Moves those of names that folder holds into folder/.replaced, the first (the checkpoint) first, after writing
    their list there (restore_run reads it); returns whether there were any."""
    present = [name for name in names if os.path.exists(os.path.join(folder, name))]
    if not present:
        return False
    aside = os.path.join(folder, REPLACED)
    os.makedirs(aside, exist_ok=True)
    data.atomic_write_bytes(os.path.join(aside, "files.json"), json.dumps(present).encode())
    for name in present:
        os.replace(os.path.join(folder, name), os.path.join(aside, name))
    return True


def restore_run(folder, names):
    """Puts the run that set_aside_run moved into folder/.replaced back in place of the new run's files of names (the
    new run's other files are deleted), the checkpoint last; returns whether there was one. Run again after a crash
    half-way, it finishes the job: a file it already moved back is not in .replaced any more, and stays."""
    aside, listed = os.path.join(folder, REPLACED), os.path.join(folder, REPLACED, "files.json")
    if not os.path.exists(listed):  # nothing was moved yet
        drop_replaced_run(folder)
        return False
    with open(listed) as f:
        moved = json.load(f)
    for name in reversed(names):
        path, kept = os.path.join(folder, name), os.path.join(aside, name)
        if name in moved and os.path.exists(kept):
            os.replace(kept, path)
        elif name not in moved and os.path.exists(path):
            os.remove(path)
    shutil.rmtree(aside)
    return True


def drop_replaced_run(folder):
    """Deletes the run set aside in folder/.replaced, if any: the new run has written its first checkpoint."""
    shutil.rmtree(os.path.join(folder, REPLACED), ignore_errors=True)


def trained_checkpoint(path):
    """Whether path is a readable checkpoint of at least one finished training step (iter_num >= 1)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, unreadable: not a checkpoint that may replace a run
        return False
    return isinstance(ckpt, dict) and isinstance(ckpt.get("iter_num"), int) and ckpt["iter_num"] >= 1


def recover_run(folder, names):
    """The run set aside in folder/.replaced by a new run that was killed before its first checkpoint of a
    trained step is put back (returns a note saying so); one whose new run had written one is deleted. Nothing is
    done while a live process holds folder/.lock (a new run that is still starting)."""
    aside = os.path.join(folder, REPLACED)
    if not os.path.isdir(aside) or lock_holder(os.path.join(folder, ".lock")) is not None:
        return None
    lock = take_lock(folder)
    try:
        if trained_checkpoint(os.path.join(folder, names[0])):  # the new run checkpointed a trained step
            drop_replaced_run(folder)
            return None
        if restore_run(folder, names):
            return (f"note: put back the run in {folder} that a new run (--overwrite=True) had set aside in {aside} "
                    f"and was killed before its first checkpoint of a trained step")
        return None
    finally:
        release_lock(lock)


# the files a run writes in its folder, its checkpoint first (set_aside_run's names)
RUN_FILES = ("ckpt.pt", "log.jsonl", "loss.png", "analysis.jsonl", "analysis.png")


def check_run_folder(out_dir, init_from, overwrite):
    """A new run never replaces the run in out_dir (its checkpoint) unasked."""
    if init_from != "resume" and not overwrite and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        raise ConfigError(f"--out_dir={out_dir!r} holds a run (ckpt.pt): continue it with --init_from=resume, "
                          f"start this one in another --out_dir, or replace it with --overwrite=True")


def prepare_run_folder(out_dir, resume_iter):
    """A new run (resume_iter None) sets the files of the run it replaces aside (set_aside_run: deleted at its
    first checkpoint, put back if it stops before) and returns whether there were any; a resumed one keeps the rows
    of its logs up to its checkpoint's step, dropping (and saying so) lines that a crash or a full disk cut short and
    rows that are no step's."""
    if resume_iter is None:
        return set_aside_run(out_dir, RUN_FILES)
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        if name.endswith(".jsonl") and os.path.exists(path):
            rows, dropped = read_jsonl(path)
            kept = "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= resume_iter)
            data.atomic_write_bytes(path, kept.encode())
            for why, count in dropped.items():
                print(f"note: dropped {count} line{'s' * (count > 1)} of {path} {why}")
    return False


def put_back_replaced_run(out_dir):
    """The run a new run set aside comes back when the new one ends before its first checkpoint of a trained step."""
    if restore_run(out_dir, RUN_FILES):
        print(f"note: {out_dir} holds the run it held before again: this run stopped before its first checkpoint "
              f"of a trained step")


# ----------------------------------------------------------------------------------------------------
# stopping a run: Ctrl-C and SIGTERM end it after the step it is in (or abandon the eval it is in)

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


# ----------------------------------------------------------------------------------------------------
# a run's log: out_dir/log.jsonl, and its wandb run when --wandb_log=True

def append_line(path, line, sync=False):
    """Appends line and a newline to path with one write, so that the line is whole or absent: a write that the
    disk cut short is undone. sync: flush it to the disk before returning."""
    encoded = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with data.full_disk_reported(path):
            size = os.fstat(fd).st_size
            if os.write(fd, encoded) != len(encoded):
                os.ftruncate(fd, size)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if sync:
                os.fsync(fd)
    finally:
        os.close(fd)


TORN, NOT_A_STEP = "cut short by a crash or a full disk", "that are not a step's row (a JSON object with a \"step\")"
NOT_TEXT = "that are not UTF-8 text"


def read_jsonl(path):
    """(rows, dropped): the rows of the step log at path, each a JSON object with an integer "step" (none if there is
    no file), and {why: count} of the lines skipped: TORN (not JSON: a last line cut short by a crash or a full
    disk), NOT_A_STEP (JSON, but no step's row: a line written or edited by hand) or NOT_TEXT (garbage bytes)."""
    rows, dropped = [], collections.Counter()
    if not os.path.exists(path):
        return rows, dropped
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a folder, not a run's log: move it out of the way, then run again")
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode())
            except UnicodeDecodeError:
                dropped[NOT_TEXT] += 1
                continue
            except json.JSONDecodeError:
                dropped[TORN] += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                rows.append(row)
            else:
                dropped[NOT_A_STEP] += 1
    return rows, dropped


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
        raise ConfigError("--wandb_log=True needs the wandb package: pip install wandb (or drop --wandb_log)") \
            from None
    settings = wandb_setup.singleton().settings
    if settings.mode in ("offline", "dryrun", "disabled"):
        return wandb
    try:
        key = wbauth.authenticate_session(host=settings.base_url, source="train.py", prompt=False,
                                          update_session=False)
    except AuthenticationError as e:
        raise ConfigError(f"wandb's API key is not valid ({e}): run `wandb login`, set WANDB_MODE=offline, or "
                          f"drop --wandb_log") from None
    if key is None:
        raise ConfigError("wandb has no API key: run `wandb login`, set WANDB_MODE=offline, or drop --wandb_log")
    return wandb


def start_wandb(wandb, c, settings):
    """The wandb run of this run (its files in out_dir/wandb), or a one-line error (no network to an online server)."""
    try:
        return wandb.init(project=c.wandb_project, name=c.wandb_run_name or None, config=settings, dir=c.out_dir)
    except Exception as e:
        raise ConfigError(f"wandb could not start its run ({type(e).__name__}: {str(e).splitlines()[0]}): check "
                          f"the network, set WANDB_MODE=offline, or drop --wandb_log") from None


def append_log(path, row, wandb_run=None, sync=False):
    """One row of out_dir/log.jsonl (whole or not at all: append_line), and of the wandb run if there is one."""
    append_line(path, json.dumps(row), sync=sync)
    if wandb_run:
        wandb_run.log({WANDB_KEYS.get(k, k): v for k, v in row.items() if k != "step"}, step=row["step"])


# ----------------------------------------------------------------------------------------------------
# checkpoints: {"model", "optimizer", "config", "meta", "iter_num", ...}, written by train.py

def save_checkpoint(path, state):
    """Writes state to path atomically: a crash, a full disk or a second Ctrl-C keeps the previous checkpoint. The
    second Ctrl-C (stop_signals' KeyboardInterrupt) comes out as a KeyboardInterrupt naming what was kept, even where
    torch's zip writer, cut off in the middle of its writes, turned it into its own RuntimeError."""
    kept = f"{path} still holds the previous one" if os.path.exists(path) else "no checkpoint was written"

    def write(f):
        try:
            torch.save(state, f)
        except BaseException as e:
            cause = e
            while cause is not None and not isinstance(cause, KeyboardInterrupt):
                cause = cause.__context__
            if cause is None:
                raise
            raise KeyboardInterrupt(f"the checkpoint it was writing is dropped; {kept}") from None
    data.atomic_write(path, write)


def load_checkpoint(path, flag="--out_dir"):
    """The checkpoint dict at path, or a one-line error when it is missing, unreadable or not specgpt's
    (flag: the argument that gave path, named in the error)."""
    if os.path.isdir(path):
        inside = os.path.join(path, "ckpt.pt")
        raise ConfigError(f"{path} is a folder, not a checkpoint: point {flag} at a checkpoint file"
                          + (f", e.g. {flag}={inside}" if os.path.isfile(inside) else ""))
    if not os.path.isfile(path):
        raise ConfigError(f"no checkpoint at {path}: train first, or point {flag} at a run")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects weights_only refuses
        raise ConfigError(f"{path} is not a readable checkpoint ({type(e).__name__}): "
                          f"delete it and train again, or point at another run") from None
    if not isinstance(ckpt, dict) or not {"model", "config", "meta"} <= ckpt.keys():
        raise ConfigError(f"{path} is not a specgpt checkpoint (no model, config and meta): point at a train.py run")
    return ckpt


def load_weights(model, ckpt, path):
    """ckpt's weights into model, or a one-line error naming the first key that does not fit (missing, extra, or of
    another shape: both shapes) and how many more do not."""
    saved, own = ckpt["model"], model.state_dict()
    misfits = [f"{key} is missing there" for key in own if key not in saved]
    misfits += [f"{key} is not in this model" for key in saved if key not in own]
    misfits += [f"{key} is {list(saved[key].shape)} there, {list(own[key].shape)} here" for key in own
                if key in saved and tuple(saved[key].shape) != tuple(own[key].shape)]
    if misfits:
        more = f" (and {len(misfits) - 1} more)" if len(misfits) > 1 else ""
        raise ConfigError(f"the weights in {path} do not fit this model: {misfits[0]}{more}: train again with this "
                          f"version of model.py, or load it with the model it was trained with")
    model.load_state_dict(saved)


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
        save_checkpoint(path, {
            "model": raw_model.state_dict(), "optimizer": opt.state_dict(), "config": settings, "meta": meta,
            "sampler": samplers, "rng": {"torch": torch.get_rng_state(),
                                         "cuda": torch.cuda.get_rng_state() if cuda else None}, **progress})
        if progress["iter_num"] >= 1:  # a new run's first trained checkpoint: the run it replaces goes
            drop_replaced_run(os.path.dirname(path))



# ----------------------------------------------------------------------------------------------------
# exports: a checkpoint's model as safetensors, for --init_from=DIR and (GPT-2's architecture) transformers

def export_checkpoint(ckpt_path, folder):
    """python train.py --export=DIR: the model of the checkpoint at ckpt_path written into folder as model.safetensors
    + config.json (model.exported_files: transformers' GPT-2 layout with specgpt's keys beside its config where
    transformers can hold the model, else specgpt's own) + meta.json (the tokenizer's meta), each file atomically.
    Returns the line to print: what was written, and the key transformers cannot hold, if any."""
    from safetensors.torch import save
    ckpt = load_checkpoint(ckpt_path)
    gpt = model.GPT(model.GPTConfig.from_dict({**ckpt["config"], "vocab_size": ckpt["meta"]["vocab_size"]}))
    load_weights(gpt, ckpt, ckpt_path)
    data.check_writable_folder(folder, "export")
    make_folder(folder, "export")
    config, tensors = model.exported_files(gpt)
    data.atomic_write_bytes(os.path.join(folder, "model.safetensors"), save(tensors, metadata={"format": "pt"}))
    data.atomic_write_bytes(os.path.join(folder, "meta.json"), json.dumps(ckpt["meta"], indent=1).encode())
    data.atomic_write_bytes(os.path.join(folder, "config.json"), json.dumps(config, indent=1).encode())
    unheld = model.gpt2_unholdable(gpt.config)
    return (f"exported {ckpt_path} to {folder} (model.safetensors, config.json, meta.json): load it with "
            f"--init_from={folder}" + (f"; transformers' GPT2LMHeadModel.from_pretrained({folder!r}) too" if not unheld
                                       else f"; not in transformers' GPT-2 layout, which cannot hold {unheld}"))


def pretrained_meta(source):
    """The tokenizer's meta of a pretrained model (train.py's and analyze.py's --init_from): meta.json in an exported
    folder, else GPT-2's BPE, which every GPT-2 (a name or a folder saved by transformers) reads."""
    path = os.path.join(source, "meta.json")
    if os.path.isdir(source) and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {"tokenizer": "gpt2", **data.GPT2Tokenizer().meta()}


if __name__ == "__main__":
    # python runs.py [out_dir]: what the run in out_dir holds
    args = sys.argv[1:]
    try:
        if args[:1] in (["-h"], ["--help"]):
            print(__doc__)
            sys.exit(0)
        extra = [a for a in args if a.startswith("-")] + args[1:]
        if extra:
            raise ConfigError(f"unexpected argument {extra[0]!r}: python runs.py [out_dir] (python runs.py --help)")
        out_dir = args[0] if args else "out"
        ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
        config = ckpt["config"]
        print(f"{out_dir}: iter {ckpt.get('iter_num')}, val loss {ckpt.get('val_loss', math.nan):.4f} (best "
              f"{ckpt.get('best_val_loss', math.nan):.4f}); {config.get('dataset')}, mixer {config.get('mixer')}, "
              f"optimizer {config.get('optimizer')}, vocab {ckpt['meta'].get('vocab_size')}")
        rows, dropped = read_jsonl(os.path.join(out_dir, "log.jsonl"))
        print(f"log.jsonl: {len(rows)} rows, {sum('val' in row for row in rows)} of them evals"
              + "".join(f"; {count} line{'s' * (count > 1)} {why}" for why, count in dropped.items()))
        holder = lock_holder(os.path.join(out_dir, ".lock"))
        print(f"in use by {holder}" if holder else "no process holds its lock")
    except ValueError as e:  # bad input: one line that says what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
