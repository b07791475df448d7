"""MemoryCache: immediate grants, FIFO waiting, timeouts, the whole-budget limit, cancellation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from petals_core._errors import AllocationFailed, ConfigError
from petals_core.server._memory_cache import MemoryCache, MemoryCacheStatistics


async def test_grant_at_once_and_free_on_exit() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=10.0)
    with trio.fail_after(10):
        async with cache.allocate(60) as grant:
            assert grant.nbytes == 60
            assert grant.waited_s == 0
            assert cache.bytes_left == 40
            async with cache.allocate(40):
                assert cache.bytes_left == 0
            assert cache.bytes_left == 40
    assert cache.statistics() == MemoryCacheStatistics(
        max_bytes=100, bytes_used=0, bytes_left=100, active=0, waiting=0, granted=2, failed=0
    )


async def test_error_in_block_frees_the_bytes() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=10.0)
    with pytest.raises(KeyError):
        async with cache.allocate(70):
            raise KeyError("boom")
    assert cache.bytes_left == 100
    assert cache.statistics().active == 0


async def test_more_than_the_whole_budget_fails_at_once() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=10.0)
    start = trio.current_time()
    with pytest.raises(AllocationFailed, match=r"requested 101 bytes.*budget of 100 bytes"):
        async with cache.allocate(101, timeout_s=5.0):
            pytest.fail("must not be granted")
    assert trio.current_time() - start < 5.0
    assert cache.statistics().failed == 1
    assert cache.bytes_left == 100


async def test_zero_budget_fails_everything_at_once() -> None:
    cache = MemoryCache(0, max_alloc_timeout_s=10.0)
    with pytest.raises(AllocationFailed, match="budget of 0 bytes"):
        async with cache.allocate(1):
            pytest.fail("must not be granted")


async def test_waiters_are_served_in_arrival_order() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=60.0)
    order: list[str] = []
    done = {"big": trio.Event(), "small": trio.Event()}

    async def take(name: str, nbytes: int) -> None:
        async with cache.allocate(nbytes, timeout_s=60.0):
            order.append(name)
            await done[name].wait()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            holder = trio.CancelScope()

            async def hold() -> None:
                with holder:
                    async with cache.allocate(60):
                        await trio.sleep_forever()

            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            # The big one waits at the head; the small one would fit (40 free) but queues behind
            # it, so a stream of small requests cannot starve a big one.
            nursery.start_soon(take, "big", 90)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "small", 20)
            await trio.testing.wait_all_tasks_blocked()
            stats = cache.statistics()
            assert (stats.waiting, stats.bytes_left, order) == (2, 40, [])

            holder.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["big"]
            assert (cache.statistics().bytes_used, cache.statistics().waiting) == (90, 1)

            done["big"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["big", "small"]
            done["small"].set()
    assert cache.statistics() == MemoryCacheStatistics(
        max_bytes=100, bytes_used=0, bytes_left=100, active=0, waiting=0, granted=3, failed=0
    )


async def test_wait_times_out_with_the_free_bytes_and_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=2.0)
    async with cache.allocate(80):
        start = trio.current_time()
        # The server's cap (2 s) wins over the caller's 100 s.
        with pytest.raises(AllocationFailed, match=r"only 20 of 100 bytes were free.*2\.000 s"):
            async with cache.allocate(50, timeout_s=100.0):
                pytest.fail("must not be granted")
        assert trio.current_time() - start == pytest.approx(2.0)
        # The caller's shorter timeout wins over the cap.
        with pytest.raises(AllocationFailed, match=r"0\.500 s"):
            async with cache.allocate(50, timeout_s=0.5):
                pytest.fail("must not be granted")
        # Timeout 0 fails at once.
        start = trio.current_time()
        with pytest.raises(AllocationFailed, match="only 20 of 100"):
            async with cache.allocate(50, timeout_s=0):
                pytest.fail("must not be granted")
        assert trio.current_time() == start
    stats = cache.statistics()
    assert (stats.failed, stats.waiting, stats.bytes_used) == (3, 0, 0)


async def test_zero_cap_fails_at_once_when_it_does_not_fit() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=0.0)
    async with cache.allocate(100):
        with pytest.raises(AllocationFailed):
            async with cache.allocate(1, timeout_s=60.0):
                pytest.fail("must not be granted")


async def test_cancel_while_waiting_leaves_no_trace() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=60.0)
    granted: list[str] = []
    with trio.fail_after(10):
        async with cache.allocate(60), trio.open_nursery() as nursery:
            head = trio.CancelScope()

            async def wait_at_head() -> None:
                with head:
                    async with cache.allocate(50):
                        granted.append("head")

            async def wait_behind() -> None:
                async with cache.allocate(30):
                    granted.append("behind")

            nursery.start_soon(wait_at_head)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait_behind)
            await trio.testing.wait_all_tasks_blocked()
            assert cache.statistics().waiting == 2
            # With the head gone, the one behind it fits and is granted at once.
            head.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert granted == ["behind"]
    assert cache.statistics() == MemoryCacheStatistics(
        max_bytes=100, bytes_used=0, bytes_left=100, active=0, waiting=0, granted=2, failed=0
    )


async def test_invalid_arguments() -> None:
    with pytest.raises(ConfigError):
        MemoryCache(-1, max_alloc_timeout_s=1.0)
    with pytest.raises(ConfigError):
        MemoryCache(10, max_alloc_timeout_s=-1.0)
    cache = MemoryCache(10, max_alloc_timeout_s=1.0)
    with pytest.raises(ValueError, match="nbytes"):
        async with cache.allocate(-1):
            pytest.fail("must not be granted")
