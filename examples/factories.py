"""Model factories for ``ddlc plan`` / ``ddlc schedule``: each returns
``(model, example_inputs, loss_fn)`` (``loss_fn`` None: the model returns its own loss, or
inference).

    python -m ddlc plan examples/factories.py:gpt_tiny --mesh 2x2
    python -m ddlc plan examples/factories.py:gpt_medium_4 --mesh 2x2 --profile dgx-h100-ib
    python -m ddlc plan examples/factories.py:gpt2_small --mesh 2x4 --profile dgx-h100-ib
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddlc.zoo import GPT, MLP, lm_loss


def _gpt(vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, batch: int):
    """A ddlc.zoo GPT with a batch of zero tokens (their values do not matter to the plan)."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d_model=d_model, n_heads=n_heads, n_layers=n_layers, seq_len=seq_len)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    return model, (tokens, tokens), lm_loss


def gpt_tiny():
    """GPT, 2 layers of width 32, vocabulary 64, sequence 16, batch 8."""
    return _gpt(64, 32, 4, 2, 16, 8)


def gpt_small_4():
    """GPT, 4 layers of width 64, vocabulary 256, sequence 32, batch 8."""
    return _gpt(256, 64, 4, 4, 32, 8)


def gpt_medium_4():
    """GPT, 4 layers of width 256, vocabulary 1024, sequence 128, batch 16 (on a GPU node,
    large enough that distributing it is modeled faster than running it whole on every
    device; ``gpt_small_4`` is not)."""
    return _gpt(1024, 256, 8, 4, 128, 16)


def gpt2_small():
    """GPT-2 small's shape: 12 layers, hidden 768, 12 heads, vocabulary 50304, sequence
    1024, batch 8. The plan depends on shapes only, so the weights are left uninitialised
    (built on the meta device, then given empty CPU storage): random initialisation of
    124 M parameters would take seconds. Only the position buffer gets its values."""
    with torch.device("meta"):
        model = GPT(vocab=50304, d_model=768, n_heads=12, n_layers=12, seq_len=1024)
    model.to_empty(device="cpu")
    model.positions.copy_(torch.arange(1024))
    tokens = torch.zeros(8, 1024, dtype=torch.long)
    return model, (tokens, tokens), lm_loss


def mlp():
    """MLP 32-64-16, batch 8, mean squared error."""
    torch.manual_seed(0)
    return MLP(), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss


def mlp_deep():
    """MLP 32-64-64-64-16 (two identical hidden layers), batch 8, mean squared error."""
    torch.manual_seed(0)
    return MLP(depth=4), (torch.randn(8, 32), torch.randn(8, 16)), F.mse_loss


def mlp_inference():
    """The MLP's forward pass alone (no loss)."""
    model, (x, _), _ = mlp()
    return model, (x,), None
