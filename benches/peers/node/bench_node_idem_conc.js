// @node-idempotency/core, C concurrent callers on distinct keys (the claim+complete_cC loop:
// caller w takes keys w, w+C, ...), one node-redis client (commands multiplexed on one connection).
// usage: node bench_node_idem_conc.js [N] [C,C,..] [redis|memory] [REDIS_PORT]
const { Idempotency } = require("@node-idempotency/core");
const { RedisStorageAdapter } = require("@node-idempotency/storage-adapter-redis");
const { MemoryStorageAdapter } = require("@node-idempotency/storage-adapter-memory");
const { performance } = require("perf_hooks");

const N = parseInt(process.argv[2] || "10000", 10);
const CONCS = (process.argv[3] || "8,64").split(",").map((s) => parseInt(s, 10));
const KIND = process.argv[4] || "redis";
const PORT = parseInt(process.argv[5] || "6399", 10);
const RUN = String(Date.now());
const peer = `node-idempotency-${KIND}`;

function pct(s, p) {
  const k = Math.min(s.length - 1, Math.max(0, Math.round((p / 100) * (s.length - 1))));
  return s[k];
}
let bodyRuns = 0;
async function idemCall(idem, id) {
  const req = { headers: { "idempotency-key": id }, path: "/charge", method: "POST", body: { id } };
  const cached = await idem.onRequest(req);
  if (cached) return cached.body;
  bodyRuns++;
  const body = { charge_id: "ch_" + id, amount: 100 };
  await idem.onResponse(req, { body });
  return body;
}
(async () => {
  let storage;
  if (KIND === "redis") {
    storage = new RedisStorageAdapter({ url: `redis://127.0.0.1:${PORT}` });
    await storage.connect();
  } else {
    storage = new MemoryStorageAdapter();
  }
  const idem = new Idempotency(storage, { cacheTTLMS: 3600 * 1000 });
  for (const C of CONCS) {
    bodyRuns = 0;
    const lat = [];
    const t0 = performance.now();
    await Promise.all(Array.from({ length: C }, async (_, w) => {
      for (let i = w; i < N; i += C) {
        const a = process.hrtime.bigint();
        await idemCall(idem, `${RUN}-c${C}-${i}`);
        lat.push(Number(process.hrtime.bigint() - a));
      }
    }));
    const wall = (performance.now() - t0) / 1000;
    const s = Float64Array.from(lat).sort();
    console.log(JSON.stringify({
      peer, phase: `claim+complete_c${C}`, n: s.length,
      ops_per_s: +(s.length / wall).toFixed(1),
      p50_us: +(pct(s, 50) / 1000).toFixed(1), p99_us: +(pct(s, 99) / 1000).toFixed(1),
      max_us: +(s[s.length - 1] / 1000).toFixed(1), body_runs: bodyRuns,
    }));
  }
  if (KIND === "redis") await storage.disconnect();
})().catch((e) => { console.error(e); process.exit(1); });
