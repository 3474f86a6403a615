"""The config groups (YAML), a package so that Hydra finds them from an installed lmlab (`lmlab train`)."""
