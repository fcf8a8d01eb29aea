"""The KV bookkeeping check that ends a scheduler scenario: with every request gone, nothing is
held. The prefix cache keeps finished requests' tokens (unlocked, evictable); flushing it must
give the allocator back every slot, and every request-table row must be free."""

from __future__ import annotations

from replaylm.entrypoints.engine import Engine


def assert_kv_released(engine: Engine) -> None:
    scheduler, runner = engine.scheduler, engine.runner
    assert not scheduler.has_work
    tree = scheduler.prefix_cache.tree
    if tree is not None:
        assert tree.protected_size == 0  # no request holds a cached prefix
        assert tree.total_size + runner.kv.allocator.available_size() == runner.kv.size
        scheduler.prefix_cache.flush()
        assert tree.total_size == 0
    assert runner.kv.allocator.available_size() == runner.kv.size
    assert runner.kv.req_to_token.available_size() == engine.server_args.max_running_requests
