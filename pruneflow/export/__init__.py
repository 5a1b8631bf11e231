"""Export targets, one module each; heavy imports happen inside the functions that need them.

A target reads the model through the run's handle: ``state.handle.float_module()`` for fp32/fp16
artifacts, ``state.handle.int8_module(example)`` for int8 ones (the model kind knows how to strip its
quantization backend), so nothing here imports one.
"""

