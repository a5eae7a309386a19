// What the Rust driver (crates/cli/tests/ts_client.rs) passes: a gateway serving reservations,
// the simulated provider behind it, and one key per test tenant, each with a $0.05 daily budget.
import assert from "node:assert/strict";

export function env(name) {
  const v = process.env[name];
  assert.ok(v, `${name} is not set: run these tests through cargo (crates/cli/tests/ts_client.rs)`);
  return v;
}

export const GATEWAY = () => env("TOLLGATE_URL");
export const PROVIDER = () => env("TOLLGATE_SIM_URL");
export const SIM_KEY = () => env("TOLLGATE_SIM_KEY");

/** The chat body every budget test reserves for: one reservation costs about $0.01. */
export function body() {
  return {
    model: "gpt-4o",
    max_tokens: 1000,
    messages: [{ role: "user", content: "Write a haiku about tollgates." }],
  };
}

/** A tenant's money budget as its own key reads it: { limit, used, reserved } in micro-USD. */
export async function budget(key) {
  const r = await fetch(`${GATEWAY()}/v1/limits`, { headers: { authorization: `Bearer ${key}` } });
  const v = await r.json();
  assert.equal(r.status, 200, JSON.stringify(v));
  const row = v.limits.find((l) => l.control === "budget");
  assert.ok(row, JSON.stringify(v));
  return { limit: row.limit, used: row.used, reserved: row.reserved };
}

/** How many of ten reservations fit the $0.05 budget, from one answer's reserved amount. */
export function fitting(reservation) {
  assert.ok(reservation.reserved_micro_usd > 0, JSON.stringify(reservation));
  return Math.min(10, Math.floor(50_000 / reservation.reserved_micro_usd));
}
