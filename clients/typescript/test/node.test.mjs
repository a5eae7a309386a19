// The client in Node against the real gateway: reservations race as proxied requests do, and
// withBudget wraps the official OpenAI and Anthropic SDKs' calls, streams included.
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";
import { Tollgate, TollgateError } from "../dist/index.js";
import { GATEWAY, PROVIDER, SIM_KEY, body, budget, env, fitting } from "./env.mjs";

test("ten reservations at once admit exactly what fits, as ten proxied requests do", async () => {
  const proxied = await Promise.all(
    Array.from({ length: 10 }, () =>
      fetch(`${GATEWAY()}/v1/chat/completions`, {
        method: "POST",
        headers: { authorization: `Bearer ${env("TOLLGATE_PROXY_KEY")}`, "content-type": "application/json" },
        body: JSON.stringify(body()),
      }).then(async (r) => ({ status: r.status, body: await r.json() })),
    ),
  );
  const key = env("TOLLGATE_NODE_KEY");
  // Ten clients, as ten stateless instances would be.
  const answers = await Promise.allSettled(
    Array.from({ length: 10 }, () => new Tollgate({ baseUrl: GATEWAY(), apiKey: key }).reserve("/v1/chat/completions", body())),
  );
  const admitted = answers.filter((a) => a.status === "fulfilled").map((a) => a.value);
  for (const a of answers.filter((a) => a.status === "rejected")) {
    assert.ok(a.reason instanceof TollgateError, String(a.reason));
    assert.equal(a.reason.status, 429);
    assert.equal(a.reason.code, "budget_limit");
    assert.equal(a.reason.shouldRetry, false);
  }
  assert.ok(admitted.length > 0 && admitted.length < 10, `${admitted.length} admitted`);
  assert.equal(admitted.length, fitting(admitted[0]));
  assert.equal(admitted.length, proxied.filter((p) => p.status === 200).length, JSON.stringify(proxied.map((p) => p.status)));
  const b = await budget(key);
  assert.ok(b.used + b.reserved <= b.limit, JSON.stringify(b));
  assert.equal(b.reserved, admitted.reduce((s, a) => s + a.reserved_micro_usd, 0));
  const client = new Tollgate({ baseUrl: GATEWAY(), apiKey: key });
  for (const a of admitted) assert.equal((await client.release(a.id)).status, "released");
  assert.deepEqual(await budget(key), { ...b, reserved: 0 });
});

test("withBudget settles an OpenAI SDK call, whole and streamed, and releases on a throw", async () => {
  const key = env("TOLLGATE_SDK_KEY");
  const tollgate = new Tollgate({ baseUrl: GATEWAY(), apiKey: key });
  const openai = new OpenAI({ baseURL: `${PROVIDER()}/v1`, apiKey: SIM_KEY() });
  const small = { ...body(), max_tokens: 50 };

  const whole = await tollgate.withBudget("/v1/chat/completions", small, (b) => openai.chat.completions.create(b));
  assert.ok(whole.usage.total_tokens > 0);
  let b = await budget(key);
  assert.equal(b.reserved, 0, JSON.stringify(b));
  assert.ok(b.used > 0);

  const stream = await tollgate.withBudget("/v1/chat/completions", { ...small, stream: true }, (b) => {
    assert.deepEqual(b.stream_options, { include_usage: true }, "the body to send asks for usage");
    return openai.chat.completions.create(b);
  });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  assert.ok(text.length > 0);
  const after = await budget(key);
  assert.equal(after.reserved, 0, "settled at the stream's end");
  assert.ok(after.used > b.used);

  await assert.rejects(
    tollgate.withBudget("/v1/chat/completions", small, async () => {
      throw new Error("the provider was not called");
    }),
    /not called/,
  );
  assert.deepEqual(await budget(key), after, "released: nothing held, nothing charged");
});

test("withBudget settles an Anthropic SDK stream from its events", async () => {
  const key = env("TOLLGATE_SDK_KEY");
  const tollgate = new Tollgate({ baseUrl: GATEWAY(), apiKey: key });
  const anthropic = new Anthropic({ baseURL: PROVIDER(), apiKey: SIM_KEY() });
  const before = await budget(key);
  const ask = {
    model: "claude-sonnet-4",
    max_tokens: 50,
    stream: true,
    messages: [{ role: "user", content: "Write a haiku about tollgates." }],
  };
  const stream = await tollgate.withBudget("/v1/messages", ask, (b) => anthropic.messages.create(b));
  let events = 0;
  for await (const _ of stream) events++;
  assert.ok(events > 2);
  const after = await budget(key);
  assert.equal(after.reserved, 0, JSON.stringify(after));
  assert.ok(after.used > before.used);
});

test("counts stated instead of a body are reserved as stated", async () => {
  const key = env("TOLLGATE_SDK_KEY");
  const tollgate = new Tollgate({ baseUrl: GATEWAY(), apiKey: key });
  const before = await budget(key);
  const r = await tollgate.reserveCounts("/v1/chat/completions", {
    model: "gpt-4o",
    input_tokens: 1200,
    max_output_tokens: 300,
  });
  assert.equal(r.reserved_tokens, 1500);
  assert.equal(r.body, null);
  assert.equal((await budget(key)).reserved, before.reserved + r.reserved_micro_usd);
  const ended = await tollgate.settle(r.id, { prompt_tokens: 1200, completion_tokens: 40 });
  assert.equal(ended.status, "settled");
  assert.equal((await budget(key)).reserved, before.reserved);
});

test("a refusal is a TollgateError with the gateway's code", async () => {
  const tollgate = new Tollgate({ baseUrl: GATEWAY(), apiKey: env("TOLLGATE_SDK_KEY") });
  await assert.rejects(tollgate.reserve("/v1/chat/completions", { ...body(), surprise: 1 }), (e) => {
    assert.ok(e instanceof TollgateError);
    assert.equal(e.status, 400);
    assert.equal(e.code, "unknown_parameter");
    return true;
  });
  await assert.rejects(tollgate.settle("res_nope", { prompt_tokens: 1 }), (e) => e.status === 404);
  assert.throws(() => new Tollgate({ baseUrl: "", apiKey: "k" }), TypeError);
});
