"""Triton kernels with a plain-torch fallback each, checked against a torch reference: flash
attention (forward, dK/dV and dQ; causal, GQA, packed documents, ring offsets: ``attention``,
fallback ``attention_torch``) and the fused lm-head + cross-entropy loss that never holds the
[tokens x vocab] logits (``fused_loss``). Leaf modules: they import only torch and triton.
"""
