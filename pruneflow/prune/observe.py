"""Running a model to look at it: eval mode with forward hooks attached, both undone afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle


@contextlib.contextmanager
def observing(model: nn.Module, handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """``model`` in eval mode with ``handles`` (hooks already registered on its modules) attached; on the way out, the
    mode it had and no hooks, whatever happened inside.

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
        with observing(model, handles):
            call(model, example)
    """
    handles = list(handles)
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
        for h in handles:
            h.remove()
