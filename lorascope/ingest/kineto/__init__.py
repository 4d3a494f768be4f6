"""Kineto Chrome-trace JSON (``torch.profiler`` exports): reading, HTA figures, cross-rank comparison."""
