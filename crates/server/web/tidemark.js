// tidemark.js — the Tidemark browser client, client protocol v1 (docs/protocol.md,
// "Browser client"). An ES module without dependencies, served by every gateway at
// /v1/client.js.
//
//   import { TidemarkClient } from "/v1/client.js";
//   const client = new TidemarkClient({ user: "bob" });          // or { token: "v1.…" }
//   client.onDeliver = (m) => { console.log(m.seq, m.from, m.body); client.ack(m.seq); };
//   await client.connect();                                         // resolves on `ready`
//   const offsets = await client.send(["alice"], "hi");            // after `send_ack`
//
// What it does for you:
// - connects to /v1/ws with `?token=` (browsers cannot set headers on a WebSocket) or, on a
//   gateway started with --dev-auth, `?user=`;
// - gives every send a fresh id and keeps it until `send_ack`: a send not acknowledged when
//   the connection drops is resent, with the same id, after the reconnect (the gateway
//   dedupes on (sender, id), so it is committed once); a retryable error is retried the same
//   way after a backoff; any other error rejects the promise;
// - reconnects with exponential backoff and jitter, then sends `sync` after the last seq it
//   has seen (when that is above the server's `ready.after`), and repeats the last `ack`;
// - calls onDeliver once per seq: `deliver` frames at or below the highest seq seen (a
//   replay after a reconnect or a `sync`) are dropped.
// A token that expires while connected (close code 4001) stops it: call setToken(newToken).

/** Error codes after which the same request may be sent again unchanged. */
export const RETRYABLE_CODES = Object.freeze([
  "overloaded",
  "rate_limited",
  "too_many_connections",
  "shard_unavailable",
  "internal",
]);

/** Close code of an expired token (docs/protocol.md, "Close codes"). */
export const CLOSE_TOKEN_EXPIRED = 4001;

/** A refused send or frame: `code` is the protocol's stable error code. */
export class TidemarkError extends Error {
  constructor(code, message, id) {
    super(`${code}: ${message}`);
    this.name = "TidemarkError";
    this.code = code;
    this.id = id;
    this.retryable = RETRYABLE_CODES.includes(code);
  }
}

/**
 * The wait before reconnect attempt `attempt` (0, 1, 2, …), in ms: an exponential step
 * (`base` · 2^attempt, at most `max`), of which a random half is waited ("equal jitter").
 */
export function backoffDelay(attempt, { base = 250, max = 10000, random = Math.random } = {}) {
  const step = Math.min(max, base * 2 ** Math.min(Math.max(attempt, 0), 30));
  return Math.round(step / 2 + (random() * step) / 2);
}

let idCounter = 0;

/** A fresh client message id: `js-` + 16 random hex digits + `-` + a counter. */
export function newMessageId() {
  const bytes = new Uint8Array(8);
  globalThis.crypto.getRandomValues(bytes);
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  idCounter += 1;
  return `js-${hex}-${idCounter}`;
}

/**
 * The WebSocket URL for `url` (absolute or relative to the page; default `/v1/ws`), http(s)
 * turned into ws(s), with `token` or (dev auth) `user` in the query.
 */
export function wsUrl(url, { token, user } = {}) {
  const base = globalThis.location ? globalThis.location.href : "http://localhost/";
  const u = new URL(url || "/v1/ws", base);
  if (u.protocol === "http:") u.protocol = "ws:";
  if (u.protocol === "https:") u.protocol = "wss:";
  u.searchParams.delete("token");
  u.searchParams.delete("user");
  if (token) u.searchParams.set("token", token);
  else if (user) u.searchParams.set("user", user);
  return u.toString();
}

/** Recipients as an array: a string is split at commas; blanks are dropped. */
export function recipients(to) {
  const list = Array.isArray(to) ? to : String(to).split(",");
  return list.map((r) => String(r).trim()).filter((r) => r.length > 0);
}

/**
 * One user's connection to a Tidemark gateway.
 *
 * Options: `url` (default `/v1/ws` on the page's host), `token` or `user`, `onDeliver(m)`
 * (m: `{seq, from, body, sentAtUs}`), `onState(s)` (s: `{state, attempt, stats}`; state is
 * `connecting`, `connected`, `reconnecting`, `expired` or `closed`), `onError(err)` (errors
 * not tied to a send), `onReady(frame)`, `backoff` (`{base, max}` in ms), `WebSocket` (the
 * constructor to use; default the browser's).
 */
export class TidemarkClient {
  constructor(opts = {}) {
    this.url = opts.url || "/v1/ws";
    this.token = opts.token || null;
    this.user = opts.user || null;
    this.onDeliver = opts.onDeliver || null;
    this.onState = opts.onState || null;
    this.onError = opts.onError || null;
    this.onReady = opts.onReady || null;
    this.backoff = { base: 250, max: 10000, ...(opts.backoff || {}) };
    this.WebSocketImpl = opts.WebSocket || globalThis.WebSocket;
    /** Highest seq delivered to onDeliver (or below the server's `ready.after`). */
    this.lastSeq = 0;
    /** Highest seq acked. */
    this.ackedSeq = 0;
    /** The user the server authenticated (from `ready`). */
    this.me = null;
    this.state = "idle";
    this.stats = {
      connects: 0, // `ready` frames received
      reconnects: 0, // of which after the first
      resyncs: 0, // `sync` frames sent after a reconnect
      resent: 0, // sends sent again (reconnect or retryable error)
      delivered: 0, // onDeliver calls
      duplicates: 0, // `deliver` frames dropped (seq already seen)
    };
    this._pending = new Map(); // id -> {frame, resolve, reject, tries}
    this._ws = null;
    this._ready = false;
    this._attempt = 0;
    this._timer = null;
    this._stopped = true;
    this._waiters = [];
    this._onOnline = () => {
      if (this._timer !== null) {
        clearTimeout(this._timer);
        this._timer = null;
        this._open();
      }
    };
  }

  /** Starts connecting; resolves with the first `ready` frame (rejects if close() comes first). */
  connect() {
    const p = new Promise((resolve, reject) => this._waiters.push({ resolve, reject }));
    if (this._stopped) {
      this._stopped = false;
      if (globalThis.addEventListener) globalThis.addEventListener("online", this._onOnline);
      this._open();
    }
    return p;
  }

  /** Closes the connection for good (code 1000); pending sends are rejected. */
  close() {
    this._stopped = true;
    if (globalThis.removeEventListener) globalThis.removeEventListener("online", this._onOnline);
    if (this._timer !== null) clearTimeout(this._timer);
    this._timer = null;
    const ws = this._ws;
    this._ws = null;
    this._ready = false;
    if (ws) ws.close(1000, "client closed");
    for (const [, p] of this._pending) p.reject(new TidemarkError("closed", "the client was closed", p.frame.id));
    this._pending.clear();
    for (const w of this._waiters.splice(0)) w.reject(new TidemarkError("closed", "the client was closed"));
    this._setState("closed");
  }

  /** Replaces the token (e.g. after 4001 token_expired) and reconnects with it. */
  setToken(token) {
    this.token = token;
    this.reconnect();
  }

  /** Drops the current connection (if any) and connects again at once. */
  reconnect() {
    if (this._stopped) {
      this.connect();
      return;
    }
    if (this._timer !== null) clearTimeout(this._timer);
    this._timer = null;
    const ws = this._ws;
    this._ws = null;
    this._ready = false;
    if (ws) ws.close(1000, "reconnecting");
    this._open();
  }

  /**
   * Sends `body` to `to` (an array, or a comma-separated string). Resolves with the
   * `send_ack` offsets (`{"shard": offset}`) once committed; rejects with a TidemarkError on a
   * non-retryable error. Sent at once when connected, else after the next `ready`.
   */
  send(to, body, { id } = {}) {
    const frame = { type: "send", id: id || newMessageId(), to: recipients(to), body: String(body) };
    return new Promise((resolve, reject) => {
      const p = { frame, resolve, reject, tries: 0 };
      this._pending.set(frame.id, p);
      if (this._ready) {
        p.tries = 1;
        this._write(frame);
      }
    });
  }

  /** Acks every entry at or below `seq` (the server may trim them). Repeated after a reconnect. */
  ack(seq) {
    if (!Number.isSafeInteger(seq) || seq <= this.ackedSeq) return;
    this.ackedSeq = seq;
    if (this._ready) this._write({ type: "ack", seq });
  }

  /** Restarts the delivery stream after `after` (entries at or below the last seen are still dropped). */
  sync(after) {
    if (this._ready) this._write({ type: "sync", after });
  }

  /** Sends waiting for their `send_ack`. */
  get pendingSends() {
    return this._pending.size;
  }

  _setState(state) {
    this.state = state;
    if (this.onState) this.onState({ state, attempt: this._attempt, stats: { ...this.stats } });
  }

  _write(frame) {
    const ws = this._ws;
    if (ws && ws.readyState === 1) ws.send(JSON.stringify(frame));
  }

  _open() {
    if (this._stopped) return;
    this._setState(this.stats.connects === 0 && this._attempt === 0 ? "connecting" : "reconnecting");
    let ws;
    try {
      ws = new this.WebSocketImpl(wsUrl(this.url, { token: this.token, user: this.user }));
    } catch (e) {
      this._report(new TidemarkError("bad_request", `cannot open the WebSocket: ${e.message}`));
      this._retryLater();
      return;
    }
    this._ws = ws;
    this._ready = false;
    ws.onmessage = (ev) => {
      if (this._ws === ws) this._frame(ev.data);
    };
    ws.onclose = (ev) => {
      if (this._ws !== ws) return; // replaced or closed on purpose
      this._ws = null;
      this._ready = false;
      if (ev.code === CLOSE_TOKEN_EXPIRED) {
        this._setState("expired");
        return;
      }
      this._retryLater();
    };
  }

  _retryLater() {
    if (this._stopped) return;
    const delay = backoffDelay(this._attempt, this.backoff);
    this._attempt += 1;
    this._setState("reconnecting");
    this._timer = setTimeout(() => {
      this._timer = null;
      this._open();
    }, delay);
  }

  _report(err) {
    if (this.onError) this.onError(err);
  }

  _frame(text) {
    let f;
    try {
      f = JSON.parse(text);
    } catch {
      this._report(new TidemarkError("bad_json", "the server sent a frame that is not JSON"));
      return;
    }
    switch (f.type) {
      case "ready":
        return this._onReadyFrame(f);
      case "deliver":
        if (f.seq <= this.lastSeq) {
          this.stats.duplicates += 1;
          return;
        }
        this.lastSeq = f.seq;
        this.stats.delivered += 1;
        if (this.onDeliver) this.onDeliver({ seq: f.seq, from: f.from, body: f.body, sentAtUs: f.sent_at_us });
        return;
      case "send_ack": {
        const p = this._pending.get(f.id);
        if (p) {
          this._pending.delete(f.id);
          p.resolve(f.offsets);
        }
        return;
      }
      case "error":
        return this._onErrorFrame(f);
      default:
        return; // frames of a later protocol version are ignored
    }
  }

  _onReadyFrame(f) {
    const again = this.stats.connects > 0;
    this.stats.connects += 1;
    if (again) this.stats.reconnects += 1;
    this._attempt = 0;
    this._ready = true;
    this.me = f.user;
    // entries at or below `after` are acked (by us or another connection of this user)
    if (this.lastSeq > f.after) {
      this._write({ type: "sync", after: this.lastSeq });
      this.stats.resyncs += 1;
    } else {
      this.lastSeq = f.after;
    }
    if (this.ackedSeq > f.after) this._write({ type: "ack", seq: this.ackedSeq });
    for (const [, p] of this._pending) {
      if (p.tries > 0) this.stats.resent += 1;
      p.tries += 1;
      this._write(p.frame);
    }
    this._setState("connected");
    if (this.onReady) this.onReady(f);
    for (const w of this._waiters.splice(0)) w.resolve(f);
  }

  _onErrorFrame(f) {
    const err = new TidemarkError(f.code, f.message, f.id);
    const p = f.id !== undefined ? this._pending.get(f.id) : undefined;
    if (!p) {
      this._report(err);
      return;
    }
    if (!err.retryable) {
      this._pending.delete(f.id);
      p.reject(err);
      return;
    }
    // retried with the same id after a backoff (a reconnect meanwhile resends it anyway)
    setTimeout(() => {
      if (this._pending.get(f.id) === p && this._ready) {
        this.stats.resent += 1;
        p.tries += 1;
        this._write(p.frame);
      }
    }, backoffDelay(p.tries, this.backoff));
  }
}
