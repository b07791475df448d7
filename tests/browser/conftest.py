"""A headless Chromium driven by selenium, for the tests of the monitor's page.

Chromium and its driver come from Debian's packages (``apt-get install -y chromium
chromium-driver``), selenium from ``nox -s browser`` (or ``nox -s tests`` in CI, which installs
all three); without them the tests are skipped, saying what to install, or fail where the
system's parts are required (CI, ``nox -s browser``: see tests/_system.py).  The driver is given
by path, so selenium never tries to download one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from .._system import missing

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

#: Where Debian's packages put them (the first name found on PATH).
CHROMIUM = ("chromium", "chromium-browser")
CHROMEDRIVER = ("chromedriver",)


def _which(names: tuple[str, ...]) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


@pytest.fixture(scope="session")
def browser() -> Iterator[Chrome]:
    try:
        from selenium import webdriver
    except ImportError:
        missing("selenium", "nox -s browser")
    chromium, driver = _which(CHROMIUM), _which(CHROMEDRIVER)
    if chromium is None or driver is None:
        missing("Chromium and its driver", "apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in [
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespaces for the sandbox
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,520",
    ]:
        options.add_argument(argument)
    chrome = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))
    try:
        yield chrome
    finally:
        chrome.quit()
