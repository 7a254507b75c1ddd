"""The user's training script of benchmarks/clean_exit.py, as users write one: module-level
globals, ``auto_parallelize`` on a tiny transformers Llama (planned for ``local-cpu:N``), a
few SGD steps, and nothing else: no ``close()``, no ``destroy_process_group``, no ``os._exit``.
``torchrun --nproc-per-node 2 benchmarks/clean_exit_script.py [steps]``."""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import planner

torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False))
ids = torch.randint(0, 128, (8, 32))
par = planner.auto_parallelize(model, {"input_ids": ids, "labels": ids},
                               cluster=f"local-cpu:{os.environ.get('WORLD_SIZE', '1')}",
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    loss = par.step({"input_ids": ids, "labels": ids})
