# nanoGPT's finetune: OpenAI's GPT-2 (124M; its weights through huggingface_hub, or a folder of them) trained further
# on specgpt's Shakespeare in GPT-2 tokens, with a small constant learning rate for a few steps: 20 steps of 32
# sequences of 1024 tokens (655k tokens), AdamW at 3e-5, an eval of 40 sequences every 5 steps. For gpt2-xl (1558M),
# as nanoGPT's preset, add --init_from=gpt2-xl on a GPU. On a CPU, the smallest run that finishes in minutes is in
# the README (GPT-2 itself, fewer and shorter sequences).
#   python train.py config/finetune_shakespeare.py --dry_run=True    # size, memory, estimated time
#   python train.py config/finetune_shakespeare.py
#   python train.py config/finetune_shakespeare.py --init_from=resume   # continue it
out_dir = "out-shakespeare-finetune"
init_from = "gpt2"
dataset = "shakespeare"
optimizer = "adamw"
learning_rate = 3e-5
min_lr = 3e-5
warmup_iters = 0
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20
eval_interval = 5
eval_iters = 40
log_interval = 1
start = "ROMEO:"
