# config/gpt2_small_fineweb.py with three Gated DeltaNet-2 layers to each attention layer ("GGGA": attention at
# layers 4, 8 and 12) at the same parameter count and depth: a G layer holds 8 d^2 weights to attention's 4 d^2,
# so the width goes from 768 to 704 (11 heads of 64): 124.7M parameters against 123.6M (+0.9%).
# The mixer: Gated DeltaNet-2 (Hatamizadeh, Choi & Kautz 2026, arXiv 2605.22791), the gated delta rule with
# decoupled erase and write gates, per key and per value channel. Three linear layers to one of softmax attention
# is the ratio of Qwen3-Next (Gated DeltaNet, Qwen team 2025) and Kimi Linear (KDA, Kimi team 2025, arXiv
# 2510.26692); in the Gated DeltaNet-2 paper, a hybrid with sliding-window attention lifts real-world recall (6 tasks,
# 1.3B parameters) from 29.9 to 42.3. Data, tokens and recipe are the attention model's, so the val losses compare.
#   python train.py config/gpt2_small_fineweb_hybrid.py --dry_run=True
#   python train.py config/gpt2_small_fineweb_hybrid.py
out_dir = "out-gpt2-small-fineweb-hybrid"
dataset = "data/fineweb10B/fineweb_train_*.bin"   # validation: the fineweb_val_* file beside them
vocab_multiple = 64            # 50257 tokens -> 50304 embedding rows, a multiple of 64 for the GPU's matmuls
n_layer = 12
n_head = 11                    # heads of 64, in attention and in Gated DeltaNet-2
n_embd = 704
block_size = 1024
mixer = "GGGA"                 # G G G A, three times
batch_size = 16                # sequences a micro-step: ~19 GiB of activations by the dry run's formula
gradient_accumulation_steps = 32   # 32 x 16 x 1024 = 524,288 tokens a step
max_iters = 5100
# the record's schedule: no warmup, constant, then linear to 0 over the last 1450 steps
schedule = "wsd"
warmup_iters = 0
wsd_decay_frac = 1450 / 5100
min_lr = 0.0
# Muon's step on a block matrix is lr * 0.2 * sqrt(max(rows, cols)) * msign(momentum): 0.00036 * sqrt(max(rows,
# cols)), the record's; its quintic Newton-Schulz; momentum 0.95 (nesterov), no weight decay
optimizer = "muon"
muon_scale = "moonlight"
learning_rate = 0.0018
ns_coeffs = "jordan"
momentum = 0.95
weight_decay = 0.0
aux_lr = 0.0036                # AdamW on the embedding (tied to the head) and the norm gains, betas (0.9, 0.95)
beta1 = 0.9
beta2 = 0.95
eval_interval = 250
eval_iters = 640               # 640 x 16 x 1024 = 10,485,760 validation tokens, the record's count
log_interval = 10
