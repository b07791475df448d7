"""MemoryCache: immediate grants of what fits, waiting in arrival order, timeouts, the
whole-budget limit, cancellation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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


class Holders:
    """Requests made in tasks of ``nursery``, each holding its grant until released."""

    def __init__(self, cache: MemoryCache, nursery: trio.Nursery) -> None:
        self.cache = cache
        self.nursery = nursery
        #: Names of the requests granted, in the order their tasks ran (trio runs the tasks
        #: woken at once in any order).
        self.granted: list[str] = []
        self._release: dict[str, trio.Event] = {}

    async def request(self, name: str, nbytes: int) -> None:
        """Make the request and return once it is granted or waits."""
        self._release[name] = trio.Event()
        self.nursery.start_soon(self._hold, name, nbytes)
        await trio.testing.wait_all_tasks_blocked()

    async def release(self, name: str) -> None:
        """Free the request's bytes and return once the waiters it lets in are granted."""
        self._release[name].set()
        await trio.testing.wait_all_tasks_blocked()

    async def _hold(self, name: str, nbytes: int) -> None:
        async with self.cache.allocate(nbytes, timeout_s=60.0):
            self.granted.append(name)
            await self._release[name].wait()


@asynccontextmanager
async def holders_of(cache: MemoryCache) -> AsyncIterator[Holders]:
    """:class:`Holders` of ``cache``; the block waits for every request to end."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            yield Holders(cache, nursery)


async def test_a_request_that_fits_is_granted_while_a_larger_one_waits() -> None:
    """A large request waiting for room holds up no smaller one: as bytes come free, each waiter
    that fits is granted, in arrival order, while the large one goes on waiting."""
    cache = MemoryCache(100, max_alloc_timeout_s=60.0)
    async with holders_of(cache) as holders:
        await holders.request("held", 60)
        await holders.request("big", 90)
        await holders.request("small", 20)  # 40 free: granted at once beside the big one
        assert holders.granted == ["held", "small"]
        await holders.request("mid", 30)
        await holders.request("mid2", 25)
        assert cache.statistics().waiting == 3
        await holders.release("small")  # 40 free: "mid" fits, "big" and "mid2" do not
        assert holders.granted == ["held", "small", "mid"]
        await holders.release("held")  # 70 free: "mid2" fits, "big" does not
        assert holders.granted == ["held", "small", "mid", "mid2"]
        await holders.release("mid")
        assert (cache.statistics().waiting, cache.bytes_left) == (1, 75)
        await holders.release("mid2")
        assert holders.granted == ["held", "small", "mid", "mid2", "big"]
        await holders.release("big")
    assert cache.statistics() == MemoryCacheStatistics(
        max_bytes=100, bytes_used=0, bytes_left=100, active=0, waiting=0, granted=5, failed=0
    )


async def test_waiters_are_served_in_arrival_order() -> None:
    cache = MemoryCache(100, max_alloc_timeout_s=60.0)
    async with holders_of(cache) as holders:
        await holders.request("a", 70)
        await holders.request("b", 20)
        for name in ("first", "second", "third"):
            await holders.request(name, 30)
        await holders.release("b")  # 30 free: room for the first waiter only
        assert holders.granted == ["a", "b", "first"]
        await holders.release("a")  # 70 free: both others
        assert set(holders.granted[3:]) == {"second", "third"}
        for name in ("first", "second", "third"):
            await holders.release(name)
    assert cache.statistics() == MemoryCacheStatistics(
        max_bytes=100, bytes_used=0, bytes_left=100, active=0, waiting=0, granted=5, failed=0
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
    scopes = {"first": trio.CancelScope(), "second": trio.CancelScope()}

    async def wait(name: str, nbytes: int) -> None:
        with scopes[name]:
            async with cache.allocate(nbytes):
                granted.append(name)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async with cache.allocate(60):
                nursery.start_soon(wait, "first", 50)
                nursery.start_soon(wait, "second", 45)
                await trio.testing.wait_all_tasks_blocked()
                assert (cache.statistics().waiting, cache.bytes_left) == (2, 40)
                scopes["first"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert (cache.statistics().waiting, cache.bytes_left, granted) == (1, 40, [])
                scopes["second"].cancel()
            # Cancelled, then granted as the block above left, before its task could run: the
            # bytes go back.
            await trio.testing.wait_all_tasks_blocked()
            assert granted == []
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
