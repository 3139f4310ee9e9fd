"""Sources of the memory model's points besides real trials.

A training step traced on fake tensors and replayed through a model of the caching allocator.
"""
