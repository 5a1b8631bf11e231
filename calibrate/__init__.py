"""Calibration-set building from real data, and writers for each consumer.

Registered through the `pruneflow.stages` entry point like any plugin; the core never imports it.
"""
