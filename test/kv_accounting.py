"""The KV bookkeeping check that ends a scheduler scenario: with every request gone, nothing is
held. The prefix cache keeps finished requests' tokens (unlocked, evictable); flushing it must
give the allocator back every slot, and every request-table row must be free."""

from __future__ import annotations

from replaylm.entrypoints.engine import Engine


def assert_kv_released(engine: Engine) -> None:
    scheduler, runner = engine.scheduler, engine.runner
    assert not scheduler.has_work
    tree = scheduler.kv.tree
    if tree is not None:
        assert tree.protected_size == 0  # no request holds a cached prefix
        assert tree.total_size + runner.token_allocator.available_size() == runner.max_total_tokens
        scheduler.kv.flush()
        assert tree.total_size == 0
    assert runner.token_allocator.available_size() == runner.max_total_tokens
    assert runner.req_to_token_pool.available_size() == engine.server_args.max_running_requests
