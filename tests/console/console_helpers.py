"""What the console's tests share: the module's fleet as they see it, and a
headless Chromium that signs in and takes screenshots.

The browser is Debian's Chromium through its chromedriver, both named by path,
so Selenium Manager never runs and nothing is downloaded at run time.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import redis
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import Keys

from gateway_server import port_of

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "docs" / "console"
WIDTH, HEIGHT = 1280, 800
HEARTBEAT_S = 0.5  # the fleet's workers'
WORKER = "w@console"  # the module's worker, on the queue 'default'


@dataclass
class Fleet:
    settings: Settings
    r: redis.Redis
    keys: Keys
    http: httpx.Client  # the gateway, no key
    client: Any  # a FleetClient on the fleet's Redis
    acme: str
    globex: str
    admin: str
    webhook_secret: str
    redis_password: str
    logs: list[str]  # every log line of the gateway and the worker, formatted
    start_worker: Callable[[str, str], Any]
    clients: list[Any] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{port_of(self.http)}"

    @property
    def secrets(self) -> dict[str, str]:
        return {"acme's key": self.acme, "globex's key": self.globex, "the admin key": self.admin,
                "the webhook secret": self.webhook_secret,
                "the Redis password": self.redis_password}

    def openai(self, key: str) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0,
                               timeout=120)
        self.clients.append(client)
        return client

    def api(self, key: str) -> httpx.Client:
        """A script's client: the key as a bearer token, asking for JSON."""
        client = httpx.Client(base_url=self.base, timeout=60, headers={
            "Authorization": f"Bearer {key}", "Accept": "application/json"})
        self.clients.append(client)
        return client

    def session(self, key: str) -> httpx.Client:
        """A browser's client without the browser: signed in through the login
        form, so it carries the session cookie and no Authorization header."""
        client = httpx.Client(base_url=self.base, timeout=60, headers={"Accept": "text/html"})
        self.clients.append(client)
        answer = client.post("/console/login", data={"key": key})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"].endswith("/console"), answer.headers
        assert client.cookies, "signing in set no cookie"
        return client


def chrome(javascript: bool = True) -> webdriver.Chrome:
    """Headless Chromium at 1280x800, its binary and driver named by path."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(argument)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    # The window's size is not its page's (a headless window keeps room for its
    # frame): the page itself is set to 1280x800, so a screenshot is that size.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    return driver


def sign_in(driver: webdriver.Chrome, fleet: Fleet, key: str) -> None:
    """Sign in as a person does: the login form, then the fleet page."""
    driver.delete_all_cookies()
    driver.get(f"{fleet.base}/console/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()
    WebDriverWait(driver, 10).until(lambda d: urlsplit(d.current_url).path == "/console")


def shot(driver: webdriver.Chrome, name: str) -> Path:
    """Save the page as docs/console/<name>.png (docs/console.md shows them)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    png = driver.get_screenshot_as_png()
    assert struct.unpack(">II", png[16:24]) == (WIDTH, HEIGHT), "not a 1280x800 screenshot"
    path = SCREENSHOTS / f"{name}.png"
    path.write_bytes(png)
    return path
