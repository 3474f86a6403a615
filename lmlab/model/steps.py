"""Modules whose state follows the training step and the mode (an attention layer's window, RoPE's frequencies
under window_yarn): the mixin the training loop hands its step to. Its own module, below both attention/ and
position/, which use it."""

from __future__ import annotations


class FollowsStep:
    """For a module (mixed in before nn.Module) whose state is a function of the training step and the mode: an
    attention layer's window, RoPE's frequencies under window_yarn. The training loop hands it the step before each
    step and each validation (`set_step`; None after training), `train`/`eval` the mode; both call `_follow_step`,
    which reads `step_at` and `self.training`."""

    window_step: tuple[int, int] | None = None  # (step, max_steps) the schedule reads; None: after training

    def set_step(self, step: int | None, max_steps: int | None = None) -> None:
        """The training step the window schedule reads, of max_steps; None: after training (the model's own)."""
        self.window_step = None if step is None else (step, max_steps)
        self._follow_step()

    def train(self, mode: bool = True) -> FollowsStep:
        super().train(mode)  # type: ignore[misc]
        self._follow_step()  # attention.eval_window's stage when not training
        return self

    @property
    def step_at(self) -> tuple[int | None, int | None]:
        return self.window_step or (None, None)

    def _follow_step(self) -> None:
        raise NotImplementedError
