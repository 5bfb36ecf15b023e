# GPT-2 small (12 layers x 768, 12 heads of 64, context 1024: 124M parameters) on FineWeb10B, trained with the
# recipe of modded-nanogpt's 14 Oct 2024 record (RoPE, QK-norm, ReLU², Muon on the blocks' matrices, AdamW on the
# tied embedding: val loss 3.274 after 5100 steps of 2^19 tokens). 5100 x 524,288 = 2.67B tokens, 21.6 a
# parameter: about Chinchilla's compute-optimal 20 (Hoffmann et al. 2022, "Training Compute-Optimal LLMs").
#   python data.py fineweb10B --shards=27     # the validation shard and 27 training shards, ~2.7B tokens
#   python train.py config/gpt2_small_fineweb.py --dry_run=True
#   python train.py config/gpt2_small_fineweb.py
# Paths are relative: run from the repository folder. On n GPUs (torchrun --nproc_per_node=n) divide
# gradient_accumulation_steps by n, which keeps 524,288 tokens a step.
out_dir = "out-gpt2-small-fineweb"
dataset = "data/fineweb10B/fineweb_train_*.bin"   # validation: the fineweb_val_* file beside them
vocab_multiple = 64            # 50257 tokens -> 50304 embedding rows, a multiple of 64 for the GPU's matmuls
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
mixer = "A"
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
