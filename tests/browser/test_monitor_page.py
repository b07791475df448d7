"""The monitor's page in a real headless Chromium: it shows a 3-server swarm (a row per server,
a bar cell per block with its count) and, when a server leaves, redraws itself from the event
stream without a reload.  The page as it ends is saved to bench/results/monitor.png.

selenium blocks, so each of its calls runs in a worker thread; its waits (``WebDriverWait``)
poll the page's DOM under a deadline, as the swarm's processes take a while to start here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import trio

from petals_core.testing import open_local_swarm

from ..monitor._swarm import add_servers, peer_id, save_tiny_llama, start_monitor

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

T = TypeVar("T")

DEADLINE_S = 240.0
#: How long the page may take to show a change.
PAGE_WAIT_S = 90.0
SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "results" / "monitor.png"

#: What the page shows, read from its DOM: the server rows (PeerIDs), the bar's cells (their
#: text and class), how each server is reached, the round-trip and the fraud-report columns.
READ_PAGE = """
const rows = [...document.querySelectorAll("table.servers tbody tr")];
return {
  version: document.body.dataset.version,
  status: document.getElementById("status").textContent,
  peers: rows.map((row) => row.dataset.peerId),
  names: rows.map((row) => row.children[1].textContent),
  rtts: rows.map((row) => row.children[9].textContent),
  reached: rows.map((row) => row.children[8].textContent),
  reports: rows.map((row) => row.children[10].textContent),
  cells: [...document.querySelectorAll(".bar .cell")].map((cell) => cell.textContent),
  holes: [...document.querySelectorAll(".bar .cell.hole")].map((cell) => cell.dataset.block),
  notReloaded: window.notReloaded === true,
};
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("page-llama"))


async def in_thread(function: Callable[..., T], *args: Any) -> T:
    return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)


def wait_for_page(browser: Chrome, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Wait until what the page shows satisfies ``condition``; return it."""
    from selenium.webdriver.support.ui import WebDriverWait

    def shown(driver: Chrome) -> dict[str, Any] | bool:
        page: dict[str, Any] = driver.execute_script(READ_PAGE)
        return page if condition(page) else False

    page: dict[str, Any] = WebDriverWait(browser, PAGE_WAIT_S, poll_frequency=0.25).until(
        shown, message="the page never showed what was expected"
    )
    return page


async def test_the_page_shows_the_swarm_and_follows_a_departure_live(
    model_folder: str, browser: Chrome
) -> None:
    spans = {"alpha": (0, 3), "beta": (2, 6), "gamma": (3, 6)}
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model_folder, []) as swarm, trio.open_nursery() as nursery:
            servers = await add_servers(swarm, model_folder, spans)
            stop = trio.Event()
            url = await start_monitor(nursery, swarm, stop)
            await in_thread(browser.get, f"{url}/")

            # Every server measured (no "measuring…" left): the page as it settles.
            everyone = {peer_id(process) for process in servers.values()}
            page = await in_thread(
                wait_for_page,
                browser,
                lambda page: (
                    set(page["peers"]) == everyone
                    and "measuring…" not in page["rtts"]
                    # Each server found that peers dial it directly, and so relays for others.
                    and set(page["reached"]) == {"direct, relays"}
                ),
            )
            assert page["status"] == "live"
            assert page["names"] == ["alpha", "beta", "gamma"]  # by span
            assert page["cells"] == ["1", "1", "2", "2", "2", "2"]
            assert page["holes"] == []
            assert all(rtt.endswith(" ms") for rtt in page["rtts"])
            assert page["reports"] == ["—"] * len(page["peers"])  # nobody reported
            before = int(page["version"])

            # A reload would forget this.
            await in_thread(browser.execute_script, "window.notReloaded = true;")
            assert await servers["alpha"].stop() == 0
            page = await in_thread(
                wait_for_page, browser, lambda page: peer_id(servers["alpha"]) not in page["peers"]
            )
            assert page["notReloaded"]
            assert int(page["version"]) > before
            assert page["names"] == ["beta", "gamma"]
            assert page["cells"] == ["0", "0", "1", "2", "2", "2"]
            assert page["holes"] == ["0", "1"]

            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            assert await in_thread(browser.save_screenshot, str(SCREENSHOT))
            stop.set()
