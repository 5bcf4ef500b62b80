"""The pipeline schedules' program order: the spec of what each stage runs, in order.

``program_order`` is 1F1B (Megatron-Core's ``forward_backward_pipelining_without_interleaving``);
``interleaved_program_order`` is interleaved 1F1B with ``V`` virtual stages (model chunks)
per stage. fastgrad's schedules and the ``verify simulate-pipeline`` simulator are tested
against these lists.
"""

from __future__ import annotations


def program_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """1F1B program order of one stage: ``warmup = min(P - s - 1, M)`` forwards, then
    one-forward-one-backward, then the cooldown backwards (derived independently of fastgrad)."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order: list[tuple[str, int]] = [("F", i) for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < num_microbatches:
        order.append(("F", next_forward))
        order.append(("B", next_backward))
        next_forward += 1
        next_backward += 1
    while next_backward < num_microbatches:
        order.append(("B", next_backward))
        next_backward += 1
    return order


def validate_schedule_shape(num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
    """ValueError unless P, M, V are ints >= 1 and, with V > 1, M is a multiple of P."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if virtual_stages > 1 and num_microbatches % num_stages != 0:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) must be a multiple of num_stages "
            f"({num_stages}) with virtual_stages > 1 (microbatches pass through each chunk "
            "in groups of P)"
        )


def interleaved_program_order(
    num_stages: int, stage: int, num_microbatches: int, virtual_stages: int
) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B order of one stage, ``("F"|"B", chunk, microbatch)``, derived
    independently of fastgrad (the forward and backward sequences are built group by group)."""
    validate_schedule_shape(num_stages, num_microbatches, virtual_stages)
    P, V, M = num_stages, virtual_stages, num_microbatches
    forwards: list[tuple[str, int, int]] = []
    backwards: list[tuple[str, int, int]] = []
    for group_start in range(0, M, P):
        for c in range(V):
            forwards.extend(("F", c, group_start + j) for j in range(P))
            backwards.extend(("B", V - 1 - c, group_start + j) for j in range(P))
    warmup = min(2 * (P - stage - 1) + (V - 1) * P, M * V)
    order = forwards[:warmup]
    for f_op, b_op in zip(forwards[warmup:], backwards):
        order += [f_op, b_op]
    order += backwards[M * V - warmup:]
    return order
