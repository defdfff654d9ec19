// The console at / : sign in (a user name with --dev-auth, or a token), send to one or many
// recipients, watch deliveries arrive with their seq and sender, ack them, and see the
// connection come and go (reconnects, resyncs). Built on the browser client, /v1/client.js.
// The credentials live in this tab's sessionStorage, so a reload signs in again by itself.

import { TidemarkClient, recipients } from "/v1/client.js";

const KEY = "tidemark.console.login";
const $ = (id) => document.getElementById(id);

let client = null;
const shown = new Set();

function setConn(state, detail) {
  $("conn-state").textContent = state;
  $("conn-dot").dataset.state = state;
  if (detail) $("conn-detail").textContent = detail;
}

function describe(stats) {
  return `reconnects: ${stats.reconnects} · resyncs: ${stats.resyncs} · resent: ${stats.resent} · duplicates dropped: ${stats.duplicates}`;
}

function time(us) {
  if (!Number.isFinite(us)) return "";
  return new Date(us / 1000).toLocaleTimeString();
}

function addDelivery(m) {
  if (shown.has(m.seq)) return;
  shown.add(m.seq);
  const li = document.createElement("li");
  li.dataset.seq = String(m.seq);
  li.className = "delivery";
  const head = document.createElement("p");
  head.className = "meta";
  const seq = document.createElement("span");
  seq.className = "seq";
  seq.textContent = `#${m.seq}`;
  const from = document.createElement("span");
  from.className = "from";
  from.textContent = `from ${m.from}`;
  const at = document.createElement("time");
  at.textContent = time(m.sentAtUs);
  head.append(seq, " ", from, " ", at);
  const body = document.createElement("p");
  body.className = "body";
  body.textContent = m.body;
  const ack = document.createElement("button");
  ack.type = "button";
  ack.className = "secondary small";
  ack.textContent = "Ack";
  ack.setAttribute("aria-label", `Ack #${m.seq} and everything before it`);
  ack.addEventListener("click", () => ackUpTo(m.seq));
  li.append(head, body, ack);
  $("deliveries").prepend(li);
  $("count").textContent = String(shown.size);
  $("empty").hidden = true;
}

function ackUpTo(seq) {
  if (!client) return;
  client.ack(seq);
  for (const li of $("deliveries").children) {
    if (Number(li.dataset.seq) <= seq && !li.classList.contains("acked")) {
      li.classList.add("acked");
      const b = li.querySelector("button");
      if (b) {
        b.disabled = true;
        b.textContent = "Acked";
      }
    }
  }
}

function start(login) {
  $("login").hidden = true;
  $("app").hidden = false;
  $("me").textContent = login.mode === "token" ? "…" : login.value;
  client = new TidemarkClient(login.mode === "token" ? { token: login.value } : { user: login.value });
  client.onDeliver = addDelivery;
  client.onReady = (f) => {
    $("me").textContent = f.user;
  };
  client.onState = (s) => {
    const label = s.state === "reconnecting" ? `reconnecting` : s.state;
    setConn(label, describe(s.stats));
  };
  client.onError = (e) => note(`error ${e.code}: ${e.message}`, true);
  client.connect().catch(() => {});
}

function note(text, bad) {
  const li = document.createElement("li");
  li.textContent = text;
  if (bad) li.className = "bad";
  $("sent").prepend(li);
  while ($("sent").children.length > 5) $("sent").lastChild.remove();
}

function currentMode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function syncLabel() {
  const token = currentMode() === "token";
  $("login-label").textContent = token ? "Token" : "User name";
  $("login-user").autocomplete = token ? "off" : "username";
}

document.addEventListener("DOMContentLoaded", () => {
  for (const r of document.querySelectorAll('input[name="mode"]')) r.addEventListener("change", syncLabel);
  $("login-user").addEventListener("input", () => {
    // a pasted token switches the mode
    if ($("login-user").value.startsWith("v1.") && currentMode() !== "token") {
      document.querySelector('input[name="mode"][value="token"]').checked = true;
      syncLabel();
    }
  });
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("login-user").value.trim();
    if (!value) {
      $("login-user").focus();
      return;
    }
    const login = { mode: currentMode(), value };
    sessionStorage.setItem(KEY, JSON.stringify(login));
    start(login);
    $("send-to").focus();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (client) client.close();
    location.reload();
  });
  $("send-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const to = recipients($("send-to").value);
    if (to.length === 0) {
      note("give at least one recipient", true);
      $("send-to").focus();
      return;
    }
    const body = $("send-body").value;
    const sending = client.send(to, body);
    note(`sending to ${to.join(", ")}…`);
    sending.then(
      (offsets) => {
        const where = Object.entries(offsets).map(([s, o]) => `shard ${s} offset ${o}`).join(", ");
        note(`sent to ${to.join(", ")}: ${where}`);
      },
      (e) => note(`not sent (${e.code}): ${e.message}`, true),
    );
    $("send-body").value = "";
    $("send-body").focus();
  });
  $("ack-all").addEventListener("click", () => {
    if (shown.size > 0) ackUpTo(Math.max(...shown));
  });
  const saved = sessionStorage.getItem(KEY);
  if (saved) {
    try {
      start(JSON.parse(saved));
    } catch {
      sessionStorage.removeItem(KEY);
    }
  }
});
