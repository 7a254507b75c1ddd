"""Worker for tests/test_adapters.py: ``auto_parallelize`` on a transformers Llama under torchrun
(or one plain process). Every process builds the model with its own random weights (the
runtime starts all replicas from rank 0's); rank 0 writes the plan label and the losses
of 3 SGD steps on a fixed batch (labels = input_ids: the model shifts them) as JSON."""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import planner

world = int(os.environ.get("WORLD_SIZE", "1"))
torch.manual_seed(int(os.environ.get("RANK", "0")))  # deliberately different weights per process ...
model = AutoModelForCausalLM.from_config(LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False))
torch.manual_seed(0)  # ... and the same data
ids = torch.randint(0, 128, (8, 32))
batch = {"input_ids": ids, "labels": ids}
par = planner.auto_parallelize(model, batch, cluster=f"local-cpu:{world}",
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
losses = [par.step(batch) for _ in range(3)]
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"label": par.plan.config.label(), "losses": losses}, f)
par.close()  # the build's groups and the default group auto_parallelize created; the script ends normally
