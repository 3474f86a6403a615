"""What the transformers interop refuses, and how it says so (shared by lmlab.interop.hf_config and hf_moe)."""

from __future__ import annotations

from typing import Any


class NotRepresentable(ValueError):
    """An lmlab architecture that transformers cannot represent exactly."""


def refuse(axis: str, value: Any, family: str, accepted: str) -> NotRepresentable:
    return NotRepresentable(f"{axis}={value!r} has no {family} form in transformers ({family} needs {accepted}); "
                            f"export refused rather than written as another architecture")
