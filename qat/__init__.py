"""Quantization-aware training (FakeQuantize insertion, fp32 → fp16 → int8 schedule) and PTQ.

Registered through the `pruneflow.stages` entry point like any plugin; the core never imports it.
"""
