// The operations view at /ops: every shard's owner, epoch, head, lanes' W (a 64-cell strip,
// diverged lanes marked), layout and blob size, lag, commits and materializations per
// second, live. It reads GET /v1/admin/status/stream (server-sent events) with fetch, so an
// admin token can go in the Authorization header; the stream is reopened with a backoff when
// it ends. Open without a token on a gateway started with --dev-auth.

import { render } from "/console/ops-view.js";

const KEY = "tidemark.ops.token";
const $ = (id) => document.getElementById(id);

let attempt = 0;

function setConn(state) {
  $("conn-state").textContent = state;
  $("conn-dot").dataset.state = state;
}

function askForToken(why) {
  $("login").hidden = false;
  $("login-why").textContent = why;
  $("admin-token").focus();
}

// Reads one server-sent-event stream until it ends; resolves normally or throws.
async function readStream() {
  const headers = { Accept: "text/event-stream" };
  const token = sessionStorage.getItem(KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const resp = await fetch("/v1/admin/status/stream", { headers, cache: "no-store" });
  if (resp.status === 401 || resp.status === 403) {
    let msg = `HTTP ${resp.status}`;
    try {
      const b = await resp.json();
      msg = `${b.error.code}: ${b.error.message}`;
    } catch {
      /* keep the status */
    }
    setConn("signed out");
    askForToken(`Refused (${msg}). This view needs an admin token: tidemark token --admin --secret-file …`);
    return "auth";
  }
  if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
  setConn("connected");
  attempt = 0;
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return "ended";
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length === 0) continue;
      const payload = JSON.parse(data.join("\n"));
      if (event === "status") render(payload);
      else if (event === "error") $("sampled").textContent = `Reading failed: ${payload.error.message}`;
    }
  }
}

async function run() {
  for (;;) {
    let outcome;
    try {
      outcome = await readStream();
    } catch (e) {
      outcome = "failed";
    }
    if (outcome === "auth") return;
    attempt += 1;
    setConn("reconnecting");
    const step = Math.min(10000, 250 * 2 ** Math.min(attempt, 10));
    await new Promise((r) => setTimeout(r, step / 2 + (Math.random() * step) / 2));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("admin-token").value.trim();
    if (!t) return;
    sessionStorage.setItem(KEY, t);
    $("login").hidden = true;
    setConn("connecting");
    run();
  });
  run();
});
