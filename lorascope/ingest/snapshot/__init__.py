"""PyTorch allocator snapshots (``torch.cuda.memory._dump_snapshot`` pickles): reading, replay to the peak, cross-rank comparison."""
