"""What infer's harness calls on a method's runner (``infer.app.execute``): one base class in
place of probing each runner for what it has."""

from __future__ import annotations

import abc


class MethodRunner(abc.ABC):
    """A method's runner. ``timed``: its rows carry wall and forward times (False: counts only,
    the report predicts its speed); ``batched``: it has :meth:`generate_batch`."""

    timed = True
    batched = False

    @abc.abstractmethod
    def generate(self, prompt_ids, max_new_tokens: int, seed: int, eos_token_id) -> tuple[list[int], object, dict]:
        """Decode ``prompt_ids`` [1, L]: ``(output_ids, stats, extra)``; ``extra["forward_time_s"]``
        and ``extra["row"]`` (the method's own counts) go into the result row."""

    def warm_up(self, prompt_len: int, max_new_tokens: int, batch_size: int | None = None,
                progress: bool = False) -> float:
        """Compile or size what calls up to this long need, untimed; its seconds (0.0: a runner
        with nothing to prepare)."""
        return 0.0

    def generate_batch(self, prompts, max_new_tokens: int, seeds, eos_token_id, batch_size: int,
                       fill: bool = False):
        raise ValueError(f"batch_size={batch_size}: {type(self).__name__} decodes one prompt at a time; "
                         "use batch_size=1 for this method")
