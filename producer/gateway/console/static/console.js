// The console's live parts; every page works without this file (a reload).
"use strict";

// A page marked data-refresh re-reads itself and swaps its main part in place.
function refreshEvery(ms) {
  const tick = async () => {
    try {
      const answer = await fetch(location.href, { headers: { Accept: "text/html" } });
      if (answer.ok) {
        const page = new DOMParser().parseFromString(await answer.text(), "text/html");
        const fresh = page.querySelector("main#live");
        if (fresh) document.querySelector("main#live").replaceChildren(...fresh.childNodes);
      }
    } catch (e) { /* the next tick tries again */ }
    setTimeout(tick, ms);
  };
  setTimeout(tick, ms);
}

// A running job's text, token by token, from where the served page left off.
function streamJob(pre) {
  const events = new EventSource(pre.dataset.events);
  const status = document.getElementById("job-status");
  events.addEventListener("token", (e) => {
    pre.textContent += JSON.parse(e.data).text;
    if (status.textContent === "queued") status.textContent = "running";
  });
  events.addEventListener("end", (e) => {
    events.close();
    const job = JSON.parse(e.data);
    pre.textContent = job.text;
    status.textContent = job.status;
    status.className = "status " + job.status;
    document.getElementById("job-finish").textContent = job.finish_reason || "";
    const cancel = document.getElementById("cancel");
    if (cancel) cancel.remove();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const refresh = document.body.dataset.refresh;
  if (refresh) refreshEvery(Number(refresh));
  const pre = document.querySelector("pre#job-text[data-events]");
  if (pre) streamJob(pre);
});
