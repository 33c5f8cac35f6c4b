"""The console in a real browser (headless Chromium), against a real fleet: a
redis-server, a worker on the tiny model and a gateway serving ``/console``.

Each test signs in through the login form, as a person does, and reads what the
pages show; scripts' JSON answers and HTTP statuses are read with httpx. Every
run saves a screenshot of each page (1280x800) to docs/console/.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import WebDriverWait

from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads

from console_helpers import (
    CHROMEDRIVER, CHROMIUM, HEARTBEAT_S, WORKER, Fleet, chrome, shot, sign_in)
from helpers import queue_parts, url_id, wait_until

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(f"the console's browser tests drive Debian's Chromium ({CHROMIUM}, "
                f"{CHROMEDRIVER}): apt-get install chromium chromium-driver (.ci/run does)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = 900  # tokens: 18 s at the worker's 20 ms a step, unless cancelled
PAGES = ["/console", "/console/jobs", "/console/batches", "/console/dead-letters",
         "/console/files", "/console/webhooks", "/console/keys"]
# A page reloads itself, or JavaScript rewrites it, while it is read.
CHANGING = (NoSuchElementException, StaleElementReferenceException)


def path_of(driver: webdriver.Chrome) -> str:
    return urlsplit(driver.current_url).path


def path_of_url(url: str | None) -> str:
    return urlsplit(url or "").path


def text_of(driver: webdriver.Chrome, css: str) -> str:
    """An element's text exactly as the page holds it (``.text`` would trim it)."""
    return driver.find_element(By.CSS_SELECTOR, css).get_attribute("textContent") or ""


def attributes(driver: webdriver.Chrome, css: str, name: str) -> list[str]:
    return [e.get_attribute(name) or "" for e in driver.find_elements(By.CSS_SELECTOR, css)]


def listed(url: str, css: str, name: str, value: str | None = None) -> Any:
    """A wait's condition: load ``url`` and find a row of ``css`` whose attribute
    ``name`` is ``value`` (any row, without one); that row's attribute, or None."""
    def condition(driver: webdriver.Chrome) -> str | None:
        driver.get(url)
        found = [v for v in attributes(driver, css, name) if value is None or v == value]
        return found[0] if found else None
    return condition


def growing(css: str) -> Any:
    """A wait's condition: the element's text, read at each try, has had two
    different lengths, neither empty; then the texts read, in order."""
    seen: list[str] = []

    def condition(driver: webdriver.Chrome) -> list[str] | None:
        text = text_of(driver, css)
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        return seen if len({len(s) for s in seen}) >= 2 else None
    return condition


def job_page(job_id: str) -> str:
    return f"/console/jobs/{url_id(job_id)}"


def submit(fleet: Fleet, key: str, prompt: str, max_new_tokens: int) -> str:
    """A job through the gateway's /v1/jobs as the key's tenant; with
    ``ignore_eos`` it runs for all its tokens."""
    answer = fleet.api(key).post("/v1/jobs", json={
        "prompt": prompt, "model": "default",
        "sampling": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def wait_running(fleet: Fleet, job_id: str) -> None:
    wait_until(lambda: fleet.client.status(job_id).status is JobStatus.RUNNING, timeout=30,
               what=f"job {job_id} to start")


def batch_of(fleet: Fleet, key: str, lines: int) -> str:
    """A batch of ``lines`` short completions, uploaded and created with the
    openai client as the key's tenant."""
    prompts = ["Once upon a time", "The function returns", "Hello there", "In the morning"]
    data = b"".join(orjson.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "default", "prompt": prompts[i % len(prompts)], "max_tokens": 4,
                 "temperature": 0}}) + b"\n" for i in range(lines))
    oa = fleet.openai(key)
    file_id = oa.files.create(file=("in.jsonl", data), purpose="batch").id
    return oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                             completion_window="24h").id


def batch_ended(fleet: Fleet, key: str, batch_id: str) -> Any:
    oa = fleet.openai(key)
    ended = ("completed", "failed", "expired", "cancelled")
    return wait_until(lambda: (b := oa.batches.retrieve(batch_id)).status in ended and b,
                      timeout=120, what=f"batch {batch_id} to end")


def test_a_page_without_a_key_sends_a_browser_to_sign_in_and_a_script_gets_401(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    browser.delete_all_cookies()
    browser.get(f"{fleet.base}/console/jobs")
    WebDriverWait(browser, 10).until(lambda d: path_of(d) == "/console/login")
    form = browser.find_element(By.CSS_SELECTOR, "form#login")
    assert (form.get_attribute("method"), path_of_url(form.get_attribute("action"))) == \
        ("post", "/console/login")
    key = browser.find_element(By.CSS_SELECTOR, "form#login input#key")
    assert (key.get_attribute("name"), key.get_attribute("type")) == ("key", "password")
    assert browser.find_element(By.CSS_SELECTOR, "form#login button#sign-in")

    for path in PAGES:
        page = fleet.http.get(path, headers={"Accept": "text/html"})
        assert page.status_code == 303, (path, page.status_code)
        assert path_of_url(page.headers["location"]) == "/console/login", path
        for headers in ({}, {"Authorization": "Bearer tfk_000000000000_not-a-key"}):
            answer = fleet.http.get(path, headers={"Accept": "application/json", **headers})
            assert answer.status_code == 401, (path, headers, answer.status_code)

    sign_in(browser, fleet, fleet.acme)
    cookies = browser.get_cookies()
    assert cookies and all(c["httpOnly"] for c in cookies), cookies  # out of a script's reach
    browser.find_element(By.CSS_SELECTOR, "form#logout [type=submit], form#logout button").click()
    WebDriverWait(browser, 10).until(lambda d: path_of(d) == "/console/login")
    browser.get(f"{fleet.base}/console")
    assert path_of(browser) == "/console/login"  # signed out: the cookie no longer opens a page


def test_the_fleet_page_lists_a_worker_within_one_heartbeat_of_its_start(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    sign_in(browser, fleet, fleet.admin)
    assert attributes(browser, "table#queues tr.queue", "data-queue").count("default") == 1
    assert WORKER in attributes(browser, "table#workers tr.worker", "data-name")

    worker = fleet.start_worker("w2@console", "console-fleet")  # returns on its first heartbeat
    try:
        # No sooner than its first heartbeat can anything know of it; one
        # heartbeat later the page must list it (each try loads the page anew).
        WebDriverWait(browser, HEARTBEAT_S, poll_frequency=0.05).until(
            listed(f"{fleet.base}/console", "table#workers tr.worker", "data-name",
                   "w2@console"))
        assert "console-fleet" in attributes(browser, "table#queues tr.queue", "data-queue")
        shot(browser, "fleet")
        answer = fleet.api(fleet.admin).get("/console").json()
        assert {"queues", "workers", "history", "tokens_per_s"} <= answer.keys()
        assert {WORKER, "w2@console"} <= {w["name"] for w in answer["workers"]}
    finally:
        worker.stop(grace_s=0)


def test_a_job_from_the_openai_client_is_listed_and_its_page_shows_its_text_arrive_then_its_result(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    sign_in(browser, fleet, fleet.acme)
    oa = fleet.openai(fleet.acme)
    with ThreadPoolExecutor(1) as pool:
        # 400 tokens: 8 s at the worker's pace, to be found and watched while it runs.
        answer = pool.submit(oa.completions.create, model="default", prompt="Once upon a time",
                             max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        job_id = WebDriverWait(browser, 30, poll_frequency=0.2).until(
            listed(f"{fleet.base}/console/jobs?tenant=acme&state=running", "table#jobs tr.job",
                   "data-id"))
        shot(browser, "jobs")

        browser.get(f"{fleet.base}{job_page(job_id)}")
        # Read on one page load: the page itself follows the tokens.
        seen = WebDriverWait(browser, 30, poll_frequency=0.05,
                             ignored_exceptions=CHANGING).until(growing("#job-text"))
        shot(browser, "job")
        completion = answer.result(timeout=120)

    assert completion.id == f"cmpl-{job_id}"  # the job the page showed is the one answered
    result = completion.choices[0].text
    # Each text the page showed on the way was the result so far: no token
    # missed or shown twice where the served page and the stream meet.
    assert all(result.startswith(text) for text in seen), (seen, result)
    WebDriverWait(browser, 30, poll_frequency=0.1, ignored_exceptions=CHANGING).until(
        lambda d: text_of(d, "#job-status").strip() != "running")
    assert text_of(browser, "#job-status").strip() == JobStatus.SUCCEEDED.value
    assert text_of(browser, "#job-text") == result
    record = fleet.api(fleet.acme).get(job_page(job_id)).json()["job"]
    assert (record["id"], record["status"], record["tenant"]) == \
        (job_id, JobStatus.SUCCEEDED.value, "acme")
    assert record["text"] == result == fleet.client.status(job_id).text
    assert not browser.find_elements(By.CSS_SELECTOR, "form#cancel")  # nothing left to cancel

    # Ended, it is still found by its id.
    browser.get(f"{fleet.base}/console/jobs?id={url_id(job_id)}")
    assert attributes(browser, "table#jobs tr.job", "data-id") == [job_id]
    found = fleet.api(fleet.acme).get("/console/jobs", params={"id": job_id}).json()["jobs"]
    assert [(j["id"], j["status"], j["tenant"]) for j in found] == \
        [(job_id, JobStatus.SUCCEEDED.value, "acme")]


def test_cancel_on_a_job_page_ends_the_running_job_cancelled(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    sign_in(browser, fleet, fleet.acme)
    job_id = submit(fleet, fleet.acme, "A long story", LONG)
    wait_running(fleet, job_id)
    browser.get(f"{fleet.base}{job_page(job_id)}")
    button = browser.find_element(By.CSS_SELECTOR, "form#cancel [type=submit], form#cancel button")
    button.click()

    # The form answers 303 back to the job's page, which tells the end.
    WebDriverWait(browser, 10).until(staleness_of(button))  # the page was left
    WebDriverWait(browser, 10).until(lambda d: unquote(path_of(d)) == f"/console/jobs/{job_id}")

    def cancelled(driver: webdriver.Chrome) -> bool:
        driver.refresh()  # the cancel takes a step to land: each try loads the page anew
        return text_of(driver, "#job-status").strip() == JobStatus.CANCELLED.value
    WebDriverWait(browser, 10, poll_frequency=0.1).until(cancelled)
    assert not browser.find_elements(By.CSS_SELECTOR, "form#cancel")
    state = fleet.client.wait(job_id, timeout=10)
    assert state.status is JobStatus.CANCELLED
    assert len(state.token_ids) < LONG  # it was stopped, not run to its end
    record = fleet.api(fleet.acme).get(job_page(job_id)).json()["job"]
    assert record["status"] == JobStatus.CANCELLED.value


def test_a_50_line_batch_reaches_50_of_50_on_its_page_and_its_output_downloads(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    sign_in(browser, fleet, fleet.acme)
    batch_id = batch_of(fleet, fleet.acme, 50)
    WebDriverWait(browser, 30, poll_frequency=0.2).until(
        listed(f"{fleet.base}/console/batches", "tr.batch", "data-id", batch_id))
    shot(browser, "batches")

    browser.get(f"{fleet.base}/console/batches/{batch_id}")
    # One page load: the progress bar follows the batch to its end.
    WebDriverWait(browser, 120, poll_frequency=0.2, ignored_exceptions=CHANGING).until(
        lambda d: text_of(d, "#batch-counts").strip() == "50/50")
    bar = browser.find_element(By.CSS_SELECTOR, "progress#batch-progress")
    assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("50", "50")

    batch = batch_ended(fleet, fleet.acme, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 50
    browser.refresh()
    assert text_of(browser, "#batch-status").strip() == "completed"
    shot(browser, "batch")
    href = browser.find_element(By.CSS_SELECTOR, "a#download-output").get_attribute("href")
    assert href
    download = fleet.session(fleet.acme).get(href, headers={
        "Authorization": f"Bearer {fleet.acme}", "Accept": "*/*"})
    assert download.status_code == 200, download.text
    assert download.content == fleet.openai(fleet.acme).files.content(
        batch.output_file_id).content
    lines = [orjson.loads(line) for line in download.content.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"c-{i}" for i in range(50))
    assert all(line["response"]["status_code"] == 200 for line in lines)

    record = fleet.api(fleet.acme).get(f"/console/batches/{batch_id}").json()["batch"]
    assert (record["id"], record["status"]) == (batch_id, "completed")
    # The page's rate is of the tokens the lines made.
    made = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    assert record["tokens"] == made and record["tokens_per_s"] > 0


def test_a_dead_letter_made_by_a_hostile_entry_shows_its_reason(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    r, keys = fleet.r, fleet.keys
    part = queue_parts(r, keys)[0]
    dlq = keys.dlq(part)
    last = r.xinfo_stream(dlq)["last-generated-id"] if r.exists(dlq) else b"0-0"
    r.xadd(keys.queue(part), {"data": b"{not json"})  # no job could come of it
    reply = r.xread({dlq: last}, count=1, block=30_000)  # the worker's dead letter, awaited
    assert reply, "the hostile entry was not dead-lettered"
    reason = loads(reply[0][1][0][1][b"data"])["reason"]
    assert reason

    sign_in(browser, fleet, fleet.admin)
    browser.get(f"{fleet.base}/console/dead-letters")
    rows = browser.find_elements(By.CSS_SELECTOR, "table#dead-letters tr.dead-letter")
    shown = [(row.find_element(By.CSS_SELECTOR, "td.reason").get_attribute("textContent")
              or "").strip() for row in rows]
    assert reason in shown, shown
    shot(browser, "dead-letters")
    dead = fleet.api(fleet.admin).get("/console/dead-letters").json()["dead_letters"]
    assert any(d["reason"] == reason and d["queue"] in (part, "default") and d["id"]
               for d in dead), dead


def test_a_tenants_key_cannot_see_another_tenants_job_or_batch(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    theirs = submit(fleet, fleet.globex, "globex's own", 4)
    fleet.client.wait(theirs, timeout=60)
    their_batch = batch_of(fleet, fleet.globex, 2)
    pages = [job_page(theirs), f"/console/batches/{their_batch}"]

    admin = fleet.api(fleet.admin)
    for path in pages:  # the pages exist: what acme meets below is the tenants' wall
        assert admin.get(path).status_code == 200, path
    as_acme, acme = fleet.session(fleet.acme), fleet.api(fleet.acme)
    for path in pages:
        assert as_acme.get(path).status_code == 404, path  # the page
        assert as_acme.get(path, headers={"Accept": "application/json"}).status_code == 404, path
        assert acme.get(path).status_code == 404, path  # a script with the key
    # Nor does a search or a list find them.
    assert acme.get("/console/jobs", params={"id": theirs}).json()["jobs"] == []
    assert theirs not in [j["id"] for j in acme.get("/console/jobs",
                                                    params={"tenant": "globex"}).json()["jobs"]]
    assert their_batch not in [b["id"] for b in acme.get("/console/batches").json()["batches"]]
    # The keys page is the admin's alone.
    assert as_acme.get("/console/keys").status_code == 404
    assert acme.get("/console/keys").status_code == 404

    sign_in(browser, fleet, fleet.acme)
    browser.get(f"{fleet.base}{job_page(theirs)}")
    assert not browser.find_elements(By.CSS_SELECTOR, "#job-status, #job-text, form#cancel")
    browser.get(f"{fleet.base}/console/batches/{their_batch}")
    assert not browser.find_elements(By.CSS_SELECTOR, "#batch-counts, progress#batch-progress")
    browser.get(f"{fleet.base}/console/batches")
    assert their_batch not in attributes(browser, "tr.batch", "data-id")


def test_the_pages_render_with_javascript_off_and_a_running_job_reloads_itself(
    fleet: Fleet
) -> None:
    done = submit(fleet, fleet.acme, "Hello there", 8)
    done_text = fleet.client.wait(done, timeout=60).text
    batch_id = batch_of(fleet, fleet.acme, 2)
    batch_ended(fleet, fleet.acme, batch_id)
    running = submit(fleet, fleet.acme, "A long story", LONG)
    wait_running(fleet, running)

    driver = chrome(javascript=False)
    try:
        sign_in(driver, fleet, fleet.admin)  # the form posts without a script
        shown = {"/console": "table#queues", "/console/jobs": "table#jobs",
                 "/console/batches": "tr.batch", "/console/dead-letters": "table#dead-letters",
                 job_page(done): "#job-status", f"/console/batches/{batch_id}": "#batch-counts"}
        for path in PAGES + list(shown):
            driver.get(f"{fleet.base}{path}")
            assert path_of(driver) == path, (path, driver.current_url)  # not sent to sign in
            assert not driver.find_elements(By.CSS_SELECTOR, "form#login"), path
            if path in shown:
                assert driver.find_elements(By.CSS_SELECTOR, shown[path]), (path, shown[path])
        driver.get(f"{fleet.base}{job_page(done)}")
        assert text_of(driver, "#job-text") == done_text  # rendered by the server
        driver.get(f"{fleet.base}/console/batches/{batch_id}")
        assert text_of(driver, "#batch-counts").strip() == "2/2"

        # A running job's page reloads itself: its text grows with no script.
        driver.get(f"{fleet.base}{job_page(running)}")
        assert driver.find_elements(By.CSS_SELECTOR, "noscript meta[http-equiv=refresh]")
        seen = WebDriverWait(driver, 15, poll_frequency=0.1,
                             ignored_exceptions=CHANGING).until(growing("#job-text"))
    finally:
        driver.quit()
        fleet.client.cancel(running)
    text = fleet.client.wait(running, timeout=10).text
    assert all(text.startswith(shown) for shown in seen), (seen, text)


def test_no_page_json_answer_or_log_line_holds_a_secret(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    # Last in the module: the jobs, batches, files and dead letters of the tests
    # before are on the pages, and their log lines in the capture.
    sign_in(browser, fleet, fleet.admin)
    for name in ("files", "webhooks", "keys"):
        browser.get(f"{fleet.base}/console/{name}")
        assert path_of(browser) == f"/console/{name}"
        shot(browser, name)

    # A job and a batch of its own, beside what the tests before left (the lists
    # show jobs while they wait or run; an ended one is found by its id).
    completion = fleet.openai(fleet.acme).completions.create(
        model="default", prompt="Hello there", max_tokens=8, temperature=0)
    batch_id = batch_of(fleet, fleet.acme, 2)
    batch_ended(fleet, fleet.acme, batch_id)
    as_admin, admin = fleet.session(fleet.admin), fleet.api(fleet.admin)
    batches = {b["id"] for b in admin.get("/console/batches").json()["batches"]} | {batch_id}
    paths = PAGES + [job_page(completion.id.removeprefix("cmpl-"))] + \
        [f"/console/batches/{b}" for b in sorted(batches)]
    bodies = {"the login page": fleet.http.get("/console/login").text}
    for path in paths:
        page, answer = as_admin.get(path), admin.get(path)
        assert (page.status_code, answer.status_code) == (200, 200), path
        bodies[f"{path} (HTML)"], bodies[f"{path} (JSON)"] = page.text, answer.text
    assert fleet.logs, "no log line was captured: the scan below would read nothing"
    bodies["the gateway's and the worker's logs"] = "\n".join(fleet.logs)
    for where, body in bodies.items():
        for name, secret in fleet.secrets.items():
            assert secret not in body, f"{name} is in {where}"
