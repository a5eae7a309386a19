// The client in Vercel's Edge Runtime (edge-runtime) and in Cloudflare's workerd (miniflare),
// against the real gateway: ten reservations from ten separate runtimes admit what fits.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import edgeRuntime from "edge-runtime";
import { Miniflare } from "miniflare";
import { GATEWAY, body, budget, env, fitting } from "./env.mjs";

const { EdgeRuntime } = edgeRuntime;
const dist = readFileSync(new URL("../dist/index.js", import.meta.url), "utf8");

/** The module as a bundler hands it to the Edge Runtime: a script whose exports are globals. */
function asScript(module) {
  const script = module.replace(/^export\s+(?=(class|function|async function|const|let)\s)/gm, "");
  return `${script}\nglobalThis.Tollgate = Tollgate; globalThis.TollgateError = TollgateError;`;
}

/** One reservation in `run`, answered as { ok, reservation } or { ok: false, status, code }. */
const reserveOnce = (gateway, key) => `(async () => {
  const t = new Tollgate({ baseUrl: ${JSON.stringify(gateway)}, apiKey: ${JSON.stringify(key)} });
  try {
    const r = await t.reserve("/v1/chat/completions", ${JSON.stringify(body())});
    return JSON.stringify({ ok: true, reservation: r });
  } catch (e) {
    return JSON.stringify({ ok: false, status: e.status, code: e.code, name: e.name });
  }
})()`;

function check(answers, what) {
  const admitted = answers.filter((a) => a.ok).map((a) => a.reservation);
  for (const a of answers.filter((a) => !a.ok)) {
    assert.deepEqual([a.name, a.status, a.code], ["TollgateError", 429, "budget_limit"], what);
  }
  assert.ok(admitted.length > 0 && admitted.length < 10, `${what}: ${admitted.length} admitted`);
  assert.equal(admitted.length, fitting(admitted[0]), what);
  return admitted;
}

test("ten Edge Runtime instances reserve against one budget", async () => {
  const key = env("TOLLGATE_EDGE_KEY");
  const vms = Array.from({ length: 10 }, () => {
    const vm = new EdgeRuntime();
    vm.evaluate(asScript(dist));
    return vm;
  });
  const answers = await Promise.all(vms.map(async (vm) => JSON.parse(await vm.evaluate(reserveOnce(GATEWAY(), key)))));
  const admitted = check(answers, "edge-runtime");
  const b = await budget(key);
  assert.ok(b.used + b.reserved <= b.limit, JSON.stringify(b));
  assert.equal(b.reserved, admitted.reduce((s, a) => s + a.reserved_micro_usd, 0));
});

test("a Cloudflare worker reserves, settles and releases against one budget", async () => {
  const key = env("TOLLGATE_WORKER_KEY");
  const worker = `
    import { Tollgate } from "./index.js";
    export default {
      async fetch(request, env) {
        const t = new Tollgate({ baseUrl: env.GATEWAY, apiKey: env.KEY });
        const url = new URL(request.url);
        if (url.pathname === "/settle") {
          const { id, usage } = await request.json();
          return Response.json(await t.settle(id, usage));
        }
        return new Response(await ${reserveOnce("GATEWAY_PLACEHOLDER", "KEY_PLACEHOLDER")
          .replace('"GATEWAY_PLACEHOLDER"', "env.GATEWAY")
          .replace('"KEY_PLACEHOLDER"', "env.KEY")});
      },
    };`;
  const mf = new Miniflare({
    modules: [
      { type: "ESModule", path: "worker.mjs", contents: worker },
      { type: "ESModule", path: "index.js", contents: dist },
    ],
    bindings: { GATEWAY: GATEWAY(), KEY: key },
    compatibilityDate: "2024-09-23",
  });
  try {
    const answers = await Promise.all(
      Array.from({ length: 10 }, async () => JSON.parse(await (await mf.dispatchFetch("http://worker/")).text())),
    );
    const admitted = check(answers, "workerd");
    const settled = await (
      await mf.dispatchFetch("http://worker/settle", {
        method: "POST",
        body: JSON.stringify({ id: admitted[0].id, usage: { prompt_tokens: 20, completion_tokens: 30 } }),
      })
    ).json();
    assert.equal(settled.status, "settled", JSON.stringify(settled));
    const b = await budget(key);
    assert.ok(b.used > 0 && b.used + b.reserved <= b.limit, JSON.stringify(b));
  } finally {
    await mf.dispose();
  }
});
