"""What a run leaves and how it is read back safely: the run directory and its lock, summary.json, metrics.csv, the
trackers (W&B, TensorBoard), the targets a run is judged by, plots and tables, the sharded-checkpoint reader. It never
imports `lmlab.run` (the training run) or `lmlab.analysis`: a record is readable without the code that trains."""
