# The baby model at nanoGPT's GPU scale, on specgpt's Shakespeare (5.06M characters, 5x nanoGPT's): the sizes and
# schedule of nanoGPT's config/train_shakespeare_char.py (6 layers x 384, 6 heads, block 256, batch 64, dropout
# 0.2, 5000 steps, 100 warmup, evals of 200 batches every 250 steps), with the CPU default's own architecture
# (the MAAA mixer, QK-norm) and optimizer (Muon on the blocks' matrices). 82M tokens.
#   python train.py config/shakespeare_char_gpu.py --dry_run=True    # size, memory, estimated time
#   python train.py config/shakespeare_char_gpu.py
out_dir = "out-shakespeare-char-gpu"
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
dropout = 0.2
batch_size = 64
max_iters = 5000
warmup_iters = 100
eval_interval = 250
eval_iters = 200
log_interval = 10
