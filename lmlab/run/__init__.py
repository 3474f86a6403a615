"""One training run: its resolved plan and checks, the Lightning module, the monitor and its figures, signals and
resume, progress, FSDP2. It writes through `lmlab.record` and never imports `lmlab.analysis`."""
