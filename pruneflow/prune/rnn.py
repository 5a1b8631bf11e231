"""Hidden units of ``nn.GRU``, ``nn.LSTM`` and ``nn.RNN`` as prunable channels (plain torch; ``tp_adapter.py``
registers the pruner with torch-pruning).

A recurrent layer of hidden size H stacks its gates along the rows of every weight: ``weight_ih_l{k}`` is
``[G*H, in]``, ``weight_hh_l{k}`` ``[G*H, H]``, the biases ``[G*H]``, with G = 3 for a GRU (reset, update, new),
4 for an LSTM (input, forget, cell, output) and 1 for a plain RNN. Hidden unit j owns rows j, H+j, ... (G-1)H+j
of each of them, column j of ``weight_hh_l{k}`` (what the unit feeds back into every gate) and, for layers
above the first, column j of ``weight_ih_l{k}`` (what it feeds the next layer). Removing a unit removes all of
them at once, so every gate keeps the same units; torch-pruning 1.6.1's ``LSTMPruner`` does not (it cuts
``weight_hh`` twice on the same rows and ``weight_ih``'s columns with the row indices) and it has nothing
for a GRU.

``hidden_size`` is shared by all layers (and both directions) of the module, so unit j goes from every layer
together. A unit whose rows are all zero stays zero from a zero initial state (GRU: n = tanh(0) = 0, h = z*h;
LSTM: g = tanh(0) = 0, so c and h stay 0) and feeds nothing, so removing it changes no output: the test of this
surgery, and what ``fade`` relies on.

Bidirectional modules (the consumer reads 2H channels, half from each direction) and LSTMs with ``proj_size``
(the output is a projection of the units) are kept whole: :func:`unsupported` says why.
"""

from __future__ import annotations

import torch
from torch import nn

#: Gates stacked along the rows of a recurrent layer's weights, by ``nn.RNNBase.mode``.
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

#: One slice of a parameter that a set of units owns: (parameter name, dimension, indices along it).
Slice = tuple[str, int, torch.Tensor]


def gates(rnn: nn.RNNBase) -> int:
    return _GATES[rnn.mode]


def unsupported(rnn: nn.RNNBase) -> str | None:
    """Why the module's hidden units cannot be pruned here (None: they can)."""
    if rnn.bidirectional:
        return "bidirectional (its consumer reads the units of both directions side by side)"
    if getattr(rnn, "proj_size", 0):
        return "an LSTM with proj_size (its output is a projection of the units)"
    return None


def _device(rnn: nn.RNNBase) -> torch.device:
    return next(rnn.parameters()).device


def _suffixes(rnn: nn.RNNBase) -> tuple[str, ...]:
    return ("", "_reverse") if rnn.bidirectional else ("",)


def unit_slices(rnn: nn.RNNBase, idxs: list[int]) -> list[Slice]:
    """Every parameter slice hidden units ``idxs`` own (rows of each gate, columns where they are read)."""
    hidden, device = rnn.hidden_size, _device(rnn)
    units = torch.as_tensor(sorted(idxs), dtype=torch.long, device=device)
    rows = torch.cat([units + k * hidden for k in range(gates(rnn))])
    out: list[Slice] = []
    for layer in range(rnn.num_layers):
        for suffix in _suffixes(rnn):
            tail = f"l{layer}{suffix}"
            out += [(f"weight_ih_{tail}", 0, rows), (f"weight_hh_{tail}", 0, rows), (f"weight_hh_{tail}", 1, units)]
            if layer > 0:
                out.append((f"weight_ih_{tail}", 1, units))  # the layer below's units, read by this one
            if rnn.bias:
                out += [(f"bias_ih_{tail}", 0, rows), (f"bias_hh_{tail}", 0, rows)]
    return out


def input_slices(rnn: nn.RNNBase, idxs: list[int]) -> list[Slice]:
    """The columns of the first layer's input weights that input features ``idxs`` meet."""
    cols = torch.as_tensor(sorted(idxs), dtype=torch.long, device=_device(rnn))
    return [(f"weight_ih_l0{suffix}", 1, cols) for suffix in _suffixes(rnn)]


def _remove(rnn: nn.RNNBase, slices: list[Slice]) -> None:
    """Drop every slice; each parameter is rebuilt once per dimension (setattr keeps ``_flat_weights`` in step)."""
    for name, dim, idx in slices:
        param = getattr(rnn, name)
        keep = torch.ones(param.shape[dim], dtype=torch.bool, device=param.device)
        keep[idx] = False
        kept = param.detach().index_select(dim, keep.nonzero().flatten()).clone()
        setattr(rnn, name, nn.Parameter(kept, requires_grad=param.requires_grad))


def prune_hidden(rnn: nn.RNNBase, idxs: list[int]) -> nn.RNNBase:
    """Remove hidden units ``idxs`` from every layer and gate of ``rnn`` (its consumers are torch-pruning's job)."""
    if len(set(idxs)) >= rnn.hidden_size:
        raise ValueError(f"cannot remove all {rnn.hidden_size} hidden units")
    _remove(rnn, unit_slices(rnn, idxs))
    rnn.hidden_size -= len(set(idxs))
    return rnn


def prune_input(rnn: nn.RNNBase, idxs: list[int]) -> nn.RNNBase:
    """Remove input features ``idxs`` (their producer lost those channels)."""
    _remove(rnn, input_slices(rnn, idxs))
    rnn.input_size -= len(set(idxs))
    return rnn


def unit_saliency(rnn: nn.RNNBase, saliency: dict[str, torch.Tensor], role: str, idxs: list[int]) -> torch.Tensor | None:
    """Per-unit (``role`` "out") or per-input-feature ("in") sums of a saliency tensor over the slices they own
    (``unit_slices``, ``input_slices``), in sorted ``idxs`` order; ``saliency`` is keyed by the module's own
    parameter names (None: none of them is scored)."""
    g, hidden = gates(rnn), rnn.hidden_size
    first = {f"weight_ih_l0{suffix}" for suffix in _suffixes(rnn)}
    parts = []
    for name, s in saliency.items():
        if role == "in":
            parts += [s.sum(0)] if name in first else []
            continue
        parts.append(s.reshape(g, hidden, -1).sum((0, 2)))  # a unit's row in every gate
        if name.startswith("weight_hh") or (name.startswith("weight_ih") and name not in first):
            parts.append(s.sum(0))  # its column: what it feeds back (hh) or up to the next layer (ih)
    if not parts:
        return None
    return torch.stack(parts).sum(0)[sorted(idxs)]


def unit_cost(rnn: nn.RNNBase, role: str, steps: int) -> float:
    """MACs one hidden unit (``role`` "out") or one input feature ("in") costs over ``steps`` time steps."""
    g, hidden, layers = gates(rnn), rnn.hidden_size, rnn.num_layers
    if role == "in":
        return float(g * hidden * steps)
    rows = g * (rnn.input_size + hidden) + (layers - 1) * g * 2 * hidden  # its rows of weight_ih and weight_hh
    cols = layers * g * hidden + (layers - 1) * g * hidden  # its column of weight_hh, and of the next layer's weight_ih
    return float((rows + cols) * steps)
