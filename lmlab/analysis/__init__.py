"""Runs read back: evaluation, sampling, comparisons and their statistics, scaling fits and ladders, one reader per
study, the lm-eval harness bridge. The top wing: it reads what `lmlab.record` kept and may use `lmlab.run`'s pieces."""
