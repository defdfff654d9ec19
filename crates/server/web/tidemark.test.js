// Unit tests of the browser client (tidemark.js), run inside Chromium by
// cmd/tidemark/tests/console.rs against a real gateway (`tidemark up --dev-auth`): the pure
// helpers directly, the connection logic over real WebSockets. Not served by the gateway.
//
// The harness loads the client from the gateway (`lib` = import("/v1/client.js")) and calls
// run(lib, env) on a page of the gateway's origin; it gets {passed, failed, results}. Every
// wait is bounded (a test that hangs fails after TEST_TIMEOUT_MS). Each test uses users of
// its own (a random suffix), so reruns on the same deployment do not see each other.

const TEST_TIMEOUT_MS = 30000;

export async function run(lib, env) {
  const tests = [];
  const test = (name, fn) => tests.push({ name, fn });
  const suffix = Math.random().toString(16).slice(2, 10);
  const user = (name) => `${name}-${suffix}`;
  const opened = [];
  const client = (opts) => {
    const c = new lib.TidemarkClient({ backoff: { base: 50, max: 500 }, ...opts });
    opened.push(c);
    return c;
  };

  function assert(cond, msg) {
    if (!cond) throw new Error(`assertion failed: ${msg}`);
  }
  function eq(a, b, msg) {
    const ja = JSON.stringify(a);
    const jb = JSON.stringify(b);
    if (ja !== jb) throw new Error(`${msg}: got ${ja}, want ${jb}`);
  }
  // Polls cond() every 20 ms until it holds, at most `ms`.
  async function until(what, cond, ms = 15000) {
    const end = Date.now() + ms;
    while (!(await cond())) {
      if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  }
  // A connected client for `name` that records its deliveries and states.
  async function listener(name, extra = {}) {
    const got = [];
    const states = [];
    const c = client({
      user: name,
      onDeliver: (m) => got.push(m),
      onState: (s) => states.push(s.state),
      ...extra,
    });
    await c.connect();
    return { c, got, states };
  }

  // ---- pure helpers ----

  test("backoffDelay: equal jitter, doubling, capped", () => {
    const lo = { random: () => 0 };
    const hi = { random: () => 1 };
    eq(lib.backoffDelay(0, { base: 250, max: 10000, ...lo }), 125, "attempt 0, low");
    eq(lib.backoffDelay(0, { base: 250, max: 10000, ...hi }), 250, "attempt 0, high");
    eq(lib.backoffDelay(3, { base: 250, max: 10000, ...hi }), 2000, "attempt 3");
    eq(lib.backoffDelay(30, { base: 250, max: 10000, ...hi }), 10000, "capped");
    eq(lib.backoffDelay(1000, { base: 250, max: 10000, ...lo }), 5000, "huge attempt, capped");
    for (let a = 0; a < 12; a++) {
      const d = lib.backoffDelay(a);
      assert(d >= 125 && d <= 10000, `default delay ${d} of attempt ${a} in range`);
    }
  });

  test("wsUrl: scheme, path, credentials", () => {
    const host = location.host;
    eq(lib.wsUrl("/v1/ws", { user: "böb x" }), `ws://${host}/v1/ws?user=b%C3%B6b+x`, "dev user");
    eq(lib.wsUrl(undefined, { token: "v1.a.b" }), `ws://${host}/v1/ws?token=v1.a.b`, "token, default path");
    eq(lib.wsUrl("https://example.test/v1/ws", { token: "t", user: "u" }), "wss://example.test/v1/ws?token=t", "https, token wins");
    eq(lib.wsUrl("ws://h:1/v1/ws?user=old", { user: "new" }), "ws://h:1/v1/ws?user=new", "replaced, not repeated");
  });

  test("recipients: comma-separated or a list, trimmed, blanks dropped", () => {
    eq(lib.recipients(" alice, bob,,carol "), ["alice", "bob", "carol"], "string");
    eq(lib.recipients([" a ", "", "b"]), ["a", "b"], "array");
    eq(lib.recipients(""), [], "empty");
  });

  test("newMessageId: unique, valid client ids", () => {
    const ids = new Set();
    for (let i = 0; i < 2000; i++) {
      const id = lib.newMessageId();
      assert(/^js-[0-9a-f]{16}-[0-9]+$/.test(id), `id shape ${id}`);
      assert(id.length <= 128, "at most 128 bytes");
      ids.add(id);
    }
    eq(ids.size, 2000, "distinct ids");
  });

  test("TidemarkError: retryable codes", () => {
    for (const code of ["overloaded", "rate_limited", "too_many_connections", "shard_unavailable", "internal"]) {
      assert(new lib.TidemarkError(code, "m").retryable, `${code} retryable`);
    }
    for (const code of ["bad_request", "body_too_large", "id_reused", "unauthorized", "forbidden"]) {
      assert(!new lib.TidemarkError(code, "m").retryable, `${code} not retryable`);
    }
  });

  test("deliver frames are deduped by seq", () => {
    const got = [];
    const c = new lib.TidemarkClient({ onDeliver: (m) => got.push(m.seq) });
    const deliver = (seq) => c._frame(JSON.stringify({ type: "deliver", seq, from: "a", body: "x", sent_at_us: 1 }));
    for (const seq of [5, 5, 3, 7, 6, 7, 9]) deliver(seq);
    eq(got, [5, 7, 9], "each seq once, never below the highest seen");
    eq(c.stats.duplicates, 4, "dropped frames are counted");
    eq(c.lastSeq, 9, "last seq");
  });

  // ---- over real WebSockets ----

  test("connect, send to self, deliver once with seq and sender", async () => {
    const me = user("solo");
    const { c, got, states } = await listener(me);
    eq(c.me, me, "ready.user");
    eq(c.state, "connected", "state");
    assert(states[0] === "connecting" && states.includes("connected"), `states ${states}`);
    const offsets = await c.send([me], "hello me");
    const seqs = Object.values(offsets);
    eq(seqs.length, 1, "one shard");
    await until("the delivery", () => got.length === 1);
    eq([got[0].seq, got[0].from, got[0].body], [seqs[0], me, "hello me"], "delivery");
    assert(got[0].sentAtUs > 1.6e15, "sent_at_us is unix microseconds");
  });

  test("one send to many recipients reaches each once", async () => {
    const a = await listener(user("many-a"));
    const b = await listener(user("many-b"));
    const s = client({ user: user("many-s") });
    await s.connect();
    await s.send(`${a.c.me}, ${b.c.me}`, "to both");
    await until("both deliveries", () => a.got.length === 1 && b.got.length === 1);
    eq([a.got[0].body, b.got[0].body], ["to both", "to both"], "bodies");
  });

  test("a send cut off by a dropped connection is resent with the same id, committed once", async () => {
    const rcpt = await listener(user("resend-r"));
    const s = client({ user: user("resend-s") });
    await s.connect();
    const id = "js-resend-" + suffix;
    const p = s.send([rcpt.c.me], "exactly once", { id });
    // the frame is on the socket; drop the connection before send_ack can be read
    s._ws.close();
    const offsets = await p;
    assert(s.stats.resent >= 1, `resent ${s.stats.resent}`);
    assert(s.stats.reconnects >= 1, "reconnected");
    // the same id again answers the same offsets (server-side dedupe)
    eq(await s.send([rcpt.c.me], "exactly once", { id }), offsets, "offsets of the retry");
    await s.send([rcpt.c.me], "marker");
    await until("the marker", () => rcpt.got.some((m) => m.body === "marker"));
    eq(rcpt.got.filter((m) => m.body === "exactly once").length, 1, "delivered once");
  });

  test("a send made while disconnected goes out after the reconnect", async () => {
    const rcpt = await listener(user("queued-r"));
    const s = client({ user: user("queued-s") });
    await s.connect();
    s._ws.close();
    const p = s.send([rcpt.c.me], "queued while offline");
    eq(s.pendingSends, 1, "pending");
    await p;
    eq(s.pendingSends, 0, "none pending");
    await until("the delivery", () => rcpt.got.some((m) => m.body === "queued while offline"));
  });

  test("after a reconnect: sync after the last seq, nothing delivered twice", async () => {
    const me = user("sync");
    const { c, got } = await listener(me);
    for (let i = 0; i < 3; i++) await c.send([me], `m${i}`);
    await until("three deliveries", () => got.length === 3);
    // nothing acked: the server's ready.after is 0, below what this client has seen
    c._ws.close();
    await until("the reconnect", () => c.stats.reconnects === 1 && c.state === "connected");
    eq(c.stats.resyncs, 1, "one sync sent");
    await c.send([me], "after");
    await until("the next delivery", () => got.some((m) => m.body === "after"));
    eq(got.map((m) => m.body), ["m0", "m1", "m2", "after"], "each once, in order");
    const seqs = got.map((m) => m.seq);
    assert(seqs.every((s, i) => i === 0 || s > seqs[i - 1]), `ascending ${seqs}`);
  });

  test("ack moves the mailbox cursor: a new connection resumes after it", async () => {
    const me = user("ack");
    const { c, got } = await listener(me);
    await c.send([me], "one");
    await c.send([me], "two");
    await until("two deliveries", () => got.length === 2);
    c.ack(got[0].seq);
    eq(c.ackedSeq, got[0].seq, "acked seq");
    // acks are not answered: poll with fresh connections until the cursor shows it
    let after = -1;
    await until("the acked cursor", async () => {
      const probe = client({ user: me });
      const ready = await probe.connect();
      probe.close();
      after = ready.after;
      if (after >= got[0].seq) return true;
      await new Promise((r) => setTimeout(r, 200)); // few connections at a time
      return false;
    });
    eq(after, got[0].seq, "ready.after is the acked seq");
    const fresh = await listener(me);
    await until("the unacked entry", () => fresh.got.length === 1);
    eq(fresh.got[0].body, "two", "only the unacked entry is delivered again");
  });

  test("a refused send rejects with its code; the connection stays usable", async () => {
    const me = user("refused");
    const { c, got } = await listener(me);
    let err = null;
    try {
      await c.send([me], "x".repeat(16385));
    } catch (e) {
      err = e;
    }
    assert(err instanceof lib.TidemarkError, "a TidemarkError");
    eq([err.code, err.retryable], ["body_too_large", false], "code");
    err = null;
    try {
      await c.send([], "nobody");
    } catch (e) {
      err = e;
    }
    eq(err && err.code, "bad_request", "empty recipients");
    eq(c.pendingSends, 0, "nothing left pending");
    await c.send([me], "still fine");
    await until("the delivery", () => got.length === 1);
  });

  test("close(): state closed, pending sends rejected, no reconnect", async () => {
    const { c, states } = await listener(user("close"));
    c._ws.close(); // drop, then close before the reconnect completes
    const p = c.send(["nobody-" + suffix], "never");
    c.close();
    let err = null;
    try {
      await p;
    } catch (e) {
      err = e;
    }
    eq(err && err.code, "closed", "pending send rejected");
    eq(c.state, "closed", "state");
    const n = states.length;
    await new Promise((r) => setTimeout(r, 300));
    eq(states.length, n, "no state change after close");
  });

  const results = [];
  for (const t of tests) {
    let timer;
    try {
      await Promise.race([
        Promise.resolve().then(t.fn),
        new Promise((_, reject) => {
          timer = setTimeout(() => reject(new Error(`timed out after ${TEST_TIMEOUT_MS} ms`)), TEST_TIMEOUT_MS);
        }),
      ]);
      results.push({ name: t.name, ok: true });
    } catch (e) {
      results.push({ name: t.name, ok: false, error: String((e && e.message) || e) });
    } finally {
      clearTimeout(timer);
      for (const c of opened.splice(0)) c.close();
    }
  }
  return {
    passed: results.filter((r) => r.ok).length,
    failed: results.filter((r) => !r.ok).length,
    results,
    env,
  };
}
