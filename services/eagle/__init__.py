"""EAGLE heads: the training data (ShareGPT conversations), the training loop with training-time test, and the
held-out acceptance estimate measured as serving drafts. The head itself is services/modeling/eagle_head.py."""
