"""Variable-length data: the length scan, longest-first drawing for trials, and ``TokenBudgetSampler``."""
