"""Quantization-aware training (FakeQuantize insertion, fp32 → fp16 → int8 schedule) and PTQ.

Registered through the `pruneflow.stages` entry point like any plugin; the core never imports it.
"""

import logging as _logging

# torchao (nncf.strip imports it) logs at import that its CUDA kernels ("_C_mxfp8", "_C_cutlass_90a") cannot
# load on a machine without CUDA, and torch logs a deprecation for each Enum torchao registers: noise on
# every run that a user can do nothing about. Errors still get through.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
