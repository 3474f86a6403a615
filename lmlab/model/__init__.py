"""The GPT and its swappable parts, one file per axis. Plain PyTorch: nothing here knows Lightning or Hydra."""
