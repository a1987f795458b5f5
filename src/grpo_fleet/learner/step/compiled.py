"""mx.compile for the Trainer's gradient and update functions, with a bounded number of traced shapes."""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from grpo_fleet.learner.step.batch import MicroBatch

# Compiled traces kept per Trainer; each holds a graph, not activations.
MAX_COMPILED_SHAPES = 32
# (loss, statistics, the loss's policy logprobs as a list of none or one, gradients)
GradsFn = Callable[[MicroBatch, Optional[mx.array], mx.array], tuple[mx.array, dict, list[mx.array], dict]]


def micro_arrays(micro: MicroBatch) -> tuple[mx.array, ...]:
    """The array fields of a micro-batch, in `MicroBatch`'s order (for compiled calls); pi_prox only when set."""
    arrays = (micro.inputs, micro.positions, micro.targets, micro.layout, micro.mask, micro.old_logprobs, micro.advantages)
    return arrays if micro.proximal_logprobs is None else (*arrays, micro.proximal_logprobs)


class CompiledUpdate:
    """Gradients (with and without pi_ref) and the update under mx.compile.

    State is declared as inputs/outputs so the graphs read the live weights and
    update the optimizer in place. The reference forward stays outside: it swaps
    LoRA arrays, and compiled graphs freeze attributes such as `scale`.
    """

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, grads: GradsFn,
                 apply: Callable[[dict, mx.array], mx.array], max_shapes: int = MAX_COMPILED_SHAPES) -> None:
        # Weights are outputs too: value_and_grad sets traced arrays on the model while
        # tracing, and only declared outputs are written back with real ones.
        reads = [model.state, mx.random.state]

        def with_ref(totals: mx.array, ref: mx.array, *arrays: Any) -> Any:
            return grads(MicroBatch(*arrays), ref, totals)

        def without_ref(totals: mx.array, *arrays: Any) -> Any:
            return grads(MicroBatch(*arrays), None, totals)

        updates = [model.state, optimizer.state]
        self._with_ref = mx.compile(with_ref, inputs=reads, outputs=reads)
        self._without_ref = mx.compile(without_ref, inputs=reads, outputs=reads)
        self.apply = mx.compile(apply, inputs=updates, outputs=updates)
        self.max_shapes = max_shapes
        self.shapes: set[tuple] = set()  # micro-batch shape signatures traced so far

    def grads(self, micro: MicroBatch, ref: Optional[mx.array], totals: mx.array) -> Optional[tuple]:
        """The compiled gradients, or None when this shape would need a trace past the budget (run eager)."""
        if not self._may_trace(micro, ref):
            return None
        if ref is None:
            return self._without_ref(totals, *micro_arrays(micro))
        return self._with_ref(totals, ref, *micro_arrays(micro))

    def _may_trace(self, micro: MicroBatch, ref: Optional[mx.array]) -> bool:
        """Already traced, or room for one more trace.

        mx.compile traces once per input-shape signature and keeps every graph.
        Widths are bucketed but row counts are not, so a long run could collect
        graphs without end; past `max_shapes` new shapes run eager.
        """
        signature = (ref is None, *(array.shape for array in micro_arrays(micro)))
        if signature in self.shapes:
            return True
        if len(self.shapes) >= self.max_shapes:
            return False
        self.shapes.add(signature)
        return True
