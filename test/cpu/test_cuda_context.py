"""The scheduler process's early CUDA context: which GPU it opens, and that a machine without
a CUDA driver (this CPU suite's) leaves the thread quietly."""

from __future__ import annotations

import threading

import pytest

from replaylm.device.cuda_context import cuda_device_index, open_in_background


@pytest.mark.parametrize(
    ("device", "tp_size", "tp_rank", "ranks_per_node", "index"),
    [
        ("cpu", 1, 0, 1, None),
        ("auto", 1, 0, 1, 0),
        ("cuda", 1, 0, 1, 0),
        ("cuda:3", 1, 0, 1, 3),
        ("cuda", 4, 2, 4, 2),  # one GPU per rank of a node, as ModelRunner places ranks
        ("cuda", 4, 3, 2, 1),  # the second node's second rank
        ("cpu", 2, 1, 2, None),
    ],
)
def test_the_gpu_is_the_one_the_runner_uses(device, tp_size, tp_rank, ranks_per_node, index):
    assert cuda_device_index(device, tp_size, tp_rank, ranks_per_node) == index


def test_without_a_driver_the_thread_ends_quietly():
    errors: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        thread = open_in_background(0)
        thread.join(timeout=30)
    finally:
        threading.excepthook = hook
    assert not thread.is_alive()
    assert thread.daemon
    assert errors == []
