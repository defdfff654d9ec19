// The rendering of the operations view (/ops): the deployment summary and one card per
// shard with its 64-lane strip (lanes behind the shard's highest W marked: diverged). Pure
// DOM building from an AdminStatus (GET /v1/admin/status); ops.js feeds it the live stream,
// and the browser test renders synthetic statuses with it.

export const LANES = 64;

const $ = (id) => document.getElementById(id);

function fmtRate(v) {
  if (v === null || v === undefined) return "–";
  return v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

function text(v) {
  return v === null || v === undefined ? "–" : String(v);
}

function field(dl, name, cls) {
  const div = document.createElement("div");
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.className = cls;
  div.append(dt, dd);
  dl.append(div);
  return dd;
}

export function shardCard(shard) {
  const el = document.createElement("article");
  el.className = "shard card";
  el.setAttribute("data-testid", "shard");
  el.dataset.shard = String(shard);
  const h = document.createElement("h3");
  h.textContent = `Shard ${shard}`;
  const owner = document.createElement("span");
  owner.className = "owner";
  h.append(" ", owner);
  const strip = document.createElement("div");
  strip.className = "strip";
  strip.setAttribute("role", "img");
  for (let i = 0; i < LANES; i++) {
    const c = document.createElement("span");
    c.className = "lane";
    strip.append(c);
  }
  const dl = document.createElement("dl");
  dl.className = "fields";
  const f = {
    epoch: field(dl, "Epoch", "epoch"),
    head: field(dl, "Head", "head"),
    lag: field(dl, "Lag", "lag"),
    w: field(dl, "W (min–max)", "w"),
    commits: field(dl, "Commits/s", "commits"),
    mat: field(dl, "Materialized/s", "mat"),
    layout: field(dl, "Watermark", "layout wide"),
  };
  f.layout.parentElement.className = "wide";
  const err = document.createElement("p");
  err.className = "bad";
  err.hidden = true;
  el.append(h, strip, dl, err);
  el._parts = { owner, strip, f, err };
  return el;
}

export function renderShard(el, s, staticOwners) {
  const { owner, strip, f, err } = el._parts;
  el.dataset.epoch = text(s.epoch);
  el.dataset.wMin = text(s.w_min);
  el.dataset.head = String(s.head);
  el.classList.toggle("diverged", s.diverged);
  owner.textContent = s.owner ? `· owner ${s.owner}` : staticOwners ? "· static owner" : "· no lease holder";
  f.epoch.textContent = text(s.epoch);
  f.head.textContent = String(s.head);
  f.w.textContent = s.w_min === s.w_max ? text(s.w_min) : `${text(s.w_min)}–${text(s.w_max)}`;
  f.lag.textContent = text(s.lag);
  f.layout.textContent = s.layout ? `${s.layout}, blob ${s.blob_bytes} bytes${s.diverged ? " (lanes diverged)" : ""}` : "unreadable";
  f.commits.textContent = fmtRate(s.commits_per_s);
  f.mat.textContent = fmtRate(s.materialized_per_s);
  const behind = [];
  const cells = strip.children;
  for (let i = 0; i < LANES; i++) {
    const w = s.lanes[i];
    const c = cells[i];
    let state = "empty";
    if (w !== null && w !== undefined) state = w < s.w_max ? "behind" : "full";
    if (state === "behind") behind.push(i);
    c.dataset.state = state;
    c.title = `lane ${i}: ${w === null || w === undefined ? "empty" : `W=${w}`}`;
  }
  strip.setAttribute(
    "aria-label",
    s.lanes.length === 0
      ? "lanes unreadable"
      : behind.length === 0
        ? `all present lanes at W=${text(s.w_max)}`
        : `${behind.length} lanes behind W=${text(s.w_max)}: ${behind.join(", ")}`,
  );
  err.hidden = !s.error;
  err.textContent = s.error ? `watermark unreadable: ${s.error}` : "";
}

export function render(st) {
  $("t-shards").textContent = String(st.shard_count);
  $("t-layout").textContent = st.layout;
  const sum = (k) => (st.window_ms === null ? null : st.shards.reduce((a, s) => a + (s[k] || 0), 0));
  $("t-commits").textContent = fmtRate(sum("commits_per_s"));
  $("t-mat").textContent = fmtRate(sum("materialized_per_s"));
  $("t-lag").textContent = String(st.shards.reduce((a, s) => a + (s.lag || 0), 0));
  $("t-div").textContent = String(st.shards.filter((s) => s.diverged).length);
  const nodes = $("nodes");
  nodes.replaceChildren();
  if (st.nodes.length === 0) {
    const li = document.createElement("li");
    li.textContent = "no node registry (one process owns the shards statically)";
    nodes.append(li);
  }
  for (const n of st.nodes) {
    const li = document.createElement("li");
    li.textContent = `${n.id} · ${n.role} · ${n.layout || "layout unknown"} · ${n.url} · heartbeat ${n.age_ms} ms ago`;
    nodes.append(li);
  }
  const grid = $("shards");
  for (const s of st.shards) {
    let el = grid.querySelector(`[data-shard="${s.shard}"]`);
    if (!el) {
      el = shardCard(s.shard);
      grid.append(el);
    }
    renderShard(el, s, st.nodes.length === 0);
  }
  $("sampled").textContent = `Read at ${new Date(st.sampled_at_ms).toLocaleTimeString()}${
    st.window_ms === null ? "" : `; rates over ${(st.window_ms / 1000).toFixed(1)} s`
  }.`;
}

